"""Weight-gradient (wgrad) grouped GEMM on Hopper warpgroup MMA (wgmma), with its host launch.

Same contract as ``sm80_wgrad`` (read its header: A / a_index / B / b_index / off / num_rows,
out0 / out1 split at m_split, bf16 or FP32 (ACCUMULATE) outputs, the NaN/Inf report, empty
experts written as zeros, rows reduced in ascending order by the tile's one owner):

    D_e[m, n] = sum over rows r in [lo_e, hi_e) of A[ra(r), m] * B[rb(r), n]    for each e

What differs is how a tile is computed. Both operands are stored k-major (the reduction runs
over the rows they are stored in), so both reach the wgmma MN-major: A = the tile's BM columns
of a K slice of rows, B = its BN columns, each as it lies in global memory, and the
``_tatb`` wgmmas (imm-trans-a = imm-trans-b = 1) read them.

    block    = BM / 64 warpgroups (BM = 128: 256 threads; 256: 512 threads with BN <= 128);
               warpgroup g owns rows m0 + [64g, 64g + 64) of the tile and all BN columns
               (BN = 64, 128 or 256)
    tiles    = E x (M / BM) x (N / BN) whatever the routing, in the order (expert, column
               tile, row tile): block b takes tiles b, b + grid, ...; the tiles running at once
               share one expert's rows of A and B, which stay in L2. No tile table: the tile ->
               (expert, m0, n0) map is two divisions
    K slice  = 64 consecutive rows r of the expert (BK = 64: one 128-byte swizzle row per
               64 columns); ktiles = max(1, ceil((hi - lo) / 64)) slices -- an empty expert
               runs one slice of zeros (the K loop tests its exit after each step: see C7518
               below), which gives its zero gradient
    ring     = STAGES slices of [A: BM/64 boxes | B: BN/64 boxes] in shared memory, 1024-byte
               aligned; a box = [64 rows of k][64 columns] (8 KiB), row k 128 bytes at k * 128,
               16-byte chunk c of it stored at chunk c ^ (k % 8): the MN-major 128-byte-swizzle
               layout that ``sm90``'s B_KN reads (and TMA writes), here written by cp.async
    stream   = the block's slices in one stream across its tiles (tile b's slices, then tile
               b + grid's, ...): slice j of the stream sits in stage j % STAGES, and the loads
               run PREFETCH = STAGES - 2 slices ahead of the MMAs whatever tile they belong to,
               so the next tile's first slices land while this tile multiplies and stores (an
               expert is 1-3 slices: a tile's own prologue would expose the L2 latency every
               tile). One cp.async group per slice of the stream, empty past the last tile
    loads    = every thread, cp.async 16 B, a fixed column chunk of each operand and rows
               64 / (threads / (BM/8)) apart (A: 4 chunks per slice; B: 4 BN / BM), a pass of
               rows a multiple of 8 apart so every chunk of a thread has one swizzle. Source
               row r of a slice: index[r] (gathered operand) or r; rows at or past hi, and
               padding rows (index -1), are zero-filled without a read (cp.async's
               ignore-src). No TMA: rows past an expert's end (or NaN rows past num_rows)
               must read as zeros on the direct side too. With K this short the kernel is
               issue-bound, so a chunk costs a 32-bit row test, an unsigned index load and
               one wide multiply-add (``chunk_offset``), and the tile map 32-bit divisions
    MMA      = per slice, per warpgroup: 4 x wgmma m64nBNk16 ``_tatb`` from two MN-major
               descriptors (``sm90._DESC_HIGH_MN``: leading byte offset 8 KiB between the
               64-column boxes, stride 1024 B between 8 rows of k, + 2048 bytes per k16 step;
               A's warpgroup g starts at box g of the A slice)
    epilogue = bf16: staged in the two ring stages the tile leaves free (the stages of its
               last two slices: the PREFETCH loads in flight hold the other STAGES - 2), 64
               rows a warpgroup at stride BN * 2 + 16, warpgroup g in free stage g % 2 at
               region g // 2 -- no staging apart, so the ring can be a stage deeper -- each
               warp its own 16 rows, which it then reads back and stores coalesced (16 B a
               lane, 512 contiguous bytes a warp instruction). Not bulk stores: one per
               128-1024-byte row is ~128 requests a tile through the SM's one bulk-copy
               unit, and with K this short the tile's requests, not its bytes, set the time
               (docs/perf.md). FP32: each thread stores its fragment (ACCUMULATE: adds it to
               the value read first, one FP32 add). What is written is checked for NaN/Inf on
               the way (a clean tile: one fold per written value or pair and one warp vote)

Order, every thread:

    prologue:  the stream's slices 0 .. PREFETCH - 1 into stages 0 .. PREFETCH - 1
    per tile:
    K loop, the tile's slices (stream slice j: compute stage j % STAGES, load stream slice
    j + PREFETCH into stage (j + PREFETCH) % STAGES; at least one step):
    1. cp.async.wait(PREFETCH - 1) -> my chunks of slice j landed; fence.proxy.async (wgmma
       reads through the async proxy); __syncthreads -> everyone's chunks landed and every
       warpgroup retired slice j - 2's wgmmas (and every warp read its previous staging)
    2. wgmma.fence; 4 wgmmas on slice j; commit           (tensor cores busy on j ...)
    3. issue loads of stream slice j + PREFETCH (this tile's or a later one's) into the stage
       of slice j - 2 (free, by 1.); commit
    4. wgmma.wait(1) -> slice j - 1's group retired       (... while j - 1 drains)
    after: wgmma.wait(0); bf16: __syncthreads -> every warpgroup retired the tile's last
           two slices, whose stages the staging takes; the epilogue (each warp stages,
           __syncwarp, reads back and stores its own rows). The next loads into those two
           stages are issued after the next two steps' barriers, every warp past its reads
    exit: cp.async.wait(0)

C7518 (ptxas serialising every wgmma of the kernel): no wgmma or warp barrier sits on a path
ptxas may think divergent -- the only branches around them test kernel arguments and block-
uniform tile values or a warp vote (``warp_all``) -- and the K loop runs at least once, so LLVM
does not copy the accumulator's zeroing into a path around it (``sm90``'s header).
``benchmarks/probes/ptxas_check.py`` prints ptxas's verdict per production kernel.

Order and determinism: each tile's rows are reduced in ascending order, 16 per wgmma, by the
one block that owns the tile; no split-K, no atomics on data. Same inputs, same bits, whatever
the grid (the FP32 sums differ from mma.sync's in rounding: a different MMA tree).
"""
from __future__ import annotations

