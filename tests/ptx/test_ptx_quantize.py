"""The FP8 quantizer lowers for sm_90: e4m3 conversion by cvt.rn.satfinite, the division IEEE,
the warp amax by redux.sync, nothing in local memory; the row kernel streams (no shared memory),
8 bytes a lane, divides by an fma correction of v / s's product with 1 / s and checks for NaN/Inf
with one vote; the FP8 row gather (``gather_rows``) copies 16 bytes a lane."""
from numba import boolean, float32, int32, int64, uint8, uint16, uint32, uint64

from mok_core.gather_rows import gather_rows_kernel
from mok_core.quantize import (dequantize_mx_kernel, quantize_cols_kernel, quantize_kernel,
                               quantize_rows_kernel)
from ptx_util import compile_sm90, count


def test_quantize_kernel_lowers():
    sig = (uint16[::1], int64, int64, uint32[::1], float32[::1], uint8[::1], boolean,
           int32[::1], int32, int32)
    ptx = compile_sm90(quantize_kernel, sig)
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
    assert "div.rn.f32" in ptx
    assert "redux.sync.min.s32" in ptx
    assert ".local" not in ptx


def test_quantize_rows_kernel_lowers():
    sig = (uint64[::1], int32[::1], boolean, int64, int64, int32[::1], boolean, uint32[::1],
           float32[::1], uint8[::1], boolean, int32[::1], int32, int32)
    ptx = compile_sm90(quantize_rows_kernel, sig)
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
    assert "div.rn.f32" in ptx                   # the scale, its reciprocal, the slow path
    assert "fma.rn.f32" in ptx and "mul.rn.f32" in ptx       # the fast quotient
    assert "ld.global.u64" in ptx                # 8 bytes a lane
    assert "redux.sync.min.s32" in ptx
    assert "vote.sync.all.pred" in ptx
    assert ".local" not in ptx
    assert ".shared" not in ptx


def test_dequantize_mx_kernel_lowers():
    ptx = compile_sm90(dequantize_mx_kernel, (uint32[::1], uint8[::1], int64, uint32[::1]))
    assert ".local" not in ptx


def test_quantize_cols_kernel_lowers():
    """The transposing kernel: 16-byte loads (eight in flight a thread), column maxima two
    columns an instruction, the fast quotient, no local memory."""
    sig = (uint32[::1], int32[::1], boolean, int32[::1], boolean, int64, int64, int64,
           uint32[::1], float32[::1], uint8[::1], boolean, boolean, int64, int64, int32[::1],
           int32, int32)
    ptx = compile_sm90(quantize_cols_kernel, sig)
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
    assert "fma.rn.f32" in ptx and "mul.rn.f32" in ptx
    assert count(ptx, r"ld\.global\.v4\.u32") == 8
    assert count(ptx, r"max\.u16x2") >= 32      # a staged word's max, no flag word
    assert "redux.sync.min.s32" in ptx
    assert ".local" not in ptx


def test_gather_rows_kernel_lowers():
    sig = (uint32[::1], float32[::1], int32[::1], int32[::1], int64, int64, int64, uint32[::1],
           float32[::1])
    ptx = compile_sm90(gather_rows_kernel, sig)
    assert "ld.global.v4.u32" in ptx and "st.global.v4.u32" in ptx
    assert ".local" not in ptx
    assert ".shared" not in ptx
