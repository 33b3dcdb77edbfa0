"""Epilogues of the grouped GEMMs: FP32 accumulators -> bf16 output rows.

    swiglu(g, u, L)   SiLU(min(g, L)) * clamp(u, -L, L) in float32 (L = +inf: plain SwiGLU);
                      both kernels' gate/up epilogue, rounded to bf16 once afterwards.

Staged epilogue of the wgmma kernel (``make_staged_epilogue``), per warp of a finished tile:

    1. the thread's fragment (rows r and r + 8, columns col + 8j (+1)) -> bf16 pairs in shared
       memory, row r at ``stage + r * stride``, column c at byte 2c (SWIGLU: gate columns
       [0, BN/2) and up columns [BN/2, BN) of the tile pair up into BN/2 hidden columns). The
       accumulator tuple is read at constant indices group by group (``tuple_fold``), never
       copied to local memory; each bf16 pair written is also folded into a running NaN/Inf
       check (``fold_nonfinite_bf16x2``: one fma.rn.bf16x2, two chains: rows r and r + 8).
       ``stride`` = row bytes + 16, so the 8 rows of a store land in 8 different bank
       groups. ``save_pre`` (SWIGLU): the same pass also stores the FP32 gate
       and up values it reads, unclamped, straight from the registers into ``pre`` = (gate,
       up) float32 [C * N_out] (one 8-byte st_v2_f32 per pair: a warp's store covers 8 rows x
       32 contiguous bytes, whole sectors). Not staged: FP32 gate and up of a tile are 4x the
       bf16 staging, which holds 2 ring stages. Not checked for NaN/Inf: h, made from them,
       is.
    2. fence.proxy.async (generic-proxy st.shared -> bulk-copy reads), __syncwarp: a warp
       stages exactly the 16 rows it sends, so a warp barrier suffices.
    3. the warp's 16 rows leave by bulk stores (one per row, then one commit): lane 0 sends
       all 16 into the output, or -- ``push``, the down GEMM (and the backward's d_x GEMM)
       fused with the combine -- lanes 0..15 one row each to its source rank's combine row
       ``peers[rank[r]][token[r] * k + slot[r]]`` (over NVLink for a peer; padding rows,
       rank < 0, are not sent). Each lane looks its row's route up (``route_home``) before
       step 1, so the loads' latency runs under the staging, in parallel across the rows.
    4. NaN/Inf check of what was staged (the values written or pushed): one warp vote on the
       folded flags -- all a clean tile costs besides the folds. Only when a lane saw one,
       lanes 0..15 recount one staged row each, and the warp's count (redux.sync), smallest
       row and the tile's expert go to the error word (``errors_record.record_gemm_non_finite``,
       one atomic each: order-independent, so the word is deterministic).

The caller owns the ordering around it: the staging area (ring stages the next tile's prologue
leaves free) may be rewritten only after the sending lanes' ``bulk_wait_read`` and a block
barrier, and the block's last stores must be waited (``bulk_wait``) before it exits.

Coalesced epilogue (``make_coalesced_epilogue``: the FP8 GEMMs, whose tiles come faster than
per-row bulk copies leave): steps 1 and 4 as above, but
the warp reads its 16 staged rows back after the __syncwarp and stores them with 16-byte
stores, a warp instruction covering 512 contiguous bytes (or, ``push``, 16-byte stores into
the source ranks' combine rows over NVLink, as the staged epilogue's bulk copies: lane i
looks row i % 16's route up before the staging, and the lanes storing a row's chunks read
it from that lane, ``warp_read`` -- loaded behind each store instead, the lookups serialised
the epilogue: the stores may alias the route, so no load passes one); rows at or
past ``rows`` (the tile's rows that are the expert's) are neither stored nor checked for
NaN/Inf. Plain generic stores: no proxy fence, and the staging may be rewritten once every
lane of the warp is past its reads (the caller's next block barrier).

TMA epilogue (``make_tma_epilogue``: the bf16 weight gradients, whose tiles are weight-sized
outputs after a K of an expert's rows -- the warps must go back to their wgmmas, not wait for
their stores), per warp of a finished plain tile, its 16 rows, in ``parts`` (1, 2 or 4: the
staging holds the tile's columns whole, or a half or a quarter of them), per part:

    1. every lane waits until its previous stores (the previous part's, or tile's) have read
       the staging (``bulk_wait_read(0)``: lane 0's are the warp's only ones; on a lane branch
       ptxas would serialise the wgmmas), __syncwarp
    2. the part's fragment -> bf16 pairs in BN / 64 / parts boxes of [16 rows][64 columns]
       with the 128-byte swizzle (row q at q * 128, 16-byte chunk c at chunk c ^ (q % 8): a
       warp's 8 rows of a store land in 8 bank groups), folded into the NaN/Inf check as in
       step 1 above
    3. fence.proxy.async, __syncwarp; lane 0 issues one TMA store per box (the tensor map
       clips what lies outside the output) and commits them as one bulk group
    4. a vote on the part's folded flags; where a lane saw a NaN/Inf, lanes 0..15 recount
       the part's swizzled rows, before the next part overwrites them
After the last part, one more vote over the warp's counts and a report (as step 4 above) of a tile
with any. The warp goes on while the TMA unit reads the staging and writes.
The caller acquires the maps before the first store and waits for the last stores
(``bulk_wait``) before the block exits (every lane, as in step 1).

FP32 TMA epilogue (``make_tma_epilogue_f32``: the weight gradients' FP32 outputs, stored or --
main-grad -- added to): steps 1-3 over [16][32] boxes of the same swizzle (one thread's pair
an 8-byte ``st.shared.v2.f32``), the warp's rows whole where the staging holds them (tiles up
to 128 wide), else twice, a half tile's columns at a time. Main-grad (``accumulate``, whole
tiles only): at the tile's start, before its K loop, lane 0 TMA-loads the output's values of
the warp's rows into its staging (``make_tma_prefetch_f32``, on the warp's own mbarrier,
once the previous tile's stores have read the staging: step 1 moves there), so the loads run
under the tile's MMAs; the epilogue waits for them, each thread adds its pairs to them in
place (``add_shared_v2_f32``: IEEE adds) and the tile leaves by plain TMA stores. Each output
element gets one add a launch (one tile owns it), so the sums are deterministic. Step 4 folds
the FP32 values (the addends; one fma each) and a bad tile recounts from the registers.

The staged, coalesced and TMA epilogues make their staging addresses per tile, from a base the
compiler cannot hoist out of the tile loop (``per_iteration``): hoisted, the 32 addresses
lived across the K loop beside the FP32 sums and the FP8 fragment, and ptxas spilled them,
reloaded every tile (the FP8 weight gradient's few-slice tiles paid it most: docs/perf.md).
"""
import math

