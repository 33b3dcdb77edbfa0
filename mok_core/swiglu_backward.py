"""SwiGLU backward of the expert-sorted rows, with the router-weight gradient: one warp per row.

Per row r < num_rows[0] of the expert-sorted layout (I intermediate columns, a multiple of 4;
bf16 as packed uint32 pairs; FP32 math, each output rounded to bf16 once):

    in   p      [C, I]   d_out[token] W_down[e]: the down GEMM's data gradient, unweighted
         gate   [C, I]   float32 gate pre-activation g, saved by the forward's gate/up GEMM
                         (``mok_core.gemm.gate_up_swiglu``'s ``pre``: the FP32 accumulators
                         its SwiGLU read, so the clamp masks here are the forward's)
         up     [C, I]   float32 up pre-activation u (likewise); gate and up are read on real
                         rows only (row_index >= 0)
         hidden [C, I]   the forward's h = SwiGLU(g, u) in bf16 (what the down GEMM consumed);
                         read by routed rows only (d_w, w h)
    out  d_gu   [C, 2I]  [d_g | d_u]: the A operand of the gate/up data gradient (K = 2I), and
                         of the gate/up weight gradients (also in FP8: they read it in bf16)
         p      [C, I]   (routed) overwritten by w * h: the B operand of W_down's gradient
                         (dW_down[e] = sum_r d_out[t_r]^T (w_r h_r))
         d_gu8  [C, 2I]  (``quant``, the FP8 layer's) [d_g | d_u] quantised 1 x 128 as
                         ``quantize_fp8`` quantises the bf16 d_gu -- e4m3 bytes and float32
                         scales [C, 2I / 128], bit for bit (I a multiple of 128): the A
                         operand of the FP8 gate/up data gradient

with w the route's router weight (routed) or 1 (shared expert), d_h = w * p and

    g' = min(g, L), u' = clip(u, -L, L), s = sigmoid(g'), d_g = d_h u' s (1 + g' (1 - s)),
    d_u = d_h g' s, the clamp passing gradient like ``torch.clamp``'s autograd (where
    -L <= u <= L, g <= L; equality included; L = +inf: no clamp) -- ``reference.swiglu_backward``.

One warp owns a row (grid-stride over the rows by global warp index, several warps a block):
a step of its lane l covers columns c = 4 (l + 32 m) .. c + 3 -- 16-byte loads of g and u, 8
of p and h, 8-byte stores of d_g, d_u (and w h) --, so a warp step is 128 columns, and lanes
past I / 4 sit the last step out. No shared memory and no block barrier: the row's only
reduction is the warp's. Why a warp: the dot product then reduces in registers and each lane
moves 16-byte chunks, where a block a row would reduce through a shared-memory tree with a
barrier per level, its threads holding a column pair or two each at real I.

Routed rows also produce the router-weight gradient d_w = <d_out[t], y_r> = sum_i p[r, i] h[r, i]:
every lane sums its columns in ascending order (step by step, the four in column order; a
bf16 product is exact in float32 short of underflow, so an fma adds the same), then the warp
adds the 32 partials by a fixed butterfly (``intrinsics.warp_fsum``), so d_w is bitwise
deterministic; lane 0 stores
it into the source rank's ``peer_d_router[src_rank[r]][src_token[r] * k + src_slot[r]]`` (one
scalar store, over NVLink for a peer) -- every route has exactly one row, so no two rows
write one slot. The router weight is read the same way from ``peer_router[src_rank[r]]``
(the source published its [T, k]).

``quant`` (the FP8 layer, I a multiple of 128): a warp step of d_g -- and of d_u -- is one
1 x 128 item of the row quantiser (``quantize.quantize_rows_kernel``: lane l holds its bf16
columns 4l .. 4l + 3 as two words), so the kernel quantises each as it stores it, with the
quantiser's own device functions (``quantize.quantize_row_item``): same scale, same bytes;
NaN/Inf of d_gu (one vote a step) are counted into the error word at their row, as the
quantiser counts them (it saturates an Inf to +-448: the count is what reports it). Why
here: the words are in registers as they are stored, where a quantiser pass of its own would
read d_gu back. The module still holds one op -- the quantisation stays ``quantize``'s,
called, not restated.

Padding rows (row_index[r] < 0) get zeros in d_gu (and p; ``quant``: e4m3 zeros, scale 1):
the GEMMs that read them multiply them into the weight gradients. Rows at or past num_rows
are not touched.

Ordering (the caller's): p, gate, up and hidden written before (stream order); the pushed d_w
is read by the source rank after a barrier; d_gu and d_gu8 read by later launches (stream
order). Nothing waits, nothing can time out.
"""
from functools import lru_cache

