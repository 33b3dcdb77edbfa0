"""Routed expert FFN: our grouped GEMMs vs torch._grouped_mm (+ SwiGLU) vs one dense cuBLAS GEMM.

    python benchmarks/bench_ffn.py [--presets kimi-k2.7,...] [--tokens 4096,8192] [--out F]

Per preset at EP=2 (half the experts local, T tokens per rank, top-k routes of all 2T tokens
landing on this rank's experts), uniform and skewed routing:
  ours        gate_up_swiglu + down over the expert-sorted layout, padded to the tiles' row unit
  grouped_mm  torch._grouped_mm gate/up (one [2I] GEMM) -> silu(g)*u -> grouped_mm down, on the
              unpadded rows (offsets rounded to 16 rows, which grouped_mm needs)
  cublas      dense bf16 matmuls of the same FLOPs (the ceiling)
  fp8         (``--precision bf16,fp8``) fp8_gate_up_swiglu + h quantised (1 x 128) + fp8_gemm
              down, on x and the weights quantised beforehand (x gathered into expert order
              and quantised in one pass, ``quantize_fp8(index=)``: in the layer, on arrival;
              weights: once per optimizer step); a row of its own (``precision`` "fp8",
              ``ratio_vs_bf16`` = our bf16 time / this, the same turns; ``quantize_x_ms`` what
              x's pass costs alone, and the ratio with it added,
              ``ratio_vs_bf16_with_quantize_x``; ``rel_l1_vs_bf16`` of y)
TFLOP/s counts real routed rows only: 6 * rows * H * I.
Each side is timed as a CUDA-graph replay (device time, as inside the layer's captured step),
ours and grouped_mm in turns (iteration i runs both: a drift of the machine hits both alike;
our gate_up and down alone run in the same turns, ``ours_gate_up_ms`` / ``ours_down_ms``):
eagerly, a Python launch that takes longer to issue than the GPU needs to drain the queue puts
its host time between the timing events. ``*_eager_ms`` keep the eager times of both sides.
grouped_mm is sometimes *slower* replayed than eager (deepseek-v4-pro at 8192: 17.7 vs
15.0 ms), so each side's ``*_ms`` -- and the ratio -- take the faster of its two timings.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from benchmarks.common import (capture_graph, gpu_name, median, numba_stream,  # noqa: E402
                               padded_layout, progress, routing_counts, table,
                               time_interleaved, write_json)


# (bm, bn, bk, wm, wn, stages, blocks_per_sm, max_registers, mma) -- GemmConfig's field order
SWEEP = [
    (192, 256, 64, 3, 1, 4, 1, 0, "wgmma"),                 # WGMMA_192_GEMM
    (128, 256, 64, 2, 1, 4, 1, 0, "wgmma"),                 # WGMMA_GEMM
    (128, 128, 64, 2, 1, 3, 2, 0, "wgmma"),                 # two blocks per SM
    (256, 128, 64, 4, 1, 4, 1, 0, "wgmma"),                 # 4 warpgroups: 256-row experts
]


def fastest_per_preset(trial):
    """{preset: GemmConfig} of the fastest row per preset of a sweep (rows carry our repr;
    ``ours_ms`` = gate_up + down with that one config: what one ``Layer.gemm`` runs)."""
    best = {}
    for r in trial:
        if r["preset"] not in best or r["ours_ms"] < best[r["preset"]]["ours_ms"]:
            best[r["preset"]] = r
    return {p: _config(r["gemm"]) for p, r in best.items()}


def fastest_per_gemm(trial):
    """{(preset, tokens_per_rank): (gate_up GemmConfig, down GemmConfig)}: each GEMM's fastest
    tiles of a sweep, chosen apart (their shapes differ: gate/up N = 2I, K = H; down N = H,
    K = I)."""
    best = {}
    for r in trial:
        key = (r["preset"], r["tokens_per_rank"])
        gu, dn = best.get(key, (r, r))
        best[key] = (r if r["gate_up_ms"] < gu["gate_up_ms"] else gu,
                     r if r["down_ms"] < dn["down_ms"] else dn)
    return {k: (_config(gu["gemm"]), _config(dn["gemm"])) for k, (gu, dn) in best.items()}


def _config(text):
    from mok_core.gemm import GemmConfig
    return eval(text, {"GemmConfig": GemmConfig})


def parse_gemm(text):
    """'bm,bn,bk,wm,wn,stages[,blocks_per_sm,max_registers,mma]' -> GemmConfig."""
    from mok_core.gemm import GemmConfig

    def value(v):
        v = v.strip()
        return int(v) if v.isdigit() else v
    return GemmConfig(*[value(v) for v in text.split(",")])


def ffn_inputs(preset_name, T, skew, row_unit, rng):
    """Rank 0's routed FFN at EP=2 (bf16 torch tensors on the GPU): x [rows, H] in expert
    order, weights, the expert-sorted layout padded to ``row_unit`` (a_index: row of x or -1,
    offsets, num_rows) and the outputs hidden [C, I], y [C, H]; plus counts and the shape."""
    import torch

    from mok_core.config import preset
    shape = preset(preset_name, ep_size=2)
    H, I, E, k = shape.hidden, shape.intermediate, shape.num_experts, shape.topk
    E_l = E // 2
    counts_all, _ = routing_counts(rng, 2 * T, E, k, skew)
    counts = counts_all[:E_l]                                   # rank 0's experts
    rows = int(counts.sum())
    off = padded_layout(counts, row_unit)
    C = int(off[-1])
    dev = "cuda"
    bf = torch.bfloat16
    a_index = np.full(C, -1, np.int32)
    starts = np.concatenate([[0], np.cumsum(counts)])
    for e in range(E_l):
        a_index[off[e]:off[e] + counts[e]] = np.arange(starts[e], starts[e + 1])
    return dict(
        shape=shape, counts=counts, rows=rows, C=C,
        x=torch.randn(rows, H, device=dev, dtype=bf),
        wg=torch.randn(E_l, I, H, device=dev, dtype=bf) * H ** -0.5,
        wu=torch.randn(E_l, I, H, device=dev, dtype=bf) * H ** -0.5,
        wd=torch.randn(E_l, H, I, device=dev, dtype=bf) * I ** -0.5,
        index=torch.from_numpy(a_index).to(dev), off=torch.from_numpy(off).to(dev),
        num_rows=torch.tensor([C], dtype=torch.int32, device=dev),
        hidden=torch.empty(C, I, device=dev, dtype=bf),
        y=torch.empty(C, H, device=dev, dtype=bf))


def gemm_pair(gemm_cfg):
    """A GemmConfig for both GEMMs, or a (gate_up, down) pair, as a pair."""
    return tuple(gemm_cfg) if isinstance(gemm_cfg, (tuple, list)) else (gemm_cfg, gemm_cfg)


def ffn_steps(d, gemm_cfg):
    """(gate_up, down) launches of our kernels over ``ffn_inputs``, on torch's current stream
    at call time (so they can be captured into a CUDA graph). ``gemm_cfg``: one GemmConfig,
    or a (gate_up, down) pair."""
    from mok_core.gemm import down, gate_up_swiglu
    import torch
    u16 = torch.uint16
    cfg_gu, cfg_dn = gemm_pair(gemm_cfg)
    wg, wu, wd = d["wg"], d["wu"], d["wd"]

    def gate_up():
        gate_up_swiglu(d["x"].view(u16), d["index"], wg.view(u16), wu.view(u16),
                       d["off"], d["num_rows"], d["hidden"].view(u16), config=cfg_gu,
                       stream=numba_stream())

    def down_():
        down(d["hidden"].view(u16), wd.view(u16), d["off"], d["num_rows"],
             d["y"].view(u16), row_index=d["index"], config=cfg_dn, stream=numba_stream())
    return gate_up, down_


def sweep_case(preset_name, T, configs, iters, rng, routings=("uniform",)):
    """Each config's gate_up and down timed apart (graph replay; the faster of replay and
    eager) on one input per routing: rows with ``gemm``, ``gate_up_ms`` and ``down_ms``
    (summed over ``routings`` -- the layer cannot know the routing when it picks its tiles,
    so the pick minimises their total), the per-routing times and ``ours_ms`` (the sum)."""
    import torch
    times = {}
    routings = tuple(dict.fromkeys(routings))       # each routing once
    for skew in routings:
        d = ffn_inputs(preset_name, T, skew, max(c.row_unit for c in configs), rng)
        for cfg in configs:
            progress(f"sweep {preset_name} T={T} {skew} {cfg}")
            try:
                gu, dn = ffn_steps(d, cfg)
                t_gu, t_dn = (best_ms(*device_ms(f, iters)) for f in (gu, dn))
            except Exception as exc:                            # keep the sweep going
                progress(f"  failed: {type(exc).__name__}: {exc}")
                continue
            progress(f"  gate_up {t_gu:.3f} ms, down {t_dn:.3f} ms")
            times.setdefault(str(cfg), {})[skew] = (t_gu, t_dn)
        gu = dn = d = None                  # the steps' closures hold d's tensors too
        torch.cuda.empty_cache()
    rows = []
    for cfg, per in times.items():
        if len(per) < len(routings):
            continue                                # failed on one routing: not a candidate
        row = {"preset": preset_name, "tokens_per_rank": T, "gemm": cfg,
               "gate_up_ms": sum(v[0] for v in per.values()),
               "down_ms": sum(v[1] for v in per.values())}
        for skew, (t_gu, t_dn) in per.items():
            row[f"gate_up_{skew}_ms"], row[f"down_{skew}_ms"] = t_gu, t_dn
        row["ours_ms"] = row["gate_up_ms"] + row["down_ms"]
        rows.append(row)
    return rows


def device_ms(fn, iters):
    """(graph-replay ms, eager ms): median per-call device time of ``fn`` captured into a CUDA
    graph (NaN if it cannot be captured), and launched from Python."""
    return interleaved_ms({"fn": fn}, iters)["fn"]


def interleaved_ms(fns, iters, eager=True):
    """name -> (graph-replay ms, eager ms) of several steps timed in turns (``time_interleaved``:
    each iteration runs every step once, so a drift of the machine over the run -- clocks,
    temperature -- hits all sides alike): medians of the CUDA-graph replays (NaN for a step
    that cannot be captured), then of the eager launches (``eager``: True for every step, or
    the names of the steps to launch eagerly too -- the others only if they could not be
    captured; NaN for the rest)."""
    graphs = {}
    for name, fn in fns.items():
        try:
            graphs[name] = capture_graph(fn)[0].replay
        except Exception as exc:                                # keep the eager time
            progress(f"{name}: graph capture failed ({type(exc).__name__}: {exc}); eager only")
    replay = time_interleaved(graphs, iters) if graphs else {}
    launched = {n: f for n, f in fns.items()
                if eager is True or n in eager or n not in graphs}
    times = time_interleaved(launched, iters) if launched else {}
    nan = float("nan")
    return {name: (median(replay[name]) if name in replay else nan,
                   median(times[name]) if name in times else nan) for name in fns}


def best_ms(graph, eager):
    """The faster of a side's two timings (a NaN one does not count)."""
    return eager if graph != graph else min(graph, eager)


