"""FP8 block quantization (``mok_core.quantize``) bit for bit against its NumPy reference, every
mode (1 x 128 / 128 x 128 blocks, fp32 / ue8m0 scales, transposed or not), on the CUDA simulator
in CI and unchanged on a GPU (where ``cvt.rn.satfinite`` does the rounding); the reference's
rounding against ``ml_dtypes``; NaN/Inf reported; bad arguments refused."""
import ml_dtypes
import numpy as np
import pytest

from helpers import to_dev
from mok_core import errors as err
from mok_core.cuda_compat import SIM, device_full, to_host
from mok_core.quantize import quantize_expert_weights, quantize_fp8
from mok_core.quantize_reference import (dequantize_fp8, dequantize_mxfp8, e4m3_bits,
                                         e4m3_values, quantize_fp8_reference)

R, C = (160, 256) if SIM else (4096, 7168)          # 160: a partial row tile


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
