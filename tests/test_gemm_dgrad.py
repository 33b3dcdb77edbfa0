"""The data-gradient grouped GEMM (``dgrad``: weights read as stored, [K, N] row-major; the
B_KN specialisations of the mma.sync kernel and of the wgmma kernel -- B MN-major, TMA boxes
of 64 x 64) vs float64 at tiny shapes (the simulator; the same tests run on a GPU as they are).

Both uses: d_hidden = d_out W_down[e] (A gathered through an index with padding rows, one
weight matrix) and d_x = [d_gate | d_up] [W_gate[e]; W_up[e]] (rows direct, K split over two
weight arrays). Ragged experts with an empty one, rows past num_rows untouched, padding rows
zero, a bitwise rerun, a NaN weight reported to the error word, the wgmma push (rows sent home
equal dgrad then the scatter), the validation messages. On a GPU only (sm_90): the wgmma
dgrad at a real shape (qwen3.5: H = 4096, I = 1024, 64 experts of ~80 rows) vs float64 on
sampled rows, with its TFLOP/s next to the mma.sync dgrad's printed (not asserted).

GPU check: ``NUMBA_ENABLE_CUDASIM=0 python -m pytest -q tests/test_gemm_dgrad.py``.
"""
import numpy as np
import pytest

from helpers import gpu_ms, push_route, rand_bf16_bits, to_dev
from mok_core import errors as err
from mok_core.cuda_compat import SIM, to_host
from mok_core.gemm import (MMA_SYNC_GEMM, SIM_GEMM, WGMMA_GEMM, GemmConfig, dgrad,
                           launch_dgrad)
from test_grouped_gemm import POISON, bits, f64, layout, rel_l1

# a second mma.sync tile: 4 warps (2 x 2), 64-wide B rows (the 8-chunk swizzle), a 3-deep ring
CFG64 = GemmConfig(bm=64, bn=64, bk=32, wm=2, wn=2, stages=3)
# the narrowest B rows (16 columns: four rows share a 128-byte bank line in the swizzle)
CFG16 = GemmConfig(bm=32, bn=16, bk=32, wm=2, wn=1, stages=2)
# wgmma (sm90's B_KN): the smallest tiles (one 64 x 64 box of B per slice), and 128 columns (two
# boxes side by side: the MN-major descriptor's leading byte offset is read)
WG64 = GemmConfig(bm=128, bn=64, bk=64, wm=2, wn=1, stages=3, mma="wgmma")
WG128 = GemmConfig(bm=128, bn=128, bk=64, wm=2, wn=1, stages=3, mma="wgmma")


def _hopper():
    if SIM:
        return True
    from numba import cuda
    return cuda.get_current_device().compute_capability == (9, 0)


def _needs_hopper(cfg):
    if cfg.mma == "wgmma" and not _hopper():
        pytest.skip("the wgmma dgrad needs sm_90")


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
    # wgmma d_hidden: gathered rows with -1, an empty expert, 150 rows = a 128-row tile + one
    # whose second warpgroup lies past the expert, two column tiles (blocks take several tiles:
    # the ring wraps, the phase bits flip)
    (WG64, [40, 0, 150], 128, 128, 128, True),
    # wgmma d_x: rows direct, K split after one slice (slices 1, 2 from w1), 128-column boxes
    (WG128, [5, 70, 0], 192, 128, 64, False),
], ids=["sim-gather", "sim-split", "cfg64-split", "cfg64-gather", "bn16-split-gather",
        "wgmma-gather", "wgmma-bn128-split"])
def test_dgrad_matches_float64(cfg, counts, K, N, K0, gather):
    _needs_hopper(cfg)
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
    if (cfg is SIM_GEMM and not gather) or cfg.mma == "wgmma":
        # deterministic: a rerun is bitwise identical
        np.testing.assert_array_equal(_run(cfg, a, a_index, w0, w1, off, C), got_bits)


