"""Our bf16 wgmma GEMM with its staged epilogue's base left to the compiler (hoisted out of
the tile loop, as before session 32), in turns against the shipped kernel (the base made per
tile by ``per_iteration``): a probe.

    python benchmarks/probes/probe_staged_base.py [--presets kimi-k2.7,qwen3.5-397b]
                                                  [--tokens 4096] [--iters 10]

At 192-row tiles (384 threads, 168 registers a thread; the layer's tile where experts hold
112-192 rows, e.g. EP 2 at 4096 tokens) ptxas spilled 144-232 bytes of the forward's kernels
with the base hoisted, 16-28 with it per tile. This builds the routed FFN's two GEMMs
(``bench_ffn.ffn_inputs``: rank 0 at EP 2, uniform routing) at ``WGMMA_192_GEMM`` and
``WGMMA_GEMM`` both ways -- ``hoisted``: ``sm90.make_staged_epilogue`` rebuilt from its
source with that one line changed -- times them in turns (CUDA-graph replays) and checks that
each pair wrote the same bits. Prints ms and hoisted / shipped. A probe: it writes nothing.
"""
from __future__ import annotations

import argparse
import inspect
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

SHIPPED = "epi0 = per_iteration(uint32(ring + stage_offset))"
HOISTED = "epi0 = ring + stage_offset"


def hoisted_factory():
    """``make_staged_epilogue`` with its staging base hoisted (module docstring)."""
    from mok_core.gemm import epilogue as EPI
    src = inspect.getsource(EPI.make_staged_epilogue)
    if SHIPPED not in src:
        raise SystemExit(f"probe_staged_base: {SHIPPED!r} is not in make_staged_epilogue "
                         "(the library changed: update the probe or delete it)")
    ns = dict(vars(EPI))
    exec(compile(src.replace(SHIPPED, HOISTED), EPI.__file__, "exec"), ns)
    return ns["make_staged_epilogue"]


_BUILT = {}                   # the hoisted kernels, built once a process
_LIBRARY = []                 # sm90._kernel as the library has it (patched while a step runs)


def _hoisted_kernel(*args, **kw):
    """``sm90._kernel`` through the hoisted epilogue (its own cache; the library's
    untouched)."""
    from mok_core.gemm import sm90
    key = (args, tuple(sorted(kw.items())))
    if key not in _BUILT:
        saved = sm90.make_staged_epilogue
        sm90.make_staged_epilogue = hoisted_factory()
        try:
            _BUILT[key] = _LIBRARY[0].__wrapped__(*args, **kw)
        finally:
            sm90.make_staged_epilogue = saved
    return _BUILT[key]


def hoisted_launch(fn):
    """``fn()`` with ``sm90``'s kernels built through the hoisted epilogue."""
    from mok_core.gemm import sm90

    def step():
        cached = sm90._kernel
        _LIBRARY[:] = [cached]
        sm90._kernel = _hoisted_kernel
        try:
            fn()
        finally:
            sm90._kernel = cached
    return step


def main():
    import numpy as np
    import torch

    from benchmarks.bench_ffn import ffn_inputs, ffn_steps, interleaved_ms
    from mok_core.gemm import WGMMA_192_GEMM, WGMMA_GEMM
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="kimi-k2.7,qwen3.5-397b")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    for preset in args.presets.split(","):
        # segments padded to 64 rows, the layer's row_align
        d = ffn_inputs(preset, args.tokens, "uniform", 64, np.random.default_rng(0))
        E = len(d["counts"])
        mine = dict(d, hidden=torch.empty_like(d["hidden"]), y=torch.empty_like(d["y"]))
        steps = {}
        for tile, cfg in (("192", WGMMA_192_GEMM), ("128", WGMMA_GEMM)):
            for side, dd, wrap in (("shipped", d, None), ("hoisted", mine, hoisted_launch)):
                gate_up, down = ffn_steps(dd, cfg)
                for name, fn in (("gate|up", gate_up), ("down", down)):
                    steps[f"{tile} {name} {side}"] = wrap(fn) if wrap else fn
        t = {n: g for n, (g, _) in interleaved_ms(steps, args.iters, eager=()).items()}
        for tile in ("192", "128"):
            for side in ("shipped", "hoisted"):      # this tile's outputs, both sides
                steps[f"{tile} gate|up {side}"]()
                steps[f"{tile} down {side}"]()
            torch.cuda.synchronize()
            same = (torch.equal(d["hidden"].view(torch.int16), mine["hidden"].view(torch.int16))
                    and torch.equal(d["y"].view(torch.int16), mine["y"].view(torch.int16)))
            for name in ("gate|up", "down"):
                a, b = t[f"{tile} {name} hoisted"], t[f"{tile} {name} shipped"]
                print(f"{preset:15s} T={args.tokens} E={E} rows={d['rows']} {tile}-row tiles "
                      f"{name:8s} hoisted {a:7.3f} ms  shipped {b:7.3f} ms  x{a / b:.3f}  "
                      f"bits {'equal' if same else 'DIFFER'}", flush=True)
        del d, mine, steps
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
