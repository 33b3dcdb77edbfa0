"""FP8 (e4m3) block quantization of bf16 tensors, as DeepSeek-V3's recipe scales them on Hopper.

    data, scales = quantize_fp8(x, block=(1, 128), scale="fp32", transpose=False)
    data, scales = quantize_expert_weights(w, scale="fp32", transpose=False)   # [E, R, C]

x [R, C] bf16 (uint16 bits) -> ``data`` uint8 e4m3 bytes in the *output layout* [R, C], or
[C, R] with ``transpose`` (the operand a GEMM wants with the other dimension contiguous: the
weight gradients' activations, K = tokens), and one scale per block of that layout:
``block=(1, 128)``: per output row and 128 columns (activations), scales [rows, cols / 128];
``(128, 128)``: per 128 x 128 block (weights), scales [rows / 128, cols / 128]. ``scale="fp32"``
stores the float32 scale; ``"ue8m0"`` rounds it up to a power of two and stores its biased
exponent byte (the MX convention). The rounding is exactly ``mok_core.quantize_reference``'s
(its docstring states it): s = amax / 448 (IEEE), q = e4m3(v / s) (IEEE quotient, then
``cvt.rn.satfinite``), so the GPU, the simulator and the reference agree to the bit.

Kernel contract (``quantize_kernel``): grid (C / 128, ceil(R / 128)), 256 threads = 8 warps; a
block owns the 128 x 128 input tile at (row 128 by, column 128 bx). It stages the tile in
shared memory as bf16 (rows past R read as zero), two bf16 loads per thread per step
(coalesced). A 128 x 128 block's amax is the maximum over the CTA (a warp reduction, then one
shared word per warp; max is exact and order-free, so deterministic). Then warp w quantizes
output lines 16w .. 16w + 15 of the tile -- a line is an input row, or an input column with
``transpose`` -- lane l taking elements 4l .. 4l + 3: a (1, 128) line's amax comes from a
warp reduction (``redux.sync`` on the float bits), every lane forms the same scale, packs its
four e4m3 bytes into one word and stores it (128 contiguous bytes per warp and line); lane 0
stores the scale.
NaN/Inf in the input is counted into the error word (``record_non_finite``: count, first row)
as tensor ``tensor``; that block's scale is then meaningless (its values are NaN or 448-
saturated). No atomics on the data path, nothing waits, no host sync.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int32, uint16, uint32

from . import errors as err
from .cuda_compat import as_device_array, device_empty, flat_view, kjit, launch
from .errors_record import record_non_finite
from .intrinsics import f32_as_u32, fdiv_rn, pack_e4m3x4, u32_as_f32, warp_min
from .quantize_reference import E4M3_MAX

THREADS = 256
_PITCH = 130          # shared row pitch in bf16: 65 words, so a column walk spreads over banks


@kjit(device=True, inline="always")
def _bf16(word_bits):
    return u32_as_f32(uint32(word_bits) << 16)


@kjit(device=True, inline="always")
def _warp_max(v):
    """The warp's largest of float32 values >= 0: their bit patterns order as int32 do, so one
    ``redux.sync`` min of the negated bits (exact, order-free)."""
    return u32_as_f32(uint32(-warp_min(-int32(f32_as_u32(v)))))


@kjit(device=True, inline="always")
def _scale(amax, ue8m0):
    """(float32 divisor, stored float32 value, stored exponent byte) of a block's amax."""
    s = float32(1.0)
    if amax > float32(0.0):
        s = fdiv_rn(amax, float32(E4M3_MAX))
    if not ue8m0:
        return s, s, int32(0)
    bits = f32_as_u32(s)
    e = int32((bits >> 23) & 0xFF)
    if bits & 0x7FFFFF:
        e += 1                                   # round up: 2**(e - 127) >= s
    e = min(max(e, int32(1)), int32(254))
    p = u32_as_f32(uint32(e) << 23)
    return p, p, e


