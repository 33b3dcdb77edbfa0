"""``mok_core.kernel_cache`` without a GPU: the key of a compiled kernel changes with
everything its code depends on (factory arguments, a patched global, a source file's bytes),
stays the same from process to process, and an entry round-trips a kernel's cubin and
launch metadata. Every kernel the PTX suite compiles is checked against the walk
(``ptx_util.compile_sm90a``: what numba translates for it, the walk reached). (Loading an
entry onto a device is the GPU suite's: ``gpu_run.sh`` carries the cache from call to call.)"""
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _fp8_fingerprint(stages=3, bn=256):
    from mok_core.gemm.sm90_fp8 import make_fp8_gemm
    from mok_core.kernel_cache import fingerprint
    return fingerprint(make_fp8_gemm(stages, False, bn).py_func)


def test_fingerprint_follows_factory_arguments_and_is_stable_across_processes():
    a, b, c = _fp8_fingerprint(3, 256), _fp8_fingerprint(4, 256), _fp8_fingerprint(4, 128)
    assert len({a, b, c}) == 3 and None not in (a, b, c)
    assert _fp8_fingerprint(3, 256) == a                       # a second build: the same key
    code = ("import sys; sys.path.insert(0, %r); from tests.ptx.test_kernel_cache import "
            "_fp8_fingerprint; print(_fp8_fingerprint(3, 256))" % ROOT)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "NUMBA_ENABLE_CUDASIM": "0"}, check=True)
    assert out.stdout.split()[-1] == a                         # another process: the same


def test_fingerprint_sees_a_patched_global(monkeypatch):
    """A probe builds kernels with a global of ``sm90_fp8`` replaced: not the cached one's."""
    from mok_core.cuda_compat import kjit
    from mok_core.gemm import sm90_fp8
    want = _fp8_fingerprint()

    @kjit(device=True, inline="always")
    def unit(*args):
        return 1.0, 1.0, 1.0, 1.0
    monkeypatch.setattr(sm90_fp8, "_slice_scales", unit)
    assert _fp8_fingerprint() not in (want, None)
    monkeypatch.undo()
    assert _fp8_fingerprint() == want


def test_fingerprint_sees_a_source_edit_and_refuses_unknown_values(tmp_path, monkeypatch):
    from mok_core.kernel_cache import fingerprint
    src = tmp_path / "kc_probe_mod.py"
    body = textwrap.dedent("""
        SCALE = 2
        def helper(x):
            return x * SCALE
        def kernel(a):
            a[0] = helper(a[0])
    """)
    src.write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    import kc_probe_mod
    first = fingerprint(kc_probe_mod.kernel)
    src.write_text(body + "# an edit the kernel does not read: the file's bytes changed\n")
    os.utime(src, ns=(1, 1))                    # a new stamp whatever the clock's resolution
    assert fingerprint(kc_probe_mod.kernel) not in (first, None)
    monkeypatch.setattr(kc_probe_mod, "SCALE", 3)
    third = fingerprint(kc_probe_mod.kernel)
    assert third is not None
    monkeypatch.setattr(kc_probe_mod, "SCALE", {"no": "key"})  # a dict: no stable identity
    assert fingerprint(kc_probe_mod.kernel) is None


