"""Dispatch / combine bandwidth over NVLink vs the copy engine and NCCL, same run.

    torchrun --standalone --nproc-per-node=2 benchmarks/bench_comm.py

Per tokens-per-rank T (H 7168, 384 experts, top-8, uniform routing, EP = world size):
  dispatch       the layer's dispatch (``MoKConfig().dispatch``: "split" -- the copy engine
                 moves each peer's first ``dispatch_ce_share`` of tokens while the SM pull
                 stages the rest -- or "pull"); each needed (token, rank) crosses NVLink once
  dispatch_pull  the SM pull alone (``mok_comm.dispatch.pull``)
  combine        our push combine (each (token, slot) row goes home)
  copy           copy-engine peer copy of the same bytes (pull for dispatch, push for combine):
                 the ceiling
  nccl           all_to_all_single of the routed rows (not deduplicated), splits exchanged and
                 read on the host first, as torch EP code does
GB/s = bytes that cross NVLink (local rows excluded) / time; time per iteration = max over ranks,
median over iterations. Ours and the copy engine are timed as CUDA-graph replays (device time,
as inside the layer's captured forward; ``*_eager_ms`` has them launched from Python too);
NCCL runs eagerly (its host-synced splits cannot be captured).
``*_ratio_to_copy_interleaved``: ours and the copy engine timed once more, in turns, iteration
by iteration (machine drift hits both alike).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from benchmarks.common import (capture_graph, comm_setup, gpu_name,  # noqa: E402
                               gumbel_topk_ids, numba_stream, progress, rank_max_median, table,
                               time_interleaved, time_iters, write_json)

H, E, K = 7168, 384, 8


def _layer_config():
    from mok_core.config import MoKConfig
    return MoKConfig()


LAYER_CONFIG = _layer_config()      # what the layer runs by default


def routed_comm(T):
    """This rank's comm protocol up to the schedule at ``T`` tokens per rank (H 7168, 384
    experts, top-8, uniform routing, EP = world size): tokens published, barrier passed,
    schedule built and synchronised. Returns (heap, workspace, schedule, numba stream, the
    routing ids [R, T, k], remote rows with the per-(token, rank) dedup, remote rows without)
    -- the rows counted on the host from the schedule, outside any timing."""
    import torch
    import torch.distributed as td

    from mok_comm import barrier, dispatch, routing
    from mok_core.config import MoKConfig
    from mok_core.schedule import build_schedule
    R, me = td.get_world_size(), td.get_rank()
    ids = gumbel_topk_ids(np.random.default_rng(T), R, T, E, K)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    s = numba_stream()
    heap, ws, sched = comm_setup(T, H, K, E, MoKConfig(capacity_factor=1.0), s)
    dispatch.publish_x(ws, *dispatch.check_x(ws, x.view(torch.uint16)), stream=s)
    routing.publish_ids(ws, routing.check_ids(ws, torch.from_numpy(ids[me]).cuda()), stream=s)
    barrier.barrier(ws, stream=s)
    build_schedule(sched, ws.ids_table, stream=s)
    torch.cuda.synchronize()
    sc = sched.to_host()
    n = int(sc["num_rows"][0])
    remote = (sc["src_rank"][:n] >= 0) & (sc["src_rank"][:n] != me)
    pairs = {(int(r), int(t)) for r, t in zip(sc["src_rank"][:n][remote],
                                              sc["src_token"][:n][remote])}
    return heap, ws, sched, s, ids, len(pairs), int(remote.sum())


def run_case(T, iters, warmup):
    import nvshmem.core as nvs
    import torch
    import torch.distributed as td

    from mok_comm import barrier, combine, dispatch
    R, me = td.get_world_size(), td.get_rank()
    heap, ws, sched, s, ids, dedup_rows, remote_rows = routed_comm(T)
    y = combine.check_y(ws, torch.randn(ws.capacity, H, device="cuda",
                                        dtype=torch.bfloat16).view(torch.uint16))
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)    # NCCL's payload rows

    # Bytes that cross NVLink (counted from the schedule, outside timing).
    row_bytes = H * 2
    dispatch_bytes = dedup_rows * row_bytes
    pair_bytes = remote_rows * row_bytes                   # without per-(token, rank) dedup
    combine_bytes = remote_rows * row_bytes

    bar = lambda: barrier.barrier(ws, stream=s)  # noqa: E731
    cur = numba_stream            # launch on torch's current stream (graph capture needs it)
    peer = (me + 1) % R
    nrow = max(1, dispatch_bytes // row_bytes)
    ncomb = max(1, combine_bytes // row_bytes)
    src = nvs.tensor((max(nrow, ncomb), H), dtype=torch.bfloat16)
    src.normal_()
    dst = torch.empty_like(src)
    pv = nvs.get_peer_tensor(src, peer)
    torch.cuda.synchronize()
    cfg = LAYER_CONFIG

    def layer_dispatch():
        if cfg.dispatch == "split":
            dispatch.split(ws, sched, cur(), cfg.dispatch_ce_share)
        else:
            dispatch.pull(ws, sched, cur())
    steps = {
        "dispatch": layer_dispatch,
        "dispatch_pull": lambda: dispatch.pull(ws, sched, cur()),
        "combine": lambda: combine.combine(ws, sched, y, cur()),
        "copy_pull": lambda: dst[:nrow].copy_(pv[:nrow]),
        "copy_push": lambda: pv[:ncomb].copy_(dst[:ncomb]),
    }
    # Each step twice: launched from Python (eager: the host's launch latency is inside the
    # events when the GPU outruns it) and replayed as a CUDA graph (device time; how the step
    # runs inside the layer's captured forward). Ratios use the graph times of both sides.
    eager, graph = {}, {}
    for name, step in steps.items():
        td.barrier()
        eager[name] = rank_max_median(time_iters(step, iters, warmup, pre=bar))
        g, _ = capture_graph(step)
        td.barrier()
        graph[name] = rank_max_median(time_iters(g.replay, iters, warmup, pre=bar))
        del g
    # Once more, in turns (dispatch, pull, combine, copy, ...): the copy engine's time drifts
    # between runs and within one, the kernels' do not.
    pair = {n: capture_graph(step)[0] for n, step in steps.items()}
    td.barrier()
    turns = time_interleaved({n: g.replay for n, g in pair.items()}, iters, warmup, pre=bar)
    t_turns = {n: rank_max_median(v) for n, v in turns.items()}
    del pair
    ws.check()

    # NCCL all_to_all_single of the routed rows, host-synced splits.
    dest = ids[me] // (E // R)
    valid = ids[me] >= 0
    order = np.argsort(np.where(valid, dest, R), kind="stable").ravel()
    send_counts = np.bincount(dest[valid].ravel(), minlength=R)
    send = x[torch.from_numpy(order[:int(send_counts.sum())] // K).cuda()]
    d_counts = torch.from_numpy(send_counts.astype(np.int64)).cuda()

    def nccl():
        recv_counts = torch.empty_like(d_counts)
        td.all_to_all_single(recv_counts, d_counts)
        rc = recv_counts.tolist()                            # the host sync torch EP code has
        recv = torch.empty(sum(rc), H, device="cuda", dtype=torch.bfloat16)
        td.all_to_all_single(recv, send, rc, send_counts.tolist())

    td.barrier()
    t_nccl = rank_max_median(time_iters(nccl, iters, warmup))
    nccl_bytes = int(send_counts.sum() - send_counts[me]) * row_bytes
    nvs.free_tensor(src)
    heap.free()
    gb = lambda b, ms: b / ms / 1e6  # noqa: E731
    copy_gbps = gb(nrow * row_bytes, graph["copy_pull"])
    copy_push_gbps = gb(ncomb * row_bytes, graph["copy_push"])
    row = {"tokens_per_rank": T, "ep": R, "gpu": gpu_name(), "dispatch_mode": cfg.dispatch,
           "dispatch_ce_share": cfg.dispatch_ce_share,
           **{f"{n}_eager_ms": v for n, v in eager.items()},
           **{f"{n}_ms": v for n, v in graph.items()},
           **{f"{n}_interleaved_ms": v for n, v in t_turns.items()},
           "nccl_ms": t_nccl,
           "dispatch_bytes": dispatch_bytes, "dispatch_bytes_without_dedup": pair_bytes,
           "combine_bytes": combine_bytes, "nccl_bytes": nccl_bytes,
           "copy_gbps": copy_gbps, "copy_push_gbps": copy_push_gbps,
           "nccl_gbps": gb(nccl_bytes, t_nccl), "speedup_vs_nccl": t_nccl / graph["dispatch"]}
    for name, nbytes, ceiling, ceiling_bytes in (
            ("dispatch", dispatch_bytes, "copy_pull", nrow * row_bytes),
            ("dispatch_pull", dispatch_bytes, "copy_pull", nrow * row_bytes),
            ("combine", combine_bytes, "copy_push", ncomb * row_bytes)):
        row[f"{name}_gbps"] = gb(nbytes, graph[name])
        row[f"{name}_ratio_to_copy"] = row[f"{name}_gbps"] / gb(ceiling_bytes, graph[ceiling])
        row[f"{name}_ratio_to_copy_interleaved"] = (gb(nbytes, t_turns[name])
                                                    / gb(ceiling_bytes, t_turns[ceiling]))
    return row


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="4096,8192")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/bench_comm.json")
    args = ap.parse_args(argv)
    from benchmarks.common import init_distributed
    from mok_comm.launch import bootstrap
    td = init_distributed()
    rows = []
    for T in map(int, args.tokens.split(",")):
        if td.get_rank() == 0:
            progress(f"comm T={T}")
        rows.append(run_case(T, args.iters, args.warmup))
    if td.get_rank() == 0:
        write_json(args.out, rows)
        print(table(rows, ["tokens_per_rank", "ep", "dispatch_mode", "dispatch_gbps",
                           "combine_gbps", "copy_gbps", "copy_push_gbps", "nccl_gbps",
                           "dispatch_ratio_to_copy", "dispatch_ratio_to_copy_interleaved",
                           "dispatch_pull_ratio_to_copy_interleaved",
                           "combine_ratio_to_copy_interleaved", "speedup_vs_nccl"]))
        print(table(rows, ["tokens_per_rank", "dispatch_ms", "dispatch_pull_ms",
                           "dispatch_eager_ms", "combine_ms", "combine_eager_ms", "copy_pull_ms",
                           "copy_push_ms", "nccl_ms", "dispatch_bytes",
                           "dispatch_bytes_without_dedup", "combine_bytes"]))
    bootstrap.finalize()
    td.destroy_process_group()


if __name__ == "__main__":
    main()
