"""The SwiGLU backward kernel (``mok_core.swiglu_backward``) vs float64 on the simulator: the
gate / up gradients with the clamp on and off, the router-weight gradient pushed to its source
rank's slot, w * h, padding rows zeroed, rows past num_rows untouched, bitwise reruns; a warp's
ragged last step (I / 4 no multiple of 32), I % 4 refused; the FP8 layer's [d_g | d_u]
quantised 1 x 128 on the way, bit for bit ``quantize_fp8`` of the bf16 d_gu (NaN/Inf counted
alike)."""
import ml_dtypes
import numpy as np
import pytest

from helpers import to_dev
from mok_core import errors as err
from mok_core.cuda_compat import device_full, to_host
from mok_core.quantize import quantize_fp8
from mok_core.quantize_reference import quantize_fp8_reference
from mok_core.reference import swiglu, swiglu_backward
from mok_core.swiglu_backward import launch_swiglu_backward


# Against float64 of the same bf16 / float32 inputs: each output's bf16 rounding (2 ulps of its
# magnitude), and the kernel's approximate exp / reciprocal, far below 2**-12 of the largest.
TOL, ATOL = 2.0 ** -7, 2.0 ** -12


def bits(a):
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def f64(b):
    return np.asarray(b).view(ml_dtypes.bfloat16).astype(np.float64)


@pytest.mark.parametrize("limit", [None, 1.0])
def test_routed_rows(limit):
    rng = np.random.default_rng(2)
    C, I, R, T, k = 12, 64, 2, 5, 3
    rows = 10                                    # rows 10, 11: past num_rows
    g = (rng.standard_normal((C, I)) * 2).astype(np.float32)
    u = (rng.standard_normal((C, I)) * 2).astype(np.float32)
    h = bits(swiglu(g, u, limit))
    p = bits(rng.standard_normal((C, I)))
    row_index = np.arange(C, dtype=np.int32)
    row_index[[3, 7]] = -1                       # padding rows
    src_rank = rng.integers(0, R, C).astype(np.int32)
    src_token = rng.integers(0, T, C).astype(np.int32)
    src_slot = (np.arange(C) % k).astype(np.int32)
    src_token[:rows] = np.arange(rows) // k      # distinct (token, slot) per rank
    src_rank[:rows] = 0
    src_rank[[3, 7]] = -1
    router = [rng.random(T * k).astype(np.float32) for _ in range(R)]
    d_router = [to_dev(np.full(T * k, np.nan, np.float32)) for _ in range(R)]
    d_gu = to_dev(np.full((C, 2 * I), 0xFFFF, np.uint16))
    p_dev = to_dev(p.copy())
    launch_swiglu_backward(p_dev, to_dev(g), to_dev(u), to_dev(h), d_gu, to_dev(row_index),
                           to_dev(np.array([rows], np.int32)), limit=limit,
                           route=(to_dev(src_rank), to_dev(src_token), to_dev(src_slot),
                                  tuple(to_dev(r) for r in router), tuple(d_router), k))
    got_gu, got_p = to_host(d_gu), to_host(p_dev)
    pushed = to_host(d_router[0])
    for r in range(C):
        if r >= rows:
            assert (got_gu[r] == 0xFFFF).all() and (got_p[r] == p[r]).all()
            continue
        if row_index[r] < 0:
            assert not got_gu[r].any() and not got_p[r].any()
            continue
        w = float(router[0][src_token[r] * k + src_slot[r]])
        dg, du = swiglu_backward(g[r], u[r], w * f64(p[r]), limit)
        np.testing.assert_allclose(f64(got_gu[r, :I]), dg, rtol=TOL, atol=ATOL * np.abs(dg).max())
        np.testing.assert_allclose(f64(got_gu[r, I:]), du, rtol=TOL, atol=ATOL * np.abs(du).max())
        np.testing.assert_allclose(f64(got_p[r]), w * f64(h[r]), rtol=TOL, atol=1e-6)
        dot = float(f64(p[r]) @ f64(h[r]))
        assert abs(pushed[src_token[r] * k + src_slot[r]] - dot) <= 1e-5 * (1 + abs(dot))
    assert np.isnan(to_host(d_router[1])).all()          # rank 1 sent nothing here
    again = to_dev(np.full((C, 2 * I), 0xFFFF, np.uint16))
    launch_swiglu_backward(to_dev(p.copy()), to_dev(g), to_dev(u), to_dev(h), again,
                           to_dev(row_index), to_dev(np.array([rows], np.int32)), limit=limit,
                           route=(to_dev(src_rank), to_dev(src_token), to_dev(src_slot),
                                  tuple(to_dev(r) for r in router), tuple(d_router), k))
    np.testing.assert_array_equal(to_host(again), got_gu)


