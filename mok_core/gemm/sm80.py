"""Grouped expert GEMM on warp-level MMA (mma.sync m16n8k16, any sm_80+ GPU and the
simulator's default), with its host launch.

Contract of every kernel built here (ThunderKittens style: read this block, know the kernel):

    ABt  (forward):   C[rows, N] = A[rows, K] . W[e]^T   for each expert e over its rows
    B_KN (dgrad):     C[rows, N] = A[rows, K] . B[e]     [off[e], off[e+1])

    A        uint16 (bf16 bits) [A_rows * K], row r of the expert-sorted space is
             A[a_index[r]] when GATHER (a_index[r] = -1: padding row, read as zeros -- the
             cp.async zero-fill, no load) else A[r]
    W (ABt)  uint16 [E * N_w * K]  nn.Linear layout (out_features, in_features)
    B (B_KN) weights read as stored, row-major [K, N] per expert (N contiguous), from two
             arrays split at K0 = ``n_w``: rows k < K0 are w0 [E, K0, N], rows k >= K0 are
             w1 [E, K - K0, N] (one matrix: w1 = w0, K0 = K). BK divides K0 (the host
             checks): each K slice reads one matrix, picked per slice. (d_hidden =
             d_out . W_down[e] gathers A through a_index; d_x = [d_gate | d_up] .
             [W_gate[e]; W_up[e]] splits K = 2I at K0 = I.)
    off      int32 [E + 1] padded row offsets (multiples of BM: no tile spans two experts)
    num_rows int32 [1]   rows in use; tiles past it are never visited (count stays on device)
    out      uint32 [rows * N_out / 2]  packed bf16 pairs (round to nearest even, once)
    pre      (SAVE_PRE, SWIGLU only) two float32 [rows * N_out]: gate and up pre-activations,
             the FP32 accumulators the SwiGLU consumes, before its clamp (the backward's
             SwiGLU derivative: its clamp masks then are the forward's); padding rows zeros.
             Without SAVE_PRE a placeholder, never touched
    errors   int32 [ERROR_WORDS]  NaN/Inf written to ``out`` are counted there under tensor
             id ``nf_tensor`` with the smallest row and the tile's expert (``mok_core.errors``;
             a clean tile pays one fma.rn.bf16x2 per written pair and one warp vote)

Two epilogues:
    SWIGLU   (ABt only) W = gate and up ([E, I, K] each). A tile's B rows interleave, per warp
             column, 16 gate rows then the 16 up rows of the same hidden columns, so one
             thread holds gate and up of the same element: h = ``epilogue.swiglu``(g, u, L)
             -> bf16; SAVE_PRE also stores g and u into ``pre`` (8-byte pairs, st_v2_f32).
    plain    out = acc -> bf16.

Tiles: BM x BN output per block (BN = 2 x hidden columns for SWIGLU), WM x WN warps, each warp
MI x NI m16n8k16 tiles, K walked in BK slices through a STAGES-deep cp.async ring in shared
memory (16-byte chunks, XOR-swizzled so ldmatrix rows hit distinct banks). A slice stages A as
[BM rows][BK] and B as [BN rows of n][BK] (ABt, fragments by ldmatrix) or [BK rows of k][BN]
(B_KN: chunks along n, fragments by ldmatrix .trans; BN = 16, 32 or a multiple of 64, so the
swizzle stays within a row). FP32 accumulation, one block owns each output tile, K in fixed
order: no split-K, no atomics -> deterministic (same inputs, same bits).

Persistent schedule: block b takes tiles b, b + grid, ... in the order
(expert, column tile, row tile within expert) -- the blocks running at once share one
expert's A rows and each weight tile is read by all of that expert's row tiles together, so
both stay in L2. The expert of a tile is found by binary search over ``off`` on the device.
"""
from functools import lru_cache

import numpy as np
from numba import cuda, float32, int32, int64, uint16, uint32

