"""A disk cache of compiled GPU kernels: ``MOK_KERNEL_CACHE=DIR`` in the environment.

Why: a process compiles every kernel specialisation it launches -- numba types and lowers it,
NVVM makes PTX, the linker a cubin: seconds for each of MoK's large kernels, minutes for a
layer's forward and backward. With the variable set (before ``mok_core`` is imported), each
kernel specialisation compiled is written to DIR and later processes load its cubin instead.
Off when unset, and always off on the simulator.

What a cache entry is keyed by (``key``), so that a changed kernel is never served:

* the code: every function the kernel reaches -- through its closure cells, defaults and the
  globals its code names, recursively, device functions and intrinsics (their ``_defn``)
  included, and what it reads through modules of ours (their attributes it names, modules
  among them followed on; a module its code imports at run time too) -- by module, name and
  bytecode, and the content of each source file holding one (an edit anywhere in a reached
  module misses, whatever it touched);
* the values: closure cells, defaults and named globals that are constants (numbers, strings,
  numba types, tuples of them): a factory's arguments, or a global a probe patches;
* the compile: the argument types, the dispatcher's target options (launch bounds, ...),
  every ``NUMBA_*`` variable in the environment, the versions of Python and every numba,
  llvmlite, NumPy, ``cuda-*`` and ``nvidia-*`` distribution, the driver's and NVVM's, the
  bytes of libNVVM and libdevice, and the device's compute capability.

A kernel reaching anything else (an array, a dict, an object of unknown kind, an import that
does not resolve) is not cached (``fingerprint`` is None): it compiles as without the cache.
Nor is a launch-config-sensitive kernel. numba keeps what it compiled in memory (device
functions' overloads, ``compile_internal`` results) whatever a global is later set to; so once
any reached function's digest changes within a process (a global patched, then restored),
that process saves nothing more (``_digests``). An entry holds the kernel's cubin and launch
metadata, not its LLVM IR or PTX (``_reduce``): loaded, it runs on the device it was built
for, and it is bound to the device before it counts as a hit. Entries are written whole (a
temporary file, then a rename), so concurrent processes (ranks) share DIR safely; a failure
to read, bind or write one is a miss, never an error.
"""
from __future__ import annotations

import dis
import hashlib
import importlib.metadata
import importlib.util
import lzma
import os
import pickle
import sys
import types as pytypes

import numpy as np

ENV = "MOK_KERNEL_CACHE"
FORMAT = 1                      # bump when an entry's layout changes

_file_digests: dict = {}        # path -> (mtime_ns, size, sha256 hex)
_digests: dict = {}             # id(function) -> (function, digest): every one walked here
_stale = False                  # a walked function's digest changed in this process
_toolchain = None               # what ``_toolchain_key`` found (once a process)

_LIBRARIES = ("numba", "numba_cuda", "llvmlite", "numpy", "math", "cmath", "builtins",
              "operator", "functools")


class _Uncacheable(Exception):
    """The kernel reaches a value whose identity the key cannot state."""


def _file_digest(path: str) -> str:
    """sha256 of a file's bytes (memoised on its mtime and size)."""
    st = os.stat(path)
    got = _file_digests.get(path)
    if got is None or got[:2] != (st.st_mtime_ns, st.st_size):
        with open(path, "rb") as f:
            got = (st.st_mtime_ns, st.st_size, hashlib.sha256(f.read()).hexdigest())
        _file_digests[path] = got
    return got[2]


def _is_library(obj) -> bool:
    """numba's, llvmlite's, NumPy's or the standard library's own objects and modules: stated
    by name (their versions are in the key)."""
    mod = obj.__name__ if isinstance(obj, pytypes.ModuleType) else \
        getattr(obj, "__module__", None) or ""
    return mod.split(".")[0] in _LIBRARIES


def _ours(obj) -> bool:
    """A module whose attributes the walk follows."""
    return isinstance(obj, pytypes.ModuleType) and not _is_library(obj)