import math
from functools import lru_cache

from numba import cuda, float32, int32, int64, uint16, uint32, uint64

from ..cuda_compat import kjit
from ..intrinsics import (cp_async_16_at, cp_async_commit, cp_async_wait, f32_zeros,
                          fence_proxy_async, shared_addr, tuple_fold, warp_all, wgmma_commit,
                          wgmma_fence, wgmma_m64n64k16_bf16_tatb, wgmma_m64n128k16_bf16_tatb,
                          wgmma_m64n256k16_bf16_tatb, wgmma_wait)
from .epilogue import make_coalesced_epilogue, report_warp
from .sm80_wgrad import launch_with
from .sm90 import (_DESC_HIGH_MN, _K16_MN, BK, BOX_BYTES, ROW_BYTES, _require_arch,
                   warpgroup_fragment)

_WGMMA_TATB = {64: wgmma_m64n64k16_bf16_tatb, 128: wgmma_m64n128k16_bf16_tatb,
               256: wgmma_m64n256k16_bf16_tatb}


def tile_ok(bm, bn):
    """Whether the loader's thread mapping covers a (bm, bn) tile: each thread copies one column
    chunk of each operand in passes of rows a multiple of 8 apart (one swizzle per thread) that
    divide the 64-row slice -- BM = 128 with BN = 64, 128 or 256, and BM = 256 with BN <= 128
    (not the 192-row tile: 384 threads over 32 chunks of a 256-wide row is no whole pass)."""
    threads = 2 * bm
    for cols in (bm, bn):
        cpr = cols // 8
        if cols % 64 or threads % cpr:
            return False
        step = threads // cpr
        if step % 8 or BK % step:
            return False
    return bm in (128, 256) and bn in _WGMMA_TATB and (bm < 256 or bn <= 128)


