"""SwiGLU backward of the expert-sorted rows, with the router-weight gradient: one block per row.

Per row r < num_rows[0] of the expert-sorted layout (I intermediate columns; bf16 as packed
uint32 pairs; FP32 math, each output rounded to bf16 once):

    in   p      [C, I]   d_out[token] W_down[e]: the down GEMM's data gradient, unweighted
         gate   [C, I]   float32 gate pre-activation g, saved by the forward's gate/up GEMM
                         (``mok_core.gemm.gate_up_swiglu``'s ``pre``: the FP32 accumulators
                         its SwiGLU read, so the clamp masks here are the forward's)
         up     [C, I]   float32 up pre-activation u (likewise); gate and up are read on real
                         rows only (row_index >= 0)
         hidden [C, I]   the forward's h = SwiGLU(g, u) in bf16 (what the down GEMM consumed)
    out  d_gu   [C, 2I]  [d_g | d_u]: the A operand of the gate/up data gradient (K = 2I)
         p      [C, I]   (routed) overwritten by w * h: the B operand of W_down's gradient
                         (dW_down[e] = sum_r d_out[t_r]^T (w_r h_r))

with w the route's router weight (routed) or 1 (shared expert), d_h = w * p and

    g' = min(g, L), u' = clip(u, -L, L), s = sigmoid(g'), d_g = d_h u' s (1 + g' (1 - s)),
    d_u = d_h g' s, the clamp passing gradient like ``torch.clamp``'s autograd (where
    -L <= u <= L, g <= L; equality included; L = +inf: no clamp) -- ``reference.swiglu_backward``.

Routed rows also produce the router-weight gradient d_w = <d_out[t], y_r> = sum_i p[r, i] h[r, i]:
every thread sums its columns in ascending order, the block adds the partials in a fixed tree,
so d_w is bitwise deterministic; thread 0 stores it into the source rank's
``peer_d_router[src_rank[r]][src_token[r] * k + src_slot[r]]`` (one scalar store, over NVLink
for a peer) -- every route has exactly one row, so no two rows write one slot. The router weight
is read the same way from ``peer_router[src_rank[r]]`` (the source published its [T, k]).

Padding rows (row_index[r] < 0) get zeros in d_gu (and p): the GEMMs that read them multiply
them into the weight gradients. Rows at or past num_rows are not touched.

Ordering (the caller's): p, gate, up and hidden written before (stream order); the pushed d_w
is read by the source rank after a barrier. Nothing waits, nothing can time out.
"""
from functools import lru_cache

import numpy as np
from numba import cuda, float32, uint32

from .bf16 import hi_bf16, lo_bf16
from .cuda_compat import SIM, flat_view, kjit, launch, multiprocessor_count
from .intrinsics import ex2_approx, pack_bf16x2, rcp_approx, tuple_pick

THREADS = 64 if SIM else 256
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


def _make_kernel(routed):
    threads = THREADS

    @kjit
    def kernel(p, gate, up, hidden, d_gu, row_index, num_rows, src_rank, src_token, src_slot,
               peer_router, peer_d_router, I, k, limit):
        part = cuda.shared.array(threads, float32)
        tid = cuda.threadIdx.x
        pairs = I // 2
        r = cuda.blockIdx.x
        while r < num_rows[0]:
            real = row_index[r] >= 0
            w = float32(1.0)
            if routed and real:
                w = tuple_pick(peer_router, src_rank[r])[src_token[r] * k + src_slot[r]]
            dot = float32(0.0)
            j = tid
            while j < pairs:
                at = r * pairs + j
                if real:
                    pw = p[at]
                    hw = hidden[at]
                    p0 = lo_bf16(pw)
                    p1 = hi_bf16(pw)
                    h0 = lo_bf16(hw)
                    h1 = hi_bf16(hw)
                    dot += p0 * h0
                    dot += p1 * h1
                    dg0, du0 = swiglu_grads(gate[2 * at], up[2 * at], w * p0, limit)
                    dg1, du1 = swiglu_grads(gate[2 * at + 1], up[2 * at + 1], w * p1, limit)
                    d_gu[2 * r * pairs + j] = pack_bf16x2(dg0, dg1)
                    d_gu[(2 * r + 1) * pairs + j] = pack_bf16x2(du0, du1)
                    if routed:
                        p[at] = pack_bf16x2(w * h0, w * h1)
                else:
                    d_gu[2 * r * pairs + j] = uint32(0)
                    d_gu[(2 * r + 1) * pairs + j] = uint32(0)
                    if routed:
                        p[at] = uint32(0)
                j += threads
            if routed:
                # fixed-order tree: the same partials always meet in the same pairs
                part[tid] = dot
                cuda.syncthreads()
                half = threads // 2
                while half > 0:
                    if tid < half:
                        part[tid] = part[tid] + part[tid + half]
                    cuda.syncthreads()
                    half //= 2
                if tid == 0 and real:
                    tuple_pick(peer_d_router, src_rank[r])[src_token[r] * k + src_slot[r]] = \
                        part[0]
                cuda.syncthreads()        # part is rewritten by the next row
            r += cuda.gridDim.x

    return kernel


@lru_cache(maxsize=None)
def _kernel(routed):
    return _make_kernel(routed)


def launch_swiglu_backward(p, gate, up, hidden, d_gu, row_index, num_rows, *, limit=None,
                           route=None, stream=0):
    """Trusted launch (device views: uint16 [C, I] p / hidden, float32 [C, I] gate / up,
    uint16 [C, 2I] d_gu, int32 [C] row_index, int32 [1] num_rows). ``route``: None (shared
    expert: w = 1, p kept) or ``(src_rank, src_token, src_slot, peer_router, peer_d_router,
    k)`` (routed: tuples over ranks of float32 [T * k])."""
    C, I = p.shape
    if C == 0:
        return
    lim = np.float32(np.inf if limit is None else limit)
    routed = route is not None
    if not routed:               # placeholders of the routed arguments (never read)
        unread = (flat_view(num_rows, np.float32),)
        route = (row_index, row_index, row_index, unread, unread, 1)
    src_rank, src_token, src_slot, peer_router, peer_d_router, k = route
    blocks = min(C, 2 if SIM else 8 * multiprocessor_count())
    u32 = np.uint32
    launch(_kernel(routed), blocks, THREADS, stream, 0,
           flat_view(p, u32), flat_view(gate), flat_view(up), flat_view(hidden, u32),
           flat_view(d_gu, u32), row_index, num_rows, src_rank, src_token, src_slot,
           tuple(peer_router), tuple(peer_d_router), np.int64(I), np.int64(k), lim)

__all__ = ["launch_swiglu_backward", "swiglu_grads"]