from numba import cuda, float32, int32, int64, uint32, uint64

from ..bf16 import nonfinite_bf16x2
from ..cuda_compat import kjit
from ..errors import INT32_MAX
from ..errors_record import record_gemm_non_finite
from ..intrinsics import (add_shared_v2_f32, bulk_commit, bulk_store, bulk_wait_read,
                          ex2_approx, fence_proxy_async, fold_nonfinite_bf16x2, ld_v4,
                          mbarrier_arrive_expect_tx, pack_bf16x2, per_iteration, rcp_approx,
                          shared_addr, st_shared_u32, st_shared_v2_f32, st_v2_f32, st_v4,
                          syncwarp, tma_load_2d, tma_store_2d, tuple_fold,
                          tuple_pick, warp_all, warp_min, warp_read, warp_sum)

_NEG_LOG2E = float32(-1.4426950408889634)
_F32_INF = float32(math.inf)
_INT32_MAX = INT32_MAX
TMA_BOX_ROWS = 16              # a warp's rows of a tile: the TMA epilogue's box
TMA_BOX_BYTES = TMA_BOX_ROWS * 128      # [16 rows][64 bf16], 128-byte swizzle


@kjit(device=True, inline="always")
def swiglu(g, u, limit):
    """SiLU(min(g, L)) * clamp(u, -L, L) in float32, the sigmoid as 1 / (1 + 2^(-g log2 e)) by
    one SFU exp2 and one SFU reciprocal: a few float32 ulp for moderate g, more near g = -80
    (the rounding of g log2 e), and flushed to 0 below g ~ -87.3 (the SFU flushes denormals)
    -- all far below the bf16 rounding that follows. ``math.exp`` and ``/`` made each element
    a long dependent chain with a slow-path branch, unrolled over the whole tile (see
    docs/perf.md). Deterministic like the rest: same inputs, same bits."""
    g = min(g, limit)
    u = max(min(u, limit), -limit)
    return g * rcp_approx(float32(1.0) + ex2_approx(g * _NEG_LOG2E)) * u