def _make_loader(bm, bn, stages, gather_a, gather_b):
    """``load_slice(smem, st, r0, hi, a, a_index, b, b_index, M, N, a_dst, b_dst, a_src0,
    b_src0, a_k, b_k)``: this thread's cp.async chunks of the slice of rows [r0, r0 + 64)
    (rows at or past ``hi``, and padding rows: zero-filled, no read) into ring stage ``st``.
    ``a_dst`` / ``b_dst``: the shared byte address of the thread's first chunk in stage 0;
    ``a_src0`` / ``b_src0``: its column in the tile (m0 / n0 included); ``a_k`` / ``b_k``:
    its first row of the slice."""
    threads = 2 * bm
    step_a = threads // (bm // 8)
    step_b = threads // (bn // 8)
    n_a = BK // step_a
    n_b = BK // step_b
    stage_bytes = (bm + bn) * ROW_BYTES

    @kjit(device=True, inline="always")
    def chunk_offset(index, gather, row0, r, i, step, left, cols, col0):
        """(element offset, bytes) of chunk i: row r = ``r`` + i * step of the operand
        (through ``index`` when ``gather``) at column col0 -- (col0, 0) past the expert or
        on padding (zero-filled, no read). ``row0``: r's offset when not gathered."""
        ok = i * step < left
        if gather:
            src = int32(-1)                  # (int32: an int64 -1 widens every test)
            if ok:
                src = index[uint64(r + i * step)]
            live = src >= 0
            return (uint64(uint32(src) if live else uint32(0)) * uint64(uint32(cols))
                    + uint64(col0)), (16 if live else 0)
        off = row0 + uint64(i * step) * uint64(uint32(cols))
        return (off if ok else uint64(col0)), (16 if ok else 0)

    @kjit(device=True, inline="always")
    def load_slice(smem, st, r0, hi, a, a_index, b, b_index, M, N, a_dst, b_dst, a_src0,
                   b_src0, a_k, b_k):
        # The integer work per chunk, not the chunk's bytes, sets the K loop's issue rate
        # (docs/perf.md): a 32-bit row test against the rows left, unsigned index loads (numba
        # wraps a signed index around), element offsets as a per-slice base plus a
        # loop-invariant stride (uint64 throughout: numba types uint64 op int64 as float64).
        base = st * stage_bytes
        ra = r0 + a_k
        left_a = int32(hi - ra)
        row_a = uint64(ra) * uint64(uint32(M)) + uint64(a_src0)
        for i in range(n_a):
            off, nbytes = chunk_offset(a_index, gather_a, row_a, ra, i, step_a, left_a, M,
                                       a_src0)
            cp_async_16_at(smem, a_dst + base + i * step_a * ROW_BYTES, a, off, nbytes)
        rb = r0 + b_k
        left_b = int32(hi - rb)
        row_b = uint64(rb) * uint64(uint32(N)) + uint64(b_src0)
        for i in range(n_b):
            off, nbytes = chunk_offset(b_index, gather_b, row_b, rb, i, step_b, left_b, N,
                                       b_src0)
            cp_async_16_at(smem, b_dst + base + i * step_b * ROW_BYTES, b, off, nbytes)

    return load_slice


def _make_mma_slice(bn):
    """``mma_slice(acc, smem, desc_a, desc_b) -> acc``: one 64-row K slice = wgmma.fence,
    4 x wgmma m64nBNk16 with both operands MN-major (a k16 step is 16 rows of k, 2048 bytes:
    +128 in both descriptors' address fields), commit."""
    mma = _WGMMA_TATB[bn]

    @kjit(device=True, inline="always")
    def mma_slice(acc, smem, da, db):
        acc = wgmma_fence(acc)
        acc = mma(acc, smem, da, db)
        acc = mma(acc, smem, da + _K16_MN, db + _K16_MN)
        acc = mma(acc, smem, da + 2 * _K16_MN, db + 2 * _K16_MN)
        acc = mma(acc, smem, da + 3 * _K16_MN, db + 3 * _K16_MN)
        wgmma_commit()
        return acc
    return mma_slice


