"""Where the routed weight gradients' time goes: the wgmma wgrad with one part left out, in turns.

    python benchmarks/probes/probe_wgrad_parts.py --presets qwen3.5-397b,glm-5.2 --tokens 4096

One GPU, EP 1 (``mok_torch.Layer`` on a local heap). After one forward and backward, the
layer's own routed operands (d_gu and the gathered x for gate/up; the gathered d_out and w h
for down) go through ``sm90_wgrad`` kernels built with one part replaced (module globals
patched while the factory runs):

    prod       the layer's kernel
    no-store   the epilogue stages its rows (and fences) but issues no TMA store (where the
               kernel stages half a tile at a time, the first half only: prod - no-store
               then counts the second half's staging and the wait before it too)
    no-epi     no epilogue at all (the wgmmas still run: they have side effects)
    no-mma     the K loop loads but multiplies nothing (zeros staged and stored)
    no-load    the producer issues no cp.async (the compute warpgroups multiply whatever
               the ring holds)
    a+b        both replacements (e.g. no-load+no-epi)
    unread     the layer's kernel on a gather index of -1s: the gathered operand (x for
               gate/up: the tile's 256 columns; d_out for down: its 128) zero-filled without
               a read, its index loads kept -- what that operand's L2 reads cost

Beside them, ``fill``: torch filling a bf16 tensor of the output's bytes (the write ceiling).

``--tiles 128x128s4,128x256s3`` times every variant at each of those tiles and ring depths
(default: the layer's).
``--profile``: the CUDA profiler runs over the timed launches only (``ncu
--profile-from-start off -k regex:^kernel``: the layer's own launches before are left out).

Each variant's time is the median of --iters CUDA-event timings, the variants in turns. The
differences say what overlaps and what does not (H200.md: time variants that leave a stage
out). A probe: it prints, it writes nothing; every variant but prod writes wrong gradients.
"""
from __future__ import annotations

import argparse
from functools import lru_cache
import os
import re
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

VARIANTS = ("prod", "no-store", "no-epi", "no-mma", "no-load", "unread")


def _patched_factories(variant):
    """{name: replacement} of ``sm90_wgrad``'s part factories for ``variant``."""
    if "+" in variant:
        out = {}
        for v in variant.split("+"):
            out.update(_patched_factories(v))
        return out
    from numba import uint32

    from mok_core.cuda_compat import kjit
    from mok_core.gemm import epilogue as epi
    from mok_core.intrinsics import fence_proxy_async, st_shared_u32, syncwarp, tuple_fold

    if variant == "no-load":
        def make_loader(cols, gather):
            @kjit(device=True, inline="always")
            def load(smem, dst, src, index, r, hi, ld, col):
                pass
            return load
        return {"_operand_loader": make_loader}
    if variant == "no-mma":
        def make_mma(bn):
            @kjit(device=True, inline="always")
            def mma_slice(acc, smem, da, db):
                return acc
            return mma_slice
        return {"_make_mma_slice": make_mma}
    @kjit(device=True, inline="always")
    def no_prefetch(smem, maps, side, grow0, n0, epi0, lane, frag_row, bar):
        pass                           # (bf16 outputs: ``make_epilogues``' is a no-op too)

    if variant == "no-epi":
        def make_epi(bm, bn, out_f32, accumulate, parts=1):
            @kjit(device=True, inline="always")
            def epilogue(smem, acc, maps, side, grow0, m0, n0, e, epi0, lane, frag_row,
                         errors, nf_tensor, nf_rank, bar, phase):
                pass
            return no_prefetch, epilogue
        return {"make_epilogues": make_epi}
    if variant == "no-store":
        def make_epi(bm, bn, out_f32, accumulate, parts=1):
            # (the staging holds a part of the tile: its first part staged)
            stage_tile = tuple_fold(epi._stage_swizzled_group, epi._part_layout(0, parts))

            @kjit(device=True, inline="always")
            def epilogue(smem, acc, maps, side, grow0, m0, n0, e, epi0, lane, frag_row,
                         errors, nf_tensor, nf_rank, bar, phase):
                q = lane // 4
                syncwarp()
                bad = stage_tile(acc, (uint32(0), uint32(0)),
                                 (smem, epi0 + q * 128 + 4 * (lane % 4), q))
                fence_proxy_async()
                syncwarp()
                if (bad[0] | bad[1]) == uint32(0x9E3779B9):     # never: keeps the folds
                    st_shared_u32(smem, epi0, bad[0])
            return no_prefetch, epilogue
        return {"make_epilogues": make_epi}
    assert variant in ("prod", "unread"), variant
    return {}


@lru_cache(maxsize=None)
def build(variant, tile, gather_a, gather_b):
    """The wgmma wgrad kernel of ``tile`` ((bm, bn, stages); bf16 output, no accumulate) with
    ``variant``."""
    from mok_core.gemm import sm90_wgrad as W
    if variant == "unread":
        return build("prod", tile, gather_a, gather_b)
    patches = _patched_factories(variant)
    saved = {k: getattr(W, k) for k in patches}
    try:
        for k, v in patches.items():
            setattr(W, k, v)
        bm, bn, stages = tile
        return W.make_wgmma_wgrad(bm, bn, stages, gather_a, gather_b, False, False)
    finally:
        for k, v in saved.items():
            setattr(W, k, v)


