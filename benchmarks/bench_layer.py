"""Whole layer, forward and backward: MoK-Py vs torch-native EP (torchtitan style), same run,
plus the floors.

    torchrun --standalone --nproc-per-node=2 benchmarks/bench_layer.py [--presets ...]
             [--tokens 2048,4096,8192] [--iters 30] [--out benchmarks/results/bench_layer.json]

Baselines: torch_native (NCCL all_to_all_single, host-synced splits) and, where this torch has
it, torch_symm_mem (the same forward over symmetric-memory all_to_all_vdev, splits on device);
a baseline that is unavailable or fails its check gets a line in "baseline_notes", not a time.

Per preset and tokens/rank: each implementation is first checked against float64 on sampled
tokens (rel-L1 <= 0.005 ours, 0.01 baselines), then timed: per iteration (routing all-gather +
schedule + forward for ours; the whole forward for a baseline) CUDA events, max over ranks,
median over iterations after warm-up. ``ours_ms`` is the eager step (``mok_torch.Layer``:
``layer(x, ids, w, weights)``); ``ours_step_ms`` the same step through ``layer.compile(weights)``
(eager prologue / epilogue around a CUDA-graph replay of the core, fresh inputs allowed; checked
bitwise against eager first), with ``speedup_step_vs_best_baseline``. Floor = max(FLOPs / dense
cuBLAS rate, NVLink bytes / peer-copy rate), both rates measured in this run; NVLink bytes =
deduplicated dispatch + combine rows that cross GPUs (from our schedule). The floor leaves out
that every weight of an expert with rows must come from HBM once per step (at small rows per
expert the GEMMs stream weights): ``floor_hbm_ms`` = those bytes (this rank's experts that got
rows, and the shared expert) / the HBM rate of a local device copy measured in this run (bytes
read + written / time), and ``step_over_roofline`` = compiled step / max(floor_ms,
floor_hbm_ms). ``--precision bf16,fp8`` adds the FP8 layer (``fp8_case``: its compiled step
and ours in bf16 in turns, ``fp8_fwd_speedup_vs_bf16``; ``fp8_rel_l1`` / ``fp8_cosine``
against the float64 bf16 reference on the sampled tokens; with the backward also both
forward+backward in turns, ``fwd_bwd_speedup_vs_bf16``, and as CUDA-graph replays in turns,
``fwd_bwd_graph_speedup_vs_bf16``; the FP8 gradients' rel-L1 and ``cosine_min``, the smallest
cosine of the output and the 8 gradients).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (gpu_name, progress, rank_max_median, table,  # noqa: E402
                               time_iters, write_json)


def ceilings():
    """Dense bf16 cuBLAS TFLOP/s, NVLink peer-copy GB/s (pull) and HBM GB/s (a local device
    copy: bytes read + written), measured now."""
    import nvshmem.core as nvs
    import torch
    import torch.distributed as dist
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = sorted(time_iters(lambda: a @ b, 10, 3))[5]
    tflops = 2 * 8192 ** 3 / ms / 1e9
    src = nvs.tensor((16384, 7168), dtype=torch.bfloat16)
    src.normal_()
    dst = torch.empty_like(src)
    peer = nvs.get_peer_tensor(src, (dist.get_rank() + 1) % dist.get_world_size())
    torch.cuda.synchronize()
    dist.barrier()
    ms = rank_max_median(time_iters(lambda: dst.copy_(peer), 10, 3))
    gbps = src.numel() * 2 / ms / 1e6
    local = torch.empty_like(dst)
    ms = rank_max_median(time_iters(lambda: local.copy_(dst), 10, 3))
    hbm_gbps = 2 * local.numel() * 2 / ms / 1e6
    torch.cuda.synchronize()
    dist.barrier()
    nvs.free_tensor(src)
    return tflops, gbps, hbm_gbps


def check(out, x, ids, w, shared, shape, pick, dev):
    from mok_testing import synthetic
    from mok_testing.sampled import reference_tokens
    ref = reference_tokens(x[pick], ids[pick], w[pick], shared,
                           lambda e: synthetic.expert_weights(shape, e, dev))
    return float((out[pick].double() - ref).abs().sum() / ref.abs().sum())


def symm_mem_baseline(shared, wg, wu, wd, T, shape, x, ids, w, pick, dev):
    """(TorchSymmMemEP or None, rel-L1, note): built and checked like torch_native; any failure
    becomes the note, and all ranks agree before anyone times it."""
    import torch
    import torch.distributed as dist

    from benchmarks.baselines import torch_symm_mem as tsm
    base, err = None, float("nan")
    ok, note = tsm.available()
    if ok:
        try:
            base = tsm.TorchSymmMemEP(*shared, wg, wu, wd, tokens=T, topk=shape.topk)
            err = check(base.forward(x, ids, w), x, ids, w, shared, shape, pick, dev)
            ok = err < 1e-2
            note = "" if ok else f"fails the correctness gate (rel-L1 {err:.2e})"
        except Exception as e:                  # noqa: BLE001 - recorded, not fatal
            ok, note = False, f"{type(e).__name__}: {e}"
    agree = torch.tensor([int(ok)], device=dev)
    dist.all_reduce(agree, op=dist.ReduceOp.MIN)
    if not agree.item():
        return None, err, note or "failed on another rank"
    syncs = tsm.count_host_syncs(lambda: base.forward(x, ids, w))
    return base, err, f"{syncs} host syncs seen by torch's sync-debug mode in one forward"


def step_breakdown(layer, ids, x, w, weights, iters):
    """{step: ms}: every launch group of our layer timed alone with CUDA events (routing
    all-gather, barriers, schedule, publish x, shared FFN, dispatch, routed GEMMs, combine,
    epilogue), median over ``iters``, max over ranks. Barriers include waiting for the slower
    rank, so they show imbalance too."""
    import statistics
    from functools import partial

    import torch
    import torch.distributed as dist

    from benchmarks.common import numba_stream
    from mok_comm import functional as F
    from mok_comm.barrier import barrier
    from mok_torch.layer import tensor_view, weight_views
    s = numba_stream()
    phases, _ = F.step_phases(layer, tensor_view(x, "x"), ids, w, weight_views(layer, weights),
                              stream=s)
    steps = []                                       # the phases with the barriers between
    for i, phase in enumerate(phases):
        if i:
            steps.append(("barrier", partial(barrier, layer.comm, s)))
        steps += [(call.func.__name__.replace("_", " "), call) for call in phase]
    samples = [[] for _ in steps]
    for it in range(iters + 2):
        dist.barrier()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(len(steps) + 1)]
        ev[0].record()
        for j, (_, fn) in enumerate(steps):
            fn()
            ev[j + 1].record()
        torch.cuda.synchronize()
        if it >= 2:                                  # 2 warm-up rounds
            for j in range(len(steps)):
                samples[j].append(ev[j].elapsed_time(ev[j + 1]))
    med = torch.tensor([statistics.median(x) for x in samples], device="cuda")
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    out = {}
    for (label, _), ms in zip(steps, med.tolist()):
        key, n = label, 2
        while key in out:                            # barrier, barrier 2, ...
            key, n = f"{label} {n}", n + 1
        out[key] = ms
    return out


def grad_case(shape, T, dev):
    """Every rank's d_out [T, H] (seeded by rank), inputs (``synthetic.rank_inputs``) and
    expert-weight function: what ``grad_errors`` checks a rank's gradients with."""
    import torch
    import torch.distributed as dist

    from mok_testing import synthetic
    R = dist.get_world_size()
    d_outs = [torch.randn(T, shape.hidden, device=dev,
                          generator=torch.Generator(dev).manual_seed(100 + r)).bfloat16()
              for r in range(R)]
    inputs = [synthetic.rank_inputs(shape, T, r, dev, skew=0.0) for r in range(R)]
    return d_outs, inputs, (lambda e: synthetic.expert_weights(shape, e, dev))


