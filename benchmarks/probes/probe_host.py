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
Then a timeline of ``TRACE_STEPS`` more eager steps of each (torch's profiler, CPU and CUDA;
each step from an idle GPU, as ``time_iters`` times them; every launch of ours and every call
of numba's that can make the host wait in a ``record_function``, a few microseconds each --
``LaunchLog``): per step the host's issue time, the device's busy time, its span from the
step's first host instruction to its last kernel's end and its idle time, and how much of
that idle came before kernels whose launch started only after the device had gone idle (the
host's); the largest gaps, each with its kernel's launch against the device going idle, the
host's time since the previous launch, and the host's waits meanwhile; the waits, torch's
CUDA runtime calls that can wait, the device's copies and sets, and launches sent to numba's
dispatcher instead of ``mok_core.launcher``. In the same files.
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

N_ISSUE, N_PROFILE, WARMUP, TRACE_STEPS = 20, 10, 3, 3


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


class LaunchLog:
    """Inside ``with``: every ``mok_core.cuda_compat.launch`` (each mok module's imported
    name patched) runs in a ``record_function("mok.launch:<kernel>")``, and every call that
    can make the host wait (``mok_testing.host_waits``: numba's driver calls -- kineto keeps
    no driver API call but the launches -- and launches sent to numba's dispatcher) in a
    ``record_function("mok.wait:<what>")``; ``waits`` lists them all."""

    def __init__(self):
        from mok_core import cuda_compat
        self.launch = cuda_compat.launch
        self.modules = [m for n, m in list(sys.modules.items())
                        if n.startswith("mok_") and getattr(m, "launch", None) is self.launch]
        self.waits: list = []
        self._watch = None

    def _wrapped(self, kernel, *rest):
        from torch.profiler import record_function

        from mok_testing.host_waits import kernel_label
        with record_function(f"mok.launch:{kernel_label(kernel)}"):
            self.launch(kernel, *rest)

    def __enter__(self):
        from torch.profiler import record_function

        from mok_testing import host_waits
        self._watch = host_waits.watch(lambda what: record_function(f"mok.wait:{what}"))
        self.waits = self._watch.__enter__()
        for m in self.modules:
            m.launch = self._wrapped
        return self

    def __exit__(self, *exc):
        for m in self.modules:
            m.launch = self.launch
        return self._watch.__exit__(*exc)


# torch's CUDA runtime calls that can make the host wait (or that mark a pageable copy)
_WAITING = ("Synchronize", "Memcpy", "Memset", "Malloc", "Free", "EventQuery", "HostAlloc")


def _numba_kernel(name):
    return name.startswith("_ZN") and "cudapy" in name


def timeline(steps, launches, device, waits, apis, top=8):
    """The text of ``timeline_report`` from the profiler's intervals (microseconds, one clock):
    ``steps`` [(start, end)] the host ranges of the steps, ``launches`` [(name, start, end)]
    our launches' ranges, ``device`` [(name, start, end)] the GPU's kernels, copies and sets,
    ``waits`` [(what, start, end)] the host's calls that can wait (``LaunchLog``), ``apis``
    [(name, start, end)] the CUDA runtime calls the profiler saw (torch's). A step's device
    work: what starts after its host start and before the next step's. Our launches pair with
    numba's kernels in order (one stream); a gap before a kernel is the host's where its
    launch started after the device went idle."""
    from benchmarks.common import kernel_name

    def tally(counts, name, dt=0.0):                 # name -> (calls, microseconds)
        n, t = counts.get(name, (0, 0.0))
        counts[name] = (n + 1, t + dt)
    rows, gaps, api_sum, dev_other, n_waits, unpaired = [], [], {}, {}, {}, 0
    launches = sorted(launches, key=lambda r: r[1])
    device = sorted(device, key=lambda r: r[1])
    bounds = [s for s, _ in steps] + [float("inf")]
    for i, (h0, h1) in enumerate(steps):
        for what, w0, _ in waits:
            if h0 <= w0 <= h1:
                tally(n_waits, what)
        work = [d for d in device if h0 <= d[1] < bounds[i + 1]]
        if not work:
            continue
        mine = [r for r in launches if h0 <= r[1] <= h1]
        numba = [d for d in work if _numba_kernel(d[0])]
        paired = len(mine) == len(numba)
        unpaired += not paired
        launch_of = {d[:2]: k for k, d in enumerate(numba)} if paired else {}
        busy = late = 0.0
        cur0 = cur1 = None
        prev_end = h0
        for name, d0, d1 in work:
            if d0 > prev_end:
                k = launch_of.get((name, d0))
                host = None
                if k is not None:
                    l0 = mine[k][1]
                    glue = l0 - (mine[k - 1][2] if k else h0)
                    host = (l0 - prev_end, glue)
                    if l0 > prev_end:
                        late += d0 - prev_end
                during = sorted({w for w, w0, w1 in waits if w0 < d0 and w1 > prev_end})
                gaps.append((d0 - prev_end, i, name, host, during))
            if cur1 is None or d0 > cur1:
                busy += 0 if cur1 is None else cur1 - cur0
                cur0, cur1 = d0, d1
            else:
                cur1 = max(cur1, d1)
            prev_end = max(prev_end, d1)
        busy += cur1 - cur0
        rows.append((h1 - h0, busy, prev_end - h0, prev_end - h0 - busy, late))
        for name, a0, a1 in apis:
            if h0 <= a0 < h1 and any(w in name for w in _WAITING):
                tally(api_sum, name, a1 - a0)
        for name, d0, d1 in work:
            if name.startswith(("Memcpy", "Memset")):
                tally(dev_other, name, d1 - d0)

    if not rows:
        return "no device work seen in the traced steps\n"
    med = [sorted(c)[len(c) // 2] / 1e3 for c in zip(*rows)]
    out = [f"host issue {med[0]:.3f} ms, device busy {med[1]:.3f} ms, span {med[2]:.3f} ms, "
           f"idle {med[3]:.3f} ms, of it before kernels the host launched late {med[4]:.3f} "
           f"ms (medians of {len(rows)} steps"
           + (f"; {unpaired} not paired: launches != numba kernels)" if unpaired else ")"),
           "largest device gaps (ms; step: the work after it; its launch started X ms after "
           "the device went idle (< 0: before), Y ms after the previous launch ended; the "
           "host's waits meanwhile):"]
    for g, i, name, host, during in sorted(gaps, key=lambda r: -r[0])[:top]:
        when = ("launch not paired" if host is None else
                f"launch {host[0] / 1e3:+.3f}, glue {host[1] / 1e3:.3f}")
        out.append(f"  {g / 1e3:7.3f}  step {i}: before {kernel_name(name)}; {when}; waits: "
                   + (", ".join(during) or "none"))
    out.append("the host's waits inside the steps (mok_testing.host_waits; all steps): "
               + ("; ".join(f"{w} x{c}" for w, (c, _) in sorted(n_waits.items())) or "none"))
    out.append("torch's CUDA runtime calls inside the steps that can wait (calls, ms): "
               + ("; ".join(f"{n}: {c}, {t / 1e3:.3f}" for n, (c, t) in
                            sorted(api_sum.items(), key=lambda r: -r[1][1])) or "none"))
    out.append("device copies / sets inside the steps: "
               + ("; ".join(f"{n}: {c}, {t / 1e3:.3f} ms" for n, (c, t) in
                            sorted(dev_other.items())) or "none"))
    return "\n".join(out) + "\n"


def timeline_report(fn, n, title):
    """``n`` eager steps of ``fn`` under torch's profiler, each from an idle GPU: the text of
    ``timeline`` (module docstring), titled."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function
    with LaunchLog() as log, profile(activities=[ProfilerActivity.CPU,
                                                 ProfilerActivity.CUDA]) as prof:
        for i in range(n):
            torch.cuda.synchronize()
            with record_function(f"mok.step:{i}"):
                fn()
            torch.cuda.synchronize()
    steps, launches, device, waits, apis = [], [], [], [], []
    for e in prof.events():
        r = (e.name, e.time_range.start, e.time_range.end)
        if e.name.startswith("mok."):
            if e.device_type == torch.autograd.DeviceType.CUDA:
                continue                # a range's GPU-side twin (kineto's user annotation)
            kind, _, what = e.name.partition(":")
            {"mok.step": lambda: steps.append(r[1:]),
             "mok.launch": lambda: launches.append((what, r[1], r[2])),
             "mok.wait": lambda: waits.append((what, r[1], r[2]))}[kind]()
        elif e.device_type == torch.autograd.DeviceType.CUDA:
            if not getattr(e, "is_user_annotation", False):
                device.append(r)
        elif e.name.startswith("cu"):
            apis.append(r)
    text = timeline(sorted(steps), launches, device, waits, apis)
    fallbacks = sorted({w for w in log.waits if w.startswith("numba's")})
    return (f"--- timeline of {n} eager steps: {title} ---\n" + text
            + f"launches a step: {len(launches) // max(n, 1)}; launched through numba's "
              f"dispatcher: {', '.join(fallbacks) or 'none'}\n")


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
            dist.barrier()
            trace = timeline_report(fn, TRACE_STEPS, f"{args.preset} T={T} {p}")
            lines.append(f"  {p:5s}: {trace.splitlines()[1]}")
            text = trace + "\n" + text
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