def _store_f32_group(accumulate):
    """Group j of a thread's fragment (rows r and r + 8 of the output, columns col + 8j,
    col + 8j + 1) -> ``out`` (float32, flat, N columns; row r at element ``at``), each value
    added to the one read first with ``accumulate``; the values folded into the NaN/Inf
    chains ``y`` (z + v * 0: stays zero while every v is finite)."""
    def group(j, y, out, at, N, a0, a1, a2, a3):
        lo = at + 8 * j
        hi = lo + 8 * N
        if accumulate:
            a0 = out[lo] + a0
            a1 = out[lo + 1] + a1
            a2 = out[hi] + a2
            a3 = out[hi + 1] + a3
        out[lo] = a0
        out[lo + 1] = a1
        out[hi] = a2
        out[hi + 1] = a3
        zero = float32(0.0)
        return a1 * zero + (a0 * zero + y[0]), a3 * zero + (a2 * zero + y[1])
    return group


def _plain_layout(count):
    return [[4 * j + i for i in range(4)] for j in range(count // 4)]


def _make_epilogues(bm, bn, out_f32, accumulate):
    """``epilogue(smem, acc, out, grow0, m0, n0, e, N, rows, epi0, lane, frag_row, frag_col,
    limit, errors, nf_tensor, nf_rank, pre, route)`` (``limit``, ``pre``, ``route`` unused):
    the finished tile (output rows grow0 + i of ``out`` for tile rows i, columns n0 ..; D_e's
    rows m0 + i) written and checked; bf16: ``epilogue.make_coalesced_epilogue``, staged at
    the shared byte address ``epi0``."""
    store_f32 = tuple_fold(_store_f32_group(accumulate), _plain_layout)
    epilogue_bf16 = make_coalesced_epilogue(bn)

    @kjit(device=True, inline="always")
    def epilogue_f32(smem, acc, out, grow0, m0, n0, e, N, rows, epi0, lane, frag_row,
                     frag_col, limit, errors, nf_tensor, nf_rank, pre, route):
        at = (grow0 + frag_row) * N + n0 + frag_col
        y = store_f32(acc, (float32(0.0), float32(0.0)), (out, at, N))
        # a clean tile costs one vote; else each lane recounts what it wrote, by row
        if warp_all(y[0] + y[1] == float32(0.0)) == 0:
            bad = 0
            first_m = 0
            for h in range(2):                 # rows ascending: the first is the smallest
                n = 0
                for j in range(bn // 8):
                    x = at + h * 8 * N + 8 * j
                    n += _nonfinite_f32(out[x]) + _nonfinite_f32(out[x + 1])
                if n > 0 and bad == 0:
                    first_m = m0 + frag_row + 8 * h
                bad += n
            report_warp(errors, nf_tensor, nf_rank, bad, first_m, e)

    return epilogue_f32 if out_f32 else epilogue_bf16


@kjit(device=True, inline="always")
def _nonfinite_f32(v):
    """1 if the float32 ``v`` is NaN or Inf, else 0 (the bad path's recount)."""
    return 1 if math.isnan(v) or math.isinf(v) else 0


def staging_fits(bm, bn):
    """Whether a bf16 tile's staging fits the two free ring stages: BM / 64 warpgroup regions
    of 64 rows x (2 BN + 16) bytes, two stages of (BM + BN) 128-byte rows."""
    regions = (bm // 64 + 1) // 2
    return regions * 64 * (2 * bn + 16) <= (bm + bn) * ROW_BYTES


def smem_bytes(bm, bn, stages):
    """Dynamic shared memory of one block: slack to align the ring to 1024 bytes, and the
    ring (the bf16 staging lives in it)."""
    return 1024 + stages * (bm + bn) * ROW_BYTES


def make_wgmma_wgrad(bm, bn, stages, gather_a, gather_b, out_f32, accumulate, max_registers=0,
                     blocks_per_sm=1):
    """Build one wgmma wgrad specialisation (all arguments compile-time)."""
    assert tile_ok(bm, bn) and stages >= 3 and staging_fits(bm, bn)
    assert not accumulate or out_f32
    threads = 2 * bm
    nacc = bn // 2                          # fp32 accumulators per thread
    prefetch = stages - 2
    in_flight = prefetch - 1                # cp.async groups allowed pending at step 1
    stage_bytes = (bm + bn) * ROW_BYTES
    a_stage = bm * ROW_BYTES
    cpr_a = bm // 8
    cpr_b = bn // 8
    nbytes = smem_bytes(bm, bn, stages)
    region = 64 * (2 * bn + 16)             # a warpgroup's staging
    if nbytes * blocks_per_sm > 227 * 1024:
        raise ValueError(f"the wgmma wgrad's {bm} x {bn} tile with {stages} stages needs "
                         f"{nbytes} bytes of shared memory per block, x {blocks_per_sm} "
                         "blocks per SM: over 227 KiB")
    load_slice = _make_loader(bm, bn, stages, gather_a, gather_b)
    mma_slice = _make_mma_slice(bn)
    epilogue = _make_epilogues(bm, bn, out_f32, accumulate)
    opts = {"max_registers": max_registers} if max_registers else {}
    if bm >= 192 or blocks_per_sm > 1:
        opts["launch_bounds"] = (threads, blocks_per_sm)

    @kjit(device=True, inline="always")
    def tile_of(t, tiles_per_expert, m_tiles, offsets, num_rows):
        """Tile t -> (expert, m0, n0, lo, hi, ktiles). 32-bit unsigned divisions: int64 ones
        are calls of ~70 instructions each, three per tile here and three in ``load_next``."""
        tu = uint32(t)
        eu = tu // uint32(tiles_per_expert)
        local = tu - eu * uint32(tiles_per_expert)
        mt = local // uint32(m_tiles)
        m0 = int64(local - mt * uint32(m_tiles)) * bm
        n0 = int64(mt) * bn
        e = int64(eu)
        hi = int64(min(offsets[eu + 1], num_rows[0]))
        lo = int64(min(offsets[eu], hi))
        ktiles = max((hi - lo + (BK - 1)) // BK, 1)
        return e, m0, n0, lo, hi, ktiles

    @kjit(device=True, inline="always")
    def load_next(smem, lst, lt, lk, lm0, ln0, llo, lhi, lkt, total, tiles_per_expert, m_tiles,
                  offsets, num_rows, a, a_index, b, b_index, M, N, a_dst, b_dst, a_col, b_col,
                  a_k, b_k):
        """The slice stream's next slice (slice lk of tile lt, none past the block's last
        tile) into ring stage lst, one cp.async group either way; returns the cursor moved
        on by one slice (to the next tile of the block after a tile's last)."""
        if lt < total:
            load_slice(smem, lst, llo + lk * BK, lhi, a, a_index, b, b_index, M, N, a_dst,
                       b_dst, lm0 + a_col, ln0 + b_col, a_k, b_k)
            lk += 1
            if lk >= lkt:
                lk = 0
                lt += cuda.gridDim.x
                if lt < total:
                    _, lm0, ln0, llo, lhi, lkt = tile_of(lt, tiles_per_expert, m_tiles,
                                                         offsets, num_rows)
        cp_async_commit()
        return lt, lk, lm0, ln0, llo, lhi, lkt

    @kjit(**opts)
    def kernel(a, a_index, b, b_index, offsets, num_rows, out0, out1, M, N, m_split, errors,
               nf_tensor, nf_rank):
        smem = cuda.shared.array(0, uint16)
        tid = cuda.threadIdx.x
        wg, lane, frag_row, frag_col = warpgroup_fragment(tid)
        num_experts = offsets.shape[0] - 1
        m_tiles = M // bm
        tiles_per_expert = m_tiles * (N // bn)
        total = num_experts * tiles_per_expert

        # The ring from the first 1024-byte boundary; this thread's chunks (module header):
        # A column chunk tid % (BM/8) of rows tid // (BM/8) + pass, B likewise.
        sbase = shared_addr(smem)
        ring = sbase + (1024 - sbase % 1024) % 1024
        # this warpgroup's staging: free stage wg % 2 (counted back from the tile's last),
        # region wg // 2, addressed by tile row (its rows start at 64 wg)
        epi_back = 1 + wg % 2
        epi_off = (wg // 2) * region - wg * 64 * (2 * bn + 16)
        a_c = tid % cpr_a
        a_k = tid // cpr_a
        b_c = tid % cpr_b
        b_k = tid // cpr_b
        a_dst = (ring + (a_c // 8) * BOX_BYTES + a_k * ROW_BYTES
                 + ((a_c % 8) ^ (a_k % 8)) * 16)
        b_dst = (ring + a_stage + (b_c // 8) * BOX_BYTES + b_k * ROW_BYTES
                 + ((b_c % 8) ^ (b_k % 8)) * 16)
        a_col = a_c * 8
        b_col = b_c * 8
        desc_a0 = int64(_DESC_HIGH_MN) + int64((ring + wg * BOX_BYTES) >> 4)
        desc_b0 = int64(_DESC_HIGH_MN) + int64((ring + a_stage) >> 4)

        # The slice stream's load cursor (tile lt, its slice lk) runs PREFETCH slices ahead of
        # the MMAs, across the block's tiles: the prologue fills stages 0 .. PREFETCH - 1.
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
                offsets, num_rows, a, a_index, b, b_index, M, N, a_dst, b_dst, a_col, b_col,
                a_k, b_k)
        cst = 0                                # ring stages of the slice computed / loaded
        lst = prefetch                         # (compare-and-wrap: no modulo in the loop)
        while t < total:
            e, m0, n0, lo, hi, ktiles = tile_of(t, tiles_per_expert, m_tiles, offsets,
                                                num_rows)
            acc = f32_zeros(nacc)
            # At least one step, the exit tested at the end (``ktiles`` >= 1): a guarded loop
            # makes LLVM copy the zeroed accumulators into the path that skips it (C7518).
            kt = int64(0)
            while True:
                cp_async_wait(in_flight)       # my chunks of this slice landed
                fence_proxy_async()
                cuda.syncthreads()             # everyone's; slice - 2's wgmmas retired
                soff = (cst * stage_bytes) >> 4
                acc = mma_slice(acc, smem, desc_a0 + soff, desc_b0 + soff)
                lt, lk, lm0, ln0, llo, lhi, lkt = load_next(
                    smem, lst, lt, lk, lm0, ln0, llo, lhi, lkt, total, tiles_per_expert,
                    m_tiles, offsets, num_rows, a, a_index, b, b_index, M, N, a_dst, b_dst,
                    a_col, b_col, a_k, b_k)
                acc = wgmma_wait(acc, 1)
                cst = 0 if cst == stages - 1 else cst + 1
                lst = 0 if lst == stages - 1 else lst + 1
                kt += 1
                if kt >= ktiles:
                    break
            acc = wgmma_wait(acc, 0)
            if not out_f32:
                cuda.syncthreads()             # the tile's last two stages: free everywhere
            fs = cst - epi_back
            fs = fs + stages if fs < 0 else fs

            # This tile's place in the outputs: the whole tile lies on one side of m_split (a
            # multiple of BM); D_e's row m goes to row e * rows + m - first of that output.
            out = out0
            rows = m_split
            first = int64(0)
            if m0 >= m_split:
                out = out1
                rows = M - m_split
                first = m_split
            epilogue(smem, acc, out, e * rows + m0 - first, m0, n0, e, N, bm,
                     ring + fs * stage_bytes + epi_off, lane,
                     frag_row, frag_col, float32(0.0), errors, nf_tensor, nf_rank, None, None)
            t += cuda.gridDim.x
        cp_async_wait(0)                       # (the stream's empty tail groups)

    kernel.threads = threads
    kernel.smem_bytes = nbytes
    return kernel


@lru_cache(maxsize=None)
def _kernel(cfg, gather_a, gather_b, out_f32, accumulate):
    _require_arch(cfg)
    return make_wgmma_wgrad(cfg.bm, cfg.bn, cfg.stages, gather_a, gather_b, out_f32,
                            accumulate, max_registers=cfg.max_registers,
                            blocks_per_sm=cfg.blocks_per_sm)


def launch_wgrad(*args, **kwargs):
    """``sm80_wgrad.launch_with`` this module's kernels (a wgmma GemmConfig whose tile
    ``tile_ok``; bf16 outputs 16-byte aligned: 16-byte stores; shared memory ``smem_bytes``)."""
    launch_with(_kernel, *args, **kwargs)