"""ptxas's verdict on every production wgmma kernel (forward, dgrad and wgrad), without a GPU:
registers, spills and C7518 (serialised wgmmas) per kernel, built as
``tests/ptx/test_ptx_gemm.py`` (``test_ptx_wgrad.py``: the wgrads) builds them. Exit status 1
if any serialises or fails to assemble.

    python benchmarks/probes/ptxas_check.py [--ptxas PATH] [--version 9.0] [--only NAME ...]
                                            [--keep DIR]

Where the local ptxas is older than the PTX numba emits (the tests skip then), the PTX's
``.version`` header is rewritten to ``--version`` (default: the highest of 9.1, 9.0, ... the
local ptxas reads). The kernels use nothing newer, and the verdict matched the GPU host's
(CUDA 13) on C7518: none at f64739d, every kernel at 219f4cc. The 192-row kernels spill at
every commit so far (168 registers at 384 threads): compare their spills between trees.
``--keep``: write each kernel's PTX and ptxas report there. ``PYTHONPATH=<tree>`` probes
another source tree, with that tree's kernel signatures (its ``tests/ptx/test_ptx_gemm.py``;
one from before B_KN: the forward kernels only; before SAVE_PRE: no ``gate_up_pre``).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if not any(os.path.isdir(os.path.join(p, "mok_core")) for p in sys.path if p):
    sys.path.insert(0, _ROOT)


def _tree_tests():
    """The probed tree's tests/ptx on the path: its kernels' signatures are in there."""
    import mok_core
    tree = os.path.dirname(os.path.dirname(os.path.abspath(mok_core.__file__)))
    sys.path.insert(0, os.path.join(tree, "tests", "ptx"))

# (name, bn, stages, swiglu, gather, padding_index, push, bm, b_kn, save_pre); gate_up_pre:
# the forward of a layer with a backward (FP32 g and u saved from the epilogue)
KERNELS = [
    ("gate_up-128", 256, 4, True, True, True, False, 128, False),
    ("gate_up_pre-128", 256, 4, True, True, True, False, 128, False, True),
    ("down-128", 256, 4, False, False, True, False, 128, False),
    ("down_push-128", 256, 4, False, False, True, True, 128, False),
    ("gate_up-192", 256, 4, True, True, True, False, 192, False),
    ("gate_up_pre-192", 256, 4, True, True, True, False, 192, False, True),
    ("down-192", 256, 4, False, False, True, False, 192, False),
    ("down_push-192", 256, 4, False, False, True, True, 192, False),
    ("down_push-256", 128, 4, False, False, True, True, 256, False),
    ("dgrad-d_x-128", 256, 4, False, False, False, False, 128, True),
    ("dgrad-d_hidden-128", 256, 4, False, True, True, False, 128, True),
    ("dgrad-d_hidden-bn128", 128, 4, False, True, True, False, 128, True),
    ("dgrad-d_x-push-128", 256, 4, False, False, False, True, 128, True),
    ("dgrad-d_x-192", 256, 4, False, False, False, False, 192, True),
    ("dgrad-d_hidden-192", 256, 4, False, True, True, False, 192, True),
]
# sm90_wgrad: (name, bm, bn, stages, gather_a, gather_b, out_f32, accumulate) -- the layer's
# dW_gate | dW_up (B = x gathered) and dW_down (A = d_out gathered): bf16 out on its two
# 128 x 256 rings (``WGRAD_WGMMA_GEMM``, ``WGRAD_WGMMA_DEEP_GEMM``), FP32 out -- added to or
# not -- on main-grad's 128 x 128 tile
WGRAD_KERNELS = [
    ("wgrad-gate_up-s3", 128, 256, 3, False, True, False, False),
    ("wgrad-down-s3", 128, 256, 3, True, False, False, False),
    ("wgrad-gate_up-s4", 128, 256, 4, False, True, False, False),
    ("wgrad-down-s4", 128, 256, 4, True, False, False, False),
    ("wgrad-gate_up-f32-128", 128, 128, 4, False, True, True, False),
    ("wgrad-gate_up-f32acc-128", 128, 128, 4, False, True, True, True),
    ("wgrad-down-f32acc-128", 128, 128, 4, True, False, True, True),
]


def _ptxas(path):
    if path:
        return path
    try:
        import nvidia.cu13
        cand = Path(nvidia.cu13.__path__[0]) / "bin" / "ptxas"
        if cand.exists():
            return str(cand)
    except ImportError:
        pass
    return shutil.which("ptxas")


def assemble(exe, ptx, version):
    ptx = re.sub(r"^\.version \d+\.\d+", f".version {version}", ptx, count=1, flags=re.M)
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(ptx)
        r = subprocess.run([exe, "-arch=sm_90a", "-v", "--warn-on-spills", str(src),
                            "-o", str(Path(d) / "k.cubin")], capture_output=True, text=True)
    return r.returncode, r.stderr


def _probe_version(exe):
    from numba import cuda, int32

    def probe(a):
        a[0] = 0
    ptx, _ = cuda.compile_ptx(probe, (int32[::1],), cc=(9, 0, "a"))
    for v in ("9.1", "9.0", "8.8", "8.7", "8.5"):
        rc, err = assemble(exe, ptx, v)
        if rc == 0:
            return v
    raise SystemExit(f"{exe} reads none of the PTX versions tried:\n{err}")


def kernel_ptx(bn, stages, swiglu, gather, padding_index, push, bm, b_kn, save_pre=False):
    from numba import cuda
    from test_ptx_gemm import PUSH_SIG, WG_SIG

    from mok_core.gemm.sm90 import make_wgmma_gemm
    kw = {"b_kn": True} if b_kn else {}          # (a tree from before B_KN: forward only)
    if save_pre:                                 # (... or before SAVE_PRE)
        kw["save_pre"] = True
    kern = make_wgmma_gemm(bn, stages, swiglu, gather, padding_index, push=push, bm=bm, **kw)
    opts = {k: v for k, v in kern.targetoptions.items() if k == "launch_bounds"}
    ptx, _ = cuda.compile_ptx(kern.py_func, PUSH_SIG if push else WG_SIG, cc=(9, 0, "a"),
                              **opts)
    return ptx


def wgrad_ptx(bm, bn, stages, gather_a, gather_b, out_f32, accumulate):
    from numba import cuda, float32, uint32
    try:
        from test_ptx_wgrad import wgmma_wgrad_sig
        sig = wgmma_wgrad_sig(out_f32)
    except ImportError:                      # a tree from before the TMA-store epilogue
        from test_ptx_wgrad import wgrad_sig
        sig = wgrad_sig(float32 if out_f32 else uint32)

    from mok_core.gemm.sm90_wgrad import make_wgmma_wgrad
    kern = make_wgmma_wgrad(bm, bn, stages, gather_a, gather_b, out_f32, accumulate)
    opts = {k: v for k, v in kern.targetoptions.items() if k == "launch_bounds"}
    ptx, _ = cuda.compile_ptx(kern.py_func, sig, cc=(9, 0, "a"), **opts)
    return ptx


def _no_driver_needed():
    """Device-function calls ask the driver for the compute capability (tests/ptx/conftest.py):
    with no GPU here, answer (9, 0)."""
    import numba.cuda.dispatcher as dispatcher

    class _Hopper:
        compute_capability = (9, 0)
    try:
        dispatcher.get_current_device()
    except Exception:
        dispatcher.get_current_device = lambda: _Hopper()


def main():
    _tree_tests()
    _no_driver_needed()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ptxas")
    ap.add_argument("--version", help="PTX .version written over numba's")
    ap.add_argument("--only", nargs="*", help="kernel names (default: all)")
    ap.add_argument("--keep", help="folder for each kernel's PTX and ptxas report")
    args = ap.parse_args()
    exe = _ptxas(args.ptxas)
    if exe is None:
        raise SystemExit("no ptxas")
    version = args.version or _probe_version(exe)
    print(f"# {exe}, PTX .version {version}")
    bad = 0
    try:                                         # (a tree from before sm90_wgrad: none)
        import mok_core.gemm.sm90_wgrad  # noqa: F401
        jobs = [(n, kernel_ptx, s) for n, *s in KERNELS] + [(n, wgrad_ptx, s)
                                                            for n, *s in WGRAD_KERNELS]
    except ImportError:
        jobs = [(n, kernel_ptx, s) for n, *s in KERNELS]
    for name, build, spec in jobs:
        if args.only and name not in args.only:
            continue
        ptx = build(*spec)
        rc, report = assemble(exe, ptx, version)
        if args.keep:
            Path(args.keep).mkdir(parents=True, exist_ok=True)
            (Path(args.keep) / f"{name}.ptx").write_text(ptx)
            (Path(args.keep) / f"{name}.txt").write_text(report)
        regs = re.findall(r"Used (\d+) registers", report)
        spill = re.findall(r"\d+ bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill "
                           r"loads", report)
        stack = re.findall(r"(\d+) bytes stack frame", report)
        c7518 = "C7518" in report or "serialized" in report
        c7517 = "C7517" in report                # a wgmma wait ptxas had to inject
        bad += c7518 or rc != 0
        print(f"{name:24s} rc={rc} regs={','.join(regs) or '?'} "
              f"spill(st,ld)={';'.join('/'.join(s) for s in spill) or '?'} "
              f"stack={','.join(stack) or '?'} C7518={'YES' if c7518 else 'no'} "
              f"C7517={'YES' if c7517 else 'no'}", flush=True)
        if rc != 0:
            print(report[-1500:])
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
