"""Where the backward's time goes: every launch group of ``mok_comm.backward`` timed alone.

    python benchmarks/probes/probe_backward.py --preset qwen3.5-397b --tokens 4096
    python benchmarks/probes/probe_backward.py --precision fp8     # the FP8 layer's
    python benchmarks/probes/probe_backward.py --precision bf16,fp8,fp8w --tokens 4096,8192

One GPU, EP 1 (``mok_torch.Layer`` on a local heap). Each call of the backward's phases (and
the barriers between them) runs between CUDA events after one forward; median over --iters,
then a table of ms per call, largest first. Then what the backward costs the forward: its
gate/up GEMMs (routed, shared) saving the FP32 pre-activations the backward reads, against
the same launches of a forward-only layer. ``--precision fp8``: the layer in
``MoKConfig(precision="fp8")`` (its routed weights quantised once, ``Layer.with_fp8``; the
data gradients' calls include their quantisations; its weight gradients in FP8 where that
pays, ``fp8_wgrad=None``); ``fp8b`` with ``fp8_wgrad=False``, ``fp8w`` with ``True`` (the
weight gradients' calls include theirs, ``wgrad_rows`` their layout). Several precisions and
token counts: a table each, one layer at a time (EP 1 at 2T tokens gives each expert EP 2's
rows at T). ``--main-grad``: the six weight gradients added into FP32 buffers
(``accumulate=True``, what ``MoEBlock(main_grad=True)`` runs every backward) instead of
written in bf16. ``--kernels``: then each kernel's device time in one forward + backward
(torch's profiler; the median of --iters steps, kernels of one name summed within a step):
the split of a launch group (a quantiser, a gather, a GEMM). A probe: it prints, it does not
write results.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3.5-397b")
    ap.add_argument("--tokens", default="4096", help="','-separated")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--precision", default="bf16", help="','-separated: bf16, fp8, fp8b, fp8w")
    ap.add_argument("--main-grad", action="store_true",
                    help="weight gradients accumulated into FP32 buffers")
    ap.add_argument("--wgrad-tiles", default="",
                    help="';'-separated bm,bn,bk,wm,wn,stages[,blocks_per_sm,max_registers"
                         "[,mma]] of the weight-gradient GEMMs (mma: mma_sync, the default, "
                         "or wgmma, e.g. 128,256,64,2,1,4,1,0,wgmma): one table each")
    ap.add_argument("--kernels", action="store_true",
                    help="each kernel's device time in a forward + backward (profiler)")
    args = ap.parse_args(argv)
    import gc

    import torch
    from numba import cuda as numba_cuda

    import mok_torch
    from mok_core.config import MoKConfig, preset
    from mok_testing import synthetic
    from mok_core.gemm import GemmConfig
    configs = {"bf16": MoKConfig(), "fp8": MoKConfig(precision="fp8"),
               "fp8b": MoKConfig(precision="fp8", fp8_wgrad=False),
               "fp8w": MoKConfig(precision="fp8", fp8_wgrad=True)}
    shape, dev = preset(args.preset, 1), "cuda"
    W = mok_torch.Weights(*synthetic.shared_weights(shape, dev),
                          *synthetic.local_expert_weights(shape, 0, dev))
    for T in map(int, args.tokens.split(",")):
        x, ids, w = synthetic.rank_inputs(shape, T, 0, dev)
        d_out = torch.randn(T, shape.hidden, device=dev).bfloat16()
        for precision in args.precision.split(","):
            layer = mok_torch.Layer(shape, T, configs[precision])
            try:
                for tiles in args.wgrad_tiles.split(";") if args.wgrad_tiles else [""]:
                    if tiles:
                        fields = tiles.split(",")
                        layer.wgrad_gemm = GemmConfig(*map(int, fields[:8]), *fields[8:])
                    _time_backward(args, precision, layer, x, ids, w, W, d_out)
                if args.kernels:
                    _time_kernels(args, precision, layer, x, ids, w, W, d_out)
                if "," not in args.tokens + args.precision:
                    _time_gate_up(args, layer, W)
            finally:                     # this layer's memory back before the next one's
                torch.cuda.synchronize()
                layer.comm.free()
                del layer
                gc.collect()
                numba_cuda.current_context().deallocations.clear()
                torch.cuda.empty_cache()


def _time_kernels(args, precision, layer, x, ids, w, W, d_out):
    """Each kernel's device time in one forward + backward, in launch order, the median over
    --iters steps."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.common import kernel_name
    steps = []
    for _ in range(args.iters + 1):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            ctx = layer.forward(x, ids, w, W)[1]
            layer.backward(ctx, d_out, w, W)
            torch.cuda.synchronize()
        evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        evs.sort(key=lambda e: e.time_range.start)
        steps.append([(kernel_name(e.name), e.device_time_total / 1e3) for e in evs])
    steps = [st for st in steps[1:] if len(st) == len(steps[1])]
    print(f"{args.preset} T={layer.tokens_per_rank} EP 1 {precision}: the kernels of a forward "
          f"+ backward in launch order (ms, median of {len(steps)})")
    total = 0.0
    for i, (name, _) in enumerate(steps[0]):
        ms = statistics.median(st[i][1] for st in steps)
        total += ms
        if ms >= 0.01:
            print(f"  {i:3d} {name:44s} {ms:8.3f}")
    print(f"  {'':3s} {'sum':44s} {total:8.3f}")


