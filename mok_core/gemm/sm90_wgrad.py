"""Weight-gradient (wgrad) grouped GEMM on Hopper warpgroup MMA (wgmma), with its host launch.

Same contract as ``sm80_wgrad`` (read its header: A / a_index / B / b_index / off / num_rows,
out0 / out1 split at m_split, bf16 or FP32 (ACCUMULATE) outputs, the NaN/Inf report, empty
experts written as zeros, rows reduced in ascending order by the tile's one owner):

    D_e[m, n] = sum over rows r in [lo_e, hi_e) of A[ra(r), m] * B[rb(r), n]    for each e

What differs is how a tile is computed. Both operands are stored k-major (the reduction runs
over the rows they are stored in), so both reach the wgmma MN-major: A = the tile's BM columns
of a K slice of rows, B = its BN columns, each as it lies in global memory, and the
``_tatb`` wgmmas (imm-trans-a = imm-trans-b = 1) read them.

    block    = 384 threads in two roles, meeting only at mbarriers: warpgroups 0 and 1
               compute (warpgroup g owns rows m0 + [64g, 64g + 64) of the 128-row tile and
               all BN columns; BN = 64, 128 or 256), warpgroup 2 loads (the producer);
               setmaxnreg moves registers from the producer to the compute warpgroups
               (COMPUTE_REGS / PRODUCER_REGS)
    tiles    = E x (M / 128) x (N / BN) whatever the routing, in the order (expert, row
               tile, column tile): block b takes tiles b, b + grid, ...; the tiles running at
               once share one expert's rows of A and B, which stay in L2, and write whole
               output rows (the other order, a BN-column band of many rows at once, measured
               slower: docs/perf.md). No tile table: the tile -> (expert, m0, n0) map is two
               divisions, done by both roles
    K slice  = BK = 64 consecutive rows r of the expert (32-row slices in a ring twice as
               deep measured slower: docs/perf.md); ktiles = max(1, ceil((hi - lo) / BK))
               slices -- an empty
               expert runs one slice of zeros (the K loop tests its exit after each step: see
               C7518 below), which gives its zero gradient
    stream   = the block's slices in one stream across its tiles (tile b's slices, then tile
               b + grid's, ...): slice j of the stream sits in ring stage j % STAGES, so the
               producer runs ahead into the next tile while the compute warpgroups multiply and
               store this one (an expert is 1-3 slices: a tile's own prologue would expose the
               L2 latency every tile)
    ring     = STAGES slices of [A: 2 boxes | B: BN/64 boxes] in shared memory, 1024-byte
               aligned after the mbarriers; a box = [BK rows of k][64 columns] (8 KiB at 64), row k
               128 bytes at k * 128, 16-byte chunk c of it stored at chunk c ^ (k % 8): the
               MN-major 128-byte-swizzle layout that ``sm90``'s B_KN reads (and TMA writes),
               here written by cp.async
    barriers = full[s] (count 128: each producer thread's arrival, made by the hardware once
               its chunks of the slice in stage s landed) and empty[s] (count 256: each
               compute thread announces that its warpgroup retired the wgmmas reading stage
               s), one phase per pass of the ring;
               slice j waits phase j / STAGES of full[j % STAGES], its refill (slice j +
               STAGES) phase j / STAGES of empty[j % STAGES]
    loads    = the producer's 128 threads, cp.async 16 B: per operand a fixed column chunk
               (and its column repeats when the operand is wider than 128 columns) of rows
               8 or 16 apart, a multiple of 8 so every chunk of a thread has one swizzle.
               Source row r of a slice: index[r] (gathered operand, loaded once for the row's
               repeats) or r; rows at or past hi, and padding rows (index -1), are zero-filled
               without a read (cp.async's ignore-src). No TMA: rows past an expert's end (or
               NaN rows past num_rows) must read as zeros on the direct side too. With K this
               short the loads are issue-bound (docs/perf.md): a producer warpgroup takes
               their integer work off the warps that issue the wgmmas and the epilogue
    MMA      = per slice, per compute warpgroup: BK / 16 x wgmma m64nBNk16 ``_tatb`` from two
               MN-major descriptors (``sm90._DESC_HIGH_MN``: leading byte offset a box between the
               64-column boxes, stride 1024 B between 8 rows of k, + 2048 bytes per k16 step;
               warpgroup g's A starts at box g of the A slice)
    epilogue = bf16: ``epilogue.make_tma_epilogue``, per warp: its 16 rows staged apart from
               the ring (the producer fills every stage meanwhile) as swizzled [16][64]
               boxes -- whole, or half a tile at a time where the whole would not fit
               beside the ring (``bf16_parts``: 128 x 256's 4-stage ring) --, then one TMA
               store a box through the outputs' tensor maps
               (``output_maps``: [E rows, N] views of out0 / out1, built on the host and
               cached); the warp goes back to its wgmmas while the TMA unit writes -- with K
               an expert's rows, a tile's multiply is shorter than its store of a weight-sized
               output, and staging, reading back and storing by the warps themselves left the
               tensor cores idle for longer than they worked (docs/perf.md). FP32:
               ``epilogue.make_tma_epilogue_f32``, the same through FP32 maps ([16][32]
               boxes), the warp's rows whole up to BN = 128 (``epilogue.f32_whole``: the staging
               holds them), else half a tile at a time. ACCUMULATE (main-grad; BN <= 128):
               at the tile's start each warp TMA-loads the output's values of its rows into
               its staging (``epilogue.make_tma_prefetch_f32``, its own mbarrier in
               ``warp[w]``), under the tile's MMAs; the epilogue adds the tile to them there
               (one IEEE add an element) and stores them -- TMA reduce-adds at L2 measured
               slower (docs/perf.md). What is written is checked for NaN/Inf on the way (a
               clean tile: one fold per written value or pair and one warp vote; with
               ACCUMULATE the addends)

Order:

    start:     thread 0 initialises the mbarriers (full[], empty[], warp[8]: the compute
               warps' prefetch); the block's one __syncthreads
    producer, per slice j of the stream:
    1. j >= STAGES: wait empty[j % STAGES] -> both warpgroups retired slice j - STAGES
    2. issue my chunks of slice j into stage j % STAGES
    3. cp.async.mbarrier.arrive.noinc full[j % STAGES]: my arrival, made once those chunks
       landed; I go on to slice j + 1 at once. (Waiting for slice j - 1's chunks here and
       arriving myself, as before, tied slice j - 1's announcement to slice j's issue -- a
       free stage and, gathered, the index loads' round trip: docs/perf.md)
       exit: commit, cp.async.wait(0) -> nothing of mine in flight
    compute, per tile, its slices j (at least one step):
    0. ACCUMULATE: each warp waits until its previous stores read its staging; lane 0:
       arrive.expect_tx(warp[w], the rows' bytes), the output's boxes by TMA into the staging
    1. wait full[j % STAGES] -> every producer thread's chunks of slice j landed;
       fence.proxy.async (cp.async wrote them through the generic proxy, the wgmmas read
       through the async proxy)
    2. wgmma.fence; BK / 16 wgmmas on slice j; commit (tensor cores busy on j ...)
    3. wgmma.wait(1) -> slice j - 1 retired; in the tile's second step on, arrive
       empty[(j - 1) % STAGES]                         (... while j - 1 drains; retiring
       each slice before issuing the next, wait(0), measured slower: docs/perf.md)
    after: wgmma.wait(0); arrive empty[] for the tile's last slice; the epilogue (each warp:
           waits until its previous stores read the staging -- ACCUMULATE: for warp[w]'s
           phase, the tile's parity --, stages (adds), fences, __syncwarp, lane 0 issues the
           TMA stores)
    exit:  each compute warp waits for its stores (bulk_wait; lane 0's are the only ones)

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

from functools import lru_cache

from numba import cuda, int32, int64, uint16, uint32, uint64

from ..cuda_compat import kjit
from ..intrinsics import (bulk_wait, cp_async_16_at, cp_async_commit, cp_async_mbarrier_arrive,
                          cp_async_wait, f32_zeros, fence_mbarrier_init, fence_proxy_async,
                          mbarrier_arrive, mbarrier_init, setmaxnreg_dec, setmaxnreg_inc,
                          shared_addr, tensormap_acquire, warp_all, wgmma_commit, wgmma_fence,
                          wgmma_m64n64k16_bf16_tatb, wgmma_m64n128k16_bf16_tatb,
                          wgmma_m64n256k16_bf16_tatb, wgmma_wait)
from .epilogue import (TMA_BOX_BYTES, TMA_BOX_ROWS, f32_whole, make_tma_epilogue,
                       make_tma_epilogue_f32, make_tma_prefetch_f32)
from .sm80_wgrad import launch_with as _launch_with
from .sm90 import (_DESC_HIGH_MN, _K16_MN, BK, ROW_BYTES, _require_arch, wait_phase,
                   warpgroup_fragment)
from .tensor_map import tensor_maps

_WGMMA_TATB = {64: wgmma_m64n64k16_bf16_tatb, 128: wgmma_m64n128k16_bf16_tatb,
               256: wgmma_m64n256k16_bf16_tatb}


PRODUCER_THREADS = 128        # the loading warpgroup
LAUNCH_REGS = 168             # registers per thread at launch: 64 Ki / 384, rounded down to 8
COMPUTE_REGS = 216            # after setmaxnreg: the compute warpgroups (a 128 x 256 tile's
PRODUCER_REGS = 64            # 128 accumulators and what the epilogue needs) and the producer;
# within the block's launch registers (setmaxnreg only moves registers inside the block)
assert 2 * 128 * COMPUTE_REGS + PRODUCER_THREADS * PRODUCER_REGS <= 3 * 128 * LAUNCH_REGS


def tile_ok(bm, bn):
    """Whether ``make_wgmma_wgrad`` builds a (bm, bn) tile: BM = 128 (two compute warpgroups
    of 64 rows) and BN = 64, 128 or 256 (one wgmma's N)."""
    return bm == 128 and bn in _WGMMA_TATB


def _operand_map(cols):
    """The producer's map of one operand's slice (BK rows x ``cols`` columns): (16-byte chunks
    of a row one pass covers -- 8 or 16 --, rows between a thread's passes -- 16 or 8: a
    multiple of 8, so every chunk of a thread has one swizzle --, passes, column repeats)."""
    cpr = min(cols // 8, 16)
    step = PRODUCER_THREADS // cpr
    return cpr, step, BK // step, cols // 8 // cpr


def _operand_loader(cols, gather):
    """``load(smem, dst, src, index, r, hi, ld, col)``: this producer thread's cp.async chunks
    of one operand's slice into one ring stage: rows r + i * step of ``src`` (through ``index``
    when ``gather``; ``ld`` elements a row), each at column ``col`` and its column repeats,
    the first landing at the shared byte address ``dst``; rows at or past ``hi``, and padding
    rows (index -1), zero-filled without a read (cp.async's ignore-src)."""
    cpr, step, passes, reps = _operand_map(cols)
    rep_bytes = (cpr // 8) * BK * ROW_BYTES  # shared bytes between a thread's column repeats
    rep_cols = cpr * 8                      # and source elements

    @kjit(device=True, inline="always")
    def load(smem, dst, src, index, r, hi, ld, col):
        # The integer work per chunk, not the chunk's bytes, sets the loads' issue rate
        # (docs/perf.md): a 32-bit row test against the rows left, unsigned index loads (numba
        # wraps a signed index around), element offsets as a per-slice base plus a
        # loop-invariant stride (uint64 throughout: numba types uint64 op int64 as float64);
        # a gathered row's index is loaded once for its column repeats.
        left = int32(hi - r)
        row = uint64(r) * uint64(uint32(ld)) + uint64(col)
        for i in range(passes):
            ok = i * step < left
            if gather:
                src_row = int32(-1)          # (int32: an int64 -1 widens every test)
                if ok:
                    src_row = index[uint64(r + i * step)]
                live = src_row >= 0
                off = (uint64(uint32(src_row) if live else uint32(0)) * uint64(uint32(ld))
                       + uint64(col))
                nbytes = 16 if live else 0
            else:
                off = row + uint64(i * step) * uint64(uint32(ld))
                off = off if ok else uint64(col)
                nbytes = 16 if ok else 0
            for c in range(reps):
                cp_async_16_at(smem, dst + i * step * ROW_BYTES + c * rep_bytes, src,
                               off + uint64(c * rep_cols), nbytes)
    return load


def _make_mma_slice(bn):
    """``mma_slice(acc, smem, desc_a, desc_b) -> acc``: one BK-row K slice = wgmma.fence,
    BK / 16 x wgmma m64nBNk16 with both operands MN-major (descriptors ``_DESC_HIGH_MN``: a
    box [BK rows of k][64 columns] between 64-column boxes, 1024 B between 8 rows of k, the
    128-byte swizzle; a k16 step is 16 rows of k, 2048 bytes: +128 in both descriptors'
    address fields), commit."""
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


def make_epilogues(bm, bn, out_f32, accumulate, parts=1):
    """(``prefetch``, ``epilogue``) of a tile (output rows grow0 + i for tile rows i, columns
    n0 ..; D_e's rows m0 + i), each warp its 16 rows through map ``side`` of ``maps``, staged
    at the shared byte address ``epi0``:

    ``prefetch(smem, maps, side, grow0, n0, epi0, lane, frag_row, bar)`` at the tile's start
    -- with ``accumulate`` (main-grad) the output's FP32 values loaded into the staging by TMA
    (``epilogue.make_tma_prefetch_f32``), completing the warp's mbarrier ``bar``; else
    nothing.
    ``epilogue(smem, acc, maps, side, grow0, m0, n0, e, epi0, lane, frag_row, errors,
    nf_tensor, nf_rank, bar, phase)`` after its K loop: the tile written and checked -- bf16
    by ``epilogue.make_tma_epilogue`` (the staging holding the warp's rows whole, or a part of
    ``parts``), FP32 by ``make_tma_epilogue_f32`` (stored; with
    ``accumulate`` once ``bar`` completed phase ``phase``, added to the prefetched values and
    stored)."""
    fetch = out_f32 and accumulate
    tma_epilogue = (make_tma_epilogue_f32(bn, accumulate) if out_f32
                    else make_tma_epilogue(bn, parts))
    tma_prefetch = make_tma_prefetch_f32(bn) if fetch else None

    @kjit(device=True, inline="always")
    def prefetch(smem, maps, side, grow0, n0, epi0, lane, frag_row, bar):
        if fetch:
            tma_prefetch(smem, maps, 16 * side, grow0 + frag_row - lane // 4, n0, epi0, lane,
                         bar)

    @kjit(device=True, inline="always")
    def epilogue(smem, acc, maps, side, grow0, m0, n0, e, epi0, lane, frag_row, errors,
                 nf_tensor, nf_rank, bar, phase):
        row0 = frag_row - lane // 4             # the warp's first tile row
        if fetch:
            wait_phase(smem, bar, phase)        # the prefetched output landed
        tma_epilogue(smem, acc, maps, 16 * side, grow0 + row0, n0, m0 + row0, e, epi0, lane,
                     errors, nf_tensor, nf_rank)

    return prefetch, epilogue


@kjit(device=True, inline="always")
def output_place(e, m0, m_split, M):
    """(side, grow0): where tile rows m0 .. of expert e's D_e land -- the whole tile lies on
    one side of m_split (a multiple of BM): D_e's row m goes to row e * rows + m - first of
    out0 (side 0: rows = m_split, first = 0) or out1 (side 1: rows = M - m_split, first =
    m_split)."""
    side = 0
    rows = m_split
    first = int64(0)
    if m0 >= m_split:
        side = 1
        rows = M - m_split
        first = m_split
    return side, e * rows + m0 - first


SMEM_LIMIT = 227 * 1024                 # dynamic shared memory a block may have (sm_90)


def _smem(bn, stages, warp_staging):
    """The full and empty mbarriers, the 8 compute warps' (main-grad's prefetch), slack to
    align the ring to 1024 bytes, the ring ((128 + BN) / 64 boxes of BK 128-byte rows a
    stage), the 8 compute warps' staging of ``warp_staging`` bytes each."""
    return (16 * stages + 64 + 1024 + stages * (128 + bn) // 64 * BK * ROW_BYTES
            + 8 * warp_staging)


def staging_parts(bn, room):
    """The fewest parts (1, 2 or 4: ``epilogue.make_tma_epilogue``'s ``parts``) a warp stages
    its 16 rows of a bf16 tile ``bn`` wide in, for the 8 compute warps' staging to fit in
    ``room`` bytes (the block's shared memory left beside the ring); the parts a wait apart.
    1 where nothing fits (the caller's size check refuses the tile)."""
    for parts in (1, 2, 4):
        if bn % (64 * parts) == 0 and 8 * warp_staging_bytes(bn, False, parts) <= room:
            return parts
    return 1


def bf16_parts(bn, stages):
    """``staging_parts`` beside this kernel's ring of ``stages``: 1 (whole) at 128 x 256 with 3
    stages; the 4-stage ring (``mok_comm.layer``'s where an expert's rows take more than two
    slices) stages half a tile at a time."""
    return staging_parts(bn, SMEM_LIMIT - _smem(bn, stages, 0))


def warp_staging_bytes(bn, out_f32, parts=1):
    """One warp's staging: its 16 rows of a bf16 tile (whole, or a part of ``parts``) or of an
    FP32 one (whole or half: ``epilogue.f32_whole``), as swizzled TMA boxes of 128-byte rows."""
    if out_f32:
        boxes = bn // 32 if f32_whole(bn) else bn // 64
    else:
        boxes = bn // 64 // parts
    return boxes * TMA_BOX_BYTES


def smem_bytes(bn, stages, out_f32=False):
    """Dynamic shared memory of one block: mbarriers, the ring, the 8 compute warps' staging
    (``warp_staging_bytes``; bf16 tiles whole where they fit: ``bf16_parts``)."""
    return _smem(bn, stages, warp_staging_bytes(bn, out_f32, bf16_parts(bn, stages)))


def _make_tile_walk(bm, bn):
    """``tile_of(t, tiles_per_expert, n_tiles, offsets, num_rows) -> (expert, m0, n0, lo, hi,
    ktiles)``: tile t of the walk (expert, row tile, column tile; module header). 32-bit
    unsigned divisions: int64 ones are calls of ~70 instructions each."""
    @kjit(device=True, inline="always")
    def tile_of(t, tiles_per_expert, n_tiles, offsets, num_rows):
        tu = uint32(t)
        eu = tu // uint32(tiles_per_expert)
        local = tu - eu * uint32(tiles_per_expert)
        mt = local // uint32(n_tiles)
        m0 = int64(mt) * bm
        n0 = int64(local - mt * uint32(n_tiles)) * bn
        e = int64(eu)
        hi = int64(min(offsets[eu + 1], num_rows[0]))
        lo = int64(min(offsets[eu], hi))
        ktiles = max((hi - lo + (BK - 1)) // BK, 1)
        return e, m0, n0, lo, hi, ktiles
    return tile_of


def make_wgmma_wgrad(bm, bn, stages, gather_a, gather_b, out_f32, accumulate):
    """Build one wgmma wgrad specialisation (all arguments compile-time)."""
    assert tile_ok(bm, bn) and stages >= 2
    assert not accumulate or out_f32
    compute = 2 * bm                        # the two compute warpgroups' threads
    threads = compute + PRODUCER_THREADS
    nacc = bn // 2                          # fp32 accumulators per thread
    box = BK * ROW_BYTES                    # one [BK][64] box of the ring
    stage_bytes = (bm + bn) // 64 * box
    a_stage = bm // 64 * box
    parts = bf16_parts(bn, stages)
    warp_staging = warp_staging_bytes(bn, out_f32, parts)
    cpr_a = _operand_map(bm)[0]
    cpr_b = _operand_map(bn)[0]
    nbytes = smem_bytes(bn, stages, out_f32)
    if nbytes > SMEM_LIMIT:
        raise ValueError(f"the wgmma wgrad's {bm} x {bn} tile with {stages} stages needs "
                         f"{nbytes} bytes of shared memory per block: over 227 KiB")
    load_a = _operand_loader(bm, gather_a)
    load_b = _operand_loader(bn, gather_b)
    mma_slice = _make_mma_slice(bn)
    prefetch, epilogue = make_epilogues(bm, bn, out_f32, accumulate, parts)
    tile_of = _make_tile_walk(bm, bn)

    @kjit(device=True, inline="always")
    def produce(smem, full0, empty0, ring, p, a, a_index, b, b_index, offsets, num_rows, M, N,
                total, tiles_per_expert, n_tiles):
        """Producer thread p's part of the block's slice stream (module header)."""
        a_c = p % cpr_a
        a_k = p // cpr_a
        b_c = p % cpr_b
        b_k = p // cpr_b
        a_dst = ring + (a_c // 8) * box + a_k * ROW_BYTES + ((a_c % 8) ^ (a_k % 8)) * 16
        b_dst = (ring + a_stage + (b_c // 8) * box + b_k * ROW_BYTES
                 + ((b_c % 8) ^ (b_k % 8)) * 16)
        j = int64(0)                        # slices issued
        st = 0                              # stage of slice j (compare-and-wrap)
        t = int64(cuda.blockIdx.x)
        while t < total:
            _, m0, n0, lo, hi, ktiles = tile_of(t, tiles_per_expert, n_tiles, offsets,
                                                num_rows)
            for kt in range(ktiles):
                if j >= stages:             # both warpgroups retired slice j - STAGES
                    wait_phase(smem, empty0 + 8 * st, (j // stages - 1) & 1)
                r0 = lo + kt * BK
                off = st * stage_bytes
                load_a(smem, a_dst + off, a, a_index, r0 + a_k, hi, M, m0 + a_c * 8)
                load_b(smem, b_dst + off, b, b_index, r0 + b_k, hi, N, n0 + b_c * 8)
                # announced by the hardware once my chunks of slice j landed: the next
                # slice's issue never waits on this one's loads
                cp_async_mbarrier_arrive(smem, full0 + 8 * st)
                j += 1
                st = 0 if st == stages - 1 else st + 1
            t += cuda.gridDim.x
        cp_async_commit()                   # nothing of mine in flight at the exit
        cp_async_wait(0)

    @kjit(launch_bounds=(threads, 1))
    def kernel(a, a_index, b, b_index, offsets, num_rows, out0, out1, M, N, m_split, errors,
               nf_tensor, nf_rank, maps):
        smem = cuda.shared.array(0, uint16)
        tid = cuda.threadIdx.x
        num_experts = offsets.shape[0] - 1
        n_tiles = N // bn
        tiles_per_expert = (M // bm) * n_tiles
        total = num_experts * tiles_per_expert
        full0 = shared_addr(smem)
        empty0 = full0 + 8 * stages
        warp0 = empty0 + 8 * stages             # the compute warps' prefetch mbarriers
        area = warp0 + 64
        ring = area + (1024 - area % 1024) % 1024
        if tid == 0:
            for s in range(stages):
                mbarrier_init(smem, full0 + 8 * s, PRODUCER_THREADS)
                mbarrier_init(smem, empty0 + 8 * s, compute)
            for w in range(8):
                mbarrier_init(smem, warp0 + 8 * w, 1)
            fence_mbarrier_init()
        cuda.syncthreads()
        # No block barrier from here on: the roles meet only at the mbarriers. Each role works
        # out what it needs after its setmaxnreg (a value live across the producer's must fit
        # its registers).
        if warp_all(tid >= compute):
            setmaxnreg_dec(PRODUCER_REGS)
            produce(smem, full0, empty0, ring, tid - compute, a, a_index, b, b_index, offsets,
                    num_rows, M, N, total, tiles_per_expert, n_tiles)
        else:
            setmaxnreg_inc(COMPUTE_REGS)
            wg, lane, frag_row, frag_col = warpgroup_fragment(tid)
            staging = ring + stages * stage_bytes + (tid // 32) * warp_staging
            tensormap_acquire(maps, 0)      # the host wrote the maps: acquired once
            tensormap_acquire(maps, 16)
            desc_a0 = int64(_DESC_HIGH_MN) + int64((ring + wg * box) >> 4)
            desc_b0 = int64(_DESC_HIGH_MN) + int64((ring + a_stage) >> 4)
            j = int64(0)                    # the stream's slice being computed
            bar = warp0 + 8 * (tid // 32)   # this warp's prefetch mbarrier ...
            phase = 0                       # ... and the phase its tile completes
            t = int64(cuda.blockIdx.x)
            while t < total:
                e, m0, n0, lo, hi, ktiles = tile_of(t, tiles_per_expert, n_tiles, offsets,
                                                    num_rows)
                side, grow0 = output_place(e, m0, m_split, M)
                prefetch(smem, maps, side, grow0, n0, staging, lane, frag_row, bar)
                acc = f32_zeros(nacc)
                # At least one step, the exit tested at the end (``ktiles`` >= 1): a guarded
                # loop makes LLVM copy the zeroed accumulators into the path that skips it
                # (C7518).
                kt = int64(0)
                while True:
                    st = j % stages
                    wait_phase(smem, full0 + 8 * st, (j // stages) & 1)
                    fence_proxy_async()     # the producer's generic-proxy writes -> wgmma
                    soff = (st * stage_bytes) >> 4
                    acc = mma_slice(acc, smem, desc_a0 + soff, desc_b0 + soff)
                    acc = wgmma_wait(acc, 1)
                    if kt > 0:              # slice j - 1 retired: its stage may refill
                        mbarrier_arrive(smem, empty0 + 8 * ((j - 1) % stages))
                    j += 1
                    kt += 1
                    if kt >= ktiles:
                        break
                acc = wgmma_wait(acc, 0)
                mbarrier_arrive(smem, empty0 + 8 * ((j - 1) % stages))
                epilogue(smem, acc, maps, side, grow0, m0, n0, e, staging, lane, frag_row,
                         errors, nf_tensor, nf_rank, bar, phase)
                phase ^= 1
                t += cuda.gridDim.x
            bulk_wait(0)                    # the warp's last stores land before the exit

    kernel.threads = threads
    kernel.smem_bytes = nbytes
    return kernel


@lru_cache(maxsize=None)
def _kernel(cfg, gather_a, gather_b, out_f32, accumulate):
    _require_arch(cfg)
    return make_wgmma_wgrad(cfg.bm, cfg.bn, cfg.stages, gather_a, gather_b, out_f32,
                            accumulate)


def output_maps(out0, out1, E, M, N, m_split, stream=0):
    """The outputs' tensor maps (device uint64 [32], cached: ``tensor_map``): out0 as
    [E m_split, N] and out1 as [E (M - m_split), N] (the other's again where one holds no
    rows: it may then be None), [TMA_BOX_ROWS, 128 bytes] boxes (64 bf16 or 32 float32)."""
    rows0, rows1 = E * m_split, E * (M - m_split)
    if rows0 == 0:
        out0, rows0 = out1, rows1
    if rows1 == 0:
        out1, rows1 = out0, rows0
    return tensor_maps([out0, out1], TMA_BOX_ROWS, stream, shapes=[(rows0, N), (rows1, N)])


def launch_with(kernel_for, cfg, stream, a, a_index, b, b_index, off, nr, out0, out1, M, N,
                m_split, *, accumulate, errors, tensor, rank):
    """``sm80_wgrad.launch_with`` (arguments as there) for kernels of this module's signature:
    the outputs' tensor maps (``output_maps``) go last (the kernel writes through them only:
    ``out0`` / ``out1`` themselves are not read)."""
    maps = output_maps(out0, out1, off.shape[0] - 1, M, N, m_split, stream)
    _launch_with(kernel_for, cfg, stream, a, a_index, b, b_index, off, nr, out0, out1, M, N,
                 m_split, accumulate=accumulate, errors=errors, tensor=tensor, rank=rank,
                 extra=(maps,))


def launch_wgrad(*args, **kwargs):
    """``launch_with`` this module's kernels (a wgmma GemmConfig whose tile ``tile_ok``;
    shared memory ``smem_bytes``)."""
    launch_with(_kernel, *args, **kwargs)