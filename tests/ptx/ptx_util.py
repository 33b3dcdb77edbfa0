import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from numba import cuda


def _compile_keyed(kernel, sig, cc, **opts):
    """``cuda.compile_ptx`` of a kjit kernel, checking on the way that the kernel cache's key
    covers it: every function of ours numba's frontend translates for it was reached by
    ``mok_core.kernel_cache``'s walk, and the walk reaches nothing it cannot state."""
    from numba.cuda.core import bytecode

    from mok_core import kernel_cache
    translated = set()
    identity = bytecode.FunctionIdentity
    original = identity.__dict__["from_function"]

    def from_function(cls, pyfunc):
        translated.add((pyfunc.__code__.co_filename, pyfunc.__qualname__))
        return original.__func__(cls, pyfunc)
    identity.from_function = classmethod(from_function)
    try:
        ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=cc, **opts)
    finally:
        identity.from_function = original
    walker = kernel_cache._Walker()
    walker.function(kernel.py_func)
    walked = {(fn.__code__.co_filename, fn.__qualname__) for fn in walker.functions}
    ours = {t for t in translated if "numba" not in t[0]}
    assert ours <= walked, f"the kernel cache's key misses {sorted(ours - walked)}"
    return ptx


def compile_sm90(kernel, sig):
    """PTX of a kjit kernel for sm_90 (raises on any typing/lowering error)."""
    ptx = _compile_keyed(kernel, sig, (9, 0))
    assert ".target sm_90" in ptx
    return ptx


def compile_sm90a(kernel, sig):
    """PTX of a kjit kernel for the arch-specific sm_90a target (wgmma), its launch bounds
    included as its launch builds it."""
    opts = {k: v for k, v in kernel.targetoptions.items() if k == "launch_bounds"}
    ptx = _compile_keyed(kernel, sig, (9, 0, "a"), **opts)
    assert ".target sm_90a" in ptx
    return ptx


def count(ptx, pattern):
    return len(re.findall(pattern, ptx))


def _tool(name):
    """The CUDA tool ``name``: the pip toolkit's (the one that matches numba's PTX version)
    first, else the one on PATH, else None."""
    try:
        import nvidia.cu13
        cand = Path(nvidia.cu13.__path__[0]) / "bin" / name
        if cand.exists():
            return str(cand)
    except ImportError:
        pass
    return shutil.which(name)


def _ptxas(ptx, d):
    exe = _tool("ptxas")
    if exe is None:
        pytest.skip("ptxas not installed")
    src = Path(d) / "k.ptx"
    src.write_text(ptx)
    r = subprocess.run([exe, "-arch=sm_90a", "-v", str(src), "-o", str(Path(d) / "k.cubin")],
                       capture_output=True, text=True)
    if "Unsupported .version" in r.stderr:
        pytest.skip(f"{exe} is older than the PTX numba emits")
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stderr


def assemble_sm90a(ptx):
    """ptxas -v the PTX for sm_90a (skipped where no CUDA toolkit is installed); returns
    ptxas's report (registers, spills, performance warnings)."""
    with tempfile.TemporaryDirectory() as d:
        return _ptxas(ptx, d)


def sass_sm90a(ptx):
    """(ptxas's report, the SASS text or None where nvdisasm is not installed)."""
    with tempfile.TemporaryDirectory() as d:
        report = _ptxas(ptx, d)
        exe = _tool("nvdisasm")
        if exe is None:
            return report, None
        r = subprocess.run([exe, "-c", str(Path(d) / "k.cubin")], capture_output=True,
                           text=True)
        assert r.returncode == 0, r.stderr[-2000:]
        return report, r.stdout


def spill_bytes(report):
    """The spill stores ptxas -v reports (bytes; the kernel's one entry)."""
    found = re.findall(r"(\d+) bytes spill stores", report)
    assert len(found) == 1, report[-600:]
    return int(found[0])


def local_memory_between(sass, first, last):
    """SASS lines touching local memory (LDL / STL: spills) from the first line matching
    ``first`` to the last matching ``last``."""
    lines = sass.splitlines()
    hits = [i for i, ln in enumerate(lines) if re.search(first, ln)]
    ends = [i for i, ln in enumerate(lines) if re.search(last, ln)]
    assert hits and ends, (first, last)
    return [ln.strip() for ln in lines[hits[0]:ends[-1] + 1] if re.search(r"\b(LDL|STL)\b", ln)]


_ptxas_skip = None


def require_ptxas():
    """Skip now -- before a big kernel is compiled for nothing -- where ptxas cannot read the
    PTX numba emits (``assemble_sm90a`` would skip after the compile)."""
    global _ptxas_skip
    if _ptxas_skip is None:
        from numba import int32

        def probe(a):
            a[0] = 0
        ptx, _ = cuda.compile_ptx(probe, (int32[::1],), cc=(9, 0, "a"))
        try:
            assemble_sm90a(ptx)
            _ptxas_skip = ""
        except pytest.skip.Exception as e:
            _ptxas_skip = str(e) or "ptxas unavailable"
    if _ptxas_skip:
        pytest.skip(_ptxas_skip)
