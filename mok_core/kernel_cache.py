"""A disk cache of compiled GPU kernels: ``MOK_KERNEL_CACHE=DIR`` in the environment.

Why: a process compiles every kernel specialisation it launches -- numba types and lowers it,
NVVM makes PTX, the linker a cubin: seconds for each of MoK's large kernels, minutes for a
layer's forward and backward. With the variable set (before ``mok_core`` is imported), each
kernel specialisation compiled is written to DIR and later processes load its cubin instead.
Off when unset, and always off on the simulator.

What a cache entry is keyed by (``key``), so that a changed kernel is never served:

* the code: every function the kernel reaches -- through its closure cells and the globals
  its code names, recursively, device functions and intrinsics (their ``_defn``) included --
  by module, name and bytecode, and the content of each source file holding one (a file edit
  anywhere in a reached module misses, whatever it touched);
* the values: closure cells and named globals that are constants (numbers, strings, numba
  types, tuples of them): a factory's arguments, or a global a probe patches;
* the compile: the argument types, the dispatcher's target options (launch bounds, ...),
  every ``NUMBA_*`` variable in the environment, the Python, numba, numba-cuda and CUDA
  bindings versions, the device's compute capability and the CUDA runtime's version.

A kernel reaching anything else (an array, a dict, an object of unknown kind) is not cached
(``fingerprint`` is None): it compiles as without the cache. So is a launch-config-sensitive
kernel. An entry holds the kernel's cubin and launch metadata, not its LLVM IR or PTX
(``_reduce``): loaded, it runs on the device it was built for. Entries are written whole
(a temporary file, then a rename), so concurrent processes (ranks) share DIR safely; a
failure to read or write one is a miss, never an error.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import lzma
import os
import pickle
import sys
import types as pytypes

import numpy as np

ENV = "MOK_KERNEL_CACHE"
FORMAT = 1                      # bump when an entry's layout changes

_file_digests: dict = {}        # path -> (mtime_ns, size, sha256 hex)


class _Uncacheable(Exception):
    """The kernel reaches a value whose identity the key cannot state."""


def _file_digest(path: str) -> str:
    """sha256 of a source file's bytes (memoised on its mtime and size)."""
    st = os.stat(path)
    got = _file_digests.get(path)
    if got is None or got[:2] != (st.st_mtime_ns, st.st_size):
        with open(path, "rb") as f:
            got = (st.st_mtime_ns, st.st_size, hashlib.sha256(f.read()).hexdigest())
        _file_digests[path] = got
    return got[2]


_LIBRARIES = ("numba", "numba_cuda", "llvmlite", "numpy", "math", "cmath", "builtins",
              "operator", "functools")


def _is_library(obj) -> bool:
    """numba's, llvmlite's, NumPy's or the standard library's own objects and modules: stated
    by name (their versions are in the key)."""
    mod = obj.__name__ if isinstance(obj, pytypes.ModuleType) else \
        getattr(obj, "__module__", None) or ""
    return mod.split(".")[0] in _LIBRARIES


class _Walker:
    """One kernel's fingerprint: the tokens of what it reaches, and the files those are in."""

    def __init__(self):
        self.seen: dict = {}    # id(function) -> its token (cycles and shared helpers)
        self.files: set = set()

    def value(self, obj):
        from numba.core import types as nbtypes
        if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes)):
            return (type(obj).__name__, repr(obj))
        if isinstance(obj, (np.generic, np.dtype)):
            return ("np", type(obj).__name__, repr(obj))
        if isinstance(obj, (tuple, list, frozenset)):
            items = sorted(map(repr, obj)) if isinstance(obj, frozenset) else obj
            return (type(obj).__name__,) + tuple(self.value(x) for x in items)
        if isinstance(obj, nbtypes.Type):
            return ("nbtype", str(obj))
        if isinstance(obj, pytypes.ModuleType):
            f = getattr(obj, "__file__", None)
            if f and not _is_library(obj) and f.endswith(".py"):
                self.files.add(f)               # what is read through it: its file
            return ("module", obj.__name__)
        if isinstance(obj, pytypes.FunctionType):
            return self.function(obj)
        if hasattr(obj, "py_func"):             # a dispatcher (kernel or device function)
            return ("dispatcher", repr(sorted(getattr(obj, "targetoptions", {}).items())),
                    self.function(obj.py_func))
        if hasattr(obj, "_defn") and type(obj).__name__ == "_Intrinsic":
            return ("intrinsic", self.function(obj._defn))
        if hasattr(obj, "__wrapped__"):         # functools wrappers (lru_cache)
            return ("wrapped", self.value(obj.__wrapped__))
        if _is_library(obj) and hasattr(obj, "__qualname__") or isinstance(obj, type):
            f = sys.modules.get(getattr(obj, "__module__", ""), None)
            if isinstance(obj, type) and f is not None and not _is_library(obj):
                self.value(f)                   # a class of ours: its module's file
            return ("named", getattr(obj, "__module__", ""), obj.__qualname__)
        if _is_library(obj):                    # numba's stubs and singletons
            return ("library", type(obj).__module__, type(obj).__qualname__, repr(obj))
        raise _Uncacheable(f"{type(obj).__module__}.{type(obj).__qualname__}")

    def code(self, co, fn_globals, out):
        """A code object's bytes, constants (nested code: the same) and named globals."""
        out.append((co.co_name, co.co_code, co.co_names))
        for c in co.co_consts:
            if isinstance(c, pytypes.CodeType):
                self.code(c, fn_globals, out)
            else:
                out.append(self.value(c))
        mods = []
        for name in co.co_names:
            if name in fn_globals:
                g = fn_globals[name]
                out.append((name, self.value(g)))
                if isinstance(g, pytypes.ModuleType) and not _is_library(g):
                    mods.append(g)
        # what the code may read through a module of ours (err.NF_X, F.helper): the
        # attributes it names, by value -- a patched one included
        for m in mods:
            for name in co.co_names:
                if name in vars(m):
                    out.append((m.__name__, name, self.value(vars(m)[name])))

    def function(self, fn):
        token = self.seen.get(id(fn))
        if token is not None:
            return token
        token = ("function", fn.__module__, fn.__qualname__)
        self.seen[id(fn)] = token               # before recursing: cycles end here
        f = fn.__code__.co_filename
        if os.path.isfile(f):
            self.files.add(f)
        body = []
        self.code(fn.__code__, fn.__globals__, body)
        body.append(self.value(fn.__defaults__))
        for cell in fn.__closure__ or ():
            try:
                contents = cell.cell_contents
            except ValueError:                  # an empty cell
                contents = None
            body.append(self.value(contents))
        digest = hashlib.sha256(repr(body).encode()).hexdigest()
        token = ("function", fn.__module__, fn.__qualname__, digest)
        self.seen[id(fn)] = token
        return token


