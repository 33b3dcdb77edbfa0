"""The data-gradient grouped GEMM (``dgrad``: weights read as stored, [K, N] row-major; the
mma.sync kernel's B_KN specialisation) vs float64, on the simulator at tiny shapes.

Both uses: d_hidden = d_out W_down[e] (A gathered through an index with padding rows, one
weight matrix) and d_x = [d_gate | d_up] [W_gate[e]; W_up[e]] (rows direct, K split over two
weight arrays). Ragged experts with an empty one, rows past num_rows untouched, padding rows
zero, a bitwise rerun, a NaN weight reported to the error word, the validation messages.
"""
import numpy as np
import pytest

from helpers import to_dev
from mok_core import errors as err
from mok_core.cuda_compat import to_host
from mok_core.gemm import SIM_GEMM, WGMMA_GEMM, GemmConfig, dgrad
from test_grouped_gemm import POISON, bits, f64, layout, rel_l1

# a second mma.sync tile: 4 warps (2 x 2), 64-wide B rows (the 8-chunk swizzle), a 3-deep ring
CFG64 = GemmConfig(bm=64, bn=64, bk=32, wm=2, wn=2, stages=3)
# the narrowest B rows (16 columns: four rows share a 128-byte bank line in the swizzle)
CFG16 = GemmConfig(bm=32, bn=16, bk=32, wm=2, wn=1, stages=2)


def _case(cfg, counts, K, N, K0, gather, seed):
    """Random bf16 operands of one dgrad: (a, a_index or None, w0, w1 or None, off, C)."""
    rng = np.random.default_rng(seed)
    E, n_src = len(counts), 40
    off, C, a_index = layout(counts, cfg.row_unit, 1, rng, n_src)
    if gather:
        a = bits(rng.standard_normal((n_src, K)))
    else:                          # rows direct: A's padding rows (and spare rows) are zeros
        a = bits(rng.standard_normal((C, K)))
        a[a_index < 0] = 0
        a_index = None
    w0 = bits(rng.standard_normal((E, K0, N)) / 8)
    w1 = bits(rng.standard_normal((E, K - K0, N)) / 8) if K0 < K else None
    return a, a_index, w0, w1, off, C


def _reference(a, a_index, w0, w1, off, C):
    """float64 out and |A| |B| (the scale of the accumulation's rounding) per row."""
    N = w0.shape[2]
    want = np.zeros((C, N))
    scale = np.zeros((C, N))
    for e in range(len(off) - 1):
        rows = np.arange(off[e], off[e + 1])
        if a_index is not None:
            rows = rows[a_index[rows] >= 0]
            A = f64(a[a_index[rows]])
        else:
            A = f64(a[rows])
        B = f64(w0[e]) if w1 is None else np.concatenate([f64(w0[e]), f64(w1[e])])
        want[rows] = A @ B
        scale[rows] = np.abs(A) @ np.abs(B)
    return want, scale


def _run(cfg, a, a_index, w0, w1, off, C, **kw):
    out = to_dev(np.full((C, w0.shape[2]), POISON, np.uint16))
    dgrad(to_dev(a), None if a_index is None else to_dev(a_index), to_dev(w0),
          None if w1 is None else to_dev(w1), to_dev(off), to_dev(np.array([off[-1]], np.int32)),
          out, config=cfg, **kw)
    return to_host(out)


@pytest.mark.parametrize("cfg,counts,K,N,K0,gather", [
    # d_hidden = d_out W_down[e]: gathered rows with padding, one matrix
    (SIM_GEMM, [40, 0, 17], 64, 32, 64, True),
    # d_x = [d_gate | d_up] [W_gate; W_up]: rows direct, K split at K0 = I
    (SIM_GEMM, [5, 33, 0, 1], 64, 64, 32, False),
    (CFG64, [0, 70, 9], 96, 64, 64, False),          # split after two slices; empty first
    (CFG64, [3, 0, 65], 64, 128, 64, True),          # two column tiles, two row tiles
    (CFG16, [17, 0, 40], 64, 32, 32, True),
], ids=["sim-gather", "sim-split", "cfg64-split", "cfg64-gather", "bn16-split-gather"])
def test_dgrad_matches_float64(cfg, counts, K, N, K0, gather):
    a, a_index, w0, w1, off, C = _case(cfg, counts, K, N, K0, gather, seed=len(counts) + K0)
    got_bits = _run(cfg, a, a_index, w0, w1, off, C)
    live = slice(0, off[-1])
    assert np.all(got_bits[off[-1]:] == POISON), "rows past num_rows must not be written"
    pad = (a_index[live] < 0) if gather else ~a[live].any(axis=1)
    assert pad.any() and np.all(got_bits[live][pad] == 0), "padding rows must be zero"
    want, scale = _reference(a, a_index, w0, w1, off, C)
    got = f64(got_bits[live])
    assert np.isfinite(got).all()
    assert rel_l1(got, want[live]) <= 5e-3
    # each element: bf16 rounding (2 ulps of its magnitude) + the FP32 accumulation's error
    tol = 2.0 ** -7 * np.abs(want[live]) + 2.0 ** -14 * scale[live]
    assert np.all(np.abs(got - want[live]) <= tol)
    if cfg is SIM_GEMM and not gather:            # deterministic: a rerun is bitwise identical
        np.testing.assert_array_equal(_run(cfg, a, a_index, w0, w1, off, C), got_bits)