def fp8_steps(d):
    """(quantize_x, gate_up, quantize_h, down, y) of the FP8 routed FFN over ``ffn_inputs``
    (weights quantised here, once; buffers allocated here so the steps can be captured)."""
    import torch

    from mok_core.gemm import fp8_gate_up_swiglu, fp8_gemm
    from mok_core.quantize import quantize_expert_weights, quantize_fp8
    u16, u8, f32 = torch.uint16, torch.uint8, torch.float32
    C, H, I = d["C"], d["shape"].hidden, d["shape"].intermediate
    dev = d["x"].device
    wg8, sg = quantize_expert_weights(d["wg"].view(u16))
    wu8, su = quantize_expert_weights(d["wu"].view(u16))
    wd8, sd = quantize_expert_weights(d["wd"].view(u16))
    x8 = torch.empty(C, H, device=dev, dtype=u8)
    sx = torch.empty(C, H // 128, device=dev, dtype=f32)
    h8 = torch.empty(C, I, device=dev, dtype=u8)
    sh = torch.empty(C, I // 128, device=dev, dtype=f32)
    y = torch.empty(C, H, device=dev, dtype=torch.bfloat16)

    def quantize_x():
        quantize_fp8(d["x"].view(u16), (1, 128), out=x8, scales=sx, index=d["index"],
                     stream=numba_stream())

    def gate_up():
        fp8_gate_up_swiglu(x8, sx, wg8, sg, wu8, su, d["off"], d["num_rows"],
                           d["hidden"].view(u16), stream=numba_stream())

    def quantize_h():
        quantize_fp8(d["hidden"].view(u16), (1, 128), out=h8, scales=sh, stream=numba_stream())

    def down_():
        fp8_gemm(h8, sh, wd8, sd, d["off"], d["num_rows"], y.view(u16),
                 stream=numba_stream())
    return quantize_x, gate_up, quantize_h, down_, y


def _fp8_label(N, swiglu):
    """The FP8 GEMM's default tile for N columns (``mok_core.gemm._fp8_tile``)."""
    from mok_core.gemm import _fp8_tile
    bn, stages = _fp8_tile(N // 2 if swiglu else N, swiglu, None, None)
    return f"sm90_fp8 128x{bn} s{stages}"


def run_case(preset_name, T, skew, gemm_cfg, iters, rng, precisions=("bf16",)):
    """[the bf16 row] or, with "fp8" in ``precisions``, [bf16 row, fp8 row] (module
    docstring)."""
    import torch

    cfg_gu, cfg_dn = gemm_pair(gemm_cfg)
    d = ffn_inputs(preset_name, T, skew, max(cfg_gu.row_unit, cfg_dn.row_unit), rng)
    shape, counts, rows, C = d["shape"], d["counts"], d["rows"], d["C"]
    H, I = shape.hidden, shape.intermediate
    wg, wu, wd = d["wg"], d["wu"], d["wd"]
    dev = "cuda"
    bf = torch.bfloat16
    gate_up, down_ = ffn_steps(d, gemm_cfg)

    def ours():
        gate_up()
        down_()

    # grouped_mm baseline (offsets must be multiples of 16 rows)
    c16 = -(-counts // 16) * 16
    offs16 = torch.from_numpy(np.cumsum(c16).astype(np.int32)).to(dev)
    x16 = torch.randn(int(c16.sum()), H, device=dev, dtype=bf)
    w_gu = torch.cat([wg, wu], dim=1)                           # [E, 2I, H]

    def grouped():
        gu = torch._grouped_mm(x16, w_gu.transpose(1, 2), offs=offs16)
        g, u = gu.split(I, dim=1)
        h = torch.nn.functional.silu(g) * u
        return torch._grouped_mm(h, wd.transpose(1, 2), offs=offs16)

    a1 = torch.randn(rows, H, device=dev, dtype=bf)
    b1 = torch.randn(H, 2 * I, device=dev, dtype=bf)
    a2 = torch.randn(rows, I, device=dev, dtype=bf)
    b2 = torch.randn(I, H, device=dev, dtype=bf)

    def cublas():
        torch.mm(a1, b1)
        torch.mm(a2, b2)

    # ours and grouped_mm (and our two GEMMs alone: what the sweep timed) in turns
    steps = {"ours": ours, "grouped": grouped, "gate_up": gate_up, "down": down_}
    if "fp8" in precisions:
        ours()
        y_bf16 = d["y"].float().clone()
        q_x, f_gu, q_h, f_dn, y8 = fp8_steps(d)
        q_x()

        def fp8():
            f_gu()
            q_h()
            f_dn()
        fp8()
        torch.cuda.synchronize()
        real = d["index"] >= 0
        fp8_l1 = float((y8.float() - y_bf16)[real].abs().sum() / y_bf16[real].abs().sum())
        steps.update(fp8=fp8, fp8_gate_up=f_gu, fp8_quantize_h=q_h, fp8_down=f_dn,
                     quantize_x=q_x)
    try:
        grouped()
    except Exception as exc:                                    # keep the run going
        progress(f"grouped_mm failed: {exc}")
        del steps["grouped"]
    t = interleaved_ms(steps, iters)
    (t_ours, e_ours), (t_gmm, e_gmm) = t["ours"], t.get("grouped", (float("nan"),) * 2)
    t_cub, _ = device_ms(cublas, iters)
    flops = 6.0 * rows * H * I
    row = {"preset": preset_name, "tokens_per_rank": T, "routing": skew, "rows": rows,
           "padded_rows": C, "ours_ms": best_ms(t_ours, e_ours), "ours_graph_ms": t_ours,
           "grouped_mm_ms": best_ms(t_gmm, e_gmm),
           "grouped_mm_graph_ms": t_gmm, "cublas_ms": t_cub,
           "ours_tflops": flops / best_ms(t_ours, e_ours) / 1e9,
           "grouped_mm_tflops": flops / best_ms(t_gmm, e_gmm) / 1e9,
           "cublas_tflops": flops / t_cub / 1e9,
           "ratio_vs_grouped_mm": best_ms(t_gmm, e_gmm) / best_ms(t_ours, e_ours),
           "ours_eager_ms": e_ours, "grouped_mm_eager_ms": e_gmm,
           "ours_gate_up_ms": best_ms(*t["gate_up"]), "ours_down_ms": best_ms(*t["down"]),
           "gpu": gpu_name(), "gemm": str(cfg_gu), "gemm_down": str(cfg_dn)}
    out = [dict(row, precision="bf16")]
    if "fp8" in precisions:
        t8 = best_ms(*t["fp8"])
        out.append({"preset": preset_name, "tokens_per_rank": T, "routing": skew,
                    "rows": rows, "padded_rows": C, "precision": "fp8", "ours_ms": t8,
                    "ours_graph_ms": t["fp8"][0], "ours_tflops": flops / t8 / 1e9,
                    "ratio_vs_bf16": row["ours_ms"] / t8,
                    "ratio_vs_grouped_mm": row["grouped_mm_ms"] / t8,
                    "ours_gate_up_ms": best_ms(*t["fp8_gate_up"]),
                    "quantize_h_ms": best_ms(*t["fp8_quantize_h"]),
                    "ours_down_ms": best_ms(*t["fp8_down"]),
                    "quantize_x_ms": best_ms(*t["quantize_x"]),
                    "ratio_vs_bf16_with_quantize_x":
                        row["ours_ms"] / (t8 + best_ms(*t["quantize_x"])),
                    "rel_l1_vs_bf16": fp8_l1, "gpu": gpu_name(),
                    "gemm": _fp8_label(2 * I, True), "gemm_down": _fp8_label(H, False)})
    del d, wg, wu, wd, x16, w_gu
    torch.cuda.empty_cache()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="kimi-k2.7,glm-5.2,qwen3.5-397b,deepseek-v4-pro")
    ap.add_argument("--tokens", default="4096,8192")
    ap.add_argument("--routing", default="uniform,skewed")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--gemm", default="",
                    help="bm,bn,bk,wm,wn,stages[,blocks_per_sm,max_registers,mma]")
    ap.add_argument("--sweep", action="store_true",
                    help="time SWEEP configs (gate_up and down apart, summed over --routing) "
                         "on kimi-k2.7 at each T first, then run with each GEMM's fastest")
    ap.add_argument("--sweep-all", action="store_true",
                    help="with --sweep: sweep every preset and T; each case then runs with "
                         "the fastest gate_up and the fastest down tiles of its (preset, T)")
    ap.add_argument("--precision", default="bf16",
                    help="bf16 or bf16,fp8 (the FP8 routed FFN in the same turns)")
    ap.add_argument("--out", default="benchmarks/results/bench_ffn.json")
    args = ap.parse_args(argv)
    from mok_core.gemm import GemmConfig, default_gemm
    cfg = default_gemm()
    if args.gemm:
        cfg = parse_gemm(args.gemm)
    rng = np.random.default_rng(0)
    tiles = {}                       # (preset, T) -> (gate_up, down) fastest swept tiles
    if args.sweep:
        sweep_presets = args.presets.split(",") if args.sweep_all else ["kimi-k2.7"]
        configs = [GemmConfig(*spec) for spec in SWEEP]
        trial = []
        for p in sweep_presets:
            for T in map(int, args.tokens.split(",")):
                trial += sweep_case(p, T, configs, args.iters, rng,
                                    tuple(args.routing.split(",")))
                write_json(args.out.replace(".json", "_sweep.json"), trial)
        print(table(trial, ["preset", "tokens_per_rank", "gemm", "gate_up_ms", "down_ms",
                            "ours_ms"]))
        tiles = fastest_per_gemm(trial)
        progress(f"fastest: {tiles}")
    rows = []
    for p in args.presets.split(","):
        for T in map(int, args.tokens.split(",")):
            pick = tiles.get((p, T), tiles.get(("kimi-k2.7", T), cfg))
            for skew in args.routing.split(","):
                progress(f"ffn {p} T={T} {skew}")
                case = run_case(p, T, skew, pick, args.iters, rng,
                                tuple(args.precision.split(",")))
                rows += case
                write_json(args.out, rows)               # keep what we have if time runs out
                r = case[0]
                progress(f"  ours {r['ours_ms']:.3f} ms ({r['ours_tflops']:.0f} TF/s)  "
                         f"grouped_mm {r['grouped_mm_ms']:.3f} ms  ratio "
                         f"{r['ratio_vs_grouped_mm']:.2f}")
                for r in case[1:]:
                    progress(f"  fp8 {r['ours_ms']:.3f} ms ({r['ours_tflops']:.0f} TF/s)  "
                             f"x{r['ratio_vs_bf16']:.2f} vs bf16, rel-L1 "
                             f"{r['rel_l1_vs_bf16']:.1e} (quantize x {r['quantize_x_ms']:.3f} "
                             "ms apart)")
    write_json(args.out, rows)
    print(table(rows, ["preset", "tokens_per_rank", "routing", "rows", "ours_ms",
                       "grouped_mm_ms", "cublas_ms", "ours_tflops", "ratio_vs_grouped_mm"]))
    return rows


if __name__ == "__main__":
    main()
