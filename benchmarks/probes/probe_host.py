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

``--fwd-bwd``: instead, an eager forward + backward (``layer.backward(layer.forward(...)[1],
...)`` into one set of gradient buffers, as ``bench_layer``'s ``fwd_bwd_speedup_vs_bf16``
times it) in bf16 and in FP8 (pre-quantised weights), in turns: the host's issue time per
step against the steady time (where issue >= steady the step is host-bound: the GPU waits
for launches), and a cProfile of each in $OUT/probe_host_fwd_bwd_{precision}_rank{r}.txt --
where the FP8 step's 2-5 ms of eager-over-graph time at 4096-8192 tokens goes (docs/perf.md).
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
    ap.add_argument("--fwd-bwd", action="store_true",
                    help="eager forward + backward, bf16 and FP8 in turns (module docstring)")
    args = ap.parse_args(argv)
    if args.fwd_bwd:
        return fwd_bwd(args)
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
        profile = profile_report(eager, N_PROFILE, "eager calls through the launcher")
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
        report.write("\n".join([head] + lines) + "\n\n" + profile)
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


def profile_report(fn, n, title):
    """cProfile of n calls of fn: the top 25 by cumulative and by own time, as text."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    report = io.StringIO()
    report.write(f"--- cProfile of {n} calls: {title} ---\n")
    for key in ("cumulative", "tottime"):
        report.write(f"--- top 25 by {key} ---\n")
        pstats.Stats(prof, stream=report).sort_stats(key).print_stats(25)
    return report.getvalue()


def fwd_bwd(args):
    """``--fwd-bwd`` (module docstring)."""
    import dataclasses

    import torch

    import mok_torch
    from benchmarks.common import init_distributed
    from mok_comm.launch import bootstrap
    from mok_core.config import MoKConfig, preset
    from mok_testing import synthetic
    dist = init_distributed()
    R, me, T = dist.get_world_size(), dist.get_rank(), args.tokens
    shape = preset(args.preset, ep_size=R)
    dev = torch.device("cuda", torch.cuda.current_device())
    x, ids, w = synthetic.rank_inputs(shape, T, me, dev, skew=0.0)
    weights = mok_torch.Weights(*synthetic.shared_weights(shape, dev),
                                *synthetic.local_expert_weights(shape, me, dev))
    d_out = torch.randn(T, shape.hidden, device=dev,
                        generator=torch.Generator(dev).manual_seed(100 + me)).bfloat16()
    layers = {}                          # (built inside: a failed build frees the other)
    try:
        for p in ("bf16", "fp8"):
            layers[p] = mok_torch.Layer(shape, T, dataclasses.replace(MoKConfig(), precision=p))
        W = {"bf16": weights,
             "fp8": mok_torch.WeightsFP8(*weights, mok_torch.quantize_weights(weights))}
        grads = layers["bf16"].backward(layers["bf16"].forward(x, ids, w, weights)[1], d_out,
                                        w, weights)
        steps = {p: (lambda p=p: layers[p].backward(layers[p].forward(x, ids, w, W[p])[1],
                                                    d_out, w, W[p], grads=grads))
                 for p in layers}
        for fn in steps.values():
            for _ in range(WARMUP):
                fn()
        times = {p: [] for p in steps}
        for _ in range(args.rounds):
            for p, fn in steps.items():
                times[p].append(issue_times(fn, N_ISSUE))
        med = {p: sorted(rows)[len(rows) // 2] for p, rows in times.items()}
        head = (f"{args.preset} T={T} EP={R} rank {me}: eager forward + backward, host issue "
                f"per step (mean of {N_ISSUE}, no sync; median of {args.rounds} rounds in "
                "turns) and steady per step incl. the final sync")
        lines = [f"  {p:5s}: issue {i:.3f} ms, steady {st:.3f} ms" for p, (i, st) in med.items()]
        out = os.environ.get("OUT", "/tmp")
        for p, fn in steps.items():
            torch.cuda.synchronize()
            dist.barrier()
            text = profile_report(fn, N_PROFILE, f"{args.preset} T={T} {p} forward + backward")
            torch.cuda.synchronize()
            path = os.path.join(out, f"probe_host_fwd_bwd_{p}_rank{me}.txt")
            with open(path, "w") as f:
                f.write("\n".join([head] + lines) + "\n\n" + text)
            lines.append(f"  profile: {path}")
        for layer in layers.values():
            layer.check()
        print("\n".join([head] + lines), flush=True)
    finally:
        torch.cuda.synchronize()
        for layer in layers.values():
            layer.comm.free()
        bootstrap.finalize()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
