"""FP8 block quantization (``mok_core.quantize``) bit for bit against its NumPy reference, every
mode (1 x 128 / 128 x 128 blocks, fp32 / ue8m0 scales, transposed or not, gathered through an
index), on the CUDA simulator in CI and unchanged on a GPU (where ``cvt.rn.satfinite`` does the
rounding); the reference's rounding against ``ml_dtypes``; NaN/Inf reported; bad arguments
refused; no allocation with the caller's buffers (CUDA-graph capture)."""
import ml_dtypes
import numpy as np
import pytest

from helpers import to_dev
import mok_core.quantize as quantize_module
from mok_core import errors as err
from mok_core.cuda_compat import SIM, device_full, multiprocessor_count, to_host
from mok_core.quantize import quantize_expert_weights, quantize_fp8
from mok_core.quantize_reference import (dequantize_fp8, dequantize_mxfp8, e4m3_bits,
                                         e4m3_values, quantize_fp8_reference)

BF16_NAN, BF16_INF, BF16_NEG_INF = 0x7FC0, 0x7F80, 0xFF80

R, C = (160, 256) if SIM else (4096, 7168)          # 160: a partial row tile


def bf16_values(bits):
    return np.asarray(bits, np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)


def bf16_bits(a):
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def inputs(seed, rows=R, cols=C):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)) * np.exp(rng.uniform(-8, 8, (rows, 1)))
    x[:, :128][rng.random((rows, 128)) < 0.5] = 0           # sparse blocks
    x[3] = 0                                                 # an all-zero line
    x[5, 7] = 60000.0                                        # one outlier in its block
    return bf16_bits(x)


@pytest.mark.parametrize("block,scale,transpose", [
    ((1, 128), "fp32", False), ((1, 128), "ue8m0", False), ((1, 128), "fp32", True),
    ((128, 128), "fp32", False), ((128, 128), "ue8m0", True)])
