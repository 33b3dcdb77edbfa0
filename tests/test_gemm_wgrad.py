"""The weight-gradient grouped GEMM (``mok_core.gemm.wgrad``: ``sm80_wgrad``, mma.sync, and
``sm90_wgrad``, wgmma with both operands MN-major) vs float64, on the simulator at tiny shapes
(the same tests run on a GPU as they are; the wgmma ones need sm_90).

D_e[m, n] = sum over expert e's rows r (clamped to num_rows) of A[ra(r), m] B[rb(r), n]:
gathered A and/or B with -1 padding rows, rows past num_rows ignored (NaN there, or indices of a
NaN row), ragged experts (not a multiple of the K slice), empty experts written as zeros, the
m_split into two outputs, bf16 (FP32 rounded once) and float32 outputs, accumulate=True,
bitwise reruns, NaN reported to the error word, and the host-side validation messages. On a
GPU only (sm_90): both wgrads of the layer at the qwen3.5-397b shape (H = 4096, I = 1024, 512
experts, top-10 of 4096 tokens) on the wgmma kernel vs float64 on sampled experts, with its
TFLOP/s next to the mma.sync kernel's printed (not asserted).

GPU check: ``NUMBA_ENABLE_CUDASIM=0 python -m pytest -q -s tests/test_gemm_wgrad.py``.
"""
from dataclasses import replace

import ml_dtypes
import numpy as np
import pytest

from helpers import gpu_ms, rand_bf16_bits, to_dev
from mok_core import errors as err
from mok_core.cuda_compat import SIM, to_host
from mok_core.gemm import WGMMA_192_GEMM, SIM_GEMM, GemmConfig, wgrad

# SIM_GEMM: 32 x 32 tiles, 2 x 1 warps, 2 stages; CFG64: 64 x 64 tiles, 2 x 2 warps, 3 stages
# (each warp 2 m16 x 4 n8 tiles, the ring deeper than most experts' slices).
CFG64 = GemmConfig(bm=64, bn=64, bk=32, wm=2, wn=2, stages=3)
# wgmma (``sm90_wgrad``): 128 rows of m (2 warpgroups) x 64 columns (one 64 x 64 box of B per
# slice, 2 chunks per thread), a 3-deep ring (PREFETCH 1); and x 128 columns (two boxes side
# by side: the MN-major descriptor's leading byte offset is read), a 4-deep ring (PREFETCH 2)
WG64 = GemmConfig(bm=128, bn=64, bk=64, wm=2, wn=1, stages=3, mma="wgmma")
WG128 = GemmConfig(bm=128, bn=128, bk=64, wm=2, wn=1, stages=4, mma="wgmma")
# ... and the layer's deeper bf16 tile (``WGRAD_WGMMA_DEEP_GEMM``): 256 columns, a warp's rows
# staged half a tile at a time (``sm90_wgrad.bf16_parts``) beside a 4-slice ring
WG256 = GemmConfig(bm=128, bn=256, bk=64, wm=2, wn=1, stages=4, mma="wgmma")
from mok_comm.layer import WGRAD_GEMM  # noqa: E402
POISON16 = 0xFFFF                    # bf16 NaN bits: a tile the kernel forgets shows up
GARBAGE = 32                         # rows past num_rows (NaN, or valid indices of a NaN row)


def bits(a):
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def f64(b):
    return np.asarray(b).view(ml_dtypes.bfloat16).astype(np.float64)


def problem(seed, counts, M, N, *, gather_a, gather_b, cut=0, n_src=40):
    """Operands of a wgrad over experts of ``counts`` rows; num_rows stops ``cut`` rows before
    the last offset and GARBAGE more rows follow. Gathered operands have n_src source rows and
    about a quarter of the rows padding (-1). Rows past num_rows are NaN (direct) or point at a
    NaN source row (gathered): a row read there poisons the output."""
    rng = np.random.default_rng(seed)
    off = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    C = int(off[-1]) + GARBAGE
    nr = np.array([off[-1] - cut], np.int32)

    def side(gather, cols):
        if not gather:
            x = bits(rng.standard_normal((C, cols)))
            x[nr[0]:] = bits(np.nan)                            # read past num_rows: NaN out
            return x, None
        x = bits(rng.standard_normal((n_src + 1, cols)))
        x[n_src] = bits(np.nan)
        index = rng.integers(0, n_src, C).astype(np.int32)
        index[rng.random(C) < 0.25] = -1
        index[nr[0]:] = n_src                # past num_rows: valid indices of a NaN row
        return x, index
    a, a_index = side(gather_a, M)
    b, b_index = side(gather_b, N)
    return a, a_index, b, b_index, off, nr


