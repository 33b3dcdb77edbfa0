"""NumPy reference of the FP8 quantizer (``mok_core.quantize``), exact to the bit.

e4m3 ("e4m3fn": 1 sign, 4 exponent bits with bias 7, 3 mantissa bits, no infinities, 0x7F /
0xFF NaN) holds +-448 at most, normals down to 2**-6 and subnormals down to 2**-9. A block of
values (1 x 128 or 128 x 128 of the output layout) gets one scale:

    amax  = max |v| over the block's finite values, 0 if none (float32; the bf16 inputs are
            exact in it): NaN/Inf are left out, so a block's other values keep their scale,
            and then quantise by the rule below -- NaN to the NaN byte 0x7F, +-Inf (Inf / s)
            saturated to +-448
    s     = amax / 448 in float32 (IEEE round to nearest), 1 when amax = 0;
            "ue8m0": s rounded up to a power of two (2**e, e the smallest with 2**e >= s),
            stored as the biased exponent byte e + 127
    q     = e4m3(v / s): the float32 quotient (IEEE round to nearest), then rounded to the
            nearest e4m3, ties to even, saturated to +-448 (what ``cvt.rn.satfinite`` does)

so dequantised values q * s are within half an e4m3 step of v, and v = 0 stays 0. Here the
rounding is computed by hand in float64 (exact: every float32 is a float64, the steps are
powers of two); the tests also compare it with ``ml_dtypes``.
"""
from __future__ import annotations

import numpy as np

E4M3_MAX = 448.0


def e4m3_bits(v) -> np.ndarray:
    """float32 values -> e4m3 bytes (uint8): round to nearest even, saturate to +-448,
    NaN -> 0x7F."""
    v = np.asarray(v, np.float32).astype(np.float64)
    nan = np.isnan(v)
    sign = np.signbit(v).astype(np.uint8) << 7
    a = np.minimum(np.abs(np.where(nan, 0.0, v)), E4M3_MAX)
    _, ex = np.frexp(a)                               # a = m 2**ex, m in [0.5, 1)
    e = np.maximum(ex - 1, -6)                        # below 2**-6: the subnormal step
    step = np.ldexp(1.0, e - 3)
    val = np.minimum(np.rint(a / step) * step, E4M3_MAX)      # np.rint: ties to even
    _, ev = np.frexp(val)
    ev = ev - 1
    normal = val >= 2.0 ** -6
    mant = np.where(normal, (np.ldexp(val, -ev) - 1) * 8, val * 2 ** 9)
    bits = np.where(normal, (ev + 7) * 8, 0) + mant
    out = bits.astype(np.uint8) | sign
    return np.where(nan, np.uint8(0x7F), out).astype(np.uint8)


def e4m3_values(bits) -> np.ndarray:
    """e4m3 bytes -> float64 values (0x7F / 0xFF -> NaN)."""
    b = np.asarray(bits, np.uint8).astype(np.int64)
    e, m = (b >> 3) & 0xF, b & 7
    mag = np.where(e == 0, m * 2.0 ** -9, np.ldexp(1 + m / 8, e - 7))
    mag = np.where((b & 0x7F) == 0x7F, np.nan, mag)
    return np.where(b & 0x80, -mag, mag)


def block_scales(amax, scale: str = "fp32"):
    """(the float32 divisor s, what is stored: float32 s or the uint8 exponent byte)."""
    amax = np.asarray(amax, np.float32)
    with np.errstate(invalid="ignore"):
        s = np.where(amax > 0, amax / np.float32(E4M3_MAX), np.float32(1)).astype(np.float32)
    if scale == "fp32":
        return s, s
    if scale != "ue8m0":
        raise ValueError(f"scale={scale!r}: must be 'fp32' or 'ue8m0'")
    bits = s.view(np.uint32)
    e = (bits >> 23) & 0xFF
    e = np.minimum(np.maximum(e + ((bits & 0x7FFFFF) != 0), 1), 254)   # round up: 2**e >= s
    return (e.astype(np.uint32) << 23).view(np.float32), e.astype(np.uint8)


