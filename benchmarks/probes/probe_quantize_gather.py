"""Why the row quantizer is slower gathering (``quantize_fp8(index=)``: 1.2 ms at kimi's
expert-sorted rows, against 0.61 ms direct, docs/perf.md FP8): four ways over the same x,
timed in turns as CUDA-graph replays, every gathered output bit-equal to the shipped one.

    direct     ``quantize_fp8(x)`` over the output's row count (no index)
    identity   the shipped gather with index = arange (the index's cost alone)
    gather     the shipped gather with the layout's index (runs of rows, padding -1)
    prefetch   a candidate: each pass's source rows loaded a pass ahead, so a pass's x loads
               wait for one memory latency instead of two (the index load, then the row)

x is [rows, H] (one row per route, as ``bench_ffn``); the index puts them in expert order
with 128-row padding, kimi-k2.7 at 8192 tokens/rank, EP 2's rank 0. A probe: it prints, it
writes nothing. ``--tiny``: a small shape, bit-equality only.

    python benchmarks/probes/probe_quantize_gather.py
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402
from numba import cuda, int64, uint32, uint64  # noqa: E402

from mok_core.cuda_compat import flat_view, kjit, launch, multiprocessor_count  # noqa: E402
from mok_core.quantize import (_ROW_BLOCKS_PER_SM, _ROW_ITEMS, THREADS,  # noqa: E402
                               row_pass)


@kjit(device=True, inline="always")
def _source(index, item, items, groups):
    """Item ``item``'s source row (-1: a padding row, or past the items)."""
    src = int64(-1)
    if item < items:
        src = int64(index[uint64(uint32(item) // uint32(groups))])
    return src


@kjit(device=True, inline="always")
def _load_from(x64, src, item, items, groups, lane):
    """The shipped ``_row_load`` with the source row already known."""
    w = uint64(0)
    if item < items and src >= 0:
        row = int64(uint32(item) // uint32(groups))
        w = x64[uint64(item * 32 + lane + (src - row) * (groups * 32))]
    return uint32(w), uint32(w >> uint64(32))


@kjit
def prefetch_kernel(x64, index, items, groups, out32, scales_f32, scales_u8, errors, tensor,
                    rank):
    """``quantize_rows_kernel`` gathering, fp32 scales, no row cap -- with the source rows of
    pass p + 1 loaded while pass p's x loads are issued."""
    lane = int64(cuda.threadIdx.x % 32)
    warps = int64(cuda.gridDim.x) * (THREADS // 32)
    i = int64(cuda.blockIdx.x) * (THREADS // 32) + cuda.threadIdx.x // 32
    step = _ROW_ITEMS * warps
    a0, b0 = _load_from(x64, _source(index, i, items, groups), i, items, groups, lane)
    a1, b1 = _load_from(x64, _source(index, i + warps, items, groups), i + warps, items,
                        groups, lane)
    a2, b2 = _load_from(x64, _source(index, i + 2 * warps, items, groups), i + 2 * warps,
                        items, groups, lane)
    a3, b3 = _load_from(x64, _source(index, i + 3 * warps, items, groups), i + 3 * warps,
                        items, groups, lane)
    s0 = _source(index, i + step, items, groups)
    s1 = _source(index, i + step + warps, items, groups)
    s2 = _source(index, i + step + 2 * warps, items, groups)
    s3 = _source(index, i + step + 3 * warps, items, groups)
    while i < items:
        n = i + step
        c0, d0 = _load_from(x64, s0, n, items, groups, lane)
        c1, d1 = _load_from(x64, s1, n + warps, items, groups, lane)
        c2, d2 = _load_from(x64, s2, n + 2 * warps, items, groups, lane)
        c3, d3 = _load_from(x64, s3, n + 3 * warps, items, groups, lane)
        s0 = _source(index, n + step, items, groups)
        s1 = _source(index, n + step + warps, items, groups)
        s2 = _source(index, n + step + 2 * warps, items, groups)
        s3 = _source(index, n + step + 3 * warps, items, groups)
        row_pass(a0, b0, a1, b1, a2, b2, a3, b3, i, warps, items, groups, out32, scales_f32,
                 scales_u8, False, errors, tensor, rank, lane)
        a0, b0, a1, b1, a2, b2, a3, b3 = c0, d0, c1, d1, c2, d2, c3, d3
        i = n


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
    from mok_core.errors_kernels import scratch_error_word
    from mok_core.quantize import quantize_fp8
    p = argparse.ArgumentParser()
    p.add_argument("--tiny", action="store_true")
    args = p.parse_args()
    rows, H, experts = (300, 256, 4) if args.tiny else (65288, 7168, 192)
    rng = np.random.default_rng(0)
    index_np = layout(rows, experts, rng)
    C = index_np.size
    dev = "cuda"
    x = torch.randn(rows, H, device=dev).bfloat16().view(torch.uint16)
    index = torch.from_numpy(index_np).to(dev)
    ident = torch.arange(C, device=dev, dtype=torch.int32) % rows
    out = {k: (torch.empty(C, H, device=dev, dtype=torch.uint8),
               torch.empty(C, H // 128, device=dev, dtype=torch.float32))
           for k in ("direct", "identity", "gather", "prefetch")}
    x_c = torch.randn(C, H, device=dev).bfloat16().view(torch.uint16)   # direct: C rows
    word = scratch_error_word()
    items = C * (H // 128)
    grid = min(multiprocessor_count() * _ROW_BLOCKS_PER_SM,
               -(-items // (THREADS // 32 * _ROW_ITEMS)))

    def q(name, src, idx):
        def run():
            quantize_fp8(src, (1, 128), out=out[name][0], scales=out[name][1], index=idx,
                         stream=stream())
        return run

    def prefetch():
        o, s = out["prefetch"]
        launch(prefetch_kernel, grid, THREADS, stream(), 0, flat_view(x, np.uint64), index,
               np.int64(items), np.int64(H // 128), flat_view(o, np.uint32), flat_view(s),
               flat_view(s, np.uint8), word, np.int32(0), np.int32(0))
    steps = {"direct": q("direct", x_c, None), "identity": q("identity", x, ident),
             "gather": q("gather", x, index), "prefetch": prefetch}
    for f in steps.values():
        f()
    torch.cuda.synchronize()
    same = all(torch.equal(a, b) for a, b in zip(out["gather"], out["prefetch"]))
    print(f"rows={rows} C={C} H={H}: prefetch bits == gather bits: {same}")
    if args.tiny:
        return
    from benchmarks.bench_ffn import interleaved_ms
    t = interleaved_ms(steps, 20, eager=())
    moved = C * H * 3                                 # bf16 read + e4m3 written, ~
    for name, (ms, _) in t.items():
        print(f"  {name:9s} {ms:7.3f} ms  {moved / ms / 1e9:6.2f} TB/s")


if __name__ == "__main__":
    main()