def _time_gate_up(args, layer, W):
    """The forward's gate/up launches after the last step, saving g and u (``layer.grad``
    set, as the forward runs them) or not (``layer.grad`` None for the measurement: a
    forward-only layer's launches); median ms over --iters."""
    import torch

    from benchmarks.common import numba_stream
    from mok_comm import functional as F
    from mok_torch.layer import weight_views
    s = numba_stream()
    Wc = F.check_weights(layer, weight_views(layer, layer.with_fp8(W)))
    calls = [("routed_gate_up", F.routed_gate_up)]
    if layer.shape.shared_intermediate:
        calls.insert(0, ("shared_gate_up", F.shared_gate_up))
    grad = layer.grad
    print(f"forward gate/up ({layer.gemm}), saving g and u for the backward vs not")
    try:
        for label, g in (("saving g, u", grad), ("forward-only", None)):
            layer.grad = g
            for name, call in calls:
                ms = []
                for _ in range(args.iters + 1):
                    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
                    ev[0].record()
                    call(layer, Wc, s)
                    ev[1].record()
                    torch.cuda.synchronize()
                    ms.append(ev[0].elapsed_time(ev[1]))
                print(f"  {name:16s} {label:12s} {statistics.median(ms[1:]):8.3f} ms")
    finally:
        layer.grad = grad
    layer.check()


def _time_backward(args, precision, layer, x, ids, w, W, d_out):
    import torch

    from benchmarks.common import numba_stream
    from mok_comm import backward as B
    from mok_comm.barrier import barrier
    from mok_torch.layer import tensor_view, weight_views
    T = layer.tokens_per_rank
    ctx = layer.forward(x, ids, w, W)[1]
    grads = layer.backward(ctx, d_out, w, W)
    if args.main_grad:                   # FP32 weight gradients, added to (main-grad)
        grads = B.Grads(*(g if g is None or n in ("d_x", "d_router_weights")
                          else torch.zeros(g.shape, dtype=torch.float32, device=g.device)
                          for g, n in zip(grads, B.Grads._fields)))
    s = numba_stream()
    views = B.Grads(*(None if g is None else tensor_view(g, n, (torch.bfloat16, torch.float32))
                      for g, n in zip(grads, B.Grads._fields)))
    phases, _ = B.backward_phases(layer, ctx, tensor_view(d_out, "d_out"),
                                  tensor_view(w, "w", (torch.float32,)),
                                  weight_views(layer, layer.with_fp8(W)),
                                  grads=views, accumulate=args.main_grad, stream=s)
    calls = []
    for i, phase in enumerate(phases):
        if i:
            calls.append(("barrier", lambda: barrier(layer.comm, s)))
        for c in phase:                  # a name's first call is the shared expert's
            name, n = c.func.__name__, 2
            while name in dict(calls):
                name, n = f"{c.func.__name__} {n}", n + 1
            calls.append((name, c))
    times = {n: [] for n, _ in calls}
    for _ in range(args.iters + 1):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(len(calls) + 1)]
        ev[0].record()
        for j, (_, c) in enumerate(calls):
            c()
            ev[j + 1].record()
        torch.cuda.synchronize()
        for j, (n, _) in enumerate(calls):
            times[n].append(ev[j].elapsed_time(ev[j + 1]))
    layer.check()
    med = {n: statistics.median(v[1:]) for n, v in times.items()}
    print(f"{args.preset} T={T} EP 1 {precision} (fp8_wgrad {layer.fp8_wgrad})"
          f"{' main-grad' if args.main_grad else ''}, "
          f"backward tiles {layer.backward_gemm}, dgrad "
          f"{layer.dgrad_gemm}, wgrad {layer.wgrad_gemm} (a name's first "
          "entry is the shared expert's, ' 2' the routed experts')")
    for n, ms in sorted(med.items(), key=lambda kv: -kv[1]):
        print(f"  {n:24s} {ms:8.3f} ms")
    print(f"  {'sum':24s} {sum(med.values()):8.3f} ms")


if __name__ == "__main__":
    main()