def test_dgrad_nan_weight_reported():
    """A NaN in w1 (the K split's second matrix) of expert 1 reaches every row that expert's
    tiles write (its padding rows too: 0 x NaN) in one column: count, first row and expert
    land in the error word under the tensor id given; nothing else is reported."""
    cfg = SIM_GEMM
    a, a_index, w0, w1, off, C = _case(cfg, [5, 33, 0, 1], 64, 64, 32, False, seed=8)
    w1 = w1.copy()
    w1[1, 20, 37] = bits(np.nan)
    word = to_dev(err.initial_error_word())
    out = _run(cfg, a, a_index, w0, w1, off, C, errors=word, tensor=err.NF_Y, rank=3)
    w = to_host(word)
    rows = int(off[2] - off[1])
    assert np.isnan(f64(out[off[1]:off[2], 37])).all()
    assert w[err.FLAGS] & err.ERR_NON_FINITE
    assert w[err.NONFINITE + 2 * err.NF_Y] == rows
    assert err.from_key(w[err.NONFINITE + 2 * err.NF_Y + 1]) == off[1]
    assert w[err.NONFINITE_EXPERT + err.NF_Y] == err.INT32_MAX - 1
    assert w[err.NONFINITE_RANK] == 3
    others = [t for t in range(err.NONFINITE_TENSORS) if t != err.NF_Y]
    assert all(w[err.NONFINITE + 2 * t] == 0 for t in others)


def test_dgrad_rejects_bad_arguments():
    cfg = SIM_GEMM
    E, K, N, C = 2, 64, 32, 32
    a = np.zeros((C, K), np.uint16)
    idx = np.zeros(C, np.int32)
    w = np.zeros((E, K, N), np.uint16)
    off = np.array([0, C, C], np.int32)
    nr = np.array([C], np.int32)
    out = np.zeros((C, N), np.uint16)

    def call(a=a, a_index=idx, w0=w, w1=None, off=off, out=out, config=cfg, **kw):
        dgrad(to_dev(a), None if a_index is None else to_dev(a_index), to_dev(w0),
              None if w1 is None else to_dev(w1), to_dev(off), to_dev(nr), to_dev(out),
              config=config, **kw)

    with pytest.raises(ValueError, match="the wgmma dgrad does not exist yet"):
        call(config=WGMMA_GEMM)
    with pytest.raises(ValueError, match="config.bn=48"):
        call(config=GemmConfig(bm=32, bn=48, bk=32, wm=2, wn=1, stages=2))
    with pytest.raises(TypeError, match="a: expected dtype uint16, got float32"):
        call(a=a.astype(np.float32))
    with pytest.raises(TypeError, match="a_index: expected dtype int32, got int64"):
        call(a_index=idx.astype(np.int64))
    with pytest.raises(ValueError, match=r"w0: expected \[E, 64, N\] \(K of a; no w1\), "
                                         r"got \(2, 32, 32\)"):
        call(w0=w[:, :32])
    with pytest.raises(ValueError, match=r"w1: expected shape \(2, 32, 32\), got \(2, 16, 32\)"):
        call(w0=w[:, :32], w1=w[:, :16])
    with pytest.raises(ValueError, match=r"w0: expected \[E, K0 <= 64, N\]"):
        call(w0=np.zeros((E, 96, N), np.uint16), w1=w[:, :0])
    with pytest.raises(ValueError, match="w0: K0=16 rows per expert must be a multiple of bk=32"):
        call(w0=w[:, :16], w1=w[:, :48])
    with pytest.raises(ValueError, match=r"expert_offsets: expected shape \(3,\), got \(2,\)"):
        call(off=off[:2])
    with pytest.raises(ValueError, match=r"out: expected shape \(32, 32\), got \(32, 16\)"):
        call(out=out[:, :16])
    with pytest.raises(ValueError, match=r"N \(columns of w0\)=48: must be a multiple of 32"):
        call(w0=np.zeros((E, K, 48), np.uint16), out=np.zeros((C, 48), np.uint16))
    with pytest.raises(ValueError, match=r"K \(columns of a\)=48: must be a multiple of 32"):
        call(a=np.zeros((C, 48), np.uint16), w0=np.zeros((E, 48, N), np.uint16))
    with pytest.raises(ValueError, match="rows 40: must be a multiple of 32"):
        call(a_index=np.zeros(40, np.int32), out=np.zeros((40, N), np.uint16))
    with pytest.raises(ValueError, match="tensor=99"):
        call(tensor=99)
