"""JAX adapter: the MoE layer forward on ``jax.Array``s, zero-copy, inside ``jax.jit``.

    lw = mok_jax_adapter.get_workspace(shape, tokens_per_rank, config)
    out = jax.jit(lambda *a: mok_jax_adapter.forward(config, lw, *a))(
        x, topk_ids, router_weights, w_shared_gate, w_shared_up, w_shared_down,
        w_gate, w_up, w_down)

One ``jax.experimental.buffer_callback`` per step runs the layer's kernels on XLA's stream over
XLA's own buffers (``functional``'s docstring: the contract and the limits -- no autodiff yet).
"""
from .functional import check, forward, get_workspace

__all__ = ["check", "forward", "get_workspace"]