def fingerprint(py_func):
    """A hex digest standing for ``py_func``'s code and values (module docstring), or None
    where it reaches something uncacheable."""
    w = _Walker()
    try:
        token = w.function(py_func)
        files = sorted(_file_digest(f) for f in w.files)
    except (_Uncacheable, OSError, RecursionError):
        return None
    return hashlib.sha256(repr((token, files)).encode()).hexdigest()


def _versions():
    out = [sys.version]
    for dist in ("numba", "numba-cuda", "cuda-bindings", "cuda-core", "llvmlite", "numpy"):
        try:
            out.append((dist, importlib.metadata.version(dist)))
        except importlib.metadata.PackageNotFoundError:
            out.append((dist, None))
    return tuple(out)


def _device():
    """(compute capability, CUDA runtime version) of the current device."""
    from numba import cuda
    from numba.cuda.cudadrv import runtime
    return (cuda.get_current_device().compute_capability, runtime.runtime.get_version())


def key(dispatcher, argtypes):
    """The cache key of ``dispatcher`` specialised for ``argtypes`` (a hex digest), or None
    (not cacheable)."""
    fp = fingerprint(dispatcher.py_func)
    if fp is None:
        return None
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith("NUMBA_"))
    parts = (FORMAT, fp, tuple(str(t) for t in argtypes),
             repr(sorted(dispatcher.targetoptions.items())), env, _versions(), _device())
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def _reduce(kernel) -> dict:
    """What an entry holds: the kernel's launch metadata and its code library's cubins (no
    LLVM IR, no PTX: a cubin serves the device it was built for)."""
    states = kernel._reduce_states()
    lib = states.pop("codelibrary")
    lib_states = lib._reduce_states()
    lib_states.update(llvm_strs=[], ptx_cache={})
    if not lib_states["cubin_cache"]:
        raise ValueError("no cubin to cache")
    return {"kernel": states, "library": lib_states}


def _rebuild(entry):
    from numba.cuda.codegen import CUDACodeLibrary
    from numba.cuda.dispatcher import _Kernel
    lib = CUDACodeLibrary._rebuild(**entry["library"])
    return _Kernel._rebuild(codelibrary=lib, **entry["kernel"])


class KernelCache:
    """A dispatcher's ``_cache`` (numba's cache protocol: ``load_overload`` / ``save_overload``)
    over the directory ``path``."""

    def __init__(self, dispatcher, path):
        self._dispatcher = dispatcher
        self.cache_path = path
        self._keys: dict = {}

    def _path(self, sig):
        from numba.core import sigutils
        argtypes, _ = sigutils.normalize_signature(sig)
        if argtypes not in self._keys:
            try:
                self._keys[argtypes] = key(self._dispatcher, argtypes)
            except Exception:                   # (no device, unreadable source): a miss
                self._keys[argtypes] = None
        k = self._keys[argtypes]
        return None if k is None else os.path.join(self.cache_path, k + ".xz")

    def load_overload(self, sig, _target_context):
        path = self._path(sig)
        if path is None or not os.path.exists(path):
            return None
        try:
            with open(path, "rb") as f:
                kernel = _rebuild(pickle.loads(lzma.decompress(f.read())))
            os.utime(path)                      # used: what a size cap keeps (newest first)
            return kernel
        except Exception:                       # a torn or foreign entry: compile
            return None

    def save_overload(self, sig, kernel):
        path = self._path(sig)
        if path is None or getattr(kernel, "launch_config_sensitive", False):
            return
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            data = lzma.compress(pickle.dumps(_reduce(kernel), protocol=4))
            os.makedirs(self.cache_path, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except Exception:
            try:
                os.remove(tmp)
            except OSError:
                pass

    def flush(self):
        pass


def attach(dispatcher):
    """Give a kernel dispatcher the disk cache when ``MOK_KERNEL_CACHE`` is set (its value: the
    directory); returns the dispatcher."""
    path = os.environ.get(ENV)
    if path:
        dispatcher._cache = KernelCache(dispatcher, os.path.abspath(path))
    return dispatcher