import numpy as np
from numba import cuda, float32, int64, uint32, uint64

from .bf16 import hi_bf16, lo_bf16
from .cuda_compat import SIM, flat_view, kjit, launch, multiprocessor_count
from .intrinsics import (ex2_approx, ld_v4, pack_bf16x2, rcp_approx, tuple_pick, u32_as_f32,
                         warp_all, warp_fsum)
from .quantize import quantize_row_item, report_row_item, row_words_finite

WARPS = 2 if SIM else 8          # warps a block, each its own rows
_BLOCKS_PER_SM = 8
_NEG_LOG2E = float32(-1.4426950408889634)


@kjit(device=True, inline="always")
def swiglu_grads(g, u, dh, limit):
    """(d_g, d_u) of SiLU(min(g, L)) * clip(u, -L, L) given d_h, in float32; the sigmoid as the
    forward's epilogue computes it (one SFU exp2, one SFU reciprocal)."""
    gc = min(g, limit)
    uc = max(min(u, limit), -limit)
    s = rcp_approx(float32(1.0) + ex2_approx(gc * _NEG_LOG2E))
    d_g = dh * uc * (s * (float32(1.0) + gc * (float32(1.0) - s)))
    d_u = dh * gc * s
    if not g <= limit:
        d_g = float32(0.0)
    if not (u <= limit and u >= -limit):
        d_u = float32(0.0)
    return d_g, d_u


@kjit(device=True, inline="always")
def _words(v):
    """A uint64 of four bf16 as its two uint32 words (low first)."""
    return uint32(v), uint32(v >> uint64(32))


@kjit(device=True, inline="always")
def _quad(v):
    """A uint64 of four bf16 as four float32."""
    a, b = _words(v)
    return lo_bf16(a), hi_bf16(a), lo_bf16(b), hi_bf16(b)


@kjit(device=True, inline="always")
def _join(a, b):
    """Two uint32 words as one uint64 (``a`` low)."""
    return uint64(a) | (uint64(b) << uint64(32))


def _make_kernel(routed, quant):

    @kjit
    def kernel(p64, gate, up, hidden64, d_gu64, row_index, num_rows, src_rank, src_token,
               src_slot, peer_router, peer_d_router, I, k, limit, out32, scales_f32, scales_u8,
               errors, tensor, rank):
        lane = int64(cuda.threadIdx.x % 32)
        quads = I >> 2                           # 4-column steps of a lane a row
        groups = quads >> 4                      # (quant) 1 x 128 items of a d_gu row
        r = int64(cuda.blockIdx.x) * WARPS + cuda.threadIdx.x // 32
        n = int64(num_rows[0])
        while r < n:
            real = row_index[r] >= 0
            w = float32(1.0)
            if routed and real:
                w = tuple_pick(peer_router, src_rank[r])[src_token[r] * k + src_slot[r]]
            dot = float32(0.0)
            c0 = int64(0)
            while c0 < quads:                    # every lane takes every step (collectives)
                c = c0 + lane
                ga = gb = ua = ub = uint32(0)
                if c < quads:
                    at = uint64(r * quads + c)
                    g_at = uint64(r * (2 * quads) + c)        # d_g's quad; d_u's + quads
                    wh = uint64(0)
                    if real:
                        p0, p1, p2, p3 = _quad(p64[at])
                        g0, g1, g2, g3 = ld_v4(gate, uint64(4) * at)
                        u0, u1, u2, u3 = ld_v4(up, uint64(4) * at)
                        dg0, du0 = swiglu_grads(u32_as_f32(g0), u32_as_f32(u0), w * p0, limit)
                        dg1, du1 = swiglu_grads(u32_as_f32(g1), u32_as_f32(u1), w * p1, limit)
                        dg2, du2 = swiglu_grads(u32_as_f32(g2), u32_as_f32(u2), w * p2, limit)
                        dg3, du3 = swiglu_grads(u32_as_f32(g3), u32_as_f32(u3), w * p3, limit)
                        ga = pack_bf16x2(dg0, dg1)
                        gb = pack_bf16x2(dg2, dg3)
                        ua = pack_bf16x2(du0, du1)
                        ub = pack_bf16x2(du2, du3)
                        if routed:
                            h0, h1, h2, h3 = _quad(hidden64[at])
                            dot += p0 * h0           # ascending columns (bf16 products:
                            dot += p1 * h1           # exact in float32)
                            dot += p2 * h2
                            dot += p3 * h3
                            wh = _join(pack_bf16x2(w * h0, w * h1), pack_bf16x2(w * h2, w * h3))
                    d_gu64[g_at] = _join(ga, gb)
                    d_gu64[g_at + uint64(quads)] = _join(ua, ub)
                    if routed:
                        p64[at] = wh
                if quant:                        # I % 128 == 0: every lane had a column
                    item = r * groups + (c0 >> 5)
                    quantize_row_item(ga, gb, item, out32, scales_f32, scales_u8, False, lane)
                    quantize_row_item(ua, ub, item + (groups >> 1), out32, scales_f32,
                                      scales_u8, False, lane)
                    if not warp_all(row_words_finite(ga, gb) & row_words_finite(ua, ub)):
                        report_row_item(ga, gb, item, groups, errors, tensor, rank, lane)
                        report_row_item(ua, ub, item + (groups >> 1), groups, errors, tensor,
                                        rank, lane)
                c0 += 32
            if routed:
                dot = warp_fsum(dot)             # the fixed butterfly: deterministic
                if lane == 0 and real:
                    tuple_pick(peer_d_router, src_rank[r])[src_token[r] * k + src_slot[r]] = dot
            r += int64(cuda.gridDim.x) * WARPS

    return kernel


