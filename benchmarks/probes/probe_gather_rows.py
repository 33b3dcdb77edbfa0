"""How many loads should ``gather_rows_kernel`` keep in flight? ``batchB``: a lane loads B of
its 16-byte chunks c, c + 32, ..., then stores them (``batch1``: each loaded then stored, the
loop the shipped kernel replaced -- a store may alias the next load, so one load a lane is in
flight), against the shipped kernel (B = CHUNKS_IN_FLIGHT = 4, from its SASS; the layer's A/B
in docs/perf.md timed it together with the combine epilogue's change, not alone), on the
layer's gathers: a token's e4m3 row (+ scales) into expert order, the index of a uniform
routing, EP 1. Timed in turns as CUDA-graph replays, bits compared. A probe: it prints, it
writes nothing; its findings go to docs/perf.md (FP8).

    python benchmarks/probes/probe_gather_rows.py [--batch 2,4]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402

from mok_core.cuda_compat import (as_device_array, flat_view, launch,  # noqa: E402
                                  multiprocessor_count)
from mok_core.gather_rows import (THREADS, _BLOCKS_PER_SM, launch_gather_rows,  # noqa: E402
                                  make_gather_rows_kernel)


def expert_index(tokens, topk, experts, rng):
    """Every route's token, in expert order (a uniform routing; no padding at EP 1's pull)."""
    ids = np.stack([rng.choice(experts, topk, replace=False) for _ in range(tokens)])
    order = np.argsort(ids.reshape(-1), kind="stable")
    return (order // topk).astype(np.int32)


def main():
    import torch
    from benchmarks.bench_ffn import interleaved_ms
    from benchmarks.common import numba_stream as stream
    p = argparse.ArgumentParser()
    p.add_argument("--batch", default="1,2,4,8")
    p.add_argument("--iters", type=int, default=30)
    a = p.parse_args()
    rng = np.random.default_rng(0)
    kernels = {b: make_gather_rows_kernel(b) for b in map(int, a.batch.split(","))}
    for name, T, H, E, k in (("qwen3.5-397b", 16384, 4096, 512, 10),
                             ("kimi-k2.7", 8192, 7168, 384, 8)):
        index_np = expert_index(T, k, E, rng)
        C = index_np.size
        src = torch.randint(0, 255, (T, H), device="cuda", dtype=torch.uint8)
        src_scale = torch.rand(T, H // 128, device="cuda")
        index = torch.from_numpy(index_np).cuda()
        num_rows = torch.tensor([C], device="cuda", dtype=torch.int32)
        outs = {n: (torch.empty(C, H, device="cuda", dtype=torch.uint8),
                    torch.empty(C, H // 128, device="cuda"))
                for n in ["shipped"] + [f"batch{b}" for b in kernels]}

        # numba views of the tensors, as the layer passes them (flat_view reshapes by .size)
        v = {n: as_device_array(t, n) for n, t in (("src", src), ("src_scale", src_scale),
                                                  ("index", index), ("num_rows", num_rows))}
        views = {n: (as_device_array(o, n), as_device_array(o_s, n + "_scale"))
                 for n, (o, o_s) in outs.items()}

        def shipped():
            launch_gather_rows(v["src"], v["src_scale"], v["index"], v["num_rows"],
                               *views["shipped"], stream=stream())

        def batched(b):
            o, o_s = views[f"batch{b}"]
            grid = max(1, min(multiprocessor_count() * _BLOCKS_PER_SM, -(-C // (THREADS // 32))))

            def run():
                launch(kernels[b], grid, THREADS, stream(), 0, flat_view(v["src"], np.uint32),
                       flat_view(v["src_scale"]), v["index"], v["num_rows"], np.int64(C),
                       np.int64(H // 16), np.int64(H // 128), flat_view(o, np.uint32),
                       flat_view(o_s))
            return run
        steps = {"shipped": shipped, **{f"batch{b}": batched(b) for b in kernels}}
        t = interleaved_ms(steps, a.iters, eager=())
        torch.cuda.synchronize()
        moved = 2 * C * (H + 4 * H // 128)
        for n, (ms, _) in t.items():
            same = all(torch.equal(x, y) for x, y in zip(outs[n], outs["shipped"]))
            print(f"  {name} T={T} rows {C}: {n:8s} {ms:7.3f} ms  {moved / ms / 1e9:6.2f} TB/s"
                  f"  bits {'equal' if same else 'DIFFER'}")


if __name__ == "__main__":
    main()