from ..bf16 import nonfinite_bf16x2
from ..cuda_compat import flat_view, kjit, launch
from ..intrinsics import (cp_async_16_at, cp_async_commit, cp_async_wait,
                          fold_nonfinite_bf16x2, ldmatrix_x4_at, ldmatrix_x4_trans_at,
                          mma_bf16_16816, pack_bf16x2, shared_addr, st_v2_f32, warp_all)
from .epilogue import report_warp, swiglu


@kjit(device=True, inline="always")
def find_tile(offsets, num_experts, t, n_tiles, bm):
    """Tile id -> (expert, first row, column tile) for order (expert, column tile, row tile)."""
    lo = 0
    hi = num_experts - 1
    while lo < hi:                         # last expert whose first tile id <= t
        mid = (lo + hi + 1) // 2
        if (offsets[mid] // bm) * n_tiles <= t:
            lo = mid
        else:
            hi = mid - 1
    e = lo
    first = offsets[e] // bm
    m_tiles = offsets[e + 1] // bm - first
    local = t - first * n_tiles
    return e, (first + local % m_tiles) * bm, local // m_tiles


def b_kn_width_ok(bn):
    """B_KN stages B rows of bn columns: bn / 8 chunks per row must be 2, 4 or a multiple of 8
    for the XOR swizzle to stay within the row."""
    cpr = bn // 8
    return bn % 8 == 0 and (cpr in (2, 4) or cpr % 8 == 0)


def _swizzle(cpr):
    """``swz(row, chunk)``: physical 16-byte chunk of (row, chunk) in shared rows of ``cpr``
    chunks, so the 8 rows one ldmatrix phase reads land in distinct banks (rows of 32 or 64
    bytes share a 128-byte bank line with their neighbours: the XOR key skips those)."""
    width = 8 if cpr % 8 == 0 else cpr      # chunks of a row within one bank line
    shift = (8 // width).bit_length() - 1   # log2(rows per bank line)
    assert width in (2, 4, 8)

    @kjit(device=True, inline="always")
    def swz(row, chunk):
        return chunk ^ ((row >> shift) & (width - 1))
    return swz


def make_mma_slice(mi_n, ni_n, kk_n, ldmatrix_a, ldmatrix_b):
    """``mma_slice(smem, base, a_ldm, b_ldm, afrag, bfrag, acc)``: one warp's MMAs over the K
    slice staged at ``base`` -- per k16 step, the A fragments of its mi_n m16 tiles and the B
    fragments of its ni_n n8 tiles (``ldmatrix_a`` / ``ldmatrix_b`` at the thread's row
    offsets ``a_ldm`` / ``b_ldm``: ``ldmatrix_x4_at``, or ``_trans_at`` for an operand stored
    the other way round), then mi_n x ni_n m16n8k16 MMAs into ``acc``. Inlined: the fragment
    and accumulator arrays stay in registers."""
    @kjit(device=True, inline="always")
    def mma_slice(smem, base, a_ldm, b_ldm, afrag, bfrag, acc):
        for kk in range(kk_n):
            for mi in range(mi_n):
                f0, f1, f2, f3 = ldmatrix_a(smem, base + a_ldm[kk * mi_n + mi])
                afrag[mi * 4 + 0] = f0
                afrag[mi * 4 + 1] = f1
                afrag[mi * 4 + 2] = f2
                afrag[mi * 4 + 3] = f3
            for nj in range(ni_n // 2):
                f0, f1, f2, f3 = ldmatrix_b(smem, base + b_ldm[kk * (ni_n // 2) + nj])
                bfrag[nj * 4 + 0] = f0
                bfrag[nj * 4 + 1] = f1
                bfrag[nj * 4 + 2] = f2
                bfrag[nj * 4 + 3] = f3
            for mi in range(mi_n):
                for ni in range(ni_n):
                    x = (mi * ni_n + ni) * 4
                    d0, d1, d2, d3 = mma_bf16_16816(
                        afrag[mi * 4], afrag[mi * 4 + 1], afrag[mi * 4 + 2], afrag[mi * 4 + 3],
                        bfrag[ni * 2], bfrag[ni * 2 + 1], acc[x], acc[x + 1], acc[x + 2],
                        acc[x + 3])
                    acc[x] = d0
                    acc[x + 1] = d1
                    acc[x + 2] = d2
                    acc[x + 3] = d3
    return mma_slice


def make_grouped_gemm(bm, bn, bk, wm, wn, stages, swiglu_epilogue, gather, max_registers=0,
                      b_kn=False, save_pre=False):
    """Build one grouped-GEMM kernel specialisation (all tile sizes are compile-time);
    ``b_kn``: B read as stored, [K, N] per expert (the contract's B_KN), else ABt;
    ``save_pre``: the SWIGLU epilogue also writes g and u to ``pre`` (the contract's SAVE_PRE)."""
    threads = wm * wn * 32
    mi_n = bm // wm // 16                  # m16 tiles per warp
    ni_n = bn // wn // 8                   # n8 tiles per warp
    wn_cols = bn // wn                     # B rows (output columns) per warp column
    half = wn_cols // 2                    # SWIGLU: gate (then up) rows per warp column
    cpr = bk // 8                          # 16-byte chunks per A smem row
    b_cpr = bn // 8 if b_kn else cpr       # ... per B smem row (B_KN: rows of k, BN wide)
    b_row = b_cpr * 8                      # uint16 elements per B smem row
    a_chunks = bm * cpr // threads         # A chunks each thread copies per stage
    b_chunks = bn * cpr // threads         # (B_KN: the same bk x bn elements)
    stage = (bm + bn) * bk                 # uint16 elements per stage
    stage_bytes = stage * 2
    acc_n = mi_n * ni_n * 4                # local-array sizes must be compile-time constants
    afrag_n = mi_n * 4
    bfrag_n = ni_n * 2
    in_flight = stages - 2                 # cp.async groups allowed pending at a K step
    kk_n = bk // 16                        # k16 MMA steps per K slice
    a_ldm_n = mi_n * kk_n                  # ldmatrix row offsets per thread
    b_ldm_n = ni_n // 2 * kk_n
    assert bm % (wm * 16) == 0 and bn % (wn * 16) == 0 and bk in (32, 64)
    assert (bm * cpr) % threads == 0 and (bn * cpr) % threads == 0
    assert not swiglu_epilogue or ni_n % 2 == 0
    assert not (b_kn and swiglu_epilogue) and (not b_kn or b_kn_width_ok(bn))
    assert swiglu_epilogue or not save_pre
    swz = _swizzle(cpr)
    swz_b = _swizzle(b_cpr)
    mma_slice = make_mma_slice(mi_n, ni_n, kk_n, ldmatrix_x4_at,
                               ldmatrix_x4_trans_at if b_kn else ldmatrix_x4_at)

    @kjit(device=True, inline="always")
    def b_row_source(b, col0, n_w):
        """(matrix, row) of the weights feeding B-tile row b."""
        if swiglu_epilogue:
            wc = b // wn_cols
            j = b % wn_cols
            return j // half, col0 + wc * half + j % half     # 0 = gate, 1 = up
        return 0, col0 + b

    @kjit(device=True, inline="always")
    def b_chunk_source(chunk, e, col0, n_w, K, n_out):
        """(matrix, element offset before the K slice's) of B chunk ``chunk`` of a tile."""
        if b_kn:                            # row k = chunk // b_cpr of the slice, along n
            return 0, (chunk // b_cpr) * n_out + col0 + (chunk % b_cpr) * 8
        which, col = b_row_source(chunk // cpr, col0, n_w)
        return which, (e * n_w + col) * K + (chunk % cpr) * 8

    @kjit(device=True, inline="always")
    def b_slice(e, k0, K, n_w, n_out):
        """(matrix, element offset) that K slice ``k0`` adds to the B chunks: ABt (0, k0);
        B_KN w0 (k0 < n_w = K0) or w1 (1) and the slice's first row of expert e there."""
        if not b_kn:
            return 0, k0
        if k0 < n_w:
            return 0, (e * n_w + k0) * n_out
        return 1, (e * (K - n_w) + k0 - n_w) * n_out

    opts = {"max_registers": max_registers} if max_registers else {}

    @kjit(**opts)
    def kernel(a, a_index, w0, w1, offsets, num_rows, out, pre, K, n_w, n_out, limit, errors,
               nf_tensor, nf_rank):
        smem = cuda.shared.array(0, uint16)
        tid = cuda.threadIdx.x
        lane = tid % 32
        warp = tid // 32
        warp_m = warp // wn
        warp_n = warp % wn
        num_experts = offsets.shape[0] - 1
        cols_per_tile = bn // 2 if swiglu_epilogue else bn
        n_tiles = n_out // cols_per_tile
        total = (num_rows[0] // bm) * n_tiles
        ktiles = K // bk

        acc = cuda.local.array(acc_n, float32)
        afrag = cuda.local.array(afrag_n, uint32)
        bfrag = cuda.local.array(bfrag_n, uint32)

        # Shared-memory offsets that never change: where this thread's cp.async chunks land
        # and where its ldmatrix rows start, per (k16 step, fragment). The K loop then only adds
        # the stage base -- integer work in the loop would otherwise outnumber the MMAs.
        # (32-bit shared byte addresses: one add per access in the loop.)
        sbase = shared_addr(smem)
        a_dst = cuda.local.array(a_chunks, uint32)
        b_dst = cuda.local.array(b_chunks, uint32)
        a_ldm = cuda.local.array(a_ldm_n, uint32)
        b_ldm = cuda.local.array(b_ldm_n, uint32)
        for i in range(a_chunks):
            r = (tid + i * threads) // cpr
            a_dst[i] = sbase + (r * bk + swz(r, (tid + i * threads) % cpr) * 8) * 2
        for i in range(b_chunks):
            r = (tid + i * threads) // b_cpr
            b_dst[i] = sbase + (bm * bk + r * b_row
                                + swz_b(r, (tid + i * threads) % b_cpr) * 8) * 2
        for kk in range(kk_n):
            for mi in range(mi_n):
                r = warp_m * (bm // wm) + mi * 16 + lane % 16
                a_ldm[kk * mi_n + mi] = sbase + (r * bk + swz(r, kk * 2 + lane // 16) * 8) * 2
            for nj in range(ni_n // 2):
                # matrix lane // 8: n8 block nj * 2 + lane // 16, k half (lane // 8) % 2
                if b_kn:                      # rows of k; the n8 block is a chunk
                    r = kk * 16 + ((lane // 8) % 2) * 8 + lane % 8
                    c = warp_n * (wn_cols // 8) + nj * 2 + lane // 16
                else:                         # rows of n; the k half is a chunk
                    r = warp_n * wn_cols + (nj * 2 + lane // 16) * 8 + lane % 8
                    c = kk * 2 + (lane // 8) % 2
                b_ldm[kk * (ni_n // 2) + nj] = sbase + (bm * bk + r * b_row + swz_b(r, c) * 8) * 2

        # Per tile: global element offsets of this thread's chunks (K slice start added later).
        a_src = cuda.local.array(a_chunks, int64)
        a_bytes = cuda.local.array(a_chunks, int32)
        b_src = cuda.local.array(b_chunks, int64)
        b_sel = cuda.local.array(b_chunks, int32)

        t = cuda.blockIdx.x
        while t < total:
            e, row0, nt = find_tile(offsets, num_experts, t, n_tiles, bm)
            col0 = nt * cols_per_tile
            for i in range(a_chunks):
                chunk = tid + i * threads
                r = row0 + chunk // cpr
                src = a_index[r] if gather else r
                a_bytes[i] = 16
                if src < 0:                   # padding row: zero-fill, no global read
                    a_bytes[i] = 0
                    src = 0
                a_src[i] = src * K + (chunk % cpr) * 8
            for i in range(b_chunks):
                which, src = b_chunk_source(tid + i * threads, e, col0, n_w, K, n_out)
                b_sel[i] = which
                b_src[i] = src
            for i in range(acc_n):
                acc[i] = float32(0.0)

            # Prologue: fill STAGES-1 slices.
            for s in range(stages - 1):
                if s < ktiles:
                    pick, b_k0 = b_slice(e, s * bk, K, n_w, n_out)
                    _load_stage(smem, s * stage_bytes, a, w1 if pick else w0, w1, a_dst, a_src,
                                a_bytes, b_dst, b_src, b_sel, s * bk, b_k0)
                cp_async_commit()

            load_base = (stages - 1) * stage_bytes  # slice kt+stages-1 goes where kt-1 was
            base = 0
            for kt in range(ktiles):
                cp_async_wait(in_flight)
                cuda.syncthreads()            # slice kt landed; slice kt-1 is free to refill
                if kt + stages - 1 < ktiles:
                    pick, b_k0 = b_slice(e, (kt + stages - 1) * bk, K, n_w, n_out)
                    _load_stage(smem, load_base, a, w1 if pick else w0, w1, a_dst, a_src,
                                a_bytes, b_dst, b_src, b_sel, (kt + stages - 1) * bk, b_k0)
                cp_async_commit()
                mma_slice(smem, base, a_ldm, b_ldm, afrag, bfrag, acc)
                base += stage_bytes           # ring of stages: advance, wrap
                if base == stage_bytes * stages:
                    base = 0
                load_base += stage_bytes
                if load_base == stage_bytes * stages:
                    load_base = 0
            cp_async_wait(0)
            cuda.syncthreads()                # every warp is done with the ring before reuse

            # Epilogue: registers -> bf16 pairs -> out (rows of padding hold zeros), each pair
            # folded into a NaN/Inf check (rows r, r + 8: two chains).
            g = lane // 4
            q = lane % 4
            z0 = uint32(0)
            z1 = uint32(0)
            for mi in range(mi_n):
                r = row0 + warp_m * (bm // wm) + mi * 16 + g
                if swiglu_epilogue:
                    for ni in range(ni_n // 2):
                        x = (mi * ni_n + ni) * 4
                        y = (mi * ni_n + ni + ni_n // 2) * 4
                        col = col0 + warp_n * half + ni * 8 + 2 * q
                        lo = pack_bf16x2(swiglu(acc[x], acc[y], limit),
                                         swiglu(acc[x + 1], acc[y + 1], limit))
                        hi = pack_bf16x2(swiglu(acc[x + 2], acc[y + 2], limit),
                                         swiglu(acc[x + 3], acc[y + 3], limit))
                        out[(r * n_out + col) // 2] = lo
                        out[((r + 8) * n_out + col) // 2] = hi
                        z0 = fold_nonfinite_bf16x2(z0, lo)
                        z1 = fold_nonfinite_bf16x2(z1, hi)
                        if save_pre:
                            st_v2_f32(pre[0], r * n_out + col, acc[x], acc[x + 1])
                            st_v2_f32(pre[0], (r + 8) * n_out + col, acc[x + 2], acc[x + 3])
                            st_v2_f32(pre[1], r * n_out + col, acc[y], acc[y + 1])
                            st_v2_f32(pre[1], (r + 8) * n_out + col, acc[y + 2], acc[y + 3])
                else:
                    for ni in range(ni_n):
                        x = (mi * ni_n + ni) * 4
                        col = col0 + warp_n * wn_cols + ni * 8 + 2 * q
                        lo = pack_bf16x2(acc[x], acc[x + 1])
                        hi = pack_bf16x2(acc[x + 2], acc[x + 3])
                        out[(r * n_out + col) // 2] = lo
                        out[((r + 8) * n_out + col) // 2] = hi
                        z0 = fold_nonfinite_bf16x2(z0, lo)
                        z1 = fold_nonfinite_bf16x2(z1, hi)
            # A clean tile costs one vote; else each lane recounts what it wrote, by row.
            if warp_all(((z0 | z1) & uint32(0x7FFF7FFF)) == 0) == 0:
                bad = 0
                first = 0
                for mi in range(mi_n):
                    for h in range(2):                 # rows ascending: the first is smallest
                        r = row0 + warp_m * (bm // wm) + mi * 16 + g + 8 * h
                        n = 0
                        for ni in range(ni_n // 2 if swiglu_epilogue else ni_n):
                            col = col0 + warp_n * (half if swiglu_epilogue else wn_cols) \
                                + ni * 8 + 2 * q
                            n += nonfinite_bf16x2(out[(r * n_out + col) // 2])
                        if n > 0 and bad == 0:
                            first = r
                        bad += n
                report_warp(errors, nf_tensor, nf_rank, bad, first, e)
            t += cuda.gridDim.x

    @kjit(device=True, inline="always")
    def _load_stage(smem, base, a, w0, w1, a_dst, a_src, a_bytes, b_dst, b_src, b_sel, k0,
                    b_k0):
        """Issue this thread's cp.async chunks of one K slice (A rows, then B rows: chunk i
        from w1 where ``b_sel`` says so, else w0 -- B_KN: the slice's matrix, ``b_slice``)."""
        for i in range(a_chunks):
            cp_async_16_at(smem, base + a_dst[i], a, a_src[i] + k0, a_bytes[i])
        for i in range(b_chunks):
            if b_sel[i] == 0:
                cp_async_16_at(smem, base + b_dst[i], w0, b_src[i] + b_k0, 16)
            else:
                cp_async_16_at(smem, base + b_dst[i], w1, b_src[i] + b_k0, 16)

    kernel.smem_bytes = stage * stages * 2
    kernel.threads = threads
    return kernel


@lru_cache(maxsize=None)
def _kernel(cfg, swiglu_epilogue, gather, b_kn, save_pre):
    return make_grouped_gemm(cfg.bm, cfg.bn, cfg.bk, cfg.wm, cfg.wn, cfg.stages, swiglu_epilogue,
                             gather, max_registers=cfg.max_registers, b_kn=b_kn,
                             save_pre=save_pre)


def launch_gemm(cfg, stream, a, a_index, w0, w1, off, nr, out, K, n_w, n_out, limit, *,
                swiglu, gather, errors, tensor, rank, b_kn=False, pre=None):
    """Persistent launch (``cfg.grid``) of the specialisation for ``cfg``; NaN/Inf in the
    output go to the error word ``errors`` as tensor id ``tensor`` of ``rank``. ``b_kn``: B
    as stored (``n_w`` = K0, the rows per expert of w0); ``pre``: SWIGLU's saved
    pre-activations, (gate, up) flat float32 [rows * n_out] (None: not saved)."""
    C = a_index.shape[0] if gather else a.shape[0]
    n_tile = cfg.bn // 2 if swiglu else cfg.bn
    kern = _kernel(cfg, swiglu, gather, b_kn, pre is not None)
    if pre is None:                                    # placeholder, never touched
        pre = (flat_view(out, np.float32),) * 2
    launch(kern, cfg.grid(C, n_out, n_tile), cfg.threads, stream,
           cfg.smem_bytes, flat_view(a), a_index, flat_view(w0), flat_view(w1), off, nr, out,
           pre, np.int64(K), np.int64(n_w), np.int64(n_out), np.float32(limit), errors,
           np.int32(tensor), np.int32(rank))