def _tile(spec):
    """'128x256s3' -> (128, 256, 3): the kernel's tile and ring stages."""
    m = re.fullmatch(r"(\d+)x(\d+)s(\d+)", spec)
    if m is None:
        raise SystemExit(f"--tiles: {spec!r} is not BMxBNsSTAGES")
    return tuple(int(v) for v in m.groups())


def probe(preset_name, T, iters, variants, tiles, profile=False):
    from dataclasses import replace

    import numpy as np
    import torch
    from numba import cuda

    import mok_torch
    from benchmarks.common import numba_stream
    from mok_comm import backward as B
    from mok_core import errors as err
    from mok_core.config import MoKConfig, preset
    from mok_core.gemm.sm90_wgrad import launch_with
    from mok_testing import synthetic
    from mok_torch.layer import tensor_view

    shape, dev = preset(preset_name, 1), "cuda"
    x, ids, w = synthetic.rank_inputs(shape, T, 0, dev)
    Wt = mok_torch.Weights(*synthetic.shared_weights(shape, dev),
                           *synthetic.local_expert_weights(shape, 0, dev))
    torch.manual_seed(0)                 # the same d_out in every process: bits comparable
    d_out = torch.randn(T, shape.hidden, device=dev).bfloat16()
    layer = mok_torch.Layer(shape, T, MoKConfig())
    ctx = layer.forward(x, ids, w, Wt)[1]
    grads = layer.backward(ctx, d_out, w, Wt)
    torch.cuda.synchronize()
    G = B.check_grads(layer, B.Grads(*(
        None if g is None else tensor_view(g, n, (torch.bfloat16, torch.float32))
        for g, n in zip(grads, B.Grads._fields))), False, T)       # device arrays
    o = B._rows(layer, False)
    g = layer.wgrad_gemm
    shapes = [_tile(t) for t in tiles] or [(g.bm, g.bn, g.stages)]
    s = numba_stream()
    I, H = shape.intermediate, shape.hidden
    # (name, a, a_index, b, b_index, out0, out1, m_split, output bytes)
    wbytes = shape.experts_per_rank * I * H * 2          # one expert weight tensor, bf16
    gemms = [("gate_up", o.d_gu, None, o.x, o.index, G.d_w_gate, G.d_w_up, I, 2 * wbytes),
             ("down", o.d_out, o.index, o.w_h, None, G.d_w_down, G.d_w_down, H, wbytes)]
    print(f"{preset_name} T={T} EP 1, wgrad (bm, bn, stages): {shapes}")
    if profile:
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
    for name, a, ai, b, bi, o0, o1, m_split, nbytes in gemms:
        # (the launch reads its grid off a config of the tile; the kernel its shared memory)
        unread = cuda.to_device(np.full(o.index.shape, -1, o.index.dtype))
        runs = [(f"{bm}x{bn}s{st} {v}", replace(g, bm=bm, bn=bn),
                 build(v, (bm, bn, st), ai is not None, bi is not None), v == "unread")
                for bm, bn, st in shapes for v in variants]
        calls = {key: (lambda k=k, c=c, u=u: launch_with(
                           lambda *_: k, c, s, a, unread if u and ai is not None else ai, b,
                           unread if u and bi is not None else bi, o.offsets, o.rows, o0, o1,
                           a.shape[1], b.shape[1], m_split, accumulate=False,
                           errors=layer.comm.errors, tensor=err.NF_WEIGHT_GRADS, rank=0))
                 for key, c, k, u in runs}
        fill = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=dev)
        calls["fill"] = lambda: fill.fill_(1.0)
        times = {key: [] for key in calls}
        for it in range(iters + 2):
            for v in calls:
                ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
                ev[0].record()
                calls[v]()
                ev[1].record()
                torch.cuda.synchronize()
                if it >= 2:
                    times[v].append(ev[0].elapsed_time(ev[1]))
        for v in calls:
            ms = statistics.median(times[v])
            print(f"  {name:8s} {v:20s} {ms:8.3f} ms  {nbytes / ms / 1e9:6.2f} TB/s of output")
        if variants[0] == "prod":            # the layer's kernel again: its bits, summed
            calls[runs[0][0]]()
            outs = [grads[B.Grads._fields.index(f)] for f in
                    (("d_w_gate", "d_w_up") if name == "gate_up" else ("d_w_down",))]
            words = [int(torch.sum(t.view(torch.int32), dtype=torch.int64)) for t in outs]
            print(f"  {name:8s} bits (int32 words summed) {words}")
    # the variants wrote wrong gradients and no error word is owed: drop the layer's flags
    torch.cuda.synchronize()
    if profile:
        torch.cuda.cudart().cudaProfilerStop()


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="qwen3.5-397b,glm-5.2")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--tiles", default="",
                    help="e.g. 128x128s4,128x256s3 (default: the layer's)")
    ap.add_argument("--profile", action="store_true", help="cudaProfilerStart/Stop around them")
    args = ap.parse_args(argv)
    tiles = [t for t in args.tiles.split(",") if t]
    for p in args.presets.split(","):
        probe(p, args.tokens, args.iters, args.variants.split(","), tiles, args.profile)


if __name__ == "__main__":
    main()
