"""One kernel source for the GPU and for the CUDA simulator.

Every kernel in MoK-Py is written once and runs either compiled for the GPU or, when
``NUMBA_ENABLE_CUDASIM=1`` is set before numba is imported, on the CPU under numba's CUDA
simulator (that is how CI exercises kernel logic without a GPU). This module is the only place
that knows which of the two worlds we are in:

* ``SIM`` -- True under the simulator.
* ``kjit`` -- use instead of ``cuda.jit``; drops options the simulator's ``jit`` does not take.
* ``as_device_array`` -- framework-neutral, zero-copy view of a caller's array (numba device
  array, anything with ``__cuda_array_interface__`` or ``__dlpack__``); on the simulator, host
  arrays stand in for device memory.
* ``device_empty`` / ``device_full`` / ``upload`` / ``to_host`` -- allocation, set-up copies and
  read-back that work in both.

GPU-only intrinsics (inline PTX) live in ``mok_core.intrinsics`` with a Python twin each.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda
from numba.cuda.core import config as _numba_config

SIM: bool = bool(_numba_config.ENABLE_CUDASIM)

if SIM:
    from . import sim_runtime as _sim_runtime
    _sim_runtime.install()

# jit options that only mean something to the real compiler; the simulator's jit rejects them.
_GPU_ONLY_OPTIONS = ("lto", "lineinfo", "max_registers", "launch_bounds", "forceinline", "link",
                     "fastmath")


def kjit(*args, **kwargs):
    """``cuda.jit`` that also runs under the simulator (GPU-only options are dropped there); on
    the GPU a kernel (not a device function) gets ``mok_core.kernel_cache``'s disk cache when
    ``MOK_KERNEL_CACHE`` is set."""
    if SIM:
        for key in _GPU_ONLY_OPTIONS:
            kwargs.pop(key, None)
        if kwargs.get("inline") == "always":
            kwargs["inline"] = True
        return cuda.jit(*args, **kwargs)
    made = cuda.jit(*args, **kwargs)
    if kwargs.get("device"):
        return made
    from .kernel_cache import attach
    if hasattr(made, "py_func"):                # kjit(fn): the dispatcher
        return attach(made)
    return lambda fn: attach(made(fn))          # kjit(options)(fn)


def default_stream():
    """The stream launches use when the caller passes none (the legacy default stream)."""
    return 0


_BF16_TYPESTRS = ("<V2", "|V2")   # how CAI producers (torch) spell bfloat16

_DLPACK_CUDA = 2        # kDLCUDA
_DLPACK_CUDA_HOST = 3   # kDLCUDAHost
_DLPACK_CPU = 1


def _is_bf16(obj) -> bool:
    """Whether ``obj`` says its dtype is bfloat16 (ml_dtypes' NumPy dtype: jax, ml_dtypes)."""
    try:
        return np.dtype(getattr(obj, "dtype", None)).name == "bfloat16"
    except TypeError:
        return False


def as_device_array(obj, name: str, *, dtype=None, ndim: int | None = None, shape=None,
                    align: int = 1):
    """Zero-copy device view of ``obj`` with its dtype / rank / shape checked.

    Arguments:
        obj: a numba device array, or any object exposing ``__cuda_array_interface__`` or
            ``__dlpack__`` on a CUDA device (torch, cupy, jax, cuda.core). On the simulator a
            NumPy array (or a CPU tensor through DLPack) stands in for device memory.
        name: argument name used in error messages.
        dtype, ndim, shape: expected properties (``None`` = not checked; a ``-1`` in ``shape``
            matches any extent).
        align: the bytes its first element's address must be a multiple of (16 where kernels
            read or write it with 16-byte vectors or TMA).
    Always checked: C-contiguity (the kernels index a row as ``r * width``).
    Returns:
        numba device array (GPU) or NumPy array / simulator array (simulator) sharing memory with
        ``obj``. A bfloat16 array comes back as a uint16 view of its bits (MoK-Py's bf16
        convention), still zero-copy.
    Raises:
        TypeError for a wrong dtype or a host array on the GPU path, ValueError for a wrong shape.
    """
    if obj is None:
        raise TypeError(f"{name}: expected an array, got None")
    if SIM:
        arr = _sim_view(obj, name)
    else:
        arr = _gpu_view(obj, name)
    _check_props(arr, name, dtype=dtype, ndim=ndim, shape=shape)
    if align > 1 and arr.size and device_address(arr) % align:
        raise ValueError(f"{name}: must start {align}-byte aligned (the kernels read and write "
                         f"it {align} bytes at a time, or by TMA); this one is "
                         f"{device_address(arr) % align} bytes past")
    return arr


def _sim_view(obj, name):
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
    if isinstance(obj, (np.ndarray, FakeCUDAArray)):
        return obj.view(np.uint16) if _is_bf16(obj) else obj
    if _is_bf16(obj) and hasattr(obj, "__array__"):
        # NumPy's DLPack import has no bfloat16; a jax array / buffer callback buffer gives
        # its memory to np.asarray (writable where the producer allows)
        return np.asarray(obj).view(np.uint16)
    if hasattr(obj, "__dlpack__"):
        dev = obj.__dlpack_device__()[0] if hasattr(obj, "__dlpack_device__") else _DLPACK_CPU
        if dev != _DLPACK_CPU:
            raise TypeError(f"{name}: the simulator needs host (CPU) arrays, got DLPack device {dev}")
        return np.from_dlpack(obj)
    raise TypeError(f"{name}: expected an array (NumPy or DLPack), got {type(obj).__name__}")


def _gpu_view(obj, name):
    from numba.cuda.cudadrv.devicearray import DeviceNDArray
    if isinstance(obj, DeviceNDArray):
        return obj
    if cuda.is_cuda_array(obj):
        cai = dict(obj.__cuda_array_interface__)
        if cai.get("typestr") in _BF16_TYPESTRS or _is_bf16(obj):   # bf16 -> its uint16 bits
            cai["typestr"] = "<u2"
            return cuda.from_cuda_array_interface(cai, owner=obj, sync=False)
        return cuda.as_cuda_array(obj, sync=False)
    if isinstance(obj, np.ndarray):
        raise TypeError(f"{name}: a host NumPy array was passed; MoK-Py needs device memory "
                        "(pass a torch/cupy/jax CUDA array or a numba device array)")
    if hasattr(obj, "__dlpack__"):
        dev_type = obj.__dlpack_device__()[0]
        if dev_type != _DLPACK_CUDA:
            raise TypeError(f"{name}: array lives on DLPack device type {dev_type}, not CUDA")
        from cuda.core.utils import StridedMemoryView
        view = StridedMemoryView.from_dlpack(obj, stream_ptr=-1)
        dtype = np.dtype(view.dtype)
        itemsize = dtype.itemsize
        strides = None if view.strides is None else tuple(s * itemsize for s in view.strides)
        typestr = "<u2" if dtype.name == "bfloat16" else dtype.str
        cai = {"shape": tuple(view.shape), "strides": strides, "typestr": typestr,
               "data": (int(view.ptr), bool(view.readonly)), "version": 2}
        return cuda.from_cuda_array_interface(cai, owner=obj, sync=False)
    raise TypeError(f"{name}: expected a CUDA array (CAI or DLPack), got {type(obj).__name__}")


def _check_props(arr, name, *, dtype, ndim, shape):
    if dtype is not None and np.dtype(arr.dtype) != np.dtype(dtype):
        raise TypeError(f"{name}: expected dtype {np.dtype(dtype)}, got {np.dtype(arr.dtype)}")
    if ndim is not None and arr.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(arr.shape)}")
    if shape is not None:
        got = tuple(arr.shape)
        if len(got) != len(shape) or any(s != -1 and s != g for s, g in zip(shape, got)):
            want = tuple("*" if s == -1 else s for s in shape)
            raise ValueError(f"{name}: expected shape {want}, got {got}")
    if not arr.flags["C_CONTIGUOUS"]:      # the kernels index rows as [r * width + c]
        raise ValueError(f"{name}: must be C-contiguous (row-major, no strides), got strides "
                         f"{tuple(arr.strides)} for shape {tuple(arr.shape)}")