class _Walker:
    """One kernel's fingerprint: the tokens of what it reaches, and the files those are in."""

    def __init__(self):
        self.seen: dict = {}    # id(function) -> its token (cycles and shared helpers)
        self.functions: list = []               # every function reached
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
            if f and _ours(obj) and f.endswith(".py"):
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
            mod = sys.modules.get(getattr(obj, "__module__", ""), None)
            if isinstance(obj, type) and mod is not None:
                self.value(mod)                 # a class of ours: its module's file
            return ("named", getattr(obj, "__module__", ""), obj.__qualname__)
        if _is_library(obj):                    # numba's stubs and singletons
            return ("library", type(obj).__module__, type(obj).__qualname__, repr(obj))
        raise _Uncacheable(f"{type(obj).__module__}.{type(obj).__qualname__}")

    def _code(self, co, fn, body, names, mods):
        """A code object's bytes, constants (nested code: the same), named globals and the
        modules of ours it may read through (globals, run-time imports)."""
        body.append((co.co_name, co.co_code, co.co_names))
        names.update(co.co_names)
        for c in co.co_consts:
            if isinstance(c, pytypes.CodeType):
                self._code(c, fn, body, names, mods)
            else:
                body.append(self.value(c))
        for name in co.co_names:
            if name in fn.__globals__:
                g = fn.__globals__[name]
                body.append((name, self.value(g)))
                if _ours(g):
                    mods.append(g)
        level = 0
        for ins in dis.get_instructions(co):
            if ins.opname == "LOAD_CONST" and isinstance(ins.argval, int):
                level = ins.argval              # (an import's level precedes it)
            elif ins.opname == "IMPORT_NAME":
                try:
                    name = importlib.util.resolve_name("." * level + ins.argval,
                                                       fn.__globals__.get("__package__"))
                except (ImportError, ValueError) as e:
                    raise _Uncacheable(f"import {ins.argval}") from e
                mod = sys.modules.get(name)
                if mod is None:
                    raise _Uncacheable(f"import {name}: not imported yet")
                body.append(("import", self.value(mod)))
                if _ours(mod):
                    mods.append(mod)

    def function(self, fn):
        token = self.seen.get(id(fn))
        if token is not None:
            return token
        token = ("function", fn.__module__, fn.__qualname__)
        self.seen[id(fn)] = token               # before recursing: cycles end here
        self.functions.append(fn)
        f = fn.__code__.co_filename
        if os.path.isfile(f):
            self.files.add(f)
        body, names, mods = [], set(), []
        self._code(fn.__code__, fn, body, names, mods)
        cells = []
        for cell in fn.__closure__ or ():
            try:
                cells.append(cell.cell_contents)
            except ValueError:                  # an empty cell
                cells.append(None)
        extra = list(fn.__defaults__ or ()) + sorted((fn.__kwdefaults__ or {}).items())
        for v in cells + extra:
            body.append(self.value(v))
            if _ours(v):
                mods.append(v)
        # what the code may read through modules of ours (err.NF_X, F.helper, a.b.c): the
        # attributes it names, by value -- a patched one included -- modules followed on
        done = set()
        while mods:
            m = mods.pop()
            if m.__name__ in done:
                continue
            done.add(m.__name__)
            for name in sorted(names):
                if name in vars(m):
                    v = vars(m)[name]
                    body.append((m.__name__, name, self.value(v)))
                    if _ours(v):
                        mods.append(v)
        digest = hashlib.sha256(repr(body).encode()).hexdigest()
        _note_digest(fn, digest)
        token = ("function", fn.__module__, fn.__qualname__, digest)
        self.seen[id(fn)] = token
        return token


def _note_digest(fn, digest):
    """Remember ``fn``'s digest for the process; a different one later means numba may hold
    code compiled from what ``fn`` reached before (module docstring)."""
    global _stale
    prev = _digests.get(id(fn))
    if prev is not None and prev[1] != digest:
        _stale = True
    _digests[id(fn)] = (fn, digest)             # (the reference keeps the id unique)


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


