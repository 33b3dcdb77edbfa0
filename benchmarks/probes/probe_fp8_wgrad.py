"""The routed weight gradients in FP8 against ours in bf16, at real shapes, timed in turns.

    python benchmarks/probes/probe_fp8_wgrad.py [--presets kimi-k2.7,qwen3.5-397b]
                                                [--tokens 8192] [--iters 10]
                                                [--variants 256s3,128s4,256s3f32,256s3acc]
                                                [--acc-tiles 256s3,128s4]
                                                [--profile] [--quant-split]
                                                [--parts prod,hoisted,no-store,no-epi,...]

Rank 0's routed experts at EP 2 (``bench_ffn.ffn_inputs``: uniform routing of 2T tokens,
segments padded to 128 rows), its two weight gradients:

    gate|up   dW_gate, dW_up [E, I, H]: sum over rows of d_gu[r, m] x[index[r], n]
    down      dW_down [E, H, I]:        sum over rows of d_out[index[r], m] h[r, n]

each as ``bf16`` (``wgrad`` on ``WGRAD_WGMMA_GEMM``, x / d_out gathered as
the layer does) and ``fp8`` (``fp8_wgrad`` on the operands already transposed and quantised:
A 1 x 128, B 128 x 128 along the rows), with ``quant`` the two transposed quantisations fp8
needs (``quantize_fp8(transpose=True)``, x and d_out gathered through the index on the way).
Prints ms, TFLOP/s, bf16 / fp8 and bf16 / (fp8 + quant), rel-L1 of fp8 against bf16 over
the first expert's gradient, and ``fill``: torch zeroing the gradient's bf16 bytes, the write
ceiling (at a few slices an expert the gradient's write, not its MMAs, bounds the kernel;
``fill / it`` for the bf16 variants). ``--variants``: the fp8 kernel's tile width, ring depth
and FP32 output instead of bf16 -- ``f32``, or ``acc``: added to (main-grad; then our bf16
kernel's FP32 accumulation, ``bf16acc``, is timed too, at ``WGRAD_MAIN_GRAD_GEMM``'s tile
or each of ``--acc-tiles``, beside ``add32``: torch adding to the FP32 gradient in place, the
same bytes read and written) --, each timed in the same turns (the first is the table's,
and not ``acc``). ``--parts``: the first
variant's kernel built with one part changed (``sm90_fp8``'s globals patched while it is built
and compiled; HOPPER.md: time variants that leave a stage out, take differences) --
``hoisted`` (the epilogue's staging addresses left to the compiler, which hoists them out of
the tile loop: ptxas spilled them; the code before ``per_iteration``), or a part left out:
``no-store`` (the epilogue stages its rows, no TMA store), ``no-epi`` (no epilogue:
``probe_wgrad_parts``' replacements), ``no-mma`` (the K loop multiplies nothing), ``no-load``
(the producer arrives on each full barrier with no TMA load); ``a+b`` both. ``--profile``:
instead of timing, one launch of each between cudaProfilerStart / Stop, for ``ncu
--profile-from-start off -k regex:^kernel``. ``--quant-split``: the four transposed
quantisations timed one by one (``q d_gu``, ``q x``, ``q d_out``, ``q h``), beside ``cast``:
torch casting the same bf16 operands to e4m3 untransposed (their bytes read and written once,
no scales: a copy's ceiling for them). A probe: it prints, it writes nothing; the parts
that leave something out write wrong gradients.
"""
from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _part_patches(part):
    """{name: replacement} among ``sm90_fp8``'s globals for ``part`` (module docstring;
    ``epilogue.NAME``: among ``mok_core.gemm.epilogue``'s)."""
    from benchmarks.probes.probe_wgrad_parts import _patched_factories
    from mok_core.cuda_compat import kjit
    from mok_core.intrinsics import mbarrier_arrive
    out = {}
    for p in part.split("+"):
        if p == "hoisted":
            @kjit(device=True, inline="always")
            def per_iteration(x):                      # a plain value: LLVM may hoist
                return x
            out["epilogue.per_iteration"] = per_iteration
        elif p in ("no-store", "no-epi"):
            out.update(_patched_factories(p))          # its make_epilogues
        elif p == "no-mma":
            @kjit(device=True, inline="always")
            def mma_slice(frag, smem, da, db):
                return frag
            out["mma_slice"] = mma_slice
        elif p == "no-load":
            @kjit(device=True, inline="always")
            def arrive(smem, bar, nbytes):             # the full barrier's one arrival
                mbarrier_arrive(smem, bar)

            @kjit(device=True, inline="always")
            def load(smem, dst, maps, elem, x, y, bar):
                pass
            out.update(mbarrier_arrive_expect_tx=arrive, tma_load_2d=load)
        elif p != "prod":
            raise SystemExit(f"--parts: unknown part {p!r}")
    return out