@pytest.mark.parametrize("cfg", [SIM_GEMM, WG64], ids=["sync", "wgmma"])
def test_dgrad_nan_weight_reported(cfg):
    """A NaN in w1 (the K split's second matrix) of expert 1 reaches every row that expert's
    tiles write (its padding rows too: 0 x NaN; rows direct, so no warpgroup skips) in one
    column: count, first row and expert land in the error word under the tensor id given;
    nothing else is reported."""
    _needs_hopper(cfg)
    K, K0 = (64, 32) if cfg.mma == "mma_sync" else (128, 64)
    a, a_index, w0, w1, off, C = _case(cfg, [5, 33, 0, 1], K, 64, K0, False, seed=8)
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


def test_wgmma_dgrad_push_equals_dgrad_then_scatter():
    """dgrad(push=...) -- the routed d_x rows sent home from the epilogue -- writes each real
    row's bits to its source rank's combine row token * k + slot and nothing else."""
    cfg = WG64
    _needs_hopper(cfg)
    rng = np.random.default_rng(12)
    counts, R, T, k, K, K0, N = [70, 0, 40], 2, 64, 2, 128, 64, 64
    a, a_index, w0, w1, off, C = _case(cfg, counts, K, N, K0, False, seed=5)
    real = np.flatnonzero(a.any(axis=1))
    src_rank, src_token, src_slot = push_route(rng, real, C, R, T, k)
    want_rows = _run(cfg, a, a_index, w0, w1, off, C)
    peers = tuple(to_dev(np.full(T * k * N, POISON, np.uint16)) for _ in range(R))
    dgrad(to_dev(a), None, to_dev(w0), to_dev(w1), to_dev(off),
          to_dev(np.array([off[-1]], np.int32)), None,
          push=(to_dev(src_rank), to_dev(src_token), to_dev(src_slot), peers, k), config=cfg)
    want = np.full((R, T * k, N), POISON, np.uint16)
    want[src_rank[real], src_token[real] * k + src_slot[real]] = want_rows[real]
    got = np.stack([to_host(p).reshape(T * k, N) for p in peers])
    np.testing.assert_array_equal(got, want)


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

    with pytest.raises(ValueError, match="rows 32: must be a multiple of 64"):
        call(config=WGMMA_GEMM)                       # wgmma: 64-row units
    with pytest.raises(ValueError, match=r"dgrad\(push=...\) needs a wgmma GemmConfig"):
        call(push=(idx, idx, idx, (out.ravel(),), 1))
    with pytest.raises(ValueError, match="must be a multiple of bk=64"):
        call(a=np.zeros((64, 128), np.uint16), a_index=np.zeros(64, np.int32),
             w0=np.zeros((E, 32, 64), np.uint16), w1=np.zeros((E, 96, 64), np.uint16),
             out=np.zeros((64, 64), np.uint16), off=np.array([0, 64, 64], np.int32),
             config=WG64)
    with pytest.raises(ValueError, match="K=0 columns: the wgmma dgrad runs at least one"):
        call(a=np.zeros((64, 0), np.uint16), a_index=np.zeros(64, np.int32),
             w0=np.zeros((E, 0, 64), np.uint16), out=np.zeros((64, 64), np.uint16),
             off=np.array([0, 64, 64], np.int32), config=WG64)
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


# ---- a real shape, on the GPU only --------------------------------------------------------------

