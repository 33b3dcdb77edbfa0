"""The MoE layer on one expert-parallel rank: one object that owns its config, buffers and
schedule.

    layer = Layer(shape, tokens_per_rank, config, heap=heap)    # once (collective at EP > 1)
    weights = Weights(w_shared_gate, w_shared_up, w_shared_down, w_gate, w_up, w_down)
    out = layer(x, topk_ids, router_weights, weights)            # one step, nothing syncs
    layer.check()                                                # device-side errors, syncs

A step is ``mok_comm.functional.forward``: four phases separated by device-side barriers (the
phases and their ordering duties are documented there). Everything the step needs lives here,
allocated once from shapes alone, so a step launches kernels and nothing else.

Tokens: ``tokens_per_rank`` is T_max, what the buffers hold; each step may bring any
0 <= T <= T_max tokens on each rank (different per rank and per step) with no reallocation
and no recapture: the routing table masks the rows past T (``mok_comm.routing``) and phase 0
writes the shared expert's rows for T on the device (``mok_core.schedule.token_rows``).

Buffers (per rank; T = T_max below, H hidden, I / I_s routed / shared intermediate, k top-k,
C schedule capacity rows, T_pad = T rounded up to the GEMMs' row tile):

    comm            the symmetric ``Workspace`` (token staging, ids table, combine rows, barrier
                    flags, error word)
    schedule        this rank's ``Schedule`` (rebuilt on the device every step)
    ids32           int32 [T, k]      ids checked (int64 narrowed) on the device before the
                                      all-gather (-1 past the step's tokens)
    gather_index    int32 [C]         expert-sorted row -> token staging row (-1 padding)
    hidden          uint16 [C, I]     routed SwiGLU output (the down GEMM's A)
    y               uint16 [C, H]     routed expert rows, only when the combine is not fused
    x8_tokens       uint8 [R*T, H] with float32 [R*T, H / 128] scales: precision "fp8"
                                      and EP < k only -- the token staging's rows quantised
                                      1 x 128, once a token
    x8, h8          uint8 [C, H], [C, I] with float32 [C, H / 128], [C, I / 128] scales:
                                      precision "fp8" only -- the landed tokens quantised
                                      1 x 128 into expert order (x8_tokens' rows gathered, or
                                      each route's row), and h (the FP8 GEMMs' A)
    peer_combine32  every rank's combine rows as flat uint32 views (the fused combine's target)
    shared_index    int32 [T_pad]     row -> token for the shared expert (-1 past the step's
                                      tokens), with shared_offsets [2] and shared_rows [1]:
                                      the shared expert's schedule, written every step
    hidden_shared   uint16 [T_pad, I_s], y_shared uint16 [T_pad, H]: the shared expert FFN
    out             uint16 [T, H]     the default output (its first rows; overwritten by the
                                      next step)

``hidden``, ``hidden_shared``, ``gather_index`` and the staging rows stay valid until the next
step: ``ForwardContext`` hands them to the backward. With ``backward=True`` the layer also
holds the backward's buffers (``BackwardBuffers``, documented there and in
``mok_comm.backward``; the forward writes the gate/up pre-activations there) and its GEMM
tiles, derived from the shape, the config and the forward's tiles (so not in the
fingerprint): ``backward_gemm`` (mma.sync: where the next two pick none of their own),
``dgrad_gemm`` (the two data gradients: ``DGRAD_GEMM``, wgmma, where the forward's tiles are
wgmma and the shape splits into it; else ``backward_gemm``) and ``wgrad_gemm`` (the weight
gradients: ``WGRAD_WGMMA_GEMM``, wgmma -- a ring a slice deeper where an expert's rows at the
step take more than two slices --, likewise where the forward's tiles are wgmma and the
shape splits into it; else mma.sync; ``main_grad_gemm`` the same for FP32 gradients, added to
or not: ``WGRAD_MAIN_GRAD_GEMM``). FP8's routed GEMMs -- the forward's two and the data gradients --
take ``fp8_bm``-row tiles (``gemm.fp8_rows_tile`` of the rows an expert gets at the shape's
tokens, as the bf16 tiles are chosen); ``fp8_wgrad`` (``MoKConfig.fp8_wgrad`` resolved by
``fp8_wgrad_on``: None -> ``gemm.fp8_wgrad_pays`` of the same rows) says whether the routed
weight gradients are FP8 too, on ``fp8_wgrad_tile``'s (columns, ring slices)
(``gemm.fp8_wgrad_tile`` of those rows; None: the kernel's default). ``nbytes`` sums the
buffers by name. ``errors`` (``mok_core.step_errors``) reports each step's device-side
problems at the next call (forward and backward calls alike).

bf16 travels as uint16 bits at this level; the adapters view their bf16 tensors as uint16.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import zlib
from functools import partial
from typing import NamedTuple

import numpy as np

from mok_core import errors as err
from mok_core.config import LayerShape, MoKConfig
from mok_core.cuda_compat import (SIM, as_device_array, device_empty, device_full, flat_view,
                                  upload)
from mok_core.gemm import (MMA_SYNC_GEMM, SIM_GEMM, WGMMA_GEMM, GemmConfig, default_gemm,
                           fp8_rows_tile, fp8_wgrad_pays, fp8_wgrad_tile)
from mok_core.schedule import Schedule
from mok_core.step_errors import StepErrors
from mok_core.wgrad_rows import k_capacity

from .heap import Heap
from .barrier import barrier
from .routing import compare_fingerprints, push_fingerprint
from .workspace import create_workspace


class Weights(NamedTuple):
    """One rank's layer weights (bf16; uint16 bits or framework bf16 tensors).

    w_shared_gate / w_shared_up [I_s, H], w_shared_down [H, I_s] (None when I_s = 0);
    w_gate / w_up [E_local, I, H], w_down [E_local, H, I]: this rank's experts, in order.
    """
    w_shared_gate: object
    w_shared_up: object
    w_shared_down: object
    w_gate: object
    w_up: object
    w_down: object


WeightsFP8 = NamedTuple("WeightsFP8", [(f, object) for f in Weights._fields] + [("fp8", object)])
WeightsFP8.__doc__ = """A ``MoKConfig(precision="fp8")`` layer's weights: ``Weights``' six, and
``fp8``, the routed experts quantised (``FP8Weights``, from ``quantize_weights`` once per
optimizer step), which the routed GEMMs read: ``WeightsFP8(*weights, quantize_weights(weights))``.
"""


class FP8Weights(NamedTuple):
    """This rank's routed experts in e4m3 with one float32 scale per 128 x 128 block
    (``mok_core.quantize.quantize_expert_weights``). As stored, for the forward: w_gate /
    w_up uint8 [E_local, I, H] with scales float32 [E_local, I / 128, H / 128]; w_down uint8
    [E_local, H, I] with [E_local, H / 128, I / 128]. Transposed, for the backward's data
    gradients (None in a forward-only set): w_down_t [E_local, I, H] (d_h = d_out W_down
    reduces over H) with [E_local, I / 128, H / 128]; w_gate_up_t [E_local, H, 2I] =
    [W_gate; W_up]^T (d_x = [d_g | d_u] [W_gate; W_up] reduces over 2I) with [E_local, H /
    128, 2I / 128]. A block's bytes and scale are the same in either orientation."""
    w_gate: object
    w_gate_scale: object
    w_up: object
    w_up_scale: object
    w_down: object
    w_down_scale: object
    w_down_t: object = None
    w_down_t_scale: object = None
    w_gate_up_t: object = None
    w_gate_up_t_scale: object = None


