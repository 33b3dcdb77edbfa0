"""FP8 weight-gradient GEMM on Hopper (wgmma e4m3), grouped over K, with its host launch.

For each expert e, over its rows r in [lo_e, hi_e) = [offsets[e], min(offsets[e + 1],
num_rows[0])):

    out[e, m, n] = bf16( sum_r A[m, r] * B[n, r] )
    A[m, r] = a[m, r] * a_scale[m, r // 128]                  (1 x 128 blocks along r)
    B[n, r] = b[n, r] * b_scale[n // 128, r // 128]           (128 x 128 blocks)

``a`` and ``b`` are the two operands of ``wgrad`` (``sm90_wgrad``: D_e = sum_r A[r, m] B[r,
n]) transposed and quantised along the rows: e4m3 wgmma reads both operands K-major only, so
the reduction's rows must be contiguous -- ``mok_core.quantize.quantize_fp8(x, (1, 128),
transpose=True)`` for A (per output row m, per 128 rows), ``(128, 128)`` for B, whose scale
then holds for a whole 128-column tile and the promotion stays per row (``promote_fp8``).
Preconditions (the padded layout gives them): every offset a multiple of 128 -- a scale block
never spans two experts --, num_rows a multiple of 16, and the operands zero from an expert's
last row to its segment's end (rows are read in 16-row chunks; chunks at or past hi are
zero-filled without a read).

    block    = 2 warpgroups (256 threads); tile 128 (m) x 128 (n), warpgroup g rows [64 g, ..)
    tiles    = E x (M / 128) x (N / 128) whatever the routing, order (expert, n tile, m tile);
               block b takes tiles b, b + grid, ...; an expert of no rows runs one slice of
               zeros (its loads zero-filled, its factors 0): its gradient is written as zeros
    K slice  = 128 rows r (one scale block of both operands); ring, stream, loads, MMA,
               promotion and epilogue as ``sm90_fp8`` (read its header): the loads take A's
               rows m and B's rows n, 128 bytes of r from lo_e + 128 kb
    out      = bf16 [E, M, N] (uint32 view), NaN/Inf reported with the row m and the expert

Order and determinism: ``sm90_fp8``'s (one block owns a tile, slices promoted in ascending r).
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from numba import cuda, float32, int64, uint16

from ..cuda_compat import flat_view, kjit, launch, multiprocessor_count
from ..intrinsics import (cp_async_16_at, cp_async_commit, cp_async_wait, f32_zeros,
                          fence_proxy_async, promote_fp8, shared_addr, wgmma_wait)
from .epilogue import make_coalesced_epilogue
from .sm90 import warpgroup_fragment
from .sm90_fp8 import (BK, BM, BN, NACC, ROW_BYTES, STAGE_BYTES, THREADS, mma_slice,
                       require_hopper, ring_layout)


def smem_bytes(stages):
    """Slack to align the ring to 1024 bytes, the ring, the staged output tile."""
    return 1024 + stages * STAGE_BYTES + BM * (2 * BN + 16)


def make_fp8_wgrad(stages):
    """Build the kernel (compile-time STAGES >= 2)."""
    assert stages >= 2
    prefetch = stages - 1
    in_flight = prefetch - 1
    epilogue = make_coalesced_epilogue(BN)

    @kjit(device=True, inline="always")
    def tile_of(t, tiles_per_expert, m_tiles, offsets, num_rows):
        """Tile t -> (expert, m0, n0, lo, hi, slices)."""
        e = t // tiles_per_expert
        local = t - e * tiles_per_expert
        m0 = (local % m_tiles) * BM
        n0 = (local // m_tiles) * BN
        hi = int64(min(offsets[e + 1], num_rows[0]))
        lo = int64(min(offsets[e], hi))
        return e, m0, n0, lo, hi, max((hi - lo + (BK - 1)) // BK, 1)

    @kjit(device=True, inline="always")
    def load_next(smem, lst, lt, lk, lm0, ln0, llo, lhi, lkt, total, tiles_per_expert,
                  m_tiles, offsets, num_rows, a, b, R, dst0, ld_row, ld_chunk):
        """The stream's next slice (slice lk of tile lt; none past the block's last tile) into
        stage lst, one cp.async group either way; the cursor moved on by one."""
        if lt < total:
            base = dst0 + lst * STAGE_BYTES
            r = llo + lk * BK + ld_chunk * 16
            nbytes = 16 if r < lhi else 0
            rr = min(r, R - 16)                 # (no read past the array when zero-filled)
            for i in range(4):
                cp_async_16_at(smem, base + i * 32 * ROW_BYTES, a,
                               ((lm0 + ld_row + 32 * i) * R + rr) >> 1, nbytes)
                cp_async_16_at(smem, base + (BM + 32 * i) * ROW_BYTES, b,
                               ((ln0 + ld_row + 32 * i) * R + rr) >> 1, nbytes)
            lk += 1
            if lk >= lkt:
                lk = 0
                lt += cuda.gridDim.x
                if lt < total:
                    _, lm0, ln0, llo, lhi, lkt = tile_of(lt, tiles_per_expert, m_tiles,
                                                         offsets, num_rows)
        cp_async_commit()
        return lt, lk, lm0, ln0, llo, lhi, lkt

    @kjit(launch_bounds=(THREADS, 1))
    def kernel(a, a_scale, b, b_scale, offsets, num_rows, out, M, N, R, errors, nf_tensor,
               nf_rank):
        smem = cuda.shared.array(0, uint16)
        tid = cuda.threadIdx.x
        wg, lane, frag_row, frag_col = warpgroup_fragment(tid)
        num_experts = offsets.shape[0] - 1
        m_tiles = M // BM
        tiles_per_expert = m_tiles * (N // BN)
        total = num_experts * tiles_per_expert
        kb_all = R // BK                         # scale blocks per operand row
        staging, ld_row, ld_chunk, dst0, desc_a0, desc_b0 = ring_layout(
            smem, shared_addr(smem), tid, wg, stages)

        t = int64(cuda.blockIdx.x)
        lt = t
        lk = int64(0)
        lm0 = int64(0)
        ln0 = int64(0)
        llo = int64(0)
        lhi = int64(0)
        lkt = int64(1)
        if lt < total:
            _, lm0, ln0, llo, lhi, lkt = tile_of(lt, tiles_per_expert, m_tiles, offsets,
                                                 num_rows)
        for s in range(prefetch):
            lt, lk, lm0, ln0, llo, lhi, lkt = load_next(
                smem, s, lt, lk, lm0, ln0, llo, lhi, lkt, total, tiles_per_expert, m_tiles,
                offsets, num_rows, a, b, R, dst0, ld_row, ld_chunk)
        cst = 0
        lst = prefetch
        part = f32_zeros(NACC)                 # (its input is never read: scale-d 0 first)
        while t < total:
            e, m0, n0, lo, hi, slices = tile_of(t, tiles_per_expert, m_tiles, offsets,
                                                num_rows)
            m_lo = m0 + frag_row
            acc = f32_zeros(NACC)
            kb = int64(0)
            while True:
                cp_async_wait(in_flight)
                fence_proxy_async()
                cuda.syncthreads()
                soff = (cst * STAGE_BYTES) >> 4
                part = mma_slice(part, smem, desc_a0 + soff, desc_b0 + soff)
                blk = lo // BK + kb             # the slice's scale block (lo: a multiple of BK)
                s_lo = float32(0.0)
                s_hi = float32(0.0)
                if hi > lo:
                    s_b = b_scale[(n0 // BN) * kb_all + blk]
                    s_lo = a_scale[m_lo * kb_all + blk] * s_b
                    s_hi = a_scale[(m_lo + 8) * kb_all + blk] * s_b
                lt, lk, lm0, ln0, llo, lhi, lkt = load_next(
                    smem, lst, lt, lk, lm0, ln0, llo, lhi, lkt, total, tiles_per_expert,
                    m_tiles, offsets, num_rows, a, b, R, dst0, ld_row, ld_chunk)
                part = wgmma_wait(part, 0)
                acc = promote_fp8(acc, part, s_lo, s_hi, s_lo, s_hi)
                cst = 0 if cst == stages - 1 else cst + 1
                lst = 0 if lst == stages - 1 else lst + 1
                kb += 1
                if kb >= slices:
                    break
            epilogue(smem, acc, out, e * M + m0, m0, n0, e, N, BM, staging, lane, frag_row,
                     frag_col, float32(0.0), errors, nf_tensor, nf_rank, None, None)
            t += cuda.gridDim.x
        cp_async_wait(0)

    kernel.threads = THREADS
    kernel.smem_bytes = smem_bytes(stages)
    return kernel


@lru_cache(maxsize=None)
def _kernel(stages):
    require_hopper()
    return make_fp8_wgrad(stages)


def launch_fp8_wgrad(a, a_scale, b, b_scale, offsets, num_rows, out, *, stages, stream, errors,
                     tensor, rank):
    """Persistent launch on trusted device views: ``a`` uint8 [M, R], ``a_scale`` float32
    [M, R / 128], ``b`` uint8 [N, R], ``b_scale`` float32 [N / 128, R / 128], ``offsets`` int32
    [E + 1], ``num_rows`` int32 [1], ``out`` uint16 (bf16) [E, M, N], 16-byte aligned."""
    M, R = a.shape
    N = b.shape[0]
    E = offsets.shape[0] - 1
    kern = _kernel(stages)
    grid = max(1, min(E * (M // BM) * (N // BN), multiprocessor_count()))
    launch(kern, grid, THREADS, stream, kern.smem_bytes, flat_view(a, np.uint16),
           flat_view(a_scale), flat_view(b, np.uint16), flat_view(b_scale), offsets,
           num_rows, flat_view(out, np.uint32), np.int64(M), np.int64(N), np.int64(R), errors,
           np.int32(tensor), np.int32(rank))
