"""The weight-gradient grouped GEMM (``mok_core.gemm.wgrad``, kernel in ``sm80_wgrad``,
mma.sync) vs float64, on the simulator at tiny shapes.

D_e[m, n] = sum over expert e's rows r (clamped to num_rows) of A[ra(r), m] B[rb(r), n]:
gathered A and/or B with -1 padding rows, rows past num_rows ignored (NaN there, or indices of a
NaN row), empty experts written as zeros, the m_split into two outputs, bf16 (FP32
rounded once) and float32 outputs, accumulate=True, bitwise reruns, NaN reported to the error
word, and the host-side validation messages.
"""
import ml_dtypes
import numpy as np
import pytest

from helpers import to_dev
from mok_core import errors as err
from mok_core.cuda_compat import to_host
from mok_core.gemm import SIM_GEMM, WGMMA_GEMM, GemmConfig, wgrad

# SIM_GEMM: 32 x 32 tiles, 2 x 1 warps, 2 stages; CFG64: 64 x 64 tiles, 2 x 2 warps, 3 stages
# (each warp 2 m16 x 4 n8 tiles, the ring deeper than most experts' slices).
CFG64 = GemmConfig(bm=64, bn=64, bk=32, wm=2, wn=2, stages=3)
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
}


@pytest.mark.parametrize("case", list(CASES))
def test_wgrad_matches_float64(case):
    c = CASES[case]
    cfg, M, N, m_split, dtype = c["cfg"], c["M"], c["N"], c["m_split"], c["dtype"]
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


def test_bf16_is_the_fp32_sum_rounded_once_and_reruns_are_bitwise():
    """The bf16 output is exactly the FP32 output rounded (to nearest even) once, and a rerun
    (a second launch, fresh outputs) gives the same bits."""
    M, N, m_split = 64, 32, 32
    args = problem(5, [64, 0, 32], M, N, gather_a=True, gather_b=True)
    E = 3
    f32 = to_dev(np.full((E, M, N), np.nan, np.float32))
    run(args, f32, f32, M, SIM_GEMM)
    outs = []
    for _ in range(2):
        lo = to_dev(np.full((E, m_split, N), POISON16, np.uint16))
        hi = to_dev(np.full((E, M - m_split, N), POISON16, np.uint16))
        run(args, lo, hi, m_split, SIM_GEMM)
        outs.append(joined(lo, hi, m_split))
    np.testing.assert_array_equal(outs[0], bits(to_host(f32)))
    np.testing.assert_array_equal(outs[1], outs[0])


def test_accumulate_adds_in_fp32():
    """accumulate=True twice = initial + D + D, bitwise equal to the two FP32 additions of the
    plain result D (itself bitwise equal on a rerun); an empty expert keeps its values; a clean
    run records nothing in the error word."""
    M, N, m_split = 64, 32, 32
    args = problem(6, [32, 0, 64], M, N, gather_a=False, gather_b=True)
    E = 3
    rng = np.random.default_rng(7)
    init = rng.standard_normal((E, M, N)).astype(np.float32)
    words = to_dev(err.initial_error_word())
    plain = []
    for _ in range(2):
        lo = to_dev(np.full((E, m_split, N), np.nan, np.float32))
        hi = to_dev(np.full((E, M - m_split, N), np.nan, np.float32))
        run(args, lo, hi, m_split, SIM_GEMM, errors=words)
        plain.append(joined(lo, hi, m_split))
    np.testing.assert_array_equal(plain[1], plain[0])
    D = plain[0]
    lo = to_dev(init[:, :m_split].copy())
    hi = to_dev(init[:, m_split:].copy())
    for _ in range(2):
        run(args, lo, hi, m_split, SIM_GEMM, accumulate=True, errors=words)
    got = joined(lo, hi, m_split)
    np.testing.assert_array_equal(got, (init + D) + D)
    np.testing.assert_array_equal(got[1], init[1])             # the empty expert: unchanged
    want, _ = reference(*args)
    np.testing.assert_allclose(got - init, 2 * want, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(to_host(words), err.initial_error_word())


@pytest.mark.parametrize("dtype", [np.uint16, np.float32], ids=["bf16", "f32"])
def test_nan_input_is_reported(dtype):
    """A NaN in A at (row r of expert 1, column m) makes row m of D_1 NaN: N values, first row
    m, expert 1, under the tensor id and rank given."""
    M, N, m = 32, 32, 21
    a, a_index, b, b_index, off, nr = problem(8, [32, 64], M, N, gather_a=False,
                                              gather_b=False)
    a = a.copy()
    a[off[1] + 40, m] = bits([np.nan])[0]
    words = to_dev(err.initial_error_word())
    out = to_dev(np.zeros((2, M, N), dtype))
    run((a, a_index, b, b_index, off, nr), out, out, M, SIM_GEMM, errors=words,
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
    (dict(config=WGMMA_GEMM), ValueError, "the wgmma wgrad does not exist yet"),
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
