"""The FP8 quantizer lowers for sm_90: e4m3 conversion by cvt.rn.satfinite, the division IEEE,
the warp amax by redux.sync, nothing in local memory."""
from numba import boolean, float32, int32, int64, uint8, uint16, uint32

from mok_core.quantize import dequantize_mx_kernel, quantize_kernel
from ptx_util import compile_sm90


def test_quantize_kernel_lowers():
    sig = (uint16[::1], int64, int64, uint32[::1], float32[::1], uint8[::1], boolean, boolean,
           boolean, int32[::1], int32, int32)
    ptx = compile_sm90(quantize_kernel, sig)
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
    assert "div.rn.f32" in ptx
    assert "redux.sync.min.s32" in ptx
    assert ".local" not in ptx


def test_dequantize_mx_kernel_lowers():
    ptx = compile_sm90(dequantize_mx_kernel, (uint32[::1], uint8[::1], int64, uint32[::1]))
    assert ".local" not in ptx