def backward_case(layer, base, shape, T, x, ids, w, weights, iters, warmup, rates, nvl_bytes,
                  weight_bytes, flops):
    """Backward columns of one case: ours (``layer.backward`` after ``layer.forward``) and the
    baseline's torch autograd (``TorchNativeEP.trainable``), each implementation's 8 gradients
    checked against float64 first (``mok_testing.sampled.grad_errors``: rel-L1 <= 0.005 ours,
    0.01 the baseline), then forward and forward+backward of both timed in turns
    (``time_interleaved``); backward = forward+backward - forward (medians, max over ranks;
    the baseline's forward records its autograd graph, as in training). Floor = max(dgrad +
    wgrad FLOPs (twice the forward's) at the dense rate, the reverse NVLink bytes (the
    forward's) at the peer rate, every weight read and its gradient written once at the HBM
    rate)."""
    import statistics

    import torch
    import torch.distributed as dist

    from benchmarks.common import time_interleaved
    from mok_testing.sampled import grad_errors
    me = dist.get_rank()
    dev = x.device
    d_outs, inputs, fn = grad_case(shape, T, dev)
    d_out = d_outs[me]
    shared = weights[:3] if shape.shared_intermediate else None
    grads = layer.backward(layer.forward(x, ids, w, weights)[1], d_out, w, weights)
    err_ours = max(grad_errors(inputs, d_outs, me, grads, shared, fn,
                               shape.experts_per_rank).values())
    base.trainable()
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()

    def base_fwd():
        base.zero_grad()
        xl.grad = wl.grad = None
        return base.forward(xl, ids, wl)

    base_fwd().backward(d_out)
    err_base = max(grad_errors(inputs, d_outs, me, base.grads(xl, wl), shared, fn,
                               shape.experts_per_rank).values())
    for label, err, tol in (("ours", err_ours, 5e-3), ("torch_native", err_base, 1e-2)):
        if not err < tol:
            raise RuntimeError(f"{shape} T={T}: {label} gradients fail the correctness gate "
                               f"(max rel-L1 {err:.2e})")

    def ours_fwd():
        return layer.forward(x, ids, w, weights)

    def ours_fwd_bwd():
        layer.backward(ours_fwd()[1], d_out, w, weights, grads=grads)

    dist.barrier()
    t = time_interleaved({"ours_fwd": ours_fwd, "ours_fwd_bwd": ours_fwd_bwd,
                          "base_fwd": base_fwd, "base_fwd_bwd": lambda: base_fwd().backward(d_out)},
                         iters, warmup, pre=dist.barrier)
    med = torch.tensor([statistics.median(t[n]) for n in
                        ("ours_fwd", "ours_fwd_bwd", "base_fwd", "base_fwd_bwd")], device=dev)
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    o_f, o_fb, b_f, b_fb = med.tolist()
    layer.check()
    tflops, gbps, hbm_gbps = rates
    floor = max(2 * flops / tflops / 1e9, nvl_bytes / gbps / 1e6,
                2 * weight_bytes / hbm_gbps / 1e6)
    return {"fwd_bwd_ms": o_fb, "fwd_bwd_baseline_ms": b_fb, "fwd_bwd_speedup": b_fb / o_fb,
            "bwd_ms": o_fb - o_f, "bwd_baseline_ms": b_fb - b_f,
            "bwd_speedup": (b_fb - b_f) / (o_fb - o_f), "bwd_floor_ms": floor,
            "bwd_over_floor": (o_fb - o_f) / floor, "grads_rel_l1_max": err_ours,
            "baseline_grads_rel_l1_max": err_base}