def names_rank(fn):
    """``fn(obj, ...)`` whose TypeError / ValueError (bad input found by its checks) says the
    rank it was found on, ``obj.rank``, unless the message names a rank already."""
    @functools.wraps(fn)
    def checked(obj, *args, **kwargs):
        try:
            return fn(obj, *args, **kwargs)
        except (TypeError, ValueError) as e:
            if len(e.args) == 1 and isinstance(e.args[0], str) and "rank" not in e.args[0]:
                e.args = (f"{e.args[0]}, on rank {obj.rank}",)
            raise
    return checked


def flat_view(arr, dtype=None):
    """``arr`` as a 1-D array (its bits as ``dtype`` when given: a ``.view``), zero-copy. On the
    GPU memoised on ``arr``: every step's launches flatten the workspace's persistent arrays
    again, and making and typing a numba view costs host time on every call."""
    if arr.ndim == 1 and dtype is None:
        return arr
    views = getattr(arr, "__dict__", None) if not SIM else None
    if views is not None:
        views = views.setdefault("_mok_flat_views", {})
        view = views.get(dtype)
        if view is not None:
            return view
    view = arr.reshape(arr.size) if arr.ndim != 1 else arr
    if dtype is not None:
        view = view.view(dtype)
    if views is not None:                 # (never the array itself: no cycle through it)
        views[dtype] = view
    return view


