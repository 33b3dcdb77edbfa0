"""Combine: expert outputs go home, and each source rank sums its tokens' routes in a fixed order.

Roles and layouts (T tokens per rank, H hidden, k top-k, C schedule capacity):
    y [C, H] uint16            expert outputs of this rank, expert-sorted rows (the routed FFN)
    combine_buf [T*k, H]       symmetric (``Workspace``): row t*k + s on rank r holds the
                               expert output of route (t, s) of rank r's token t
``combine`` (on the expert rank): a warp per row of y, rows dealt in order to the comm blocks;
each real row is stored straight into its source rank's combine buffer at its route's unique
row ``src_token * k + src_slot`` -- no atomics, no write conflicts; padding rows are skipped.
Router weights are not applied here: the source applies them in a fixed order.

Ordering (the caller's duties): a ``barrier`` after every rank's combine, before the
epilogue reads the buffer; the next step's combine comes a barrier after this epilogue (the
forward's phase order gives both). Masked routes (id -1) are never written; the epilogue skips
them by reading this rank's row of the ids table (pushed by ``routing.check_and_publish_ids``).

``epilogue`` (on the source rank): out[t] = y_shared[t] + sum_j w[t, j] * y[t, j], slots j
ascending, FP32, each multiply and add rounded once (``fmul_rn``/``fadd_rn`` are never fused into
an FMA), one bf16 rounding at the end -- bitwise deterministic and bit-equal to a NumPy float32
evaluation in the same order. A thread per 8 columns (16-byte loads/stores); it loads
ROUTES_IN_FLIGHT routes' ids, weights and rows before adding any (masked ones' rows are loaded
and dropped), so that many loads are in flight.

Nothing here waits on a peer, so nothing here can time out or set an error.

Entries: ``combine`` and ``epilogue`` are trusted -- they take device views already checked
(``check_y`` / ``check_epilogue`` check a direct caller's arrays once).
"""
import numpy as np
from numba import boolean, cuda, float32, uint32

from mok_core.bf16 import hi_bf16, lo_bf16
from mok_core.cuda_compat import SIM, as_device_array, kjit, launch, multiprocessor_count
from mok_core.intrinsics import fadd_rn, fmul_rn, ld_v4, pack_bf16x2, st_v4

from .device import COMM_WARPS, COPY_THREADS, comm_grid, copy_row, flat

ROUTES_IN_FLIGHT = 4    # epilogue: routes whose rows a thread loads before adding them


# ---- device ------------------------------------------------------------------------------

@kjit
def push_combine_kernel(y, src_rank, src_token, src_slot, num_rows, peer_combine, H, k):
    """Launch: grid = comm blocks, block = 32 * warps threads.

    y             uint16 [capacity*H]         expert outputs, expert-sorted rows
    src_*         int32 [capacity]            schedule pull table
    peer_combine  tuple over ranks of uint16 [T*k*H]
    """
    warps = cuda.blockDim.x // 32
    lane = cuda.threadIdx.x % 32
    rows = num_rows[0]
    row = cuda.blockIdx.x * warps + cuda.threadIdx.x // 32
    while row < rows:
        r = src_rank[row]
        if r >= 0:
            dst = (src_token[row] * k + src_slot[row]) * H
            copy_row(y, row * H, peer_combine[r], dst, H, lane)
        row += cuda.gridDim.x * warps


@kjit(device=True, inline="always")
def _add_route(acc, w, v0, v1, v2, v3):
    """acc[q] += w * (the q-th bf16 of v0..v3), each multiply and add rounded once."""
    acc[0] = fadd_rn(acc[0], fmul_rn(w, lo_bf16(v0)))
    acc[1] = fadd_rn(acc[1], fmul_rn(w, hi_bf16(v0)))
    acc[2] = fadd_rn(acc[2], fmul_rn(w, lo_bf16(v1)))
    acc[3] = fadd_rn(acc[3], fmul_rn(w, hi_bf16(v1)))
    acc[4] = fadd_rn(acc[4], fmul_rn(w, lo_bf16(v2)))
    acc[5] = fadd_rn(acc[5], fmul_rn(w, hi_bf16(v2)))
    acc[6] = fadd_rn(acc[6], fmul_rn(w, lo_bf16(v3)))
    acc[7] = fadd_rn(acc[7], fmul_rn(w, hi_bf16(v3)))


