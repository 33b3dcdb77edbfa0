"""FP8 grouped GEMM on Hopper (wgmma e4m3, DeepSeek-V3's block scaling), with its host launch.

For the rows r of each expert e, offsets[e] <= r < offsets[e + 1] (clamped to num_rows[0]):

    out[r, n] = bf16( sum_k A[ra(r), k] * W_e[n, k] )
    A[ra, k]  = a[ra, k] * a_scale[ra, k // 128]                 (1 x 128 blocks)
    W_e[n, k] = w[e, n, k] * w_scale[e, n // 128, k // 128]      (128 x 128 blocks)
    ra(r)     = a_index[r] (gathered; -1: a padding row, zeros) or r

with a and w e4m3 bytes, both K-major (the layout ``mok_core.quantize.quantize_fp8`` writes,
untransposed), the scales float32 divisors (value = byte's e4m3 value x scale). Rows of no
expert are not written.

    block    = 2 warpgroups (256 threads); tile BM = 128 rows x BN = 128 columns (one scale
               block of W wide), warpgroup g owns rows [64 g, 64 g + 64) and every column
    tiles    = per expert ceil(rows / 128) row tiles that never cross into the next expert
               (``sm90``'s tile table) x N / 128 column tiles, in the order (expert, column
               tile, row tile); block b takes tiles b, b + grid, ...
    K slice  = 128 of K: one 128-byte row of e4m3 per tile row -- the 128-byte swizzle's row
               and one scale block of both operands
    ring     = STAGES slices of [A: 128 rows x 128 B | B: 128 rows x 128 B] (32 KiB), from a
               1024-byte boundary after the tile table; 16-byte chunk c of row r at chunk
               c ^ (r % 8)
    stream   = the block's slices in one stream across its tiles: the loads run PREFETCH =
               STAGES - 1 slices ahead of the MMAs, into the stage the previous slice freed
    loads    = every thread, cp.async 16 B: chunk tid % 8 of rows tid // 8 + 32 i (i < 4) of
               A and of B (rows 32 apart: one swizzle per thread); A rows gathered through
               a_index, padding rows and rows past the expert zero-filled without a read
    MMA      = per slice, per warpgroup: 4 x wgmma m64n128k32 e4m3 (both descriptors K-major,
               + 32 bytes a k32 step; the first with scale-d 0: the fragment starts fresh
               without an instruction but the wgmma writing it) into an FP32 fragment,
               commit, wait(0), then the
               promotion (``promote_fp8``): acc += part * (a_scale[row, kb] * w_scale[e, nb,
               kb]), the thread's two rows each with its own scale. The tensor cores' running
               sum keeps fewer bits than FP32: one slice (128 of K) is all it holds
    epilogue = ``epilogue.make_coalesced_epilogue``: the bf16 tile staged apart from the ring
               (128 rows, stride 272 B), the expert's rows stored coalesced, NaN/Inf reported

Order, every thread (the whole contract of one step j of the stream, slice kb of a tile):

    prologue:  the tile table (thread 0), __syncthreads; stream slices 0 .. PREFETCH - 1
    per tile:  its rows' scale rows (a_index), acc = 0, then per slice (``mma_slice``):
    1. cp.async.wait(PREFETCH - 1) -> my chunks of slice j landed; fence.proxy.async;
       __syncthreads -> everyone's landed; every warp is past slice j - 1's wgmmas (waited in
       its step) and past the previous tile's epilogue reads of the staging
    2. wgmma.fence; 4 wgmmas on stage j % STAGES; commit
    3. the slice's scales (global loads under the MMAs); loads of stream slice j + PREFETCH
       into stage (j - 1) % STAGES; commit
    4. wgmma.wait(0); promote
    after the tile's last slice: the epilogue (each warp its own rows; no block barrier)
    exit: cp.async.wait(0)

Why wait(0) every slice: the promotion reads the slice's fragment; overlapping it with the
next slice's wgmmas takes a second fragment (64 more registers) or the two warpgroups in turns
(DeepGEMM's way) -- the next step once this one is measured (docs/design.md, FP8).
C7518: no branch around a wgmma tests anything but kernel arguments and block-uniform tile
values, and the K loop runs at least once (K >= 128), testing its exit at the end (``sm90``).
Determinism: one block owns a tile, slices promoted in ascending K, no atomics on data.
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from numba import cuda, float32, int64, uint16

from ..cuda_compat import SIM, flat_view, kjit, launch, multiprocessor_count
from ..intrinsics import (cp_async_16_at, cp_async_commit, cp_async_wait, f32_zeros,
                          fence_proxy_async, promote_fp8, shared_addr, wgmma_commit,
                          wgmma_fence, wgmma_m64n128k32_e4m3, wgmma_m64n128k32_e4m3_fresh,
                          wgmma_wait)
from .epilogue import make_coalesced_epilogue
from .sm90 import _DESC_HIGH, _TABLE_BYTES, find_tile_in_table, tile_table, warpgroup_fragment

BM = 128                      # tile rows: 2 warpgroups of 64
BN = 128                      # tile columns: one 128-wide scale block of W
BK = 128                      # K slice: 128 e4m3 = 128 bytes = the swizzle atom's row
SCALE_BLOCK = 128
ROW_BYTES = BK
THREADS = 2 * BM
STAGE_BYTES = (BM + BN) * ROW_BYTES
_K32 = 32 >> 4                # K-major: a k32 step is 32 bytes along the 128-byte row
NACC = BN // 2                # fp32 accumulators per thread (and as many for a slice)


def smem_bytes(stages):
    """Dynamic shared memory of one block: the tile table, slack to align the ring to 1024
    bytes, the ring, the staged output tile."""
    return _TABLE_BYTES + 1024 + stages * STAGE_BYTES + BM * (2 * BN + 16)


def make_stream(gather, swiglu_epilogue=False):
    """The slice stream's device functions (module header), shared by every FP8 kernel body
    (``col0``: a tile's first weight row -- its first output column, or with SWIGLU its first
    hidden column, whose gate rows are w0's and up rows w1's; ``N`` the weights' rows):

    ``tile_of(smem, offsets, E, t, n_tiles, rows_cap)`` -> (expert, first row, col0, end of
    the expert's rows) of tile t;
    ``load_next(smem, lst, lt, lk, le, lrow0, lend, lcol0, total, n_tiles, ktiles, offsets, E,
    rows_cap, a, a_index, w0, w1, K, N, dst0, ld_row, ld_chunk)``: the stream's next slice
    (slice lk of tile lt; none past the block's last tile) into ring stage lst, one cp.async
    group either way; returns the cursor (lt, lk, le, lrow0, lend, lcol0) moved on by one;
    ``scales(a_scale, w0_scale, w1_scale, src_lo, src_hi, w_at, kb, ktiles)`` -> the
    promotion's four factors of slice kb (``promote_fp8``: a_scale's row x w0's scale for the
    tile's first half of columns, x w1's for the second; 0 for a row of no source);
    ``scale_row(a_index, r, row_end)`` -> the a_scale row of output row r (-1: none)."""
    col_step = BN // 2 if swiglu_epilogue else BN

    @kjit(device=True, inline="always")
    def load_slice(smem, st, kb, row0, row_end, col0, e, a, a_index, w0, w1, K, N, dst0,
                   ld_row, ld_chunk):
        """This thread's chunks of slice kb of the tile (row0, col0) of expert e into ring
        stage st (a and w as uint16 views: element offsets are byte offsets / 2). B's rows
        32 i + ld_row: w0's rows col0 + ..., or with SWIGLU rows 0-63 w0's (gate) and 64-127
        w1's (up), rows col0 + ... of each."""
        base = dst0 + st * STAGE_BYTES
        kbyte = kb * BK + ld_chunk * 16
        for i in range(4):
            r = row0 + ld_row + 32 * i
            src = -1
            if r < row_end:
                src = a_index[r] if gather else r
            nbytes = 16 if src >= 0 else 0
            cp_async_16_at(smem, base + i * 32 * ROW_BYTES, a, (max(src, 0) * K + kbyte) >> 1,
                           nbytes)
        for i in range(4):
            if swiglu_epilogue and i >= 2:
                cp_async_16_at(smem, base + (BM + 32 * i) * ROW_BYTES, w1,
                               ((e * N + col0 + ld_row + 32 * (i - 2)) * K + kbyte) >> 1, 16)
            else:
                cp_async_16_at(smem, base + (BM + 32 * i) * ROW_BYTES, w0,
                               ((e * N + col0 + ld_row + 32 * i) * K + kbyte) >> 1, 16)

    @kjit(device=True, inline="always")
    def tile_of(smem, offsets, num_experts, t, n_tiles, rows_cap):
        e, row0, nt, row_end = find_tile_in_table(smem, offsets, num_experts, t, n_tiles, BM,
                                                  rows_cap)
        return e, row0, nt * col_step, row_end

    @kjit(device=True, inline="always")
    def load_next(smem, lst, lt, lk, le, lrow0, lend, lcol0, total, n_tiles, ktiles, offsets,
                  num_experts, rows_cap, a, a_index, w0, w1, K, N, dst0, ld_row, ld_chunk):
        if lt < total:
            load_slice(smem, lst, lk, lrow0, lend, lcol0, le, a, a_index, w0, w1, K, N, dst0,
                       ld_row, ld_chunk)
            lk += 1
            if lk >= ktiles:
                lk = 0
                lt += cuda.gridDim.x
                if lt < total:
                    le, lrow0, lcol0, lend = tile_of(smem, offsets, num_experts, lt, n_tiles,
                                                     rows_cap)
        cp_async_commit()
        return lt, lk, le, lrow0, lend, lcol0

    @kjit(device=True, inline="always")
    def scales(a_scale, w0_scale, w1_scale, src_lo, src_hi, w_at, kb, ktiles):
        s0 = w0_scale[w_at + kb]
        s1 = w1_scale[w_at + kb]
        f0 = float32(0.0)                   # a row of no source: 0, even with a NaN / Inf
        f1 = float32(0.0)                   # weight scale (its values are not the GEMM's)
        f2 = float32(0.0)
        f3 = float32(0.0)
        if src_lo >= 0:
            a_lo = a_scale[src_lo * ktiles + kb]
            f0 = a_lo * s0
            f2 = a_lo * s1
        if src_hi >= 0:
            a_hi = a_scale[src_hi * ktiles + kb]
            f1 = a_hi * s0
            f3 = a_hi * s1
        return f0, f1, f2, f3

    @kjit(device=True, inline="always")
    def scale_row(a_index, r, row_end):
        src = -1
        if r < row_end:
            src = a_index[r] if gather else r
        return src

    return tile_of, load_next, scales, scale_row


@kjit(device=True, inline="always")
def ring_layout(smem, area, tid, wg, stages):
    """Where a block's FP8 ring lies (from the first 1024-byte boundary at or after the shared
    byte address ``area``) and this thread's part in it: (staging -- the output tile's, after
    the ring --, its loader row and 16-byte chunk, the shared address its chunks of stage 0
    land at -- chunk c of row r at chunk c ^ (r % 8) --, and its warpgroup's A and B
    descriptors of stage 0)."""
    ring = area + (1024 - area % 1024) % 1024
    ld_row = tid // 8
    ld_chunk = tid % 8
    dst0 = ring + ld_row * ROW_BYTES + ((ld_chunk ^ (ld_row % 8)) * 16)
    desc_a0 = int64(_DESC_HIGH) + int64((ring + wg * 64 * ROW_BYTES) >> 4)
    desc_b0 = int64(_DESC_HIGH) + int64((ring + BM * ROW_BYTES) >> 4)
    return ring + stages * STAGE_BYTES, ld_row, ld_chunk, dst0, desc_a0, desc_b0


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


def make_fp8_gemm(stages, gather, swiglu_epilogue=False):
    """Build one specialisation (compile-time STAGES >= 2, whether A is gathered, and the
    SwiGLU epilogue: w0 / w1 = W_gate / W_up, out = h)."""
    assert stages >= 2
    prefetch = stages - 1
    in_flight = prefetch - 1                # cp.async groups allowed pending at step 1
    epilogue = make_coalesced_epilogue(BN, swiglu_epilogue)
    tile_of, load_next, scales, scale_row = make_stream(gather, swiglu_epilogue)
    col_step = BN // 2 if swiglu_epilogue else BN

    @kjit(launch_bounds=(THREADS, 1))
    def kernel(a, a_scale, a_index, w0, w0_scale, w1, w1_scale, offsets, num_rows, out, K, N,
               limit, errors, nf_tensor, nf_rank):
        smem = cuda.shared.array(0, uint16)
        tid = cuda.threadIdx.x
        wg, lane, frag_row, frag_col = warpgroup_fragment(tid)
        num_experts = offsets.shape[0] - 1
        rows_cap = min(int64(num_rows[0]), int64(out.shape[0]) * 2 // N)
        tile_table(smem, offsets, num_experts, BM, rows_cap)
        cuda.syncthreads()
        n_tiles = N // col_step
        ktiles = K // BK
        nb = N // SCALE_BLOCK
        total = int64(smem[num_experts]) * n_tiles

        staging, ld_row, ld_chunk, dst0, desc_a0, desc_b0 = ring_layout(
            smem, shared_addr(smem) + _TABLE_BYTES, tid, wg, stages)

        t = int64(cuda.blockIdx.x)
        lt = t
        lk = int64(0)
        le = int64(0)
        lrow0 = int64(0)
        lend = int64(0)
        lcol0 = int64(0)
        if lt < total:
            le, lrow0, lcol0, lend = tile_of(smem, offsets, num_experts, lt, n_tiles, rows_cap)
        for s in range(prefetch):
            lt, lk, le, lrow0, lend, lcol0 = load_next(
                smem, s, lt, lk, le, lrow0, lend, lcol0, total, n_tiles, ktiles, offsets,
                num_experts, rows_cap, a, a_index, w0, w1, K, N, dst0, ld_row, ld_chunk)
        cst = 0                                # ring stages of the slice computed / loaded
        lst = prefetch
        part = f32_zeros(NACC)                 # (its input is never read: scale-d 0 first)
        while t < total:
            e, row0, col0, row_end = tile_of(smem, offsets, num_experts, t, n_tiles, rows_cap)
            src_lo = scale_row(a_index, row0 + frag_row, row_end)
            src_hi = scale_row(a_index, row0 + frag_row + 8, row_end)
            w_at = (e * nb + col0 // SCALE_BLOCK) * ktiles
            acc = f32_zeros(NACC)
            kb = int64(0)
            while True:
                cp_async_wait(in_flight)
                fence_proxy_async()
                cuda.syncthreads()
                soff = (cst * STAGE_BYTES) >> 4
                part = mma_slice(part, smem, desc_a0 + soff, desc_b0 + soff)
                f0, f1, f2, f3 = scales(a_scale, w0_scale, w1_scale, src_lo, src_hi, w_at, kb,
                                        ktiles)
                lt, lk, le, lrow0, lend, lcol0 = load_next(
                    smem, lst, lt, lk, le, lrow0, lend, lcol0, total, n_tiles, ktiles, offsets,
                    num_experts, rows_cap, a, a_index, w0, w1, K, N, dst0, ld_row, ld_chunk)
                part = wgmma_wait(part, 0)
                acc = promote_fp8(acc, part, f0, f1, f2, f3)
                cst = 0 if cst == stages - 1 else cst + 1
                lst = 0 if lst == stages - 1 else lst + 1
                kb += 1
                if kb >= ktiles:
                    break
            epilogue(smem, acc, out, row0, row0, col0, e, N, row_end - row0, staging, lane,
                     frag_row, frag_col, limit, errors, nf_tensor, nf_rank)
            t += cuda.gridDim.x
        cp_async_wait(0)                       # (the stream's empty tail groups)

    kernel.threads = THREADS
    kernel.smem_bytes = smem_bytes(stages)
    return kernel


def require_hopper():
    """ValueError off Hopper (the simulator runs the twins anywhere)."""
    if not SIM and cuda.get_current_device().compute_capability != (9, 0):
        cc = cuda.get_current_device().compute_capability
        raise ValueError(f"the FP8 GEMMs need a Hopper GPU (sm_90: wgmma e4m3); this device "
                         f"is sm_{cc[0]}{cc[1]}")


@lru_cache(maxsize=None)
def _kernel(stages, gather, swiglu_epilogue):
    require_hopper()
    return make_fp8_gemm(stages, gather, swiglu_epilogue)


def launch_fp8(a, a_scale, a_index, w0, w0_scale, offsets, num_rows, out, *, w1=None,
               w1_scale=None, swiglu_limit=None, stages, stream, errors, tensor, rank):
    """Persistent launch on trusted device views: ``a`` uint8 [A_rows, K], ``a_scale``
    float32 [A_rows, K / 128], ``a_index`` int32 [C] or None, ``w0`` uint8 [E, N, K],
    ``w0_scale`` float32 [E, N / 128, K / 128], ``offsets`` int32 [E + 1], ``num_rows`` int32
    [1], ``out`` uint16 (bf16) [C, N], 16-byte aligned; K a multiple of 128, N of 128. With
    ``w1`` / ``w1_scale`` (W_up, as w0 = W_gate): the SwiGLU epilogue, out = h [C, N],
    ``swiglu_limit`` its clamp (None: none)."""
    K = a.shape[1]
    E, N = w0.shape[0], w0.shape[1]
    rows = out.shape[0]
    swiglu = w1 is not None
    kern = _kernel(stages, a_index is not None, swiglu)
    tiles = (rows // BM + E) * (N // (BN // 2 if swiglu else BN))   # an upper bound
    grid = max(1, min(tiles, multiprocessor_count()))
    limit = math.inf if swiglu_limit is None else float(swiglu_limit)
    w1, w1_scale = (w0, w0_scale) if w1 is None else (w1, w1_scale)
    launch(kern, grid, THREADS, stream, kern.smem_bytes, flat_view(a, np.uint16),
           flat_view(a_scale), num_rows if a_index is None else a_index,   # (a placeholder)
           flat_view(w0, np.uint16), flat_view(w0_scale), flat_view(w1, np.uint16),
           flat_view(w1_scale), offsets, num_rows, flat_view(out, np.uint32), np.int64(K),
           np.int64(N), np.float32(limit), errors, np.int32(tensor), np.int32(rank))
