"""Does the combine epilogue gain from its routes' loads in flight together? ``combine.epilogue``
(the shipped kernel: ROUTES_IN_FLIGHT routes' ids, weights and rows loaded before any is
added) against ``serial``, the loop it replaced (a route's id loaded, then its row, one at a
time -- its SASS issues them so). Out = y_shared +
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
from numba import cuda, float32  # noqa: E402

from mok_comm.combine import _add_route  # noqa: E402
from mok_core.bf16 import hi_bf16, lo_bf16  # noqa: E402
from mok_core.cuda_compat import kjit  # noqa: E402
from mok_core.intrinsics import ld_v4, pack_bf16x2, st_v4  # noqa: E402

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
                _add_route(acc, w, v0, v1, v2, v3)
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
                for n in ("shipped", "serial")}

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
                 "serial": probe(serial_kernel, "serial")}
        t = interleaved_ms(steps, 30, eager=())
        torch.cuda.synchronize()
        moved = T * k * H * 2 + 2 * T * H * 2
        for n, (ms, _) in t.items():
            same = torch.equal(outs[n], outs["serial"])
            print(f"  {name} T={T} k={k}: {n:8s} {ms:7.3f} ms  {moved / ms / 1e9:6.2f} TB/s"
                  f"  bits {'equal' if same else 'DIFFER'} to serial")


if __name__ == "__main__":
    main()
