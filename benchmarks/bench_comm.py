"""Dispatch / combine bandwidth over NVLink vs the copy engine and NCCL, same run.

    torchrun --standalone --nproc-per-node=2 benchmarks/bench_comm.py

Per tokens-per-rank T (H 7168, 384 experts, top-8, uniform routing, EP = world size):
  dispatch   the layer's dispatch (``MoKConfig().dispatch``, variant in ``dispatch_variant``;
             each needed (token, rank) crosses NVLink once); "dispatch_pull": the SM pull kernel
             alone (variant "ld", whatever the default); "dispatch_bulk": the
             same with bulk async copies (ops.dispatch(variant="bulk")); likewise "combine_bulk";
             "dispatch_ce": ops.dispatch(variant="copy_engine") -- every peer token by the copy
             engine;
             "dispatch_push": ops.dispatch(variant="push") -- each rank's SMs write its tokens
             into the peers' staging (+ the wait for its own arrivals), ratio to the
             copy-engine push of the same bytes ("copy_push_dispatch") and to the pull;
             "dispatch_split": ops.dispatch(variant="split") -- the copy engine moves each
             peer's first ``ops.SPLIT_CE_SHARE`` of tokens while the SM pull stages the rest
  combine    our push combine (each (token, slot) row goes home)
  copy       copy-engine peer copy of the same bytes (pull for dispatch, push for combine)
  nccl       all_to_all_single of the routed rows (not deduplicated), splits exchanged and
             read on the host first, as torch EP code does
GB/s = bytes that cross NVLink (local rows excluded) / time; time per iteration = max over ranks,
median over iterations. Ours and the copy engine are timed as CUDA-graph replays (device time,
as inside the layer's captured forward; ``*_eager_ms`` has them launched from Python too);
NCCL runs eagerly (its host-synced splits cannot be captured).
``dispatch_ratio_to_copy_interleaved``: the dispatch and the copy-engine pull timed once more,
in turns, iteration by iteration (machine drift hits both alike); the push dispatch and the
copy-engine push of the same rows take their turns in the same loop
(``dispatch_push_ratio_to_copy[_push]_interleaved``).
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


def _layer_dispatch():
    from mok_core.config import MoKConfig
    cfg = MoKConfig()
    return cfg, {"pull": "ld"}.get(cfg.dispatch, cfg.dispatch)


LAYER_CONFIG, LAYER_VARIANT = _layer_dispatch()     # what the layer runs by default


def routed_comm(T):
    """This rank's comm protocol up to the schedule at ``T`` tokens per rank (H 7168, 384
    experts, top-8, uniform routing, EP = world size): tokens published, barrier passed,
    schedule built and synchronised. Returns (heap, workspace, schedule, numba stream, the
    routing ids [R, T, k], remote rows with the per-(token, rank) dedup, remote rows without)
    -- the rows counted on the host from the schedule, outside any timing."""
    import torch
    import torch.distributed as td

    from mok_comm import ops
    from mok_core.config import MoKConfig
    from mok_core.schedule import build_schedule
    R, me = td.get_world_size(), td.get_rank()
    ids = gumbel_topk_ids(np.random.default_rng(T), R, T, E, K)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    s = numba_stream()
    heap, ws, sched = comm_setup(T, H, K, E, MoKConfig(capacity_factor=1.0), s)
    ops.publish_tokens(ws, x.view(torch.uint16), torch.from_numpy(ids[me]).cuda(), stream=s)
    ops.barrier(ws, stream=s)
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

    from mok_comm import ops
    R, me = td.get_world_size(), td.get_rank()
    heap, ws, sched, s, ids, dedup_rows, remote_rows = routed_comm(T)
    y = torch.randn(ws.capacity, H, device="cuda", dtype=torch.bfloat16)
    u16 = torch.uint16
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)    # NCCL's payload rows

    # Bytes that cross NVLink (counted from the schedule, outside timing).
    row_bytes = H * 2
    dispatch_bytes = dedup_rows * row_bytes
    pair_bytes = remote_rows * row_bytes                   # without per-(token, rank) dedup
    combine_bytes = remote_rows * row_bytes

    bar = lambda: ops.barrier(ws, stream=s)  # noqa: E731
    cur = numba_stream            # launch on torch's current stream (graph capture needs it)
    peer = (me + 1) % R
    nrow = max(1, dispatch_bytes // row_bytes)
    ncomb = max(1, combine_bytes // row_bytes)
    src = nvs.tensor((max(nrow, ncomb), H), dtype=torch.bfloat16)
    src.normal_()
    dst = torch.empty_like(src)
    pv = nvs.get_peer_tensor(src, peer)
    torch.cuda.synchronize()
    steps = {
        "dispatch": lambda: ops.dispatch(ws, sched, stream=cur(), variant=LAYER_VARIANT,
                                         ce_share=LAYER_CONFIG.dispatch_ce_share),
        "dispatch_pull": lambda: ops.dispatch(ws, sched, stream=cur()),
        "dispatch_bulk": lambda: ops.dispatch(ws, sched, stream=cur(), variant="bulk"),
        "dispatch_ce": lambda: ops.dispatch(ws, sched, stream=cur(), variant="copy_engine"),
        "dispatch_push": lambda: ops.dispatch(ws, sched, stream=cur(), variant="push"),
        "dispatch_split": lambda: ops.dispatch(ws, sched, stream=cur(), variant="split"),
        "combine": lambda: ops.combine(ws, sched, y.view(u16), stream=cur()),
        "combine_bulk": lambda: ops.combine(ws, sched, y.view(u16), stream=cur(),
                                            variant="bulk"),
        "copy_pull": lambda: dst[:nrow].copy_(pv[:nrow]),
        "copy_push": lambda: pv[:ncomb].copy_(dst[:ncomb]),
        "copy_push_dispatch": lambda: pv[:nrow].copy_(dst[:nrow]),
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
    # The goal's pair once more, taken in turns (dispatch, copy, dispatch, copy, ...): the
    # copy engine's time drifts between runs and within one, the kernel's does not.
    pair = {n: capture_graph(steps[n])[0] for n in ("dispatch", "copy_pull", "dispatch_push",
                                                    "copy_push_dispatch", "dispatch_split",
                                                    "dispatch_pull")}
    td.barrier()
    turns = time_interleaved({n: g.replay for n, g in pair.items()}, iters, warmup, pre=bar)
    t_turns = {n: rank_max_median(v) for n, v in turns.items()}
    del pair
    ws.check()
    t_disp, t_bulk, t_comb, t_comb_bulk, t_pull, t_push = (
        graph[n] for n in ("dispatch", "dispatch_bulk", "combine", "combine_bulk", "copy_pull",
                           "copy_push"))

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

    def turns_ratio(name, ceiling="copy_pull"):
        """GB/s of dispatch ``name`` over the copy engine's, both from the in-turns timing."""
        return gb(dispatch_bytes, t_turns[name]) / gb(nrow * row_bytes, t_turns[ceiling])
    row = {"tokens_per_rank": T, "ep": R, "gpu": gpu_name(),
           **{f"{n}_eager_ms": v for n, v in eager.items()},
           "dispatch_ms": t_disp, "dispatch_bulk_ms": t_bulk, "combine_ms": t_comb,
           "combine_bulk_ms": t_comb_bulk,
           "copy_pull_ms": t_pull,
           "copy_push_ms": t_push, "nccl_ms": t_nccl,
           "dispatch_bytes": dispatch_bytes, "dispatch_bytes_without_dedup": pair_bytes,
           "combine_bytes": combine_bytes, "nccl_bytes": nccl_bytes,
           "dispatch_gbps": gb(dispatch_bytes, t_disp), "combine_gbps": gb(combine_bytes, t_comb),
           "copy_gbps": gb(nrow * row_bytes, t_pull), "copy_push_gbps": gb(ncomb * row_bytes,
                                                                           t_push),
           "nccl_gbps": gb(nccl_bytes, t_nccl)}
    row["dispatch_ratio_to_copy"] = row["dispatch_gbps"] / row["copy_gbps"]
    row["dispatch_variant"] = LAYER_VARIANT
    row["dispatch_pull_ms"] = graph["dispatch_pull"]
    row["dispatch_pull_gbps"] = gb(dispatch_bytes, graph["dispatch_pull"])
    row["dispatch_pull_ratio_to_copy"] = row["dispatch_pull_gbps"] / row["copy_gbps"]
    row["dispatch_pull_ratio_to_copy_interleaved"] = turns_ratio("dispatch_pull")
    row["dispatch_interleaved_ms"] = t_turns["dispatch"]
    row["copy_pull_interleaved_ms"] = t_turns["copy_pull"]
    row["dispatch_ratio_to_copy_interleaved"] = turns_ratio("dispatch")
    row["dispatch_push_interleaved_ms"] = t_turns["dispatch_push"]
    row["copy_push_dispatch_interleaved_ms"] = t_turns["copy_push_dispatch"]
    row["dispatch_push_ratio_to_copy_interleaved"] = turns_ratio("dispatch_push")
    row["dispatch_push_ratio_to_copy_push_interleaved"] = turns_ratio("dispatch_push",
                                                                      "copy_push_dispatch")
    row["dispatch_split_ms"] = graph["dispatch_split"]
    row["dispatch_split_ce_share"] = ops.SPLIT_CE_SHARE
    row["dispatch_split_gbps"] = gb(dispatch_bytes, graph["dispatch_split"])
    row["dispatch_split_ratio_to_copy"] = row["dispatch_split_gbps"] / row["copy_gbps"]
    row["dispatch_split_interleaved_ms"] = t_turns["dispatch_split"]
    row["dispatch_split_ratio_to_copy_interleaved"] = turns_ratio("dispatch_split")
    row["dispatch_bulk_gbps"] = gb(dispatch_bytes, t_bulk)          # variant="bulk", same rows
    row["dispatch_bulk_ratio_to_copy"] = row["dispatch_bulk_gbps"] / row["copy_gbps"]
    # copy-engine variant: whole peer buffers (more bytes than the dedup'd rows); GB/s counted
    # on the deduplicated bytes like the others, so the ratio is what a user gets per needed row
    row["dispatch_ce_ms"] = graph["dispatch_ce"]
    row["dispatch_ce_gbps"] = gb(dispatch_bytes, graph["dispatch_ce"])
    row["dispatch_ce_ratio_to_copy"] = row["dispatch_ce_gbps"] / row["copy_gbps"]
    row["dispatch_push_ms"] = graph["dispatch_push"]
    row["dispatch_push_gbps"] = gb(dispatch_bytes, graph["dispatch_push"])
    row["copy_push_dispatch_ms"] = graph["copy_push_dispatch"]
    row["copy_push_dispatch_gbps"] = gb(nrow * row_bytes, graph["copy_push_dispatch"])
    row["dispatch_push_ratio_to_copy_push"] = (row["dispatch_push_gbps"]
                                               / row["copy_push_dispatch_gbps"])
    row["dispatch_push_ratio_to_copy"] = row["dispatch_push_gbps"] / row["copy_gbps"]
    row["combine_bulk_gbps"] = gb(combine_bytes, t_comb_bulk)
    row["combine_bulk_ratio_to_copy"] = row["combine_bulk_gbps"] / row["copy_push_gbps"]
    row["combine_ratio_to_copy"] = row["combine_gbps"] / row["copy_push_gbps"]
    row["speedup_vs_nccl"] = t_nccl / t_disp
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
        print(table(rows, ["tokens_per_rank", "ep", "dispatch_gbps", "combine_gbps",
                           "copy_gbps", "copy_push_gbps", "nccl_gbps", "dispatch_ratio_to_copy",
                           "dispatch_ratio_to_copy_interleaved", "dispatch_pull_ratio_to_copy",
                           "dispatch_split_ratio_to_copy",
                           "dispatch_split_ratio_to_copy_interleaved",
                           "dispatch_bulk_ratio_to_copy", "dispatch_ce_ratio_to_copy",
                           "dispatch_push_ratio_to_copy_push", "dispatch_push_ratio_to_copy",
                           "combine_bulk_ratio_to_copy",
                           "combine_ratio_to_copy", "speedup_vs_nccl"]))
        print(table(rows, ["tokens_per_rank", "dispatch_ms", "dispatch_split_ms",
                           "dispatch_push_ms", "dispatch_ce_ms",
                           "copy_push_dispatch_ms", "dispatch_eager_ms", "combine_ms",
                           "combine_eager_ms", "copy_pull_ms", "copy_push_ms", "nccl_ms",
                           "dispatch_bytes", "dispatch_bytes_without_dedup", "combine_bytes"]))
    bootstrap.finalize()
    td.destroy_process_group()


if __name__ == "__main__":
    main()
