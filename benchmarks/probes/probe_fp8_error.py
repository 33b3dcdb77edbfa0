"""The FP8 layer's error budget, on a CPU: how far the FP8 layer's output and gradients can be
from float64 of the bf16 layer on random operands, whatever its kernels do right.

    python benchmarks/probes/probe_fp8_error.py --preset kimi-k2.7 --tokens 16

float64 emulation of ``MoKConfig(precision="fp8")``'s quantisation at a preset's real H and I
(``mok_core.quantize_reference``, bit-exact to the kernels' quantizer; every GEMM itself in
float64): x and the d_out rows 1 x 128, the expert weights (and their transposes) 128 x 128, h
= SiLU(g8) u8 in bf16 then 1 x 128, p = d_out8 W_down8 in bf16, [d_g | d_u] in bf16 then 1 x
128; the weight gradients' GEMMs on the FP8 path's activations (bf16 GEMMs: the layer's
default; ``fp8_wgrad`` adds the 0.037 of session 27's FP8 wgrad, docs/perf.md); the
shared expert exact in both (its bf16 roundings are not modelled: it only dilutes the output's
and d_x's error). Synthetic operands as ``mok_testing.synthetic`` draws them (x, d_out ~ N(0,
1), weights scaled by fan-in^-1/2), ``--tokens`` tokens all routed to the same ``topk`` experts
(the per-route error does not depend on which); dW_up is dW_gate's twin and not computed.

Columns: rel-L1 and cosine against float64 of the bf16 layer, for the layer as it runs (FP8
forward and data gradients) and with the backward's data gradients in bf16 (what the FP8 layer
was before them): which error comes from the forward's h, which from the backward. The GPU
suite's FP8 bounds (``tests/gpu/test_backward_gpu.py``) are read off this.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from mok_core.config import preset  # noqa: E402
from mok_core.quantize_reference import dequantize_fp8, quantize_fp8_reference  # noqa: E402


def bf16(a):
    """Round to bf16 (nearest even), as float64."""
    b = np.asarray(a, np.float32).view(np.uint32)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.astype(np.uint32).view(np.float32).astype(np.float64)


def fp8(a, block):
    """a's values after quantising in ``block``s (float64 of the e4m3 bytes x scales)."""
    data, scales = quantize_fp8_reference(np.asarray(a, np.float32), block)
    return dequantize_fp8(data, scales, block)


def silu(g):
    return g / (1 + np.exp(-g))


def swiglu_grads(p, g, u):
    """(d_g, d_u) of SiLU(g) u at the upstream gradient p."""
    s = 1 / (1 + np.exp(-g))
    return p * u * s * (1 + g * (1 - s)), p * silu(g)


def rel(a, b):
    return float(np.abs(a - b).sum() / np.abs(b).sum())


def cosine(a, b):
    return float((a * b).sum() / (np.linalg.norm(a) * np.linalg.norm(b)))


def budget(H, I, I_s, k, n, seed=0):
    """{gradient name: {variant: (rel-L1, cosine)}} for n tokens of top-k routes."""
    rng = np.random.default_rng(seed)
    normal = rng.standard_normal
    x, d_out = bf16(normal((n, H))), bf16(normal((n, H)))
    rw = rng.random((n, k))
    rw /= rw.sum(1, keepdims=True)
    x8, d_out8 = fp8(x, (1, 128)), fp8(d_out, (1, 128))
    sg, su = (bf16(normal((I_s, H)) * H ** -0.5) for _ in range(2))
    sd = bf16(normal((H, I_s)) * I_s ** -0.5)
    g_s, u_s = x @ sg.T, x @ su.T
    dg_s, du_s = swiglu_grads(d_out @ sd, g_s, u_s)
    base = {"out": silu(g_s) * u_s @ sd.T, "d_x": dg_s @ sg + du_s @ su}
    variants = ("fp8", "fp8_forward")
    got = {v: {name: a.copy() for name, a in base.items()} for v in variants}
    ref = {name: a.copy() for name, a in base.items()}
    ref["d_router_weights"] = np.zeros((n, k))
    for v in variants:
        got[v]["d_router_weights"] = np.zeros((n, k))
    weight_errs = {v: {"d_w_gate": [], "d_w_down": []} for v in variants}
    for j in range(k):
        wg, wu = (bf16(normal((I, H)) * H ** -0.5) for _ in range(2))
        wd = bf16(normal((H, I)) * I ** -0.5)
        wg8, wu8, wd8 = (fp8(w, (128, 128)) for w in (wg, wu, wd))
        w = rw[:, j:j + 1]
        g, u = x @ wg.T, x @ wu.T
        h = silu(g) * u
        p = d_out @ wd
        d_g, d_u = swiglu_grads(w * p, g, u)
        ref["out"] += w * (h @ wd.T)
        ref["d_router_weights"][:, j] = (p * h).sum(1)
        ref["d_x"] += d_g @ wg + d_u @ wu
        g8, u8 = x8 @ wg8.T, x8 @ wu8.T
        h8 = bf16(silu(g8) * u8)
        y8 = fp8(h8, (1, 128)) @ wd8.T
        for v in variants:
            got[v]["out"] += w * y8
            if v == "fp8":                # the data gradients on the transposed FP8 copies
                p8 = bf16(d_out8 @ fp8(wd.T.copy(), (128, 128)).T)
                dg8, du8 = (bf16(a) for a in swiglu_grads(w * p8, g8, u8))
                gu8 = fp8(np.concatenate([dg8, du8], 1), (1, 128))
                got[v]["d_x"] += (gu8[:, :I] @ fp8(wg.T.copy(), (128, 128)).T
                                  + gu8[:, I:] @ fp8(wu.T.copy(), (128, 128)).T)
            else:
                p8 = bf16(d_out @ wd)
                dg8, du8 = (bf16(a) for a in swiglu_grads(w * p8, g8, u8))
                got[v]["d_x"] += dg8 @ wg + du8 @ wu
            got[v]["d_router_weights"][:, j] = (p8 * h8).sum(1)
            # the weight gradients: bf16 GEMMs of the FP8 path's activations (the default)
            weight_errs[v]["d_w_down"].append(((w * d_out).T @ h8, (w * d_out).T @ h))
            weight_errs[v]["d_w_gate"].append((dg8.T @ x, d_g.T @ x))
    table = {}
    for name in ("out", "d_x", "d_router_weights"):
        table[name] = {v: (rel(got[v][name], ref[name]), cosine(got[v][name], ref[name]))
                       for v in variants}
    for name in ("d_w_gate", "d_w_down"):      # the worst expert
        table[name] = {v: (max(rel(a, b) for a, b in weight_errs[v][name]),
                           min(cosine(a, b) for a, b in weight_errs[v][name]))
                       for v in variants}
    return table


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="kimi-k2.7")
    ap.add_argument("--tokens", type=int, default=16)
    args = ap.parse_args()
    s = preset(args.preset)
    table = budget(s.hidden, s.intermediate, s.shared_intermediate, s.topk, args.tokens)
    print(f"{args.preset} (H {s.hidden}, I {s.intermediate}, top-{s.topk}), {args.tokens} tokens:"
          " rel-L1 / cosine against float64 of the bf16 layer")
    print("| | FP8 layer | FP8 forward, bf16 data gradients |\n|---|---|---|")
    for name, row in table.items():
        print(f"| {name} | " + " | ".join(f"{r:.4f} / {c:.6f}" for r, c in row.values()) + " |")


if __name__ == "__main__":
    main()