def quantize_fp8_reference(x, block=(1, 128), scale: str = "fp32", transpose: bool = False):
    """``mok_core.quantize.quantize_fp8`` in NumPy: x [R, C] (values exact in float32, e.g.
    bf16) -> (e4m3 bytes [R, C] or, ``transpose``, [C, R]; scales of the output layout:
    [rows, cols / 128] for (1, 128) blocks, [rows / 128, cols / 128] for (128, 128))."""
    x = np.asarray(x, np.float32)
    if transpose:
        x = x.T
    R, C = x.shape
    br, bc = block
    if bc != 128 or br not in (1, 128) or C % 128 or R % br:
        raise ValueError(f"block={block} on [{R}, {C}]: (1, 128) or (128, 128) blocks of "
                         "the output layout, whole blocks only")
    blocks = x.reshape(R // br, br, C // 128, 128)
    amax = np.where(np.isfinite(blocks), np.abs(blocks), np.float32(0)).max(axis=(1, 3))
    s, stored = block_scales(amax, scale)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        q = (blocks / s[:, None, :, None]).astype(np.float32)
    return e4m3_bits(q).reshape(R, C), stored


def dequantize_fp8(data, scales, block=(1, 128), scale: str = "fp32") -> np.ndarray:
    """float64 values of quantised data: q * s per block."""
    R, C = data.shape
    br = block[0]
    s = np.asarray(scales, np.float64) if scale == "fp32" else \
        np.ldexp(1.0, np.asarray(scales, np.int64) - 127)
    v = e4m3_values(data).reshape(R // br, br, C // 128, 128)
    return (v * s[:, None, :, None]).reshape(R, C)


def dequantize_mxfp8(data, scales) -> np.ndarray:
    """float64 values of MXFP8 data: e4m3 bytes [R, C] times 2**(E - 127), one E8M0 byte E per
    32 consecutive values of a row (scales [R, C / 32]; 255 = NaN)."""
    R, C = data.shape
    e = np.asarray(scales, np.int64)
    s = np.where(e == 255, np.nan, np.ldexp(1.0, e - 127))
    return (e4m3_values(data).reshape(R, C // 32, 32) * s[:, :, None]).reshape(R, C)


__all__ = ["E4M3_MAX", "block_scales", "dequantize_fp8", "dequantize_mxfp8", "e4m3_bits",
           "e4m3_values", "quantize_fp8_reference"]


def grouped_gemm_fp8_reference(a, a_scale, w, w_scale, offsets, num_rows):
    """float64 [C, N] of ``mok_core.gemm.fp8_gemm``: each expert's rows (segments clamped to
    ``num_rows``) times its weights, both dequantised (1 x 128 and 128 x 128 fp32 scales); NaN
    in rows of no expert (not written)."""
    A = dequantize_fp8(a, a_scale)
    E, N, _ = w.shape
    out = np.full((A.shape[0], N), np.nan)
    nr = int(np.asarray(num_rows).reshape(-1)[0])
    for e in range(E):
        lo, hi = min(int(offsets[e]), nr), min(int(offsets[e + 1]), nr)
        out[lo:hi] = A[lo:hi] @ dequantize_fp8(w[e], w_scale[e], block=(128, 128)).T
    return out


def grouped_wgrad_fp8_reference(a, a_scale, b, b_scale, offsets, num_rows):
    """float64 [E, M, N] of ``mok_core.gemm.fp8_wgrad``: for each expert, the sum over its rows
    r in [offsets[e], min(offsets[e + 1], num_rows)) of A[m, r] B[n, r], A dequantised with
    1 x 128 scales along r, B with 128 x 128."""
    A = dequantize_fp8(a, a_scale)
    B = dequantize_fp8(b, b_scale, block=(128, 128))
    E = len(offsets) - 1
    nr = int(np.asarray(num_rows).reshape(-1)[0])
    out = np.zeros((E, A.shape[0], B.shape[0]))
    for e in range(E):
        lo, hi = min(int(offsets[e]), nr), min(int(offsets[e + 1]), nr)
        out[e] = A[:, lo:hi] @ B[:, lo:hi].T
    return out
