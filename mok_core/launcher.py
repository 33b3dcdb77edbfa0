"""A lean kernel launch for the GPU: numba's compiled kernel, our own argument packing.

Why: a layer step issues ~20 launches, and most of the eager step's host time goes to numba's
dispatcher and argument preparation (docs/perf.md, "Host launch time"): per launch it types
every argument (``typeof``), re-wraps every array
(``wrap_arg`` / ``to_device``), makes a fresh ``LaunchConfig`` and a fresh cuda.core stream per
launch. Here, per launch:

1. the signature key -- one numba type per argument, an array's type memoised on the array
   object (its dtype, rank and layout never change) -- finds the compiled specialisation in a
   dict (first time: numba types the arguments and compiles, as its dispatcher would);
2. the arguments are flattened exactly as numba's ``_Kernel._prepare_args`` flattens them
   (an array: meminfo 0, parent 0, size, itemsize, data pointer, shape, strides in bytes; an
   integer as its ctypes type; a tuple element by element) -- ``tests/ptx/test_launcher.py``
   checks the two agree, argument kind by argument kind;
3. cuda.core's ``launch`` (what numba itself calls) runs it, with the ``LaunchConfig`` and the
   cuda.core stream wrapper cached.

Anything else (an argument kind not listed above; a cooperative, debug or extension kernel)
goes through numba's dispatcher unchanged. One GPU per process (MoK's EP model: a compiled
kernel is looked up for the device current at its first launch).
``MOK_NUMBA_LAUNCH=1`` in the environment (or ``ENABLED = False``) sends every launch through
numba's dispatcher -- the A/B switch of ``benchmarks/probes/probe_host.py``. GPU only (imported by
``cuda_compat.launch`` off the simulator, which launches through its own dispatcher).
"""
from __future__ import annotations

import ctypes
import os

import numpy as np
from cuda.core import LaunchConfig
from cuda.core import launch as _core_launch
from numba.cuda import types
from numba.cuda.cudadrv.devicearray import DeviceNDArray
from numba.cuda.cudadrv.driver import _to_core_stream

ENABLED: bool = os.environ.get("MOK_NUMBA_LAUNCH", "0") != "1"

_ENTRIES: dict = {}     # (kernel, dynamic smem bytes, signature key) -> _Entry
_CONFIGS: dict = {}     # (grid, block, smem bytes) -> cuda.core LaunchConfig
_STREAMS: dict = {}     # stream handle -> cuda.core Stream (a non-owning wrapper)


class _Entry:
    """One compiled specialisation: its cuda.core kernel and how to flatten its arguments."""
    __slots__ = ("kernel", "codes")

    def __init__(self, kernel, codes):
        self.kernel = kernel
        self.codes = codes


# Flattening codes, one per argument (a tuple's are nested):
_ARRAY, _CTYPE, _RAW = 0, 1, 2


def _code(ty):
    """Flattening code of one numba argument type, or None where numba's path must run."""
    if isinstance(ty, types.Array):
        return (_ARRAY,)
    if isinstance(ty, types.Integer):
        return (_CTYPE, getattr(ctypes, f"c_{ty}"))
    if ty == types.float64:
        return (_CTYPE, ctypes.c_double)
    if ty == types.float32:
        return (_CTYPE, ctypes.c_float)
    if ty == types.boolean:
        return (_RAW,)
    if isinstance(ty, types.BaseTuple):
        inner = tuple(_code(t) for t in ty)
        return None if any(c is None for c in inner) else (inner,)
    return None


def flatten(codes, args, out: list) -> None:
    """Append the kernel parameters of ``args`` to ``out``, as numba's ``_prepare_args`` does."""
    for code, value in zip(codes, args):
        kind = code[0]
        if kind == _ARRAY:
            shim = value._strided_memory_view_shim
            out += (0, 0, shim.size, shim.dtype.itemsize, shim.ptr)
            out += shim.shape
            out += shim._layout.strides_in_bytes
        elif kind == _CTYPE:
            out.append(code[1](value))
        elif kind == _RAW:
            out.append(value)
        else:
            flatten(kind, value, out)


def _key(value):
    """numba's type of an argument (the part of the signature it decides), or None."""
    if isinstance(value, DeviceNDArray):
        ty = value.__dict__.get("_mok_numba_type")
        if ty is None:
            ty = value._numba_type_
            value._mok_numba_type = ty
        return ty
    if type(value) is bool:
        return bool
    if type(value) is int:         # (not an IntEnum: numba types those apart)
        # numba types a Python int as int64, or uint64 from 2**63 on
        return int if -(1 << 63) <= value < (1 << 63) else None
    if isinstance(value, (np.integer, np.floating, np.bool_)):
        return value.dtype
    if type(value) is float:
        return float
    if type(value) is tuple:       # (not a namedtuple: numba types each class apart)
        inner = tuple(_key(v) for v in value)
        return None if any(k is None for k in inner) else inner
    return None


def _entry(kernel, args, smem_bytes, compile_fn):
    signature = tuple(_key(a) for a in args)
    if None in signature:
        return False                           # numba's dispatcher launches this one
    key = (kernel, smem_bytes, signature)
    entry = _ENTRIES.get(key)
    if entry is None:
        compiled = compile_fn(kernel, args, smem_bytes)
        codes = tuple(_code(t) for t in compiled.argument_types)
        if (any(c is None for c in codes) or compiled.cooperative or compiled.debug
                or compiled.extensions):
            entry = False                      # what numba's launch does beyond packing
        else:
            entry = _Entry(compiled._codelibrary.get_cufunc().kernel, codes)
        _ENTRIES[key] = entry
    return entry


def core_stream(stream):
    """The cuda.core stream of a numba stream (or 0: the legacy default stream), cached."""
    handle = int(stream.handle or 0) if stream else 0
    wrapped = _STREAMS.get(handle)
    if wrapped is None:
        wrapped = _STREAMS[handle] = _to_core_stream(stream)
    return wrapped


def _config(grid, block, smem_bytes):
    key = (grid, block, smem_bytes)
    config = _CONFIGS.get(key)
    if config is None:
        config = _CONFIGS[key] = LaunchConfig(grid=_dims(grid), block=_dims(block),
                                              shmem_size=int(smem_bytes))
    return config


def _dims(d):
    """A grid or block extent as cuda.core takes it: int, or a tuple of ints."""
    return tuple(int(x) for x in d) if isinstance(d, tuple) else int(d)


def launch(kernel, grid, block, stream, smem_bytes, args, compile_fn) -> bool:
    """Launch ``kernel`` (a numba dispatcher) on the GPU; False (nothing launched) where the
    caller must use numba's dispatcher. ``compile_fn(kernel, args, smem_bytes)`` returns the
    compiled specialisation (``cuda_compat._compiled``: it also raises the kernel's dynamic
    shared-memory limit)."""
    if not ENABLED:
        return False
    entry = _entry(kernel, args, smem_bytes, compile_fn)
    if entry is False:
        return False
    params: list = []
    flatten(entry.codes, args, params)
    _core_launch(core_stream(stream), _config(grid, block, smem_bytes), entry.kernel, *params)
    return True
