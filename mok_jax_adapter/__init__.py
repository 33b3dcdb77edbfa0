"""JAX adapter: the MoE layer on ``jax.Array``s, zero-copy, inside ``jax.jit``.

    layer = mok_jax_adapter.Layer(shape, tokens_per_rank, config)
    out = jax.jit(layer)(x, topk_ids, router_weights, mok_jax_adapter.Weights(...))

One ``jax.experimental.buffer_callback`` per step runs the layer's kernels on XLA's stream over
XLA's own buffers (``layer``'s docstring: the contract and the limits -- no autodiff yet).
"""
from .layer import Layer, Weights

__all__ = ["Layer", "Weights"]
