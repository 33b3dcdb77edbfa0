"""Same bits, same speed? The layer of one source tree at every preset, for an A/B against
another tree (a refactor's acceptance check; one GPU).

    python benchmarks/probes/compare_trees.py --api new --out a.json          # this tree
    PYTHONPATH=/path/to/old/tree python benchmarks/probes/compare_trees.py --api old --out b.json

Per preset (EP 1, T tokens, synthetic weights and inputs with skew and masked routes): the eager
step ``--reps`` times (every output must be bit-identical) and the compiled (CUDA-graph) step as
often (each equal to the eager output), the output's SHA-256, and the median of CUDA-event step
times of both. ``--emulated R`` adds one preset with R ranks emulated on this GPU (split
dispatch and the fused push between ranks). Run the trees in alternation (``--rounds``) so
clock drift hits both alike; ``--compare`` prints the table of two or more result files.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.common import time_iters  # noqa: E402


def _digest(t) -> str:
    return hashlib.sha256(t.view(__import__("torch").int16).cpu().numpy().tobytes()).hexdigest()[:16]


def _time(fn, iters):
    return statistics.median(time_iters(fn, iters, warmup=0))


def _api(name):
    """(make_layer, eager, compile, synthetic) for the old (functional) or new (Layer) API."""
    import mok_torch
    if name == "new":
        from mok_testing import synthetic

        def make(shape, T, cfg):
            return mok_torch.Layer(shape, T, cfg)

        def eager(lw, cfg, x, ids, w, W):
            return lw(x, ids, w, mok_torch.Weights(*W))

        def compiled(lw, cfg, W):
            return lw.compile(W)
    else:
        from mok_torch import synthetic

        def make(shape, T, cfg):
            return mok_torch.get_workspace(shape, T, cfg)

        def eager(lw, cfg, x, ids, w, W):
            sched = mok_torch.build_schedule(lw, ids)
            return mok_torch.forward(cfg, lw, sched, x, w, *W)[0]

        def compiled(lw, cfg, W):
            return mok_torch.compile_step(cfg, lw, *W)
    return make, eager, compiled, synthetic


def run_preset(api, name, T, reps):
    import torch
    from mok_core.config import MoKConfig, preset
    make, eager, compiled, synthetic = _api(api)
    shape, cfg, dev = preset(name, 1), MoKConfig(), "cuda"
    x, ids, w = synthetic.rank_inputs(shape, T, 0, dev, skew=0.3, masked=0.01)
    W = (*synthetic.shared_weights(shape, dev), *synthetic.local_expert_weights(shape, 0, dev))
    lw = make(shape, T, cfg)
    with torch.no_grad():
        first = eager(lw, cfg, x, ids, w, W).clone()
        same = all(torch.equal(eager(lw, cfg, x, ids, w, W), first) for _ in range(reps))
        step = compiled(lw, cfg, W)
        graph_same = all(torch.equal(step(x, ids, w), first) for _ in range(reps))
        lw.check()
        eager_ms = _time(lambda: eager(lw, cfg, x, ids, w, W), reps)
        graph_ms = _time(lambda: step(x, ids, w), reps)
    row = dict(preset=name, tokens=T, ep=1, sha=_digest(first), repeat_equal=same,
               graph_equal=graph_same, eager_ms=eager_ms, graph_ms=graph_ms)
    del lw, step, W
    torch.cuda.empty_cache()
    return row


def run_emulated(api, name, T, R, reps):
    """R ranks on one GPU through the framework-neutral phases: hash of every rank's output."""
    import torch
    from mok_core.config import MoKConfig, preset
    from mok_comm.emulation import run_phases
    _, _, _, synthetic = _api(api)
    shape, cfg, dev = preset(name, R), MoKConfig(), "cuda"
    ins = [synthetic.rank_inputs(shape, T, r, dev, skew=0.3, masked=0.01) for r in range(R)]
    Ws = [(*synthetic.shared_weights(shape, dev), *synthetic.local_expert_weights(shape, r, dev))
          for r in range(R)]
    outs = [torch.empty(T, shape.hidden, dtype=torch.bfloat16, device=dev) for _ in range(R)]
    if api == "new":
        from mok_comm.emulation import emulated_layers
        from mok_comm.functional import step_phases
        from mok_comm.layer import Weights, layer_gemm
        lws = emulated_layers(shape, T, cfg, layer_gemm(shape, T))

        def step():
            run_phases([lw.comm for lw in lws],
                       [step_phases(lw, x, ids, w, Weights(*W), out=o)[0]
                        for lw, (x, ids, w), W, o in zip(lws, ins, Ws, outs)])
    else:
        from mok_comm.emulation import emulated_layer
        from mok_comm.functional import forward_phases, layer_gemm, schedule_phases
        lws = emulated_layer(shape, T, cfg, layer_gemm(shape, T))

        def step():
            comms = [lw.comm for lw in lws]
            run_phases(comms, [schedule_phases(lw, ids) for lw, (x, ids, w) in zip(lws, ins)])
            run_phases(comms, [forward_phases(cfg, lw, lw.schedule, x, w, *W, out=o)[0]
                               for lw, (x, ids, w), W, o in zip(lws, ins, Ws, outs)])
    step()
    torch.cuda.synchronize()
    first = [o.clone() for o in outs]
    same = True
    for _ in range(reps):
        step()
        same &= all(torch.equal(o, f) for o, f in zip(outs, first))
    for lw in lws:
        lw.check()
    return dict(preset=name, tokens=T, ep=R, emulated=True, repeat_equal=same,
                sha=_digest(torch.stack(first)), eager_ms=_time(step, 5), graph_ms=None)


def compare(paths):
    runs = [json.load(open(p)) for p in paths]
    print(f"| preset | EP | T | {' | '.join(r['api'] + ' sha' for r in runs)} | bits equal | "
          f"{' | '.join(r['api'] + ' eager/graph ms' for r in runs)} |")
    print("|---" * (4 + 2 * len(runs)) + "|")
    for rows in zip(*(r["rows"] for r in runs)):
        shas = [row["sha"] for row in rows]
        ok = len(set(shas)) == 1 and all(row["repeat_equal"] and row.get("graph_equal", True)
                                         for row in rows)
        times = [f"{row['eager_ms']:.2f} / " + (f"{row['graph_ms']:.2f}" if row["graph_ms"]
                                                  else "-") for row in rows]
        print(f"| {rows[0]['preset']} | {rows[0]['ep']} | {rows[0]['tokens']} | "
              f"{' | '.join(shas)} | {ok} | {' | '.join(times)} |")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--api", choices=("old", "new"), default="new")
    ap.add_argument("--presets", default="kimi-k2.7,glm-5.2,qwen3.5-397b,deepseek-v4-pro")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--emulated", type=int, default=0, help="ranks emulated on one GPU (qwen)")
    ap.add_argument("--out", default="")
    ap.add_argument("--compare", nargs="*")
    a = ap.parse_args(argv)
    if a.compare:
        return compare(a.compare)
    rows = [run_preset(a.api, p, a.tokens, a.reps) for p in a.presets.split(",")]
    if a.emulated:
        rows.append(run_emulated(a.api, "qwen3.5-397b", a.tokens, a.emulated, 3))
    for r in rows:
        print(json.dumps(r), flush=True)
    if a.out:
        json.dump(dict(api=a.api, rows=rows), open(a.out, "w"), indent=1)


if __name__ == "__main__":
    sys.exit(main())
