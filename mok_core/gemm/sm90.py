"""Grouped expert GEMM on Hopper warpgroup MMA (wgmma), with its host launch.

Same contract as ``sm80`` (read its header: A / a_index / W / off / num_rows / out, the SWIGLU
and plain outputs, deterministic FP32 accumulation; ABt and B_KN = dgrad, the weights read as
stored, plain epilogue only, A gathered or direct, ``push`` allowed); what differs is how a
tile is computed:

    block    = BM / 64 warpgroups (BM = 128: 256 threads; 192: 384; 256: 512 with BN <= 128);
               warpgroup g owns rows [64g, 64g + 64) of the tile and all BN columns
               (BN = 64, 128 or 256)
    tiles    = up to BM rows of one expert: experts' rows are padded to multiples of 64 and cut
               into ceil(rows / BM) tiles; a per-expert table in shared memory (``tile_table``)
               maps tile ids to experts in the order (expert, column tile, row tile), block b
               taking tiles b, b + grid, ...; a warpgroup whose rows lie past the expert idles
    K slice  = 64 bf16 = one 128-byte row per tile row: the unit of wgmma's 128-byte swizzle
    ring     = STAGES slices of [A BM x 64 | B BN x 64] in shared memory, 1024-byte aligned,
               16-byte chunk c of row r stored at chunk c ^ (r % 8) (what the descriptors say);
               B_KN: B is BN/64 blocks [64 rows of k][64 columns of n], 8 KiB each
    loads    = A: every thread, cp.async 16 B (rows gathered through a_index, padding rows and
               rows past the expert zero-filled without a load); B (weights): thread 0, one TMA
               box per slice (SWIGLU: a gate box and an up box; B_KN: BN/64 boxes of 64 x 64
               from w0's map below K0, else w1's -- K0 a multiple of 64: a slice never
               straddles) from the tensor maps (``tensor_map``), landing swizzled and
               completing on the stage's mbarrier full[s] (phase bit per stage, flipped at each
               wait). PREFETCH = STAGES - 2 slices ahead.
    MMA      = per slice, per warpgroup: 4 x wgmma m64nBNk16 from two descriptors, both
               K-major (start address + 32 bytes per k16 step; stride 1024 B between 8-row
               groups); B_KN: B MN-major (the ``_tb`` wgmmas, imm-trans-b = 1; leading byte
               offset 8 KiB between 64-column blocks, stride 1024 B between 8 rows of k, + 2048
               bytes per k16 step: see ``_DESC_HIGH_MN`` for the PTX ISA sections relied on)
    epilogue = staged in the ring stages the next tile's prologue leaves free, rows sent by
               bulk stores (``epilogue`` module header; ``push``: to the source ranks' combine
               rows), so the next tile's MMAs need not wait for the global stores; what it
               stages is checked for NaN/Inf on the way (reported to the error word); SAVE_PRE
               (gate/up): the FP32 g and u also go from the registers straight to ``pre``

Shared memory: uint16 tile table [E + 1] (``MAX_EXPERTS`` + 1), STAGES mbarriers full[s], the
ring. Order of one tile, every thread:

    prologue (issued before the K loop, right after the previous tile's staging):
               loads of slices 0 .. PREFETCH - 1 into stages 0 .. PREFETCH - 1
    K loop, step kt (compute stage kt % STAGES, load stage (kt + PREFETCH) % STAGES; B_KN:
    at least one step, K > 0):
    0. (kt = 0, sending lanes) bulk_wait_read: the previous staging was read out
    1. cp.async.wait -> my A chunks of slice kt landed; wait full[kt's stage] -> B landed;
       fence.proxy.async (wgmma reads through the async proxy); __syncthreads -> everyone's
       chunks landed, every warpgroup retired slice kt - 2's wgmmas, and step 0 is done
    2. issue loads of slice kt + PREFETCH into the stage of slice kt - 2 (free, by 1.)
    3. wgmma.fence; 4 wgmmas on slice kt; commit      (tensor cores busy on kt ...)
    4. wgmma.wait(1) -> slice kt - 1's group retired  (... while kt - 1 drains)
    after: wgmma.wait(0); cp.async.wait(0); __syncthreads (the ring is free)
    epilogue: stage and send this tile; then the next tile's prologue
    exit: the sending lanes wait for their last bulk stores

A warpgroup whose 64 rows are all padding (a_index[first row] < 0: padding sits at the end of
each expert's segment) skips its MMAs and stages zeros. Branches around wgmmas and warp
barriers test a warp vote (``warp_all``): under a plain per-thread ``if`` ptxas serialises
every wgmma of the kernel (C7518). So does a non-wgmma instruction that defines accumulator
registers between a wgmma and its wait, which LLVM produces when it copies the accumulator's
zeroing into the path around a K loop that may run no step: the tile loop carries one int64
``b_row`` (no tuple: ``_make_loader``), and B_KN's K loop tests its exit after each step (the
forward keeps the guarded ``for``, whose code LLVM leaves alone; see the kernel).
``benchmarks/probes/ptxas_check.py`` prints ptxas's verdict per production kernel without a
GPU.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from numba import cuda, int32, int64, uint16, uint32

from ..cuda_compat import SIM, flat_view, kjit, launch
from ..intrinsics import (bulk_wait, bulk_wait_read, cp_async_16_at, cp_async_commit,
                          cp_async_wait, f32_zeros, fence_mbarrier_init, fence_proxy_async,
                          mbarrier_arrive_expect_tx, mbarrier_init, mbarrier_try_wait,
                          shared_addr, tensormap_acquire, tma_load_2d, trap, warp_all,
                          wgmma_commit, wgmma_fence, wgmma_m64n64k16_bf16,
                          wgmma_m64n64k16_bf16_tb, wgmma_m64n128k16_bf16,
                          wgmma_m64n128k16_bf16_tb, wgmma_m64n256k16_bf16,
                          wgmma_m64n256k16_bf16_tb, wgmma_wait)
from .epilogue import make_staged_epilogue
from .tensor_map import BOX_COLS, MAP_ELEMS, tensor_maps

BK = 64                       # K slice: 64 bf16 = 128 bytes = the swizzle atom's row
ROW_BYTES = BK * 2
ROW_UNIT = 64                 # experts' rows are padded to this (one warpgroup's rows)
MAX_EXPERTS = 512             # per launch: the tile table in shared memory is sized for it
_TABLE_BYTES = -(-2 * (MAX_EXPERTS + 1) // 8) * 8     # uint16 [E + 1], mbarriers 8-aligned after
_WGMMA = {64: wgmma_m64n64k16_bf16, 128: wgmma_m64n128k16_bf16, 256: wgmma_m64n256k16_bf16}
_WGMMA_TB = {64: wgmma_m64n64k16_bf16_tb, 128: wgmma_m64n128k16_bf16_tb,
             256: wgmma_m64n256k16_bf16_tb}
BOX_BYTES = BK * BOX_COLS * 2  # B_KN: one TMA box, 64 rows of k x 64 columns of n (8 KiB)

# Matrix descriptor bits (PTX ISA, "matrix descriptor"): start address >> 4 in [13:0],
# leading byte offset >> 4 in [29:16] (unused for swizzled K-major; 1 by convention),
# stride byte offset >> 4 in [45:32] (1024 B: next group of 8 rows), swizzle mode in [63:62]
# (1 = 128-byte). Base offset [51:49] stays 0: every tile starts 1024-byte aligned.
_DESC_HIGH = (1 << 16) | ((1024 >> 4) << 32) | (1 << 62)
_K16 = 32 >> 4                # K-major: a k16 step is 32 bytes along the 128-byte row
# B_KN (B MN-major, the wgmma's imm-trans-b = 1). PTX ISA 9.7.15.5.1.2 "Shared Memory Matrix
# Layout": canonical MN-major 128B layout ((T,8,m),(8,k)) : ((1,T,LBO),(8T,SBO)) with T = 8
# bf16, i.e. 64 n (one 128-byte row) contiguous, 8 rows of k 128 bytes apart (one 1024-byte
# swizzle atom), atoms LBO apart along n and SBO apart along k; "Leading Dimension Byte
# Offset", MN-major swizzled: from the first (128/16 = 8) rows of 128-bit elements to the
# next -- the next 64 columns of n; "Stride Dimension Byte Offset", MN-major swizzled: from
# the first 8 columns to the next 8 -- the next 8 rows of k. CUTLASS make_gmma_desc
# (Major::MN, B128) sets the same: leading_byte_offset = the MN atom stride, stride_byte_offset
# = the k stride; ThunderKittens' st_descriptor (transpose, 128B) likewise: LBO = the bytes of
# one 64-column block of its [k][n] tile, SBO = 1024, a k16 chunk +2048 bytes. Our slice of B
# is BN/64 TMA boxes [64 k][64 n], 8 KiB apart: LBO = 8192,
# SBO = 1024, and a k16 step moves 16 rows of k = 2048 bytes (+128 in the address field): every
# step starts on a 1024-byte boundary, so the base offset stays 0 here too.
_DESC_HIGH_MN = ((BOX_BYTES >> 4) << 16) | ((1024 >> 4) << 32) | (1 << 62)
_K16_MN = (16 * ROW_BYTES) >> 4
_SPIN_LIMIT = 1 << 22         # try_wait rounds before a wait is declared hung (~seconds)


def smem_bytes(bn, stages, bm):
    """Dynamic shared memory of one block: the tile table, STAGES mbarriers, slack to align
    the ring to 1024 bytes, the ring."""
    return _TABLE_BYTES + 8 * stages + 1024 + stages * (bm + bn) * ROW_BYTES


@kjit(device=True, inline="always")
def warpgroup_fragment(tid):
    """Thread ``tid`` of a block of warpgroups: (its warpgroup g, its lane, the first of the two
    tile rows its wgmma fragment holds -- that and the row 8 below, in g's rows [64g, 64g + 64)
    -- and its first column: 8j + that (+1) for group j)."""
    wg = tid // 128
    lane = tid % 32
    return wg, lane, wg * 64 + ((tid % 128) // 32) * 16 + lane // 4, 2 * (lane % 4)


@kjit(device=True, inline="always")
def wait_phase(smem, bar, parity):
    """Until the mbarrier at ``bar`` completed the phase of ``parity``. Bounded: only a bug in
    the kernel itself can make it time out, and then it traps (a launch failure, not a hang)."""
    n = 0
    while mbarrier_try_wait(smem, bar, parity) == 0:
        n += 1
        if n == _SPIN_LIMIT:
            trap()


@kjit(device=True, inline="always")
def tile_table(smem, offsets, num_experts, bm, rows_cap):
    """Thread 0 writes first[e] = row tiles of experts < e (uint16 smem[0 .. E]): an expert's
    rows (padded to a multiple of 64) are cut into ceil(rows / bm) tiles that never cross into
    the next expert, so bm need not divide the padding. Offsets are clamped to ``rows_cap``
    (the rows the buffers hold): after a capacity overflow -- flagged by the schedule -- the
    GEMM stays inside its arrays (and its pushes inside real rows). The caller syncs."""
    if cuda.threadIdx.x == 0:
        acc = 0
        for e in range(num_experts):
            smem[e] = acc
            lo = min(offsets[e], rows_cap)
            acc += (min(offsets[e + 1], rows_cap) - lo + bm - 1) // bm
        smem[num_experts] = acc


@kjit(device=True, inline="always")
def find_tile_in_table(smem, offsets, num_experts, t, n_tiles, bm, rows_cap):
    """Tile id -> (expert, first row, column tile, end of the expert's rows, clamped to
    ``rows_cap``); the expert's first tile id = first[e] * n_tiles. Unsigned (tile ids and
    the table's counts are far below 2^32): one unsigned division a tile -- numba widens it to
    64 bits, and the division routine takes its 32-bit path at run time -- where signed
    ``//`` and ``%`` were two divisions with their sign fixes."""
    t32 = uint32(t)
    n32 = uint32(n_tiles)
    lo = uint32(0)
    hi = uint32(num_experts - 1)
    while lo < hi:                         # last expert whose first tile id <= t
        mid = (lo + hi + uint32(1)) >> uint32(1)
        if uint32(smem[mid]) * n32 <= t32:
            lo = mid
        else:
            hi = mid - uint32(1)
    first = uint32(smem[lo])
    m_tiles = uint32(smem[lo + uint32(1)]) - first
    local = t32 - first * n32
    nt = local // m_tiles
    row_tile = local - nt * m_tiles
    return (int64(lo), min(offsets[lo], rows_cap) + int64(row_tile) * bm, int64(nt),
            min(offsets[lo + uint32(1)], rows_cap))