def graph_time(step, iters, warmup):
    """Median (max over ranks) ms of replaying a CUDA graph of ``step`` (schedule + forward):
    the layer without Python launch overhead, as a captured training step runs it."""
    import torch.distributed as dist

    from benchmarks.common import capture_graph
    graph, _ = capture_graph(step)
    dist.barrier()
    return rank_max_median(time_iters(graph.replay, iters, warmup))


def fp8_case(shape, T, cfg, gemm, gemm_down, x, ids, w, weights, shared, pick, dev,
             bf16_layer, bf16_step, iters, warmup, backward, fp8_wgrad=None,
             breakdown=False):
    """The FP8 columns (``--precision bf16,fp8``): a second layer with
    ``MoKConfig(precision="fp8")`` on the same inputs, the routed weights quantised once
    (``mok_torch.quantize_weights``); accuracy on the sampled tokens against the float64 bf16
    reference (rel-L1 and cosine), then its compiled step and the bf16 one timed in turns;
    with ``backward`` also ``fp8_backward``'s columns. ``fp8_wgrad``: that layer's
    ``MoKConfig.fp8_wgrad`` (None, the default: where it pays; True: ``--precision bf16,fp8w``,
    False: ``bf16,fp8b``; the ``fp8_wgrad`` column says what ran). ``breakdown``: its forward's launch
    groups timed alone too (``fp8_breakdown_ms``, as ``breakdown_ms``)."""
    import dataclasses

    import torch

    import mok_torch
    from benchmarks.common import time_interleaved
    from mok_testing import synthetic
    from mok_testing.sampled import reference_tokens
    layer = mok_torch.Layer(shape, T, dataclasses.replace(cfg, precision="fp8",
                                                          fp8_wgrad=fp8_wgrad),
                            gemm=gemm, gemm_down=gemm_down, backward=backward)
    try:
        w8 = mok_torch.WeightsFP8(*weights, mok_torch.quantize_weights(weights,
                                                                       backward=backward))
        out = layer(x, ids, w, w8)
        ref = reference_tokens(x[pick], ids[pick], w[pick], shared,
                               lambda e: synthetic.expert_weights(shape, e, dev))
        got = out[pick].double()
        rel = float((got - ref).abs().sum() / ref.abs().sum())
        cos = float((got * ref).sum() / (got.norm() * ref.norm()))
        step = layer.compile(w8)
        if not all(torch.equal(o, out) for o in [step(x, ids, w), step(x, ids, w)]):
            raise RuntimeError("the FP8 compiled step differs from its eager step")
        t = time_interleaved({"bf16": bf16_step, "fp8": lambda: step(x, ids, w)}, iters, warmup)
        t_bf16, t_fp8 = rank_max_median(t["bf16"]), rank_max_median(t["fp8"])
        row = {"fp8_wgrad": layer.fp8_wgrad, "fp8_step_ms": t_fp8, "fp8_bf16_step_ms": t_bf16,
               "fp8_fwd_speedup_vs_bf16": t_bf16 / t_fp8, "fp8_rel_l1": rel,
               "fp8_cosine": cos, "cosine_min": cos}
        if breakdown:
            row["fp8_breakdown_ms"] = step_breakdown(layer, ids, x, w, w8, 10)
        if backward:
            step = None                     # (its graph holds the layer's buffers)
            row.update(fp8_backward(layer, w8, bf16_layer, shape, T, x, ids, w, weights,
                                    shared, dev, iters, warmup))
            row["cosine_min"] = min(cos, row.pop("fp8_grads_cosine_min"))
        layer.check()
        return row
    finally:
        torch.cuda.synchronize()
        layer.comm.free()