def reference(a, a_index, b, b_index, off, nr):
    """float64 D [E, M, N] and the scale sum_r |A||B| (for FP32 tolerances)."""
    E = len(off) - 1
    D = np.zeros((E, a.shape[1], b.shape[1]))
    S = np.zeros_like(D)
    for e in range(E):
        hi = min(off[e + 1], nr[0])
        rows = np.arange(min(off[e], hi), hi)

        def gathered(x, index):
            if index is None:
                return f64(x[rows])
            src = index[rows]
            return np.where(src[:, None] >= 0, f64(x[np.maximum(src, 0)]), 0.0)
        A, B = gathered(a, a_index), gathered(b, b_index)
        D[e] = A.T @ B
        S[e] = np.abs(A).T @ np.abs(B)
    return D, S


def run(args, out0, out1, m_split, cfg, **kw):
    a, a_index, b, b_index, off, nr = args
    wgrad(to_dev(a), None if a_index is None else to_dev(a_index), to_dev(b),
          None if b_index is None else to_dev(b_index), to_dev(off), to_dev(nr), out0, out1,
          m_split, config=cfg, **kw)


def joined(out0, out1, m_split):
    """[E, M, N] from the two outputs (out1 is out0 when m_split = M)."""
    h0 = to_host(out0)
    return h0 if out1 is out0 else np.concatenate([h0, to_host(out1)], axis=1)


def check_bf16(got_bits, D, S):
    got = f64(got_bits)
    assert np.isfinite(got).all()
    assert np.abs(got - D).sum() <= 0.005 * np.abs(D).sum()
    # each element: one bf16 rounding (half an ulp, <= 2^-8 relative) of an FP32 sum
    assert np.all(np.abs(got - D) <= 2.0 ** -8 * np.abs(D) + 1e-5 * S)


# counts: an empty expert, 1-3 slices; the last expert cut by num_rows (cut rows), the one
# after it wholly past num_rows (zeros)
CASES = {
    # dW_gate/dW_up's form: A = d(gate|up) rows direct [C, 2I], B = x gathered; two outputs
    "gate_up": dict(cfg=SIM_GEMM, counts=[32, 0, 64, 96, 32], cut=64, M=64, N=96,
                    gather_a=False, gather_b=True, m_split=32, dtype=np.uint16),
    # dW_down's form: A = d_out gathered, B = hidden rows direct; one output (m_split = M);
    # the 40-row expert is ragged (not a multiple of bk: the rest of its tail slice, past
    # num_rows, is NaN and must be zero-filled on both sides)
    "down": dict(cfg=SIM_GEMM, counts=[32, 0, 64, 40, 32], cut=32, M=32, N=64, gather_a=True,
                 gather_b=False, m_split=32, dtype=np.float32),
    # both gathered, 64 x 64 tiles, two outputs
    "both64": dict(cfg=CFG64, counts=[0, 64, 96, 32], cut=32, M=128, N=64, gather_a=True,
                   gather_b=True, m_split=64, dtype=np.uint16),
    # the layer's GPU wgrad tile (``mok_comm.layer.WGRAD_GEMM``: 128 x 128, 2 x 4 warps)
    "gate_up128": dict(cfg=WGRAD_GEMM, counts=[64, 0, 32, 32], cut=32, M=256, N=128,
                       gather_a=False, gather_b=True, m_split=128, dtype=np.uint16),
    # wgmma, dW_gate/dW_up's form: ragged experts (40 rows: one part-slice; 130 cut to 112 by
    # num_rows: a full slice and a part one, zero-filled on both sides past hi), an empty one,
    # one wholly past num_rows (its one slice of zeros), two outputs; 10 tiles on 4 blocks: the
    # ring, the staging and the prologue of the next tile wrap around
    "wgmma-gate_up": dict(cfg=WG64, counts=[64, 0, 40, 130, 32], cut=50, M=256, N=64,
                          gather_a=False, gather_b=True, m_split=128, dtype=np.uint16),
    # wgmma, dW_down's form, FP32 out: A gathered, one output, two boxes of B per slice; 200
    # rows = 4 slices (the ring of 4 wraps within a tile), a ragged 40, an empty expert
    "wgmma-down": dict(cfg=WG128, counts=[200, 0, 64, 40, 32], cut=32, M=128, N=128,
                       gather_a=True, gather_b=False, m_split=128, dtype=np.float32),
    # wgmma, both gathered, bf16, two column tiles per expert
    "wgmma-both": dict(cfg=WG64, counts=[0, 70, 64, 32], cut=32, M=128, N=128, gather_a=True,
                       gather_b=True, m_split=128, dtype=np.uint16),
    # wgmma at 256 columns, bf16 (half-tile staging), B gathered, the split mid-M; expert 3
    # 312 rows (5 slices: the 4-slice ring wraps within a tile), expert 4 past num_rows
    "wgmma-gate_up256": dict(cfg=WG256, counts=[64, 0, 40, 330, 32], cut=50, M=256, N=256,
                             gather_a=False, gather_b=True, m_split=128, dtype=np.uint16),
}