def _toolchain_key():
    """The compiler and libraries that make a cubin: distribution versions, the driver's and
    NVVM's versions, libNVVM's and libdevice's bytes (once a process)."""
    global _toolchain
    if _toolchain is None:
        dists = sorted((d.metadata["Name"].lower(), d.version)
                       for d in importlib.metadata.distributions()
                       if (d.metadata["Name"] or "").lower().startswith(
                           ("numba", "llvmlite", "numpy", "cuda-", "nvidia-")))
        from numba.cuda import cuda_paths
        from numba.cuda.cudadrv import nvvm
        from numba.cuda.cudadrv.driver import driver
        try:
            paths = cuda_paths.get_cuda_paths()
        except Exception:
            paths = {}
        # each part that cannot be read is None (and stays so while the host is the same)
        parts = [lambda: driver.get_version(), lambda: nvvm.NVVM().get_version()]
        parts += [lambda k=k: _file_digest(paths[k].info) for k in ("nvvm", "libdevice")]
        found = []
        for part in parts:
            try:
                found.append(part())
            except Exception:
                found.append(None)
        _toolchain = (sys.version, tuple(dists), tuple(found))
    return _toolchain


def _device():
    """The current device's compute capability."""
    from numba import cuda
    return cuda.get_current_device().compute_capability


def key(dispatcher, argtypes):
    """The cache key of ``dispatcher`` specialised for ``argtypes`` (a hex digest), or None
    (not cacheable)."""
    fp = fingerprint(dispatcher.py_func)
    if fp is None:
        return None
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith("NUMBA_"))
    parts = (FORMAT, fp, tuple(str(t) for t in argtypes),
             repr(sorted(dispatcher.targetoptions.items())), env, _toolchain_key(), _device())
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


def _rebuild(entry, dispatcher, argtypes):
    """The compiled kernel of an entry, with what numba's ``_Kernel.__init__`` sets and
    ``_rebuild`` does not (``objectmode``, ``py_func``, ``argtypes``, ``launch_bounds``)."""
    from numba.cuda.codegen import CUDACodeLibrary
    from numba.cuda.dispatcher import _Kernel
    lib = CUDACodeLibrary._rebuild(**entry["library"])
    kernel = _Kernel._rebuild(codelibrary=lib, **entry["kernel"])
    kernel.objectmode = False
    kernel.py_func = dispatcher.py_func
    kernel.argtypes = argtypes
    kernel.launch_bounds = dispatcher.targetoptions.get("launch_bounds")
    kernel.lifted = []
    return kernel


class KernelCache:
    """A dispatcher's ``_cache`` (numba's cache protocol: ``load_overload`` / ``save_overload``
    / ``flush``) over the directory ``path``."""

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
        return argtypes, None if k is None else os.path.join(self.cache_path, k + ".xz")

    def load_overload(self, sig, _target_context):
        argtypes, path = self._path(sig)
        if path is None or not os.path.exists(path):
            return None
        try:
            with open(path, "rb") as f:
                kernel = _rebuild(pickle.loads(lzma.decompress(f.read())), self._dispatcher,
                                  argtypes)
            kernel.bind()                       # a cubin this device cannot load: a miss
        except Exception:                       # a torn or foreign entry: compile
            return None
        try:
            os.utime(path)                      # used: what a size cap keeps (newest first)
        except OSError:
            pass
        return kernel

    def save_overload(self, sig, kernel):
        _, path = self._path(sig)
        if path is None or _stale or getattr(kernel, "launch_config_sensitive", False):
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
        """numba's ``recompile``: keys are made again."""
        self._keys.clear()


def attach(dispatcher):
    """Give a kernel dispatcher the disk cache when ``MOK_KERNEL_CACHE`` is set (its value: the
    directory); returns the dispatcher."""
    path = os.environ.get(ENV)
    if path:
        dispatcher._cache = KernelCache(dispatcher, os.path.abspath(path))
    return dispatcher
