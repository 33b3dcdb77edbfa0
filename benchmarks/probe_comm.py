"""Where the dispatch loses to the copy engine: the dispatch kernel rebuilt with one knob
changed, beside the copy-engine pull and push of the same bytes, in one run.

    torchrun --standalone --nproc-per-node=2 benchmarks/probe_comm.py [--tokens 4096,8192]

Variants (``kernels.dispatch.make_pull_dispatch_kernel`` + the launch shape):
  base         the library's dispatch (``ops.dispatch``)
  nofence      no ``membar.gl`` before a token's ready adds (warp barrier + release adds only)
  nc           peers' rows read through ``ld.global.nc.L1::no_allocate.L2::256B``
  bBwW         B blocks per SM of W warps (base: b2w16)
  push         the push dispatch (``kernels.push_dispatch``: owners write into the peers'
               staging, + the arrivals wait); perroute: a release add per route, not per
               block (with nofence: no ``membar.sys`` per pair)
  splitF       the split dispatch (``ops.dispatch_split``): the copy engine moves the first
               F of every peer's tokens on a side stream while the SM pull kernel stages the
               rest (``ce_share=F``; with bBw16: B blocks per SM for the SM kernel)
  '+'-joined   e.g. nofence+nc+b4w8, push+nofence+b4w8, split0.5+b1w16
Ratios: pull variants to the copy-engine pull, push variants to the copy-engine push; every
variant and the copy-engine pull are also timed in turns (``*_turns_ratio``: iteration i times
the copy and each variant once). Every variant's staging rows are checked bit-equal to the
library's before it is timed (split: the copy engine's range may also hold unneeded tokens).
GB/s = deduplicated bytes that cross NVLink / time; CUDA-graph replays, max over ranks per
iteration, median over iterations (as ``bench_comm``).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_comm import H, routed_comm  # noqa: E402
from benchmarks.common import (capture_graph, gpu_name, numba_stream, progress,  # noqa: E402
                               rank_max_median, table, time_interleaved, time_iters,
                               write_json)

VARIANTS = "base,split0.2,split0.35,split0.5,split0.65,split0.8,split1.0,split0.5+b1w16,push"


def parse_variant(name):
    """(push, fence, nc_loads, blocks per SM, warps per block, aggregate, split share or None)
    of a variant."""
    push, fence, nc, blocks, warps, aggregate, split = False, True, False, 2, 16, True, None
    for part in name.split("+"):
        if part == "base":
            continue
        if part.startswith("split"):
            split = float(part[5:])
        elif part == "push":
            push = True
        elif part == "perroute":
            aggregate = False
        elif part == "nofence":
            fence = False
        elif part == "nc":
            nc = True
        elif part.startswith("b") and "w" in part:
            blocks, warps = (int(v) for v in part[1:].split("w"))
        else:
            raise ValueError(f"unknown variant part {part!r}")
    if split is not None and (push or not fence or nc or warps != 16):
        raise ValueError(f"{name}: split takes only blocks per SM (bBw16: the library's "
                         "16-warp blocks)")
    return push, fence, nc, blocks, warps, aggregate, split


def run_case(T, variants, iters, warmup):
    import nvshmem.core as nvs
    import torch
    import torch.distributed as td

    from mok_comm import ops
    from mok_comm.kernels.dispatch import make_pull_dispatch_kernel
    from mok_comm.kernels.push_dispatch import make_push_dispatch_kernel
    from mok_core.cuda_compat import multiprocessor_count
    R, me = td.get_world_size(), td.get_rank()
    heap, ws, sched, s, _, dedup_rows, _ = routed_comm(T)
    nbytes = dedup_rows * H * 2

    staged = torch.as_tensor(ws.x_recv, device="cuda").view(torch.int16)   # uint16: few ops
    bar = lambda: ops.barrier(ws, stream=s)  # noqa: E731
    src = nvs.tensor((max(1, dedup_rows), H), dtype=torch.bfloat16)   # EP 1: none
    src.normal_()
    dst = torch.empty_like(src)
    pv = nvs.get_peer_tensor(src, (me + 1) % R)
    sms = multiprocessor_count()

    def step_of(name):
        if name == "base":
            return lambda: ops.dispatch(ws, sched, stream=numba_stream())
        push, fence, nc, blocks, warps, aggregate, split = parse_variant(name)
        if split is not None:
            return lambda: ops.dispatch_split(ws, sched, numba_stream(), blocks * sms, split)
        if push:
            kernel = make_push_dispatch_kernel(fence, aggregate)
            args = ops.push_dispatch_args(ws, sched)

            def push_step():
                kernel[blocks * sms, 32 * warps, numba_stream()](*args)
                ops.wait_dispatch_push(ws, sched, stream=numba_stream())
            return push_step
        kernel = make_pull_dispatch_kernel(fence, nc)
        args = ops.pull_dispatch_args(ws, sched)
        return lambda: kernel[blocks * sms, 32 * warps, numba_stream()](*args)

    ops.dispatch(ws, sched, stream=s)
    torch.cuda.synchronize()
    want = staged.clone()
    needed = torch.as_tensor(sched.recv_row, device="cuda").view(R, T, -1).ge(0).any(dim=2)
    needed[me] = True                        # own tokens: in place
    needed = needed.view(-1)
    row = {"tokens_per_rank": T, "ep": R, "gpu": gpu_name(), "dispatch_bytes": nbytes}
    td.barrier()
    copy_graph, _ = capture_graph(lambda: dst.copy_(pv))
    row["copy_ms"] = rank_max_median(time_iters(copy_graph.replay, iters, warmup, pre=bar))
    row["copy_gbps"] = nbytes / row["copy_ms"] / 1e6
    graphs = {}
    g, _ = capture_graph(lambda: pv.copy_(dst))
    row["copy_push_ms"] = rank_max_median(time_iters(g.replay, iters, warmup, pre=bar))
    row["copy_push_gbps"] = nbytes / row["copy_push_ms"] / 1e6
    del g
    for name in variants:
        step = step_of(name)
        for r in range(R):                   # peers' rows only: our slice is what they pull
            if r != me:
                staged.view(R, T * H)[r].zero_()
        torch.cuda.synchronize()
        td.barrier()                         # no push lands before the peer's zeroing
        step()
        torch.cuda.synchronize()
        td.barrier()
        differs = (staged != want).view(R * T, H).any(dim=1)
        if parse_variant(name)[6] is not None:   # split: the copy engine's range also holds
            differs &= needed                     # unneeded tokens -- compare the needed ones
        ok = not bool(differs.any())
        td.barrier()
        g, _ = capture_graph(step)
        ms = rank_max_median(time_iters(g.replay, iters, warmup, pre=bar))
        graphs[name] = g
        row[f"{name}_ms"] = ms
        ceiling = "copy_push_ms" if parse_variant(name)[0] else "copy_ms"
        row[f"{name}_ratio"] = row[ceiling] / ms
        row[f"{name}_equal"] = bool(ok)
    # In turns with the copy-engine pull (machine drift hits both alike).
    td.barrier()
    turns = time_interleaved({"copy": copy_graph.replay,
                              **{n: g.replay for n, g in graphs.items()}}, iters, warmup,
                             pre=bar)
    t_copy = rank_max_median(turns.pop("copy"))
    row["copy_turns_ms"] = t_copy
    for name, times in turns.items():
        row[f"{name}_turns_ratio"] = t_copy / rank_max_median(times)
    del graphs, copy_graph
    ws.check()
    nvs.free_tensor(src)
    heap.free()
    return row


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="4096,8192")
    ap.add_argument("--variants", default=VARIANTS)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out", default="probe_comm.json")
    args = ap.parse_args(argv)
    from benchmarks.common import init_distributed
    from mok_comm import bootstrap
    td = init_distributed()
    variants = args.variants.split(",")
    rows = []
    for T in map(int, args.tokens.split(",")):
        if td.get_rank() == 0:
            progress(f"probe comm T={T}")
        rows.append(run_case(T, variants, args.iters, args.warmup))
    if td.get_rank() == 0:
        write_json(args.out, rows)
        flat = [{"variant": v, **{f"T{r['tokens_per_rank']}_{f}": r[f"{v}_{f}"]
                                  for r in rows for f in ("ms", "ratio", "turns_ratio",
                                                          "equal")}}
                for v in variants]
        for ce in ("copy_push", "copy"):
            flat.insert(0, {"variant": ce, **{f"T{r['tokens_per_rank']}_ms": r[f"{ce}_ms"]
                                               for r in rows}})
        print(table(flat, list(flat[-1])))           # a variant row: every column
    bootstrap.finalize()
    td.destroy_process_group()


if __name__ == "__main__":
    main()
