"""FP8 grouped GEMM on Hopper (wgmma e4m3, DeepSeek-V3's block scaling), with its host launch.

For the rows r of each expert e, offsets[e] <= r < offsets[e + 1] (clamped to num_rows[0]):

    out[r, n] = bf16( sum_k A[r, k] * W_e[n, k] )
    A[r, k]   = a[r, k] * a_scale[r, k // 128]                   (1 x 128 blocks)
    W_e[n, k] = w[e, n, k] * w_scale[e, n // 128, k // 128]      (128 x 128 blocks)

with a and w e4m3 bytes, both K-major (the layout ``mok_core.quantize.quantize_fp8`` writes,
untransposed), the scales
float32 divisors (value = byte's e4m3 value x scale). Rows of no expert are not written.

    block    = 384 threads: warpgroups 0 and 1 compute (warpgroup g owns tile rows [64 g,
               64 g + 64) and every column), warpgroup 2 loads (the producer: its first
               thread the operands by TMA, every thread one row's scales); the producer
               warpgroup gives registers back (setmaxnreg: 40 per
               thread) so the compute ones hold 232 -- the FP32 sum, the slice's fragment
               and the addressing (launch bounds alone give 168); the two add up to the
               block's 168 a thread at launch, as they must
    tiles    = per expert ceil(rows / 128) row tiles that never cross into the next expert
               (``sm90``'s tile table) x N / BN column tiles, BN = 128 or 256 (SWIGLU: N /
               (BN / 2), a tile pairing BN / 2 gate rows of w0 with the same up rows of w1),
               in the order (expert, column tile, row tile); block b takes tiles b, b + grid
    K slice  = 128 of K: one 128-byte row of e4m3 per tile row -- the 128-byte swizzle's row
               and one scale block of both operands
    ring     = STAGES slices of [A: 128 rows x 128 B | B: BN rows x 128 B] (32 / 48 KiB), from a
               1024-byte boundary; 16-byte chunk c of row r at chunk c ^ (r % 8) (TMA's
               128-byte swizzle, what the descriptors say); mbarriers full[s] (129 arrivals:
               the TMA thread's with the stage's bytes, and every producer thread's once its
               scales landed) and empty[s] (256 arrivals: every compute thread)
    scales   = beside each stage, before the ring: bm + 2 floats -- the slice's a_scale
               of the tile's bm rows (0 past the expert's rows), w0's and w1's scale blocks
               -- copied by the producer threads (row p by thread p; the two blocks by threads
               0 and 1) with cp.async, each thread's arrival on full[s] made by the hardware
               once its copies landed (``cp_async_mbarrier_arrive``: a load never stalls the
               producer's stream), read by the compute threads from shared memory (loaded
               by the compute warps themselves, their latency sat between a slice's wait and
               its promotion: docs/perf.md, the FP8 GEMM's parts)
    loads    = TMA, 2 + BN / 64 boxes of 64 rows x 128 B a slice (A rows row0 .. row0 + 127 -- rows
               past the expert are the next one's or zero-filled past the array, computed and
               never stored --, B's rows of w0 / w1) from tensor maps over the uint16 views
               (``tensor_map``: 128 bytes a box row, the dtype only sizes the copy)
    stream   = the producer walks the block's slices across its tiles (slice j into stage
               j % STAGES), so the next tile's slices land while this one's finish and store
    MMA      = per slice, per warpgroup and 128 columns: 4 x wgmma m64n128k32 e4m3 (+ 32 bytes a
               k32 step; the first with scale-d 0: a fresh fragment) into an FP32 fragment,
               commit, wait(0), then the promotion (``promote_fp8``) into that half's FP32
               sum: acc += part * (a_scale[row, kb] * w_scale[e, nb, kb]), each of the
               thread's two rows with its own scale (0 for a row past the expert). The tensor
               cores' running sum keeps fewer bits than FP32: one slice (128 of K) is all it
               holds
    epilogue = ``epilogue.make_coalesced_epilogue``: the bf16 tile staged apart from the ring
               (128 rows; each warp its own 16 rows), stored coalesced, NaN/Inf of the rows
               stored reported

192-row tiles (``make_fp8_gemm(bm=192)``, 128 columns; ``gemm.fp8_rows_tile`` picks them for
experts of 113-192 rows, where 128-row tiles compute up to 256): three compute warpgroups
(512 threads, 128 registers each at launch; setmaxnreg 160 / 32), 3 A boxes a slice, producer
threads 0..63 also stage row p + 128's scale, the staging 192 rows -- otherwise the kernel
above; bit-equal to the 128-row tiles.

Order. Producer thread p, slice j of its stream (tile t, slice kb):
    j >= STAGES: wait empty[j % STAGES] (parity (j / STAGES - 1) & 1) -> both warpgroups
    retired slice j - STAGES's wgmmas and read its scales; p = 0: arrive.expect_tx(full[s],
    the stage's bytes), its TMA boxes; every p: its scale(s) cp.async-copied, the arrival on
    full[s] that lands with them.
Compute warpgroup, slice j (BN = 128):
    1. wait full[j % STAGES] (parity (j / STAGES) & 1) -> the slice and its scales landed
    2. wgmma.fence; 4 wgmmas; commit
    3. the slice's scales from shared memory (under the MMAs)
    4. wgmma.wait(0); arrive empty[j % STAGES] (the stage may be refilled); promote
    (BN = 256: the second half's 4 wgmmas after the first half's wait(0) and promotion, then
    wait(0), arrive empty, promote: the scales are read before the stage is released)
    after a tile's last slice: __syncwarp, the epilogue (no block barrier: the warpgroups
    drift apart by up to a ring, which is what lets one's promotion overlap the other's
    wgmmas)
No block barrier after the prologue (tile table, mbarrier init). Waits are bounded (a trap,
not a hang). The producer's exit leaves its last TMA boxes and scale copies in flight: the
compute warps wait for them on full[s] (whose arrivals the copies make as they land) before
the block can end.

WGRAD (``make_fp8_gemm(wgrad=True)``, ``launch_fp8_wgrad``): the weight gradient, grouped
over K -- for each expert e, over its rows r in [lo_e, hi_e) = [offsets[e], min(offsets[e + 1],
num_rows[0])):

    D_e[m, n] = sum_r A[m, r] * B[n, r]                      (FP32; rows m < m_split of D_e
                                                              -> out0[e], the others -> out1[e])
    A[m, r] = a[m, r] * a_scale[m, r // 128]                  (1 x 128 blocks along r)
    B[n, r] = b[n, r] * b_scale[n // 128, r // 128]           (128 x 128 blocks)

``a`` [M, R] and ``b`` [N, R] are ``wgrad``'s two operands transposed and quantised along the
rows (e4m3 wgmma reads K-major only: the reduction's rows must be contiguous), so they take
the places of the forward's ``a`` and ``w``: the same block, ring, stream, loads, MMA,
promotion and epilogue, with
    tiles    = E x (M / 128) x (N / BN) whatever the routing, order (expert, column tile,
               row tile); a tile lies on one side of m_split (a multiple of 128): D_e's row m
               is out0's row e m_split + m, or out1's e (M - m_split) + m - m_split
    K slices = those of [lo_e, hi_e) (lo_e a multiple of 128: a scale block never spans two
               experts), read from ``slice_table`` (each offset's slice, in shared memory,
               where the forward keeps its tile table); an expert of no rows runs one slice
               past the operands' end (TMA zero-fills it, its factors 0): its gradient tile
               is written as zeros
    epilogue = ``sm90_wgrad.make_epilogues`` (the bf16 weight gradient's, the same fragment
               layout): bf16 -- each compute warp stages its 16 rows as BN / 64 swizzled
               boxes (or, beside 256's 4-slice ring, a quarter of them at a time, each
               quarter once the previous one's stores read the staging: ``wgrad_parts``)
               and one lane stores them by TMA (``omaps``: out0's and out1's tensor
               maps, ``sm90_wgrad.output_maps``), the warp back to its wgmmas while they
               leave -- a gradient tile is a weight-sized write after a few slices; every
               compute warp waits for its stores before the block exits. FP32 (OUT_F32):
               the same through FP32 maps, whole at BN = 128, half a tile at a time at 256;
               ACCUMULATE (main-grad, BN = 128): the output's values TMA-loaded into each
               warp's staging as the tile starts (its mbarrier of the 8 after empty[]),
               the tile added to them there, stored
Preconditions (the caller's; the padded layout and the transposed quantisation give them):
offsets multiples of 128, and both operands zero from hi_e to the end of its last slice --
the slice is read whole.

C7518: the role test is a warp vote (``warp_all``); no branch around a wgmma tests anything
but block-uniform values, and the K loop runs at least once (K >= 128), testing its exit at
the end (``sm90``).
Determinism: one block owns a tile, slices promoted in ascending K, no atomics on data.
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from numba import cuda, float32, int64, uint16, uint32

from ..cuda_compat import SIM, flat_view, kjit, launch, multiprocessor_count
from ..intrinsics import (bulk_wait, cp_async_4_at, cp_async_mbarrier_arrive, f32_zeros,
                          fence_mbarrier_init, mbarrier_arrive,
                          mbarrier_arrive_expect_tx, mbarrier_init, promote_fp8,
                          setmaxnreg_dec, setmaxnreg_inc, shared_addr, syncwarp,
                          tensormap_acquire, tma_load_2d, warp_all, wgmma_commit,
                          wgmma_fence, wgmma_m64n128k32_e4m3, wgmma_m64n128k32_e4m3_fresh,
                          wgmma_wait)
from .epilogue import make_coalesced_epilogue
from .sm90 import (_DESC_HIGH, _TABLE_BYTES, find_tile_in_table, tile_table, wait_phase,
                   warpgroup_fragment)
from .sm90_wgrad import (SMEM_LIMIT, make_epilogues, output_maps, output_place, staging_parts,
                         warp_staging_bytes)
from .tensor_map import MAP_ELEMS, tensor_maps

BM = 128                      # tile rows: 2 warpgroups of 64
BN = 128                      # tile columns: one 128-wide scale block of W
BK = 128                      # K slice: 128 e4m3 = 128 bytes = the swizzle atom's row
SCALE_BLOCK = 128
ROW_BYTES = BK
THREADS = 2 * BM              # compute threads
GEMM_THREADS = THREADS + 128  # + the producer warpgroup
LAUNCH_REGS = 168             # registers per thread at launch: 64 Ki / 384, rounded down to 8
COMPUTE_REGS = 232            # registers per thread: compute warpgroups (setmaxnreg) ...
PRODUCER_REGS = 40            # ... and the producer's: together exactly the block's launch
# registers. setmaxnreg only moves registers within the block: asking for more (48 here: 1 Ki
# over) faulted on a later driver (580.159) though an earlier one had granted it.
assert 2 * 128 * COMPUTE_REGS + 128 * PRODUCER_REGS == 3 * 128 * LAUNCH_REGS
BOX_ROWS = 64                 # a TMA box: 64 rows x 128 bytes
BOX_BYTES = BOX_ROWS * ROW_BYTES
_K32 = 32 >> 4                # K-major: a k32 step is 32 bytes along the 128-byte row
NACC = BN // 2                # fp32 accumulators per thread (and as many for a slice)
PRODUCERS = GEMM_THREADS - THREADS
assert PRODUCERS == BM        # producer thread p stages tile row p's scale (and p + 128's)
# 192-row tiles (``make_fp8_gemm(bm=192)``, 128 columns): three compute warpgroups and the
# producer's, 128 registers a thread at launch; 3 x 160 + 32 = 4 x 128
ROWS192_REGS = (160, 32)
assert 3 * 128 * ROWS192_REGS[0] + 128 * ROWS192_REGS[1] == 4 * 128 * 128


def scale_stage_bytes(bm=BM):
    """A slice's scales (``bm`` rows' a_scale, then w0's and w1's block), in 16-byte units."""
    return -(-4 * (bm + 2) // 16) * 16


def scales_offset(stages):
    """Byte offset of the scales' ring in the block's shared memory: past the tile table, the
    2 STAGES mbarriers and the 8 compute warps' (WGRAD's main-grad prefetch)."""
    return _TABLE_BYTES + 16 * stages + 64


def _ring_bytes(stages, bn, bm):
    """Shared memory up to the ring's end: the tile table, 2 STAGES mbarriers and the 8
    compute warps' (WGRAD's main-grad prefetch), the STAGES slices' scales, slack to align the
    ring to 1024 bytes, the ring."""
    return (scales_offset(stages) + stages * scale_stage_bytes(bm) + 1024
            + stages * (bm + bn) * ROW_BYTES)


def wgrad_parts(stages, bn, out_f32=False):
    """The parts a WGRAD compute warp stages its 16 rows of a bf16 tile in
    (``sm90_wgrad.staging_parts`` beside the ring of ``stages``): whole at 128 columns and at
    256 with 3 stages, a quarter at a time beside 256's 4-slice ring. (FP32 tiles: 1, their
    own split, ``epilogue.f32_whole``.)"""
    return 1 if out_f32 else staging_parts(bn, SMEM_LIMIT - _ring_bytes(stages, bn, BM))


def smem_bytes(stages, bn=BN, swiglu_epilogue=False, wgrad=False, out_f32=False, bm=BM):
    """Dynamic shared memory of one GEMM block: ``_ring_bytes``, then the staged output tile
    (WGRAD: the 8 compute warps' TMA boxes, ``sm90_wgrad.warp_staging_bytes`` of
    ``wgrad_parts``)."""
    cols = bn // 2 if swiglu_epilogue else bn
    staging = bm * (2 * cols + 16)
    if wgrad:
        staging = 8 * warp_staging_bytes(bn, out_f32, wgrad_parts(stages, bn, out_f32))
    return _ring_bytes(stages, bn, bm) + staging


@kjit(device=True, inline="always")
def ring_start(area):
    """The ring's first byte: the first 1024-byte boundary at or after the shared byte address
    ``area`` (the 128-byte swizzle repeats every 8 rows of 128 bytes: descriptors with base
    offset 0 need that alignment)."""
    return area + (1024 - area % 1024) % 1024


@kjit(device=True, inline="always")
def stage0_descriptors(ring, wg, bm=BM):
    """Stage 0's wgmma descriptors for warpgroup ``wg``: its 64 A rows and B (after A's
    ``bm`` rows); a stage s is ``(s * stage bytes) >> 4`` further on."""
    return (int64(_DESC_HIGH) + int64((ring + wg * 64 * ROW_BYTES) >> 4),
            int64(_DESC_HIGH) + int64((ring + bm * ROW_BYTES) >> 4))


@kjit(device=True, inline="always")
def mma_slice(part, smem, da, db):
    """One K slice into a fresh fragment: wgmma.fence, the first k32 step with scale-d 0 (so
    only wgmmas ever write the fragment: C7518), 3 more accumulating, commit."""
    part = wgmma_fence(part)
    part = wgmma_m64n128k32_e4m3_fresh(part, smem, da, db)
    part = wgmma_m64n128k32_e4m3(part, smem, da + _K32, db + _K32)
    part = wgmma_m64n128k32_e4m3(part, smem, da + 2 * _K32, db + 2 * _K32)
    part = wgmma_m64n128k32_e4m3(part, smem, da + 3 * _K32, db + 3 * _K32)
    wgmma_commit()
    return part


@kjit(device=True, inline="always")
def _slice_scales(scales, at, r, bm):
    """The promotion's four factors of a slice (``promote_fp8``) from its scales staged at
    float ``at`` of ``scales`` (``stage_scales``): A's tile rows r and r + 8 (the thread's two)
    x w0's scale block (the tile's first half of columns) and x w1's (the second). A row past
    the expert's has a_scale 0 there (its values are not the GEMM's, and never stored), and a
    tile of no rows (WGRAD: an expert without tokens) W's blocks 0 too: its factors are 0
    whatever the scales in memory. ``bm``: the tile's rows (the W blocks follow them).
    Unsigned indices: no negative-index wraparound code."""
    i = uint32(at)
    s0 = scales[i + uint32(bm)]
    s1 = scales[i + uint32(bm) + 1]
    a_lo = scales[i + uint32(r)]
    a_hi = scales[i + uint32(r) + 8]
    return a_lo * s0, a_hi * s0, a_lo * s1, a_hi * s1


@kjit(device=True, inline="always")
def _stage_row_scale(smem, dst, q, a_scale, row0, row_end, kb, ktiles):
    """Tile row q's a_scale of slice kb (a_scale's row row0 + q; 0 at or past ``row_end``)
    into float slot q at ``dst``, by cp.async."""
    r = row0 + q
    inside = r < row_end
    cp_async_4_at(smem, dst + 4 * q, a_scale, r * ktiles + kb if inside else int64(0),
                  4 if inside else 0)


@kjit(device=True, inline="always")
def stage_scales(smem, dst, p, a_scale, w0_scale, w1_scale, row0, row_end, w_at, w1_at, kb,
                 ktiles, bm):
    """Producer thread p's part of slice kb's scales, copied asynchronously (cp.async: the
    thread never waits on the load; ``cp_async_mbarrier_arrive`` counts it in once landed)
    to the shared byte address ``dst`` ..: A's tile row p, and p = 0 / 1: w0's block at
    ``w_at`` / w1's at ``w1_at`` (0 for a tile of no rows; module header, "scales"; they
    follow the tile's ``bm`` rows); at 192-row tiles threads 0..63 also row p + 128."""
    _stage_row_scale(smem, dst, p, a_scale, row0, row_end, kb, ktiles)
    rows = 4 if row0 < row_end else 0        # (WGRAD: an expert of no rows -- W's blocks 0)
    if p == 0:
        cp_async_4_at(smem, dst + 4 * bm, w0_scale, w_at + kb, rows)
    elif p == 1:
        cp_async_4_at(smem, dst + 4 * (bm + 1), w1_scale, w1_at + kb, rows)
    if bm > PRODUCERS and p + PRODUCERS < bm:
        _stage_row_scale(smem, dst, p + PRODUCERS, a_scale, row0, row_end, kb, ktiles)


