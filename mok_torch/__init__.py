"""PyTorch adapter: torch tensors in and out of MoK-Py's layer, zero-copy (DLPack / CUDA array
interface), kernels launched on torch's current stream.

    import mok_torch
    layer = mok_torch.Layer(shape, tokens_per_rank, config)             # NVSHMEM if EP > 1
    weights = mok_torch.Weights(w_shared_gate, w_shared_up, w_shared_down, w_gate, w_up, w_down)
    out = layer(x, topk_ids, router_weights, weights)                   # one step
    out, ctx = layer.forward(x, topk_ids, router_weights, weights)      # ... and its context
    grads = layer.backward(ctx, d_out, router_weights, weights)         # mok_torch.Grads
    step = layer.compile(weights)                                       # CUDA-graph fast path
    out = step(x, topk_ids, router_weights)                             # == the eager step

Autograd and ``torch.compile``: the step and its backward are custom ops (``mok_torch.op``):

    out = mok_torch.moe(layer, x, topk_ids, router_weights, weights)   # differentiable
    block = mok_torch.MoEBlock(hidden, intermediate, shared_intermediate, num_experts, topk,
                               max_tokens=4096)                         # router + experts
"""
from .graphed import CompiledStep
from .layer import Grads, Layer, Weights, WeightsFP8, quantize_weights
from .module import MoEBlock, Router
from .op import moe, moe_backward, moe_forward, register_layer, unregister_layer

__all__ = ["CompiledStep", "Grads", "Layer", "MoEBlock", "Router", "Weights", "moe", "moe_backward", "moe_forward",
           "WeightsFP8", "quantize_weights", "register_layer", "unregister_layer"]
