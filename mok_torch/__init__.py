"""PyTorch adapter: torch tensors in and out of MoK-Py's functional layer, zero-copy (DLPack /
CUDA array interface), kernels launched on torch's current stream.

    import mok_torch
    lw = mok_torch.get_workspace(shape, tokens_per_rank, config)        # NVSHMEM if EP > 1
    sched = mok_torch.build_schedule(lw, topk_ids)                      # int64 or int32 [T, k]
    out, ctx = mok_torch.forward(config, lw, sched, x, router_weights,
                                 w_shared_gate, w_shared_up, w_shared_down,
                                 w_gate, w_up, w_down, swiglu_limit=None)

The fast path (training loops): the same step captured as a CUDA graph once, with new x / ids /
router-weight tensors every call (see ``mok_torch.graphed``):

    step = mok_torch.compile_step(config, lw, w_shared_gate, w_shared_up, w_shared_down,
                                  w_gate, w_up, w_down, swiglu_limit=None)
    out = step(x, topk_ids, router_weights)           # == forward's out, bit for bit

For ``torch.compile`` (one opaque node; see ``mok_torch.op``):

    layer = mok_torch.register_layer(config, lw)
    out = torch.ops.mok.moe_forward(x, topk_ids, router_weights, w_shared_gate, w_shared_up,
                                    w_shared_down, w_gate, w_up, w_down, layer, swiglu_limit)
"""
from .functional import build_schedule, forward, get_workspace
from .graphed import LayerStep, compile_step
from .op import moe_forward, register_layer, unregister_layer

__all__ = ["LayerStep", "build_schedule", "compile_step", "forward", "get_workspace",
           "moe_forward", "register_layer", "unregister_layer"]