def fp8_backward(layer8, w8, layer, shape, T, x, ids, w, weights, shared, dev, iters, warmup):
    """The FP8 layer's backward against ours in bf16: its 8 gradients checked against float64
    (rel-L1 and cosine on the samples of ``grad_errors``), then forward+backward of both timed
    in turns (eager, as ``backward_case``: ``fwd_bwd_speedup_vs_bf16``), then again as CUDA-graph
    replays of the two (the device's time alone: ``fwd_bwd_graph_speedup_vs_bf16``), all
    writing one set of gradient buffers."""
    import statistics

    import torch
    import torch.distributed as dist

    from benchmarks.common import capture_graph, time_interleaved
    from mok_testing.sampled import grad_errors
    me = dist.get_rank()
    d_outs, inputs, fn = grad_case(shape, T, dev)
    d_out = d_outs[me]
    grads = layer.backward(layer.forward(x, ids, w, weights)[1], d_out, w, weights)
    layer8.backward(layer8.forward(x, ids, w, w8)[1], d_out, w, w8, grads=grads)
    errs = {m: grad_errors(inputs, d_outs, me, grads, shared, fn, shape.experts_per_rank,
                           measure=m) for m in ("rel_l1", "cosine")}
    steps = {
        "bf16": lambda: layer.backward(layer.forward(x, ids, w, weights)[1], d_out, w, weights,
                                       grads=grads),
        "fp8": lambda: layer8.backward(layer8.forward(x, ids, w, w8)[1], d_out, w, w8,
                                       grads=grads)}

    def medians(fns):                    # (bf16, fp8): per rank the median, then the max
        t = time_interleaved(fns, iters, warmup, pre=dist.barrier)
        med = torch.tensor([statistics.median(t[n]) for n in ("bf16", "fp8")], device=dev)
        dist.all_reduce(med, op=dist.ReduceOp.MAX)
        return med.tolist()

    t_bf16, t_fp8 = medians(steps)
    row = {"fp8_fwd_bwd_ms": t_fp8, "fp8_bf16_fwd_bwd_ms": t_bf16,
           "fwd_bwd_speedup_vs_bf16": t_bf16 / t_fp8,
           "fp8_grads_rel_l1_max": max(errs["rel_l1"].values()),
           "fp8_grads_cosine_min": min(errs["cosine"].values())}
    # the same two as CUDA-graph replays: the device's time, without the host's launches
    try:
        graphs = {n: capture_graph(fn)[0] for n, fn in steps.items()}
        g_bf16, g_fp8 = medians({n: g.replay for n, g in graphs.items()})
        row.update(fp8_fwd_bwd_graph_ms=g_fp8, fp8_bf16_fwd_bwd_graph_ms=g_bf16,
                   fwd_bwd_graph_speedup_vs_bf16=g_bf16 / g_fp8)
    except Exception as e:                  # noqa: BLE001 - the eager times stand without it
        progress(f"  forward+backward CUDA-graph timing failed: {type(e).__name__}: {e}")
    return row