def _stage_swiglu_group(j, bad, smem, r, col, limit, base, stride, g0, g1, g2, g3, u0, u1, u2,
                        u3):
    """8-column group j of a SwiGLU fragment: gate and up values of rows r (g0, g1 / u0, u1)
    and r + 8 (g2, g3 / u2, u3) -> bf16 pairs at hidden column col + 8j of the staging; the
    pairs folded into ``bad`` (rows r, r + 8: two chains, ``fold_nonfinite_bf16x2``)."""
    at = base + 2 * (col + 8 * j)
    lo = pack_bf16x2(swiglu(g0, u0, limit), swiglu(g1, u1, limit))
    hi = pack_bf16x2(swiglu(g2, u2, limit), swiglu(g3, u3, limit))
    st_shared_u32(smem, at + r * stride, lo)
    st_shared_u32(smem, at + (r + 8) * stride, hi)
    return fold_nonfinite_bf16x2(bad[0], lo), fold_nonfinite_bf16x2(bad[1], hi)


def _stage_swiglu_save_group(j, bad, smem, r, col, limit, base, stride, gate, up, at, row8,
                             lo_ok, hi_ok, g0, g1, g2, g3, u0, u1, u2, u3):
    """``_stage_swiglu_group`` (its body again: a group function cannot call another), and
    the FP32 gate and up values into ``gate`` / ``up`` at element ``at`` + 8j (row r, when
    ``lo_ok``) and ``at + row8`` + 8j (row r + 8, when ``hi_ok``: a row past the expert is the
    next one's)."""
    if lo_ok:
        st_v2_f32(gate, at + 8 * j, g0, g1)
        st_v2_f32(up, at + 8 * j, u0, u1)
    if hi_ok:
        st_v2_f32(gate, at + row8 + 8 * j, g2, g3)
        st_v2_f32(up, at + row8 + 8 * j, u2, u3)
    at_s = base + 2 * (col + 8 * j)
    lo = pack_bf16x2(swiglu(g0, u0, limit), swiglu(g1, u1, limit))
    hi = pack_bf16x2(swiglu(g2, u2, limit), swiglu(g3, u3, limit))
    st_shared_u32(smem, at_s + r * stride, lo)
    st_shared_u32(smem, at_s + (r + 8) * stride, hi)
    return fold_nonfinite_bf16x2(bad[0], lo), fold_nonfinite_bf16x2(bad[1], hi)


def _stage_plain_group(j, bad, smem, r, col, limit, base, stride, a0, a1, a2, a3):
    """8-column group j of a plain fragment -> bf16 pairs of rows r and r + 8, folded into
    ``bad``. (Both rows share the column offset: computed per row instead, ptxas keeps more
    registers and the 192-row kernels spill more.)"""
    at = base + 2 * (col + 8 * j)
    lo = pack_bf16x2(a0, a1)
    hi = pack_bf16x2(a2, a3)
    st_shared_u32(smem, at + r * stride, lo)
    st_shared_u32(smem, at + (r + 8) * stride, hi)
    return fold_nonfinite_bf16x2(bad[0], lo), fold_nonfinite_bf16x2(bad[1], hi)


