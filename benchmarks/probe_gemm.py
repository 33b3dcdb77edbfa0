"""Where the grouped GEMMs' time goes: the library's kernel rebuilt with parts switched off.

    python benchmarks/probe_gemm.py [--presets kimi-k2.7] [--tokens 4096,8192] [--variants ...]

For each preset (EP=2, rank 0's routed experts, uniform routing) and for its dense shared
expert (one expert, T rows), times gate_up and down separately with the library's tiles for the
shape (``mok_comm.layer.layer_gemm``) changed by one field:
  base       as shipped
  no_a       A chunks zero-filled, never read       (GemmConfig.probe; results are wrong)
  no_b       weight boxes never loaded              (probe)
  no_mma     no wgmma issued                        (probe)
  no_store   the epilogue stores nothing            (probe; what the epilogue costs)
  mma_first  a slice's wgmmas issued before the loads of slice kt + PREFETCH (same results)
  l2pfN      weight boxes prefetched into L2 N slices past the newest load (same results)
  async      GemmConfig.async_ring (stages handed over by mbarriers)
  packed     GemmConfig.packed_weights (weights packed box by box, one bulk copy per box;
             the packing itself is weight preparation, not timed)
  bm128      128-row tiles x 256 columns (2 warpgroups; bm192: 3), weights by TMA;
             bm256: 256 x 128 (4 warpgroups)
  2cta       two 128 x 128 blocks per SM (3-slice rings), weights by TMA
  stN, bnN   N ring stages, N-column tiles
  smemepi    GemmConfig.smem_epilogue (the epilogue staged in shared memory, bulk stores)
  rows16     (probe, staged) lanes 0..15 send one row each instead of lane 0 all 16
  stage_only (probe, staged) the tile staged, no bulk store sent (results are wrong)
  stage_local (probe, staged) staged through a local-array copy of the accumulator (as up to
             session 9; same results)
  loads_first (probe, staged) staged after the next tile's prologue loads are issued
             (same results)
  exact_act  (probe, staged) the SwiGLU through math.exp and an IEEE division (as up to
             session 9; within float32 rounding)
  mc1, mc2   GemmConfig.multicast: the cluster ring (1: one block, plain loads; 2: clusters
             of 2 blocks, each weight slice read once and multicast to both)
  a+b        parts combined (e.g. no_a+no_b: MMAs and the loop alone; async+no_mma)
beside torch (grouped_mm gate/up + SwiGLU, grouped_mm down; cuBLAS for the dense expert),
each GEMM timed alone as a CUDA-graph replay (device time, no host launch cost; torch's the
faster of replay and eager, as in bench_ffn), all of a case's variants and torch in turns.
If a part switched off saves little, it is not what bounds the kernel.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from benchmarks.bench_ffn import best_ms, ffn_inputs, ffn_steps, interleaved_ms  # noqa: E402
from benchmarks.common import gpu_name, progress, table, write_json  # noqa: E402

VARIANTS = "base,no_a,no_b,no_mma,mma_first,l2pf2,l2pf4,l2pf8"


def variant_config(base, name):
    """'base', or '+'-joined parts, applied in order: 'async' (async_ring), 'packed'
    (packed_weights), 'bm128' / 'bm192' / 'bm256' (row tile), '2cta' (two 128 x 128 blocks per
    SM), 'smemepi' (the staged epilogue), 'mc1' / 'mc2' (clusters), 'stN', 'bnN', 'l2pfN'
    (l2_prefetch=N), probes. Row-tile, async and cluster parts turn the staged epilogue off
    (the default tiles may have it on): 'bm192+smemepi' asks for it again."""
    cfg, probes = base, []
    for part in name.split("+"):
        if part == "base":
            continue
        if part == "async":            # (the staged epilogue needs the block ring)
            cfg = dataclasses.replace(cfg, async_ring=True, smem_epilogue=False)
        elif part == "packed":
            cfg = dataclasses.replace(cfg, packed_weights=True, tma=True, l2_prefetch=0)
        elif part == "2cta":           # two 128 x 128 blocks per SM, 3 stages each
            cfg = dataclasses.replace(cfg, bm=128, wm=2, bn=128, stages=3, blocks_per_sm=2,
                                      tma=True, smem_epilogue=False)
        elif part in ("bm128", "bm192", "bm256"):
            bm = int(part[2:])
            cfg = dataclasses.replace(cfg, bm=bm, wm=bm // 64, tma=True,
                                      bn=128 if bm == 256 else 256, smem_epilogue=False)
        elif part == "smemepi":        # epilogue staged in shared memory + bulk stores
            cfg = dataclasses.replace(cfg, smem_epilogue=True, async_ring=False, multicast=0)
        elif part in ("mc1", "mc2"):   # clusters sharing weight slices (TMA, no l2pf)
            cfg = dataclasses.replace(cfg, multicast=int(part[2:]), tma=True, l2_prefetch=0,
                                      async_ring=False, smem_epilogue=False)
        elif part.startswith("st") and part[2:].isdigit():
            cfg = dataclasses.replace(cfg, stages=int(part[2:]))
        elif part.startswith("bn") and part[2:].isdigit():
            cfg = dataclasses.replace(cfg, bn=int(part[2:]))
        elif part.startswith("l2pf"):
            cfg = dataclasses.replace(cfg, l2_prefetch=int(part[4:]))
        else:
            probes.append(part)
    return dataclasses.replace(cfg, probe="+".join(probes))


def dense_inputs(shape, T, row_unit):
    """The shared expert as a one-expert grouped GEMM over T contiguous rows."""
    import torch
    H, I = shape.hidden, shape.shared_intermediate
    C = -(-T // row_unit) * row_unit
    index = np.where(np.arange(C) < T, np.arange(C), -1).astype(np.int32)
    bf, dev = torch.bfloat16, "cuda"
    return dict(
        x=torch.randn(T, H, device=dev, dtype=bf),
        wg=torch.randn(1, I, H, device=dev, dtype=bf) * H ** -0.5,
        wu=torch.randn(1, I, H, device=dev, dtype=bf) * H ** -0.5,
        wd=torch.randn(1, H, I, device=dev, dtype=bf) * I ** -0.5,
        index=torch.from_numpy(index).to(dev),
        off=torch.tensor([0, C], dtype=torch.int32, device=dev),
        num_rows=torch.tensor([C], dtype=torch.int32, device=dev),
        hidden=torch.empty(C, I, device=dev, dtype=bf), y=torch.empty(C, H, device=dev, dtype=bf))


def torch_steps(d, dense):
    """(gate_up, down) of the baseline on the same problem."""
    import torch
    I = d["wg"].shape[1]
    if dense:
        x, w_gu, wd = d["x"], torch.cat([d["wg"][0], d["wu"][0]]).t(), d["wd"][0].t()
        h = torch.empty(x.shape[0], I, device="cuda", dtype=x.dtype)

        def gate_up():
            g, u = torch.mm(x, w_gu).split(I, dim=1)
            h.copy_(torch.nn.functional.silu(g) * u)
        return gate_up, lambda: torch.mm(h, wd)
    counts = d["counts"]
    c16 = -(-counts // 16) * 16
    offs = torch.from_numpy(np.cumsum(c16).astype(np.int32)).cuda()
    x16 = torch.randn(int(c16.sum()), d["x"].shape[1], device="cuda", dtype=d["x"].dtype)
    w_gu = torch.cat([d["wg"], d["wu"]], dim=1).transpose(1, 2)
    h = torch.empty(x16.shape[0], I, device="cuda", dtype=x16.dtype)

    def gate_up():
        g, u = torch._grouped_mm(x16, w_gu, offs=offs).split(I, dim=1)
        h.copy_(torch.nn.functional.silu(g) * u)
    return gate_up, lambda: torch._grouped_mm(h, d["wd"].transpose(1, 2), offs=offs)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="kimi-k2.7")
    ap.add_argument("--tokens", default="4096", help="tokens per rank, comma-separated")
    ap.add_argument("--variants", default=VARIANTS)
    ap.add_argument("--dense", default="deepseek-v4-pro",
                    help="presets whose dense shared expert is probed too ('' for none)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default="benchmarks/results/probe_gemm.json")
    args = ap.parse_args(argv)
    import torch

    from mok_comm.layer import layer_gemm
    from mok_core.config import preset
    cases = [(p, False, T) for T in map(int, args.tokens.split(","))
             for p in args.presets.split(",")]
    cases += [(p, True, T) for T in map(int, args.tokens.split(","))
              for p in args.dense.split(",") if p]
    rows = []
    for name, dense, T in cases:
        shape = preset(name, ep_size=2)
        base = layer_gemm(shape, T)
        if dense:
            d = dense_inputs(shape, T, base.row_unit)
            flops = 6.0 * T * shape.hidden * shape.shared_intermediate
        else:
            d = ffn_inputs(name, T, "uniform", base.row_unit, np.random.default_rng(0))
            flops = 6.0 * d["rows"] * shape.hidden * shape.intermediate
        case = f"{name} {'shared (dense)' if dense else 'routed'} T={T}"
        steps = {"torch": torch_steps(d, dense)}
        configs = {}
        for v in args.variants.split(","):
            try:
                cfg = variant_config(base, v)
                progress(f"{case} {v}: {cfg}")
                steps[v] = ffn_steps(d, cfg)
                for f in steps[v]:                       # compile (and fail) here
                    f()
                configs[v] = cfg
            except Exception as exc:                     # keep the probe going
                progress(f"  failed: {type(exc).__name__}: {exc}")
                steps.pop(v, None)
        # every variant's two GEMMs and torch's in turns: a drift of the machine over the
        # case hits them all alike (one variant after another, the spread between bursts
        # was larger than the effects probed -- NOTES, session 10)
        # (graph replays: device time; torch eagerly too, as in bench_ffn -- its best)
        t = interleaved_ms({f"{v} {g}": f for v, pair in steps.items()
                            for g, f in zip(("gate_up", "down"), pair)}, args.iters,
                           eager=("torch gate_up", "torch down"))
        for v in steps:
            ms = (best_ms(*t[f"{v} gate_up"]), best_ms(*t[f"{v} down"]))
            row = {"case": case, "variant": v, "gate_up_ms": ms[0], "down_ms": ms[1],
                   "tflops": flops / sum(ms) / 1e9, "gpu": gpu_name()}
            if v in configs:
                row["gemm"] = str(configs[v])
            rows.append(row)
        write_json(args.out, rows)
        d = steps = t = None                  # the steps' closures hold d's tensors too
        torch.cuda.empty_cache()
    write_json(args.out, rows)
    from mok_core import cuda_compat
    for (_, cluster, block, smem), n in cuda_compat._MAX_CLUSTERS.items():
        progress(f"resident clusters of {cluster} x {block} threads, {smem} B shared: {n}")
    print(table(rows, ["case", "variant", "gate_up_ms", "down_ms", "tflops"]))
    return rows


if __name__ == "__main__":
    main()