def run_case(name, T, iters, warmup, rates, gemm, symm_mem=False, breakdown=False,
             graph=False, gemm_down=None, dispatch="pull", backward=True, precisions=("bf16",)):
    import torch
    import torch.distributed as dist

    import mok_torch
    from mok_testing.torch_native import TorchNativeEP
    from mok_core.config import MoKConfig, preset
    from mok_testing import synthetic
    R, me = dist.get_world_size(), dist.get_rank()
    shape = preset(name, ep_size=R)
    dev = torch.device("cuda", torch.cuda.current_device())
    if gemm is None:                       # what mok_torch.Layer would pick for this shape
        from mok_comm.layer import layer_gemm
        gemm = layer_gemm(shape, T)
    gemm_down = gemm_down or gemm
    mode, _, share = dispatch.partition(":")          # e.g. "split:1.0" = ce share 1.0
    if share and mode != "split":
        raise ValueError(f"--dispatch {dispatch}: only split takes a share")
    cfg = MoKConfig(row_align=max(64, gemm.row_unit, gemm_down.row_unit), dispatch=mode,
                    **({"dispatch_ce_share": float(share)} if share else {}))
    x, ids, w = synthetic.rank_inputs(shape, T, me, dev, skew=0.0)
    wg, wu, wd = synthetic.local_expert_weights(shape, me, dev)
    shared = synthetic.shared_weights(shape, dev)
    pick = torch.linspace(0, T - 1, 16, device=dev).long()
    weights = mok_torch.Weights(*shared, wg, wu, wd)
    layer = mok_torch.Layer(shape, T, cfg, gemm=gemm, gemm_down=gemm_down)
    step = None
    try:
        def ours():
            return layer(x, ids, w, weights)

        out_eager = ours()
        err_ours = check(out_eager, x, ids, w, shared, shape, pick, dev)
        step = layer.compile(weights)

        def ours_step():
            return step(x, ids, w)

        # the first call runs the core eagerly and captures it; the second replays the graph
        if not all(torch.equal(o, out_eager) for o in [ours_step(), ours_step()]):
            raise RuntimeError(f"{name} T={T}: the compiled step differs from the eager one")
        base = TorchNativeEP(*shared, wg, wu, wd)
        err_base = check(base.forward(x, ids, w), x, ids, w, shared, shape, pick, dev)
        # Ours must meet the layer's bf16 bar (5e-3); the baseline rounds gate/up and SwiGLU to
        # bf16 between its ops, so it gets MoK's own bf16 tolerance (1e-2).
        for label, err, tol in (("ours", err_ours, 5e-3), ("torch_native", err_base, 1e-2)):
            if not err < tol:
                raise RuntimeError(f"{name} T={T}: {label} fails the correctness gate "
                                   f"(rel-L1 {err:.2e})")
        symm, err_symm, note = None, None, "not run (opt-in: --symm-mem)"
        if symm_mem:
            symm, err_symm, note = symm_mem_baseline(shared, wg, wu, wd, T, shape, x, ids, w,
                                                     pick, dev)
        dist.barrier()
        t_ours = rank_max_median(time_iters(ours, iters, warmup))
        dist.barrier()
        t_step = rank_max_median(time_iters(ours_step, iters, warmup))
        t_graph = float("nan")
        if graph:
            try:
                t_graph = graph_time(ours, iters, warmup)
            except Exception as e:                  # noqa: BLE001 - diagnostics only
                progress(f"  CUDA-graph timing failed: {type(e).__name__}: {e}")
        times = {}
        for label, b in (("torch_native", base), ("torch_symm_mem", symm)):
            if b is not None:
                dist.barrier()
                times[label] = rank_max_median(time_iters(lambda: b.forward(x, ids, w), iters,
                                                          warmup))
        steps = {}
        if breakdown:
            try:
                steps = step_breakdown(layer, ids, x, w, weights, 10)
            except Exception as e:                  # noqa: BLE001 - diagnostics only
                progress(f"  breakdown failed: {type(e).__name__}: {e}")
        layer.check()
        # Floor from this rank's actual routed work and NVLink bytes.
        sc = layer.schedule.to_host()
        n = int(sc["num_rows"][0])
        real = sc["src_rank"][:n] >= 0
        remote = real & (sc["src_rank"][:n] != me)
        tokens = len({(int(r), int(t)) for r, t in zip(sc["src_rank"][:n][remote],
                                                       sc["src_token"][:n][remote])})
        nvl_bytes = (tokens + int(remote.sum())) * shape.hidden * 2
        flops = 6.0 * int(real.sum()) * shape.hidden * shape.intermediate \
            + shape.shared_flops(T)
        tflops, gbps, hbm_gbps = rates
        floor = max(flops / tflops / 1e9, nvl_bytes / gbps / 1e6)
        experts = int((sc["expert_counts"] > 0).sum())
        weight_bytes = 2 * 3 * shape.hidden * (experts * shape.intermediate
                                               + shape.shared_intermediate)
        floor_hbm = weight_bytes / hbm_gbps / 1e6
        floors = torch.tensor([floor, floor_hbm], dtype=torch.float64, device="cuda")
        dist.all_reduce(floors, op=dist.ReduceOp.MAX)
        floor, floor_hbm = float(floors[0]), float(floors[1])
        fp8 = {}
        modes = {"fp8": None, "fp8w": True, "fp8b": False}
        mode = [m for m in modes if m in precisions]
        if mode:
            try:
                fp8 = fp8_case(shape, T, cfg, gemm, gemm_down, x, ids, w, weights, shared, pick,
                               dev, layer, ours_step, iters, warmup, backward,
                               fp8_wgrad=modes[mode[0]], breakdown=breakdown)
            except Exception as e:                  # noqa: BLE001 - recorded in the row
                torch.cuda.synchronize()
                fp8 = {"fp8_note": f"{type(e).__name__}: {e}"[:300]}
                progress(f"  fp8 failed: {fp8['fp8_note']}")
            if me == 0:                             # (before the backward: a run cut short
                progress("  fp8: " + ", ".join(     # by its time limit still shows it)
                    f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                    for k, v in fp8.items()))
        bwd = {}
        if backward:
            try:
                bwd = backward_case(layer, base, shape, T, x, ids, w, weights, iters, warmup,
                                    rates, nvl_bytes, weight_bytes, flops)
            except Exception as e:                  # noqa: BLE001 - recorded in the row
                torch.cuda.synchronize()
                bwd = {"bwd_note": f"{type(e).__name__}: {e}"[:300]}
                progress(f"  backward failed: {bwd['bwd_note']}")
    finally:
        torch.cuda.synchronize()
        step = None                              # its graph references the layer's buffers
        layer.comm.free()
    return {"preset": name, "tokens_per_rank": T, "ep": R, "dispatch": dispatch,
            "ours_ms": t_ours,
            "ours_step_ms": t_step, "ours_graph_ms": t_graph,
            "baselines": times, "baseline_notes": {"torch_symm_mem": note}, "floor_ms": floor,
            "speedup_vs_best_baseline": min(times.values()) / t_ours,
            "speedup_step_vs_best_baseline": min(times.values()) / t_step,
            "ours_over_floor": t_ours / floor, "floor_hbm_ms": floor_hbm,
            "step_over_roofline": t_step / max(floor, floor_hbm), "ours_rel_l1": err_ours,
            "baseline_rel_l1": err_base, "symm_mem_rel_l1": err_symm, "gpu": gpu_name(),
            "gemm": str(gemm), "gemm_down": str(gemm_down), "breakdown_ms": steps, **fp8,
            **bwd}