def _stage_swizzled_group(j, bad, smem, base, q, a0, a1, a2, a3):
    """8-column group j of a plain fragment -> bf16 pairs of the warp's rows q and q + 8 in
    the 128-byte-swizzled boxes of a TMA store (box j // 8, 16-byte chunk (j % 8) ^ q of the
    row; ``base``: the thread's byte in chunk 0 of row q of box 0), folded into ``bad``."""
    at = base + (j // 8) * TMA_BOX_BYTES + ((j % 8) ^ q) * 16
    lo = pack_bf16x2(a0, a1)
    hi = pack_bf16x2(a2, a3)
    st_shared_u32(smem, at, lo)
    st_shared_u32(smem, at + 8 * 128, hi)
    return fold_nonfinite_bf16x2(bad[0], lo), fold_nonfinite_bf16x2(bad[1], hi)


def _swizzled_f32_group(write):
    """The group function staging a half tile's FP32 fragment by ``write`` (a two-float32
    shared-memory intrinsic): 8-column group j -> the thread's pairs in rows q and q + 8 of the
    half's 128-byte-swizzled [16][32] boxes: box j // 4, 16-byte chunk 2 (j % 4) + (lane % 4)
    // 2 of the row, written at chunk (2 (j % 4)) ^ hq, hq = ((lane % 4) // 2) ^ q (``base``:
    the thread's byte in chunk 0 of row q of box 0); the values folded into the NaN/Inf chains
    ``y`` (z + v * 0 stays zero while every v is finite)."""
    def group(j, y, smem, base, hq, a0, a1, a2, a3):
        at = base + (j // 4) * TMA_BOX_BYTES + ((2 * (j % 4)) ^ hq) * 16
        write(smem, at, a0, a1)
        write(smem, at + 8 * 128, a2, a3)
        zero = float32(0.0)
        return a1 * zero + (a0 * zero + y[0]), a3 * zero + (a2 * zero + y[1])
    return group


_stage_swizzled_f32_group = _swizzled_f32_group(st_shared_v2_f32)
# main-grad: the values added to those already staged there (the prefetched output)
_add_swizzled_f32_group = _swizzled_f32_group(add_shared_v2_f32)


def _count_nonfinite_f32_group(j, n, lane, a0, a1, a2, a3):
    """Group j's NaN/Inf values, added to ``n`` = (row r's, row r + 8's) counts (the bad
    path: ``lane`` unused, the fold's extra argument)."""
    return (n[0] + (0 if abs(a0) < _F32_INF else 1) + (0 if abs(a1) < _F32_INF else 1),
            n[1] + (0 if abs(a2) < _F32_INF else 1) + (0 if abs(a3) < _F32_INF else 1))


def _part_layout(part, parts):
    """Groups of the fragment's columns in part ``part`` of ``parts`` equal ones (a tile staged
    a part at a time)."""
    def layout(count):
        per = count // (4 * parts)
        return [[4 * j + i for i in range(4)] for j in range(part * per, (part + 1) * per)]
    return layout


def _swiglu_layout(count):      # group j: gate elements 4j.., up elements 4(j + half)..
    half = count // 8
    return [[4 * j + i for i in range(4)] + [4 * (j + half) + i for i in range(4)]
            for j in range(half)]


def _plain_layout(count):
    return [[4 * j + i for i in range(4)] for j in range(count // 4)]


def make_stage_tile(swiglu_epilogue, save_pre=False):
    """``stage_tile(acc, (0, 0), (smem, r, col, limit, base, stride[, gate, up, at, row8]))
    -> bad``: step 1 of the header (``save_pre``: the extra arguments say where the FP32 gate
    and up go); ``bad`` (two uint32) has a bit set outside 0x80008000 iff a staged value is
    NaN or Inf (``fold_nonfinite_bf16x2``)."""
    if save_pre:             # (plain functions: tuple_fold compiles them inline per group)
        return tuple_fold(_stage_swiglu_save_group, _swiglu_layout)
    if swiglu_epilogue:
        return tuple_fold(_stage_swiglu_group, _swiglu_layout)
    return tuple_fold(_stage_plain_group, _plain_layout)


@kjit(device=True, inline="always")
def bf16_nonfinite_count(smem, at, n):
    """NaN/Inf among the ``n`` bf16 at shared byte address ``at`` (relative to the array's
    ``shared_addr``; 4-byte aligned, n even): the bad path's recount of one staged row."""
    bad = 0
    for i in range(n // 2):
        w = uint32(smem[(at >> 1) + 2 * i]) | (uint32(smem[(at >> 1) + 2 * i + 1]) << 16)
        bad += nonfinite_bf16x2(w)
    return bad


@kjit(device=True, inline="always")
def report_warp(errors, tensor, rank, bad, row, expert):
    """Every lane: ``bad`` NaN/Inf values, the first in row ``row`` (any row when bad = 0);
    lane 0 records the warp's total, smallest row and ``expert`` (one atomic each)."""
    total = warp_sum(bad)
    first = warp_min(row if bad > 0 else _INT32_MAX)
    if cuda.threadIdx.x % 32 == 0:
        record_gemm_non_finite(errors, tensor, rank, total, first, expert)


@kjit(device=True, inline="always")
def route_home(route_rank, route_token, route_slot, k, grow):
    """Row ``grow``'s home for the fused combine: (source rank, combine row token * k + slot),
    int32 both; rank < 0 for padding. The push epilogues call it before staging the tile, so
    the three loads' latency runs under the staging instead of sitting between a row's
    staging and its store."""
    return (int32(route_rank[grow]),
            int32(route_token[grow] * k + route_slot[grow]))


def make_row_sender(push):
    """``send_row(out, peers, home, n_out, grow, col0, smem, src, nbytes)``: one staged row
    (``nbytes`` at the shared byte address ``src``) by a bulk store to row ``grow`` of ``out``
    (uint32 view, n_out bf16 columns) from column ``col0`` on, or with ``push`` to its source
    rank's combine row, ``home`` = ``route_home``'s (rank, combine row; not sent for rank <
    0)."""
    @kjit(device=True, inline="always")
    def send_row(out, peers, home, n_out, grow, col0, smem, src, nbytes):
        if push:
            if home[0] >= 0:
                # tuple_pick: ``peers[rank]`` lowers to a switch, which ptxas treats as
                # divergence and then serialises every wgmma of the kernel (C7518)
                bulk_store(tuple_pick(peers, home[0]),
                           (int64(home[1]) * n_out + col0) // 2, smem, src, nbytes)
        else:
            bulk_store(out, (grow * n_out + col0) // 2, smem, src, nbytes)
    return send_row


def make_staged_epilogue(bn, swiglu_epilogue, push, stage_offset, save_pre=False):
    """``stage_and_send(smem, acc, out, pre, peers, route_rank, route_token, route_slot, k,
    n_out, limit, ring, lane, frag_row, frag_col, row0, col0, stores, errors, nf)``: steps 1-3
    of the header for the tile at (row0, col0), staged at ``ring + stage_offset``
    (``save_pre``: g and u into ``pre`` on the way, else ``pre`` is unused); ``stores``: this
    warp's rows are the expert's (else it does nothing); then step 4 with ``nf`` = (tensor id,
    rank, B's first weight row, weight rows per expert): the expert is their quotient,
    computed on the bad path only. Returns it and the staging's bytes per tile row (the
    caller checks they fit)."""
    assert swiglu_epilogue or not save_pre
    out_row_bytes = (bn // 2 if swiglu_epilogue else bn) * 2     # bf16 of one output row
    stride = out_row_bytes + 16             # +16: a warp's 8 rows land in 8 bank groups
    stage_tile = make_stage_tile(swiglu_epilogue, save_pre)
    send_row = make_row_sender(push)

    @kjit(device=True, inline="always")
    def stage_and_send(smem, acc, out, pre, peers, route_rank, route_token, route_slot, k,
                       n_out, limit, ring, lane, frag_row, frag_col, row0, col0, stores, errors,
                       nf):
        # The vote makes the branch warp-uniform to ptxas: a warp barrier on a path it thinks
        # divergent serialises every wgmma of the kernel (C7518).
        if warp_all(stores) != 0:
            epi0 = per_iteration(uint32(ring + stage_offset))   # (module header)
            srow = frag_row - lane // 4 + lane % 16     # the warp's first row + lane % 16
            home = (int32(-1), int32(0))
            if push:                       # the route first: its loads run under the staging
                home = route_home(route_rank, route_token, route_slot, k, row0 + srow)
            if save_pre:                   # this thread's first element of g / u
                bad = stage_tile(acc, (uint32(0), uint32(0)),
                                 (smem, frag_row, frag_col, limit, epi0, stride, pre[0],
                                  pre[1], (row0 + frag_row) * n_out + col0 + frag_col,
                                  8 * n_out, True, True))
            else:
                bad = stage_tile(acc, (uint32(0), uint32(0)),
                                 (smem, frag_row, frag_col, limit, epi0, stride))
            fence_proxy_async()            # generic-proxy writes -> bulk reads
            syncwarp()
            if push:
                if lane < 16:
                    send_row(out, peers, home, n_out, row0 + srow, col0, smem,
                             epi0 + srow * stride, out_row_bytes)
                    bulk_commit()
            elif lane == 0:
                for i in range(16):            # lane 0's row is the warp's first
                    send_row(out, peers, home, n_out, row0 + frag_row + i, col0, smem,
                             epi0 + (frag_row + i) * stride, out_row_bytes)
                bulk_commit()
            # 4. a clean tile costs one vote; else lanes 0..15 recount the warp's 16 staged
            # rows (synced above) and the warp reports (``report_warp``).
            if warp_all(((bad[0] | bad[1]) & uint32(0x7FFF7FFF)) == 0) == 0:
                n = 0
                if lane < 16:
                    n = bf16_nonfinite_count(smem, epi0 + srow * stride - shared_addr(smem),
                                             out_row_bytes // 2)
                report_warp(errors, nf[0], nf[1], n, row0 + srow, nf[2] // nf[3])

    return stage_and_send, stride


@kjit(device=True, inline="always")
def report_stored_rows(smem, bad, rows, rel, stride, cols, row0, lane, frag_row, m0, e, errors,
                       nf_tensor, nf_rank):
    """Step 4 of a coalesced epilogue: a clean tile costs one vote; else lanes 0..15 recount
    the warp's 16 staged rows (staged from shared byte ``rel``, ``stride`` apart, ``cols``
    bf16 each) and report. Only rows stored count: rows past the expert may hold anything (the
    FP8 GEMM computes them from whatever A rows follow, times a zero scale)."""
    lo_bad = bad[0] if frag_row < rows else uint32(0)
    hi_bad = bad[1] if frag_row + 8 < rows else uint32(0)
    if warp_all(((lo_bad | hi_bad) & uint32(0x7FFF7FFF)) == 0) == 0:
        srow = row0 + lane % 16
        n = 0
        if lane < 16 and srow < rows:
            n = bf16_nonfinite_count(smem, rel + srow * stride, cols)
        report_warp(errors, nf_tensor, nf_rank, n, m0 + srow, e)


def make_coalesced_epilogue(bn, swiglu_epilogue=False, save_pre=False, push=False):
    """``epilogue(smem, acc, out, grow0, m0, n0, e, N, rows, epi0, lane, frag_row, frag_col,
    limit, errors, nf_tensor, nf_rank, pre, route)``: the finished tile, bf16 -- plain, or (SWIGLU)
    the BN/2 hidden columns of its gate and up halves (``limit``: the clamp) -- staged at the
    shared byte address ``epi0`` (row stride: the row's bytes + 16) and stored coalesced
    (module header) to rows grow0 + i < grow0 + rows of ``out`` (uint32 view, N bf16
    columns), columns n0 ..; NaN/Inf reported as D_e's rows m0 + i. ``save_pre`` (SWIGLU):
    the FP32 gate and up values also go from the registers into ``pre`` = (gate, up) float32
    [C * N], the same rows and columns (else ``pre`` is unused). ``push`` (the down GEMM, or
    the backward's d_x GEMM, fused with the combine): row grow goes to its source rank's
    combine row instead, ``route``
    = (rank, token, slot, peers, k): peers[rank[grow]] (uint32 views, N bf16 columns) row
    token[grow] * k + slot[grow]; a row of rank < 0 (padding) is not sent (else ``route`` is
    unused)."""
    assert swiglu_epilogue or not save_pre
    assert not (push and swiglu_epilogue)
    cols = bn // 2 if swiglu_epilogue else bn
    stride = cols * 2 + 16
    cpr = cols // 8                         # 16-byte chunks per output row
    chunks = 16 * cpr // 32                 # per lane, of its warp's 16 rows
    RPI = 32 // cpr                         # rows a warp instruction covers
    assert 32 % cpr == 0
    stage_tile = make_stage_tile(swiglu_epilogue, save_pre)

    @kjit(device=True, inline="always")
    def epilogue(smem, acc, out, grow0, m0, n0, e, N, rows, epi0, lane, frag_row, frag_col,
                 limit, errors, nf_tensor, nf_rank, pre, route):
        epi0 = per_iteration(uint32(epi0))      # addresses per tile (module header)
        row0 = frag_row - lane // 4             # the warp's first row
        home = (int32(-1), int32(0))
        if push:
            # lane i looks row row0 + i % 16's route up now (the staging hides the loads);
            # the lanes storing that row's chunks read it from lane i below
            if row0 + lane % 16 < rows:
                home = route_home(route[0], route[1], route[2], route[4],
                                  uint64(grow0 + row0 + lane % 16))
        if save_pre:
            bad = stage_tile(acc, (uint32(0), uint32(0)),
                             (smem, frag_row, frag_col, limit, epi0, stride, pre[0], pre[1],
                              (grow0 + frag_row) * N + n0 + frag_col, 8 * N, frag_row < rows,
                              frag_row + 8 < rows))
        else:
            bad = stage_tile(acc, (uint32(0), uint32(0)),
                             (smem, frag_row, frag_col, limit, epi0, stride))
        syncwarp()
        rel = epi0 - shared_addr(smem)
        # Chunk i of a lane: row r0 + i * RPI, 16-byte column ``col`` (cpr divides 32), so
        # every address is a per-lane base plus a constant or loop-invariant step: the
        # divisions, modulos and 64-bit products per chunk were most of the epilogue's
        # instructions, and the short-K kernels are issue-bound (docs/perf.md).
        col = lane % cpr
        r0 = row0 + lane // cpr
        s_at = (rel + r0 * stride + col * 16) >> 1
        g_at = uint64((grow0 + r0) * N + n0 + col * 8) >> uint64(1)
        g_step = uint64(RPI * N) >> uint64(1)
        for i in range(chunks):
            r = r0 + i * RPI
            rank, crow = int32(-1), int32(0)
            if push:                        # every lane: the shuffles are warp-wide
                rank = warp_read(home[0], r - row0)
                crow = warp_read(home[1], r - row0)
            if r < rows:
                v0, v1, v2, v3 = ld_v4(smem, s_at + i * (RPI * stride // 2))
                if push:
                    if rank >= 0:
                        # tuple_pick: ``peers[rank]`` would lower to a switch (C7518)
                        st_v4(tuple_pick(route[3], rank),
                              uint64(int64(crow) * N + n0 + col * 8) >> uint64(1),
                              v0, v1, v2, v3)
                else:
                    st_v4(out, g_at + uint64(i) * g_step, v0, v1, v2, v3)
        report_stored_rows(smem, bad, rows, rel, stride, cols, row0, lane, frag_row, m0, e,
                           errors, nf_tensor, nf_rank)

    return epilogue


def _make_box_sender(boxes, box_cols):
    """``send(smem, maps, elem, grow, col0, epi0, lane)``: the warp's staged boxes (its lanes'
    generic-proxy writes) fenced for the TMA unit, then lane 0 stores ``boxes`` boxes of
    ``box_cols`` columns from ``epi0`` on to (col0 + box_cols b, grow) of map ``elem`` by
    TMA, one bulk group."""
    @kjit(device=True, inline="always")
    def send(smem, maps, elem, grow, col0, epi0, lane):
        fence_proxy_async()            # generic-proxy writes -> the TMA unit's reads
        syncwarp()
        if lane == 0:
            for b in range(boxes):
                tma_store_2d(maps, elem, smem, epi0 + b * TMA_BOX_BYTES, col0 + box_cols * b,
                             grow)
            bulk_commit()
    return send


def make_tma_epilogue(bn, parts=1):
    """``epilogue(smem, acc, maps, elem, grow, col0, m, e, epi0, lane, errors, nf_tensor,
    nf_rank)``: the warp's 16 rows of a finished plain tile, bf16, staged at the shared byte
    address ``epi0`` (1024-byte aligned; ``TMA_BOX_BYTES`` boxes: BN / 64 of them, or BN / 64
    / ``parts`` -- the tile's columns a part at a time, each part staged once the previous
    one's stores have read the staging) and stored by TMA into the 2-D tensor map at
    ``maps[elem:]`` (``[TMA_BOX_ROWS, 64]`` boxes) at rows grow .. grow + 15, columns col0 ..;
    NaN/Inf reported as D_e's rows m + i of expert e. The caller waits for the warp's last
    stores (``bulk_wait``) before the block exits and acquires the maps
    (``tensormap_acquire``) first, on every lane (lane 0's count)."""
    assert parts in (1, 2, 4) and bn % (64 * parts) == 0
    boxes = bn // 64 // parts
    stage = [tuple_fold(_stage_swizzled_group, _part_layout(p, parts)) for p in range(parts)]
    send = _make_box_sender(boxes, 64)

    @kjit(device=True, inline="always")
    def recount(bad, smem, epi0, lane):
        # a clean staging costs one vote (the report's a second, once a tile); else lanes
        # 0..15 recount one staged row each (its chunks swizzled within the row: a count does
        # not care). Every lane counts (16..31 a row again, not reported): shared loads on a
        # branch of some lanes make ptxas serialise the kernel's wgmmas (C7518)
        n = 0
        if warp_all(((bad[0] | bad[1]) & uint32(0x7FFF7FFF)) == 0) == 0:
            rel = epi0 - shared_addr(smem) + (lane % 16) * 128
            for b in range(boxes):
                n += bf16_nonfinite_count(smem, rel + b * TMA_BOX_BYTES, 64)
        return n if lane < 16 else 0

    step = bn // parts

    def make_part(stage_part, offset):
        @kjit(device=True, inline="always")
        def part(smem, acc, maps, elem, grow, col0, epi0, lane, base, q):
            # the previous part's stores (or the previous tile's) past their reads (every
            # lane: lane 0's groups are the only ones; a wait on a branch of lane 0 would make
            # ptxas serialise the wgmmas)
            bulk_wait_read(0)
            syncwarp()
            bad = stage_part(acc, (uint32(0), uint32(0)), (smem, base, q))
            send(smem, maps, elem, grow, col0 + offset, epi0, lane)
            return recount(bad, smem, epi0, lane)
        return part

    part0, part1, part2, part3 = [make_part(stage[p % parts], p % parts * step)
                                  for p in range(4)]   # (parts 1 and 2: unused repeats)

    @kjit(device=True, inline="always")
    def epilogue(smem, acc, maps, elem, grow, col0, m, e, epi0, lane, errors, nf_tensor,
                 nf_rank):
        q = lane // 4
        # (addresses per tile: module header)
        base = per_iteration(uint32(epi0 + q * 128 + 4 * (lane % 4)))
        n = part0(smem, acc, maps, elem, grow, col0, epi0, lane, base, q)
        if parts > 1:
            n += part1(smem, acc, maps, elem, grow, col0, epi0, lane, base, q)
        if parts > 2:
            n += part2(smem, acc, maps, elem, grow, col0, epi0, lane, base, q)
            n += part3(smem, acc, maps, elem, grow, col0, epi0, lane, base, q)
        if warp_all(n == 0) == 0:
            report_warp(errors, nf_tensor, nf_rank, n, m + lane % 16, e)

    return epilogue


def f32_whole(bn):
    """Whether a warp stages its rows of an FP32 tile ``bn`` wide whole (BN / 32 boxes: at
    128 columns what a 256-wide bf16 tile takes) rather than half at a time."""
    return bn <= 128


def make_tma_prefetch_f32(bn):
    """``prefetch(smem, maps, elem, grow, col0, epi0, lane, bar)``: main-grad's first step, at
    a tile's start: once the warp's previous TMA stores have read its staging, lane 0 loads
    the warp's 16 rows x BN FP32 columns of the output (rows grow .., columns col0 .., map
    ``maps[elem:]``) into it by TMA, BN / 32 swizzled [16][32] boxes -- the layout
    ``make_tma_epilogue_f32`` stages its values in -- completing the mbarrier at ``bar``
    (expecting their bytes), so the loads run under the tile's MMAs."""
    boxes = bn // 32

    @kjit(device=True, inline="always")
    def prefetch(smem, maps, elem, grow, col0, epi0, lane, bar):
        # (every lane waits: a wait on a branch of lane 0 would make ptxas serialise the
        # wgmmas)
        bulk_wait_read(0)
        syncwarp()
        if lane == 0:
            mbarrier_arrive_expect_tx(smem, bar, boxes * TMA_BOX_BYTES)
            for b in range(boxes):
                tma_load_2d(smem, epi0 + b * TMA_BOX_BYTES, maps, elem, col0 + 32 * b, grow, bar)

    return prefetch


def make_tma_epilogue_f32(bn, accumulate):
    """``make_tma_epilogue``'s ``epilogue`` for FP32 outputs (same arguments; the maps float32,
    ``[TMA_BOX_ROWS, 32]`` boxes): the warp's 16 rows x BN columns staged into swizzled
    [16][32] boxes and stored by one TMA store a box. Up to 128 columns (``f32_whole``) the
    staging holds the warp's whole FP32 tile (BN / 32 boxes), stored at once; else half of it
    (BN / 64 boxes, what the bf16 tile takes), the second half staged once the first's stores
    have read the staging (a wait in the middle of the epilogue). ``accumulate`` (main-grad,
    whole tiles only): the staging already holds the output's values
    (``make_tma_prefetch_f32``, completed: the caller waited on its mbarrier) and each thread
    adds its pairs to them in place (``add_shared_v2_f32``: ``out + acc`` rounded once,
    IEEE), so the tile leaves as plain stores and each element gets one add a launch --
    deterministic. The NaN/Inf check folds
    the values staged (with ``accumulate``: the addends -- a NaN/Inf already in the buffer
    came from an earlier call, which reported it, or from the caller; an FP32 overflow of the
    add itself goes unseen); a bad tile recounts from the registers."""
    whole = f32_whole(bn)
    assert bn % 64 == 0 and (whole or not accumulate)
    if whole:
        stage_all = tuple_fold(_add_swizzled_f32_group if accumulate
                               else _stage_swizzled_f32_group, _plain_layout)
        send_all = _make_box_sender(bn // 32, 32)
    else:
        stage0 = tuple_fold(_stage_swizzled_f32_group, _part_layout(0, 2))
        stage1 = tuple_fold(_stage_swizzled_f32_group, _part_layout(1, 2))
        send_half = _make_box_sender(bn // 64, 32)
    count_tile = tuple_fold(_count_nonfinite_f32_group, _plain_layout)

    @kjit(device=True, inline="always")
    def epilogue(smem, acc, maps, elem, grow, col0, m, e, epi0, lane, errors, nf_tensor,
                 nf_rank):
        q = lane // 4
        base = per_iteration(uint32(epi0 + q * 128 + 8 * (lane % 2)))
        hq = uint32(((lane % 4) // 2) ^ q)
        zero = float32(0.0)
        if not accumulate:
            # (every lane waits: lane 0's groups are the warp's only ones, and a wait on a
            # branch of lane 0 would make ptxas serialise the wgmmas)
            bulk_wait_read(0)          # the previous tile's stores have read the staging
            syncwarp()
        if whole:
            y = stage_all(acc, (zero, zero), (smem, base, hq))
            send_all(smem, maps, elem, grow, col0, epi0, lane)
        else:
            y = stage0(acc, (zero, zero), (smem, base, hq))
            send_half(smem, maps, elem, grow, col0, epi0, lane)
            bulk_wait_read(0)          # ... and this tile's first half
            syncwarp()
            y = stage1(acc, y, (smem, base, hq))
            send_half(smem, maps, elem, grow, col0 + bn // 2, epi0, lane)
        # a clean tile costs one vote; else each lane counts its values, by row
        if warp_all(y[0] + y[1] == zero) == 0:
            n = count_tile(acc, (int32(0), int32(0)), (lane,))
            first = m + q if n[0] > 0 else m + q + 8
            report_warp(errors, nf_tensor, nf_rank, n[0] + n[1], first, e)

    return epilogue