def device_address(arr) -> int:
    """Address of an array's first element: the device pointer on a GPU, the host address of
    the simulator's NumPy arrays."""
    if SIM:
        return int(arr.__array_interface__["data"][0])
    return int(arr.__cuda_array_interface__["data"][0])


def device_empty(shape, dtype, stream=0):
    """Uninitialised device array (a host array on the simulator)."""
    if SIM:
        return np.empty(shape, dtype=dtype)
    return cuda.device_array(shape, dtype=dtype, stream=stream)


def device_full(shape, value, dtype, stream=0):
    """Device array filled with ``value`` on ``stream`` (no host sync)."""
    if SIM:
        return np.full(shape, value, dtype=dtype)
    arr = cuda.device_array(shape, dtype=dtype, stream=stream)
    fill(arr, value, stream)
    return arr


def upload(host: np.ndarray, stream=0):
    """Device copy of a small host array (set-up only: a pageable copy waits for the host)."""
    if SIM:
        return np.array(host, copy=True)
    return cuda.to_device(np.ascontiguousarray(host), stream=stream)


def device_copy(dst, src, stream=0) -> None:
    """``dst[...] = src`` for device arrays of one size (may be a peer's memory): an async
    device-to-device copy on ``stream`` -- a copy-engine transfer, capturable in a CUDA graph."""
    if SIM:
        np.copyto(dst, src)
        return
    dst.copy_to_device(src, stream=stream)


