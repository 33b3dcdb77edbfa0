"""The SwiGLU backward kernel (``mok_core.swiglu_backward``) vs float64 on the simulator: the
gate / up gradients with the clamp on and off, the router-weight gradient pushed to its source
rank's slot, w * h, padding rows zeroed, rows past num_rows untouched, bitwise reruns."""
import ml_dtypes
import numpy as np
import pytest

from helpers import to_dev
from mok_core.cuda_compat import to_host
from mok_core.reference import swiglu, swiglu_backward
from mok_core.swiglu_backward import launch_swiglu_backward


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
        np.testing.assert_allclose(f64(got_gu[r, :I]), dg, rtol=2e-2, atol=1e-2 * np.abs(dg).max())
        np.testing.assert_allclose(f64(got_gu[r, I:]), du, rtol=2e-2, atol=1e-2 * np.abs(du).max())
        np.testing.assert_allclose(f64(got_p[r]), w * f64(h[r]), rtol=1e-2, atol=1e-6)
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
    np.testing.assert_allclose(f64(got[:3, :I]), dg, rtol=2e-2, atol=1e-2)
    np.testing.assert_allclose(f64(got[:3, I:]), du, rtol=2e-2, atol=1e-2)
    assert not got[3].any()
