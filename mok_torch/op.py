"""``torch.ops.mok.moe_forward``: the layer step (routing all-gather + schedule + forward) as
one torch custom op, so ``torch.compile`` and other graph tracers see one opaque node with a
known output instead of tracing into numba launches.

    handle = mok_torch.register_layer(layer)          # an int handle for the mok_torch.Layer
    out = torch.ops.mok.moe_forward(x, topk_ids, router_weights,
                                    w_shared_gate, w_shared_up, w_shared_down,
                                    w_gate, w_up, w_down, handle)

Contract: the same tensors and shapes as ``mok_torch.Layer.forward`` (docstring there), ``out``
a fresh [T, H] bf16 tensor, bit for bit the layer's step; every input is checked before the
first launch. Custom ops take tensors and scalars only, hence the handle: the layer stays in a
registry here (``unregister_layer`` drops it). The op's hidden effect --
the workspace, and at EP > 1 the other ranks -- is outside torch's view: the op is declared
functional, so a compiler may drop a call whose output is unused -- use the output (at EP > 1
every rank must run the layer alike: the ranks' fingerprints are compared on the device, as in
eager). No autograd yet (the backward comes with its own issue): no autograd formula is
registered, so a backward through the op raises.
"""
from __future__ import annotations

import itertools
import torch

from .layer import Layer

_LAYERS: dict = {}                       # handle -> mok_torch.Layer
_HANDLES = itertools.count(1)


def register_layer(layer: Layer) -> int:
    """Make ``layer`` callable from ``torch.ops.mok.moe_forward``; returns its handle."""
    if not isinstance(layer, Layer):
        raise TypeError(f"layer: expected a mok_torch.Layer, got {type(layer).__name__}")
    handle = next(_HANDLES)
    _LAYERS[handle] = layer
    return handle


def unregister_layer(handle: int) -> None:
    _LAYERS.pop(handle, None)


def _layer(handle: int):
    try:
        return _LAYERS[int(handle)]     # (a SymInt under torch.compile: pinned to its value)
    except KeyError:
        raise ValueError(f"layer={handle}: no such layer (mok_torch.register_layer returns the "
                         "handle; unregister_layer drops it)") from None


@torch.library.custom_op("mok::moe_forward", mutates_args=())
def moe_forward(x: torch.Tensor, topk_ids: torch.Tensor, router_weights: torch.Tensor,
                w_shared_gate: torch.Tensor, w_shared_up: torch.Tensor,
                w_shared_down: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                w_down: torch.Tensor, layer: int) -> torch.Tensor:
    return _layer(layer)(x, topk_ids, router_weights,
                         (w_shared_gate, w_shared_up, w_shared_down, w_gate, w_up, w_down))


@moe_forward.register_fake
def _moe_forward_fake(x, topk_ids, router_weights, w_shared_gate, w_shared_up, w_shared_down,
                      w_gate, w_up, w_down, layer):
    lw = _layer(layer)
    T, H = lw.tokens_per_rank, lw.shape.hidden
    if tuple(x.shape) != (T, H) or x.dtype != torch.bfloat16:
        raise ValueError(f"x: expected a [{T}, {H}] bf16 tensor, got {x.dtype} "
                         f"{list(x.shape)}")
    return x.new_empty((T, H))