def fp8_shapes(experts: int, intermediate: int, hidden: int, backward: bool = True) -> dict:
    """FP8Weights' field -> (dtype, shape) for ``experts`` routed experts of W_gate's shape
    [experts, intermediate, hidden]: the forward's six fields, and with ``backward`` the four
    transposed ones (in field order, so ``FP8Weights(*arrays)`` leaves the others None)."""
    E, I, H = experts, intermediate, hidden
    u8, f32 = np.uint8, np.float32
    blocks = lambda r, c: (f32, (E, r // 128, c // 128))                   # noqa: E731
    shapes = {"w_gate": (u8, (E, I, H)), "w_gate_scale": blocks(I, H),
              "w_up": (u8, (E, I, H)), "w_up_scale": blocks(I, H),
              "w_down": (u8, (E, H, I)), "w_down_scale": blocks(H, I)}
    if backward:
        shapes.update({"w_down_t": (u8, (E, I, H)), "w_down_t_scale": blocks(I, H),
                       "w_gate_up_t": (u8, (E, H, 2 * I)),
                       "w_gate_up_t_scale": blocks(H, 2 * I)})
    return shapes


def check_six_weights(weights) -> None:
    """TypeError unless ``weights`` holds six tensors (``Weights``' fields, in order)."""
    if len(weights) != len(Weights._fields):
        raise TypeError(f"weights: expected {len(Weights._fields)} tensors "
                        f"({', '.join(Weights._fields)}), got {len(weights)}")


def check_fp8_experts(E: int, I: int, H: int) -> None:
    """ValueError unless routed experts of W_gate's shape [E, I, H] split into 128 x 128
    scale blocks."""
    if I % 128 or H % 128:
        raise ValueError(f"w_gate: shape {(E, I, H)} -- FP8 needs I and H multiples of 128 "
                         "(128 x 128 scale blocks)")


def check_quantize_args(weights, out, backward: bool):
    """(the routed experts of ``weights`` -- a ``Weights``, or its six in order -- as checked
    device views in a ``Weights``, ``out`` likewise as an ``FP8Weights`` or None), checked for
    ``quantize_weights``: bf16 w_gate / w_up [E, I, H] and w_down [E, H, I], I and H multiples
    of 128; ``out`` the arrays ``fp8_shapes`` lists (with ``backward``, the transposed ones)."""
    if not isinstance(backward, (bool, np.bool_)):
        raise TypeError(f"backward={backward!r}: expected a bool")
    check_six_weights(weights)
    w_gate = as_device_array(weights[3], "w_gate", dtype=np.uint16, ndim=3)
    E, I, H = w_gate.shape
    check_fp8_experts(E, I, H)
    routed = (w_gate, as_device_array(weights[4], "w_up", dtype=np.uint16, shape=(E, I, H)),
              as_device_array(weights[5], "w_down", dtype=np.uint16, shape=(E, H, I)))
    if out is None:
        return Weights(None, None, None, *routed), None
    specs = fp8_shapes(E, I, H, backward)
    if len(out) not in (6, len(FP8Weights._fields)):
        raise TypeError(f"out: expected an FP8Weights ({len(FP8Weights._fields)} arrays, or "
                        f"the forward's 6), got {len(out)}")
    views = []
    for name, a in zip(FP8Weights._fields, FP8Weights(*out)):
        if name not in specs:
            views.append(a)
            continue
        if a is None:
            raise ValueError(f"out.{name}: None, but quantize_weights(backward={backward}) "
                             f"writes it (out from fp8_shapes(E, I, H, backward))")
        dtype, shp = specs[name]
        views.append(as_device_array(a, f"out.{name}", dtype=dtype, shape=shp, align=16))
    return Weights(None, None, None, *routed), FP8Weights(*views)


def quantize_weights(weights: Weights, *, backward: bool = True, out: FP8Weights | None = None,
                     stream=0) -> FP8Weights:
    """The routed experts of ``weights`` (bf16, as stored) quantised for the FP8 GEMMs -- once
    per optimizer step, into ``out``'s arrays when given (else allocated here); with
    ``backward`` also the transposed copies the backward's data gradients read (a
    forward-only layer needs only the first six)."""
    from mok_core.quantize import quantize_expert_weights
    given = out
    weights, out = check_quantize_args(weights, out, backward)
    if out is None:
        out = FP8Weights(*(device_empty(shp, dtype, stream) for dtype, shp in
                           fp8_shapes(*weights.w_gate.shape, backward).values()))
    for i, name in enumerate(("w_gate", "w_up", "w_down")):
        quantize_expert_weights(getattr(weights, name), out=out[2 * i], scales=out[2 * i + 1],
                                stream=stream)
    if backward:
        I = weights.w_gate.shape[1]
        for w, column in ((weights.w_gate, 0), (weights.w_up, I)):
            quantize_expert_weights(w, transpose=True, out=out.w_gate_up_t,
                                    scales=out.w_gate_up_t_scale, column=column, stream=stream)
        quantize_expert_weights(weights.w_down, transpose=True, out=out.w_down_t,
                                scales=out.w_down_t_scale, stream=stream)
    return out if given is None else FP8Weights(*given)     # (the caller's own arrays)


class ForwardContext(NamedTuple):
    """What the backward needs from a step; views into the layer, valid until its next step."""
    tokens: int               # the step's T
    step: int                 # the layer's ``steps`` then (the backward refuses a stale one)
    schedule: Schedule
    gather_index: object      # int32 [C] expert-sorted row -> staging row (-1 padding)
    x_recv: object            # uint16 [R*T, H] token staging
    hidden: object            # uint16 [C, I] routed SwiGLU output
    hidden_shared: object     # uint16 [T_pad, I_s]
    pre: object               # (gate, up) float32 [C, I]: the routed SwiGLU's inputs, saved
                              # by the forward (None: a forward-only layer)
    pre_shared: object        # (gate_s, up_s) float32 [T_pad, I_s] (None: forward-only, I_s = 0)


class BackwardBuffers:
    """What the backward (``mok_comm.backward``) writes, allocated once with the layer.

    Symmetric (per rank, peer views as tuples over ranks):
        d_out_recv  uint16 [R*T, H]   d_out staging, as ``x_recv`` for x: slice ``rank`` is
                                      this rank's d_out, peers pull the rows they need
        router      float32 [T*k]     this rank's router weights, read by the expert ranks
        d_router    float32 [T*k]     router-weight gradients pushed home by the expert ranks
    ``comm`` is the layer's ``Workspace`` with ``d_out_recv`` as its staging (the dispatch
    ops pull d_out through it exactly as they pull x); its combine rows are the forward's,
    reused for the routed d_x pushed home (the forward's epilogue has read them).
    Local, expert-sorted rows [C, .] (routed) and [T_pad, .] (shared, suffix ``_s``):
        gate, up    [., I]   float32: the gate / up pre-activations, written by the forward's
                             gate/up GEMMs (``pre``: the FP32 accumulators the SwiGLU read,
                             padding rows zero), read by the SwiGLU backward; part of the
                             step's context (``ForwardContext.pre``)
        p           [., I]   d_out W_down, then (routed) w * h
        d_gu        [., 2I]  [d_gate | d_up]
        d_x_rows    [C, H]   routed d_x rows, pushed home by the combine kernel (None where
                             the GEMM pushes them from its epilogue: ``fused_d_x_push``)
        d_x_s       [T_pad, H] the shared expert's d_x
    ``MoKConfig(precision="fp8")`` only (K = C, or where ``Layer.fp8_wgrad``
    ``mok_core.wgrad_rows.k_capacity``: the FP8 weight gradient's rows, each expert's from a
    multiple of 128):
        q_h, q_i       uint8 [K * H], [K * 2I], with float32 scales ``q_h_scale`` [K * H /
                             128], ``q_i_scale`` [K * 2I / 128]: e4m3 operands, first the
                             routed dgrads' A quantised 1 x 128 -- ``d_out8`` [C, H],
                             ``d_gu8`` [C, 2I] (scales ``d_out8_scale``, ``d_gu8_scale``) --,
                             then, read by then, the weight gradients' operands transposed
                             along the rows (``Layer.fp8_wgrad``: ``mok_comm.backward``) --
                             ``d_out8t`` and ``x8t`` [H, K] in q_h, ``d_gu8t`` [2I, K] and
                             ``wh8t`` [I, K] in q_i, each with its ``_scale``: [H, K / 128]
                             and [2I, K / 128] (1 x 128), [H / 128, K / 128] and [I / 128,
                             K / 128] (128 x 128)
        d_out8_tokens  uint8 [R*T, H] with float32 ``d_out8_tokens_scale`` [R*T, H / 128]
                             (EP < k): the d_out staging's rows quantised 1 x 128 once a
                             token, then gathered into ``d_out8`` -- the forward's
                             ``x8_tokens`` (gathered into ``x8`` before the backward)
        k_offsets, k_rows, rows_index, tokens_index   int32 [E + 1], [1], [K], [K]
                             (``Layer.fp8_wgrad``): that layout (``mok_core.wgrad_rows``), written
                             every backward
    and ``ones`` float32 [T, k] (the d_x epilogue is the forward's with unit weights),
    ``d_x`` uint16 [T, H] / ``d_router_out`` float32 [T, k] (the default outputs), ``grads``
    (the default weight gradients, allocated at the first backward that needs them).
    """

    def __init__(self, layer: "Layer", heap: Heap, stream=0):
        s, T, C = layer.shape, layer.tokens_per_rank, layer.comm.capacity
        R, H, I, I_s, k = s.ep_size, s.hidden, s.intermediate, s.shared_intermediate, s.topk
        u16, f32 = np.uint16, np.float32
        recv, peer_recv = heap.alloc((R * T, H), u16, name="d_out_recv",
                                     dims=("tokens_per_rank", "hidden"))
        self.router, self.peer_router = heap.alloc((T * k,), f32, name="router",
                                                   dims=("tokens_per_rank * topk",))
        self.d_router, self.peer_d_router = heap.alloc((T * k,), f32, name="d_router",
                                                       dims=("tokens_per_rank * topk",))
        me = heap.rank
        self.comm = dataclasses.replace(
            layer.comm, x_recv=recv, x_buf=recv[me * T:(me + 1) * T],
            peer_x=tuple(p.reshape(p.size)[q * T * H:(q + 1) * T * H]
                         for q, p in enumerate(peer_recv)))
        T_pad = layer.hidden_shared.shape[0]
        self.gate, self.up = (device_empty((C, I), f32, stream) for _ in range(2))
        self.p = device_empty((C, I), u16, stream)
        self.d_gu = device_empty((C, 2 * I), u16, stream)
        self.d_x_rows = None if layer.fused_d_x_push else device_empty((C, H), u16, stream)
        self.q_h = self.q_h_scale = self.q_i = self.q_i_scale = None
        self.d_out8 = self.d_out8_scale = self.d_gu8 = self.d_gu8_scale = None
        self.d_out8_tokens, self.d_out8_tokens_scale = layer.x8_tokens, layer.x8_tokens_scale
        self.k_offsets = self.k_rows = self.rows_index = self.tokens_index = None
        self.d_out8t = self.x8t = self.d_gu8t = self.wh8t = None
        self.d_out8t_scale = self.x8t_scale = self.d_gu8t_scale = self.wh8t_scale = None

        def view(flat, rows, cols):                     # [rows, cols] at the start of flat
            return flat[:rows * cols].reshape(rows, cols)
        if layer.config.precision == "fp8":
            # the FP8 weight gradients' operands take K >= C rows of these
            K = k_capacity(C, s.experts_per_rank, layer.config.row_align) \
                if layer.fp8_wgrad else C
            self.q_h = device_empty((K * H,), np.uint8, stream)
            self.q_h_scale = device_empty((K * H // 128,), f32, stream)
            self.q_i = device_empty((K * 2 * I,), np.uint8, stream)
            self.q_i_scale = device_empty((K * 2 * I // 128,), f32, stream)
            self.d_out8 = view(self.q_h, C, H)
            self.d_out8_scale = view(self.q_h_scale, C, H // 128)
            self.d_gu8 = view(self.q_i, C, 2 * I)
            self.d_gu8_scale = view(self.q_i_scale, C, 2 * I // 128)
        if layer.fp8_wgrad:
            self.d_out8t, self.x8t = (view(self.q_h, H, K),) * 2
            self.d_out8t_scale = view(self.q_h_scale, H, K // 128)
            self.x8t_scale = view(self.q_h_scale, H // 128, K // 128)
            self.d_gu8t = view(self.q_i, 2 * I, K)
            self.d_gu8t_scale = view(self.q_i_scale, 2 * I, K // 128)
            self.wh8t = view(self.q_i, I, K)
            self.wh8t_scale = view(self.q_i_scale, I // 128, K // 128)
            self.k_offsets = device_empty((s.experts_per_rank + 1,), np.int32, stream)
            self.k_rows = device_empty((1,), np.int32, stream)
            self.rows_index = device_empty((K,), np.int32, stream)
            self.tokens_index = device_empty((K,), np.int32, stream)
        self.gate_s = self.up_s = self.p_s = self.d_gu_s = self.d_x_s = None
        if I_s:
            self.gate_s, self.up_s = (device_empty((T_pad, I_s), f32, stream)
                                      for _ in range(2))
            self.p_s = device_empty((T_pad, I_s), u16, stream)
            self.d_gu_s = device_empty((T_pad, 2 * I_s), u16, stream)
            self.d_x_s = device_empty((T_pad, H), u16, stream)
        self.ones = device_full((T, k), 1.0, f32, stream)
        self.d_x = device_empty((T, H), u16, stream)
        self.d_router_out = device_empty((T, k), f32, stream)
        self.grads = None

    def arrays(self) -> dict:
        """name -> device array, for ``Layer.nbytes``."""
        return {"d_out_recv (symmetric)": self.comm.x_recv, "router (symmetric)": self.router,
                "d_router (symmetric)": self.d_router, "gate": self.gate, "up": self.up,
                "p": self.p, "d_gu": self.d_gu, "d_x_rows": self.d_x_rows,
                "gate_s": self.gate_s, "up_s": self.up_s, "p_s": self.p_s,
                "d_gu_s": self.d_gu_s, "d_x_s": self.d_x_s, "ones": self.ones,
                "d_x": self.d_x, "d_router_out": self.d_router_out, "q_h": self.q_h,
                "q_h_scale": self.q_h_scale, "q_i": self.q_i, "q_i_scale": self.q_i_scale,
                "k_offsets": self.k_offsets, "k_rows": self.k_rows,
                "rows_index": self.rows_index, "tokens_index": self.tokens_index}


def layer_gemm(shape: LayerShape, tokens_per_rank: int) -> GemmConfig:
    """The GEMM tiles a layer takes when given none: ``default_gemm`` for the mean rows per
    local expert under uniform routing, R*T*k/E (``rows_per_expert``)."""
    return default_gemm(rows_per_expert(shape, tokens_per_rank))


# The backward's mma.sync tiles, largest first (the simulator takes the smallest only).
_BACKWARD_TILES = (MMA_SYNC_GEMM,
                   GemmConfig(bm=64, bn=64, bk=32, wm=2, wn=2, stages=4, blocks_per_sm=2),
                   SIM_GEMM)


# The weight gradients' tile on a GPU where the shape takes it: their K is an expert's rows
# (~100), so a tile is mostly its loads' latency and its stores, and more warps in flight per
# SM pay (docs/perf.md: faster than 64 x 128 tiles at qwen's shape).
WGRAD_GEMM = GemmConfig(bm=128, bn=128, bk=32, wm=2, wn=4, stages=3, blocks_per_sm=2,
                        max_registers=128)


# The weight gradients' tile on Hopper: ``sm90_wgrad`` (both operands MN-major wgmma, a
# producer warpgroup loading). An expert's ~100 rows are 1-3 K slices, so a tile is mostly its
# output and its loads' integer work: the producer's ring runs on into the next tile while the
# compute warpgroups store this one (docs/perf.md). 128 x 256 with a 3-slice ring (209 KiB
# beside a whole bf16 tile's staging), and where an expert's rows take more than two slices a
# ring a slice deeper (225 KiB: each warp's rows staged half a tile at a time,
# ``sm90_wgrad.bf16_parts``) -- faster from three slices, slower at two, where the halves' wait
# weighs more than the loads it hides (docs/perf.md). Not 192 rows: 384-thread wgmma kernels
# spill. FP32 gradients take ``WGRAD_MAIN_GRAD_GEMM``'s tile, whose staging holds them whole.
WGRAD_WGMMA_GEMM = GemmConfig(bm=128, bn=256, bk=64, wm=2, wn=1, stages=3, mma="wgmma")
WGRAD_WGMMA_DEEP_GEMM = GemmConfig(bm=128, bn=256, bk=64, wm=2, wn=1, stages=4, mma="wgmma")
# ... and with FP32 weight gradients (added to -- main-grad -- or not): 128 x 128, a warp's rows
# of the output tile staged whole (a whole FP32 tile, 64 KiB; main-grad loads the output's
# values into it) beside a 4-slice ring.
WGRAD_MAIN_GRAD_GEMM = GemmConfig(bm=128, bn=128, bk=64, wm=2, wn=1, stages=4, mma="wgmma")


def wgrad_gemm(shape: LayerShape, backward: GemmConfig, forward: tuple = (),
               main_grad: bool = False, rows: float = 0.0) -> GemmConfig:
    """The tiles of the backward's weight-gradient GEMMs (``wgrad``: dW_gate | dW_up, M = 2I
    split at I (2 I_s at I_s), N = H; dW_down, M = H, N = I or I_s; K = an expert's rows).

    ``WGRAD_WGMMA_GEMM`` -- ``WGRAD_WGMMA_DEEP_GEMM`` where an expert's ``rows`` (at the
    layer's step: ``rows_per_expert``) take more than two of its K slices; ``main_grad``
    (FP32 gradients), ``WGRAD_MAIN_GRAD_GEMM``; wgmma -- on a
    GPU when the forward's tiles ``forward`` are wgmma -- the forward runs on Hopper -- and H,
    I and I_s are multiples of its bm and bn (M, N and the split; no row alignment: the rows
    are its K, zero-filled past each expert). Else ``WGRAD_GEMM`` (mma.sync) where they split
    into its tiles (on a GPU), else ``backward`` (the rest of the backward's tiles; the
    simulator's ``SIM_GEMM``: it cannot run wgmma)."""
    dims = (shape.hidden, shape.intermediate, shape.shared_intermediate)
    g = (WGRAD_MAIN_GRAD_GEMM if main_grad
         else WGRAD_WGMMA_DEEP_GEMM if rows > 2 * WGRAD_WGMMA_GEMM.bk else WGRAD_WGMMA_GEMM)
    if (not SIM and forward and all(f.mma == "wgmma" for f in forward)
            and all(not n % t for n in dims for t in (g.bm, g.bn))):
        return g
    if not SIM and all(not n % t for n in dims for t in (WGRAD_GEMM.bm, WGRAD_GEMM.bn)):
        return WGRAD_GEMM
    return backward


# The data gradients' tile on Hopper: sm90's B_KN (the weights as stored, MN-major wgmma B) at
# WGMMA_GEMM's 128 x 256 tile measured faster than the mma.sync dgrad at qwen's shapes on the
# H200 (docs/perf.md, Backward: the wgmma dgrad). Not the forward's
# 192-row tile where the forward takes it: at 384 threads its kernels spill (168 registers;
# benchmarks/probes/ptxas_check.py), the 128-row dgrad kernels do not.
DGRAD_GEMM = WGMMA_GEMM


def dgrad_gemm(shape: LayerShape, config: MoKConfig, forward: tuple,
               backward: GemmConfig) -> GemmConfig:
    """The tiles of the backward's two data-gradient GEMMs (``dgrad``: p = d_out W_down, K = H,
    N = I or I_s; d_x = [d_g | d_u] [W_gate; W_up], K = 2I split at I (2 I_s at I_s), N = H).

    ``DGRAD_GEMM`` (wgmma) on a GPU when the forward's tiles ``forward`` (gate/up, down) are
    wgmma -- the forward runs on Hopper -- and every dgrad splits into its tile: H, I and I_s
    multiples of its bn (N) and bk (K, K0; K > 0: H and I are), ``row_align`` a multiple of its
    row_unit (the routed segments; the shared expert's T_pad is a multiple of the forward's
    wgmma bm, itself one of 64). Else ``backward`` (``backward_gemm``, mma.sync; the
    simulator's ``SIM_GEMM``: it cannot run wgmma)."""
    g = DGRAD_GEMM
    if (not SIM and all(f.mma == "wgmma" for f in forward)
            and not config.row_align % g.row_unit
            and all(not n % t for n in (shape.hidden, shape.intermediate,
                                        shape.shared_intermediate) for t in (g.bn, g.bk))):
        return g
    return backward


def backward_gemm(shape: LayerShape, config: MoKConfig) -> GemmConfig:
    """The backward's mma.sync GEMM tiles: the largest mma.sync tile (``MMA_SYNC_GEMM``
    first; the simulator: ``SIM_GEMM``) whose rows divide ``row_align`` and whose sides divide
    H, I and I_s (every backward GEMM has them as M, N or K). The data and weight gradients
    run on them where ``dgrad_gemm`` / ``wgrad_gemm`` pick no tiles of their own.
    ValueError when none does."""
    for g in _BACKWARD_TILES[-1:] if SIM else _BACKWARD_TILES:
        if not config.row_align % g.row_unit and all(
                not n % t for n in (shape.hidden, shape.intermediate, shape.shared_intermediate)
                for t in (g.bm, g.bn, g.bk)):
            return g
    raise ValueError(f"{shape} with MoKConfig.row_align={config.row_align}: the backward's "
                     "GEMMs need H, I and I_s multiples of 32 and row_align a multiple of "
                     "32; pass backward=False for a forward-only layer")


def rows_per_expert(shape: LayerShape, tokens_per_rank: int) -> float:
    """The rows an expert gets at a step of ``tokens_per_rank`` under uniform routing (EP x T
    x k / E): what the FP8 kernels' tiles and ``fp8_wgrad`` are chosen by."""
    return shape.ep_size * tokens_per_rank * shape.topk / shape.num_experts


def fp8_wgrad_on(shape: LayerShape, config: MoKConfig, tokens_per_rank: int) -> bool:
    """``MoKConfig.fp8_wgrad`` resolved for a layer: None -> where it pays
    (``gemm.fp8_wgrad_pays`` of the layer's rows per expert); bf16 layers never."""
    if config.precision != "fp8":
        return False
    if config.fp8_wgrad is not None:
        return config.fp8_wgrad
    return fp8_wgrad_pays(rows_per_expert(shape, tokens_per_rank))


def _check_fp8(shape: LayerShape, config: MoKConfig, tokens_per_rank: int):
    """What ``MoKConfig(precision="fp8")`` needs of the layer: a Hopper GPU (or the
    simulator), H and I multiples of 128 (the scale blocks), and the FP8 kernels' tables
    (in shared memory, 16-bit counts) holding its experts, row tiles and (``fp8_wgrad``) K
    slices -- checked here, not at a launch inside a step."""
    from mok_core.gemm import _check_fp8_table
    from mok_core.gemm.sm90_fp8 import require_hopper
    for field, n in (("hidden", shape.hidden), ("intermediate", shape.intermediate)):
        if n % 128:
            raise ValueError(f"LayerShape.{field}={n}: MoKConfig(precision='fp8') needs a "
                             "multiple of 128 (one scale per 128 values)")
    E = shape.experts_per_rank
    C = config.schedule_capacity(tokens_per_rank, shape.topk, shape.ep_size, E)
    _check_fp8_table(E, C // 128 + E, "row tiles")
    if fp8_wgrad_on(shape, config, tokens_per_rank):
        _check_fp8_table(E, k_capacity(C, E, config.row_align) // 128, "K slices")
    require_hopper()


def check_swiglu_limit(swiglu_limit):
    """ValueError unless ``swiglu_limit`` is None or a finite number > 0."""
    if swiglu_limit is not None and not (isinstance(swiglu_limit, numbers.Real)
                                         and not isinstance(swiglu_limit, bool)
                                         and math.isfinite(swiglu_limit) and swiglu_limit > 0):
        raise ValueError(f"swiglu_limit={swiglu_limit!r}: must be None or a finite number > 0")


def check_layer_args(shape, tokens_per_rank, config, gemm, gemm_down, backward) -> None:
    """TypeError / ValueError naming the argument unless each has the type ``Layer`` takes
    (before anything is allocated or initialised)."""
    for name, value, cls in (("shape", shape, LayerShape), ("config", config, MoKConfig),
                             ("gemm", gemm, GemmConfig), ("gemm_down", gemm_down, GemmConfig)):
        if not isinstance(value, cls) and (value is not None or name in ("shape", "config")):
            raise TypeError(f"{name}: expected a {cls.__name__}"
                            f"{'' if name in ('shape', 'config') else ' or None'}, got "
                            f"{type(value).__name__} {value!r:.80}")
    if (not isinstance(tokens_per_rank, numbers.Integral) or isinstance(tokens_per_rank, bool)
            or tokens_per_rank < 0):
        raise ValueError(f"tokens_per_rank={tokens_per_rank!r}: must be an int >= 0 (T_max)")
    if not isinstance(backward, (bool, np.bool_)):
        raise TypeError(f"backward={backward!r}: expected a bool")


def _check_tiles(shape: LayerShape, config: MoKConfig, gemm: GemmConfig, gemm_down: GemmConfig):
    """The shapes must split into the GEMMs' tiles: gate/up has K = H and N = I (bn/2 columns
    of each half per tile), down has K = I and N = H; the shared expert likewise with I_s."""
    for g in {gemm, gemm_down}:
        if config.row_align % g.row_unit:
            raise ValueError(f"MoKConfig.row_align={config.row_align}: must be a multiple of "
                             f"{g.row_unit} for {g}")
    H, I, I_s = shape.hidden, shape.intermediate, shape.shared_intermediate
    for field, n, tile, g in (("hidden", H, gemm.bk, gemm), ("hidden", H, gemm_down.bn, gemm_down),
                              ("intermediate", I, gemm_down.bk, gemm_down),
                              ("intermediate", I, gemm.bn // 2, gemm)):
        if n % tile:
            raise ValueError(f"LayerShape.{field}={n}: must be a multiple of {tile} for {g}")
    if I_s and (I_s % gemm.bk or I_s % (gemm.bn // 2) or I_s % gemm_down.bk):
        raise ValueError(f"LayerShape.shared_intermediate={I_s}: must be a multiple of "
                         f"{gemm.bk}, {gemm.bn // 2} and {gemm_down.bk}")


def _digest(obj) -> int:
    """The same value in every process (``hash`` of a dataclass with a str field is salted)."""
    return zlib.crc32(repr(obj).encode()) & 0x7FFFFFFF


class Layer:
    """The layer's state on this rank; see the module docstring.

    Arguments:
        shape: the model's ``LayerShape`` (``shape.ep_size`` ranks, one per process, or
            emulated ranks on one ``EmulatedHeap``).
        tokens_per_rank: T_max, the most tokens a rank brings to a step (each step may bring
            any 0 <= T <= T_max, different per rank).
        config: the ``MoKConfig``.
        heap: where the symmetric buffers live (``LocalHeap`` at EP 1, ``NvshmemHeap``, or an
            emulated rank's heap). Collective on NVSHMEM: every rank constructs alike.
        gemm / gemm_down: tiles of the gate/up GEMMs (default ``layer_gemm``) and of the down
            GEMMs (default ``gemm``).
        swiglu_limit: None, or L > 0: gate clamped above at L, up to [-L, L] (as some models do).
        verify: compare every rank's shapes and config on the device and raise ``MoKError`` on
            a mismatch -- the layer's one host sync, at construction. Emulated ranks pass False
            and run ``agreement_phases`` themselves.
        backward: allocate the backward's buffers (``BackwardBuffers``); False for a
            forward-only (inference) layer, which then refuses ``backward``.
    """

    def __init__(self, shape: LayerShape, tokens_per_rank: int, config: MoKConfig = MoKConfig(),
                 *, heap: Heap, gemm: GemmConfig | None = None,
                 gemm_down: GemmConfig | None = None, swiglu_limit=None, verify: bool = True,
                 backward: bool = True, stream=0):
        check_layer_args(shape, tokens_per_rank, config, gemm, gemm_down, backward)
        if heap.ep_size != shape.ep_size:
            raise ValueError(f"LayerShape.ep_size={shape.ep_size} but the heap has "
                             f"{heap.ep_size} ranks")
        check_swiglu_limit(swiglu_limit)
        if config.precision == "fp8":
            _check_fp8(shape, config, tokens_per_rank)
        T = int(tokens_per_rank)
        gemm = gemm or layer_gemm(shape, T)
        gemm_down = gemm_down or gemm
        _check_tiles(shape, config, gemm, gemm_down)
        self.shape, self.config, self.tokens_per_rank = shape, config, T
        self.gemm, self.gemm_down = gemm, gemm_down
        self.swiglu_limit = None if swiglu_limit is None else float(swiglu_limit)
        H, I, I_s, k = shape.hidden, shape.intermediate, shape.shared_intermediate, shape.topk
        self.comm = create_workspace(heap, tokens_per_rank=T, hidden=H, topk=k,
                                     num_experts=shape.num_experts, config=config,
                                     stream=stream)
        C = self.comm.capacity
        self.schedule = Schedule.allocate(rank=heap.rank, ep_size=shape.ep_size,
                                          tokens_per_rank=T, topk=k,
                                          num_experts=shape.num_experts, config=config,
                                          capacity=C, stream=stream)
        u16, i32 = np.uint16, np.int32
        unit = math.lcm(gemm.bm, gemm_down.bm)           # the shared expert's rows, both GEMMs
        T_pad = max(unit, -(-T // unit) * unit)
        self.ids32 = device_empty((T, k), i32, stream)
        self.gather_index = device_full((C,), -1, i32, stream)
        self.hidden = device_empty((C, I), u16, stream)
        self.y = None if self.fused_combine else device_empty((C, H), u16, stream)
        # the FP8 GEMMs' tile rows for this step size's experts (``fp8_rows_tile``)
        rows = rows_per_expert(shape, T)
        self.fp8_bm = fp8_rows_tile(rows)
        # ... whether its weight gradients are FP8 (``MoKConfig.fp8_wgrad`` resolved) and their
        # tile columns and ring (``fp8_wgrad_tile``: by the K slices an expert's rows take)
        self.fp8_wgrad = fp8_wgrad_on(shape, config, T)
        self.fp8_wgrad_tile = fp8_wgrad_tile(rows)
        # FP8: the landed tokens quantised 1 x 128 into expert order -- where a rank gets more
        # routes than staging rows (EP < k: T k against R T), once a token (the staging's
        # rows) and then gathered, else route by route -- and h quantised: the GEMMs' A rows
        fp8 = config.precision == "fp8"
        R_T = self.comm.x_recv.shape[0]
        by_token = fp8 and shape.ep_size < k
        self.x8_tokens = device_empty((R_T, H), np.uint8, stream) if by_token else None
        self.x8_tokens_scale = (device_empty((R_T, H // 128), np.float32, stream) if by_token
                                else None)
        self.x8 = device_empty((C, H), np.uint8, stream) if fp8 else None
        self.x8_scale = device_empty((C, H // 128), np.float32, stream) if fp8 else None
        self.h8 = device_empty((C, I), np.uint8, stream) if fp8 else None
        self.h8_scale = device_empty((C, I // 128), np.float32, stream) if fp8 else None
        # the fused combine's destinations: every rank's combine rows as packed bf16 pairs
        self.peer_combine32 = tuple(flat_view(p, np.uint32) for p in self.comm.peer_combine)
        self.shared_unit = unit
        self.shared_index = device_full((T_pad,), -1, i32, stream)   # (token_rows fills them)
        self.shared_offsets = device_full((2,), 0, i32, stream)
        self.shared_rows = device_full((1,), 0, i32, stream)
        self.tokens = T                   # the last step's T (host-side, set as it launches)
        self.steps = 0                    # forwards launched on it (host-side: a replay of
                                          # a caller's own CUDA graph is not counted)
        self.hidden_shared = device_empty((T_pad, max(I_s, 8)), u16, stream)
        self.y_shared = device_empty((T_pad, H), u16, stream)
        self.out = device_empty((T, H), u16, stream)
        self.backward_gemm = backward_gemm(shape, config) if backward else None
        # the weight gradients' tiles cut H and I only (their K is an expert's rows): wgmma
        # where the forward's are (derived like dgrad_gemm: not in the fingerprint)
        self.wgrad_gemm = (wgrad_gemm(shape, self.backward_gemm, (gemm, gemm_down),
                                      rows=rows) if backward else None)
        self.main_grad_gemm = (wgrad_gemm(shape, self.backward_gemm, (gemm, gemm_down), True)
                               if backward else None)
        # the data gradients': wgmma where the forward's are and the shape splits into them
        # (derived from the shape, config and forward tiles: not in the fingerprint)
        self.dgrad_gemm = (dgrad_gemm(shape, config, (gemm, gemm_down), self.backward_gemm)
                           if backward else None)
        self.grad = BackwardBuffers(self, heap, stream) if backward else None
        fields = dict(hidden=H, intermediate=I, shared_intermediate=I_s,
                      num_experts=shape.num_experts, topk=k, ep_size=shape.ep_size,
                      tokens_per_rank=T, row_align=config.row_align,
                      minibatch_size=config.minibatch_size,
                      capacity_factor=round(config.capacity_factor * 1e6), config=_digest(config),
                      gemm=_digest(gemm), gemm_down=_digest(gemm_down),
                      swiglu_limit=_digest(self.swiglu_limit), backward=int(backward))
        # in the order errors.describe names them when ranks disagree
        fp = np.array([fields[n] for n in err.FINGERPRINT_FIELDS], i32)
        self.fingerprint = upload(fp, stream)
        self.fingerprint_table, peers = heap.alloc((shape.ep_size, fp.size), i32, -1)
        self.peer_fingerprints = tuple(p.reshape(p.size) for p in peers)
        self.errors = StepErrors((self.comm.errors, self.schedule.errors), rank=heap.rank,
                                 mode=config.errors,
                                 describe=partial(err.describe, num_experts=shape.num_experts))
        heap.fence()                      # the fingerprint table's fill precedes peers' pushes
        if verify:
            push, compare = agreement_phases(self, stream)
            push()
            barrier(self.comm, stream)
            compare()
            self.comm.check(stream)

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def fused_combine(self) -> bool:
        """The down GEMM pushes rows home from its epilogue (wgmma and FP8 GEMMs with
        ``MoKConfig.fuse_combine``); else it writes ``y`` and the combine kernel sends it."""
        return self._pushes(self.gemm_down)

    @property
    def fused_d_x_push(self) -> bool:
        """The backward's routed d_x GEMM pushes its rows home from its epilogue (the wgmma
        dgrad or the FP8 GEMM, with ``MoKConfig.fuse_combine``), as the forward's down GEMM
        does; else it writes ``grad.d_x_rows`` and the combine kernel sends them."""
        return self.dgrad_gemm is not None and self._pushes(self.dgrad_gemm)

    def _pushes(self, gemm: GemmConfig) -> bool:
        """A routed GEMM on these bf16 tiles (or, FP8, the FP8 GEMM) sends its rows home from
        its epilogue: the config fuses the combine and the kernel can push (not mma.sync)."""
        return self.config.fuse_combine and (gemm.mma != "mma_sync"
                                             or self.config.precision == "fp8")

    def __call__(self, x, topk_ids, router_weights, weights: Weights, *, out=None, stream=0):
        """One step (``mok_comm.functional.forward``); returns ``out`` uint16 [T, H]."""
        from .functional import forward
        return forward(self, x, topk_ids, router_weights, weights, out=out, stream=stream)[0]

    def context(self) -> ForwardContext:
        """The forward context of the last step run on this layer."""
        g = self.grad
        return ForwardContext(self.tokens, self.steps, self.schedule, self.gather_index,
                              self.comm.x_recv, self.hidden, self.hidden_shared,
                              None if g is None else (g.gate, g.up),
                              None if g is None or g.gate_s is None else (g.gate_s, g.up_s))

    def check(self, stream=0) -> None:
        """Wait for every step in flight and raise ``MoKError`` for the first one that recorded
        a problem (``mok_core.step_errors``; without ``check`` the next step raises it)."""
        self.errors.poll(block=True)

    @property
    def nbytes(self) -> dict:
        """Device bytes this layer holds, by buffer (symmetric ones are per rank)."""
        arrays = {"x_recv (symmetric)": self.comm.x_recv,
                  "ids_table (symmetric)": self.comm.ids_table,
                  "combine_buf (symmetric)": self.comm.combine_buf, "hidden": self.hidden,
                  "y": self.y, "hidden_shared": self.hidden_shared, "y_shared": self.y_shared,
                  "out": self.out, "gather_index": self.gather_index, "ids32": self.ids32,
                  "x8_tokens": self.x8_tokens, "x8_tokens_scale": self.x8_tokens_scale,
                  "x8": self.x8, "x8_scale": self.x8_scale, "h8": self.h8,
                  "h8_scale": self.h8_scale}
        if self.grad is not None:
            arrays.update(self.grad.arrays())
        sizes = {name: int(a.size) * a.dtype.itemsize for name, a in arrays.items()
                 if a is not None}
        s = self.schedule
        sizes["schedule row tables"] = sum(int(a.size) * 4 for a in (s.src_rank, s.src_token,
                                                                      s.src_slot, s.recv_row))
        return sizes


def agreement_phases(layer: Layer, stream=0):
    """[push our fingerprint, compare everyone's] -- a barrier goes between them."""
    return [partial(push_fingerprint, layer.comm, layer.fingerprint, layer.peer_fingerprints,
                    stream),
            partial(compare_fingerprints, layer.comm, layer.fingerprint_table, stream)]


__all__ = ["BackwardBuffers", "DGRAD_GEMM", "FP8Weights", "ForwardContext", "Layer",
           "WGRAD_GEMM", "WGRAD_MAIN_GRAD_GEMM", "WGRAD_WGMMA_DEEP_GEMM", "WGRAD_WGMMA_GEMM",
           "Weights", "WeightsFP8",
           "agreement_phases",
           "backward_gemm", "check_swiglu_limit", "dgrad_gemm", "layer_gemm", "quantize_weights",
           "wgrad_gemm"]
