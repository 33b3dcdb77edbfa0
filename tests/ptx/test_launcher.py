"""mok_core.launcher packs kernel parameters exactly as numba's dispatcher does (no GPU needed:
device arrays over a fake allocation, numba's own ``_Kernel._prepare_args`` as the oracle)."""
import ctypes

import numpy as np
import pytest
from numba.cuda.cudadrv.devicearray import DeviceNDArray
from numba.cuda.dispatcher import _Kernel
from numba.cuda.typing.typeof import Purpose, typeof

from mok_core import launcher


class _FakeAllocation:
    """Stands in for device memory: only its address is read."""

    def __init__(self, address):
        self.device_ctypes_pointer = ctypes.c_void_p(address)


def _device_array(shape, dtype, strides=None, address=0x7F0000001000):
    dtype = np.dtype(dtype)
    if strides is None:
        strides = np.empty(shape, dtype).strides
    return DeviceNDArray(shape, strides, dtype, gpu_data=_FakeAllocation(address))


class _NumbaOracle:
    extensions = []
    _prepare_args = _Kernel._prepare_args


def _numba_params(args):
    out, oracle = [], _NumbaOracle()
    for a in args:
        oracle._prepare_args(typeof(a, Purpose.argument), a, 0, [], out)
    return out


def _plain(params):
    """Parameters as comparable (kind, value) pairs (ctypes objects by their type and value)."""
    return [(type(p).__name__, p.value if isinstance(p, ctypes._SimpleCData) else p)
            for p in params]


def _cases():
    a1 = _device_array((1000,), np.uint16)
    a2 = _device_array((64, 7168), np.uint16, address=0x7F0000200000)
    a3 = _device_array((8, 16, 4), np.int32, address=0x7F0000300000)
    f_order = _device_array((16, 8), np.float32, strides=(4, 64))
    sliced = _device_array((16, 8), np.float32, strides=(64, 8))       # every other column
    peers = (_device_array((4096,), np.uint16, address=0x7F0010000000),
             _device_array((4096,), np.uint16, address=0x7F0020000000))
    return {
        "arrays": (a1, a2, a3),
        "layouts": (f_order, sliced),
        "tuple of arrays": (peers, a1),
        "integers": (np.int64(7), np.int32(-3), np.uint16(9), 5, -(1 << 40), a1),
        "floats and bool": (1.5, np.float32(0.25), np.float64(2.0), True, False, a2),
    }


@pytest.mark.parametrize("name", list(_cases()))
def test_flatten_matches_numba(name):
    args = _cases()[name]
    codes = tuple(launcher._code(typeof(a, Purpose.argument)) for a in args)
    assert None not in codes
    ours: list = []
    launcher.flatten(codes, args, ours)
    assert _plain(ours) == _plain(_numba_params(args))


def test_key_decides_numba_type():
    """Arguments with one signature key have one numba type (the key picks the compiled
    specialisation, so it must be as fine as numba's typing)."""
    samples = [0, 1, -1, 1 << 40, -(1 << 62), (1 << 63) - 1, np.int64(3), np.int32(3),
               np.uint64(3), 0.5, np.float32(0.5), True, np.bool_(True),
               _device_array((4,), np.uint16), _device_array((4, 4), np.uint16),
               _device_array((4, 4), np.float32, strides=(4, 16)),
               _device_array((4, 4), np.float32, strides=(32, 4)),
               (_device_array((4,), np.uint16), _device_array((4,), np.uint16))]
    by_key = {}
    for value in samples:
        key = launcher._key(value)
        assert key is not None, value
        ty = typeof(value, Purpose.argument)
        assert by_key.setdefault(key, ty) == ty, (value, key, by_key[key], ty)


def test_unknown_kinds_fall_back_to_numba():
    import collections
    import enum

    class Mode(enum.IntEnum):
        A = 1

    Pair = collections.namedtuple("Pair", "a b")
    assert launcher._key(1 << 63) is None                 # numba: uint64
    assert launcher._key(object()) is None
    assert launcher._key((1, object())) is None
    assert launcher._key(Mode.A) is None                  # numba: IntEnumMember
    assert launcher._key(Pair(1, 2)) is None              # numba: a NamedTuple per class


def test_flat_views_memoised_on_the_array():
    from mok_core.cuda_compat import flat_view
    a2 = _device_array((64, 7168), np.uint16)
    flat = flat_view(a2)
    assert flat is flat_view(a2) and flat.shape == (64 * 7168,)
    assert flat_view(a2, np.uint32) is flat_view(a2, np.uint32)
    assert flat_view(a2, np.uint32).shape == (32 * 7168,)
    a1 = _device_array((1000,), np.uint16)
    assert flat_view(a1) is a1 and "_mok_flat_views" not in a1.__dict__     # no self-cycle
    assert flat_view(a1, np.uint32).device_ctypes_pointer.value == a1.device_ctypes_pointer.value