class _Layout:
    """Compile-time sizes of one specialisation (read into locals before the device functions
    close over them: numba specialises on closure constants)."""

    def __init__(self, bn, stages, bm):
        self.bn, self.stages, self.bm = bn, stages, bm
        self.threads = 2 * bm                   # bm / 64 warpgroups of 128 threads
        self.pass_rows = self.threads // 8      # rows covered when every thread copies a chunk
        self.pass_bytes = self.pass_rows * ROW_BYTES
        self.a_passes = bm // self.pass_rows    # A rows per loading thread
        self.a_stage = bm * ROW_BYTES           # bytes of A in a stage; B follows
        self.stage_bytes = (bm + bn) * ROW_BYTES
        self.prefetch = stages - 2              # slices in flight ahead of the MMAs
        self.in_flight = self.prefetch - 1      # cp.async groups allowed pending at step 1


def _make_loader(lay, swiglu_epilogue, gather, padding_index, b_kn):
    """``tile_start(...)``: where a tile's A chunks come from, where its B boxes come from
    (``b_row``), whether this warpgroup's rows are the expert's (``owned``) and real
    (``active``), and its prologue loads issued.
    ``load_stage(...)``: one slice into a ring stage -- this thread's A chunks by cp.async,
    then (thread 0) B's TMA box(es) armed on the stage's full barrier.

    The tile loop carries one int64 scalar for B, ``b_row`` (ABt: B's first weight row,
    e N_w + col0; B_KN: the expert e, each slice's rows and columns derived from it, col0, K
    and K0). Not a tuple: one carried through the tile loop, even a 1-tuple, makes LLVM copy
    the accumulator's zeroing into the path around the K loop, and ptxas serialise every
    wgmma (C7518; module header) -- the forward's kernels too."""
    bn, bm = lay.bn, lay.bm
    a_rows, pass_rows, pass_bytes = lay.a_passes, lay.pass_rows, lay.pass_bytes
    a_stage, stage_bytes, prefetch = lay.a_stage, lay.stage_bytes, lay.prefetch
    half_bytes = (bn // 2) * ROW_BYTES
    uses_index = gather or padding_index

    @kjit(device=True, inline="always")
    def a_sources(a_index, first_row, row_end, K, chunk, a_src, a_nb):
        """Per tile: the element offset of each of this thread's A chunks (rows a pass apart:
        one swizzle) and the bytes to read -- 16, or 0 for a padding row or a row of the next
        expert, which cp.async zero-fills; kept apart from the offset so the K loop does no
        per-chunk selects."""
        for j in range(a_rows):
            r = first_row + pass_rows * j
            src = -1
            if r < row_end:
                src = a_index[r] if gather else r
            a_nb[j] = 16 if src >= 0 else 0
            a_src[j] = max(src, 0) * K + chunk * 8

    @kjit(device=True, inline="always")
    def load_stage(smem, st, k0, ring, full0, tmaps, dst0, a, a_src, a_nb, b_row, col0, K,
                   n_w, tid):
        """``b_row`` (``tile_start``): ABt, B's first weight row (``col0``, ``K`` and ``n_w``
        unused); B_KN, the expert (``n_w`` = K0)."""
        dst = dst0 + st * stage_bytes
        for j in range(a_rows):
            cp_async_16_at(smem, dst + j * pass_bytes, a, a_src[j] + k0, a_nb[j])
        if tid == 0:
            b_dst = ring + st * stage_bytes + a_stage
            bar = full0 + 8 * st
            mbarrier_arrive_expect_tx(smem, bar, bn * ROW_BYTES)
            if b_kn:
                # the slice's 64 rows of k from w0 (map 0) below K0, else from w1 (map 1):
                # BN/64 boxes of 64 columns side by side, BOX_BYTES apart (the descriptor's
                # leading byte offset). w0 [E K0, N]: expert e's row k at e K0 + k; w1
                # [E (K - K0), N]: at e (K - K0) + k - K0.
                lo = k0 < n_w
                elem = 0 if lo else MAP_ELEMS
                row = (b_row * n_w if lo else b_row * (K - n_w) - n_w) + k0
                for j in range(bn // BOX_COLS):
                    tma_load_2d(smem, b_dst + j * BOX_BYTES, tmaps, elem,
                                col0 + j * BOX_COLS, row, bar)
            else:
                tma_load_2d(smem, b_dst, tmaps, 0, k0, b_row, bar)
                if swiglu_epilogue:        # gate rows from map 0, up rows from map 1
                    tma_load_2d(smem, b_dst + half_bytes, tmaps, MAP_ELEMS, k0, b_row, bar)

    @kjit(device=True, inline="always")
    def tile_start(smem, a, a_index, tmaps, offsets, t, n_tiles, K, n_w, ktiles, ring, full0,
                   dst0, a_src, a_nb, ld_row, ld_chunk, wg, tid, rows_cap):
        """Returns (first row, first output column, b_row, active, owned)."""
        e, row0, nt, row_end = find_tile_in_table(smem, offsets, offsets.shape[0] - 1, t,
                                                  n_tiles, bm, rows_cap)
        col0 = nt * (bn // 2 if swiglu_epilogue else bn)
        a_sources(a_index, row0 + ld_row, row_end, K, ld_chunk, a_src, a_nb)
        b_row = e if b_kn else e * n_w + col0
        first = row0 + wg * 64
        owned = first < row_end
        active = owned
        if uses_index and owned:
            active = a_index[first] >= 0
        for s in range(prefetch):
            if s < ktiles:
                load_stage(smem, s, s * BK, ring, full0, tmaps, dst0, a, a_src, a_nb, b_row,
                           col0, K, n_w, tid)
            cp_async_commit()
        return row0, col0, b_row, active, owned

    return tile_start, load_stage


def _make_mma_slice(bn, b_kn):
    """``mma_slice(acc, smem, desc_a, desc_b) -> acc``: one 64-wide K slice = wgmma.fence, 4 x
    wgmma m64nBNk16 (K-major k16 steps are 32 bytes apart: +2 in the descriptor's address
    field; B_KN's B steps 16 rows of k, 2048 bytes: +128), commit; the caller decides how long
    to let it run (``wgmma_wait``)."""
    mma = (_WGMMA_TB if b_kn else _WGMMA)[bn]
    kb = _K16_MN if b_kn else _K16

    @kjit(device=True, inline="always")
    def mma_slice(acc, smem, da, db):
        acc = wgmma_fence(acc)
        acc = mma(acc, smem, da, db)
        acc = mma(acc, smem, da + _K16, db + kb)
        acc = mma(acc, smem, da + 2 * _K16, db + 2 * kb)
        acc = mma(acc, smem, da + 3 * _K16, db + 3 * kb)
        wgmma_commit()
        return acc
    return mma_slice


def _make_kernel(lay, swiglu_epilogue, push, gather, b_kn, tile_start, load_stage, mma_slice,
                 stage_and_send, opts):
    """The kernel body: set-up, then per tile the K loop and the staged epilogue (module
    header)."""
    desc_high_b = _DESC_HIGH_MN if b_kn else _DESC_HIGH
    two_maps = swiglu_epilogue or b_kn
    bn, bm, stages = lay.bn, lay.bm, lay.stages
    stage_bytes, a_stage, prefetch, in_flight = (lay.stage_bytes, lay.a_stage, lay.prefetch,
                                                 lay.in_flight)
    a_passes = lay.a_passes
    nacc = bn // 2                          # fp32 accumulators per thread

    @kjit(device=True, inline="always")
    def k_step(smem, acc, kt, ktiles, cst, lst, phases, active, ring, full0, tmaps, dst0, a,
               a_src, a_nb, b_row, col0, K, n_w, tid, desc_a0, desc_b0):
        """K loop step ``kt`` (module header, steps 1-4): compute ring stage ``cst``, load
        slice kt + PREFETCH into stage ``lst``. Returns (acc, cst, lst, phases) for kt + 1."""
        cp_async_wait(in_flight)
        wait_phase(smem, full0 + 8 * cst, (phases >> cst) & 1)
        phases ^= 1 << cst
        fence_proxy_async()
        cuda.syncthreads()
        soff = (cst * stage_bytes) >> 4
        run_mma = warp_all(active) != 0     # vote: see the header (C7518)
        nxt = kt + prefetch
        if nxt < ktiles:
            load_stage(smem, lst, nxt * BK, ring, full0, tmaps, dst0, a, a_src, a_nb, b_row,
                       col0, K, n_w, tid)
        cp_async_commit()
        if run_mma:
            acc = mma_slice(acc, smem, desc_a0 + soff, desc_b0 + soff)
            acc = wgmma_wait(acc, 1)
        cst = 0 if cst == stages - 1 else cst + 1
        lst = 0 if lst == stages - 1 else lst + 1
        return acc, cst, lst, phases

    @kjit(**opts)
    def kernel(a, a_index, w0, w1, tmaps, offsets, num_rows, out, pre, K, n_w, n_out, limit,
               route_rank, route_token, route_slot, peers, k, errors, nf_tensor, nf_rank):
        smem = cuda.shared.array(0, uint16)
        tid = cuda.threadIdx.x
        wg, lane, frag_row, frag_col = warpgroup_fragment(tid)
        num_experts = offsets.shape[0] - 1
        n_tiles = n_out // (bn // 2 if swiglu_epilogue else bn)
        ktiles = K // BK

        # Shared memory: the tile table, the full barriers, then the ring aligned to the
        # swizzle atom; where this thread's 16-byte chunks land in pass 0 (pass i adds
        # i * pass_bytes: pass_rows rows on, same row % 8, same swizzle).
        sbase = shared_addr(smem)
        full0 = sbase + _TABLE_BYTES            # full[s] at full0 + 8 s
        ring0 = full0 + 8 * stages
        ring = ring0 + (1024 - ring0 % 1024) % 1024
        ld_row = tid // 8
        ld_chunk = tid % 8
        dst0 = ring + ld_row * ROW_BYTES + ((ld_chunk ^ (ld_row % 8)) * 16)
        desc_a0 = int64(_DESC_HIGH) + int64((ring + wg * 64 * ROW_BYTES) >> 4)
        desc_b0 = int64(desc_high_b) + int64((ring + a_stage) >> 4)
        # Rows the buffers hold: the output's (gate/up: hidden [C, n_out] as bf16 pairs), the
        # index's (dgrad gathered: a_index [C]) or A's (down, dgrad direct: [C, K]); the
        # output may be a placeholder when pushing.
        if swiglu_epilogue:
            rows_cap = out.shape[0] * 2 // n_out
        elif gather:
            rows_cap = a_index.shape[0]
        else:
            rows_cap = a.shape[0] // K
        tile_table(smem, offsets, num_experts, bm, rows_cap)
        if tid == 0:
            for s in range(stages):
                mbarrier_init(smem, full0 + 8 * s, 1)
            tensormap_acquire(tmaps, 0)
            if two_maps:
                tensormap_acquire(tmaps, MAP_ELEMS)
            fence_mbarrier_init()
        cuda.syncthreads()
        total = int64(smem[num_experts]) * n_tiles
        nf_div = int64(1) if b_kn else n_w      # b_row // nf_div: the expert (NaN/Inf report)
        phases = 0                              # bit s = parity of full[s]'s next phase

        a_src = cuda.local.array(a_passes, int64)
        a_nb = cuda.local.array(a_passes, int32)

        t = cuda.blockIdx.x
        row0 = 0
        col0 = 0
        b_row = 0
        active = True
        owned = True
        if t < total:
            row0, col0, b_row, active, owned = tile_start(
                smem, a, a_index, tmaps, offsets, t, n_tiles, K, n_w, ktiles, ring, full0,
                dst0, a_src, a_nb, ld_row, ld_chunk, wg, tid, rows_cap)
        while t < total:
            acc = f32_zeros(nacc)
            cst = 0                            # ring stages of the slice computed / loaded
            lst = prefetch                     # (compare-and-wrap: no modulo in the loop)
            if lane < 16:                      # the last epilogue's staging (stages
                bulk_wait_read(0)              # PREFETCH..) is read out before kt = 0
            if b_kn:
                # At least one step, tested at the end (K >= 64: the launch checks it): with
                # the guarded loop below, LLVM copies the 128 zeroed accumulators into the
                # path that skips the loop, laid out after it -- non-wgmma definitions of
                # accumulator registers inside the wgmma pipeline, for which ptxas serialises
                # every wgmma of the kernel (C7518). The forward keeps the guarded loop: its
                # code is the one measured, and LLVM does not split its zeroing.
                kt = 0
                while True:
                    acc, cst, lst, phases = k_step(
                        smem, acc, kt, ktiles, cst, lst, phases, active, ring, full0, tmaps,
                        dst0, a, a_src, a_nb, b_row, col0, K, n_w, tid, desc_a0, desc_b0)
                    kt += 1
                    if kt >= ktiles:
                        break
            else:
                for kt in range(ktiles):
                    acc, cst, lst, phases = k_step(
                        smem, acc, kt, ktiles, cst, lst, phases, active, ring, full0, tmaps,
                        dst0, a, a_src, a_nb, b_row, col0, K, n_w, tid, desc_a0, desc_b0)
            acc = wgmma_wait(acc, 0)
            cp_async_wait(0)
            cuda.syncthreads()                 # every warpgroup done with the ring

            # All-padding warpgroups stage zeros; one past the expert's rows sends nothing
            # (they are the next expert's). The NaN/Inf report names the expert, nf[2] // nf[3]
            # (B_KN: b_row is the expert).
            stage_and_send(smem, acc, out, pre, peers, route_rank, route_token, route_slot, k,
                           n_out, limit, ring, lane, frag_row, frag_col, row0, col0, owned,
                           errors, (nf_tensor, nf_rank, b_row, nf_div))
            t += cuda.gridDim.x
            if t < total:                      # next tile's first slices: in flight now
                row0, col0, b_row, active, owned = tile_start(
                    smem, a, a_index, tmaps, offsets, t, n_tiles, K, n_w, ktiles, ring, full0,
                    dst0, a_src, a_nb, ld_row, ld_chunk, wg, tid, rows_cap)
        if lane < 16:               # the last bulk stores, written before the block ends
            bulk_wait(0)

    return kernel


def make_wgmma_gemm(bn, stages, swiglu_epilogue, gather, padding_index, push=False, bm=128,
                    max_registers=0, blocks_per_sm=1, b_kn=False, save_pre=False):
    """Build one wgmma grouped-GEMM specialisation (all arguments compile-time).

    ``gather``: A rows come through ``a_index``; ``padding_index``: ``a_index`` marks padding
    rows (< 0) even when A is not gathered, so all-padding warpgroups skip their MMAs.
    ``b_kn``: dgrad, B read as stored ([K, N] per expert from w0 / w1 split at K0 = ``n_w``;
    MN-major wgmma B), plain epilogue only.
    ``push``: the epilogue sends rows home (``epilogue.make_row_sender``); else the route
    arguments are unused placeholders. ``save_pre`` (SWIGLU only): the epilogue also writes
    the FP32 gate and up values into ``pre`` (``epilogue`` header), else ``pre`` is an unused
    placeholder. ``blocks_per_sm`` > 1 or 3+ warpgroups: launch bounds,
    so that ptxas caps the registers to fit (384 threads: <= 168; 512: <= 128)."""
    assert bn in _WGMMA and stages >= 3 and bm in (128, 192, 256)
    assert bm < 256 or bn <= 128, "4 warpgroups hold at most 64 accumulators per thread"
    assert not (b_kn and swiglu_epilogue), "dgrad has the plain epilogue"
    lay = _Layout(bn, stages, bm)
    stage_and_send, stride = make_staged_epilogue(bn, swiglu_epilogue, push,
                                                  lay.prefetch * lay.stage_bytes, save_pre)
    assert bm * stride <= 2 * lay.stage_bytes, "the staging must fit in 2 ring stages"
    tile_start, load_stage = _make_loader(lay, swiglu_epilogue, gather, padding_index, b_kn)
    opts = {"max_registers": max_registers} if max_registers else {}
    if bm >= 192 or blocks_per_sm > 1:
        opts["launch_bounds"] = (lay.threads, blocks_per_sm)
    kernel = _make_kernel(lay, swiglu_epilogue, push, gather, b_kn, tile_start, load_stage,
                          _make_mma_slice(bn, b_kn), stage_and_send, opts)
    kernel.smem_bytes = smem_bytes(bn, stages, bm)
    kernel.threads = lay.threads
    return kernel


def _require_arch(cfg):
    if SIM:
        return
    cc = cuda.get_current_device().compute_capability
    if cc != (9, 0):
        raise ValueError(f"GemmConfig(mma={cfg.mma!r}) needs a Hopper GPU (sm_90); this device "
                         f"is sm_{cc[0]}{cc[1]}: use mma='mma_sync' (e.g. MMA_SYNC_GEMM)")


@lru_cache(maxsize=None)
def _kernel(cfg, swiglu, gather, padding_index, push, b_kn=False, save_pre=False):
    _require_arch(cfg)
    return make_wgmma_gemm(cfg.bn, cfg.stages, swiglu, gather, padding_index, push=push,
                           bm=cfg.bm, max_registers=cfg.max_registers,
                           blocks_per_sm=cfg.blocks_per_sm, b_kn=b_kn, save_pre=save_pre)


def launch_gemm(cfg, stream, a, a_index, w0, w1, off, nr, out, K, n_w, n_out, limit, *,
                swiglu, gather, padding_index, errors, tensor, rank, route=None, b_kn=False,
                pre=None):
    """Persistent launch (``cfg.grid``): the weights' tensor maps and the push route (rank,
    token, slot, peers, k; placeholders when None) go with it. Maps: ``w0``, ``w1``
    [E, N_w, K] as 2-D [E N_w, K] with boxes of the B rows a slice needs (BN/2 per gate/up
    half, BN for down); ``b_kn`` (``n_w`` = K0): w0 [E, K0, N] and w1 [E, K - K0, N] (w0 again
    where there is no second matrix) as [E K0, N] / [E (K - K0), N] with boxes of 64 rows x 64
    columns (the swizzle's 128-byte row caps a box at 64 bf16: BN/64 boxes per slice). NaN/Inf
    in the output go to the error word ``errors`` as tensor id ``tensor`` of ``rank``.
    ``pre``: SWIGLU's saved pre-activations, (gate, up) flat float32 [C * n_out] (None: not
    saved)."""
    C = a_index.shape[0] if gather else a.shape[0]
    n_tile = cfg.bn // 2 if swiglu else cfg.bn     # output columns per tile
    kern = _kernel(cfg, swiglu, gather, padding_index, route is not None, b_kn,
                   pre is not None)
    box_rows = BK if b_kn else n_tile              # (ABt: B rows per box = output columns)
    maps = tensor_maps([w.reshape((w.shape[0] * w.shape[1], w.shape[2]))
                        for w in ((w0, w1) if swiglu or b_kn else (w0,))], box_rows, stream)
    if route is None:
        route = (nr, nr, nr, (out,), np.int64(0))
    if pre is None:                                # placeholder, never touched
        pre = (flat_view(out, np.float32),) * 2
    launch(kern, cfg.grid(C, n_out, n_tile), cfg.threads, stream, cfg.smem_bytes,
           flat_view(a), a_index, flat_view(w0), flat_view(w1), maps, off, nr, out, pre,
           np.int64(K), np.int64(n_w), np.int64(n_out), np.float32(limit), *route, errors,
           np.int32(tensor), np.int32(rank))
