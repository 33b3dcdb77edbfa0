"""Thin torch wrapper over ``mok_comm.functional`` (see its docstring for the algorithm).

Tensors are checked (dtype, device, contiguity) and handed over as zero-copy views: bf16 as its
uint16 bits, int64 ids converted to int32 on the device. Kernels run on
``torch.cuda.current_stream()``; nothing synchronises with the host, so ``build_schedule`` +
``forward`` can be captured in a ``torch.cuda.CUDAGraph`` (warm up once first: compilation and
module loading must not happen during capture). Under the CUDA simulator the same code takes
CPU tensors (tests).
"""
from __future__ import annotations

import torch

from mok_comm import functional as F
from mok_comm.heap import LocalHeap, NvshmemHeap
from mok_core.config import LayerShape, MoKConfig
from mok_core.cuda_compat import SIM
from mok_core.gemm import GemmConfig


def _stream():
    if SIM:
        return 0
    from numba import cuda
    return cuda.external_stream(torch.cuda.current_stream().cuda_stream)


def _check(t, name, dtype):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    want = "cpu" if SIM else "cuda"
    if t.device.type != want:
        raise ValueError(f"{name}: expected a {want} tensor, got one on {t.device}")
    if not SIM and t.device.index != torch.cuda.current_device():
        raise ValueError(f"{name}: tensor on {t.device} but the current device is "
                         f"cuda:{torch.cuda.current_device()}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous")
    return t.detach()


def _bits(t, name):
    return _check(t, name, torch.bfloat16).view(torch.uint16)


def get_workspace(shape: LayerShape, tokens_per_rank: int, config: MoKConfig = MoKConfig(), *,
                  gemm: GemmConfig | None = None, gemm_down: GemmConfig | None = None,
                  heap=None) -> F.LayerWorkspace:
    """Layer workspace for this rank. EP = 1: local buffers, no NVSHMEM. EP > 1: NVSHMEM is
    initialised from the running torch.distributed group (or ``mok_comm.launch``'s environment)
    and every rank of the world is one EP rank. Collective: all ranks call it alike.
    ``gemm`` / ``gemm_down``: tiles of the gate/up and of the down GEMMs (``gemm_down``
    defaults to ``gemm``; see ``mok_comm.functional.get_workspace``)."""
    if heap is None:
        if shape.ep_size == 1:
            heap = LocalHeap(_stream())
        else:
            from mok_comm import bootstrap
            info = bootstrap.init("auto")
            if info.world_size != shape.ep_size:
                raise ValueError(f"shape.ep_size={shape.ep_size} but {info.world_size} processes "
                                 "are running (one EP rank per process)")
            heap = NvshmemHeap(_stream())
    return F.get_workspace(shape, tokens_per_rank, config, heap=heap, gemm=gemm,
                           gemm_down=gemm_down, stream=_stream())


def _ids(topk_ids):
    if not isinstance(topk_ids, torch.Tensor):
        raise TypeError(f"topk_ids: expected a torch.Tensor, got {type(topk_ids).__name__}")
    if topk_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"topk_ids: expected dtype torch.int64 or torch.int32, got "
                        f"{topk_ids.dtype}")
    return _check(topk_ids, "topk_ids", topk_ids.dtype)


def build_schedule(lw: F.LayerWorkspace, topk_ids: torch.Tensor):
    """Routing all-gather + schedule. topk_ids: int64 or int32 [T, k], -1 = masked route."""
    return F.build_schedule(lw, _ids(topk_ids), stream=_stream())


def forward(config: MoKConfig, lw: F.LayerWorkspace, schedule, x, router_weights,
            w_shared_gate, w_shared_up, w_shared_down, w_gate, w_up, w_down,
            swiglu_limit=None):
    """MoE layer forward. Shapes: x [T, H] bf16, router_weights [T, k] float32, shared weights
    [I_s, H] / [I_s, H] / [H, I_s] bf16, routed [E_local, I, H] / [E_local, I, H] /
    [E_local, H, I] bf16 (this rank's experts). Returns (out [T, H] bf16 -- a fresh tensor,
    ForwardContext)."""
    out, args = _layer_args(lw, x, router_weights, w_shared_gate, w_shared_up, w_shared_down,
                            w_gate, w_up, w_down)
    _, ctx = F.forward(config, lw, schedule, *args, swiglu_limit, out=out.view(torch.uint16),
                       stream=_stream())
    return out, ctx


def _layer_args(lw, x, router_weights, w_shared_gate, w_shared_up, w_shared_down, w_gate, w_up,
                w_down):
    """(a fresh bf16 out [T, H], the checked views of x, router_weights and the six weights
    in ``mok_comm.functional``'s order; shared ones None when I_s = 0)."""
    T, H = lw.tokens_per_rank, lw.shape.hidden
    xb = _bits(x, "x")
    out = torch.empty((T, H), dtype=torch.bfloat16, device=xb.device)
    I_s = lw.shape.shared_intermediate
    shared = [(_bits(w, n) if I_s else None) for w, n in
              ((w_shared_gate, "w_shared_gate"), (w_shared_up, "w_shared_up"),
               (w_shared_down, "w_shared_down"))]
    return out, (xb, _check(router_weights, "router_weights", torch.float32), *shared,
                 _bits(w_gate, "w_gate"), _bits(w_up, "w_up"), _bits(w_down, "w_down"))


def step(config: MoKConfig, lw: F.LayerWorkspace, topk_ids, x, router_weights, w_shared_gate,
         w_shared_up, w_shared_down, w_gate, w_up, w_down, swiglu_limit=None):
    """``build_schedule`` + ``forward`` in one call with every input checked before the first
    launch (``mok_comm.functional.step``); returns out [T, H] bf16 (a fresh tensor), bit for
    bit ``forward``'s. What ``torch.ops.mok.moe_forward`` runs."""
    out, args = _layer_args(lw, x, router_weights, w_shared_gate, w_shared_up, w_shared_down,
                            w_gate, w_up, w_down)
    F.step(config, lw, _ids(topk_ids), *args, swiglu_limit, out=out.view(torch.uint16), stream=_stream())
    return out