def test_shared_rows_keep_p():
    """The shared expert: w = 1, no push, p kept (its W_down gradient reads h itself)."""
    rng = np.random.default_rng(3)
    C, I = 4, 32
    g, u = (rng.standard_normal((C, I)).astype(np.float32) for _ in range(2))
    p = bits(rng.standard_normal((C, I)))
    h = bits(swiglu(g, u))
    d_gu = to_dev(np.zeros((C, 2 * I), np.uint16))
    p_dev = to_dev(p.copy())
    idx = np.array([0, 1, 2, -1], np.int32)
    launch_swiglu_backward(p_dev, to_dev(g), to_dev(u), to_dev(h), d_gu, to_dev(idx),
                           to_dev(np.array([C], np.int32)))
    got = to_host(d_gu)
    np.testing.assert_array_equal(to_host(p_dev), p)
    dg, du = swiglu_backward(g[:3], u[:3], f64(p[:3]))
    np.testing.assert_allclose(f64(got[:3, :I]), dg, rtol=TOL, atol=ATOL * np.abs(dg).max())
    np.testing.assert_allclose(f64(got[:3, I:]), du, rtol=TOL, atol=ATOL * np.abs(du).max())
    assert not got[3].any()


def _routed_case(rng, C, I, rows, R=2, T=8, k=2, pads=(1,)):
    """Operands of C routed rows (``rows`` of them in use, ``pads`` padding rows), every real
    row its own (token, slot) on rank 0; d_gu and d_router start as sentinels."""
    g = (rng.standard_normal((C, I)) * 2).astype(np.float32)
    u = (rng.standard_normal((C, I)) * 2).astype(np.float32)
    h = bits(swiglu(g, u))
    p = bits(rng.standard_normal((C, I)))
    row_index = np.arange(C, dtype=np.int32)
    row_index[list(pads)] = -1
    src_rank = np.zeros(C, np.int32)
    src_rank[list(pads)] = -1
    src_token = (np.arange(C) // k).astype(np.int32)
    src_slot = (np.arange(C) % k).astype(np.int32)
    router = [rng.random(T * k).astype(np.float32) for _ in range(R)]
    return dict(g=g, u=u, h=h, p=p, row_index=row_index, rows=rows, k=k, router=router,
                route=(src_rank, src_token, src_slot))


def _launch(c, p_dev, d_gu, d_router, **kw):
    src_rank, src_token, src_slot = c["route"]
    launch_swiglu_backward(p_dev, to_dev(c["g"]), to_dev(c["u"]), to_dev(c["h"]), d_gu,
                           to_dev(c["row_index"]), to_dev(np.array([c["rows"]], np.int32)),
                           route=(to_dev(src_rank), to_dev(src_token), to_dev(src_slot),
                                  tuple(to_dev(r) for r in c["router"]), tuple(d_router),
                                  c["k"]), **kw)


def _check_rows(c, got_gu, got_p, pushed, only=None):
    """d_gu, w h and d_w of the rows in use (or rows ``only``) against float64 (padding rows
    zero)."""
    I = c["g"].shape[1]
    k, (_, src_token, src_slot) = c["k"], c["route"]
    for r in range(c["rows"]) if only is None else only:
        if c["row_index"][r] < 0:
            assert not got_gu[r].any() and not got_p[r].any()
            continue
        w = float(c["router"][0][src_token[r] * k + src_slot[r]])
        dg, du = swiglu_backward(c["g"][r], c["u"][r], w * f64(c["p"][r]))
        np.testing.assert_allclose(f64(got_gu[r, :I]), dg, rtol=TOL,
                                   atol=ATOL * np.abs(dg).max())
        np.testing.assert_allclose(f64(got_gu[r, I:]), du, rtol=TOL,
                                   atol=ATOL * np.abs(du).max())
        np.testing.assert_allclose(f64(got_p[r]), w * f64(c["h"][r]), rtol=TOL, atol=1e-6)
        dot = float(f64(c["p"][r]) @ f64(c["h"][r]))
        assert abs(pushed[src_token[r] * k + src_slot[r]] - dot) <= 1e-5 * (1 + abs(dot))


@pytest.mark.parametrize("I", [160, 36])
def test_ragged_lane_steps(I):
    """I / 4 no multiple of 32 (160: a full step, then 8 lanes; 36: 9 lanes): the idle lanes
    write nothing, the partial sums still meet in the butterfly, the rows past num_rows stay."""
    rng = np.random.default_rng(5)
    C, rows = 4, 3
    c = _routed_case(rng, C, I, rows)
    d_router = [to_dev(np.full(16, np.nan, np.float32)) for _ in range(2)]
    d_gu = to_dev(np.full((C, 2 * I), 0xFFFF, np.uint16))
    p_dev = to_dev(c["p"].copy())
    _launch(c, p_dev, d_gu, d_router)
    got_gu, got_p = to_host(d_gu), to_host(p_dev)
    _check_rows(c, got_gu, got_p, to_host(d_router[0]))
    assert (got_gu[rows:] == 0xFFFF).all() and (got_p[rows:] == c["p"][rows:]).all()


def test_columns_not_a_multiple_of_4_refused():
    C, I = 2, 30
    z = np.zeros((C, I), np.uint16)
    with pytest.raises(ValueError, match=r"I = 30 columns.*multiple of 4"):
        launch_swiglu_backward(z, np.zeros((C, I), np.float32), np.zeros((C, I), np.float32), z,
                               np.zeros((C, 2 * I), np.uint16), np.zeros(C, np.int32),
                               np.array([C], np.int32))


@pytest.mark.parametrize("I", [128, 384])
def test_routed_fp8_rows_quantised_on_the_way(I):
    """``quant``: [d_g | d_u] quantised 1 x 128 by the same kernel -- bytes and scales bit for
    bit ``quantize_fp8`` (and its reference) of the bf16 d_gu it wrote, zeros (scale 1) on a
    padding row, nothing past num_rows; an Inf in p (row 2: both halves non-finite there) and
    an Inf in u (row 4: d_g only) counted into the error word exactly as the row quantiser
    counts them."""
    rng = np.random.default_rng(7 + I)
    C, rows = 6, 5
    c = _routed_case(rng, C, I, rows)
    c["p"][2, 5] = 0x7F80                                   # +Inf
    c["u"][4, I - 3] = np.inf
    d_router = [to_dev(np.full(16, np.nan, np.float32)) for _ in range(2)]
    d_gu = to_dev(np.full((C, 2 * I), 0xFFFF, np.uint16))
    out = to_dev(np.full((C, 2 * I), 0xAB, np.uint8))
    scales = to_dev(np.full((C, 2 * I // 128), -1.0, np.float32))
    errors = device_full((err.ERROR_WORDS,), 0, np.int32)
    p_dev = to_dev(c["p"].copy())
    _launch(c, p_dev, d_gu, d_router,
            quant=(out, scales, errors, err.NF_D_X_ROUTED, 1))
    got_gu = to_host(d_gu)
    _check_rows(c, got_gu, to_host(p_dev), to_host(d_router[0]), only=(0, 1, 3))
    finite = np.isfinite(f64(got_gu))
    assert not finite[2, :I].all() and not finite[2, I:].all()
    assert not finite[4, :I].all() and finite[4, I:].all()
    # the row quantiser over the bf16 d_gu, num_rows capped, its own error word
    want_out = to_dev(np.full((C, 2 * I), 0xAB, np.uint8))
    want_scales = to_dev(np.full((C, 2 * I // 128), -1.0, np.float32))
    want_errors = device_full((err.ERROR_WORDS,), 0, np.int32)
    quantize_fp8(to_dev(got_gu), out=want_out, scales=want_scales, errors=want_errors,
                 tensor=err.NF_D_X_ROUTED, rank=1,
                 num_rows=to_dev(np.array([rows], np.int32)))
    np.testing.assert_array_equal(to_host(out), to_host(want_out))
    np.testing.assert_array_equal(to_host(scales).view(np.uint32),
                                  to_host(want_scales).view(np.uint32))
    np.testing.assert_array_equal(to_host(errors), to_host(want_errors))
    clean = [0, 1, 3]                   # (rows 2 and 4, NaN/Inf: held to quantize_fp8 above)
    ref, ref_s = quantize_fp8_reference(f64(got_gu[clean]).astype(np.float32))
    np.testing.assert_array_equal(to_host(out)[clean], ref)
    np.testing.assert_array_equal(to_host(scales)[clean], ref_s)
    assert (to_host(out)[1] == 0).all() and (to_host(scales)[1] == 1).all()   # padding row
    assert (to_host(out)[rows:] == 0xAB).all() and (to_host(scales)[rows:] == -1).all()
    words = to_host(errors)
    bad = int((~finite[:rows]).sum())
    assert bad >= 2 and words[err.NONFINITE + 2 * err.NF_D_X_ROUTED] == bad
    assert err.INT32_MAX - words[err.NONFINITE + 2 * err.NF_D_X_ROUTED + 1] == 2
    # bitwise rerun (d_gu, d_gu8, its scales, d_w)
    first_d_w = to_host(d_router[0]).copy()
    again = [to_dev(np.zeros((C, 2 * I), np.uint16)), to_dev(np.zeros((C, 2 * I), np.uint8)),
             to_dev(np.zeros((C, 2 * I // 128), np.float32))]
    _launch(c, to_dev(c["p"].copy()), again[0], d_router,
            quant=(again[1], again[2], errors, err.NF_D_X_ROUTED, 1))
    np.testing.assert_array_equal(to_host(again[0])[:rows], got_gu[:rows])
    np.testing.assert_array_equal(to_host(again[1])[:rows], to_host(out)[:rows])
    np.testing.assert_array_equal(to_host(again[2])[:rows].view(np.uint32),
                                  to_host(scales)[:rows].view(np.uint32))
    np.testing.assert_array_equal(to_host(d_router[0]).view(np.uint32), first_d_w.view(np.uint32))


def test_quant_needs_a_multiple_of_128():
    C, I = 2, 64
    z = np.zeros((C, I), np.uint16)
    quant = (np.zeros((C, 2 * I), np.uint8), np.zeros((C, 1), np.float32),
             np.zeros(err.ERROR_WORDS, np.int32), err.NF_D_X_ROUTED, 0)
    with pytest.raises(ValueError, match=r"I = 64 columns.*multiple of 128"):
        launch_swiglu_backward(z, np.zeros((C, I), np.float32), np.zeros((C, I), np.float32), z,
                               np.zeros((C, 2 * I), np.uint16), np.zeros(C, np.int32),
                               np.array([C], np.int32), quant=quant)