def patched_fp8_step(patches, bn, stages, wgrad, launch):
    """A step running ``launch()`` (an ``sm90_fp8`` GEMM call of tile ``bn`` / ``stages``,
    bf16 out; WGRAD's with ``wgrad``) on the kernel built while ``patches`` ({(module, name):
    value}) apply -- set while it is built and first compiled --, handed to the launch in
    place of the library's cached kernel."""
    from mok_core.gemm import sm90_fp8 as F
    kern = []

    def step():
        active = {} if kern else patches
        saved = {k: getattr(*k) for k in active}
        cached = F._kernel
        try:
            for (m, k), v in active.items():
                setattr(m, k, v)
            if not kern:
                kern.append(F.make_fp8_gemm(stages, False, bn, False, False, wgrad))
            F._kernel = lambda *args: kern[0]
            launch()                                  # (the first call compiles it here)
        finally:
            F._kernel = cached
            for (m, k), v in saved.items():
                setattr(m, k, v)
    return step


def _part_step(part, bn, stages, launch):
    """``patched_fp8_step`` of the WGRAD kernel with ``part`` left out."""
    from mok_core.gemm import epilogue as EPI
    from mok_core.gemm import sm90_fp8 as F

    def where(k):
        return (EPI, k.split(".")[1]) if k.startswith("epilogue.") else (F, k)
    return patched_fp8_step({where(k): v for k, v in _part_patches(part).items()}, bn, stages,
                            True, launch)