class SideStream:
    """A second stream that a launch sequence forks work onto and joins back from, through
    events: ordered both ways with the caller's stream, so it runs concurrently with the
    caller's launches in between and is capturable in a CUDA graph (fork and join become graph
    edges). Non-blocking: a caller on the legacy default stream would otherwise serialise with
    it. Simulator: ``stream`` is 0 and fork / join do nothing (everything runs in order)."""

    def __init__(self):
        self.stream = 0
        self.pending = None         # what a caller forked for and must join (its own marker)
        if SIM:
            return
        import weakref

        from cuda.bindings import driver as cu
        cuda.current_context()              # numba's (primary) context current on this thread
        err, handle = cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING.value)
        if err != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuStreamCreate failed: {err}")
        self.stream = cuda.external_stream(int(handle))
        self._fork, self._join = cuda.event(timing=False), cuda.event(timing=False)
        weakref.finalize(self.stream, cu.cuStreamDestroy, handle)    # with its last user

    def fork(self, stream) -> None:
        """Work enqueued on ``self.stream`` from now on starts after ``stream``'s so far."""
        if not SIM:
            self._fork.record(stream)
            self._fork.wait(self.stream)

    def join(self, stream) -> None:
        """Work enqueued on ``stream`` from now on starts after ``self.stream``'s so far."""
        if not SIM:
            self._join.record(self.stream)
            self._join.wait(stream)


def to_host(arr, stream=0) -> np.ndarray:
    """Copy a device array to a fresh host NumPy array (synchronises ``stream``)."""
    if isinstance(arr, np.ndarray):
        return arr.copy()
    if hasattr(arr, "copy_to_host"):
        out = arr.copy_to_host(stream=stream) if not SIM else arr.copy_to_host()
        if not SIM and stream:
            stream.synchronize()
        return np.asarray(out)
    return np.asarray(arr)


@kjit
def _fill_kernel(flat, value):
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < flat.size:
        flat[i] = value
        i += stride


def fill(arr, value, stream=0):
    """Fill a device array with ``value`` on ``stream`` (kernel, no host sync)."""
    if SIM:
        arr[...] = value
        return
    flat = arr.reshape(arr.size) if arr.ndim != 1 else arr
    if flat.size == 0:
        return
    blocks = min(1024, (flat.size + 255) // 256)
    launch(_fill_kernel, blocks, 256, stream, 0, flat, flat.dtype.type(value))


_COMPILED: dict = {}         # (kernel, argument types, dynamic smem bytes) -> compiled kernel
_SMEM_LIMIT: dict = {}       # compiled kernel -> the dynamic smem limit set on it


def _compiled(kernel, args, smem_bytes):
    """numba's compiled specialisation of ``kernel`` for ``args``; above 48 KiB of dynamic
    shared memory the kernel's limit is raised first (numba does not) -- to the largest size
    asked for so far, so that launches of one kernel with two sizes both fit. Once per
    specialisation and size."""
    argtypes = tuple(kernel.typeof_pyval(a) for a in args)
    key = (id(kernel), argtypes, smem_bytes)
    compiled = _COMPILED.get(key)
    if compiled is None:
        compiled = kernel.compile(argtypes)
        if smem_bytes > _SMEM_LIMIT.get(compiled, 48 * 1024):
            from numba.cuda.cudadrv.driver import binding, driver
            cufunc = compiled._codelibrary.get_cufunc()
            attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            driver.cuKernelSetAttribute(attr, smem_bytes, cufunc.handle, cufunc.device.id)
            _SMEM_LIMIT[compiled] = smem_bytes
        _COMPILED[key] = compiled
    return compiled


def launch(kernel, grid, block, stream, smem_bytes, *args):
    """Launch a kjit kernel: ``kernel[grid, block, stream, smem_bytes](*args)``, raising its
    dynamic shared-memory limit first when it needs more than 48 KiB. On the GPU through
    ``mok_core.launcher`` (the same launch with a fraction of numba's host time)."""
    if not SIM:
        from . import launcher
        if launcher.launch(kernel, grid, block, stream, smem_bytes, args, _compiled):
            return
        if smem_bytes > 48 * 1024:
            _compiled(kernel, args, smem_bytes)
    kernel[grid, block, stream, smem_bytes](*args)


def multiprocessor_count() -> int:
    """SMs of the current device (4 on the simulator, to exercise persistent loops)."""
    if SIM:
        return 4
    return cuda.get_current_device().MULTIPROCESSOR_COUNT