def test_fingerprint_follows_modules_read_through(tmp_path, monkeypatch):
    """``pkg.sub.helper(x)``: helper's code and the module it imports from, two attribute
    levels down, are part of the key."""
    from mok_core.kernel_cache import fingerprint
    pkg = tmp_path / "kc_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from . import sub\n")
    (pkg / "sub.py").write_text("from .deep import scale\ndef helper(x):\n"
                                "    return scale(x)\n")
    deep = pkg / "deep.py"
    deep.write_text("def scale(x):\n    return x * 3.0\n")
    (tmp_path / "kc_user.py").write_text("import kc_pkg\ndef kernel(a):\n"
                                         "    a[0] = kc_pkg.sub.helper(a[0])\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import kc_user
    first = fingerprint(kc_user.kernel)
    deep.write_text("def scale(x):\n    return x * 5.0\n")
    os.utime(deep, ns=(1, 1))
    assert fingerprint(kc_user.kernel) not in (first, None)


def test_a_digest_changing_in_the_process_stops_saving(tmp_path, monkeypatch):
    """numba keeps what it compiled from a patched global after the global is restored: once a
    walked function's digest changes, the process saves nothing more."""
    from mok_core import kernel_cache
    monkeypatch.setattr(kernel_cache, "_stale", False)
    (tmp_path / "kc_stale.py").write_text("G = 1.0\ndef dev(x):\n    return x + G\n"
                                          "def kernel(a):\n    a[0] = dev(a[0])\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import kc_stale
    kernel_cache.fingerprint(kc_stale.kernel)
    kernel_cache.fingerprint(kc_stale.kernel)
    assert not kernel_cache._stale                              # the same code again
    monkeypatch.setattr(kc_stale, "G", 2.0)
    kernel_cache.fingerprint(kc_stale.kernel)
    assert kernel_cache._stale


def _fake_kernel():
    """A compiled-kernel object as numba rebuilds one from its cache (no driver here): a
    code library holding IR, PTX and a cubin."""
    from cuda.core import ObjectCode
    from numba import types
    from numba.core.typing import signature
    from numba.cuda.codegen import CUDACodeLibrary
    from numba.cuda.dispatcher import _Kernel
    lib = CUDACodeLibrary._rebuild(
        codegen=None, name="k", entry_name="_Z1kPf", llvm_strs=["; IR"],
        ptx_cache={(9, 0): ".version 8.0"},
        cubin_cache={(9, 0): ObjectCode.from_cubin(b"\x7fELF" + bytes(range(200)))},
        linkerinfo_cache={(9, 0): ""}, max_registers=None, nvvm_options={"opt": 3},
        needs_cudadevrt=False, nrt=False, use_cooperative=False, lto=False)
    sig = signature(types.none, types.float32[::1], types.int64)
    return _Kernel._rebuild(cooperative=False, name="_Z1kPf", signature=sig, codelibrary=lib,
                            debug=False, lineinfo=False, call_helper=None, extensions=[])


def test_entry_round_trips_a_kernel_without_its_ir(tmp_path, monkeypatch):
    from numba import types

    from numba.cuda.dispatcher import _Kernel

    from mok_core import kernel_cache
    from mok_core.cuda_compat import kjit
    monkeypatch.setattr(kernel_cache, "_device", lambda: (9, 0))
    monkeypatch.setattr(kernel_cache, "_toolchain_key", lambda: ("toolkit", 13000))
    monkeypatch.setattr(kernel_cache, "_stale", False)
    bound = []
    monkeypatch.setattr(_Kernel, "bind", lambda self: bound.append(self))   # (no driver here)

    @kjit
    def k(a, n):
        a[0] = n
    cache = kernel_cache.KernelCache(k, str(tmp_path))
    sig = (types.float32[::1], types.int64)
    assert cache.load_overload(sig, None) is None               # empty: a miss
    kernel = _fake_kernel()
    cache.save_overload(sig, kernel)
    (entry,) = os.listdir(tmp_path)
    got = cache.load_overload(sig, None)
    assert bound == [got]                                       # bound before it is a hit
    lib, want = got._codelibrary, kernel._codelibrary
    assert got.objectmode is False and got.py_func is k.py_func and got.argtypes == sig
    assert got.signature == kernel.signature and got.entry_name == kernel.entry_name
    assert got.argument_types == (types.float32[::1], types.int64)
    assert bytes(lib._cubin_cache[(9, 0)].code) == bytes(want._cubin_cache[(9, 0)].code)
    assert lib._ptx_cache == {} and lib._llvm_strs == []        # a cubin serves its device
    assert lib._entry_name == "_Z1kPf" and lib._nvvm_options == {"opt": 3}
    # another signature, device or compile environment: another entry
    assert cache.load_overload((types.float64[::1], types.int64), None) is None
    other = kernel_cache.KernelCache(k, str(tmp_path))
    monkeypatch.setattr(kernel_cache, "_toolchain_key", lambda: ("toolkit", 13010))
    assert other.load_overload(sig, None) is None
    monkeypatch.setattr(kernel_cache, "_toolchain_key", lambda: ("toolkit", 13000))
    # a cubin the device refuses, or a torn entry: a miss, not an error
    monkeypatch.setattr(_Kernel, "bind", lambda self: 1 / 0)
    assert kernel_cache.KernelCache(k, str(tmp_path)).load_overload(sig, None) is None
    (tmp_path / entry).write_bytes(b"torn")
    assert kernel_cache.KernelCache(k, str(tmp_path)).load_overload(sig, None) is None
    # nothing is saved once the process's code went stale
    monkeypatch.setattr(kernel_cache, "_stale", True)
    os.remove(tmp_path / entry)
    kernel_cache.KernelCache(k, str(tmp_path)).save_overload(sig, kernel)
    assert not os.listdir(tmp_path)


def test_kjit_attaches_the_cache_to_kernels_only(tmp_path, monkeypatch):
    from mok_core.cuda_compat import kjit
    from mok_core.kernel_cache import KernelCache
    monkeypatch.setenv("MOK_KERNEL_CACHE", str(tmp_path))

    @kjit(launch_bounds=(128, 1))
    def kern(a):
        a[0] = 1

    @kjit
    def kern2(a):
        a[0] = 2

    @kjit(device=True)
    def dev(a):
        return a
    assert isinstance(kern._cache, KernelCache) and isinstance(kern2._cache, KernelCache)
    assert kern._cache.cache_path == str(tmp_path)
    assert not isinstance(getattr(dev, "_cache", None), KernelCache)
    monkeypatch.delenv("MOK_KERNEL_CACHE")

    @kjit
    def kern3(a):
        a[0] = 3
    assert not isinstance(kern3._cache, KernelCache)


@pytest.fixture
def fake_device(monkeypatch):
    """What numba asks of a device while it compiles and links a kernel, answered for an
    sm_90 one (the cubin is linked here; nothing is loaded)."""
    import numba.cuda.codegen as codegen
    from numba.cuda.dispatcher import _Kernel

    from mok_core import kernel_cache

    class Dev:
        compute_capability = (9, 0)
        id = 0

    class Ctx:
        device = Dev()
    monkeypatch.setattr(codegen.devices, "get_context", lambda *a: Ctx())
    monkeypatch.setattr(_Kernel, "bind", lambda self: self._codelibrary.get_cubin())
    monkeypatch.setattr(kernel_cache, "_device", lambda: Dev.compute_capability)
    monkeypatch.setattr(kernel_cache, "_stale", False)


@pytest.mark.parametrize("which", ["small", "fp8_gemm"])
def test_a_real_kernel_round_trips_through_the_dispatcher(which, tmp_path, monkeypatch,
                                                          fake_device):
    """numba's ``compile`` saves the kernel it built; a fresh dispatcher of the same function
    loads it (a hit, no compile) with the same cubin, under the key numba links sm_90a
    kernels by."""
    from numba import cuda, float32

    from mok_core.cuda_compat import kjit
    from mok_core.gemm.sm90_fp8 import make_fp8_gemm
    monkeypatch.setenv("MOK_KERNEL_CACHE", str(tmp_path))
    if which == "small":
        from numba import types

        def body(a):
            i = cuda.grid(1)
            if i < a.shape[0]:
                a[i] = a[i] * float32(2.0)
        made = kjit(body)
        sig = (types.float32[::1],)
    else:
        from test_ptx_fp8 import sig as fp8_sig
        made, sig = make_fp8_gemm(3, False, 256), fp8_sig()
    built = made.compile(sig)
    assert made._cache_misses[sig] == 1 and len(os.listdir(tmp_path)) == 1
    again = kjit(**made.targetoptions)(made.py_func) if made.targetoptions else \
        kjit(made.py_func)
    got = again.compile(sig)
    assert again._cache_hits[sig] == 1 and again._cache_misses[sig] == 0
    cc = (9, 0, "a")
    assert bytes(got._codelibrary.get_cubin().code) == bytes(built._codelibrary._cubin_cache[cc].code)
    assert got.signature == built.signature and got.entry_name == built.entry_name
    assert got.launch_bounds == built.launch_bounds
