"""Markdown tables from the committed benchmark results (stdlib only: runs anywhere, no GPU).

    python benchmarks/report.py            # README's table + setup line, printed
    python benchmarks/report.py --write    # rewrite README.md between the perf-table markers
    python benchmarks/report.py --check    # exit 1 when README.md's table is not what the JSON says
    python benchmarks/report.py --all      # every table of docs/perf.md (layer, FFN, comm, schedule)

Reads benchmarks/results/{bench_layer,bench_ffn,bench_comm,bench_schedule}.json as the
benchmarks write them (one JSON list of rows each); nothing here measures anything.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
README = os.path.join(ROOT, "README.md")
BEGIN, END = "<!-- perf-table -->", "<!-- /perf-table -->"


def load(name):
    """Rows of results/<name>.json (json accepts the NaN the benchmarks write)."""
    with open(os.path.join(RESULTS, name + ".json")) as f:
        return json.load(f)


def ms(v):
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.2f}"


def x(v):
    return "-" if v is None else f"{v:.2f}x"


# GemmConfig options a result may have been measured with that the library no longer has.
REMOVED = {"packed_weights=True": "packed weights", "tma=False": "cp.async weights",
           "async_ring=True": "async ring", "multicast=2": "multicast"}


def removed(*gemms):
    return sorted({v for g in gemms for k, v in REMOVED.items() if k in (g or "")})


def tile(gemm):
    """'192', '128 staged' or '192 (packed weights)' from a GemmConfig repr (fields the repr
    no longer has read as off)."""
    bm = re.search(r"bm=(\d+)", gemm or "")
    staged = "smem_epilogue=True" in (gemm or "")
    gone = removed(gemm)
    return ((bm.group(1) if bm else "?") + (" staged" if staged else "")
            + (f" ({', '.join(gone)})" if gone else ""))


def table(head, rows):
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def gpus(rows):
    names = sorted({r.get("gpu", "?") for r in rows})
    return ", ".join(names)


def readme_block(tokens=4096):
    """One table at ``tokens`` per rank: the layer (compiled step, eager, torch-native EP) and
    the routed expert FFN against torch._grouped_mm, + the dispatch / combine line and setup."""
    layer = [r for r in load("bench_layer") if r["tokens_per_rank"] == tokens]
    ffn = {(r["preset"], r["routing"]): r for r in load("bench_ffn")
           if r["tokens_per_rank"] == tokens and r.get("precision", "bf16") == "bf16"}
    comm = [r for r in load("bench_comm") if r["tokens_per_rank"] == tokens]
    rows, stale = [], False
    for r in layer:
        fu, fs = ffn.get((r["preset"], "uniform")), ffn.get((r["preset"], "skewed"))
        f = (f"{fu['ratio_vs_grouped_mm']:.2f}x / {fs['ratio_vs_grouped_mm']:.2f}x"
             if fu and fs else "-")
        if fu and fs and removed(fu["gemm"], fu["gemm_down"], fs["gemm"], fs["gemm_down"]):
            f += " *"
            stale = True
        rows.append([r["preset"], ms(r["ours_step_ms"]), ms(r["ours_ms"]),
                     ms(r["baselines"].get("torch_native")),
                     f"**{x(r['speedup_step_vs_best_baseline'])}**", f])
    head = ["preset", "MoK-Py step ms (CUDA graph)", "MoK-Py eager ms", "torch-native EP ms",
            "speedup (step)", "expert FFN vs `torch._grouped_mm` (uniform / skewed)"]
    ep = layer[0]["ep"] if layer else "?"
    lines = [table(head, rows), ""]
    if stale:
        lines += ["\\* the FFN benchmark's tile sweep picked a GEMM option this version no longer "
                  "has (see docs/perf.md); to be measured again.", ""]
    for c in comm:
        lines.append(
            f"Dispatch ({c['dispatch_variant']}) / combine at the same shape: "
            f"{c['dispatch_ratio_to_copy']:.2f}x / {c['combine_ratio_to_copy']:.2f}x the "
            f"copy engine's bandwidth; the dispatch {c['speedup_vs_nccl']:.1f}x faster than NCCL "
            "all_to_all of the same routes.")
    lines += ["", (
        f"Setup: {ep}x {gpus(layer)} (NVLink), EP {ep}, {tokens} tokens/rank, bf16 "
        f"activations and weights, FP32 accumulation; layer dispatch "
        f"`{layer[0]['dispatch'] if layer else '?'}`; CUDA events, max over ranks, median over "
        "iterations; the FFN on one GPU (this rank's experts at EP 2), ours and grouped_mm timed "
        "in turns. From `benchmarks/results/*.json` by `python benchmarks/report.py`; "
        "commands and every shape in [docs/perf.md](docs/perf.md).")]
    return "\n".join(lines)


def all_tables():
    """The tables of docs/perf.md, each under its own heading line."""
    out = []
    layer = load("bench_layer")
    out.append("### Layer (bench_layer.json)\n" + table(
        ["preset", "T/rank", "tiles", "step ms", "eager ms", "torch-native EP ms",
         "speedup step / eager", "floor ms", "HBM floor ms", "step / roofline", "rel-L1"],
        [[r["preset"], r["tokens_per_rank"], tile(r["gemm"]), ms(r["ours_step_ms"]),
          ms(r["ours_ms"]), ms(r["baselines"].get("torch_native")),
          f"{x(r['speedup_step_vs_best_baseline'])} / {x(r['speedup_vs_best_baseline'])}",
          ms(r["floor_ms"]), ms(r.get("floor_hbm_ms")),
          f"{r['step_over_roofline']:.2f}" if r.get("step_over_roofline") else "-",
          f"{r['ours_rel_l1']:.1e}"] for r in layer]))
    ffn = [r for r in load("bench_ffn") if r.get("precision", "bf16") == "bf16"]
    fp8 = [r for r in load("bench_ffn") if r.get("precision") == "fp8"]
    if fp8:
        out.append("### Expert FFN in FP8 (bench_ffn.json, precision fp8)\n" + table(
            ["preset", "T/rank", "routing", "fp8 ms", "gate_up + quantize h + down ms",
             "TFLOP/s", "vs bf16", "rel-L1 vs bf16", "quantize x ms"],
            [[r["preset"], r["tokens_per_rank"], r["routing"], ms(r["ours_ms"]),
              f"{ms(r['ours_gate_up_ms'])} + {ms(r['quantize_h_ms'])} + "
              f"{ms(r['ours_down_ms'])}", f"{r['ours_tflops']:.0f}",
              f"**{x(r['ratio_vs_bf16'])}**", f"{r['rel_l1_vs_bf16']:.1e}",
              ms(r["quantize_x_ms"])] for r in fp8]))
    out.append("### Expert FFN (bench_ffn.json)\n" + table(
        ["preset", "T/rank", "routing", "tiles gate_up / down", "ours ms", "gate_up + down ms",
         "grouped_mm ms", "ours TFLOP/s", "cuBLAS dense TFLOP/s", "ratio"],
        [[r["preset"], r["tokens_per_rank"], r["routing"],
          f"{tile(r['gemm'])} / {tile(r['gemm_down'])}", ms(r["ours_ms"]),
          f"{ms(r['ours_gate_up_ms'])} + {ms(r['ours_down_ms'])}", ms(r["grouped_mm_ms"]),
          f"{r['ours_tflops']:.0f}", f"{r['cublas_tflops']:.0f}",
          f"**{x(r['ratio_vs_grouped_mm'])}**"] for r in ffn]))
    comm = load("bench_comm")
    out.append("### Dispatch / combine (bench_comm.json)\n" + table(
        ["T/rank", "op", "ours us", "GB/s", "copy engine us", "ratio", "ratio in turns"],
        [row for c in comm for row in (
            [c["tokens_per_rank"], f"dispatch ({c['dispatch_variant']})",
             f"{c['dispatch_ms'] * 1e3:.0f}", f"{c['dispatch_gbps']:.0f}",
             f"{c['copy_pull_ms'] * 1e3:.0f}", x(c["dispatch_ratio_to_copy"]),
             x(c.get("dispatch_ratio_to_copy_interleaved"))],
            [c["tokens_per_rank"], "dispatch (SM pull alone)", f"{c['dispatch_pull_ms'] * 1e3:.0f}",
             f"{c['dispatch_pull_gbps']:.0f}", f"{c['copy_pull_ms'] * 1e3:.0f}",
             x(c["dispatch_pull_ratio_to_copy"]),
             x(c.get("dispatch_pull_ratio_to_copy_interleaved"))],
            [c["tokens_per_rank"], "combine (push)", f"{c['combine_ms'] * 1e3:.0f}",
             f"{c['combine_gbps']:.0f}", f"{c['copy_push_ms'] * 1e3:.0f}",
             x(c["combine_ratio_to_copy"]), "-"],
            [c["tokens_per_rank"], "NCCL all_to_all (routed rows)", f"{c['nccl_ms'] * 1e3:.0f}",
             f"{c['nccl_gbps']:.0f}", "-", f"dispatch {x(c['speedup_vs_nccl'])} faster", "-"])]))
    sched = load("bench_schedule")
    out.append("### Schedule (bench_schedule.json)\n" + table(
        ["T/rank", "EP", "experts", "top-k", "graph us", "eager us", "place_routes us"],
        [[r["tokens_per_rank"], r["ep"], r["experts"], r["topk"], f"{r['graph_us']:.1f}",
          f"{r['eager_us']:.0f}", f"{r['place_routes_us']:.1f}"] for r in sched]))
    return "\n\n".join(out)


def spliced(text, block, begin=BEGIN, end=END):
    """``text`` with what stands between the ``begin`` and ``end`` markers replaced by
    ``block``."""
    i, j = text.find(begin), text.find(end)
    if i < 0 or j < i:
        sys.exit(f"README.md: no {begin} ... {end} block")
    return text[:i + len(begin)] + "\n" + block + "\n" + text[j:]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per rank of README's table")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite README.md's perf-table block")
    mode.add_argument("--check", action="store_true", help="fail if README.md's block is stale")
    mode.add_argument("--all", action="store_true", help="print every table of docs/perf.md")
    a = ap.parse_args(argv)
    if a.all:
        print(all_tables())
        return 0
    return readme_table(readme_block(a.tokens), a.write, a.check, BEGIN, END,
                        "performance table differs from benchmarks/results/*.json",
                        "python benchmarks/report.py --write")


def readme_table(block, write, check, begin, end, stale, fix):
    """Print ``block``; or (``write``) put it into README.md between ``begin`` and ``end``;
    or (``check``) return 1, saying so (``stale``, ``fix``), when README.md's copy differs."""
    if not (write or check):
        print(block)
        return 0
    with open(README) as f:
        text = f.read()
    new = spliced(text, block, begin, end)
    if check:
        if new != text:
            print(f"README.md's {stale}: run {fix}", file=sys.stderr)
            return 1
        return 0
    with open(README, "w") as f:
        f.write(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