@kjit(device=True, inline="always")
def slice_table(smem, offsets, num_experts, rows_cap):
    """WGRAD: smem[e] = ceil(min(offsets[e], rows_cap) / 128) for e <= E (uint16; the caller
    syncs), so expert e's K slices are [smem[e], smem[e + 1]) -- none where they are equal
    (offsets are multiples of 128, so lo_e is smem[e]'s first row) -- read from shared memory
    at every tile instead of two global loads on each side's path into it."""
    e = int64(cuda.threadIdx.x)
    while e <= num_experts:
        smem[e] = (min(int64(offsets[e]), rows_cap) + (BK - 1)) // BK
        e += cuda.blockDim.x


def make_fp8_gemm(stages, swiglu_epilogue=False, bn=BN, save_pre=False, push=False,
                  wgrad=False, out_f32=False, accumulate=False, bm=BM):
    """Build one specialisation: compile-time STAGES >= 2, the SwiGLU epilogue (w0 / w1 =
    W_gate / W_up, out = h), the tile's width ``bn`` (128, or 256: two 128-column halves per
    slice, each its own wgmma group, wait and promotion into its own FP32 accumulator -- the A
    slice serves twice the columns), ``save_pre``
    (SWIGLU: the FP32 gate and up values also into ``pre_g`` / ``pre_u`` [C, N], the rows
    stored -- what the backward differentiates the SwiGLU at), ``push``
    (not SWIGLU: row r goes to its source rank's combine row, the route's
    ``epilogue.make_coalesced_epilogue``, instead of ``out``) and ``wgrad`` (the weight
    gradient's tiles and K ranges: module header, "WGRAD"), with FP32 outputs (``out_f32``)
    optionally added to (``accumulate``); ``bm`` = 192 (not WGRAD, ``bn`` 128): tiles of 192
    rows, three compute warpgroups (module header, "192-row tiles")."""
    assert stages >= 2 and bn in (128, 256)
    assert not save_pre or swiglu_epilogue
    assert not wgrad or not (swiglu_epilogue or push)
    assert not (out_f32 or accumulate) or wgrad
    assert not accumulate or out_f32
    assert bm == BM or (bm == 192 and bn == 128 and not wgrad)
    compute = 2 * bm                         # compute threads: bm / 64 warpgroups
    threads = compute + PRODUCERS
    compute_regs, producer_regs = (COMPUTE_REGS, PRODUCER_REGS) if bm == BM else ROWS192_REGS
    ssb = scale_stage_bytes(bm)
    halves = bn // 128
    epilogue = make_coalesced_epilogue(bn, swiglu_epilogue, save_pre, push)
    parts = wgrad_parts(stages, bn, out_f32) if wgrad else 1
    wgrad_prefetch, wgrad_epilogue = make_epilogues(bm, bn, out_f32, accumulate, parts)
    warp_staging = warp_staging_bytes(bn, out_f32, parts)
    col_step = bn // 2 if swiglu_epilogue else bn
    stage_bytes = (bm + bn) * ROW_BYTES
    a_boxes = bm // BOX_ROWS
    w_boxes = bn // BOX_ROWS // 2            # B boxes of each half (w0's, then w1's or w0's)
    half_b = (128 * ROW_BYTES) >> 4          # descriptor step to the second half's rows
    w1_blocks = 1 if (halves == 2 and not swiglu_epilogue) else 0   # its scale block's step
    scales_at = scales_offset(stages)
    sc0 = scales_at // 4                     # the scales' ring, in floats

    @kjit(device=True, inline="always")
    def tile_of(smem, offsets, num_experts, t, n_tiles, rows_cap, ktiles, M):
        """Tile t -> (expert, first A row, first output column -- with SWIGLU the hidden
        column whose gate rows are w0's and up rows w1's --, end of the A rows that count
        (scale factor 0 from there), first B row, its K slices [k0, k_end), first output
        row -- WGRAD: D_e's row, the epilogue places it). WGRAD: an expert of no rows gets
        the one slice k0 = ktiles, past the operands (zero-filled, factors 0): its gradient
        tile is written as zeros."""
        if wgrad:
            m_tiles = M // bm
            per_expert = m_tiles * n_tiles
            e = t // per_expert
            local = t - e * per_expert
            m0 = (local % m_tiles) * bm
            col0 = (local // m_tiles) * col_step
            k0 = int64(smem[e])                # ``slice_table``
            k_end = int64(smem[e + 1])
            if k_end > k0:
                return e, m0, col0, m0 + bm, col0, k0, k_end, m0
            return e, m0, col0, m0, col0, ktiles, ktiles + 1, m0
        e, row0, nt, row_end = find_tile_in_table(smem, offsets, num_experts, t, n_tiles, bm,
                                                  rows_cap)
        col0 = nt * col_step
        return e, row0, col0, row_end, e * n_tiles * col_step + col0, int64(0), ktiles, row0

    @kjit(device=True, inline="always")
    def produce(smem, scales0, ring, full0, empty0, tmaps, a_scale, w0_scale, w1_scale,
                offsets, num_experts, rows_cap, total, n_tiles, ktiles, M, p):
        """Producer thread p's stream (module header): every slice of the block's tiles --
        thread 0 its TMA boxes (B's rows: plain, w0's rows col0 .. col0 + bn; SWIGLU, w0's
        rows col0 .. col0 + bn / 2 then w1's same rows), every thread its part of the
        slice's scales (``stage_scales``, the ring of them at shared byte address
        ``scales0``), then its arrival on the full barrier, made once they landed."""
        if p == 0:
            tensormap_acquire(tmaps, 0)
            tensormap_acquire(tmaps, MAP_ELEMS)
            tensormap_acquire(tmaps, 2 * MAP_ELEMS)
        second = 2 * MAP_ELEMS if swiglu_epilogue else MAP_ELEMS
        st = 0                                 # stage of the stream's slice j ...
        rnd = 0                                # ... and its round j / STAGES
        t = int64(cuda.blockIdx.x)
        while t < total:
            _, row0, _, row_end, w_row, k0, k_end, _ = tile_of(smem, offsets, num_experts, t,
                                                               n_tiles, rows_cap, ktiles, M)
            w_row2 = w_row if swiglu_epilogue else w_row + w_boxes * BOX_ROWS
            # the scale blocks of W's row w_row (WGRAD: b's, its blocks [N / 128, K / 128])
            w_at = (w_row // SCALE_BLOCK) * ktiles
            k_last = min(k_end, ktiles) - 1          # (a scale read stays in bounds)
            for kb in range(k0, k_end):
                if rnd > 0:
                    wait_phase(smem, empty0 + 8 * st, (rnd - 1) & 1)
                bar = full0 + 8 * st
                if p == 0:
                    dst = ring + st * stage_bytes
                    kx = kb * (BK // 2)                  # uint16 columns of the maps
                    mbarrier_arrive_expect_tx(smem, bar, stage_bytes)
                    for i in range(a_boxes):
                        tma_load_2d(smem, dst + i * BOX_BYTES, tmaps, 0, kx,
                                    row0 + i * BOX_ROWS, bar)
                    for i in range(w_boxes):
                        tma_load_2d(smem, dst + (a_boxes + i) * BOX_BYTES, tmaps, MAP_ELEMS,
                                    kx, w_row + i * BOX_ROWS, bar)
                        tma_load_2d(smem, dst + (a_boxes + w_boxes + i) * BOX_BYTES, tmaps,
                                    second, kx, w_row2 + i * BOX_ROWS, bar)
                stage_scales(smem, scales0 + st * ssb, p, a_scale, w0_scale,
                             w1_scale, row0, row_end, w_at, w_at + w1_blocks * ktiles,
                             min(kb, k_last), ktiles, bm)
                cp_async_mbarrier_arrive(smem, bar)     # once the scales landed
                st += 1                        # (counted, not j % STAGES: a 64-bit
                if st == stages:               # division every slice)
                    st = 0
                    rnd += 1
            t += cuda.gridDim.x

    @kjit(launch_bounds=(threads, 1))
    def kernel(a_scale, w0_scale, w1_scale, tmaps, offsets, num_rows, out, out1, omaps, pre_g,
               pre_u, route_rank, route_token, route_slot, peers, k, C, K, N, M, m_split,
               limit, errors, nf_tensor, nf_rank):
        smem = cuda.shared.array(0, uint16)
        scales = cuda.shared.array(0, float32)   # the same bytes, as floats (the scales')
        tid = cuda.threadIdx.x
        num_experts = offsets.shape[0] - 1
        rows_cap = min(int64(num_rows[0]), C)
        full0 = shared_addr(smem) + _TABLE_BYTES
        empty0 = full0 + 8 * stages
        warp0 = empty0 + 8 * stages            # the compute warps' (WGRAD's prefetch)
        if wgrad:
            slice_table(smem, offsets, num_experts, rows_cap)
        else:
            tile_table(smem, offsets, num_experts, bm, rows_cap)
        if tid == 0:
            for s in range(stages):
                mbarrier_init(smem, full0 + 8 * s, 1 + PRODUCERS)   # TMA + the scales
                mbarrier_init(smem, empty0 + 8 * s, compute)
            for w in range(8):
                mbarrier_init(smem, warp0 + 8 * w, 1)
            fence_mbarrier_init()
        cuda.syncthreads()
        n_tiles = N // col_step
        # each side works out what it needs after its setmaxnreg: a value live across it
        # must fit the producer's registers (40; 32 at 192-row tiles), so ptxas would spill it
        if warp_all(tid >= compute):
            setmaxnreg_dec(producer_regs)
            ktiles = K // BK
            total = (num_experts * (M // bm) if wgrad else int64(smem[num_experts])) * n_tiles
            scales0 = shared_addr(smem) + scales_at
            ring = ring_start(scales0 + stages * ssb)
            produce(smem, scales0, ring, full0, empty0, tmaps, a_scale, w0_scale,
                    w1_scale, offsets, num_experts, rows_cap, total, n_tiles, ktiles, M,
                    tid - compute)
        else:
            setmaxnreg_inc(compute_regs)
            ktiles = K // BK
            total = (num_experts * (M // bm) if wgrad else int64(smem[num_experts])) * n_tiles
            wg, lane, frag_row, frag_col = warpgroup_fragment(tid)
            ring = ring_start(shared_addr(smem) + scales_at + stages * ssb)
            staging = ring + stages * stage_bytes
            if wgrad:                          # the warp's boxes; the outputs' maps
                staging += (tid // 32) * warp_staging
                tensormap_acquire(omaps, 0)
                tensormap_acquire(omaps, MAP_ELEMS)
            desc_a0, desc_b0 = stage0_descriptors(ring, wg, bm)
            st = 0                             # stage of the stream's slice j ...
            ph = 0                             # ... and its parity (j / STAGES) & 1
            bar = warp0 + 8 * (tid // 32)      # WGRAD: this warp's prefetch mbarrier ...
            phase = 0                          # ... and the phase its tile completes
            t = int64(cuda.blockIdx.x)
            part = f32_zeros(NACC)             # (its input is never read: scale-d 0 first)
            while t < total:
                e, row0, col0, row_end, w_row, kb, k_end, grow0 = tile_of(
                    smem, offsets, num_experts, t, n_tiles, rows_cap, ktiles, M)
                side = 0
                if wgrad:
                    # the tile's side of m_split (block-uniform) and its first output row
                    side, grow0 = output_place(e, row0, m_split, M)
                    wgrad_prefetch(smem, omaps, side, grow0, col0, staging, lane, frag_row,
                                   bar)
                acc0 = f32_zeros(NACC)
                acc1 = f32_zeros(NACC)
                while True:
                    wait_phase(smem, full0 + 8 * st, ph)
                    soff = (st * stage_bytes) >> 4
                    part = mma_slice(part, smem, desc_a0 + soff, desc_b0 + soff)
                    # the slice's scales, staged with it: read under its MMAs, before the
                    # stage is released
                    f0, f1, f2, f3 = _slice_scales(scales, sc0 + st * (ssb // 4), frag_row, bm)
                    if halves == 2:
                        part = wgmma_wait(part, 0)
                        acc0 = promote_fp8(acc0, part, f0, f1, f0, f1)
                        part = mma_slice(part, smem, desc_a0 + soff, desc_b0 + soff + half_b)
                        part = wgmma_wait(part, 0)
                        mbarrier_arrive(smem, empty0 + 8 * st)
                        acc1 = promote_fp8(acc1, part, f2, f3, f2, f3)
                    else:
                        part = wgmma_wait(part, 0)
                        mbarrier_arrive(smem, empty0 + 8 * st)
                        acc0 = promote_fp8(acc0, part, f0, f1, f2, f3)
                    st += 1
                    if st == stages:
                        st = 0
                        ph ^= 1
                    kb += 1
                    if kb >= k_end:
                        break
                syncwarp()                     # every lane past its reads of the staging
                rows = row_end - row0
                if wgrad:
                    if halves == 2:
                        wgrad_epilogue(smem, acc0 + acc1, omaps, side, grow0, row0, col0, e,
                                       staging, lane, frag_row, errors, nf_tensor, nf_rank,
                                       bar, phase)
                    else:
                        wgrad_epilogue(smem, acc0, omaps, side, grow0, row0, col0, e,
                                       staging, lane, frag_row, errors, nf_tensor, nf_rank,
                                       bar, phase)
                    phase ^= 1
                elif halves == 2:
                    epilogue(smem, acc0 + acc1, out, grow0, row0, col0, e, N, rows, staging,
                             lane, frag_row, frag_col, limit, errors, nf_tensor, nf_rank,
                             (pre_g, pre_u), (route_rank, route_token, route_slot, peers, k))
                else:
                    epilogue(smem, acc0, out, grow0, row0, col0, e, N, rows, staging,
                             lane, frag_row, frag_col, limit, errors, nf_tensor, nf_rank,
                             (pre_g, pre_u), (route_rank, route_token, route_slot, peers, k))
                t += cuda.gridDim.x
            if wgrad:                          # the warp's last stores land before the exit
                bulk_wait(0)

    kernel.smem_bytes = smem_bytes(stages, bn, swiglu_epilogue, wgrad, out_f32, bm)
    kernel.threads = threads
    return kernel


def require_hopper():
    """ValueError off Hopper (the simulator runs the twins anywhere)."""
    if not SIM and cuda.get_current_device().compute_capability != (9, 0):
        cc = cuda.get_current_device().compute_capability
        raise ValueError(f"the FP8 GEMMs need a Hopper GPU (sm_90: wgmma e4m3); this device "
                         f"is sm_{cc[0]}{cc[1]}")


@lru_cache(maxsize=None)
def _kernel(stages, swiglu_epilogue, bn, save_pre, push, wgrad, out_f32=False, accumulate=False,
            bm=BM):
    require_hopper()
    return make_fp8_gemm(stages, swiglu_epilogue, bn, save_pre, push, wgrad, out_f32,
                         accumulate, bm)


def launch_fp8(a, a_scale, w0, w0_scale, offsets, num_rows, out, *, w1=None, w1_scale=None,
               swiglu_limit=None, stages, bn=BN, bm=BM, pre=None, route=None, rows=None,
               stream, errors, tensor, rank):
    """Persistent launch on trusted device views: ``a`` uint8 [C, K], ``a_scale`` float32
    [C, K / 128], ``w0`` uint8 [E, N, K], ``w0_scale`` float32 [E, N / 128, K / 128],
    ``offsets`` int32 [E + 1], ``num_rows`` int32 [1], ``out`` uint16 (bf16) [C, N], 16-byte
    aligned; K a multiple of 128, N of 128. With ``w1`` / ``w1_scale`` (W_up, as w0 = W_gate):
    the SwiGLU epilogue, out = h [C, N], ``swiglu_limit`` its clamp (None: none); with ``pre``
    = (gate, up) float32 [C, N] each, the FP32 gate and up values saved; with ``route`` =
    (rank, token, slot, peers, k) (not SwiGLU) the rows go to their source ranks' combine rows
    (``epilogue.make_coalesced_epilogue``'s push; ``out`` is then not written, ``rows`` = C).
    ``bm`` = 192 (``bn`` 128): 192-row tiles (module header). The tensor maps of a, w0 and w1
    are built on the first call for their addresses (not inside a CUDA-graph capture:
    ``tensor_map``)."""
    K = a.shape[1]
    E, N = w0.shape[0], w0.shape[1]
    rows = out.shape[0] if rows is None else rows
    swiglu = w1 is not None
    kern = _kernel(stages, swiglu, bn, pre is not None, route is not None, False, bm=bm)
    if route is None:
        route = (offsets, offsets, offsets, (flat_view(out, np.uint32),), np.int64(0))
    tiles = (rows // bm + E) * (N // (bn // 2 if swiglu else bn))   # an upper bound
    grid = max(1, min(tiles, multiprocessor_count()))
    limit = math.inf if swiglu_limit is None else float(swiglu_limit)
    w1, w1_scale = (w0, w0_scale) if w1 is None else (w1, w1_scale)
    maps = tensor_maps([flat_view(a, np.uint16).reshape(a.shape[0], K // 2),
                        flat_view(w0, np.uint16).reshape(E * N, K // 2),
                        flat_view(w1, np.uint16).reshape(E * N, K // 2)], BOX_ROWS, stream)
    launch(kern, grid, kern.threads, stream, kern.smem_bytes, flat_view(a_scale),
           flat_view(w0_scale), flat_view(w1_scale), maps, offsets, num_rows,
           flat_view(out, np.uint32), flat_view(out, np.uint32), maps,
           *(flat_view(p) for p in (pre if pre is not None else (w0_scale, w0_scale))),
           *route, np.int64(rows),
           np.int64(K), np.int64(N), np.int64(0), np.int64(0),
           np.float32(limit), errors, np.int32(tensor), np.int32(rank))


def launch_fp8_wgrad(a, a_scale, b, b_scale, offsets, num_rows, out0, out1, m_split, *,
                     accumulate, stages, bn, stream, errors, tensor, rank):
    """WGRAD's persistent launch on trusted device views: ``a`` uint8 [M, R], ``a_scale``
    float32 [M, R / 128], ``b`` uint8 [N, R], ``b_scale`` float32 [N / 128, R / 128],
    ``offsets`` int32 [E + 1] (multiples of 128), ``num_rows`` int32 [1], ``out0`` [E,
    m_split, N] and ``out1`` [E, M - m_split, N] (the one holding no rows may be None), both
    bf16 (uint16) or both float32 (``accumulate``: added to), 16-byte aligned (TMA stores);
    M, N (of ``bn``), R and m_split multiples of 128. Tensor maps as ``launch_fp8``'s."""
    M, R = a.shape
    N = b.shape[0]
    E = offsets.shape[0] - 1
    o0 = out1 if out0 is None else out0
    f32 = np.dtype(o0.dtype) == np.float32
    kern = _kernel(stages, False, bn, False, False, True, f32, bool(accumulate))
    grid = max(1, min(E * (M // BM) * (N // bn), multiprocessor_count()))
    maps = tensor_maps([flat_view(a, np.uint16).reshape(M, R // 2),
                        flat_view(b, np.uint16).reshape(N, R // 2),
                        flat_view(b, np.uint16).reshape(N, R // 2)], BOX_ROWS, stream)
    # written through the outputs' maps: ``out`` / ``out1`` are placeholders, typed as the
    # forward's out (the PTX checks')
    outs = (flat_view(a_scale, np.uint32),) * 2
    omaps = output_maps(out0, out1, E, M, N, m_split, stream)
    launch(kern, grid, GEMM_THREADS, stream, kern.smem_bytes, flat_view(a_scale),
           flat_view(b_scale), flat_view(b_scale), maps, offsets, num_rows, *outs, omaps,
           flat_view(a_scale), flat_view(a_scale), offsets, offsets, offsets,
           (flat_view(a_scale, np.uint32),), np.int64(0), np.int64(R), np.int64(R),
           np.int64(N), np.int64(M), np.int64(m_split), np.float32(math.inf), errors,
           np.int32(tensor), np.int32(rank))