def test_quantize_matches_reference(block, scale, transpose):
    rows = R if block == (1, 128) and not transpose else 128 * (R // 128)
    xb = inputs(1, rows)
    data, scales = quantize_fp8(to_dev(xb), block, scale, transpose)
    want_data, want_scales = quantize_fp8_reference(
        xb.view(ml_dtypes.bfloat16).astype(np.float32), block, scale, transpose)
    np.testing.assert_array_equal(to_host(data), want_data)
    np.testing.assert_array_equal(to_host(scales), want_scales)
    # what the scales promise: dequantised values within half an e4m3 step of x (2**-4
    # relative; half the subnormal step, 2**-10 s, near zero)
    x = xb.view(ml_dtypes.bfloat16).astype(np.float64)
    x = x.T if transpose else x
    deq = dequantize_fp8(want_data, want_scales, block, scale)
    s = dequantize_fp8(np.full(want_data.shape, 0x38, np.uint8), want_scales, block, scale)
    assert np.all(np.abs(deq - x) <= 2.0 ** -4 * np.abs(x) + 2.0 ** -10 * s)


@pytest.mark.parametrize("transpose", [False, True])
def test_expert_weights(transpose):
    """``quantize_expert_weights``: every expert bit for bit its own ``quantize_fp8_reference``
    with 128 x 128 blocks, as stored (one launch over all experts: blocks never span two) or
    each expert transposed."""
    E, rows, cols = 3, 128, 256
    w = np.stack([inputs(10 + e, rows, cols) for e in range(E)])
    w[1] = bf16_bits(np.full((rows, cols), 1e-3) * np.arange(cols))   # scales differ by expert
    data, scales = quantize_expert_weights(to_dev(w), transpose=transpose)
    data, scales = to_host(data), to_host(scales)
    assert data.shape == ((E, cols, rows) if transpose else (E, rows, cols))
    for e in range(E):
        want_data, want_scales = quantize_fp8_reference(
            w[e].view(ml_dtypes.bfloat16).astype(np.float32), (128, 128), "fp32", transpose)
        np.testing.assert_array_equal(data[e], want_data)
        np.testing.assert_array_equal(scales[e], want_scales)
    with pytest.raises(ValueError, match=r"w: shape \[3, 100, 256\] -- each expert's rows"):
        quantize_expert_weights(to_dev(w[:, :100]))


@pytest.mark.parametrize("scale", ["fp32", "ue8m0"])
def test_expert_weights_transposed_side_by_side(scale):
    """[W_gate; W_up]^T as the FP8 dgrad reads it ([E, H, 2I]), made from the two weights
    with ``column=``: bit for bit the stacked weight quantised and transposed, each half
    ``quantize_fp8_reference`` of its own weight's transpose; the other columns untouched."""
    E, I, H = 2, 128, 256
    wg = np.stack([inputs(30 + e, I, H) for e in range(E)])
    wu = np.stack([inputs(40 + e, I, H) for e in range(E)])
    wu[1] = bf16_bits(np.full((I, H), 3e-2) * np.arange(H))      # another scale per expert
    stacked, stacked_scales = quantize_expert_weights(to_dev(np.concatenate([wg, wu], 1)),
                                                      scale, transpose=True)
    dtype = np.float32 if scale == "fp32" else np.uint8
    out = device_full((E, H, 3 * I), 0x11, np.uint8)              # a third block left alone
    scales = device_full((E, H // 128, 3), 7, dtype)
    for w, col in ((wg, 0), (wu, I)):
        quantize_expert_weights(to_dev(w), scale, transpose=True, out=out, scales=scales,
                                column=col)
    out, scales = to_host(out), to_host(scales)
    np.testing.assert_array_equal(out[:, :, :2 * I], to_host(stacked))
    np.testing.assert_array_equal(scales[:, :, :2], to_host(stacked_scales))
    assert np.all(out[:, :, 2 * I:] == 0x11) and np.all(scales[:, :, 2] == 7)
    for e in range(E):
        want, want_scales = quantize_fp8_reference(
            wu[e].view(ml_dtypes.bfloat16).astype(np.float32), (128, 128), scale, True)
        np.testing.assert_array_equal(out[e, :, I:2 * I], want)
        np.testing.assert_array_equal(scales[e, :, 1:2], want_scales)
    with pytest.raises(ValueError, match=r"column=256: must be a multiple of 128 with "
                                         r"column \+ 128 <= out's 256 columns"):
        quantize_expert_weights(to_dev(wg), transpose=True, out=np.zeros((E, H, 2 * I),
                                                                          np.uint8), column=256)
    with pytest.raises(ValueError, match="column=128: only with transpose=True"):
        quantize_expert_weights(to_dev(wg), column=128)


def test_reference_rounding_equals_ml_dtypes():
    rng = np.random.default_rng(0)
    v = np.concatenate([rng.standard_normal(20000) * s for s in (1e-3, 1, 100)])
    q = e4m3_values(np.arange(256, dtype=np.uint8))
    q = np.sort(q[np.isfinite(q)])
    mids = (q[:-1] + q[1:]) / 2                                # every tie, both ways
    v = np.concatenate([v, mids, np.nextafter(mids, np.inf), np.nextafter(mids, -np.inf),
                        [0.0, -0.0, 448.0, 464.0, 1e6, -1e6]]).astype(np.float32)
    want = np.clip(v, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    np.testing.assert_array_equal(e4m3_bits(v), want)


def test_nonfinite_reported():
    xb = inputs(2, 128, 256)
    xb[70, 200] = 0x7FC0                                      # NaN
    xb[90, 3] = 0x7F80                                        # +Inf
    errors = device_full((err.ERROR_WORDS,), 0, np.int32)
    quantize_fp8(to_dev(xb), (128, 128), errors=errors, tensor=err.NF_D_OUT, rank=1)
    words = to_host(errors)
    assert words[err.FLAGS] & err.ERR_NON_FINITE
    assert words[err.NONFINITE + 2 * err.NF_D_OUT] == 2
    assert err.INT32_MAX - words[err.NONFINITE + 2 * err.NF_D_OUT + 1] == 70


# (rows, cols): rows not a multiple of 128, several column groups
ROW_SHAPES = [(70, 384)] if SIM else [(5000, 384), (4097, 7168)]


@pytest.mark.parametrize("shape", ROW_SHAPES)
@pytest.mark.parametrize("scale", ["fp32", "ue8m0"])
@pytest.mark.parametrize("blocks_per_sm", [None, 1])
def test_rows_kernel_matches_reference(shape, scale, blocks_per_sm, monkeypatch):
    """``block=(1, 128)`` without ``transpose`` (``quantize_rows_kernel``) bit for bit, into the
    caller's buffers (every byte written); with one block per SM, more items than one pass of
    the grid covers, so warps loop (the prefetch of the next pass included)."""
    rows, cols = shape
    rng = np.random.default_rng(20)
    xb = inputs(20, rows, cols)
    xb[7] = bf16_bits(rng.standard_normal(cols) * 1e-30)     # scales below _FAST_SCALE: divided
    xb[8] = bf16_bits(rng.standard_normal(cols) * 1e30)
    xb[9, ::3] = bf16_bits(rng.standard_normal(cols)[::3] * 1e-39)   # bf16 subnormals
    if blocks_per_sm is not None:
        monkeypatch.setattr(quantize_module, "_ROW_BLOCKS_PER_SM", blocks_per_sm)
        assert rows * cols // 128 > multiprocessor_count() * blocks_per_sm * \
            quantize_module.THREADS // 32 * quantize_module._ROW_ITEMS
    dtype = np.float32 if scale == "fp32" else np.uint8
    out = to_dev(np.full((rows, cols), 0xAB, np.uint8))
    scales = to_dev(np.full((rows, cols // 128), 77, dtype))
    data, sc = quantize_fp8(to_dev(xb), (1, 128), scale, out=out, scales=scales)
    want_data, want_scales = quantize_fp8_reference(bf16_values(xb), (1, 128), scale)
    np.testing.assert_array_equal(to_host(data), want_data)
    np.testing.assert_array_equal(to_host(sc), want_scales)


@pytest.mark.skipif(not SIM, reason="calls device functions on the host (the GPU's check: "
                    "the row kernel's tests)")
def test_fast_quotient_is_the_division():
    """``_fast_quotient`` (v r, then one fma correction) against the IEEE division: on bf16
    values of every size under their row's amax, the scale RN(amax / 448); and the row
    kernel's scale (amax / 448 that way) against ``_scale``'s division for every bf16 amax."""
    rng = np.random.default_rng(6)
    n = 3000
    amax = bf16_values(bf16_bits(2.0 ** rng.uniform(-50, 120, n)))
    s = (amax / np.float32(448)).astype(np.float32)
    v = bf16_values(bf16_bits(amax * rng.uniform(-1, 1, n) * 2.0 ** -rng.integers(0, 40, n)))
    v[:4] = [0.0, -0.0, amax[2], -amax[3]]                    # zeros keep their sign
    r = (np.float32(1) / s).astype(np.float32)
    assert np.all(s >= quantize_module._FAST_SCALE)
    for vi, si, ri in zip(v, s, r):
        got, want = quantize_module._fast_quotient(vi, si, ri), np.float32(vi / si)
        assert got.view(np.uint32) == want.view(np.uint32), (vi, si, got, want)
    every_amax = bf16_values(np.arange(0, 0x7F80, dtype=np.uint16))
    for ue8m0 in (False, True):
        for a in every_amax:
            assert quantize_module._row_scale(a, ue8m0) == quantize_module._scale(a, ue8m0), a


def gather_reference(xb, index, scale):
    """The reference on x[index] with zero rows where index < 0."""
    rows = np.where(index[:, None] >= 0, bf16_values(xb)[np.maximum(index, 0)], 0.0)
    return quantize_fp8_reference(rows.astype(np.float32), (1, 128), scale)


@pytest.mark.parametrize("scale", ["fp32", "ue8m0"])
def test_rows_kernel_gathers(scale):
    """``index``: output row r is x row index[r] -- repeated rows, padding rows (-1: zeros,
    scale 1.0 / exponent byte 127), as many output rows as index has (not a multiple of 128)."""
    rng = np.random.default_rng(7)
    R_in, cols, R_out = 40, 256, 90
    xb = inputs(21, R_in, cols)
    index = rng.integers(0, R_in, R_out).astype(np.int32)
    index[rng.random(R_out) < 0.3] = -1
    index[:4] = [-1, 5, 5, R_in - 1]                          # padding, a repeat, the last row
    index[-1] = -7                                            # any negative: a padding row
    data, sc = quantize_fp8(to_dev(xb), (1, 128), scale, index=to_dev(index))
    want_data, want_scales = gather_reference(xb, index, scale)
    assert to_host(data).shape == (R_out, cols) and to_host(sc).shape == (R_out, cols // 128)
    np.testing.assert_array_equal(to_host(data), want_data)
    np.testing.assert_array_equal(to_host(sc), want_scales)
    pad = index < 0
    assert np.all(to_host(data)[pad] == 0)
    assert np.all(to_host(sc)[pad] == (1.0 if scale == "fp32" else 127))
    empty, empty_scales = quantize_fp8(to_dev(xb), index=to_dev(np.zeros(0, np.int32)))
    assert to_host(empty).shape == (0, cols) and to_host(empty_scales).shape == (0, 2)


def test_rows_kernel_stops_at_num_rows():
    """``num_rows`` (device): rows below num_rows[0] are the gathered reference, the rest keep
    what the buffers held; the layer's trusted launch (``launch_quantize_rows``) does the
    same."""
    from mok_core.quantize import launch_quantize_rows
    rng = np.random.default_rng(8)
    xb = inputs(22, 30, 256)
    index = rng.integers(-1, 30, 50).astype(np.int32)
    want_data, want_scales = gather_reference(xb, index, "fp32")
    for trusted in (False, True):
        out = to_dev(np.full((50, 256), 0xAB, np.uint8))
        sc = to_dev(np.full((50, 2), -3.0, np.float32))
        if trusted:
            from mok_core.errors_kernels import scratch_error_word
            launch_quantize_rows(to_dev(xb), out, sc, index=to_dev(index),
                                 num_rows=to_dev(np.array([37], np.int32)),
                                 errors=scratch_error_word())
        else:
            quantize_fp8(to_dev(xb), out=out, scales=sc, index=to_dev(index),
                         num_rows=to_dev(np.array([37], np.int32)))
        got, got_s = to_host(out), to_host(sc)
        np.testing.assert_array_equal(got[:37], want_data[:37])
        np.testing.assert_array_equal(got_s[:37], want_scales[:37])
        assert (got[37:] == 0xAB).all() and (got_s[37:] == -3.0).all()
    with pytest.raises(ValueError, match=r"num_rows: only with block=\(1, 128\)"):
        quantize_fp8(to_dev(np.zeros((128, 128), np.uint16)), (128, 128),
                     num_rows=to_dev(np.array([1], np.int32)))


@pytest.mark.parametrize("block,scale", [((1, 128), "fp32"), ((128, 128), "fp32"),
                                         ((1, 128), "ue8m0"), ((128, 128), "ue8m0")])
def test_transposed_gathers_and_stops_at_num_rows(block, scale):
    """Transposed (``quantize_cols_kernel``) with ``index`` and ``num_rows`` -- the weight
    gradients' operands: output column r is x row index[r] (repeats; -1: zeros), columns at or
    past num_rows[0] zeros (nothing read) in the 128-column block holding it, the blocks
    past it not written; bit for bit the reference of that gathered matrix transposed;
    NaN/Inf counted per output column, the smallest reported, left out of their line's or
    block's amax (NaN -> the NaN byte, +-Inf -> +-448)."""
    rng = np.random.default_rng(9)
    R_in, cols, R_out, cap = 70, 256, 384, 200       # 3 row tiles (the third past cap), 2 column
    xb = inputs(24, R_in, cols)
    xb[50, 200] = BF16_NAN
    xb[20, 130] = BF16_INF
    xb[20, 5] = BF16_NEG_INF
    index = rng.integers(0, R_in, R_out).astype(np.int32)
    index[rng.random(R_out) < 0.2] = -1
    index[[3, 150, 151, 220]] = [20, 50, 50, 20]      # 220: past num_rows, never read
    errors = device_full((err.ERROR_WORDS,), 0, np.int32)
    dtype = np.float32 if scale == "fp32" else np.uint8
    data, sc = quantize_fp8(to_dev(xb), block, scale, transpose=True, index=to_dev(index),
                            num_rows=to_dev(np.array([cap], np.int32)), errors=errors,
                            tensor=err.NF_D_OUT, rank=2,
                            out=to_dev(np.full((cols, R_out), 0xAB, np.uint8)),
                            scales=to_dev(np.full((cols // block[0], R_out // 128), 7, dtype)))
    live = (index >= 0) & (np.arange(R_out) < cap)
    g = np.where(live[:, None], bf16_values(xb)[np.maximum(index, 0)], 0.0)
    want_data, want_scales = quantize_fp8_reference(g.astype(np.float32), block, scale, True)
    for r, c, byte in ((50, 200, 0x7F), (20, 130, 0x7E), (20, 5, 0xFE)):
        assert (want_data[c, live & (index == r)] == byte).all()
    data, sc = to_host(data), to_host(sc)
    assert data.shape == (cols, R_out)
    np.testing.assert_array_equal(data[:, :256], want_data[:, :256])
    np.testing.assert_array_equal(sc[:, :2], want_scales[:, :2])
    assert (data[:, 256:] == 0xAB).all() and (sc[:, 2:] == 7).all(), "past num_rows: unwritten"
    words = to_host(errors)
    n = int(2 * (live & (index == 20)).sum() + (live & (index == 50)).sum())
    assert words[err.NAN_COUNT] == n == words[err.NONFINITE + 2 * err.NF_D_OUT]
    first = np.flatnonzero(live & ((index == 20) | (index == 50)))[0]
    assert err.INT32_MAX - words[err.NONFINITE + 2 * err.NF_D_OUT + 1] == first
    assert words[err.NONFINITE_RANK] == 2


@pytest.mark.parametrize("gather", [False, True])
def test_rows_kernel_nonfinite(gather):
    """NaN/Inf through the row kernel: counted once each (per output row when gathered), the
    smallest output row reported; left out of their line's amax, so the line's other values
    are what they would be with zeros there, NaN -> the NaN byte, +-Inf -> +-448."""
    rows, cols = 70, 384
    xb = inputs(22, rows, cols)
    xb[50, 200] = BF16_NAN
    xb[20, 300] = BF16_INF
    xb[20, 5] = BF16_NEG_INF
    index = np.arange(rows - 1, -1, -1).astype(np.int32)      # reversed: row 50 -> output 19
    index = np.concatenate([index, [20, -1]]).astype(np.int32)   # row 20 once more, a pad
    errors = device_full((err.ERROR_WORDS,), 0, np.int32)
    data, sc = quantize_fp8(to_dev(xb), errors=errors, tensor=err.NF_D_OUT, rank=3,
                            index=to_dev(index) if gather else None)
    words = to_host(errors)
    assert words[err.FLAGS] & err.ERR_NON_FINITE
    assert words[err.NAN_COUNT] == (5 if gather else 3)
    assert words[err.NONFINITE + 2 * err.NF_D_OUT] == (5 if gather else 3)
    assert err.INT32_MAX - words[err.NONFINITE + 2 * err.NF_D_OUT + 1] == (19 if gather else 20)
    assert words[err.NONFINITE_RANK] == 3
    # the reference leaves NaN/Inf out of their line's amax too (NaN -> 0x7F, +-Inf -> +-448)
    want_data, want_scales = (gather_reference(xb, index, "fp32") if gather else
                              quantize_fp8_reference(bf16_values(xb), (1, 128)))
    src = index if gather else np.arange(rows)
    for r, c, byte in ((50, 200, 0x7F), (20, 300, 0x7E), (20, 5, 0xFE)):
        assert (want_data[src == r, c] == byte).all()
    np.testing.assert_array_equal(to_host(data), want_data)
    np.testing.assert_array_equal(to_host(sc), want_scales)


@pytest.mark.parametrize("block,scale,transpose", [
    ((1, 128), "fp32", False), ((1, 128), "ue8m0", False), ((128, 128), "ue8m0", False),
    ((1, 128), "fp32", True)])
def test_no_allocation_with_callers_buffers(monkeypatch, block, scale, transpose):
    """With ``out``, ``scales`` and ``errors`` given, a launch allocates nothing (a CUDA graph
    can capture it): the scale argument a mode does not use is a view of memory at hand."""
    rows, cols = 128, 256
    xb = inputs(23, rows, cols)
    o_rows, o_cols = (cols, rows) if transpose else (rows, cols)
    dtype = np.float32 if scale == "fp32" else np.uint8
    out = to_dev(np.zeros((o_rows, o_cols), np.uint8))
    scales = to_dev(np.zeros((o_rows // block[0], o_cols // 128), dtype))
    errors = device_full((err.ERROR_WORDS,), 0, np.int32)

    def no_allocation(*args, **kwargs):
        raise AssertionError("quantize_fp8 allocated with the caller's buffers")
    monkeypatch.setattr(quantize_module, "device_empty", no_allocation)
    quantize_fp8(to_dev(xb), block, scale, transpose, out=out, scales=scales, errors=errors)
    want_data, want_scales = quantize_fp8_reference(bf16_values(xb), block, scale, transpose)
    np.testing.assert_array_equal(to_host(out), want_data)
    np.testing.assert_array_equal(to_host(scales), want_scales)


def test_bad_index():
    x = to_dev(np.zeros((128, 128), np.uint16))
    with pytest.raises(TypeError, match="index: expected dtype int32"):
        quantize_fp8(x, index=to_dev(np.zeros(4, np.int64)))
    with pytest.raises(ValueError, match="index: expected 1 dimensions"):
        quantize_fp8(x, index=to_dev(np.zeros((4, 1), np.int32)))
    with pytest.raises(ValueError, match=r"index: only with block=\(1, 128\) or transpose"):
        quantize_fp8(x, (128, 128), index=to_dev(np.zeros(128, np.int32)))
    with pytest.raises(ValueError, match=r"index's rows \(100\) too"):
        quantize_fp8(x, transpose=True, index=to_dev(np.zeros(100, np.int32)))


def test_bad_arguments():
    x = to_dev(np.zeros((128, 200), np.uint16))
    with pytest.raises(ValueError, match=r"columns must be a multiple of 128"):
        quantize_fp8(x)
    with pytest.raises(ValueError, match=r"block=\(64, 128\)"):
        quantize_fp8(to_dev(np.zeros((128, 128), np.uint16)), (64, 128))
    with pytest.raises(ValueError, match="scale='e5m2'"):
        quantize_fp8(to_dev(np.zeros((128, 128), np.uint16)), scale="e5m2")
    with pytest.raises(ValueError, match="rows"):
        quantize_fp8(to_dev(np.zeros((100, 128), np.uint16)), transpose=True)
    with pytest.raises(TypeError, match="x: expected dtype uint16"):
        quantize_fp8(to_dev(np.zeros((128, 128), np.float32)))
    odd = to_dev(np.zeros(128 * 128 + 4, np.uint16))[1:1 + 128 * 128].reshape(128, 128)
    with pytest.raises(ValueError, match="x: .* 8-byte aligned"):
        quantize_fp8(odd)


def test_mxfp8_conversion():
    """MXFP8 -> our 128 x 128 blocks with ue8m0 scales: a block whose 32-groups share an
    exponent keeps its values exactly (so the bf16 in between held them exactly), every other
    value stays within half an e4m3 step of its new scale."""
    from mok_core.quantize import mxfp8_to_blockwise
    rng = np.random.default_rng(4)
    rows, cols = 128, 256
    data = rng.integers(0, 256, (rows, cols), dtype=np.uint8)
    data[(data & 0x7F) == 0x7F] = 0x38                           # no NaN bytes
    scales = rng.integers(120, 135, (rows, cols // 32)).astype(np.uint8)
    scales[:, :4] = 127                                          # block 0: one exponent
    q, s = mxfp8_to_blockwise(to_dev(data), to_dev(scales), scale="ue8m0")
    want = dequantize_mxfp8(data, scales)
    got = dequantize_fp8(to_host(q), to_host(s), (128, 128), "ue8m0")
    np.testing.assert_array_equal(got[:, :128], want[:, :128])
    step = dequantize_fp8(np.full(q.shape, 0x38, np.uint8), to_host(s), (128, 128), "ue8m0")
    assert np.all(np.abs(got - want) <= 2.0 ** -4 * np.abs(want) + 2.0 ** -10 * step)
    with pytest.raises(ValueError, match="scales: expected shape"):
        mxfp8_to_blockwise(to_dev(data), to_dev(scales[:, :4]))