BASELINE_LABELS = {"torch_native": "torch native EP", "torch_symm_mem": "torch symm-mem EP"}


def baseline_names(rows):
    return [b for b in BASELINE_LABELS if any(b in r["baselines"] for r in rows)]


def plot(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    labels = [f"{r['preset']}\nT={r['tokens_per_rank']}" for r in rows]
    bars = [("MoK-Py", [r["ours_ms"] for r in rows]),
            ("MoK-Py compiled step", [r.get("ours_step_ms", 0.0) for r in rows])]
    bars += [(BASELINE_LABELS[b], [r["baselines"].get(b, 0.0) for r in rows])
             for b in baseline_names(rows)]
    bars.append(("floor", [r["floor_ms"] for r in rows]))
    bars.append(("HBM floor (weights once)", [r.get("floor_hbm_ms", 0.0) for r in rows]))
    width = 0.8 / len(bars)
    fig, ax = plt.subplots(figsize=(max(6, 0.45 * len(bars) * len(rows)), 4))
    for j, (label, ys) in enumerate(bars):
        ax.bar([i + (j - (len(bars) - 1) / 2) * width for i in range(len(rows))], ys, width,
               label=label)
    ax.set_xticks(list(range(len(rows))), labels, fontsize=7)
    ax.set_ylabel("forward ms (max over ranks, median)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="kimi-k2.7,glm-5.2,qwen3.5-397b,deepseek-v4-pro")
    ap.add_argument("--tokens", default="2048,4096,8192")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--gemm-from", default="",
                    help="bench_ffn sweep JSON: use its fastest GEMM config per preset")
    ap.add_argument("--gemm-per-gemm", action="store_true",
                    help="with --gemm-from: the fastest gate_up and down tiles of each (preset, "
                         "T) the sweep covered, apart (mok_torch.Layer's gemm / gemm_down)")
    ap.add_argument("--symm-mem", action="store_true",
                    help="also run the torch symmetric-memory (NVSHMEM all_to_all_vdev) baseline "
                         "(opt-in until it has run on our GPU host: torch's NVSHMEM beside ours)")
    ap.add_argument("--graph", action="store_true",
                    help="also time our layer as a CUDA-graph replay (ours_graph_ms)")
    ap.add_argument("--breakdown", action="store_true",
                    help="also time each launch group of our forward alone (breakdown_ms; "
                         "with --precision bf16,fp8 the FP8 layer's too: fp8_breakdown_ms)")
    ap.add_argument("--dispatch", default="split:1.0",
                    help="MoKConfig.dispatch modes to run each case with (comma-separated: "
                         "pull,split; split:S sets dispatch_ce_share=S)")
    ap.add_argument("--no-backward", action="store_true",
                    help="forward only (skip the backward and forward+backward columns)")
    ap.add_argument("--precision", default="bf16",
                    help="bf16, or bf16,fp8: also the FP8 layer (MoKConfig(precision='fp8'))"
                         " in turns with ours in bf16: fp8_* columns; bf16,fp8w / bf16,fp8b: "
                         "that layer with fp8_wgrad=True / False instead of None (where it "
                         "pays; the fp8_wgrad column says what ran)")
    ap.add_argument("--out", default="benchmarks/results/bench_layer.json")
    args = ap.parse_args(argv)
    gemm_of = {}                                 # preset -> tiles from a bench_ffn sweep
    pair_of = {}                                 # (preset, T) -> (gate_up, down) tiles
    if args.gemm_from and os.path.exists(args.gemm_from):
        import json

        from benchmarks.bench_ffn import fastest_per_gemm, fastest_per_preset
        trial = json.load(open(args.gemm_from))
        if args.gemm_per_gemm:
            pair_of = fastest_per_gemm(trial)
        else:
            gemm_of = fastest_per_preset(trial)
    from benchmarks.common import init_distributed
    from mok_comm.launch import bootstrap
    dist = init_distributed()
    rates = ceilings()
    rank0 = dist.get_rank() == 0
    if rank0:
        progress(f"GEMM tiles: {pair_of or gemm_of or 'the library default per shape'}")
        progress(f"ceilings: {rates[0]:.0f} TFLOP/s dense bf16, {rates[1]:.0f} GB/s peer pull, "
                 f"{rates[2]:.0f} GB/s HBM (local copy)")
    rows = []
    for name in args.presets.split(","):
        for T in map(int, args.tokens.split(",")):
            if rank0:
                progress(f"layer {name} T={T}")
            # a preset the sweep covered uses its fastest tiles; else kimi's; else the
            # library's choice for the shape (None)
            tiles = gemm_of.get(name, gemm_of.get("kimi-k2.7"))
            tiles_down = None
            if (name, T) in pair_of:                 # per-GEMM tiles of this (preset, T)
                tiles, tiles_down = pair_of[(name, T)]
            for mode in args.dispatch.split(","):
                rows.append(run_case(name, T, args.iters, args.warmup, rates, tiles,
                                     args.symm_mem, args.breakdown, args.graph, tiles_down,
                                     mode, not args.no_backward,
                                     tuple(args.precision.split(","))))
            if rank0:
                write_json(args.out, rows)           # keep what we have if time runs out
                r = rows[-1]
                base = "  ".join(f"{b} {ms:.2f} ms" for b, ms in r["baselines"].items())
                progress(f"  ours {r['ours_ms']:.2f} ms  compiled step {r['ours_step_ms']:.2f} ms  "
                         f"{base}  floor {r['floor_ms']:.2f} ms (HBM {r['floor_hbm_ms']:.2f})  "
                         f"speedup {r['speedup_vs_best_baseline']:.2f}x "
                         f"(step {r['speedup_step_vs_best_baseline']:.2f}x)  "
                         f"(symm-mem: {r['baseline_notes']['torch_symm_mem']})")
                if "bwd_ms" in r:
                    progress(f"  backward ours {r['bwd_ms']:.2f} ms  torch autograd "
                             f"{r['bwd_baseline_ms']:.2f} ms ({r['bwd_speedup']:.2f}x)  "
                             f"fwd+bwd {r['fwd_bwd_ms']:.2f} vs {r['fwd_bwd_baseline_ms']:.2f} ms "
                             f"({r['fwd_bwd_speedup']:.2f}x)  floor {r['bwd_floor_ms']:.2f} ms  "
                             f"grads rel-L1 {r['grads_rel_l1_max']:.1e}")
                if r["ours_graph_ms"] == r["ours_graph_ms"]:      # not NaN
                    progress(f"  ours as a CUDA-graph replay {r['ours_graph_ms']:.2f} ms")
                for key in ("breakdown_ms", "fp8_breakdown_ms"):
                    if r.get(key):
                        progress(f"  steps{' (fp8)' if key.startswith('fp8') else ''}: "
                                 + ", ".join(f"{k} {v:.3f}" for k, v in r[key].items())
                                 + f" (sum {sum(r[key].values()):.2f} ms)")
    if rank0:
        write_json(args.out, rows)
        plot(rows, args.out.replace(".json", ".png"))
        names = baseline_names(rows)
        flat = [dict(r, **{f"{b}_ms": r["baselines"].get(b) for b in names}) for r in rows]
        print(table(flat, ["preset", "tokens_per_rank", "ep", "dispatch", "ours_ms", "ours_step_ms",
                           "ours_graph_ms", *(f"{b}_ms" for b in names), "floor_ms",
                           "floor_hbm_ms", "speedup_vs_best_baseline",
                           "speedup_step_vs_best_baseline", "ours_over_floor",
                           "step_over_roofline", "bwd_ms", "bwd_baseline_ms", "bwd_speedup",
                           "fwd_bwd_ms", "fwd_bwd_baseline_ms", "fwd_bwd_speedup",
                           "bwd_over_floor", "grads_rel_l1_max"]))
    bootstrap.finalize()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
