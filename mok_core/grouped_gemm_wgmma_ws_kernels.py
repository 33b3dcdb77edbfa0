"""Warp-specialised variant of the wgmma grouped GEMM (``GemmConfig(mma="wgmma_ws")``).

Same contract and ring layout as ``grouped_gemm_wgmma_kernels`` (descriptors, swizzle,
padding-warpgroup skip); what differs is who does what and how they wait. This is the shape
the fused layer kernel's tasks take (roles + mbarriers, no block-wide barrier), measured on
its own first: on H200 it is slower than the all-threads-load kernel so far (NOTES.md).

Roles (one block = 2 consumer warpgroups + 1 producer warpgroup = 384 threads):

    consumer warpgroup g (warps 4g..4g+3): rows [64g, 64g + 64) of the 128-row tile, all BN
        columns (BN = 64, 128 or 256): per K slice 4 x wgmma m64nBNk16 from two shared-memory
        descriptors, FP32 accumulators in registers, then the epilogue straight to global.
    producer warpgroup (warps 8-11): all loads, cp.async 16 B into the ring (A rows gathered
        through a_index, padding rows zero-filled without a load); it hands most of its
        registers to the consumers (setmaxnreg 72 / 216), which hold BN/2 accumulators each.
        TMA variant (``tma_b``): B (weights) arrives as TMA boxes that producer thread 0
        issues (full[s] then counts 129 arrivals: its arm-with-bytes arrival too).

    ring     = STAGES slices of [A 128 x 64 | B BN x 64] bf16, 1024-byte aligned; a slice row is
               128 bytes and 16-byte chunk c of row r sits at chunk c ^ (r % 8) (the 128-byte
               swizzle the descriptors name: start + 32 B per k16 step, 1024 B per 8 rows)
    full[s]  = mbarrier, 128 arrivals: each producer thread's copies into stage s landed
               (cp.async.mbarrier.arrive.noinc)
    empty[s] = mbarrier, 8 arrivals: each consumer warp is done reading stage s

Task order. Both roles walk the block's tiles b, b + grid, ... and their K slices in the same
order; step i uses stage i % STAGES with phase (i / STAGES) & 1:

    producer: wait empty[s] (not on the first lap) -> issue the slice's chunks -> arrive full[s]
    consumer: wait full[s] -> fence.proxy.async -> wgmma.fence, 4 wgmmas, commit
              -> wgmma.wait(1): the previous slice's MMAs retired -> arrive empty[previous]
              (tile end: wait(0), release this slice too, epilogue while the producer already
              fills the next tile's slices)

So loads run up to STAGES slices ahead, no block-wide barrier in the loop, and tensor cores
always have the next group queued. A warpgroup whose 64 rows are all padding
(a_index[first row] < 0; padding sits at the end of each expert's segment) skips its MMAs
(it still takes part in the barriers) and writes zeros. Every wait is bounded: a wait that
times out can only be a bug in this kernel, and it traps (the host sees a launch failure)
instead of hanging. FP32 accumulation, K in fixed order, one owner per output tile:
deterministic.
"""
from numba import cuda, float32, int32, int64, uint16

from .cuda_compat import kjit
from .grouped_gemm_kernels import find_tile
from .grouped_gemm_wgmma_kernels import (_DESC_HIGH, _WGMMA, BK, BM, ROW_BYTES, make_slice_loader,
                                         make_tile_ops, make_tma_b_loader, wait_phase)
from .intrinsics import (cp_async_commit, cp_async_mbarrier_arrive, cp_async_wait, f32_zeros,
                         fence_mbarrier_init, fence_proxy_async, mbarrier_arrive, mbarrier_init,
                         setmaxnreg_dec, setmaxnreg_inc, shared_addr, syncwarp,
                         tensormap_acquire, wgmma_wait)

