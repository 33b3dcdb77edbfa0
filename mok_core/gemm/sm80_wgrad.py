"""Weight-gradient (wgrad) grouped GEMM on warp-level MMA (mma.sync m16n8k16, any sm_80+ GPU
and the simulator), with its host launch.

Contract of every kernel built here (ThunderKittens style: read this block, know the kernel):

    D_e[m, n] = sum over rows r in [lo_e, hi_e) of A[ra(r), m] * B[rb(r), n]    for each e

    lo_e, hi_e  the expert's segment [off[e], off[e+1]) clamped to num_rows[0] (rows at or past
             num_rows are never read; a segment starting past it is empty)
    A        uint16 (bf16 bits) [A_rows * M] row-major: ra(r) = a_index[r] when GATHER_A
             (a_index[r] = -1: padding row, read as zeros -- the cp.async zero-fill, no global
             read) else r
    B        uint16 [B_rows * N]: rb(r) likewise through b_index (GATHER_B)
    off      int32 [E + 1] row offsets of the expert-sorted space (device)
    num_rows int32 [1]  rows in use (device; the host never reads it)
    out0     [E, m_split, N]      rows m <  m_split of every D_e
    out1     [E, M - m_split, N]  rows m >= m_split (at m - m_split); for one output pass the
             same array twice with m_split = M (out1 is then never touched)
             OUT_F32: float32, written (or with ACCUMULATE: out += D, one FP32 add per element,
             read and written by the thread that owns it); else packed bf16 pairs (uint32
             view), each rounded once from the FP32 sum (round to nearest even)
    errors   int32 [ERROR_WORDS]  NaN/Inf among the values written are counted there under
             tensor id ``nf_tensor`` of ``nf_rank``, with the smallest output row m (of D_e, not
             of the split output) and the expert (``mok_core.errors``; a clean tile pays one
             fold per written value or bf16 pair and one warp vote)

Every output tile of every expert is written -- an expert with no rows gets zeros (ACCUMULATE:
out + 0, the values kept; a -0.0 becomes +0.0) -- so the caller never sees stale tiles.

Layout precondition (the layer's): expert segments are multiples of BK rows -- MoKConfig pads
every expert to row_align, a multiple of 64 -- so every K slice is full. The kernel does not
rely on it for correctness (a ragged tail slice, or one cut by num_rows, is zero-filled past
the end), only for not wasting MMAs on zeros.

Roles and layout in shared memory: a block owns one BM x BN output tile of one expert at a
time. The reduction dimension is the expert's rows, so a K slice is BK consecutive rows r:
of each row the block needs BM contiguous A elements (columns m0 .. m0+BM) and BN contiguous
B elements. They are staged as they lie in global memory -- A^T slice [BK rows of k][BM of m]
and B slice [BK][BN], 16-byte cp.async chunks, the chunk index XOR-swizzled by the row so the
8 rows one ldmatrix matrix reads hit 8 distinct bank groups -- and both MMA fragments come from
``ldmatrix_x4_trans_at`` (A^T and B stored k-major: the transposing load gives the m16k16 A
and k16n8 B fragments directly). A STAGES-deep ring of slices keeps STAGES - 1 slices in
flight; the gather indices of the next slice are loaded one K step ahead into registers, so
issuing a slice's copies never waits on an index load.

Warps: WM x WN, each MI x NI m16n8 tiles (BM/WM rows, BN/WN columns); k16 steps BK/16 per
slice. FP32 accumulation in registers.

Order and determinism: rows are reduced in ascending order, one slice at a time, by the one
block that owns the tile; no split-K, no atomics on data. Same inputs, same bits, whatever the
grid (atomics touch only the error word, whose records are order-independent).

Persistent schedule: block b takes tiles b, b + grid, ... in the order (expert, column tile,
row tile): the tiles running at once share one expert's rows of A and B, which stay in L2.
The tile count is E x (M / BM) x (N / BN) whatever the routing, so the grid and the tile ->
(expert, m tile, n tile) map need no device-side search.
"""
import math
from functools import lru_cache

import numpy as np
from numba import cuda, float32, int32, int64, uint16, uint32