@kjit
def quantize_kernel(x, R, C, out32, scales_f32, scales_u8, ue8m0, whole_block, transpose,
                    errors, tensor, rank):
    """Launch: grid (C / 128, ceil(R / 128)), THREADS threads (module docstring).

    x           uint16 [R*C]      bf16 bits, row-major
    out32       uint32 [R*C/4]    e4m3 bytes of the output layout, four per word
    scales_f32  float32 [n]       float32 scales (``ue8m0`` False), else unused
    scales_u8   uint8 [n]         exponent bytes (``ue8m0``), else unused
    whole_block                   one scale per 128 x 128 tile, else per line
    transpose                     the output is [C, R] (lines are input columns)
    """
    tile = cuda.shared.array((128, _PITCH), uint16)
    red = cuda.shared.array(8, float32)
    t = cuda.threadIdx.x
    lane = t % 32
    warp = t // 32
    r0 = cuda.blockIdx.y * 128
    c0 = cuda.blockIdx.x * 128
    amax = float32(0.0)
    bad = int32(0)
    first = int32(0)
    for i in range(t, 128 * 64, THREADS):       # 128 rows x 64 words of two bf16
        r = i // 64
        w = i % 64
        lo = uint16(0)
        hi = uint16(0)
        if r0 + r < R:
            base = (r0 + r) * C + c0 + 2 * w
            lo = x[base]
            hi = x[base + 1]
        tile[r, 2 * w] = lo
        tile[r, 2 * w + 1] = hi
        for h in (lo, hi):
            v = abs(_bf16(h))
            if not math.isfinite(v):
                if bad == 0:
                    first = r0 + r
                bad += 1
            else:
                amax = max(amax, v)
    if bad:
        record_non_finite(errors, tensor, rank, bad, first)
    if whole_block:
        amax = _warp_max(amax)
        if lane == 0:
            red[warp] = amax
    cuda.syncthreads()
    if whole_block:
        amax = red[0]
        for w in range(1, 8):
            amax = max(amax, red[w])
    lines_out = C if transpose else R           # output rows
    cols_out = R if transpose else C            # output columns
    line0 = c0 if transpose else r0             # this tile's first output row
    col0 = r0 if transpose else c0              # ... and first output column
    n_blk = cols_out // 128
    s, s_f32, s_u8 = _scale(amax, ue8m0)
    if whole_block and t == 0:
        k = (line0 // 128) * n_blk + col0 // 128
        if ue8m0:
            scales_u8[k] = s_u8
        else:
            scales_f32[k] = s_f32
    for j in range(16):
        line = warp * 16 + j
        if line0 + line >= lines_out:
            break
        v0 = float32(0.0)
        v1 = float32(0.0)
        v2 = float32(0.0)
        v3 = float32(0.0)
        e = 4 * lane
        if transpose:
            v0 = _bf16(tile[e, line])
            v1 = _bf16(tile[e + 1, line])
            v2 = _bf16(tile[e + 2, line])
            v3 = _bf16(tile[e + 3, line])
        else:
            v0 = _bf16(tile[line, e])
            v1 = _bf16(tile[line, e + 1])
            v2 = _bf16(tile[line, e + 2])
            v3 = _bf16(tile[line, e + 3])
        if not whole_block:
            m = float32(0.0)
            for v in (v0, v1, v2, v3):
                if math.isfinite(v):
                    m = max(m, abs(v))
            s, s_f32, s_u8 = _scale(_warp_max(m), ue8m0)
            if lane == 0:
                k = (line0 + line) * n_blk + col0 // 128
                if ue8m0:
                    scales_u8[k] = s_u8
                else:
                    scales_f32[k] = s_f32
        out32[((line0 + line) * cols_out + col0) // 4 + lane] = pack_e4m3x4(
            fdiv_rn(v0, s), fdiv_rn(v1, s), fdiv_rn(v2, s), fdiv_rn(v3, s))


def quantize_fp8(x, block=(1, 128), scale: str = "fp32", transpose: bool = False, *, out=None,
                 scales=None, stream=0, errors=None, tensor: int = err.NF_X, rank: int = 0):
    """x uint16 (bf16 bits) [R, C] -> (data uint8 [R, C] or [C, R], scales) (module
    docstring); ``out`` / ``scales`` are the caller's buffers or allocated here. C must be a
    multiple of 128, and R too unless ``block=(1, 128)`` without ``transpose``. ``errors``
    (int32 [ERROR_WORDS]) gets NaN/Inf counted as tensor ``tensor`` seen on ``rank``."""
    from .gemm import _check_errors, _error_word
    x = as_device_array(x, "x", dtype=np.uint16, ndim=2)
    R, C = x.shape
    block = tuple(block)
    if block not in ((1, 128), (128, 128)):
        raise ValueError(f"block={block}: must be (1, 128) or (128, 128)")
    if scale not in ("fp32", "ue8m0"):
        raise ValueError(f"scale={scale!r}: must be 'fp32' or 'ue8m0'")
    if C % 128 or ((transpose or block[0] == 128) and R % 128):
        raise ValueError(f"x: shape [{R}, {C}] -- columns must be a multiple of 128, and rows "
                         "too for (128, 128) blocks or a transposed output")
    rows, cols = (C, R) if transpose else (R, C)
    n_scales = (rows // block[0], cols // 128)
    dtype = np.float32 if scale == "fp32" else np.uint8
    out = device_empty((rows, cols), np.uint8, stream) if out is None else \
        as_device_array(out, "out", dtype=np.uint8, shape=(rows, cols))
    scales = device_empty(n_scales, dtype, stream) if scales is None else \
        as_device_array(scales, "scales", dtype=dtype, shape=n_scales)
    errors, tensor = _check_errors(errors, tensor)
    if R and C:
        dummy_f32 = scales if scale == "fp32" else device_empty((1,), np.float32, stream)
        dummy_u8 = scales if scale == "ue8m0" else device_empty((1,), np.uint8, stream)
        launch(quantize_kernel, (C // 128, -(-R // 128)), THREADS, stream, 0,
               x.reshape(R * C), np.int64(R), np.int64(C), flat_view(out, np.uint32),
               dummy_f32.reshape(dummy_f32.size), dummy_u8.reshape(dummy_u8.size),
               scale == "ue8m0", block[0] == 128, bool(transpose), _error_word(errors),
               np.int32(tensor), np.int32(rank))
    return out, scales


@kjit(device=True, inline="always")
def _e4m3_value(b):
    """An e4m3 byte's value as float32, exactly (0x7F / 0xFF: NaN)."""
    e = (b >> 3) & 0xF
    m = float32(b & 7)
    v = m * float32(2.0 ** -9)
    if e:
        v = (float32(8.0) + m) * u32_as_f32(uint32(e + 117) << 23)   # (8 + m) 2**(e - 10)
    if (b & 0x7F) == 0x7F:
        v = u32_as_f32(uint32(0x7FC00000))
    return -v if b & 0x80 else v


@kjit
def dequantize_mx_kernel(data32, scales, cols, out32):
    """Launch: any grid. data32 uint32 [R*C/4] e4m3 bytes, scales uint8 [R*C/32] (one E8M0
    exponent per 32 consecutive values of a row), out32 uint32 [R*C/2]: bf16 pairs, exact
    (a value has 4 significant bits, bf16 keeps 8) down to bf16's normal range."""
    i = cuda.grid(1)
    while i < data32.shape[0]:
        w = data32[i]
        e = uint32(scales[(4 * i) // 32])
        s = u32_as_f32(e << 23)
        if e == 0:
            s = u32_as_f32(uint32(0x00400000))           # 2**-127 (subnormal in float32)
        elif e == 255:
            s = u32_as_f32(uint32(0x7FC00000))           # E8M0's NaN
        v0 = _e4m3_value(w & 0xFF) * s
        v1 = _e4m3_value((w >> 8) & 0xFF) * s
        v2 = _e4m3_value((w >> 16) & 0xFF) * s
        v3 = _e4m3_value(w >> 24) * s
        out32[2 * i] = (f32_as_u32(v1) & 0xFFFF0000) | (f32_as_u32(v0) >> 16)
        out32[2 * i + 1] = (f32_as_u32(v3) & 0xFFFF0000) | (f32_as_u32(v2) >> 16)
        i += cuda.gridsize(1)


def mxfp8_to_blockwise(data, scales, block=(128, 128), scale: str = "fp32", *,
                       transpose: bool = False, stream=0):
    """MXFP8 (e4m3 ``data`` [R, C] with an E8M0 exponent byte per 32 consecutive values of a
    row, ``scales`` uint8 [R, C / 32] -- Blackwell's format) -> ``quantize_fp8``'s layout, once
    (e.g. at checkpoint load). Through bf16, which holds every MX value exactly, then
    ``quantize_fp8``. With ``scale="ue8m0"`` the values are kept exactly where a block's
    32-groups share one exponent (the new power-of-two scale only shifts them); otherwise, and
    with float32 scales, each value moves by at most half an e4m3 step of its new block scale
    (groups with smaller exponents lose low bits)."""
    data = as_device_array(data, "data", dtype=np.uint8, ndim=2)
    R, C = data.shape
    if C % 128:
        raise ValueError(f"data: {C} columns, must be a multiple of 128")
    scales = as_device_array(scales, "scales", dtype=np.uint8, shape=(R, C // 32))
    bf16 = device_empty((R, C), np.uint16, stream)
    if R:
        launch(dequantize_mx_kernel, min(1024, -(-R * C // 4 // THREADS)), THREADS, stream, 0,
               flat_view(data, np.uint32), scales.reshape(scales.size), np.int64(C),
               flat_view(bf16, np.uint32))
    return quantize_fp8(bf16, block, scale, transpose, stream=stream)


def quantize_expert_weights(w, scale: str = "fp32", transpose: bool = False, *, out=None,
                            scales=None, stream=0, errors=None, tensor: int = err.NF_X,
                            rank: int = 0):
    """Expert weights bf16 (uint16 bits) [E, R, C] -> e4m3 [E, R, C] (``transpose``: each
    expert's transpose, [E, C, R]) with one scale per 128 x 128 block of that layout ([E, R /
    128, C / 128] or [E, C / 128, R / 128]) -- what ``mok_core.gemm.fp8_gemm`` takes, made once
    per optimizer step: the forward reads the weights as stored, the dgrads reduce over their
    other side and take the transposed copies (docs/design.md, FP8). R and C multiples of 128.
    As stored: one launch over [E R, C] (a 128-row block never spans two experts); transposed:
    one launch per expert. ``out`` / ``scales``: the caller's buffers, else allocated here."""
    w = as_device_array(w, "w", dtype=np.uint16, ndim=3)
    E, R, C = w.shape
    if R % 128 or C % 128:
        raise ValueError(f"w: shape [{E}, {R}, {C}] -- each expert's rows and columns must be "
                         "multiples of 128 (128 x 128 blocks)")
    rows, cols = (C, R) if transpose else (R, C)
    dtype = np.float32 if scale == "fp32" else np.uint8
    out = device_empty((E, rows, cols), np.uint8, stream) if out is None else \
        as_device_array(out, "out", dtype=np.uint8, shape=(E, rows, cols))
    scales = device_empty((E, rows // 128, cols // 128), dtype, stream) if scales is None \
        else as_device_array(scales, "scales", dtype=dtype, shape=(E, rows // 128, cols // 128))
    kw = dict(stream=stream, errors=errors, tensor=tensor, rank=rank)
    if not transpose:
        quantize_fp8(w.reshape(E * R, C), (128, 128), scale, out=out.reshape(E * R, C),
                     scales=scales.reshape(E * R // 128, C // 128), **kw)
    else:
        for e in range(E):
            quantize_fp8(w[e], (128, 128), scale, True, out=out[e], scales=scales[e], **kw)
    return out, scales


__all__ = ["dequantize_mx_kernel", "mxfp8_to_blockwise", "quantize_expert_weights",
           "quantize_fp8", "quantize_kernel"]
