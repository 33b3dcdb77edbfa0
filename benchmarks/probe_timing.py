"""Does the timing protocol move the FFN ratio? Ours and grouped_mm timed four ways, one run.

    python benchmarks/probe_timing.py [--presets qwen3.5-397b,kimi-k2.7] [--tokens 4096]

For each preset (EP=2, rank 0's routed FFN, uniform routing, the library's tiles for the shape
-- ``functional.layer_gemm``), both sides as CUDA-graph replays:
  alone      each side's iterations back to back (bench_ffn up to session 9)
  turns      ours, grouped_mm, ours, ... (bench_ffn from session 10)
  reversed   grouped_mm, ours, grouped_mm, ...
  idle       turns with the GPU left idle 20 ms before every timed call (clocks recover)
An SM-clock and power trace (``nvidia-smi -lms 50``, ``*_smi.csv``) runs beside it; each
row carries the trace's mean over that protocol's window (a protocol lasts ~0.5-2 s and the
power reading is a ~1 s average: read the CSV for the shape over time). If a side runs slower
right after the other, the protocol -- not the kernel -- moves the ratio.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from datetime import datetime

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from benchmarks.bench_ffn import ffn_inputs, ffn_steps  # noqa: E402
from benchmarks.common import (capture_graph, median, progress, table,  # noqa: E402
                               time_iters, write_json)


def torch_steps(d):
    """(gate_up, down) of the torch._grouped_mm baseline on the same problem."""
    import torch
    I = d["wg"].shape[1]
    counts = d["counts"]
    c16 = -(-counts // 16) * 16
    offs = torch.from_numpy(np.cumsum(c16).astype(np.int32)).cuda()
    x16 = torch.randn(int(c16.sum()), d["x"].shape[1], device="cuda", dtype=d["x"].dtype)
    w_gu = torch.cat([d["wg"], d["wu"]], dim=1).transpose(1, 2)
    h = torch.empty(x16.shape[0], I, device="cuda", dtype=x16.dtype)

    def gate_up():
        g, u = torch._grouped_mm(x16, w_gu, offs=offs).split(I, dim=1)
        h.copy_(torch.nn.functional.silu(g) * u)
    return gate_up, lambda: torch._grouped_mm(h, d["wd"].transpose(1, 2), offs=offs)


def trace_start(path):
    """nvidia-smi sampling SM clock and power every 50 ms into ``path`` (None if absent)."""
    try:
        return subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw",
                                 "--format=csv,noheader,nounits", "-lms", "50", "-i", "0"],
                                stdout=open(path, "w"), stderr=subprocess.DEVNULL)
    except OSError:
        return None


def trace_mean(path, t0, t1):
    """(mean SM MHz, mean W, samples) of the trace's samples taken between host times t0 and
    t1. (nvidia-smi's power reading is itself an average over about a second.)"""
    clocks, power = [], []
    for line in open(path):
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3:
            continue
        try:
            stamp = datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            if t0 <= stamp <= t1:
                clocks.append(float(parts[1]))
                power.append(float(parts[2]))
        except ValueError:
            continue
    return (float(np.mean(clocks)) if clocks else float("nan"),
            float(np.mean(power)) if power else float("nan"), len(clocks))


def protocols(ours, torch_fn, iters):
    """name -> (ours ms, torch ms) medians per protocol, with host start/end times."""
    out = {}

    def idle():
        time.sleep(0.02)
    t0 = time.time()
    a = median(time_iters(ours, iters))
    b = median(time_iters(torch_fn, iters))
    out["alone"] = (a, b, t0, time.time())
    for name, order, pre in (("turns", (0, 1), None), ("reversed", (1, 0), None),
                             ("idle", (0, 1), idle)):
        fns = (ours, torch_fn)
        times = ([], [])
        t0 = time.time()
        for _ in range(3):
            for i in order:
                time_iters(fns[i], 1, 0, pre)
        for _ in range(iters):
            for i in order:
                times[i].extend(time_iters(fns[i], 1, 0, pre))
        out[name] = (median(times[0]), median(times[1]), t0, time.time())
    return out


def probe_preset(name, tokens, iters, trace):
    """Rows of one preset: each protocol's medians, ratio and the clock trace's mean over it
    (the inputs and graphs are freed on return)."""
    from mok_comm.functional import layer_gemm
    from mok_core.config import preset
    shape = preset(name, ep_size=2)
    cfg = layer_gemm(shape, tokens)
    d = ffn_inputs(name, tokens, "uniform", cfg.row_unit, np.random.default_rng(0))
    gu, dn = ffn_steps(d, cfg)
    tg, td = torch_steps(d)

    def ours():
        gu()
        dn()

    def theirs():
        tg()
        td()
    g_ours = capture_graph(ours)[0]
    g_theirs = capture_graph(theirs)[0]
    progress(f"{name}: {cfg}")
    rows = []
    for proto, (a, b, t0, t1) in protocols(g_ours.replay, g_theirs.replay, iters).items():
        clock, power, n = trace_mean(trace, t0, t1) if trace else (float("nan"),) * 2 + (0,)
        rows.append({"preset": name, "tokens_per_rank": tokens, "protocol": proto,
                     "ours_ms": a, "grouped_mm_ms": b, "ratio": b / a,
                     "sm_mhz": clock, "watts": power, "smi_samples": n})
        progress(f"  {proto:9s} ours {a:.3f}  grouped_mm {b:.3f}  ratio {b / a:.3f}  "
                 f"{clock:.0f} MHz {power:.0f} W ({n} samples)")
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="qwen3.5-397b,kimi-k2.7,glm-5.2")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--out", default="benchmarks/results/probe_timing.json")
    args = ap.parse_args(argv)
    import torch

    trace = os.path.splitext(args.out)[0] + "_smi.csv"
    smi = trace_start(trace)
    rows = []
    try:
        for name in args.presets.split(","):
            rows += probe_preset(name, args.tokens, args.iters, trace if smi else None)
            write_json(args.out, rows)
            torch.cuda.empty_cache()
    finally:
        if smi:
            smi.terminate()
            smi.wait()
    print(table(rows, ["preset", "protocol", "ours_ms", "grouped_mm_ms", "ratio", "sm_mhz",
                       "watts"]))
    return rows


if __name__ == "__main__":
    main()