def _needs_hopper(cfg):
    if cfg.mma == "wgmma" and not SIM:
        from numba import cuda
        if cuda.get_current_device().compute_capability != (9, 0):
            pytest.skip("the wgmma wgrad needs sm_90")


@pytest.mark.parametrize("case", list(CASES))
def test_wgrad_matches_float64(case):
    c = CASES[case]
    cfg, M, N, m_split, dtype = c["cfg"], c["M"], c["N"], c["m_split"], c["dtype"]
    _needs_hopper(cfg)
    args = problem(len(case), c["counts"], M, N, gather_a=c["gather_a"],
                   gather_b=c["gather_b"], cut=c["cut"])
    E = len(c["counts"])
    fill = POISON16 if dtype == np.uint16 else np.nan          # every tile must be written
    out0 = to_dev(np.full((E, m_split, N), fill, dtype))
    out1 = out0 if m_split == M else to_dev(np.full((E, M - m_split, N), fill, dtype))
    run(args, out0, out1, m_split, cfg)
    got = joined(out0, out1, m_split)
    D, S = reference(*args)
    empty = [e for e in range(E) if not D[e].any()]
    assert len(empty) >= 2                                     # an empty one, one past num_rows
    for e in empty:
        assert np.all(got[e] == 0), f"expert {e} (no rows) must get zeros"
    if dtype == np.float32:
        assert np.all(np.abs(got - D) <= 1e-5 * np.abs(D) + 1e-6 * S)
    else:
        check_bf16(got, D, S)


# (config, M, N, m_split) of the single-config tests below: each kernel family's small tiles
SMALL = {"sync": (SIM_GEMM, 64, 32, 32), "wgmma": (WG64, 256, 64, 128)}


@pytest.mark.parametrize("kind", list(SMALL))
def test_bf16_is_the_fp32_sum_rounded_once_and_reruns_are_bitwise(kind):
    """The bf16 output is exactly the FP32 output rounded (to nearest even) once, and a rerun
    (a second launch, fresh outputs) gives the same bits."""
    cfg, M, N, m_split = SMALL[kind]
    _needs_hopper(cfg)
    args = problem(5, [64, 0, 32], M, N, gather_a=True, gather_b=True)
    E = 3
    f32 = to_dev(np.full((E, M, N), np.nan, np.float32))
    run(args, f32, f32, M, cfg)
    outs = []
    for _ in range(2):
        lo = to_dev(np.full((E, m_split, N), POISON16, np.uint16))
        hi = to_dev(np.full((E, M - m_split, N), POISON16, np.uint16))
        run(args, lo, hi, m_split, cfg)
        outs.append(joined(lo, hi, m_split))
    np.testing.assert_array_equal(outs[0], bits(to_host(f32)))
    np.testing.assert_array_equal(outs[1], outs[0])