@pytest.mark.skipif(SIM, reason="a real shape: GPU only")
@pytest.mark.parametrize("use", ["d_x", "d_hidden"])
def test_wgmma_dgrad_real_shape(use, capsys):
    """qwen3.5 experts (H = 4096, I = 1024), 64 local experts of ~80 rows (one empty):
    d_x = [d_g | d_u] [W_gate; W_up] (K = 2I split at I, N = H, rows direct) or
    d_hidden = d_out W_down (K = H, N = I, rows gathered with padding). WGMMA_GEMM tiles vs
    float64 on sampled rows of 3 experts; rows past num_rows untouched, padding rows zero;
    then the TFLOP/s (useful rows) of the wgmma and the mma.sync dgrad, printed."""
    if not _hopper():
        pytest.skip("the wgmma dgrad needs sm_90")
    from numba import cuda
    H, I, E = 4096, 1024, 64
    cfg = WGMMA_GEMM
    rng = np.random.default_rng(21)
    counts = np.clip(rng.normal(80, 20, E).round(), 1, None).astype(np.int64)
    counts[3] = 0
    off = np.concatenate([[0], np.cumsum(-(-counts // 64) * 64)]).astype(np.int32)
    C = int(off[-1]) + 128                               # spare rows past num_rows
    a_index = np.full(C, -1, np.int32)
    for e in range(E):
        a_index[off[e]:off[e] + counts[e]] = np.arange(off[e], off[e] + counts[e])
    if use == "d_x":
        K, N, K0 = 2 * I, H, I
        a = rand_bf16_bits(rng, (C, K), 0)
        a[a_index < 0] = 0                               # padding rows of d_gu are zeros
        w0 = rand_bf16_bits(rng, (E, I, H), -5)
        w1 = rand_bf16_bits(rng, (E, I, H), -5)
        idx = None
    else:
        K, N, K0 = H, I, H
        n_src = 4096
        a = rand_bf16_bits(rng, (n_src, K), 0)
        w0 = rand_bf16_bits(rng, (E, H, I), -5)
        w1 = None
        a_index[a_index >= 0] = rng.integers(0, n_src, int((a_index >= 0).sum()))
        idx = a_index
    d = {name: (None if v is None else cuda.to_device(v)) for name, v in
         (("a", a), ("idx", idx), ("w0", w0), ("w1", w1), ("off", off),
          ("nr", np.array([off[-1]], np.int32)))}
    out = cuda.to_device(np.full((C, N), POISON, np.uint16))

    def run(c):                 # the trusted entry: no host checks in what is timed
        launch_dgrad(d["a"], d["idx"], d["w0"], d["w1"], d["off"], d["nr"], out, config=c)

    dgrad(d["a"], d["idx"], d["w0"], d["w1"], d["off"], d["nr"], out, config=cfg)
    cuda.synchronize()
    got = out.copy_to_host()
    n = int(off[-1])
    assert np.all(got[n:] == POISON), "rows past num_rows must not be written"
    pad = a_index[:n] < 0
    assert np.all(got[:n][pad] == 0), "padding rows must be zero"
    err_num = err_den = 0.0
    for e in (int(np.argmax(counts)), 1, E - 1):
        rows = rng.choice(np.arange(off[e], off[e] + counts[e]), min(8, counts[e]),
                          replace=False)
        A = f64(a[rows] if idx is None else a[a_index[rows]])
        B = f64(w0[e]) if w1 is None else np.concatenate([f64(w0[e]), f64(w1[e])])
        want, scale = A @ B, np.abs(A) @ np.abs(B)
        g = f64(got[rows])
        assert np.isfinite(g).all()
        # bf16 rounding of the output + a generous bound on the FP32 accumulation's error: a
        # misread operand (wrong box, column block or k step) is off by ~|A||B| / sqrt(K)
        assert np.all(np.abs(g - want) <= 2.0 ** -7 * np.abs(want) + 2.0 ** -12 * scale), e
        err_num += np.abs(g - want).sum()
        err_den += np.abs(want).sum()
    assert err_num / err_den <= 5e-3
    flop = 2.0 * counts.sum() * K * N
    ms = {name: gpu_ms(lambda c=c: run(c), 20, 2) for name, c in (("wgmma", cfg),
                                                                  ("mma_sync", MMA_SYNC_GEMM))}
    with capsys.disabled():
        print(f"\n[dgrad {use}: rows={int(counts.sum())} K={K} N={N}] " + ", ".join(
            f"{k}: {v:.3f} ms = {flop / v / 1e9:.0f} TFLOP/s" for k, v in ms.items())
            + f" (wgmma x{ms['mma_sync'] / ms['wgmma']:.2f})")