from ..bf16 import nonfinite_bf16x2
from ..cuda_compat import flat_view, kjit, launch, multiprocessor_count
from ..intrinsics import (cp_async_16_at, cp_async_commit, cp_async_wait,
                          fold_nonfinite_bf16x2, ldmatrix_x4_trans_at,
                          pack_bf16x2, shared_addr, warp_all)
from .epilogue import report_warp
from .sm80 import make_mma_slice


def swizzle_ok(cols):
    """Whether a staged row of ``cols`` bf16 can be swizzled here: 2 or 4 chunks (16 or 32
    columns: several rows share one 128-byte bank line) or whole 128-byte lines (a multiple of
    64 columns: the XOR stays inside each aligned group of 8 chunks)."""
    return cols in (16, 32) or (cols > 0 and cols % 64 == 0)


def _swizzle_params(cols):
    """(shift, mask) of the chunk XOR for rows of ``cols`` bf16: physical chunk =
    chunk ^ ((row >> shift) & mask). 8 consecutive rows (what one ldmatrix matrix reads at one
    logical chunk) then land in 8 distinct 16-byte bank groups: rows of 128 bytes or more start
    in the same group, so the low 3 row bits pick it; a 64-byte (32-byte) row shares its line
    with 1 (3) others, which its own position already separates, so the XOR takes the next 2 (1)
    row bits."""
    cpr = cols // 8
    if cpr >= 8:
        return 0, 7
    return {4: 1, 2: 2}[cpr], cpr - 1


@kjit(device=True, inline="always")
def _nonfinite_f32(v):
    """1 if the float32 ``v`` is NaN or Inf, else 0 (the bad path's recount)."""
    return 1 if math.isnan(v) or math.isinf(v) else 0


def _make_fetch(chunks, gather):
    """``fetch(index, rows, r0, hi, kr)``: the source rows of a thread's ``chunks`` chunks of
    one operand for the slice starting at row r0 (rows past ``hi``: -1, zeros)."""
    @kjit(device=True, inline="always")
    def fetch(index, rows, r0, hi, kr):
        for i in range(chunks):
            r = r0 + kr[i]
            src = -1
            if r < hi:
                src = index[r] if gather else r
            rows[i] = src
    return fetch


