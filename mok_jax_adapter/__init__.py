"""JAX adapter: the MoE layer on ``jax.Array``s, zero-copy, inside ``jax.jit``, differentiable.

    layer = mok_jax_adapter.Layer(shape, tokens_per_rank, config)
    out = jax.jit(layer)(x, topk_ids, router_weights, mok_jax_adapter.Weights(...))
    jax.grad(loss, argnums=(0, 2, 3))(x, topk_ids, router_weights, weights)   # through layer

One ``jax.experimental.buffer_callback`` per step runs the layer's kernels on XLA's stream over
XLA's own buffers; the step is a ``jax.custom_vjp`` whose backward is another buffer callback
(``mok_comm.backward``). ``MoKConfig(precision="fp8")``: ``WeightsFP8(*weights,
quantize_weights(weights))``. ``layer``'s docstring: the contract and the limits.
"""
from .layer import FP8Weights, Layer, Weights, WeightsFP8, quantize_weights

__all__ = ["FP8Weights", "Layer", "Weights", "WeightsFP8", "quantize_weights"]
