"""The routed weight gradients in FP8 against ours in bf16, at real shapes, timed in turns.

    python benchmarks/probes/probe_fp8_wgrad.py [--presets kimi-k2.7,qwen3.5-397b]
                                                [--tokens 8192] [--iters 10]

Rank 0's routed experts at EP 2 (``bench_ffn.ffn_inputs``: uniform routing of 2T tokens,
segments padded to 128 rows), its two weight gradients:

    gate|up   dW_gate, dW_up [E, I, H]: sum over rows of d_gu[r, m] x[index[r], n]
    down      dW_down [E, H, I]:        sum over rows of d_out[index[r], m] h[r, n]

each as ``bf16`` (``wgrad`` on ``WGRAD_WGMMA_GEMM``, x / d_out gathered as
the layer does) and ``fp8`` (``fp8_wgrad`` on the operands already transposed and quantised:
A 1 x 128, B 128 x 128 along the rows), with ``quant`` the two transposed quantisations fp8
needs (``quantize_fp8(transpose=True)``, x and d_out gathered through the index on the way).
Prints ms, TFLOP/s, bf16 / fp8 and bf16 / (fp8 + quant), and rel-L1 of fp8 against bf16 over
the first expert's gradient. A probe: it prints, it writes nothing.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main():
    import numpy as np
    import torch

    from benchmarks.bench_ffn import ffn_inputs, interleaved_ms
    from benchmarks.common import numba_stream
    from mok_core.gemm import fp8_wgrad, wgrad
    from mok_core.quantize import quantize_fp8
    from mok_comm.layer import WGRAD_WGMMA_GEMM
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="kimi-k2.7,qwen3.5-397b")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    u16 = torch.uint16
    for preset in args.presets.split(","):
        d = ffn_inputs(preset, args.tokens, "uniform", 128, np.random.default_rng(0))
        for w in ("wg", "wu", "wd", "y"):
            del d[w]                                  # only the routed operands are needed
        H, I = d["shape"].hidden, d["shape"].intermediate
        C, E = d["C"], len(d["counts"])
        index, off, nr = d["index"], d["off"], d["num_rows"]
        pad = (index < 0)[:, None]
        x = d["x"]                                    # [rows, H]: the tokens, gathered
        d_out = torch.randn_like(x)                   # [rows, H], gathered alike
        d_gu = torch.randn(C, 2 * I, device="cuda", dtype=torch.bfloat16).masked_fill(pad, 0)
        h = d["hidden"].normal_().masked_fill(pad, 0)  # [C, I]
        del d
        outs = {n: torch.empty(E, *s, device="cuda", dtype=torch.bfloat16)
                for n, s in (("g16", (I, H)), ("u16", (I, H)), ("d16", (H, I)),
                             ("gu8", (2 * I, H)), ("d8", (H, I)))}
        q = {}

        def quant(name, x, block, gather):   # into the first call's buffers (graph replays)
            o, sc = q.get(name, (None, None))
            q[name] = quantize_fp8(x.view(u16), block, transpose=True, out=o, scales=sc,
                                   index=index if gather else None, num_rows=nr,
                                   stream=numba_stream())

        def quant_gu():
            quant("a_gu", d_gu, (1, 128), False)
            quant("b_gu", x, (128, 128), True)

        def quant_down():
            quant("a_d", d_out, (1, 128), True)
            quant("b_d", h, (128, 128), False)
        quant_gu()
        quant_down()
        torch.cuda.synchronize()
        steps = {
            "bf16 gate|up": lambda: wgrad(
                d_gu.view(u16), None, x.view(u16), index, off, nr, outs["g16"].view(u16),
                outs["u16"].view(u16), I, config=WGRAD_WGMMA_GEMM, stream=numba_stream()),
            "fp8 gate|up": lambda: fp8_wgrad(
                *q["a_gu"], *q["b_gu"], off, nr, outs["gu8"].view(u16),
                stream=numba_stream()),
            "quant gate|up": quant_gu,
            "bf16 down": lambda: wgrad(
                d_out.view(u16), index, h.view(u16), None, off, nr, outs["d16"].view(u16), None, H, config=WGRAD_WGMMA_GEMM, stream=numba_stream()),
            "fp8 down": lambda: fp8_wgrad(
                *q["a_d"], *q["b_d"], off, nr, outs["d8"].view(u16), stream=numba_stream()),
            "quant down": quant_down,
        }
        t = {n: g for n, (g, _) in interleaved_ms(steps, args.iters, eager=()).items()}
        torch.cuda.synchronize()
        rows = int((index >= 0).sum())
        for part, m in (("gate|up", 2 * I), ("down", H)):
            n = H if part == "gate|up" else I
            flop = 2.0 * rows * m * n
            b16, f8, qt = t[f"bf16 {part}"], t[f"fp8 {part}"], t[f"quant {part}"]
            if part == "gate|up":
                want = torch.cat([outs["g16"][0], outs["u16"][0]]).double()
                got = outs["gu8"][0].double()
            else:
                want, got = outs["d16"][0].double(), outs["d8"][0].double()
            rel = float((got - want).abs().sum() / want.abs().sum())
            print(f"{preset:15s} T={args.tokens} E={E} rows={rows} {part:8s} "
                  f"bf16 {b16:7.3f} ms ({flop / b16 / 1e9:4.0f} TFLOP/s)  "
                  f"fp8 {f8:7.3f} ms ({flop / f8 / 1e9:4.0f})  quant {qt:6.3f}  "
                  f"x{b16 / f8:.2f} kernel, x{b16 / (f8 + qt):.2f} with quant  "
                  f"rel-L1 {rel:.4f}", flush=True)
        outs.clear()
        q.clear()
        steps.clear()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
