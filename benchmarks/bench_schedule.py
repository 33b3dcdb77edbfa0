"""Schedule builder time on one GPU (routing of R ranks given as the gathered [R, T, k] table).

    python benchmarks/bench_schedule.py [--out benchmarks/results/bench_schedule.json]

Reports eager time (5 launches from Python, per-iteration CUDA events) and CUDA-graph replay
time (the GPU work alone; the layer runs captured). Goal: <= 60 us at T=8192, R=8, E=384, k=8.
``--per-kernel``: also the graph-replay time of each prefix of the launches (reset, + count,
+ scan, + offsets, + place); consecutive differences = what each launch adds (``*_us``).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from benchmarks.common import (gpu_name, median, numba_stream, progress, table,  # noqa: E402
                               time_iters, write_json)


def replay_us(launches, iters, reps=10):
    """Replay time of ``reps`` copies of the launch sequence captured in one graph, per copy."""
    import torch
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for run in launches():                         # warm (compiled, loaded) on this stream
            run()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=side):
            for _ in range(reps):
                for run in launches():
                    run()
    return median(time_iters(g.replay, iters)) / reps * 1e3


def run_case(T, R, E, k, iters, per_kernel=False):
    import torch

    from mok_core.config import MoKConfig
    from mok_core.schedule import Schedule, build_schedule, schedule_launches
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
        graph_us = replay_us(lambda: [lambda: build_schedule(sched, d_ids,
                                                             stream=numba_stream())], iters)
    except Exception as exc:                        # noqa: BLE001 - reported, not fatal
        progress(f"graph capture failed: {type(exc).__name__}: {exc}")
    row = {"tokens_per_rank": T, "ep": R, "experts": E, "topk": k, "eager_us": eager * 1e3,
           "graph_us": graph_us}
    if per_kernel:
        names = [n for n, _ in schedule_launches(sched, d_ids)]
        prev = 0.0
        for i, name in enumerate(names):
            def prefix(i=i):
                return [run for _, run in
                        schedule_launches(sched, d_ids, stream=numba_stream())[:i + 1]]
            t = replay_us(prefix, iters)
            row[f"{name}_us"] = t - prev
            prev = t
    sched.check()
    row["gpu"] = gpu_name()
    return row


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--per-kernel", action="store_true",
                    help="also time what each of the five launches adds (graph replays)")
    ap.add_argument("--out", default="benchmarks/results/bench_schedule.json")
    args = ap.parse_args(argv)
    rows = []
    for T, R in [(8192, 8), (4096, 2), (8192, 2), (16384, 8)]:
        progress(f"schedule T={T} R={R}")
        rows.append(run_case(T, R, 384, 8, args.iters, args.per_kernel))
    write_json(args.out, rows)
    cols = ["tokens_per_rank", "ep", "experts", "topk", "eager_us", "graph_us"]
    if args.per_kernel:
        cols += [c for c in rows[0] if c.endswith("_us") and c not in cols]
    print(table(rows, cols))


if __name__ == "__main__":
    main()
