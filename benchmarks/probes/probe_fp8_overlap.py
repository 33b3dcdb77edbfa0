"""Probe: the FP8 GEMM with each slice's promotion overlapped with the next slice's wgmmas.

    python benchmarks/probes/probe_fp8_overlap.py            # GPU: ptxas verdict, bits, times
    NUMBA_ENABLE_CUDASIM=1 python benchmarks/probes/probe_fp8_overlap.py --small   # simulator

``mok_core.gemm.sm90_fp8`` waits for each K slice's wgmmas (wait(0)) before promoting them, so
the tensor cores idle through every promotion, barrier and issue. This variant keeps two
fragments per warpgroup: slice j + 1's wgmmas are issued into one before slice j's, in the
other, is waited (wait(1)) and promoted -- 64 more registers per thread, PREFETCH = STAGES - 2
(a slice's wgmmas may still read its stage while the next loads), each slice's scales loaded
under its own MMAs and used a step later. The promotions run in the same order with the same
operands, so the output must be bit-identical to the production kernel's; the probe checks
that, prints ptxas's verdict (C7518, registers, spills) where it can, and times both at kimi's
routed gate|up shape in turns (``--small``: a tiny shape, the simulator, bits only). It wins
if it is faster and ptxas keeps its wgmmas unserialised: then it replaces ``make_fp8_gemm``'s
body and this file goes.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np
from numba import cuda          # a module global: the simulator swaps it in kernels' globals

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def make_overlap_kernel(stages, gather):
    from numba import float32, int64, uint16

    from mok_core.cuda_compat import kjit
    from mok_core.gemm.epilogue import make_coalesced_epilogue
    from mok_core.gemm.sm90 import _TABLE_BYTES, tile_table, warpgroup_fragment
    from mok_core.gemm.sm90_fp8 import (BM, BN, NACC, SCALE_BLOCK, STAGE_BYTES, THREADS, BK,
                                        make_stream, mma_slice, ring_layout, smem_bytes)
    from mok_core.intrinsics import (cp_async_wait, f32_zeros, fence_proxy_async, promote_fp8,
                                     shared_addr, warp_all, wgmma_wait)
    assert stages >= 3
    prefetch = stages - 2
    in_flight = prefetch - 1
    epilogue = make_coalesced_epilogue(BN)
    tile_of, load_next, scales, scale_row = make_stream(gather)

    @kjit(launch_bounds=(THREADS, 1))
    def kernel(a, a_scale, a_index, w, w_scale, offsets, num_rows, out, K, N, errors,
               nf_tensor, nf_rank):
        limit = float32(0.0)                 # (plain epilogue: unused)
        smem = cuda.shared.array(0, uint16)
        tid = cuda.threadIdx.x
        wg, lane, frag_row, frag_col = warpgroup_fragment(tid)
        num_experts = offsets.shape[0] - 1
        rows_cap = min(int64(num_rows[0]), int64(out.shape[0]) * 2 // N)
        tile_table(smem, offsets, num_experts, BM, rows_cap)
        cuda.syncthreads()
        n_tiles = N // BN
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
                num_experts, rows_cap, a, a_index, w, w, K, N, dst0, ld_row, ld_chunk)
        cst = 0
        lst = prefetch
        part_a = f32_zeros(NACC)
        part_b = f32_zeros(NACC)
        while t < total:
            e, row0, col0, row_end = tile_of(smem, offsets, num_experts, t, n_tiles, rows_cap)
            src_lo = scale_row(a_index, row0 + frag_row, row_end)
            src_hi = scale_row(a_index, row0 + frag_row + 8, row_end)
            w_at = (e * nb + col0 // SCALE_BLOCK) * ktiles
            acc = f32_zeros(NACC)
            # slice 0 into part_a
            cp_async_wait(in_flight)
            fence_proxy_async()
            cuda.syncthreads()
            part_a = mma_slice(part_a, smem, desc_a0 + ((cst * STAGE_BYTES) >> 4),
                               desc_b0 + ((cst * STAGE_BYTES) >> 4))
            sa = scales(a_scale, w_scale, w_scale, src_lo, src_hi, w_at, 0, ktiles)
            lt, lk, le, lrow0, lend, lcol0 = load_next(
                smem, lst, lt, lk, le, lrow0, lend, lcol0, total, n_tiles, ktiles, offsets,
                num_experts, rows_cap, a, a_index, w, w, K, N, dst0, ld_row, ld_chunk)
            cst = 0 if cst == stages - 1 else cst + 1
            lst = 0 if lst == stages - 1 else lst + 1
            sb = sa
            kb = int64(1)
            while True:
                run_b = warp_all(kb < ktiles) != 0          # a vote: C7518 (sm90's header)
                if run_b:                                   # slice kb into part_b
                    cp_async_wait(in_flight)
                    fence_proxy_async()
                    cuda.syncthreads()
                    part_b = mma_slice(part_b, smem, desc_a0 + ((cst * STAGE_BYTES) >> 4),
                                       desc_b0 + ((cst * STAGE_BYTES) >> 4))
                    sb = scales(a_scale, w_scale, w_scale, src_lo, src_hi, w_at, kb, ktiles)
                    lt, lk, le, lrow0, lend, lcol0 = load_next(
                        smem, lst, lt, lk, le, lrow0, lend, lcol0, total, n_tiles, ktiles,
                        offsets, num_experts, rows_cap, a, a_index, w, w, K, N, dst0, ld_row,
                        ld_chunk)
                    cst = 0 if cst == stages - 1 else cst + 1
                    lst = 0 if lst == stages - 1 else lst + 1
                    part_a = wgmma_wait(part_a, 1)          # slice kb - 1 retired
                else:
                    part_a = wgmma_wait(part_a, 0)
                acc = promote_fp8(acc, part_a, sa[0], sa[1], sa[2], sa[3])
                if not run_b:
                    break
                kb += 1
                run_a = warp_all(kb < ktiles) != 0
                if run_a:                                   # slice kb into part_a
                    cp_async_wait(in_flight)
                    fence_proxy_async()
                    cuda.syncthreads()
                    part_a = mma_slice(part_a, smem, desc_a0 + ((cst * STAGE_BYTES) >> 4),
                                       desc_b0 + ((cst * STAGE_BYTES) >> 4))
                    sa = scales(a_scale, w_scale, w_scale, src_lo, src_hi, w_at, kb, ktiles)
                    lt, lk, le, lrow0, lend, lcol0 = load_next(
                        smem, lst, lt, lk, le, lrow0, lend, lcol0, total, n_tiles, ktiles,
                        offsets, num_experts, rows_cap, a, a_index, w, w, K, N, dst0, ld_row,
                        ld_chunk)
                    cst = 0 if cst == stages - 1 else cst + 1
                    lst = 0 if lst == stages - 1 else lst + 1
                    part_b = wgmma_wait(part_b, 1)
                else:
                    part_b = wgmma_wait(part_b, 0)
                acc = promote_fp8(acc, part_b, sb[0], sb[1], sb[2], sb[3])
                if not run_a:
                    break
                kb += 1
            epilogue(smem, acc, out, row0, row0, col0, e, N, row_end - row0, staging, lane,
                     frag_row, frag_col, limit, errors, nf_tensor, nf_rank)
            t += cuda.gridDim.x
        cp_async_wait(0)

    kernel.threads = THREADS
    kernel.smem_bytes = smem_bytes(stages)
    return kernel


def _ptxas_report(kern, gather):
    """ptxas -v of the variant (sm_90a), where a ptxas that reads numba's PTX is installed."""
    import shutil
    import subprocess
    import tempfile
    from pathlib import Path

    from numba import float32, int32, int64, uint16, uint32
    sig = (uint16[::1], float32[::1], int32[::1], uint16[::1], float32[::1], int32[::1],
           int32[::1], uint32[::1], int64, int64, int32[::1], int32, int32)   # (its own)
    ptx, _ = cuda.compile_ptx(kern.py_func, sig, cc=(9, 0, "a"), launch_bounds=(256, 1))
    exe = shutil.which("ptxas")
    try:
        import nvidia.cu13
        cand = Path(nvidia.cu13.__path__[0]) / "bin" / "ptxas"
        exe = str(cand) if cand.exists() else exe
    except ImportError:
        pass
    if exe is None:
        return "no ptxas"
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "k.ptx").write_text(ptx)
        r = subprocess.run([exe, "-arch=sm_90a", "-v", str(Path(d) / "k.ptx"), "-o",
                            str(Path(d) / "k.cubin")], capture_output=True, text=True)
    return "\n".join(line for line in r.stderr.splitlines()
                     if "C7518" in line or "registers" in line or "spill" in line)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true", help="a tiny shape (the simulator)")
    ap.add_argument("--stages", type=int, default=4)
    args = ap.parse_args(argv)
    from mok_core import errors as err
    from mok_core.cuda_compat import SIM, device_full, flat_view, launch, to_host, upload
    from mok_core.gemm import fp8_gemm
    from mok_core.gemm.sm90_fp8 import THREADS

    rng = np.random.default_rng(0)
    E, K, N, per = (3, 384, 256, 100) if args.small else (48, 7168, 4096, 1365)
    counts = -(-rng.multinomial(E * per, np.ones(E) / E) // 128) * 128
    off = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    C = int(off[-1])

    def e4m3(shape):
        b = rng.integers(0, 256, size=shape, dtype=np.uint8)
        return np.where((b & 0x7F) == 0x7F, b - 1, b).astype(np.uint8)
    host = dict(a=e4m3((C, K)), a_scale=np.exp2(rng.uniform(-10, -6, (C, K // 128))),
                w=e4m3((E, N, K)), w_scale=np.exp2(rng.uniform(-10, -6, (E, N // 128, K // 128))))
    host["a_scale"] = host["a_scale"].astype(np.float32)
    host["w_scale"] = host["w_scale"].astype(np.float32)
    d = {k: upload(v) for k, v in host.items()}
    d_off, d_nr = upload(off), upload(np.array([C], np.int32))
    words = device_full((err.ERROR_WORDS,), 0, np.int32)
    outs = {n: device_full((C, N), 0, np.uint16) for n in ("production", "overlap")}
    kern = make_overlap_kernel(args.stages, False)
    if not SIM:
        print("overlap variant, ptxas:\n" + _ptxas_report(kern, False))

    def production():
        fp8_gemm(d["a"], d["a_scale"], None, d["w"], d["w_scale"], d_off, d_nr,
                 outs["production"], stages=args.stages)

    grid = 4 if SIM else min(C // 128 * (N // 128), 132)

    def overlap():
        launch(kern, grid, THREADS, 0, kern.smem_bytes, flat_view(d["a"], np.uint16),
               flat_view(d["a_scale"]), d_nr, flat_view(d["w"], np.uint16),
               flat_view(d["w_scale"]), d_off, d_nr, flat_view(outs["overlap"], np.uint32),
               np.int64(K), np.int64(N), words, np.int32(err.NF_HIDDEN), np.int32(0))
    production()
    overlap()
    same = np.array_equal(to_host(outs["production"]), to_host(outs["overlap"]))
    print(f"rows={C} K={K} N={N} E={E}: overlap bits == production: {same}")
    if SIM or not same:
        return 0 if same else 1
    ms = {"production": [], "overlap": []}
    for _ in range(5):                                     # in turns
        for name, fn in (("production", production), ("overlap", overlap)):
            fn()
            t0, t1 = cuda.event(), cuda.event()
            t0.record()
            for _ in range(5):
                fn()
            t1.record()
            t1.synchronize()
            ms[name].append(cuda.event_elapsed_time(t0, t1) / 5)
    flop = 2.0 * C * K * N
    for name, v in ms.items():
        m = float(np.median(v))
        print(f"  {name:10s} {m:8.3f} ms  {flop / m / 1e9:6.0f} TFLOP/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
