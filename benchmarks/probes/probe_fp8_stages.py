"""The FP8 GEMM's tile width and ring depth: ``fp8_gemm`` (plain) and ``fp8_gate_up_swiglu``
at kimi-k2.7's routed gate|up shape (8192 tokens/rank of EP 8: 48 experts, ~1365 rows each
padded to 128, K = 7168, N = 2I = 4096) with 128-column tiles and STAGES = 3, 4, 5 and with
256-column tiles (3 stages: what fits), and our bf16 GEMM (``down``, the forward's wgmma
kernel, bf16 operands of the same size), all timed in turns as CUDA-graph replays; every
variant's output must be bit-equal to the first's. A probe: it prints, it writes nothing.

    python benchmarks/probes/probe_fp8_stages.py
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main():
    import numpy as np
    import torch

    from benchmarks.bench_ffn import interleaved_ms
    from benchmarks.common import numba_stream
    from mok_core.gemm import default_gemm, down, fp8_gate_up_swiglu, fp8_gemm
    E, K, N, per = 48, 7168, 4096, 1365
    rng = np.random.default_rng(0)
    counts = -(-rng.multinomial(E * per, np.ones(E) / E) // 128) * 128
    off = torch.tensor(np.concatenate([[0], np.cumsum(counts)]), dtype=torch.int32,
                       device="cuda")
    C = int(counts.sum())
    nr = torch.tensor([C], dtype=torch.int32, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)

    def e4m3(*shape):                       # random finite e4m3 bytes (no 0x7F / 0xFF)
        b = torch.randint(0, 256, shape, device="cuda", dtype=torch.int32, generator=g)
        return torch.where((b & 0x7F) == 0x7F, b - 1, b).to(torch.uint8)
    a, w = e4m3(C, K), e4m3(E, N, K)
    wg, wu = w[:, :N // 2], w[:, N // 2:].contiguous()
    wg = wg.contiguous()
    a_s = torch.exp2(torch.rand(C, K // 128, device="cuda") * -4 - 6)
    w_s = torch.exp2(torch.rand(E, N // 128, K // 128, device="cuda") * -4 - 6)
    wg_s, wu_s = w_s[:, :N // 256].contiguous(), w_s[:, N // 256:].contiguous()
    outs, steps = {}, {}
    variants = [(128, 3), (128, 4), (128, 5), (256, 3)]
    for bn, st in variants:
        out = torch.empty(C, N, device="cuda", dtype=torch.uint16)
        h = torch.empty(C, N // 2, device="cuda", dtype=torch.uint16)
        outs[bn, st] = (out, h)

        def plain(st=st, bn=bn, out=out):
            fp8_gemm(a, a_s, w, w_s, off, nr, out, stages=st, bn=bn, stream=numba_stream())

        def swiglu(st=st, bn=bn, h=h):
            fp8_gate_up_swiglu(a, a_s, wg, wg_s, wu, wu_s, off, nr, h, stages=st, bn=bn,
                               stream=numba_stream())
        plain()
        swiglu()
        steps[f"fp8 {bn} s{st}"] = plain
        steps[f"fp8 swiglu {bn} s{st}"] = swiglu
    torch.cuda.synchronize()
    for v in variants[1:]:
        for i in range(2):
            same = torch.equal(outs[v][i], outs[variants[0]][i])
            print(f"bn {v[0]} stages {v[1]} {'plain' if i == 0 else 'swiglu'} bits == "
                  f"bn 128 stages 3: {same}")
    x16 = torch.randn(C, K, device="cuda").bfloat16().view(torch.uint16)
    w16 = (torch.randn(E, N, K, device="cuda") * K ** -0.5).bfloat16().view(torch.uint16)
    y16 = torch.empty(C, N, device="cuda", dtype=torch.uint16)
    cfg = default_gemm(C / E)

    def bf16():
        down(x16, w16, off, nr, y16, config=cfg, stream=numba_stream())
    bf16()
    steps["bf16 down"] = bf16
    t = interleaved_ms(steps, 10, eager=())
    flop = 2.0 * C * K * N
    print(f"rows={C} K={K} N={N} E={E}")
    for name, (graph_ms, _) in t.items():
        print(f"  {name:18s} {graph_ms:7.3f} ms  {flop / graph_ms / 1e9:6.0f} TFLOP/s  "
              f"x{t['bf16 down'][0] / graph_ms:.2f} vs bf16")


if __name__ == "__main__":
    main()
