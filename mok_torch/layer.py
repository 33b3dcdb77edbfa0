"""The layer for torch tensors: ``mok_comm.layer.Layer`` with torch in and out, zero-copy.

    layer = mok_torch.Layer(shape, tokens_per_rank, config)          # NVSHMEM when EP > 1
    out, ctx = layer.forward(x, topk_ids, router_weights, weights)   # one step
    grads = layer.backward(ctx, d_out, router_weights, weights)      # its gradients
    step = layer.compile(weights)                                    # the CUDA-graph fast path

Tensors are checked here for what only torch knows (type, device, contiguity) and handed to
``mok_comm.functional`` as zero-copy views (bf16 as its uint16 bits), which checks shapes and
dtypes once. Kernels run on ``torch.cuda.current_stream()``; nothing synchronises with the host,
so a step can be captured in a ``torch.cuda.CUDAGraph`` (``compile`` does it). Under the CUDA
simulator the same code takes CPU tensors (tests).
"""
from __future__ import annotations

import numpy as np
import torch

from mok_comm import backward as B
from mok_comm import functional as F
from mok_comm import layer as L
from mok_comm.heap import LocalHeap, NvshmemHeap
from mok_core.config import LayerShape, MoKConfig
from mok_core.cuda_compat import SIM, names_rank

Weights = L.Weights
WeightsFP8 = L.WeightsFP8
Grads = B.Grads


def current_stream():
    """torch's current stream as a numba stream (0 on the simulator)."""
    if SIM:
        return 0
    from numba import cuda
    return cuda.external_stream(torch.cuda.current_stream().cuda_stream)


def tensor_view(t, name, dtypes=(torch.bfloat16,), *, manual=True):
    """``t`` after torch-side checks (a tensor of one of ``dtypes``, on this process's device,
    contiguous; for the manual API (``manual``) not requiring grad); bf16 as its uint16 bits.
    Shapes are checked by ``mok_comm.functional``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{name}: expected dtype {want}, got {t.dtype}")
    if manual and t.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{name}: requires_grad=True, but layer.forward / layer.backward are "
                         "the manual API and record no autograd graph: call layer(...), "
                         "mok_torch.moe(...) or use mok_torch.MoEBlock for autograd, or pass "
                         "detached tensors")
    want = "cpu" if SIM else "cuda"
    if t.device.type != want:
        raise ValueError(f"{name}: expected a {want} tensor, got one on {t.device}")
    if not SIM and t.device.index != torch.cuda.current_device():
        raise ValueError(f"{name}: tensor on {t.device} but the current device is "
                         f"cuda:{torch.cuda.current_device()}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous")
    t = t.detach()                      # (the same storage; DLPack exports no autograd tensor)
    return t.view(torch.uint16) if t.dtype == torch.bfloat16 else t


def dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous and 16-byte aligned, copied only where it is not: what autograd hands
    the op (a narrowed d_out, a slice of x) need be neither, and torch calls a [1, H] column
    slice contiguous though it starts mid-row."""
    if t.is_contiguous() and t.data_ptr() % 16 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def weight_views(layer: L.Layer, weights, *, manual=True):
    """``Weights`` of ``tensor_view``s (the shared ones None when the shape has none); a
    ``WeightsFP8`` (7: its ``fp8`` an ``FP8Weights`` of uint8 / float32 tensors,
    ``quantize_weights``) the same way. Counts are checked by ``mok_comm.functional``."""
    if len(weights) not in (6, 7):
        raise TypeError(f"weights: expected 6 tensors ({', '.join(Weights._fields)}), or 7 "
                        f"(WeightsFP8), got {len(weights)}")
    shared = bool(layer.shape.shared_intermediate)
    views = [tensor_view(w, n, manual=manual) if shared or i >= 3 else None
             for i, (w, n) in enumerate(zip(weights[:6], Weights._fields))]
    if len(weights) == 6:
        return Weights(*views)
    fp8 = weights[6]
    if fp8 is not None and len(fp8) in (6, len(L.FP8Weights._fields)):
        fp8 = L.FP8Weights(*(None if t is None else
                             tensor_view(t, f"weights.fp8.{n}",
                                         (torch.float32,) if n.endswith("scale") else
                                         (torch.uint8,), manual=manual)
                             for t, n in zip(fp8, L.FP8Weights._fields)))
    return L.WeightsFP8(*views, fp8)