@lru_cache(maxsize=None)
def _kernel(routed, quant):
    return _make_kernel(routed, quant)


def launch_swiglu_backward(p, gate, up, hidden, d_gu, row_index, num_rows, *, limit=None,
                           route=None, quant=None, stream=0):
    """Trusted launch (device views: uint16 [C, I] p / hidden, float32 [C, I] gate / up,
    uint16 [C, 2I] d_gu, int32 [C] row_index, int32 [1] num_rows; gate / up 16-byte aligned,
    p / hidden / d_gu 8-byte aligned; I a multiple of 4). ``route``: None (shared expert:
    w = 1, p kept) or ``(src_rank, src_token, src_slot, peer_router, peer_d_router, k)``
    (routed: tuples over ranks of float32 [T * k]). ``quant``: None, or ``(out, scales,
    errors, tensor, rank)`` -- ``launch_quantize_rows(d_gu, out, scales, num_rows=num_rows,
    errors=errors, tensor=tensor, rank=rank)``'s operands (uint8 [C, 2I] e4m3, float32
    [C, 2I / 128] scales, the error word), done by this kernel as it writes d_gu (I a
    multiple of 128)."""
    C, I = p.shape
    if I % 4:
        raise ValueError(f"swiglu_backward: I = {I} columns -- a lane takes 4 a step (16-byte "
                         "loads): I must be a multiple of 4")
    if quant is not None and I % 128:
        raise ValueError(f"swiglu_backward: I = {I} columns -- the 1 x 128 quantisation of "
                         "[d_g | d_u] needs a multiple of 128")
    if C == 0:
        return
    lim = np.float32(np.inf if limit is None else limit)
    routed = route is not None
    if not routed:               # placeholders of the routed arguments (never read)
        unread = (flat_view(num_rows, np.float32),)
        route = (row_index, row_index, row_index, unread, unread, 1)
    src_rank, src_token, src_slot, peer_router, peer_d_router, k = route
    if quant is None:            # placeholders of the quantiser's (never touched)
        out32, scales_f32, scales_u8 = (flat_view(d_gu, np.uint32), flat_view(gate),
                                        flat_view(d_gu, np.uint8))
        errors, tensor, rank = row_index, 0, 0
    else:
        out, scales, errors, tensor, rank = quant
        out32, scales_f32, scales_u8 = (flat_view(out, np.uint32), flat_view(scales),
                                        flat_view(scales, np.uint8))
    blocks = min(-(-C // WARPS), 2 if SIM else _BLOCKS_PER_SM * multiprocessor_count())
    u64 = np.uint64
    launch(_kernel(routed, quant is not None), blocks, 32 * WARPS, stream, 0,
           flat_view(p, u64), flat_view(gate), flat_view(up), flat_view(hidden, u64),
           flat_view(d_gu, u64), row_index, num_rows, src_rank, src_token, src_slot,
           tuple(peer_router), tuple(peer_d_router), np.int64(I), np.int64(k), lim,
           out32, scales_f32, scales_u8, errors, np.int32(tensor), np.int32(rank))

__all__ = ["launch_swiglu_backward", "swiglu_grads"]
