"""What bounds the FP8 GEMM: its kernels at real shapes, for Nsight Compute or timed in turns.

    ncu --clock-control none --kernel-name-base demangled --kernel-name regex:sm90_fp8 \
        --section SpeedOfLight --section WarpStateStats ... \
        python benchmarks/probes/probe_fp8_ncu.py            # each kernel launched twice
    python benchmarks/probes/probe_fp8_ncu.py --time         # CUDA-graph replays in turns

Shapes (``NCU_SHAPES``, default ``long,ffn``; rows padded to 128): ``long`` = gate|up (K =
7168, N = 2I = 4096) over 16 experts x ~1365 rows (kimi-k2.7's at EP 8, 8192 tokens/rank),
``ffn`` = the same over 48 experts x ~373 rows (kimi-k2.7 at EP 2, 8192 tokens/rank: 3 row
tiles an expert), ``down`` = K = 2048, N = 7168 over those 48 experts; qwen3.5-397b's at EP 2,
8192 tokens/rank (256 experts x ~320 rows): ``qgu`` K = 4096, N = 2048 and ``qdown`` K = 1024,
N = 4096. Per shape: ``fp8_gemm``
and ``fp8_gate_up_swiglu`` (not for ``down``) on each tile of ``FP8_TILES`` (default
``256,128``: 128 x 256 with 3 stages -- the library's --, 128 x 128 with 4; ``192``: 192 x 128
with 4, ``launch_fp8_gemm(bm=192)``), each into its own
output (``--time`` prints whether it is bit-equal to the first tile's), and our bf16 wgmma
GEMM (``down``) on
bf16 operands of the same size. ``FP8_PARTS`` (``--time``; e.g. ``no-epi,no-store``): the
plain kernel on the first tile built again with its epilogue left out (``no-epi``: the
promotions and scale reads then go too, dead code), staging its tile without storing it
(``no-store``) or promoting with every factor 1 (``no-scale``: no scale read in the compute
warps) -- ``sm90_fp8``'s globals replaced while it is built and compiled --, timed in the same
turns (HOPPER.md: time variants that leave a stage out); they write nothing, or wrong values. A probe: it prints, it writes nothing. Its findings:
docs/perf.md, "What bounds the FP8 GEMM".
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _epilogue_factory(part):
    """A stand-in for ``make_coalesced_epilogue`` leaving the epilogue (``no-epi``) or its
    stores (``no-store``: the tile staged, its NaN/Inf fold kept alive) out."""
    from numba import uint32

    from mok_core.cuda_compat import kjit
    from mok_core.gemm.epilogue import make_stage_tile
    from mok_core.intrinsics import st_shared_u32, syncwarp

    def make(bn, swiglu_epilogue=False, save_pre=False, push=False):
        stage_tile = make_stage_tile(False)
        stride = 2 * bn + 16

        @kjit(device=True, inline="always")
        def epilogue(smem, acc, out, grow0, m0, n0, e, N, rows, epi0, lane, frag_row,
                     frag_col, limit, errors, nf_tensor, nf_rank, pre, route):
            if part == "no-store":
                bad = stage_tile(acc, (uint32(0), uint32(0)),
                                 (smem, frag_row, frag_col, limit, epi0, stride))
                syncwarp()
                if (bad[0] | bad[1]) == uint32(0x9E3779B9):     # never: keeps the folds
                    st_shared_u32(smem, epi0, bad[0])
        return epilogue
    return make


def _unit_scales(arity):
    """A stand-in for ``sm90_fp8._slice_scales`` (of ``arity`` arguments, whichever tree's)
    that reads nothing: every factor 1."""
    from numba import float32

    from mok_core.cuda_compat import kjit
    args = ", ".join(f"a{i}" for i in range(arity))
    ns = {"float32": float32}
    exec(f"def unit({args}):\n    one = float32(1.0)\n    return one, one, one, one", ns)
    return kjit(device=True, inline="always")(ns["unit"])


def _part_patches(part):
    """{name: replacement} among ``sm90_fp8``'s globals for ``part`` (module docstring)."""
    import inspect

    from mok_core.gemm import sm90_fp8 as F
    if part in ("no-epi", "no-store"):
        return {"make_coalesced_epilogue": _epilogue_factory(part)}
    if part == "no-scale":
        arity = len(inspect.signature(F._slice_scales.py_func).parameters)
        return {"_slice_scales": _unit_scales(arity)}
    raise SystemExit(f"FP8_PARTS: unknown part {part!r}")


def _part_step(part, bn, stages, launch):
    """``launch()`` (a plain ``fp8_gemm`` of tile ``bn`` / ``stages``) on the kernel built
    with ``part``'s replacements (``probe_fp8_wgrad.patched_fp8_step``)."""
    from benchmarks.probes.probe_fp8_wgrad import patched_fp8_step
    from mok_core.gemm import sm90_fp8 as F
    return patched_fp8_step({(F, k): v for k, v in _part_patches(part).items()}, bn, stages,
                            False, launch)


def main():
    import numpy as np
    import torch
    from numba import cuda

    from benchmarks.bench_ffn import interleaved_ms
    from benchmarks.common import numba_stream
    from mok_core.gemm import default_gemm, down, fp8_gate_up_swiglu, fp8_gemm, launch_fp8_gemm
    TIME = "--time" in sys.argv
    TILES = os.environ.get("FP8_TILES", "256,128").split(",")
    PARTS = [p for p in os.environ.get("FP8_PARTS", "").split(",") if p]
    g = torch.Generator(device="cuda").manual_seed(0)

    def e4m3(*shape):                       # random finite e4m3 bytes (no 0x7F / 0xFF)
        b = torch.randint(0, 256, shape, device="cuda", dtype=torch.int32, generator=g)
        return torch.where((b & 0x7F) == 0x7F, b - 1, b).to(torch.uint8)

    shapes = [s for s in os.environ.get("NCU_SHAPES", "long,ffn").split(",") if s]
    for shape in shapes:
        E, per, K, N = {"long": (16, 1365, 7168, 4096), "ffn": (48, 373, 7168, 4096),
                        "down": (48, 373, 2048, 7168), "qgu": (256, 320, 4096, 2048),
                        "qdown": (256, 320, 1024, 4096)}[shape]
        rng = np.random.default_rng(0)
        counts = -(-rng.multinomial(E * per, np.ones(E) / E) // 128) * 128
        off = torch.tensor(np.concatenate([[0], np.cumsum(counts)]), dtype=torch.int32,
                           device="cuda")
        C = int(counts.sum())
        nr = torch.tensor([C], dtype=torch.int32, device="cuda")
        a, w = e4m3(C, K), e4m3(E, N, K)
        wg, wu = w[:, :N // 2].contiguous(), w[:, N // 2:].contiguous()   # (N // 2: 256 | it)
        a_s = torch.exp2(torch.rand(C, K // 128, device="cuda") * -4 - 6)
        w_s = torch.exp2(torch.rand(E, N // 128, K // 128, device="cuda") * -4 - 6)
        wg_s, wu_s = w_s[:, :N // 256].contiguous(), w_s[:, N // 256:].contiguous()
        out = torch.empty(C, N, device="cuda", dtype=torch.uint16)
        x16 = torch.randn(C, K, device="cuda").bfloat16().view(torch.uint16)
        w16 = (torch.randn(E, N, K, device="cuda") * K ** -0.5).bfloat16().view(torch.uint16)
        cfg = default_gemm(C / E)
        outs = {}

        def variant(swiglu, tile):
            """The GEMM (plain or SwiGLU) on tile "256" (128 x 256, 3 stages: the default) or
            "128" (128 x 128, 4 stages), into its own output."""
            o = torch.empty(C, N // 2 if swiglu else N, device="cuda", dtype=torch.uint16)
            outs[swiglu, tile] = o
            bn, stages = (256, 3) if tile == "256" else (128, 4)

            def step():
                if tile == "192":          # (no public entry takes bm: device views here)
                    v = cuda.as_cuda_array
                    launch_fp8_gemm(v(a), v(a_s), v(wg if swiglu else w),
                                    v(wg_s if swiglu else w_s), v(off), v(nr), v(o),
                                    w_up=v(wu) if swiglu else None,
                                    w_up_scale=v(wu_s) if swiglu else None, stages=4, bm=192,
                                    stream=numba_stream())
                elif swiglu:
                    fp8_gate_up_swiglu(a, a_s, wg, wg_s, wu, wu_s, off, nr, o, stages=stages,
                                       bn=bn, stream=numba_stream())
                else:
                    fp8_gemm(a, a_s, w, w_s, off, nr, o, stages=stages, bn=bn,
                             stream=numba_stream())
            return step
        steps = {f"fp8 {'swiglu' if sw else 'plain'} {tile}": variant(sw, tile)
                 for sw in ((False,) if shape.endswith("down") else (False, True))
                 for tile in TILES}
        bn0, stages0 = (256, 3) if TILES[0] == "256" else (128, 4)
        for part in PARTS:
            steps[f"fp8 plain {TILES[0]} {part}"] = _part_step(
                part, bn0, stages0, steps[f"fp8 plain {TILES[0]}"])
        steps["bf16 down"] = lambda: down(x16, w16, off, nr, out, config=cfg,
                                          stream=numba_stream())
        flop = 2.0 * C * K * N
        if TIME:                # CUDA-graph replays in turns: sustained, as in a step
            for fn in steps.values():
                fn()
            torch.cuda.synchronize()
            for (sw, tile), o in outs.items():
                if tile == TILES[0]:
                    continue
                print(f"{shape}: {'swiglu' if sw else 'plain'} {tile} bits == {TILES[0]}: "
                      f"{torch.equal(o, outs[sw, TILES[0]])}")
            t = interleaved_ms(steps, 20, eager=())
            for name, (graph_ms, _) in t.items():
                print(f"{shape:5s} rows={C} E={E} {name:15s} {graph_ms:7.3f} ms "
                      f"{flop / graph_ms / 1e9:6.0f} TFLOP/s "
                      f"x{t['bf16 down'][0] / graph_ms:.2f} vs bf16", flush=True)
        else:                   # one launch each after its compile: what ncu profiles
            for name, fn in steps.items():
                fn()
                fn()
                torch.cuda.synchronize()
        steps.clear()           # the next shape's tensors replace these
        outs.clear()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
