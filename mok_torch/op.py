"""The layer as torch custom ops with autograd: ``torch.ops.mok.moe_forward`` (the step) and
``torch.ops.mok.moe_backward`` (its gradients), so ``torch.compile(fullgraph=True)`` traces
forward and backward as two opaque nodes with known outputs instead of tracing into numba.

    out = mok_torch.moe(layer, x, topk_ids, router_weights, weights)    # differentiable
    out.float().square().sum().backward()       # x.grad, router_weights.grad, weight .grads

    handle = mok_torch.register_layer(layer)    # what the ops take (custom ops take tensors
    out = torch.ops.mok.moe_forward(x, topk_ids, router_weights,      # and scalars only)
                                    w_shared_gate, w_shared_up, w_shared_down,
                                    w_gate, w_up, w_down, handle)

Contract: the tensors and shapes of ``mok_torch.Layer.forward`` (docstring there; the shared
weights None when the shape has none), ``out`` a fresh [T, H] bf16 tensor, bit for bit the
layer's step; every input is checked before the first launch. Gradients flow to x,
router_weights (so to a router) and the six weights, bit for bit ``Layer.backward``'s; topk_ids
gets none. Weight gradients are bf16, added into ``.grad`` by autograd as for any parameter.

The backward's context: the layer's buffers hold the context of its last step only. The backward
op uses it when that step was made by this node's saved inputs (``Layer.context_for``: same
live tensors, same versions), else it first recomputes it from them
(``recompute_forward_context``, bit for bit) -- so two micro-batches through one layer before
their backwards, ``torch.utils.checkpoint`` regions and a retained graph all get the right
gradients; the recompute costs the forward without its down GEMMs. The decision depends only on
the order of calls, which every rank shares, so at EP > 1 every rank recomputes alike.

Side effects outside torch's view (the workspace, at EP > 1 the other ranks): the ops are
declared functional, so a compiler may drop a call whose output is unused -- use the outputs (at
EP > 1 every rank must run the layer alike: the ranks' fingerprints are compared on the device,
as in eager). The layers registry holds weak references: a layer lives as long as its owner
keeps it.
"""
from __future__ import annotations

import itertools
import weakref
from typing import Optional

import torch

from mok_comm import functional as F

from .layer import Layer, Weights, dense

_LAYERS: dict = {}                       # handle -> weakref to a mok_torch.Layer
_HANDLES = itertools.count(1)


def register_layer(layer: Layer) -> int:
    """Make ``layer`` callable from the ops; returns its handle (one per layer: registering
    again returns the same)."""
    if not isinstance(layer, Layer):
        raise TypeError(f"layer: expected a mok_torch.Layer, got {type(layer).__name__}")
    handle = getattr(layer, "op_handle", None)
    if handle is None or handle not in _LAYERS:
        handle = next(_HANDLES)
        _LAYERS[handle] = weakref.ref(layer)
        layer.op_handle = handle
        weakref.finalize(layer, _LAYERS.pop, handle, None)
    return handle


def unregister_layer(handle: int) -> None:
    _LAYERS.pop(handle, None)


def _layer(handle: int) -> Layer:
    ref = _LAYERS.get(int(handle))      # (a SymInt under torch.compile: pinned to its value)
    layer = None if ref is None else ref()
    if layer is None:
        raise ValueError(f"layer={handle}: no such layer (mok_torch.register_layer returns the "
                         "handle; unregister_layer or the layer's deletion drops it)")
    return layer


def moe(layer: Layer, x, topk_ids, router_weights, weights) -> torch.Tensor:
    """The layer step, differentiable (module docstring): out [T, H] bf16."""
    return torch.ops.mok.moe_forward(x, topk_ids, router_weights, *weights,
                                     register_layer(layer))


