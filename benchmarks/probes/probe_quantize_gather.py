"""What the row quantizer's gather costs (``quantize_fp8(index=)``) and how the transposing
kernel compares: over the same x, timed in turns as CUDA-graph replays.

    direct        ``quantize_fp8(x)`` over the output's row count (no index)
    identity      the shipped gather with index = arange (the index's cost alone)
    gather        the shipped gather with the layout's index (runs of rows, padding -1)
    cols-direct / cols-gather   the transposed kernel (``quantize_cols_kernel``: the weight
                  gradients' operands, 128 x 128 blocks), direct and gathering

x is [rows, H] (one row per route, as ``bench_ffn``); the index puts them in expert order
with 128-row padding, kimi-k2.7 at 8192 tokens/rank, EP 2's rank 0. A probe: it prints, it
writes nothing. Its findings: docs/perf.md, FP8 ("The quantizer").

    python benchmarks/probes/probe_quantize_gather.py
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402


def layout(rows, experts, rng):
    """The expert-sorted index over ``rows`` routes: experts' runs of rows, each padded to
    128 with -1."""
    counts = rng.multinomial(rows, np.ones(experts) / experts)
    index = []
    start = 0
    for c in counts:
        index += list(range(start, start + c)) + [-1] * (-c % 128)
        start += c
    return np.array(index, np.int32)


def main():
    import torch

    from benchmarks.common import numba_stream as stream
    from mok_core.quantize import quantize_fp8
    rows, H, experts = 65288, 7168, 192
    rng = np.random.default_rng(0)
    index_np = layout(rows, experts, rng)
    C = index_np.size
    dev = "cuda"
    x = torch.randn(rows, H, device=dev).bfloat16().view(torch.uint16)
    index = torch.from_numpy(index_np).to(dev)
    ident = torch.arange(C, device=dev, dtype=torch.int32) % rows
    out = {k: (torch.empty(C, H, device=dev, dtype=torch.uint8),
               torch.empty(C, H // 128, device=dev, dtype=torch.float32))
           for k in ("direct", "identity", "gather")}
    x_c = torch.randn(C, H, device=dev).bfloat16().view(torch.uint16)   # direct: C rows

    def q(name, src, idx):
        def run():
            quantize_fp8(src, (1, 128), out=out[name][0], scales=out[name][1], index=idx,
                         stream=stream())
        return run

    cols = {k: (torch.empty(H, C, device=dev, dtype=torch.uint8),
                torch.empty(H // 128, C // 128, device=dev, dtype=torch.float32))
            for k in ("cols-direct", "cols-gather")}

    def qt(name, src, idx):
        def run():
            quantize_fp8(src, (128, 128), transpose=True, out=cols[name][0],
                         scales=cols[name][1], index=idx, stream=stream())
        return run
    steps = {"direct": q("direct", x_c, None), "identity": q("identity", x, ident),
             "gather": q("gather", x, index),
             "cols-direct": qt("cols-direct", x_c, None),
             "cols-gather": qt("cols-gather", x, index)}
    from benchmarks.bench_ffn import interleaved_ms
    t = interleaved_ms(steps, 20, eager=())
    moved = C * H * 3                                 # bf16 read + e4m3 written, ~
    for name, (ms, _) in t.items():
        print(f"  {name:9s} {ms:7.3f} ms  {moved / ms / 1e9:6.2f} TB/s")


if __name__ == "__main__":
    main()