CONSUMERS = 256               # 2 warpgroups
PRODUCERS = 128               # 1 warpgroup
THREADS = CONSUMERS + PRODUCERS
# Registers are granted per warpgroup: 3 x 128 x 168 fit an SM's 64K at launch; then the
# producer gives back down to 72 and the consumers grow to 216 out of what it freed. The
# block's pool is only what it got at launch, so the growth must fit in what the producer
# frees (the assert), else the consumers' setmaxnreg.inc waits forever (seen: 48 / 232).
LAUNCH_REGISTERS = 168
PRODUCER_REGISTERS = 72
CONSUMER_REGISTERS = 216
assert CONSUMERS * (CONSUMER_REGISTERS - LAUNCH_REGISTERS) <= \
    PRODUCERS * (LAUNCH_REGISTERS - PRODUCER_REGISTERS)


def smem_bytes(bn, stages):
    """Dynamic shared memory of one block: the ring, 2 x STAGES mbarriers, alignment slack."""
    return stages * (BM + bn) * ROW_BYTES + 16 * stages + 1024


def make_wgmma_ws_grouped_gemm(bn, stages, swiglu_epilogue, gather, padding_index,
                               max_registers=0, tma_b=False, push=False):
    """Build one warp-specialised wgmma grouped-GEMM specialisation (all compile-time).

    ``gather``: A rows come through ``a_index``; ``padding_index``: ``a_index`` marks padding
    rows (< 0) even when A is not gathered, so all-padding warpgroups skip their MMAs.
    ``tma_b``: producer thread 0 loads B (weights) as TMA boxes from the maps in ``tmaps``
    (one more arrival on full[s], which also waits for the boxes' bytes); the producer
    warpgroup's cp.async then carries only A. ``push``: the epilogue sends rows home
    (``make_tile_ops``).
    """
    assert bn in _WGMMA and stages >= 2
    a_rows_lane = BM // 16                  # a producer pass covers 16 rows x 8 chunks
    mma_slice, store_tile = make_tile_ops(bn, swiglu_epilogue, push)
    a_sources, load_slice = make_slice_loader(swiglu_epilogue, gather, a_rows_lane,
                                              0 if tma_b else bn // 16)
    tma_b_load, _ = make_tma_b_loader(bn, swiglu_epilogue)
    full_count = PRODUCERS + (1 if tma_b else 0)
    nacc = bn // 2                          # fp32 accumulators per consumer thread
    a_stage = BM * ROW_BYTES
    stage_bytes = (BM + bn) * ROW_BYTES
    ring_bytes = stages * stage_bytes
    pass_bytes = 16 * ROW_BYTES            # 16 rows on: the next row of this thread
    uses_index = gather or padding_index
    # .maxntid 384 makes ptxas budget LAUNCH_REGISTERS at entry (setmaxnreg moves them later).
    opts = {"max_registers": max_registers or LAUNCH_REGISTERS, "launch_bounds": (THREADS, 1)}

    @kjit(device=True, inline="always")
    def release(smem, bar, lane):
        """This warp is done with a stage: one arrival, after every lane got here."""
        syncwarp()
        if lane == 0:
            mbarrier_arrive(smem, bar)

    @kjit(**opts)
    def kernel(a, a_index, w0, w1, tmaps, offsets, num_rows, out, K, n_w, n_out, limit,
               route_rank, route_token, route_slot, peers, k):
        smem = cuda.shared.array(0, uint16)
        tid = cuda.threadIdx.x
        num_experts = offsets.shape[0] - 1
        cols_per_tile = bn // 2 if swiglu_epilogue else bn
        n_tiles = n_out // cols_per_tile
        total = (num_rows[0] // BM) * n_tiles
        ktiles = K // BK
        grid = cuda.gridDim.x

        sbase = shared_addr(smem)
        ring = sbase + (1024 - sbase % 1024) % 1024
        full0 = ring + ring_bytes               # full[s] at full0 + 8 s, empty[s] after them
        empty0 = full0 + 8 * stages
        if tid == 0:
            for s in range(stages):
                mbarrier_init(smem, full0 + 8 * s, full_count)
                mbarrier_init(smem, empty0 + 8 * s, CONSUMERS // 32)
            fence_mbarrier_init()
        cuda.syncthreads()

        if tid >= CONSUMERS:
            # ---------------- producer warpgroup ----------------
            setmaxnreg_dec(PRODUCER_REGISTERS)
            p = tid - CONSUMERS
            row_in = p // 8                     # this thread's rows: row_in + 16 j, so
            chunk = p % 8                       # every row has the same swizzle (16 j % 8 = 0)
            lane_dst = ring + row_in * ROW_BYTES + ((chunk ^ (row_in % 8)) * 16)
            a_src = cuda.local.array(a_rows_lane, int64)
            a_nb = cuda.local.array(a_rows_lane, int32)
            if tma_b and p == 0:
                tensormap_acquire(tmaps, 0)
                if swiglu_epilogue:
                    tensormap_acquire(tmaps, 16)
            i = 0
            t = cuda.blockIdx.x
            while t < total:
                e, row0, nt = find_tile(offsets, num_experts, t, n_tiles, BM)
                a_sources(a_index, row0 + row_in, 16, offsets[e + 1], K, chunk, a_src, a_nb)
                b_row = e * n_w + nt * cols_per_tile
                b_src = (b_row + row_in) * K + chunk * 8
                b_step = 16 * K
                for kt in range(ktiles):
                    s = i % stages
                    if i >= stages:
                        wait_phase(smem, empty0 + 8 * s, (i // stages - 1) & 1)
                    load_slice(smem, lane_dst + s * stage_bytes, pass_bytes, a_stage, a, w0, w1,
                               a_src, a_nb, b_src, b_step, kt * BK)
                    if tma_b and p == 0:
                        tma_b_load(smem, ring + s * stage_bytes + a_stage, tmaps, full0 + 8 * s,
                                   b_row, kt * BK, w0, w1, K)
                    cp_async_mbarrier_arrive(smem, full0 + 8 * s)
                    i += 1
                t += grid
            cp_async_commit()
            cp_async_wait(0)
            return

        # ---------------- consumer warpgroups ----------------
        setmaxnreg_inc(CONSUMER_REGISTERS)
        wg = tid // 128
        lane = tid % 32
        frag_row = wg * 64 + ((tid % 128) // 32) * 16 + lane // 4   # (+8): this thread's rows
        frag_col = 2 * (lane % 4)
        desc_a0 = int64(_DESC_HIGH) + int64((ring + wg * 64 * ROW_BYTES) >> 4)
        desc_b0 = int64(_DESC_HIGH) + int64((ring + a_stage) >> 4)
        c = cuda.local.array(nacc, float32)     # the accumulator, for the epilogue's loop
        i = 0
        t = cuda.blockIdx.x
        while t < total:
            e, row0, nt = find_tile(offsets, num_experts, t, n_tiles, BM)
            col0 = nt * cols_per_tile
            active = True
            if uses_index:
                active = a_index[row0 + wg * 64] >= 0
            acc = f32_zeros(nacc)
            prev = -1                           # stage whose MMAs may still be running
            for kt in range(ktiles):
                s = i % stages
                wait_phase(smem, full0 + 8 * s, (i // stages) & 1)
                if active:
                    fence_proxy_async()
                    soff = (s * stage_bytes) >> 4
                    acc = wgmma_wait(mma_slice(acc, smem, desc_a0 + soff, desc_b0 + soff), 1)
                    if prev >= 0:
                        release(smem, empty0 + 8 * prev, lane)
                    prev = s
                else:
                    release(smem, empty0 + 8 * s, lane)
                i += 1
            acc = wgmma_wait(acc, 0)
            if prev >= 0:
                release(smem, empty0 + 8 * prev, lane)

            # Epilogue: registers -> bf16 pairs -> out (all-padding warpgroups write zeros).
            store_tile(out, c, acc, row0 + frag_row, col0 + frag_col, n_out, limit, route_rank,
                       route_token, route_slot, peers, k)
            t += grid

    kernel.smem_bytes = smem_bytes(bn, stages)
    kernel.threads = THREADS
    return kernel