def quantize_weights(weights, out: L.FP8Weights | None = None, *,
                     backward: bool = True) -> L.FP8Weights:
    """The routed experts of ``weights`` (bf16 tensors) quantised for
    ``MoKConfig(precision="fp8")`` -- e4m3 with a float32 scale per 128 x 128 block, as torch
    tensors (``mok_comm.layer.FP8Weights``; with ``backward`` also the transposed copies the
    backward's data gradients read); once per optimizer step, into ``out`` when given. The
    layer takes ``WeightsFP8(*weights, quantize_weights(weights))``."""
    L.check_six_weights(weights)
    routed = [tensor_view(w, n, manual=False) for w, n in zip(weights[3:6], Weights._fields[3:6])]
    L.check_quantize_args(L.Weights(None, None, None, *routed), None, backward)
    if out is None:
        dtypes = {np.uint8: torch.uint8, np.float32: torch.float32}
        out = L.FP8Weights(*(torch.empty(shp, dtype=dtypes[dt], device=weights[3].device)
                             for dt, shp in L.fp8_shapes(*routed[0].shape, backward).values()))
    L.quantize_weights(L.Weights(None, None, None, *routed), backward=backward, out=out,
                       stream=current_stream())
    return L.FP8Weights(*out)


def inputs_key(x, topk_ids, router_weights, weights) -> tuple:
    """What identifies a step's inputs: address, geometry and version of each tensor -- equal
    keys mean the same memory, unmodified since, so the same values (the autograd node keeps
    its inputs alive, so their memory is not reused meanwhile); a tensor that keeps no version
    (made under ``torch.inference_mode``) matches no key."""
    fp8 = tuple(weights[6]) if len(weights) == 7 and weights[6] is not None else ()
    return tuple(None if t is None else (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype,
                                         _version(t))
                 for t in (x, topk_ids, router_weights, *weights[:6], *fp8))


def _version(t: torch.Tensor):
    """``t``'s version counter, or a value equal to nothing where it keeps none (a tensor made
    under ``torch.inference_mode``): a key holding it never matches, so what it guards is
    redone."""
    try:
        return t._version
    except RuntimeError:
        return object()


def _heap(shape: LayerShape):
    if shape.ep_size == 1:
        return LocalHeap(current_stream())
    from mok_comm.launch import bootstrap
    info = bootstrap.init("auto")
    if info.world_size != shape.ep_size:
        raise ValueError(f"LayerShape.ep_size={shape.ep_size} but {info.world_size} processes "
                         "are running (one EP rank per process)")
    return NvshmemHeap(current_stream())


