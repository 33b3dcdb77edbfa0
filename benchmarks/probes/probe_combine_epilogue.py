"""Does the combine epilogue keep enough loads in flight? ``combine.epilogue`` (the shipped
kernel) against two copies of it here: ``serial`` (the shipped kernel's loop: a slot's id
loaded, then its row, one at a time -- its SASS issues them so) and ``grouped`` (GROUP slots'
ids, weights and rows loaded before any is added: a masked route's stale row too, never
added; the SASS issues a group's loads together). Out = y_shared +
sum_j w_j y_j over [T, k] routes with 10 % masked, at qwen3.5-397b's 16384 tokens (k = 10, H =
4096) and kimi-k2.7's 8192 (k = 8, H = 7168). Timed in turns as CUDA-graph replays, bits
compared. A probe: it prints, it writes nothing; its findings go to docs/perf.md.

    python benchmarks/probes/probe_combine_epilogue.py
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402
from numba import boolean, cuda, float32, uint32  # noqa: E402

from mok_core.bf16 import hi_bf16, lo_bf16  # noqa: E402
from mok_core.cuda_compat import kjit  # noqa: E402
from mok_core.intrinsics import fadd_rn, fmul_rn, ld_v4, pack_bf16x2, st_v4  # noqa: E402

GROUP = 4


@kjit(device=True, inline="always")
def _load_shared(acc, y_shared, has_shared, t, H, c):
    if has_shared:
        s0, s1, s2, s3 = ld_v4(y_shared, t * H + c)
        acc[0] = lo_bf16(s0)
        acc[1] = hi_bf16(s0)
        acc[2] = lo_bf16(s1)
        acc[3] = hi_bf16(s1)
        acc[4] = lo_bf16(s2)
        acc[5] = hi_bf16(s2)
        acc[6] = lo_bf16(s3)
        acc[7] = hi_bf16(s3)
    else:
        for q in range(8):
            acc[q] = float32(0.0)


@kjit(device=True, inline="always")
def _add(acc, w, v0, v1, v2, v3):
    acc[0] = fadd_rn(acc[0], fmul_rn(w, lo_bf16(v0)))
    acc[1] = fadd_rn(acc[1], fmul_rn(w, hi_bf16(v0)))
    acc[2] = fadd_rn(acc[2], fmul_rn(w, lo_bf16(v1)))
    acc[3] = fadd_rn(acc[3], fmul_rn(w, hi_bf16(v1)))
    acc[4] = fadd_rn(acc[4], fmul_rn(w, lo_bf16(v2)))
    acc[5] = fadd_rn(acc[5], fmul_rn(w, hi_bf16(v2)))
    acc[6] = fadd_rn(acc[6], fmul_rn(w, lo_bf16(v3)))
    acc[7] = fadd_rn(acc[7], fmul_rn(w, hi_bf16(v3)))


@kjit(device=True, inline="always")
def _store(out, acc, t, H, c):
    st_v4(out, t * H + c, pack_bf16x2(acc[0], acc[1]), pack_bf16x2(acc[2], acc[3]),
          pack_bf16x2(acc[4], acc[5]), pack_bf16x2(acc[6], acc[7]))


@kjit
def serial_kernel(y_shared, has_shared, combine, ids, weights, out, T, H, k):
    acc = cuda.local.array(8, float32)
    chunks = H // 8
    i = cuda.grid(1)
    while i < T * chunks:
        t = i // chunks
        c = (i % chunks) * 8
        _load_shared(acc, y_shared, has_shared, t, H, c)
        for j in range(k):
            if ids[t * k + j] >= 0:
                w = weights[t * k + j]
                v0, v1, v2, v3 = ld_v4(combine, (t * k + j) * H + c)
                _add(acc, w, v0, v1, v2, v3)
        _store(out, acc, t, H, c)
        i += cuda.gridsize(1)


@kjit
def grouped_kernel(y_shared, has_shared, combine, ids, weights, out, T, H, k):
    acc = cuda.local.array(8, float32)
    rows = cuda.local.array((GROUP, 4), uint32)
    wts = cuda.local.array(GROUP, float32)
    live = cuda.local.array(GROUP, boolean)
    chunks = H // 8
    i = cuda.grid(1)
    while i < T * chunks:
        t = i // chunks
        c = (i % chunks) * 8
        _load_shared(acc, y_shared, has_shared, t, H, c)
        for j0 in range(0, k, GROUP):
            for b in range(GROUP):
                j = j0 + b
                live[b] = False
                if j < k:
                    r = t * k + j
                    live[b] = ids[r] >= 0
                    wts[b] = weights[r]
                    rows[b, 0], rows[b, 1], rows[b, 2], rows[b, 3] = ld_v4(combine, r * H + c)
            for b in range(GROUP):
                if live[b]:
                    _add(acc, wts[b], rows[b, 0], rows[b, 1], rows[b, 2], rows[b, 3])
        _store(out, acc, t, H, c)
        i += cuda.gridsize(1)


def main():
    import torch

    from benchmarks.bench_ffn import interleaved_ms
    from benchmarks.common import numba_stream as stream
    from mok_comm import combine
    from mok_comm.device import COPY_THREADS
    from mok_core.cuda_compat import as_device_array, launch, multiprocessor_count
    for name, T, H, k in (("qwen3.5-397b", 16384, 4096, 10), ("kimi-k2.7", 8192, 7168, 8)):
        g = torch.Generator(device="cuda").manual_seed(0)
        buf = torch.randn(T * k, H, device="cuda", generator=g).bfloat16()
        ys = torch.randn(T, H, device="cuda", generator=g).bfloat16()
        ids = torch.randint(0, 64, (T, k), device="cuda", generator=g, dtype=torch.int32)
        ids[torch.rand(T, k, device="cuda", generator=g) < 0.1] = -1
        w = torch.rand(T, k, device="cuda", generator=g)
        outs = {n: torch.empty(T, H, device="cuda", dtype=torch.bfloat16)
                for n in ("shipped", "serial", "grouped")}

        class WS:                                     # what combine.epilogue reads
            rank, hidden, topk = 0, H, k
            combine_buf = as_device_array(buf, "combine_buf")
            ids_table = [as_device_array(ids, "ids")]
        blocks = min(4 * multiprocessor_count(), -(-(T * H // 8) // COPY_THREADS))
        flat = {n: as_device_array(t.reshape(-1), n) for n, t in
                (("ys", ys), ("buf", buf), ("ids", ids), ("w", w))}

        def probe(kernel, n):
            o = as_device_array(outs[n].reshape(-1), n)
            return lambda: launch(kernel, blocks, COPY_THREADS, stream(), 0, flat["ys"], True,
                                  flat["buf"], flat["ids"], flat["w"], o, np.int64(T),
                                  np.int64(H), np.int64(k))
        shipped_out = as_device_array(outs["shipped"], "out")
        w_dev, ys_dev = as_device_array(w, "w"), as_device_array(ys, "ys")
        steps = {"shipped": lambda: combine.epilogue(WS, w_dev, shipped_out, ys_dev, stream()),
                 "serial": probe(serial_kernel, "serial"),
                 "grouped": probe(grouped_kernel, "grouped")}
        t = interleaved_ms(steps, 30, eager=())
        torch.cuda.synchronize()
        moved = T * k * H * 2 + 2 * T * H * 2
        for n, (ms, _) in t.items():
            same = torch.equal(outs[n], outs["serial"])
            print(f"  {name} T={T} k={k}: {n:8s} {ms:7.3f} ms  {moved / ms / 1e9:6.2f} TB/s"
                  f"  bits {'equal' if same else 'DIFFER'} to serial")


if __name__ == "__main__":
    main()
