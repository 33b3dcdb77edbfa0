"""Host-overhead probe: how long the host takes to *issue* one layer step (no synchronisation).

    OUT=/tmp torchrun --standalone --nproc-per-node=2 benchmarks/probes/probe_host.py
                      [--preset kimi-k2.7] [--tokens 4096]

Builds the layer like bench_layer (synthetic weights and inputs, default MoKConfig) and reports
per rank: the host wall time (time.perf_counter) of issuing one eager step (``mok_torch.Layer``:
``layer(x, ids, w, weights)``) and one compiled step (``layer.compile(weights)``) call, mean
over 20 calls after warm-up, without synchronising
(the GPU runs behind; ``steady`` = the 20 calls plus the final synchronise, per call), and a
cProfile of 10 eager calls (top 25 by cumulative and by own time) in
$OUT/probe_host_rank{r}.txt. Both launch paths -- ``mok_core.launcher`` and numba's dispatcher
(``launcher.ENABLED = False``) -- in turns, ``--rounds`` rounds, the median round of each; their
eager outputs must be bitwise equal (checked). Runs at any EP (``--nproc-per-node=1``: EP 1).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

N_ISSUE, N_PROFILE, WARMUP = 20, 10, 3


def issue_times(fn, n):
    """(mean host ms per call over n unsynchronised calls, steady ms per call incl. the sync)."""
    import torch
    import torch.distributed as dist
    torch.cuda.synchronize()
    dist.barrier()
    times, outs = [], []
    t0 = time.perf_counter()
    for _ in range(n):
        a = time.perf_counter()
        outs.append(fn())
        times.append(time.perf_counter() - a)
    torch.cuda.synchronize()
    steady = (time.perf_counter() - t0) / n
    return 1e3 * sum(times) / n, 1e3 * steady


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="kimi-k2.7")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    import torch

    from benchmarks.common import init_distributed
    from mok_comm.launch import bootstrap
    dist = init_distributed()

    import mok_torch
    from mok_core import launcher
    from mok_core.config import MoKConfig, preset
    from mok_testing import synthetic
    R, me, T = dist.get_world_size(), dist.get_rank(), args.tokens
    shape = preset(args.preset, ep_size=R)
    dev = torch.device("cuda", torch.cuda.current_device())
    cfg = MoKConfig()
    x, ids, w = synthetic.rank_inputs(shape, T, me, dev, skew=0.0)
    wg, wu, wd = synthetic.local_expert_weights(shape, me, dev)
    shared = synthetic.shared_weights(shape, dev)
    weights = mok_torch.Weights(*shared, wg, wu, wd)
    layer = mok_torch.Layer(shape, T, cfg)
    step = layer.compile(weights)

    def eager():
        return layer(x, ids, w, weights)

    def compiled():
        return step(x, ids, w)

    try:
        paths = {"launcher": True, "numba": False}
        outs = {}
        for name, enabled in paths.items():
            launcher.ENABLED = enabled
            for _ in range(WARMUP):
                out = eager()
                compiled()              # first call: eager core + capture; then replays
            torch.cuda.synchronize()
            outs[name] = out.clone()
        same = bool(torch.equal(outs["launcher"].view(torch.int16),
                                outs["numba"].view(torch.int16)))
        times = {name: [] for name in paths}
        for _ in range(args.rounds):
            for name, enabled in paths.items():
                launcher.ENABLED = enabled
                times[name].append(issue_times(eager, N_ISSUE) + issue_times(compiled, N_ISSUE))
        med = {name: sorted(rows)[len(rows) // 2] for name, rows in times.items()}
        launcher.ENABLED = True
        torch.cuda.synchronize()
        dist.barrier()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(N_PROFILE):
            eager()
        prof.disable()
        torch.cuda.synchronize()
        layer.check()
        report = io.StringIO()
        head = (f"{args.preset} T={T} EP={R} rank {me}: host issue per call (mean of {N_ISSUE}, "
                f"no sync; median of {args.rounds} rounds in turns) and steady per call incl. "
                f"the final sync; eager outputs of the two launch paths bitwise equal: {same}")
        lines = [f"  {name:8s}: eager {e:.3f} ms (steady {es:.3f}), compiled step {c:.3f} ms "
                 f"(steady {cs:.3f})" for name, (e, es, c, cs) in med.items()]
        lines.append(f"  launcher / numba eager issue: {med['launcher'][0] / med['numba'][0]:.3f}"
                     f" (captures: {step.captures})")
        report.write("\n".join([head] + lines) + "\n\n")
        report.write(f"--- cProfile of {N_PROFILE} eager calls through the launcher ---\n")
        for key in ("cumulative", "tottime"):
            report.write(f"--- top 25 by {key} ---\n")
            pstats.Stats(prof, stream=report).sort_stats(key).print_stats(25)
        path = os.path.join(os.environ.get("OUT", "/tmp"), f"probe_host_rank{me}.txt")
        with open(path, "w") as f:
            f.write(report.getvalue())
        print("\n".join([head] + lines) + f"\n  profile: {path}", flush=True)
        if not same:
            raise SystemExit("the two launch paths gave different outputs")
    finally:
        torch.cuda.synchronize()
        step = None
        layer.comm.free()
        bootstrap.finalize()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