def make_wgrad_gemm(bm, bn, bk, wm, wn, stages, gather_a, gather_b, out_f32, accumulate,
                    max_registers=0):
    """Build one wgrad kernel specialisation (tile sizes and flags are compile-time)."""
    threads = wm * wn * 32
    mi_n = bm // wm // 16                  # m16 tiles per warp
    ni_n = bn // wn // 8                   # n8 tiles per warp
    warp_rows = bm // wm
    warp_cols = bn // wn
    cpr_a = bm // 8                        # 16-byte chunks per staged A^T row
    cpr_b = bn // 8
    a_chunks = bk * cpr_a // threads       # chunks each thread copies per slice
    b_chunks = bk * cpr_b // threads
    a_elems = bk * bm                      # uint16 elements of the A^T slice (B follows)
    stage_bytes = (bm + bn) * bk * 2
    acc_n = mi_n * ni_n * 4                # local-array sizes must be compile-time constants
    afrag_n = mi_n * 4
    bfrag_n = ni_n * 2
    in_flight = stages - 2                 # cp.async groups allowed pending at a K step
    kk_n = bk // 16                        # k16 MMA steps per slice
    a_ldm_n = mi_n * kk_n
    b_ldm_n = ni_n // 2 * kk_n
    assert bm % (wm * 16) == 0 and bn % (wn * 16) == 0 and bk in (32, 64) and stages >= 2
    assert (bk * cpr_a) % threads == 0 and (bk * cpr_b) % threads == 0
    assert swizzle_ok(bm) and swizzle_ok(bn)
    assert not accumulate or out_f32
    a_shift, a_mask = _swizzle_params(bm)
    b_shift, b_mask = _swizzle_params(bn)

    @kjit(device=True, inline="always")
    def swz_a(row, chunk):
        return chunk ^ ((row >> a_shift) & a_mask)

    @kjit(device=True, inline="always")
    def swz_b(row, chunk):
        return chunk ^ ((row >> b_shift) & b_mask)

    fetch_a = _make_fetch(a_chunks, gather_a)
    fetch_b = _make_fetch(b_chunks, gather_b)
    mma_slice = make_mma_slice(mi_n, ni_n, kk_n, ldmatrix_x4_trans_at, ldmatrix_x4_trans_at)

    @kjit(device=True, inline="always")
    def issue(smem, base, a, b, a_dst, a_rows, a_col, b_dst, b_rows, b_col, M, N):
        """This thread's cp.async chunks of one slice (A^T, then B) into the stage at ``base``."""
        for i in range(a_chunks):
            src = a_rows[i]
            nbytes = 16
            if src < 0:                   # padding / past the segment: zero-fill, no read
                nbytes = 0
                src = 0
            cp_async_16_at(smem, base + a_dst[i], a, src * M + a_col[i], nbytes)
        for i in range(b_chunks):
            src = b_rows[i]
            nbytes = 16
            if src < 0:
                nbytes = 0
                src = 0
            cp_async_16_at(smem, base + b_dst[i], b, src * N + b_col[i], nbytes)

    opts = {"max_registers": max_registers} if max_registers else {}

    @kjit(**opts)
    def kernel(a, a_index, b, b_index, offsets, num_rows, out0, out1, M, N, m_split, errors,
               nf_tensor, nf_rank):
        smem = cuda.shared.array(0, uint16)
        tid = cuda.threadIdx.x
        lane = tid % 32
        warp = tid // 32
        warp_m = warp // wn
        warp_n = warp % wn
        num_experts = offsets.shape[0] - 1
        m_tiles = M // bm
        tiles_per_expert = m_tiles * (N // bn)
        total = num_experts * tiles_per_expert

        acc = cuda.local.array(acc_n, float32)
        afrag = cuda.local.array(afrag_n, uint32)
        bfrag = cuda.local.array(bfrag_n, uint32)

        # Per-thread constants: where its chunks land (32-bit shared byte addresses), which
        # row of the slice each one is, and where its ldmatrix rows start per (k16 step,
        # fragment) -- the K loop then only adds the stage base.
        sbase = shared_addr(smem)
        a_dst = cuda.local.array(a_chunks, uint32)
        b_dst = cuda.local.array(b_chunks, uint32)
        a_kr = cuda.local.array(a_chunks, int32)
        b_kr = cuda.local.array(b_chunks, int32)
        a_ldm = cuda.local.array(a_ldm_n, uint32)
        b_ldm = cuda.local.array(b_ldm_n, uint32)
        for i in range(a_chunks):
            k = (tid + i * threads) // cpr_a
            a_kr[i] = k
            a_dst[i] = sbase + (k * bm + swz_a(k, (tid + i * threads) % cpr_a) * 8) * 2
        for i in range(b_chunks):
            k = (tid + i * threads) // cpr_b
            b_kr[i] = k
            b_dst[i] = sbase + (a_elems + k * bn + swz_b(k, (tid + i * threads) % cpr_b) * 8) * 2
        j = lane // 8                      # the ldmatrix matrix this lane addresses a row of
        for kk in range(kk_n):
            for mi in range(mi_n):
                # A^T: matrix j = (m half j % 2, k half j // 2) -> a0..a3 of m16n8k16
                k = kk * 16 + (j // 2) * 8 + lane % 8
                c = (warp_m * warp_rows + mi * 16 + (j % 2) * 8) // 8
                a_ldm[kk * mi_n + mi] = sbase + (k * bm + swz_a(k, c) * 8) * 2
            for nj in range(ni_n // 2):
                # B: matrix j = (n8 tile 2 nj + j // 2, k half j % 2) -> b0, b1 of two n8 tiles
                k = kk * 16 + (j % 2) * 8 + lane % 8
                c = (warp_n * warp_cols + nj * 16 + (j // 2) * 8) // 8
                b_ldm[kk * (ni_n // 2) + nj] = sbase + (a_elems + k * bn + swz_b(k, c) * 8) * 2

        # Per tile: global column offsets of the chunks; per slice: their source rows.
        a_col = cuda.local.array(a_chunks, int64)
        b_col = cuda.local.array(b_chunks, int64)
        a_rows = cuda.local.array(a_chunks, int32)
        b_rows = cuda.local.array(b_chunks, int32)

        t = cuda.blockIdx.x
        while t < total:
            e = t // tiles_per_expert
            local = t - e * tiles_per_expert
            m0 = (local % m_tiles) * bm
            n0 = (local // m_tiles) * bn
            nr = num_rows[0]
            hi = min(offsets[e + 1], nr)
            lo = min(offsets[e], hi)
            ktiles = (hi - lo + (bk - 1)) // bk
            for i in range(a_chunks):
                a_col[i] = m0 + ((tid + i * threads) % cpr_a) * 8
            for i in range(b_chunks):
                b_col[i] = n0 + ((tid + i * threads) % cpr_b) * 8
            for i in range(acc_n):
                acc[i] = float32(0.0)

            # Prologue: fill STAGES-1 slices, then load the next slice's rows.
            for s in range(stages - 1):
                fetch_a(a_index, a_rows, lo + s * bk, hi, a_kr)
                fetch_b(b_index, b_rows, lo + s * bk, hi, b_kr)
                if s < ktiles:
                    issue(smem, s * stage_bytes, a, b, a_dst, a_rows, a_col, b_dst, b_rows,
                          b_col, M, N)
                cp_async_commit()
            fetch_a(a_index, a_rows, lo + (stages - 1) * bk, hi, a_kr)
            fetch_b(b_index, b_rows, lo + (stages - 1) * bk, hi, b_kr)

            load_base = (stages - 1) * stage_bytes  # slice kt+stages-1 goes where kt-1 was
            base = 0
            for kt in range(ktiles):
                cp_async_wait(in_flight)
                cuda.syncthreads()            # slice kt landed; slice kt-1 is free to refill
                if kt + stages - 1 < ktiles:
                    issue(smem, load_base, a, b, a_dst, a_rows, a_col, b_dst, b_rows, b_col,
                          M, N)
                cp_async_commit()
                # the rows of slice kt+stages: their loads complete under this step's MMAs
                fetch_a(a_index, a_rows, lo + (kt + stages) * bk, hi, a_kr)
                fetch_b(b_index, b_rows, lo + (kt + stages) * bk, hi, b_kr)
                mma_slice(smem, base, a_ldm, b_ldm, afrag, bfrag, acc)
                base += stage_bytes           # ring of stages: advance, wrap
                if base == stage_bytes * stages:
                    base = 0
                load_base += stage_bytes
                if load_base == stage_bytes * stages:
                    load_base = 0
            cp_async_wait(0)
            cuda.syncthreads()                # every warp is done with the ring before reuse

            # Epilogue: the whole tile lies on one side of m_split (a multiple of BM). Row
            # (e, m) of D goes to row e * rows + (m - first) of that output, flattened.
            out = out0
            rows = m_split
            first = 0
            if m0 >= m_split:
                out = out1
                rows = M - m_split
                first = m_split
            g = lane // 4
            q = lane % 4
            row0 = e * rows + m0 - first + warp_m * warp_rows + g
            col0 = n0 + warp_n * warp_cols + 2 * q
            # NaN/Inf check of what is written, rows g and g + 8 in two chains: bf16 pairs by
            # fold_nonfinite_bf16x2; FP32 values by z + v * 0 (stays a zero while every v is
            # finite, NaN from the first NaN/Inf on: one FMA per value).
            z0 = uint32(0)
            z1 = uint32(0)
            y0 = float32(0.0)
            y1 = float32(0.0)
            for mi in range(mi_n):
                r = row0 + mi * 16
                for ni in range(ni_n):
                    x = (mi * ni_n + ni) * 4
                    lo_at = r * N + col0 + ni * 8
                    hi_at = lo_at + 8 * N
                    if out_f32:
                        v0 = acc[x]
                        v1 = acc[x + 1]
                        v2 = acc[x + 2]
                        v3 = acc[x + 3]
                        if accumulate:
                            v0 = out[lo_at] + v0
                            v1 = out[lo_at + 1] + v1
                            v2 = out[hi_at] + v2
                            v3 = out[hi_at + 1] + v3
                        out[lo_at] = v0
                        out[lo_at + 1] = v1
                        out[hi_at] = v2
                        out[hi_at + 1] = v3
                        y0 = v1 * float32(0.0) + (v0 * float32(0.0) + y0)
                        y1 = v3 * float32(0.0) + (v2 * float32(0.0) + y1)
                    else:
                        w_lo = pack_bf16x2(acc[x], acc[x + 1])
                        w_hi = pack_bf16x2(acc[x + 2], acc[x + 3])
                        out[lo_at // 2] = w_lo
                        out[hi_at // 2] = w_hi
                        z0 = fold_nonfinite_bf16x2(z0, w_lo)
                        z1 = fold_nonfinite_bf16x2(z1, w_hi)
            if out_f32:
                clean = y0 + y1 == float32(0.0)
            else:
                clean = ((z0 | z1) & uint32(0x7FFF7FFF)) == 0
            # A clean tile costs one vote; else each lane recounts what it wrote, by row.
            if warp_all(clean) == 0:
                bad = 0
                first_m = 0
                for mi in range(mi_n):
                    for h in range(2):                 # rows ascending: the first is smallest
                        at = (row0 + mi * 16 + 8 * h) * N + col0
                        n = 0
                        for ni in range(ni_n):
                            if out_f32:
                                n += _nonfinite_f32(out[at + ni * 8])
                                n += _nonfinite_f32(out[at + ni * 8 + 1])
                            else:
                                n += nonfinite_bf16x2(out[(at + ni * 8) // 2])
                        if n > 0 and bad == 0:
                            first_m = m0 + warp_m * warp_rows + mi * 16 + g + 8 * h
                        bad += n
                report_warp(errors, nf_tensor, nf_rank, bad, first_m, e)
            t += cuda.gridDim.x

    kernel.smem_bytes = stage_bytes * stages
    kernel.threads = threads
    return kernel


@lru_cache(maxsize=None)
def _kernel(cfg, gather_a, gather_b, out_f32, accumulate):
    return make_wgrad_gemm(cfg.bm, cfg.bn, cfg.bk, cfg.wm, cfg.wn, cfg.stages, gather_a,
                           gather_b, out_f32, accumulate, max_registers=cfg.max_registers)


def grid(cfg, experts, M, N):
    """Persistent grid: one block per SM (x blocks_per_sm), never more than the tiles."""
    tiles = experts * (M // cfg.bm) * (N // cfg.bn)
    return max(1, min(tiles, multiprocessor_count() * cfg.blocks_per_sm))


def launch_with(kernel_for, cfg, stream, a, a_index, b, b_index, off, nr, out0, out1, M, N,
                m_split, *, accumulate, errors, tensor, rank, extra=()):
    """Persistent launch of ``kernel_for(cfg, gather_a, gather_b, out_f32, accumulate)`` (this
    module's ``_kernel`` or, through ``sm90_wgrad.launch_with``, that module's: the two share
    their arguments, ``extra`` appended): trusted device views (``a`` [A_rows, M], ``b``
    [B_rows, N] uint16, indices int32 or None, ``out0`` / ``out1`` uint16 or float32 of the
    same dtype -- one may be None where it would hold no rows). NaN/Inf written go to
    ``errors`` as tensor id ``tensor`` of ``rank``."""
    if out0 is None:
        out0 = out1
    if out1 is None:
        out1 = out0
    out_f32 = np.dtype(out0.dtype) == np.float32
    view = None if out_f32 else np.uint32
    E = off.shape[0] - 1
    kern = kernel_for(cfg, a_index is not None, b_index is not None, out_f32, bool(accumulate))
    launch(kern, grid(cfg, E, M, N), kern.threads, stream, kern.smem_bytes, flat_view(a),
           nr if a_index is None else a_index, flat_view(b),        # (unused placeholders)
           nr if b_index is None else b_index, off, nr, flat_view(out0, view),
           flat_view(out1, view), np.int64(M), np.int64(N), np.int64(m_split), errors,
           np.int32(tensor), np.int32(rank), *extra)


def launch_wgrad(*args, **kwargs):
    """``launch_with`` this module's (mma.sync) kernels."""
    launch_with(_kernel, *args, **kwargs)
