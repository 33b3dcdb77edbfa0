"""Shared benchmark helpers: CUDA-event timing, routing generators, result files.

Timing follows DESIGN.md §10: warm up, time each iteration with CUDA events, report the median
(multi-rank benchmarks take the max over ranks per iteration first).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

import numpy as np


def gpu_name() -> str:
    import torch
    return torch.cuda.get_device_name()


def numba_stream():
    """The current torch stream as a numba stream (launch our kernels in torch's order)."""
    import torch
    from numba import cuda
    return cuda.external_stream(torch.cuda.current_stream().cuda_stream)


def init_distributed():
    """This torchrun process on GPU LOCAL_RANK (torch and numba), torch.distributed (gloo +
    NCCL) and NVSHMEM over all processes. Returns ``torch.distributed``; tear down with
    ``mok_comm.launch.bootstrap.finalize()`` then ``destroy_process_group()``."""
    import torch
    import torch.distributed as dist
    from numba import cuda

    from mok_comm.launch import bootstrap
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    cuda.select_device(local)
    dist.init_process_group("cpu:gloo,cuda:nccl", device_id=torch.device("cuda", local))
    bootstrap.init("torch")
    return dist


def kernel_name(name: str) -> str:
    """A profiler kernel name, short: numba's mangled ``_ZN6cudapy..E`` -> module.function
    (a factory's ``kernel``: factory.kernel); a C++ name cut at its template arguments."""
    import re
    if not name.startswith("_ZN"):
        return re.split(r"[<(]", name)[0].replace("void ", "")[-48:]
    parts, i = [], 3
    while i < len(name) and name[i].isdigit():
        j = i
        while name[j].isdigit():
            j += 1
        n = int(name[i:j])
        parts.append(name[j:j + n])
        i = j + n
    parts = [re.sub(r"_\d+B\w*$|\$\d+$", "", q) for q in parts
             if q not in ("cudapy", "_3clocals_3e")]
    return ".".join(parts[-2:])


def comm_setup(tokens, hidden, topk, num_experts, config, stream):
    """The comm protocol on its own (no layer), on the NVSHMEM heap: (heap, workspace,
    schedule sized to the workspace). ``heap.free()`` releases both."""
    from mok_comm.heap import NvshmemHeap
    from mok_comm.workspace import create_workspace
    from mok_core.schedule import Schedule
    heap = NvshmemHeap(stream=stream)
    ws = create_workspace(heap, tokens_per_rank=tokens, hidden=hidden, topk=topk,
                          num_experts=num_experts, config=config, stream=stream)
    sched = Schedule.allocate(rank=ws.rank, ep_size=ws.ep_size, tokens_per_rank=tokens,
                              topk=topk, num_experts=num_experts, config=config,
                              capacity=ws.capacity)
    return heap, ws, sched


def capture_graph(step):
    """(CUDA graph, its output) of ``step()`` on the current torch stream, after one warm-up
    run on a side stream (what torch.cuda.graph needs); replay with ``graph.replay()``."""
    import torch
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


def time_iters(fn, iters=20, warmup=3, pre=None):
    """Per-iteration device times in ms (CUDA events around each call of ``fn``; ``pre`` runs
    untimed before each, e.g. a barrier that lines the ranks up)."""
    import torch
    for _ in range(warmup):
        if pre:
            pre()
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        if pre:
            pre()
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return times


def time_interleaved(fns, iters=20, warmup=3, pre=None):
    """``time_iters`` of several steps taken in turns -- iteration i times every step of
    ``fns`` (name -> callable) once, in order -- so a drift of the machine over the run (clocks,
    a neighbour's load) hits every step alike. Returns name -> per-iteration ms."""
    for _ in range(warmup):
        for fn in fns.values():
            time_iters(fn, 1, 0, pre)
    times = {name: [] for name in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            times[name] += time_iters(fn, 1, 0, pre)
    return times


def rank_max_median(times):
    """Median over iterations of the per-iteration max over ranks (torch.distributed)."""
    import torch
    import torch.distributed as dist
    t = torch.tensor(times, dtype=torch.float64, device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.median())


def gumbel_topk_ids(rng, ranks, tokens, experts, topk):
    """[ranks, tokens, topk] int32: uniform top-k routing (Gumbel top-k, distinct experts)."""
    ids = np.empty((ranks, tokens, topk), np.int32)
    for r in range(ranks):
        g = rng.gumbel(size=(tokens, experts)).astype(np.float32)
        ids[r] = np.argpartition(g, -topk, axis=1)[:, -topk:]
    return ids


def median(xs):
    return float(statistics.median(xs))


def routing_counts(rng, tokens, num_experts, topk, skew: str):
    """Routes per expert for ``tokens`` tokens choosing top-k of ``num_experts``.

    uniform: every expert equally likely; skewed: expert popularity ~ Zipf(1.0) (hot experts
    get several times the average, some get few).
    """
    if skew == "uniform":
        logits = np.zeros(num_experts)
    else:
        logits = -1.0 * np.log(np.arange(1, num_experts + 1))
        logits = rng.permutation(logits)
    g = rng.gumbel(size=(tokens, num_experts)).astype(np.float32) + logits.astype(np.float32)
    ids = np.argpartition(g, -topk, axis=1)[:, -topk:]
    return np.bincount(ids.ravel(), minlength=num_experts), ids


def padded_layout(counts, align):
    padded = -(-counts // align) * align
    off = np.concatenate([[0], np.cumsum(padded)]).astype(np.int32)
    return off


def write_json(path, rows):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)


def progress(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def table(rows, cols):
    """Plain-text table of dict rows."""
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in cols]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths))]
    for r in rows:
        lines.append("  ".join(_fmt(r.get(c)).rjust(w) for c, w in zip(cols, widths)))
    return "\n".join(lines)


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.3f}"
    return str(v)