@torch.library.custom_op("mok::moe_forward", mutates_args=())
def moe_forward(x: torch.Tensor, topk_ids: torch.Tensor, router_weights: torch.Tensor,
                w_shared_gate: Optional[torch.Tensor], w_shared_up: Optional[torch.Tensor],
                w_shared_down: Optional[torch.Tensor], w_gate: torch.Tensor, w_up: torch.Tensor,
                w_down: torch.Tensor, layer: int) -> torch.Tensor:
    # (dense here, where the tensors are real: torch.compile traces the caller)
    return _layer(layer).forward(dense(x), dense(topk_ids), dense(router_weights),
                                 (w_shared_gate, w_shared_up, w_shared_down, w_gate, w_up,
                                  w_down), manual=False)[0]


def _check_x(lw: Layer, x, name="x"):
    H = lw.shape.hidden
    if x.dim() != 2 or x.shape[1] != H or x.dtype != torch.bfloat16:
        raise ValueError(f"{name}: expected a [T, {H}] bf16 tensor, got {x.dtype} "
                         f"{list(x.shape)}")
    F.step_tokens(lw, x, name)                               # T <= T_max


@moe_forward.register_fake
def _moe_forward_fake(x, topk_ids, router_weights, w_shared_gate, w_shared_up, w_shared_down,
                      w_gate, w_up, w_down, layer):
    lw = _layer(layer)
    _check_x(lw, x)
    return x.new_empty((x.shape[0], lw.shape.hidden))


@torch.library.custom_op("mok::moe_backward", mutates_args=())
def moe_backward(d_out: torch.Tensor, x: torch.Tensor, topk_ids: torch.Tensor,
                 router_weights: torch.Tensor, w_shared_gate: Optional[torch.Tensor],
                 w_shared_up: Optional[torch.Tensor], w_shared_down: Optional[torch.Tensor],
                 w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                 layer: int) -> list[torch.Tensor]:
    """[d_x, d_router_weights, d_w_shared_gate, d_w_shared_up, d_w_shared_down, d_w_gate,
    d_w_up, d_w_down] (the shared ones empty when the shape has no shared expert)."""
    lw = _layer(layer)
    weights = Weights(w_shared_gate, w_shared_up, w_shared_down, w_gate, w_up, w_down)
    x, topk_ids, router_weights = dense(x), dense(topk_ids), dense(router_weights)
    ctx = lw.context_for(x, topk_ids, router_weights, weights)
    grads = lw.backward(ctx, dense(d_out), router_weights, weights, manual=False)
    return [d_out.new_empty((0,)) if g is None else g for g in grads]


@moe_backward.register_fake
def _moe_backward_fake(d_out, x, topk_ids, router_weights, w_shared_gate, w_shared_up,
                       w_shared_down, w_gate, w_up, w_down, layer):
    lw = _layer(layer)
    _check_x(lw, d_out, "d_out")
    T = x.shape[0]
    shared = [w.new_empty(w.shape) if w is not None else d_out.new_empty((0,))
              for w in (w_shared_gate, w_shared_up, w_shared_down)]
    return [x.new_empty(x.shape), router_weights.new_empty((T, lw.shape.topk)), *shared,
            w_gate.new_empty(w_gate.shape), w_up.new_empty(w_up.shape),
            w_down.new_empty(w_down.shape)]


def _setup_context(ctx, inputs, output):
    *tensors, layer = inputs
    ctx.layer = layer
    ctx.save_for_backward(*(t if t is not None else None for t in tensors))


def _backward(ctx, d_out):
    x, topk_ids, router_weights, *weights = ctx.saved_tensors
    grads = torch.ops.mok.moe_backward(d_out.to(torch.bfloat16), x, topk_ids, router_weights,
                                       *weights, ctx.layer)
    d_x, d_w, *d_weights = grads
    d_weights = [None if w is None else g for w, g in zip(weights, d_weights)]
    return (d_x, None, d_w, *d_weights, None)


moe_forward.register_autograd(_backward, setup_context=_setup_context)
