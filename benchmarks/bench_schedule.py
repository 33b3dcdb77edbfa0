"""Schedule builder time on one GPU (routing of R ranks given as the gathered [R, T, k] table).

    python benchmarks/bench_schedule.py [--out benchmarks/results/bench_schedule.json]

Reports eager time (5 launches from Python, per-iteration CUDA events) and CUDA-graph replay
time (the GPU work alone; the layer runs captured). Goal: <= 60 us at T=8192, R=8, E=384, k=8.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from benchmarks.common import (gpu_name, median, numba_stream, progress, table,  # noqa: E402
                               time_iters, write_json)


def run_case(T, R, E, k, iters):
    import torch

    from mok_core.config import MoKConfig
    from mok_core.schedule import Schedule, build_schedule
    rng = np.random.default_rng(T + R)
    g = rng.gumbel(size=(R * T, E)).astype(np.float32)
    ids = np.argpartition(g, -k, axis=1)[:, -k:].reshape(R, T, k).astype(np.int32)
    d_ids = torch.from_numpy(ids).cuda()
    s = numba_stream()
    sched = Schedule.allocate(rank=0, ep_size=R, tokens_per_rank=T, topk=k, num_experts=E,
                              config=MoKConfig(capacity_factor=1.0), stream=s)

    def once():
        build_schedule(sched, d_ids, stream=s)

    eager = median(time_iters(once, iters))
    graph_us = float("nan")
    try:
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            s_side = numba_stream()
            build_schedule(sched, d_ids, stream=s_side)                # warm, on this stream
            torch.cuda.synchronize()
            g_ = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g_, stream=side):
                for _ in range(10):
                    build_schedule(sched, d_ids, stream=numba_stream())
        replay = median(time_iters(g_.replay, iters))
        graph_us = replay / 10 * 1e3
    except Exception as exc:
        progress(f"graph capture failed: {type(exc).__name__}: {exc}")
    sched.check()
    return {"tokens_per_rank": T, "ep": R, "experts": E, "topk": k, "eager_us": eager * 1e3,
            "graph_us": graph_us, "gpu": gpu_name()}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--out", default="benchmarks/results/bench_schedule.json")
    args = ap.parse_args(argv)
    rows = []
    for T, R in [(8192, 8), (4096, 2), (8192, 2), (16384, 8)]:
        progress(f"schedule T={T} R={R}")
        rows.append(run_case(T, R, 384, 8, args.iters))
    write_json(args.out, rows)
    print(table(rows, ["tokens_per_rank", "ep", "experts", "topk", "eager_us", "graph_us"]))


if __name__ == "__main__":
    main()