def main():
    import numpy as np
    import torch

    from benchmarks.bench_ffn import ffn_inputs, interleaved_ms
    from benchmarks.common import numba_stream
    from mok_core.gemm import GemmConfig, fp8_wgrad, wgrad
    from mok_core.quantize import quantize_fp8
    from mok_comm.layer import WGRAD_MAIN_GRAD_GEMM, WGRAD_WGMMA_GEMM
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="kimi-k2.7,qwen3.5-397b")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--variants", default="256s3")
    ap.add_argument("--acc-tiles", default="")
    ap.add_argument("--parts", default="")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--quant-split", action="store_true")
    args = ap.parse_args()
    variants = {}
    for v in args.variants.split(","):
        m = re.fullmatch(r"(\d+)s(\d+)(f32|acc)?", v)
        if m is None:
            raise SystemExit(f"--variants: {v!r} is not BNsSTAGES[f32|acc]")
        variants[v] = (int(m[1]), int(m[2]), m[3] or "bf16")
    if next(iter(variants.values()))[2] == "acc":
        raise SystemExit("--variants: the first (the rel-L1's) must not accumulate")
    acc = any(v[2] == "acc" for v in variants.values())
    acc_tiles = {}                            # the bf16 kernel's tiles for FP32 added to
    for v in filter(None, args.acc_tiles.split(",")):
        m = re.fullmatch(r"(\d+)s(\d+)", v)
        if m is None:
            raise SystemExit(f"--acc-tiles: {v!r} is not BNsSTAGES")
        acc_tiles[v] = GemmConfig(bm=128, bn=int(m[1]), bk=64, wm=2, wn=1,
                                  stages=int(m[2]), mma="wgmma")
    acc_tiles = acc_tiles or {"": WGRAD_MAIN_GRAD_GEMM}
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
        if any(v[2] != "bf16" for v in variants.values()):
            outs.update({n: torch.zeros(E, *s, device="cuda", dtype=torch.float32)
                         for n, s in (("gu32", (2 * I, H)), ("d32", (H, I)))})
        if acc:                               # the bf16 kernel's FP32 outputs, split at I
            outs.update({n: torch.zeros(E, I, H, device="cuda", dtype=torch.float32)
                         for n in ("g32", "u32")})
        q = {}

        def quant(name, x, block, gather):   # into the first call's buffers (graph replays)
            o, sc = q.get(name, (None, None))
            q[name] = quantize_fp8(x.view(u16), block, transpose=True, out=o, scales=sc,
                                   index=index if gather else None, num_rows=nr,
                                   stream=numba_stream())

        # each weight gradient's two transposed quantisations: operand -> (its buffers' name,
        # bf16 rows, block, gathered through the index)
        quants = {"d_gu": ("a_gu", d_gu, (1, 128), False), "x": ("b_gu", x, (128, 128), True),
                  "d_out": ("a_d", d_out, (1, 128), True), "h": ("b_d", h, (128, 128), False)}

        def quant_gu():
            quant(*quants["d_gu"])
            quant(*quants["x"])

        def quant_down():
            quant(*quants["d_out"])
            quant(*quants["h"])
        quant_gu()
        quant_down()
        torch.cuda.synchronize()
        steps = {
            "bf16 gate|up": lambda: wgrad(
                d_gu.view(u16), None, x.view(u16), index, off, nr, outs["g16"].view(u16),
                outs["u16"].view(u16), I, config=WGRAD_WGMMA_GEMM, stream=numba_stream()),
            "quant gate|up": quant_gu,
            "bf16 down": lambda: wgrad(
                d_out.view(u16), index, h.view(u16), None, off, nr, outs["d16"].view(u16),
                None, H, config=WGRAD_WGMMA_GEMM, stream=numba_stream()),
            "quant down": quant_down,
            # the write ceiling: torch filling the gradient's bytes (what no kernel beats)
            "fill gate|up": lambda: outs["gu8"].zero_(),
            "fill down": lambda: outs["d8"].zero_(),
        }

        if args.quant_split:
            cast = {n: torch.empty(v.shape, device="cuda", dtype=torch.float8_e4m3fn)
                    for n, v in (("d_gu", d_gu), ("x", x), ("h", h))}
            steps.update({f"q {o}": (lambda a=a: quant(*a)) for o, a in quants.items()})
            steps.update({
                "cast gate|up": lambda: (cast["d_gu"].copy_(d_gu), cast["x"].copy_(x)),
                "cast down": lambda: (cast["x"].copy_(d_out), cast["h"].copy_(h))})

        if acc:                               # main-grad: FP32 outputs added to
            def bf16acc(part, cfg):
                if part == "gate|up":
                    return lambda: wgrad(
                        d_gu.view(u16), None, x.view(u16), index, off, nr, outs["g32"],
                        outs["u32"], I, accumulate=True, config=cfg, stream=numba_stream())
                return lambda: wgrad(
                    d_out.view(u16), index, h.view(u16), None, off, nr, outs["d32"], None, H,
                    accumulate=True, config=cfg, stream=numba_stream())
            for tile, cfg in acc_tiles.items():
                for part in ("gate|up", "down"):
                    steps[f"bf16acc{tile} {part}"] = bf16acc(part, cfg)
            # the ceiling: torch adding to the FP32 gradient in place (its bytes read, written)
            steps["add32 gate|up"] = lambda: (outs["g32"].add_(1.0), outs["u32"].add_(1.0))
            steps["add32 down"] = lambda: outs["d32"].add_(1.0)

        def fp8_step(a, b, out, bn, stages, accumulate=False):
            return lambda: fp8_wgrad(*q[a], *q[b], off, nr, out, bn=bn, stages=stages,
                                     accumulate=accumulate, stream=numba_stream())
        for v, (bn, stages, kind) in variants.items():
            for part, a, b, o in (("gate|up", "a_gu", "b_gu", "gu"), ("down", "a_d", "b_d", "d")):
                out = outs[o + "8"].view(u16) if kind == "bf16" else outs[o + "32"]
                steps[f"fp8 {part} {v}"] = fp8_step(a, b, out, bn, stages, kind == "acc")
        bn0, stages0 = next(iter(variants.values()))[:2]
        for p in filter(None, args.parts.split(",")):
            for part, a, b, o in (("gate|up", "a_gu", "b_gu", "gu"), ("down", "a_d", "b_d", "d")):
                steps[f"part {part} {p}"] = _part_step(
                    p, bn0, stages0, fp8_step(a, b, outs[o + "8"].view(u16), bn0, stages0))
        if args.profile:
            for f in steps.values():             # compiled and run once, outside the profile
                f()
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStart()
            for f in steps.values():
                f()
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
            print(f"{preset}: profiled one launch each of {list(steps)}", flush=True)
            continue
        t = {n: g for n, (g, _) in interleaved_ms(steps, args.iters, eager=()).items()}
        first = next(iter(variants))
        f32_first = variants[first][2] == "f32"
        for part in ("gate|up", "down"):       # the rel-L1's: the first variant's again (the
            steps[f"fp8 {part} {first}"]()    # parts and later variants share its buffers)
        torch.cuda.synchronize()
        rows = int((index >= 0).sum())
        for part, m in (("gate|up", 2 * I), ("down", H)):
            n = H if part == "gate|up" else I
            flop = 2.0 * rows * m * n
            b16, f8, qt = t[f"bf16 {part}"], t[f"fp8 {part} {first}"], t[f"quant {part}"]
            if part == "gate|up":
                want = torch.cat([outs["g16"][0], outs["u16"][0]]).double()
                got = outs["gu32" if f32_first else "gu8"][0].double()
            else:
                want = outs["d16"][0].double()
                got = outs["d32" if f32_first else "d8"][0].double()
            rel = float((got - want).abs().sum() / want.abs().sum())
            print(f"{preset:15s} T={args.tokens} E={E} rows={rows} {part:8s} "
                  f"bf16 {b16:7.3f} ms ({flop / b16 / 1e9:4.0f} TFLOP/s)  "
                  f"fp8 {f8:7.3f} ms ({flop / f8 / 1e9:4.0f})  quant {qt:6.3f}  "
                  f"x{b16 / f8:.2f} kernel, x{b16 / (f8 + qt):.2f} with quant  "
                  f"rel-L1 {rel:.4f}  fill {t[f'fill {part}']:.3f} ms", flush=True)
            if acc:
                for tile in acc_tiles:
                    ba = t[f"bf16acc{tile} {part}"]
                    print(f"    bf16acc{tile:6s} {ba:7.3f} ms ({flop / ba / 1e9:4.0f} TFLOP/s)  "
                          f"x{b16 / ba:.2f} (FP32 added to)  add32 / it "
                          f"{t[f'add32 {part}'] / ba:.2f}", flush=True)
            for v in variants:
                ms, kind = t[f"fp8 {part} {v}"], variants[v][2]
                note = ""                     # (the add32 steps exist only with acc)
                if kind == "bf16":
                    note = f"  fill / it {t[f'fill {part}'] / ms:.2f}"
                elif kind == "acc":
                    note = f"  add32 / it {t[f'add32 {part}'] / ms:.2f}"
                print(f"    fp8 {v:9s} {ms:7.3f} ms ({flop / ms / 1e9:4.0f} TFLOP/s)  "
                      f"x{b16 / ms:.2f}{note}", flush=True)
            for p in filter(None, args.parts.split(",")):
                print(f"    {first} {p:16s} {t[f'part {part} {p}']:7.3f} ms", flush=True)
            if args.quant_split:
                ops = ("d_gu", "x") if part == "gate|up" else ("d_out", "h")
                print("    quant " + ", ".join(f"{o} {t['q ' + o]:.3f}" for o in ops)
                      + f" ms; torch's cast of both {t['cast ' + part]:.3f} ms", flush=True)
        outs.clear()
        q.clear()
        steps.clear()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