class Layer(L.Layer):
    """``mok_comm.layer.Layer`` taking and returning torch tensors.

    EP = 1: local buffers, no NVSHMEM. EP > 1: NVSHMEM is initialised from the running
    torch.distributed group (or ``mok_comm.launch``'s environment) and every process is one EP
    rank; collective: all ranks construct alike. Arguments as ``mok_comm.layer.Layer``; ``heap``
    defaults as just said."""

    def __init__(self, shape: LayerShape, tokens_per_rank: int, config: MoKConfig = MoKConfig(),
                 *, gemm=None, gemm_down=None, swiglu_limit=None, heap=None,
                 backward: bool = True):
        L.check_layer_args(shape, tokens_per_rank, config, gemm, gemm_down, backward)
        super().__init__(shape, tokens_per_rank, config, heap=heap or _heap(shape), gemm=gemm,
                         gemm_down=gemm_down, swiglu_limit=swiglu_limit, backward=backward,
                         stream=current_stream())
        self._fp8 = None                  # the routed experts quantised (FP8Weights), the
        self._fp8_from = ()               # tensors they came from (held: no address reuse)
        self._fp8_state = ()              # and those tensors' (address, version) then
        self.fp8_quantizations = 0

    def with_fp8(self, weights):
        """``weights`` as the layer reads them: a ``MoKConfig(precision="fp8")`` layer given
        the six bf16 ``Weights`` gets them with its own quantised copies (``WeightsFP8``),
        quantised again only when a routed weight changed -- another tensor or storage, or
        an in-place update such as an optimizer step (torch's version counter) -- so once per
        optimizer step however many micro-batches, forwards and backwards read them, into
        the same arrays (a captured step reads them there). Anything else: ``weights``
        unchanged."""
        if self.config.precision != "fp8" or len(weights) != 6:
            return weights
        routed = tuple(weights[3:6])
        state = tuple((t.data_ptr(), _version(t)) if isinstance(t, torch.Tensor) else None
                      for t in routed)
        same = len(self._fp8_from) == 3 and all(a is b for a, b in zip(routed, self._fp8_from))
        if not (same and state == self._fp8_state):
            self._fp8 = quantize_weights(weights, self._fp8, backward=self.grad is not None)
            self._fp8_from, self._fp8_state = routed, state
            self.fp8_quantizations += 1
        return L.WeightsFP8(*weights, self._fp8)

    @names_rank
    def forward(self, x, topk_ids, router_weights, weights, *, manual: bool = True):
        """One step: x [T, H] bf16, topk_ids [T, k] int64 or int32 (-1 = masked route),
        router_weights [T, k] float32, ``weights`` (``Weights``: bf16, this rank's experts).
        T may differ per call and per rank, 0 <= T <= tokens_per_rank (T_max).
        Returns (out [T, H] bf16 -- a fresh tensor, ForwardContext). The manual API: tensors
        requiring grad are refused (``manual=False``: the autograd op's own call)."""
        xb = tensor_view(x, "x", manual=manual)
        out = torch.empty((F.step_tokens(self, xb), self.shape.hidden), dtype=torch.bfloat16,
                          device=xb.device)
        self.step_key = None                    # the buffers change: no step's context now
        F.forward(self, xb, tensor_view(topk_ids, "topk_ids", (torch.int64, torch.int32)),
                  tensor_view(router_weights, "router_weights", (torch.float32,),
                              manual=manual),
                  weight_views(self, self.with_fp8(weights), manual=manual),
                  out=out.view(torch.uint16), stream=current_stream())
        self.step_key = inputs_key(x, topk_ids, router_weights, weights)
        return out, self.context()

    @names_rank
    def recompute_context(self, x, topk_ids, router_weights, weights):
        """The ``ForwardContext`` of the step these inputs made, rebuilt bit for bit
        (``mok_comm.functional.recompute_forward_context``: activation checkpointing, or a
        backward after another step of this layer)."""
        self.step_key = None
        ctx = F.recompute_forward_context(
            self, tensor_view(x, "x", manual=False),
            tensor_view(topk_ids, "topk_ids", (torch.int64, torch.int32)),
            tensor_view(router_weights, "router_weights", (torch.float32,), manual=False),
            weight_views(self, self.with_fp8(weights), manual=False), stream=current_stream())
        self.step_key = inputs_key(x, topk_ids, router_weights, weights)
        return ctx

    def context_for(self, x, topk_ids, router_weights, weights):
        """The ``ForwardContext`` of the step these inputs made: the layer's own when its last
        step was that one, else recomputed (``recompute_context``). Every rank calls the
        layer in the same order, so every rank decides alike (the recompute is collective)."""
        if getattr(self, "step_key", None) == inputs_key(x, topk_ids, router_weights, weights):
            return self.context()
        return self.recompute_context(x, topk_ids, router_weights, weights)

    @names_rank
    def backward(self, ctx, d_out, router_weights, weights, *, grads=None,
                 accumulate: bool = False, manual: bool = True) -> Grads:
        """The gradients of the step ``ctx`` came from (``mok_comm.backward.backward``): d_out
        [T, H] bf16, the step's router weights and ``weights``. Returns ``Grads`` of fresh
        tensors (bf16; d_router_weights float32), or fills ``grads`` (a ``Grads`` of the
        caller's tensors: bf16, or float32 weight gradients, which ``accumulate`` adds into)."""
        B.check_context(self, ctx)
        T, H, k = ctx.tokens, self.shape.hidden, self.shape.topk
        d_out = tensor_view(d_out, "d_out", manual=manual)
        B.check_grads_given(grads, accumulate)
        if grads is None:
            dev, bf = d_out.device, torch.bfloat16
            shapes = B._grad_shapes(self)
            shared = bool(self.shape.shared_intermediate)
            grads = Grads(torch.empty((T, H), dtype=bf, device=dev),
                          torch.empty((T, k), dtype=torch.float32, device=dev),
                          *(torch.empty(shp, dtype=bf, device=dev) if shared or i >= 3
                            else None for i, shp in enumerate(shapes)))
        views = Grads(*(None if g is None else
                        tensor_view(g, f"grads.{n}", (torch.bfloat16, torch.float32))
                        for g, n in zip(grads, Grads._fields)))
        B.backward(self, ctx, d_out, tensor_view(router_weights, "router_weights",
                                                 (torch.float32,), manual=manual),
                   weight_views(self, self.with_fp8(weights), manual=manual), grads=views,
                   accumulate=accumulate, stream=current_stream())
        return Grads(*grads)

    def __call__(self, x, topk_ids, router_weights, weights) -> torch.Tensor:
        """out [T, H]; with grad enabled and an input requiring grad, through autograd
        (``mok_torch.moe``), else the step alone."""
        if torch.is_grad_enabled() and any(
                isinstance(t, torch.Tensor) and t.requires_grad
                for t in (x, router_weights, *weights)):
            from .op import moe
            return moe(self, x, topk_ids, router_weights, weights)
        return self.forward(x, topk_ids, router_weights, weights)[0]

    def compile(self, weights) -> "CompiledStep":
        """The step as a CUDA graph with fresh x / ids / router weights every call
        (``mok_torch.graphed``); bit for bit the eager step."""
        from .graphed import CompiledStep
        return CompiledStep(self, weights)


__all__ = ["Grads", "Layer", "Weights", "WeightsFP8", "current_stream", "dense", "inputs_key",
           "quantize_weights", "tensor_view", "weight_views"]