@kjit
def combine_epilogue_kernel(y_shared, has_shared, combine, ids, weights, out, T, H, k):
    """Launch: any grid.

    y_shared  uint16 [T*H]     shared-expert output (ignored unless has_shared)
    combine   uint16 [T*k*H]   this rank's combine buffer (rows pushed by the expert ranks)
    ids       int32 [T*k]      this rank's top-k ids (-1 = masked)
    weights   float32 [T*k]    router weights
    out       uint16 [T*H]
    """
    acc = cuda.local.array(8, float32)
    rows = cuda.local.array((ROUTES_IN_FLIGHT, 4), uint32)
    wts = cuda.local.array(ROUTES_IN_FLIGHT, float32)
    live = cuda.local.array(ROUTES_IN_FLIGHT, boolean)
    chunks = H // 8
    i = cuda.grid(1)
    while i < T * chunks:
        t = i // chunks
        c = (i % chunks) * 8
        if has_shared:
            s0, s1, s2, s3 = ld_v4(y_shared, t * H + c)
            acc[0] = lo_bf16(s0)
            acc[1] = hi_bf16(s0)
            acc[2] = lo_bf16(s1)
            acc[3] = hi_bf16(s1)
            acc[4] = lo_bf16(s2)
            acc[5] = hi_bf16(s2)
            acc[6] = lo_bf16(s3)
            acc[7] = hi_bf16(s3)
        else:
            for q in range(8):
                acc[q] = float32(0.0)
        # A group's ids, weights and rows are all loaded before any is added, so they are in
        # flight together (a branch on each id before its row keeps one load in flight). A
        # masked route's row is loaded too (its buffer row is stale, never written) and dropped.
        for j0 in range(0, k, ROUTES_IN_FLIGHT):
            for b in range(ROUTES_IN_FLIGHT):
                j = j0 + b
                live[b] = False
                if j < k:
                    r = t * k + j
                    live[b] = ids[r] >= 0
                    wts[b] = weights[r]
                    rows[b, 0], rows[b, 1], rows[b, 2], rows[b, 3] = ld_v4(combine, r * H + c)
            for b in range(ROUTES_IN_FLIGHT):
                if live[b]:
                    _add_route(acc, wts[b], rows[b, 0], rows[b, 1], rows[b, 2], rows[b, 3])
        st_v4(out, t * H + c, pack_bf16x2(acc[0], acc[1]), pack_bf16x2(acc[2], acc[3]),
              pack_bf16x2(acc[4], acc[5]), pack_bf16x2(acc[6], acc[7]))
        i += cuda.gridsize(1)


@kjit
def router_grads_kernel(ids, pushed, out):
    """Launch: any grid. out[i] = pushed[i] where ids[i] >= 0 (a route an expert rank took:
    it pushed its d_w there), else 0 (masked, or a bad id the forward reported)."""
    i = cuda.grid(1)
    while i < out.shape[0]:
        out[i] = pushed[i] if ids[i] >= 0 else float32(0.0)
        i += cuda.gridsize(1)


# ---- host --------------------------------------------------------------------------------

def check_y(ws, y):
    """``y`` as a device view, checked: uint16 (bf16 bits) [capacity, H]."""
    return as_device_array(y, "y", dtype=np.uint16, shape=(ws.capacity, ws.hidden))


def check_epilogue(ws, router_weights, out, y_shared=None, tokens=None):
    """(router_weights, out, y_shared) as device views, checked: float32 [T, k], uint16 [T, H]
    and uint16 [T, H] (or None); T = ``tokens``, default T_max."""
    T, H, k = ws.tokens_per_rank if tokens is None else tokens, ws.hidden, ws.topk
    w = as_device_array(router_weights, "router_weights", dtype=np.float32, shape=(T, k))
    out = as_device_array(out, "out", dtype=np.uint16, shape=(T, H))
    if y_shared is not None:
        y_shared = as_device_array(y_shared, "y_shared", dtype=np.uint16, shape=(T, H))
    return w, out, y_shared


def combine(ws, schedule, y, stream=0) -> None:
    """Push this rank's expert outputs ``y`` (uint16 [capacity, H] device view) home."""
    launch(push_combine_kernel, comm_grid(), 32 * COMM_WARPS, stream, 0, flat(y),
           schedule.src_rank, schedule.src_token, schedule.src_slot, schedule.num_rows,
           ws.peer_combine, np.int64(ws.hidden), np.int64(ws.topk))


def epilogue(ws, router_weights, out, y_shared=None, stream=0) -> None:
    """out = y_shared + sum_j w_j * y_j (device views: router_weights float32 [T, k], out
    uint16 [T, H], y_shared uint16 [T, H] or None; T <= T_max, the step's tokens), after the
    combine's barrier."""
    T, H, k = out.shape[0], ws.hidden, ws.topk
    has_shared = y_shared is not None
    ys = y_shared if has_shared else out
    if T == 0:
        return
    chunks = T * H // 8
    blocks = min(4 * multiprocessor_count() if not SIM else 2, -(-chunks // COPY_THREADS))
    launch(combine_epilogue_kernel, blocks, COPY_THREADS, stream, 0,
           flat(ys), has_shared, flat(ws.combine_buf), flat(ws.ids_table[ws.rank]),
           flat(router_weights), flat(out), np.int64(T), np.int64(H), np.int64(k))


def router_grads(ids32, pushed, out, stream=0) -> None:
    """The backward's d_router_weights (float32 [T, k] ``out``) from the values the expert
    ranks pushed into ``pushed`` (float32 [T*k]), after the backward's barrier; ``ids32``
    (int32 [T, k]) is the forward's checked ids."""
    n = out.size
    if n == 0:
        return
    blocks = min(2 if SIM else 4 * multiprocessor_count(), -(-n // COPY_THREADS))
    launch(router_grads_kernel, blocks, COPY_THREADS, stream, 0, flat(ids32), pushed, flat(out))
