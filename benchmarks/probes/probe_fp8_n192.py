"""The FP8 GEMM on 128 x 192 tiles -- one wgmma group a K slice over the tile's whole width --
in turns against the shipped 128 x 256 (two 128-column halves a slice) and 128 x 128: a probe.

    python benchmarks/probes/probe_fp8_n192.py [--shapes gu,down] [--stages 4] [--iters 20]
    python benchmarks/probes/probe_fp8_n192.py --ptx          # ptxas's report, no GPU needed

docs/perf.md ("What bounds the FP8 GEMM"): the compute side bounds ``sm90_fp8`` -- each
compute warpgroup issues a 4-wgmma group, waits for it, promotes, twice a slice at 128 x 256
-- and the tensor pipe is busy 57 % of the cycles. DeepGEMM's tiles instead issue one group a
slice over the whole width (m64nNk32, N <= 192 fits a 96-register fragment beside a
96-register sum). This builds that for the plain forward GEMM (``fp8_gemm``'s operands and
result, bit for bit): ``sm90_fp8``'s block, ring, producer and tile order at BN = 192 (three
64-row B boxes a slice), 4 x m64n192k32 a slice, one wait, the promotion of 96 values -- the
tile's columns span two 128-wide scale blocks of W, split at 64 or 128 columns (n0 % 128) --
and a coalesced epilogue of 24 16-byte chunks a row. N must be a multiple of 384 (and so of
128 and 192). Shapes (rows: 48 experts x ~373, kimi-k2.7 at EP 2, 8192 tokens/rank, padded to
128): ``gu`` K = 7168, N = 6144; ``down`` K = 2048, N = 6144 (glm-5.2's down). Prints ms,
TFLOP/s and the ratio to the shipped 128 x 256, and whether each output equals its bits.
A probe: it writes nothing.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

BN = 192
NACC = BN // 2                  # a thread's FP32 values of the fragment (and of the sum)


def make_n192_gemm(stages):
    """The plain FP8 forward GEMM on 128 x 192 tiles (module docstring)."""
    from numba import cuda, float32, int64, uint16, uint32, uint64

    from mok_core.cuda_compat import kjit
    from mok_core.gemm.epilogue import make_stage_tile, report_stored_rows
    from mok_core.gemm.sm90 import (_TABLE_BYTES, find_tile_in_table, tile_table, wait_phase,
                                    warpgroup_fragment)
    from mok_core.gemm.sm90_fp8 import (_K32, BK, BM, BOX_BYTES, BOX_ROWS, COMPUTE_REGS,
                                        GEMM_THREADS, PRODUCER_REGS, ROW_BYTES, THREADS,
                                        _a_row, _slice_scales, ring_start, stage0_descriptors)
    from mok_core.gemm.tensor_map import MAP_ELEMS
    from mok_core.intrinsics import (f32_zeros, fence_mbarrier_init, ld_v4, mbarrier_arrive,
                                     mbarrier_arrive_expect_tx, mbarrier_init, per_iteration,
                                     promote_fp8, setmaxnreg_dec, setmaxnreg_inc, shared_addr,
                                     st_v4, syncwarp, tensormap_acquire, tma_load_2d, warp_all,
                                     wgmma_commit, wgmma_fence, wgmma_wait)
    from mok_core.intrinsics import ptx as P
    from mok_core.intrinsics.ptx import _wgmma_e4m3, _wgmma_e4m3_fresh
    # the library's accumulator intrinsics take 32, 64 or 128 values; this fragment holds 96
    # (their typing reads the module's check when a kernel is compiled)
    P._f32_tuple = lambda acc: (isinstance(acc, P.types.UniTuple)
                                and acc.dtype == P.types.float32
                                and acc.count in (32, 64, 96, 128))
    mma = _wgmma_e4m3(BN)
    mma_fresh = _wgmma_e4m3_fresh(BN)
    stage_bytes = (BM + BN) * ROW_BYTES
    stride = 2 * BN + 16                     # a staged row's bytes (+16: 8 bank groups)
    cpr = BN // 8                            # 16-byte chunks a row
    per_lane = 16 * cpr // 32                # of the warp's 16 rows
    stage_tile = make_stage_tile(False)

    @kjit(device=True, inline="always")
    def mma_slice(part, smem, da, db):
        part = wgmma_fence(part)
        part = mma_fresh(part, smem, da, db)
        part = mma(part, smem, da + _K32, db + _K32)
        part = mma(part, smem, da + 2 * _K32, db + 2 * _K32)
        part = mma(part, smem, da + 3 * _K32, db + 3 * _K32)
        wgmma_commit()
        return part

    @kjit(device=True, inline="always")
    def promote(acc, part, f0, f1, f2, f3, first128):
        # columns [0, 64) are the first scale block's, [128, 192) the second's, [64, 128)
        # the first's where the tile starts on a block (first128), else the second's
        g0 = f0 if first128 else f2
        g1 = f1 if first128 else f3
        return (promote_fp8(acc[:32], part[:32], f0, f1, f0, f1)
                + promote_fp8(acc[32:64], part[32:64], g0, g1, g0, g1)
                + promote_fp8(acc[64:], part[64:], f2, f3, f2, f3))

    @kjit(device=True, inline="always")
    def epilogue(smem, acc, out, grow0, m0, n0, e, N, rows, epi0, lane, frag_row, frag_col,
                 errors, nf_tensor, nf_rank):
        epi0 = per_iteration(uint32(epi0))
        bad = stage_tile(acc, (uint32(0), uint32(0)),
                         (smem, frag_row, frag_col, float32(math.inf), epi0, stride))
        syncwarp()
        rel = epi0 - shared_addr(smem)
        row0 = frag_row - lane // 4
        ln = per_iteration(uint32(lane))     # the chunks' rows per tile, not held (spilled)
        for i in range(per_lane):
            c = ln + 32 * i
            r = row0 + c // cpr
            col = c % cpr
            if r < rows:
                v0, v1, v2, v3 = ld_v4(smem, (rel + r * stride + col * 16) >> 1)
                st_v4(out, uint64((grow0 + r) * N + n0 + col * 8) >> uint64(1), v0, v1, v2,
                      v3)
        report_stored_rows(smem, bad, rows, rel, stride, BN, row0, lane, frag_row, m0, e,
                           errors, nf_tensor, nf_rank)

    @kjit(launch_bounds=(GEMM_THREADS, 1))
    def kernel(a_scale, w_scale, tmaps, offsets, num_rows, out, C, K, N, errors, nf_tensor,
               nf_rank):
        smem = cuda.shared.array(0, uint16)
        tid = cuda.threadIdx.x
        num_experts = offsets.shape[0] - 1
        rows_cap = min(int64(num_rows[0]), C)
        full0 = shared_addr(smem) + _TABLE_BYTES
        empty0 = full0 + 8 * stages
        tile_table(smem, offsets, num_experts, BM, rows_cap)
        if tid == 0:
            for s in range(stages):
                mbarrier_init(smem, full0 + 8 * s, 1)
                mbarrier_init(smem, empty0 + 8 * s, THREADS)
            fence_mbarrier_init()
        cuda.syncthreads()
        n_tiles = N // BN
        if warp_all(tid >= THREADS):
            setmaxnreg_dec(PRODUCER_REGS)
            ktiles = K // BK
            total = int64(smem[num_experts]) * n_tiles
            ring = ring_start(empty0 + 8 * stages)
            if tid == THREADS:
                tensormap_acquire(tmaps, 0)
                tensormap_acquire(tmaps, MAP_ELEMS)
                j = int64(0)
                t = int64(cuda.blockIdx.x)
                while t < total:
                    e, row0, nt, _ = find_tile_in_table(smem, offsets, num_experts, t, n_tiles,
                                                        BM, rows_cap)
                    w_row = e * N + nt * BN
                    for kb in range(ktiles):
                        st = j % stages
                        if j >= stages:
                            wait_phase(smem, empty0 + 8 * st, ((j // stages) - 1) & 1)
                        bar = full0 + 8 * st
                        dst = ring + st * stage_bytes
                        kx = kb * (BK // 2)
                        mbarrier_arrive_expect_tx(smem, bar, stage_bytes)
                        for i in range(BM // BOX_ROWS):
                            tma_load_2d(smem, dst + i * BOX_BYTES, tmaps, 0, kx,
                                        row0 + i * BOX_ROWS, bar)
                        for i in range(BN // BOX_ROWS):
                            tma_load_2d(smem, dst + (BM // BOX_ROWS + i) * BOX_BYTES, tmaps,
                                        MAP_ELEMS, kx, w_row + i * BOX_ROWS, bar)
                        j += 1
                    t += cuda.gridDim.x
        else:
            setmaxnreg_inc(COMPUTE_REGS)
            ktiles = K // BK
            total = int64(smem[num_experts]) * n_tiles
            wg, lane, frag_row, frag_col = warpgroup_fragment(tid)
            ring = ring_start(empty0 + 8 * stages)
            staging = ring + stages * stage_bytes
            desc_a0, desc_b0 = stage0_descriptors(ring, wg, BM)
            j = int64(0)
            t = int64(cuda.blockIdx.x)
            part = f32_zeros(NACC)
            while t < total:
                e, row0, nt, row_end = find_tile_in_table(smem, offsets, num_experts, t,
                                                          n_tiles, BM, rows_cap)
                col0 = nt * BN
                first128 = col0 % 128 == 0
                lo = _a_row(row0 + frag_row, row_end)
                hi = _a_row(row0 + frag_row + 8, row_end)
                w_at = ((e * N + col0) // 128) * ktiles
                f0, f1, f2, f3 = _slice_scales(a_scale, w_scale, w_scale, lo, hi, w_at,
                                               w_at + ktiles, int64(0), ktiles)
                acc = f32_zeros(NACC)
                kb = int64(0)
                while True:
                    st = j % stages
                    wait_phase(smem, full0 + 8 * st, (j // stages) & 1)
                    soff = (st * stage_bytes) >> 4
                    part = mma_slice(part, smem, desc_a0 + soff, desc_b0 + soff)
                    g0, g1, g2, g3 = _slice_scales(a_scale, w_scale, w_scale, lo, hi, w_at,
                                                   w_at + ktiles, min(kb + 1, ktiles - 1),
                                                   ktiles)
                    part = wgmma_wait(part, 0)
                    mbarrier_arrive(smem, empty0 + 8 * st)
                    acc = promote(acc, part, f0, f1, f2, f3, first128)
                    f0, f1, f2, f3 = g0, g1, g2, g3
                    j += 1
                    kb += 1
                    if kb >= ktiles:
                        break
                syncwarp()
                epilogue(smem, acc, out, row0, row0, col0, e, N, row_end - row0, staging,
                         lane, frag_row, frag_col, errors, nf_tensor, nf_rank)
                t += cuda.gridDim.x

    kernel.smem_bytes = _TABLE_BYTES + 16 * stages + 1024 + stages * stage_bytes + BM * stride
    return kernel


def _signature():
    from numba import float32, int32, int64, uint8, uint32, uint64
    f32 = float32[::1]
    return (f32, f32, uint64[::1], int32[::1], int32[::1], uint32[::1], int64, int64, int64,
            uint32[::1], int32, int32)


def ptx_report(stages):
    """ptxas -v of the kernel for sm_90a (registers, spills, C7518) -- a CPU check."""
    import subprocess
    import tempfile

    import numba.cuda.dispatcher as dispatcher
    from numba import cuda

    class Hopper:                       # device functions ask the driver (none here)
        compute_capability = (9, 0)
    dispatcher.get_current_device = Hopper
    kern = make_n192_gemm(stages)
    ptx, _ = cuda.compile_ptx(kern.py_func, _signature(), cc=(9, 0, "a"),
                              launch_bounds=kern.targetoptions["launch_bounds"])
    import nvidia.cu13
    exe = os.path.join(nvidia.cu13.__path__[0], "bin", "ptxas")
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        r = subprocess.run([exe, "-arch=sm_90a", "-v", src, "-o", os.path.join(d, "k.cubin")],
                           capture_output=True, text=True)
    n = ptx.count("wgmma.mma_async.sync.aligned.m64n192k32.f32.e4m3.e4m3")
    print(f"m64n192k32 wgmmas {n}, smem {kern.smem_bytes} B\n{r.stderr[-1500:]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="gu,down")
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--ptx", action="store_true")
    args = ap.parse_args()
    if args.ptx:
        ptx_report(args.stages)
        return
    import numpy as np
    import torch

    from benchmarks.bench_ffn import interleaved_ms
    from benchmarks.common import numba_stream
    from mok_core.cuda_compat import as_device_array, flat_view, launch, multiprocessor_count
    from mok_core.errors_kernels import scratch_error_word
    from mok_core.gemm import fp8_gemm
    from mok_core.gemm.sm90_fp8 import BOX_ROWS, GEMM_THREADS
    from mok_core.gemm.tensor_map import tensor_maps
    g = torch.Generator(device="cuda").manual_seed(0)
    kern = make_n192_gemm(args.stages)

    def e4m3(*shape):                       # random finite e4m3 bytes (no 0x7F / 0xFF)
        b = torch.randint(0, 256, shape, device="cuda", dtype=torch.int32, generator=g)
        return torch.where((b & 0x7F) == 0x7F, b - 1, b).to(torch.uint8)

    for shape in args.shapes.split(","):
        E, per, K, N = {"gu": (48, 373, 7168, 6144), "down": (48, 373, 2048, 6144)}[shape]
        rng = np.random.default_rng(0)
        counts = -(-rng.multinomial(E * per, np.ones(E) / E) // 128) * 128
        off = torch.tensor(np.concatenate([[0], np.cumsum(counts)]), dtype=torch.int32,
                           device="cuda")
        C = int(counts.sum())
        nr = torch.tensor([C], dtype=torch.int32, device="cuda")
        a, w = e4m3(C, K), e4m3(E, N, K)
        a_s = torch.exp2(torch.rand(C, K // 128, device="cuda") * -4 - 6)
        w_s = torch.exp2(torch.rand(E, N // 128, K // 128, device="cuda") * -4 - 6)
        outs = {v: torch.empty(C, N, device="cuda", dtype=torch.uint16)
                for v in ("256", "128", "192")}
        errors = scratch_error_word()
        dev = {n: as_device_array(x, n) for n, x in (("a", a), ("w", w), ("a_s", a_s),
                                                       ("w_s", w_s), ("off", off), ("nr", nr),
                                                       ("out", outs["192"]))}
        maps = tensor_maps([flat_view(dev["a"], np.uint16).reshape(C, K // 2),
                            flat_view(dev["w"], np.uint16).reshape(E * N, K // 2)],
                           BOX_ROWS, numba_stream())
        grid = max(1, min((C // 128 + E) * (N // BN), multiprocessor_count()))

        def n192():
            launch(kern, grid, GEMM_THREADS, numba_stream(), kern.smem_bytes,
                   flat_view(dev["a_s"]), flat_view(dev["w_s"]), maps, dev["off"], dev["nr"],
                   flat_view(dev["out"], np.uint32), np.int64(C), np.int64(K), np.int64(N),
                   errors, np.int32(0), np.int32(0))
        steps = {
            "256": lambda: fp8_gemm(a, a_s, w, w_s, off, nr, outs["256"], stages=3, bn=256,
                                    stream=numba_stream()),
            "128": lambda: fp8_gemm(a, a_s, w, w_s, off, nr, outs["128"], stages=4, bn=128,
                                    stream=numba_stream()),
            "192": n192,
        }
        for fn in steps.values():
            fn()
        torch.cuda.synchronize()
        t = interleaved_ms(steps, args.iters, eager=())
        flop = 2.0 * C * K * N
        for v, (ms, _) in t.items():
            print(f"{shape:5s} rows={C} E={E} K={K} N={N} 128x{v} {ms:7.3f} ms "
                  f"{flop / ms / 1e9:6.0f} TFLOP/s  x{t['256'][0] / ms:.3f} vs 128x256  "
                  f"bits {'equal' if torch.equal(outs[v], outs['256']) else 'DIFFER'}",
                  flush=True)
        del a, w, outs, steps, dev
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
