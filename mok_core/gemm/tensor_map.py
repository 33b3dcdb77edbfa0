"""TMA tensor maps for the grouped GEMMs' weight tiles (host side).

A tensor map is the 128-byte descriptor a Hopper TMA load reads: the global tensor (address,
extents, row stride), the box one instruction moves and the shared-memory swizzle. We build
them for 2-D views [rows, cols] of bf16 (uint16 bits) or float32 arrays with a box of
[box_rows, one 128-byte swizzle row] -- 64 bf16 or 32 float32 -- and the 128-byte swizzle:
exactly the ring layout the wgmma descriptors read (16-byte chunk c of row r at chunk c ^ (r %
8), 1024-byte aligned stages).
The forward's maps view weights as [E N, K] (a box = B rows of n x 64 of k: K-major); dgrad's
view them as stored, [E K, N], with [64, 64] boxes (64 rows of k x 64 of n: the MN-major
layout of ``sm90``'s B_KN). The wgmma wgrad stores through maps of its bf16 outputs, [E M, N]
with [16, 64] boxes (a warp's 16 rows of a tile, 64 columns a box), and through maps of
its float32 outputs with [16, 32] boxes (stored, or added to: main-grad).

Maps live in a device uint64 array, 16 elements (128 bytes) per map, map i at element 16 i;
kernels take that array (``tensormap_acquire`` + ``tma_load_2d``). Encoding goes straight to
``libcuda``'s ``cuTensorMapEncodeTiled`` through ctypes, writing into a 128-byte-aligned NumPy
buffer (the driver requires the alignment; we do not rely on a Python wrapper object's). On the
simulator a map is a handle into the twins' registry (``intrinsics.twins.register_tensor_map``).

Maps are cached per (address, shape, box): building one costs a driver call and an upload,
which must not happen inside a CUDA-graph capture -- the first (eager) call of a shape builds
them. A map only encodes the address and extents, so a cached map stays right for any array
later placed at the same address with the same shape.
"""
from __future__ import annotations

import ctypes

import numpy as np

from ..cuda_compat import SIM, device_address, flat_view, upload

BOX_BYTES = 128                    # a box row: the 128-byte swizzle atom's row
BOX_COLS = BOX_BYTES // 2          # bf16 columns a box row
MAP_ELEMS = 16                     # uint64 elements per map

# cuda.h enums (stable driver ABI)
_DATA_TYPES = {np.dtype(np.uint16): 9,    # CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 (bf16 bits)
               np.dtype(np.float32): 7}   # CU_TENSOR_MAP_DATA_TYPE_FLOAT32
_INTERLEAVE_NONE = 0
_SWIZZLE_128B = 3
_L2_PROMOTION_256B = 3
_OOB_FILL_ZERO = 0                 # CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE: out of bounds reads 0

_cache: dict = {}
_encode_fn = None


def _driver_encode():
    global _encode_fn
    if _encode_fn is None:
        lib = ctypes.CDLL("libcuda.so.1")
        f = lib.cuTensorMapEncodeTiled
        p64, p32 = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32)
        f.restype = ctypes.c_int
        f.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, p64, p64,
                      p32, p32, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        _encode_fn = f
    return _encode_fn


def encode_2d(arr2d, box_rows: int) -> np.ndarray:
    """The 128 bytes (uint64 [16]) of a tensor map over the row-major device array ``arr2d``
    [rows, cols] -- bf16 (uint16 bits) or float32 -- with a [box_rows, 128 bytes] box and the
    128-byte swizzle."""
    rows, cols = arr2d.shape
    dtype = np.dtype(arr2d.dtype)
    if dtype not in _DATA_TYPES:
        raise TypeError(f"a tensor map over {dtype}: bf16 (uint16 bits) or float32 only")
    box_cols = BOX_BYTES // dtype.itemsize
    if not (1 <= box_rows <= 256):
        raise ValueError(f"box_rows={box_rows}: a TMA box has 1..256 rows")
    if cols % box_cols:
        raise ValueError(f"cols={cols}: must be a multiple of {box_cols}")
    if SIM:
        from ..intrinsics import twins
        m = np.zeros(MAP_ELEMS, np.uint64)
        m[0] = twins.TMAP_MAGIC
        m[1] = twins.register_tensor_map(arr2d, box_rows, box_cols)
        return m
    addr = device_address(arr2d)
    if addr % 16:
        raise ValueError("a TMA tensor must start 16-byte aligned")
    buf = np.zeros(2 * MAP_ELEMS, np.uint64)
    k = (-buf.ctypes.data % 128) // 8
    out = buf[k:k + MAP_ELEMS]                          # 128-byte aligned
    dims = (ctypes.c_uint64 * 2)(cols, rows)            # innermost first
    strides = (ctypes.c_uint64 * 1)(cols * dtype.itemsize)   # bytes, dimension 0 left out
    box = (ctypes.c_uint32 * 2)(box_cols, box_rows)
    elem_strides = (ctypes.c_uint32 * 2)(1, 1)
    rc = _driver_encode()(out.ctypes.data, _DATA_TYPES[dtype], 2, addr, dims, strides, box,
                          elem_strides, _INTERLEAVE_NONE, _SWIZZLE_128B, _L2_PROMOTION_256B,
                          _OOB_FILL_ZERO)
    if rc != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed (CUresult {rc}) for a "
                           f"[{rows}, {cols}] {dtype} tensor, box [{box_rows}, {box_cols}]")
    return out.copy()


def tensor_maps(arrays2d, box_rows: int, stream=0, *, shapes=None):
    """Device uint64 [16 * len(arrays2d)]: one map per array (same box rows), cached.
    ``shapes``: the 2-D [rows, cols] each (contiguous) array is viewed as -- float32 arrays
    as float32, any other as its bf16 bits (default: the arrays' own shapes); the view is
    made only when the map is built."""
    if shapes is None:
        shapes = [a.shape for a in arrays2d]
    shapes = [tuple(int(n) for n in shp) for shp in shapes]
    dtypes = [np.dtype(np.float32 if np.dtype(a.dtype) == np.float32 else np.uint16)
              for a in arrays2d]
    key = tuple((device_address(a), shp, dt.str)
                for a, shp, dt in zip(arrays2d, shapes, dtypes)) + (box_rows,)
    maps = _cache.get(key)
    if maps is None:                         # no reference kept: arrays stay freeable
        views = [a if a.shape == shp and a.dtype == dt else flat_view(a, dt).reshape(shp)
                 for a, shp, dt in zip(arrays2d, shapes, dtypes)]
        host = np.concatenate([encode_2d(a, box_rows) for a in views])
        try:
            maps = upload(host, stream)
        except Exception as exc:             # typically: inside a CUDA-graph capture
            raise RuntimeError(
                f"uploading the TMA tensor maps of {len(arrays2d)} array(s) failed "
                f"({type(exc).__name__}: {exc}). New weights or bf16 weight-gradient buffers "
                "(a new address or shape) need "
                "their maps built outside a CUDA-graph capture: run the step once eagerly "
                "before capturing it (mok_torch.Layer.compile does)") from exc
        _cache[key] = maps
    return maps