@pytest.mark.parametrize("kind", list(SMALL))
def test_accumulate_adds_in_fp32(kind):
    """accumulate=True twice = initial + D + D, bitwise equal to the two FP32 additions of the
    plain result D (itself bitwise equal on a rerun); an empty expert keeps its values; a clean
    run records nothing in the error word."""
    cfg, M, N, m_split = SMALL[kind]
    _needs_hopper(cfg)
    args = problem(6, [32, 0, 64], M, N, gather_a=False, gather_b=True)
    E = 3
    rng = np.random.default_rng(7)
    init = rng.standard_normal((E, M, N)).astype(np.float32)
    words = to_dev(err.initial_error_word())
    plain = []
    for _ in range(2):
        lo = to_dev(np.full((E, m_split, N), np.nan, np.float32))
        hi = to_dev(np.full((E, M - m_split, N), np.nan, np.float32))
        run(args, lo, hi, m_split, cfg, errors=words)
        plain.append(joined(lo, hi, m_split))
    np.testing.assert_array_equal(plain[1], plain[0])
    D = plain[0]
    lo = to_dev(init[:, :m_split].copy())
    hi = to_dev(init[:, m_split:].copy())
    for _ in range(2):
        run(args, lo, hi, m_split, cfg, accumulate=True, errors=words)
    got = joined(lo, hi, m_split)
    np.testing.assert_array_equal(got, (init + D) + D)
    np.testing.assert_array_equal(got[1], init[1])             # the empty expert: unchanged
    want, _ = reference(*args)
    np.testing.assert_allclose(got - init, 2 * want, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(to_host(words), err.initial_error_word())


@pytest.mark.parametrize("kind", list(SMALL) + ["wgmma256"])
@pytest.mark.parametrize("dtype", [np.uint16, np.float32], ids=["bf16", "f32"])
def test_nan_input_is_reported(dtype, kind):
    """A NaN in A at (row r of expert 1, column m) makes row m of D_1 NaN: N values, first row
    m, expert 1, under the tensor id and rank given (``wgmma256``: the bf16 tile staged in two
    halves, each recounted; FP32 there takes a 3-slice ring, as 4 do not fit beside it)."""
    if kind == "wgmma256":
        cfg, N = (WG256 if dtype == np.uint16 else replace(WG256, stages=3)), 256
    else:
        cfg, _, N, _ = SMALL[kind]
    _needs_hopper(cfg)
    M = cfg.bm
    m = 21 if M == 32 else 77          # (wgmma: a row of the second warpgroup)
    a, a_index, b, b_index, off, nr = problem(8, [32, 64], M, N, gather_a=False,
                                              gather_b=False)
    a = a.copy()
    a[off[1] + 40, m] = bits([np.nan])[0]
    words = to_dev(err.initial_error_word())
    out = to_dev(np.zeros((2, M, N), dtype))
    run((a, a_index, b, b_index, off, nr), out, out, M, cfg, errors=words,
        tensor=err.NF_HIDDEN, rank=3)
    got = joined(out, out, M).astype(np.float64) if dtype == np.float32 else f64(to_host(out))
    assert np.isnan(got[1, m]).all() and np.isfinite(np.delete(got[1], m, axis=0)).all()
    assert np.isfinite(got[0]).all()
    w = to_host(words)
    t = err.NF_HIDDEN
    assert w[err.FLAGS] & err.ERR_NON_FINITE
    assert w[err.NONFINITE + 2 * t] == N
    assert err.from_key(w[err.NONFINITE + 2 * t + 1]) == m
    assert err.from_key(w[err.NONFINITE_EXPERT + t]) == 1
    assert w[err.NONFINITE_RANK] == 3


@pytest.mark.parametrize("col", [5, 200], ids=["first_half", "second_half"])
def test_nan_in_one_half_of_a_half_staged_tile_is_reported(col):
    """``WG256`` stages a warp's bf16 rows half a tile at a time: a NaN in B's column ``col``
    (row r of expert 1) makes column ``col`` of D_1 NaN in one half only -- M values, first
    row 0, expert 1 -- and nothing else."""
    cfg, M, N = WG256, 128, 256
    _needs_hopper(cfg)
    a, a_index, b, b_index, off, nr = problem(9, [32, 64], M, N, gather_a=False,
                                              gather_b=False)
    b = b.copy()
    b[off[1] + 40, col] = bits([np.nan])[0]
    words = to_dev(err.initial_error_word())
    out = to_dev(np.zeros((2, M, N), np.uint16))
    run((a, a_index, b, b_index, off, nr), out, out, M, cfg, errors=words,
        tensor=err.NF_HIDDEN, rank=1)
    got = f64(to_host(out))
    assert np.isnan(got[1][:, col]).all() and np.isfinite(np.delete(got[1], col, axis=1)).all()
    assert np.isfinite(got[0]).all()
    w = to_host(words)
    t = err.NF_HIDDEN
    assert w[err.NONFINITE + 2 * t] == M
    assert err.from_key(w[err.NONFINITE + 2 * t + 1]) == 0
    assert err.from_key(w[err.NONFINITE_EXPERT + t]) == 1
    assert w[err.NONFINITE_RANK] == 1


def _good():
    C, M, N, E = 32, 32, 64, 2
    return dict(a=np.zeros((C, M), np.uint16), a_index=None, b=np.zeros((C, N), np.uint16),
                b_index=np.zeros(C, np.int32), expert_offsets=np.array([0, 32, 32], np.int32),
                num_rows=np.array([32], np.int32), out0=np.zeros((E, M, N), np.float32),
                out1=None, m_split=M)


@pytest.mark.parametrize("change,exc,match", [
    (dict(a=np.zeros((32, 32), np.float32)), TypeError, "a: expected dtype uint16, got float32"),
    (dict(b=np.zeros(32, np.uint16)), ValueError, "b: expected 2 dimensions"),
    (dict(b_index=np.zeros(32, np.int64)), TypeError, "b_index: expected dtype int32, got int64"),
    (dict(b_index=np.zeros(16, np.int32)), ValueError,
     "a rows \\(no a_index\\) is 32, b_index length is 16"),
    (dict(a_index=np.zeros(8, np.int32)), ValueError,
     "a_index length is 8, b_index length is 32"),
    (dict(expert_offsets=np.zeros(3, np.int64)), TypeError, "expert_offsets: expected dtype int32"),
    (dict(expert_offsets=np.zeros(1, np.int32)), ValueError,
     "expert_offsets: expected \\[E \\+ 1\\]"),
    (dict(num_rows=np.zeros(2, np.int32)), ValueError, "num_rows: expected shape \\(1,\\)"),
    (dict(a=np.zeros((32, 48), np.uint16), out0=np.zeros((2, 48, 64), np.float32), m_split=48),
     ValueError, "a: M=48 .* multiple of bm=32"),
    (dict(b=np.zeros((32, 40), np.uint16), out0=np.zeros((2, 32, 40), np.float32)), ValueError,
     "b: N=40 .* multiple of bn=32"),
    (dict(m_split=16), ValueError, "m_split=16: must be a multiple of bm=32 in \\[0, M=32\\]"),
    (dict(m_split=64), ValueError, "m_split=64"),
    (dict(out0=np.zeros((2, 32, 64), np.float64)), TypeError,
     "out0: expected dtype uint16 \\(bf16\\) or float32, got float64"),
    (dict(out0=np.zeros((3, 32, 64), np.float32)), ValueError,
     "out0: expected shape \\(2, 32, 64\\), got \\(3, 32, 64\\)"),
    (dict(out0=None), TypeError, "out0: expected an array, got None"),
    (dict(a=np.zeros((32, 64), np.uint16), out0=np.zeros((2, 32, 64), np.float32),
          out1=np.zeros((2, 32, 64), np.uint16), m_split=32), TypeError,
     "out1: expected dtype float32 \\(that of out0\\), got uint16"),
    (dict(out0=np.zeros((2, 32, 64), np.uint16), accumulate=True), ValueError,
     "accumulate=True needs float32 outputs, got uint16"),
    (dict(config=WGMMA_192_GEMM), ValueError,
     "the wgmma wgrad takes bm=128 \\(two compute warpgroups\\) with bn=64, 128 or 256"),
    (dict(config=WG64), ValueError, "a: M=32 .* multiple of bm=128"),
    (dict(config=replace(WG64, bn=256), accumulate=True), ValueError,
     "accumulate=True: bn=256, but the tiles it adds to are at most 128 columns wide"),
    (dict(config=GemmConfig(bm=96, bn=32, bk=32, wm=2, wn=1, stages=2)), ValueError,
     "wgrad needs bm = 16, 32 or a multiple of 64"),
    (dict(tensor=99), ValueError, "tensor=99"),
])
def test_validation_names_the_argument(change, exc, match):
    kw = dict(_good(), config=SIM_GEMM)
    kw.update(change)
    args = [kw.pop(k) for k in ("a", "a_index", "b", "b_index", "expert_offsets",
                                "num_rows", "out0", "out1", "m_split")]
    with pytest.raises(exc, match=match):
        wgrad(*[None if x is None else to_dev(x) if isinstance(x, np.ndarray) else x
                for x in args], **kw)


def test_split_outputs_must_not_alias():
    kw = _good()
    a = to_dev(np.zeros((32, 64), np.uint16))
    out = to_dev(np.zeros((2, 32, 64), np.float32))
    with pytest.raises(ValueError, match="out0, out1: .* the same memory"):
        wgrad(a, None, to_dev(kw["b"]), to_dev(kw["b_index"]), to_dev(kw["expert_offsets"]),
              to_dev(kw["num_rows"]), out, out, 32, config=SIM_GEMM)


# ---- a real shape, on the GPU only --------------------------------------------------------------

@pytest.mark.skipif(SIM, reason="a real shape: GPU only")
@pytest.mark.parametrize("use", ["gate_up", "down"])
def test_wgmma_wgrad_real_shape(use, capsys):
    """qwen3.5-397b's routed experts at EP 1 (H = 4096, I = 1024, 512 experts, top-10 of 4096
    tokens: ~80 rows each, padded to 64, one expert empty): dW_gate | dW_up = d_gu^T x (A =
    d_gu [C, 2I] direct, B = x gathered, split at I) or dW_down = d_out^T (w h) (A = d_out
    gathered, B = w h [C, I] direct), bf16 out, on ``mok_comm.layer.WGRAD_WGMMA_GEMM`` and
    ``WGRAD_WGMMA_DEEP_GEMM`` (half-tile staging) vs float64 on 3 whole experts (the
    largest, the empty one, the last) -- the two bit-equal --, and FP32 added to (main-grad,
    on ``WGRAD_MAIN_GRAD_GEMM``) likewise; then the TFLOP/s (useful rows) and output GB/s of
    the wgmma and the mma.sync wgrad (``WGRAD_GEMM``) and the main-grad launch's time,
    printed."""
    from numba import cuda
    if cuda.get_current_device().compute_capability != (9, 0):
        pytest.skip("the wgmma wgrad needs sm_90")
    from mok_comm.layer import WGRAD_MAIN_GRAD_GEMM, WGRAD_WGMMA_DEEP_GEMM, WGRAD_WGMMA_GEMM
    from mok_core.cuda_compat import device_full
    from mok_core.gemm import launch_wgrad
    H, I, E, T, k = 4096, 1024, 512, 4096, 10
    cfg = WGRAD_WGMMA_GEMM
    rng = np.random.default_rng(31)
    counts = np.bincount(rng.integers(0, E, T * k), minlength=E).astype(np.int64)
    counts[7] = 0
    off = np.concatenate([[0], np.cumsum(-(-counts // 64) * 64)]).astype(np.int32)
    C = int(off[-1]) + 128                                   # spare rows past num_rows
    index = np.full(C, -1, np.int32)                         # row -> token (-1: padding)
    for e in range(E):
        index[off[e]:off[e] + counts[e]] = rng.integers(0, T, counts[e])
    if use == "gate_up":
        M, N, m_split = 2 * I, H, I
        a = rand_bf16_bits(rng, (C, M), 0)                       # d_gu rows, padding rows zero
        a[index < 0] = 0
        b = rand_bf16_bits(rng, (T, N), 0)                       # x, gathered
        a_index, b_index = None, index
    else:
        M, N, m_split = H, I, H
        a = rand_bf16_bits(rng, (T, M), 0)                       # d_out, gathered
        b = rand_bf16_bits(rng, (C, N), 0)                       # w h rows, padding rows zero
        b[index < 0] = 0
        a_index, b_index = index, None
    dev = {name: None if v is None else cuda.to_device(v) for name, v in
           (("a", a), ("ai", a_index), ("b", b), ("bi", b_index), ("off", off),
            ("nr", np.array([off[-1]], np.int32)))}
    cfg2 = replace(cfg, bn=128, stages=4)  # the narrower tile, a ring a stage deeper
    bits = []
    for c in (cfg, WGRAD_WGMMA_DEEP_GEMM, cfg2):    # each into freshly poisoned outputs
        out0 = out1 = None
        out0 = device_full((E, m_split, N), POISON16, np.uint16)   # (4.3 GB for gate/up)
        out1 = out0 if m_split == M else device_full((E, M - m_split, N), POISON16, np.uint16)
        word = cuda.to_device(err.initial_error_word())
        wgrad(dev["a"], dev["ai"], dev["b"], dev["bi"], dev["off"], dev["nr"], out0, out1,
              m_split, config=c, errors=word)
        cuda.synchronize()
        np.testing.assert_array_equal(word.copy_to_host(), err.initial_error_word())
        _check_experts(out0, out1, a, a_index, b, b_index, off, counts, E)
        if c.bn == cfg.bn:                 # a ring's depth does not enter a sum: the two
            # 256-wide kernels' bits equal on the first 64 experts (what the host holds easily)
            bits.append([o[:64].copy_to_host() for o in {id(out0): out0, id(out1): out1}.values()])
    for x, y in zip(*bits):
        np.testing.assert_array_equal(x, y)
    # main-grad: FP32 added to (the layer's accumulate=True: the output's tile loaded, added
    # to, stored) on the layer's main-grad tile, into buffers holding 0.5
    acc0 = device_full((E, m_split, N), 0.5, np.float32)          # (17 GB for gate/up)
    acc1 = acc0 if m_split == M else device_full((E, M - m_split, N), 0.5, np.float32)
    word = cuda.to_device(err.initial_error_word())
    wgrad(dev["a"], dev["ai"], dev["b"], dev["bi"], dev["off"], dev["nr"], acc0, acc1,
          m_split, accumulate=True, config=WGRAD_MAIN_GRAD_GEMM, errors=word)
    cuda.synchronize()
    np.testing.assert_array_equal(word.copy_to_host(), err.initial_error_word())
    _check_experts(acc0, acc1, a, a_index, b, b_index, off, counts, E, added_to=0.5)
    flop = 2.0 * counts.sum() * M * N
    gbytes = 2.0 * E * M * N / 1e9                          # the bf16 output written

    def timed(c, outs=(out0, out1), accumulate=False):   # the trusted entry: no host checks
        return gpu_ms(lambda: launch_wgrad(dev["a"], dev["ai"], dev["b"], dev["bi"],
                                           dev["off"], dev["nr"], *outs, m_split,
                                           accumulate=accumulate, config=c), 10, 1)
    ms = {"wgmma": timed(cfg), "4 stages": timed(WGRAD_WGMMA_DEEP_GEMM),
          "128x128 s4": timed(cfg2), "mma_sync": timed(WGRAD_GEMM)}
    acc_ms = timed(WGRAD_MAIN_GRAD_GEMM, (acc0, acc1), True)
    with capsys.disabled():
        print(f"\n[wgrad {use}: rows={int(counts.sum())} M={M} N={N} E={E}] " + ", ".join(
            f"{name}: {v:.3f} ms = {flop / v / 1e9:.0f} TFLOP/s, {gbytes / v * 1e3:.0f} GB/s out"
            for name, v in ms.items()) + f" (wgmma x{ms['mma_sync'] / ms['wgmma']:.2f}); "
            f"FP32 added to: {acc_ms:.3f} ms = {4 * gbytes / acc_ms * 1e3:.0f} GB/s read + "
            f"written (x{acc_ms / ms['wgmma']:.2f} the bf16 output's time)")


def _check_experts(out0, out1, a, a_index, b, b_index, off, counts, E, added_to=None):
    """The real-shape test's outputs vs float64 on 3 whole experts (the largest, the empty
    one, the last); ``added_to``: FP32 outputs that held this value before."""
    for e in (int(np.argmax(counts)), 7, E - 1):
        rows = np.arange(off[e], off[e] + counts[e])

        def side(x, idx):
            return f64(x[rows] if idx is None else x[idx[rows]])
        A, B = side(a, a_index), side(b, b_index)
        D, S = A.T @ B, np.abs(A).T @ np.abs(B)
        got = out0[e].copy_to_host()
        if out1 is not out0:
            got = np.concatenate([got, out1[e].copy_to_host()])
        if added_to is not None:               # FP32: one rounding of added_to + D
            got = got.astype(np.float64) - added_to
            assert np.isfinite(got).all()
            bound = 2.0 ** -23 * (np.abs(D) + added_to) + 1e-5 * S
            assert np.all(np.abs(got - D) <= bound), f"expert {e}"
        elif counts[e] == 0:
            assert np.all(got == 0), f"expert {e} (no rows) must get zeros"
        else:
            check_bf16(got, D, S)
