"""The FP8 grouped GEMM (``mok_core.gemm.fp8_gemm``, ``sm90_fp8``: wgmma e4m3, 1 x 128 and
128 x 128 scales, the FP32 promotion per 128 of K) vs float64 of the dequantised operands
(``mok_core.quantize_reference.grouped_gemm_fp8_reference``): on the simulator at tiny shapes
(ragged experts, an empty one, one cut by num_rows, rows gathered by the quantizer with zero
padding rows), unchanged on a Hopper GPU, plus a real shape there with its TFLOP/s."""
import ml_dtypes
import numpy as np
import pytest

from helpers import gpu_ms, push_route, rand_bf16_bits, to_dev
from mok_core import errors as err
from mok_core.cuda_compat import SIM, to_host
from mok_core.gemm import fp8_gate_up_swiglu, fp8_gemm, fp8_wgrad, launch_fp8_gemm
from mok_core.quantize_reference import (grouped_gemm_fp8_reference,
                                         grouped_wgrad_fp8_reference, quantize_fp8_reference)
from mok_core.reference import swiglu

POISON16 = 0x7FC1                   # a bf16 NaN the GEMM never writes


def _hopper():
    if not SIM:
        from numba import cuda
        if cuda.get_current_device().compute_capability != (9, 0):
            pytest.skip("the FP8 GEMM needs sm_90")


def problem(seed, counts, K, N, *, gather, cut=0, scale=1.0):
    """Host inputs: quantised a [C, K] / w [E, N, K] with their scales, the expert offsets of
    ``counts`` rows each, num_rows = the total minus ``cut``; gathered: a's rows are random
    rows of a smaller source (what ``quantize_fp8(..., index=)`` writes), the last 7 rows of
    every non-empty expert padding (zero rows, scale 1)."""
    rng = np.random.default_rng(seed)
    C = int(sum(counts))
    off = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    src_rows = C if not gather else max(C // 2, 1)
    x = rng.standard_normal((src_rows, K)).astype(np.float32) * scale
    x[:, :128] *= 8.0                         # the scale blocks differ
    if gather:
        index = rng.integers(0, src_rows, C)
        for e, n in enumerate(counts):
            if n:
                index[off[e + 1] - min(7, n):off[e + 1]] = -1
        x = np.where(index[:, None] >= 0, x[np.maximum(index, 0)], 0.0).astype(np.float32)
    a, a_scale = quantize_fp8_reference(x, (1, 128))
    ws = [quantize_fp8_reference(rng.standard_normal((N, K)).astype(np.float32)
                                 * (1 + e), (128, 128)) for e in range(len(counts))]
    w = np.stack([q for q, _ in ws])
    w_scale = np.stack([s for _, s in ws]).astype(np.float32)
    nr = np.array([C - cut], np.int32)
    pad = np.flatnonzero(~x.any(axis=1))
    return (a, a_scale.astype(np.float32), w, w_scale, off, nr), pad


def run(args, stages=4, errors=None, bn=128):
    a, a_scale, w, w_scale, off, nr = args
    out = to_dev(np.full((a.shape[0], w.shape[1]), POISON16, np.uint16))
    fp8_gemm(to_dev(a), to_dev(a_scale), to_dev(w), to_dev(w_scale), to_dev(off), to_dev(nr),
             out, stages=stages, bn=bn, errors=errors)
    return to_host(out)


def f64(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


CASES = {
    # direct rows: 150 = a full and a partial row tile, an empty expert, the last cut by 20
    # (2 stages: the ring wraps within a tile, every stage refilled several times)
    "direct": dict(counts=[150, 0, 40, 96], K=256, N=128, gather=False, cut=20, stages=2),
    # gathered rows with padding, two column tiles, three K slices, an expert past num_rows
    "gathered": dict(counts=[64, 130, 0, 32], K=384, N=256, gather=True, cut=32, stages=4),
    # 256-column tiles: two halves a slice, each with its own weight scale block
    "wide": dict(counts=[100, 0, 60], K=256, N=256, gather=True, cut=8, stages=3, bn=256),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fp8_gemm_matches_float64_of_the_dequantised_operands(case):
    """Within rel-L1 5e-3 of float64 of the dequantised operands (the bf16 output rounding is
    most of it), each row within bf16 rounding plus the tensor cores' narrower sum; rows of no
    expert untouched; padding rows zero; a rerun bit for bit."""
    _hopper()
    c = CASES[case]
    args, pad = problem(len(case), c["counts"], c["K"], c["N"], gather=c["gather"],
                        cut=c["cut"])
    got = run(args, stages=c["stages"], bn=c.get("bn", 128))
    want = grouped_gemm_fp8_reference(*args)
    written = ~np.isnan(want[:, 0])
    assert (got[~written] == POISON16).all(), "rows of no expert must be left as they were"
    g, r = f64(got[written]), want[written]
    assert np.isfinite(g).all()
    rel = np.abs(g - r).sum() / np.abs(r).sum()
    assert rel < 5e-3, rel
    scale = np.abs(r).max(axis=1, keepdims=True) + 1e-30
    assert (np.abs(g - r) <= 8e-3 * np.abs(r) + 2e-3 * scale).all()
    if c["gather"]:
        pad = pad[written[pad]]
        assert len(pad) and (got[pad] == 0).all(), "padding rows must be zeros"
    np.testing.assert_array_equal(run(args, stages=c["stages"], bn=c.get("bn", 128)),
                                  got)                                  # deterministic


@pytest.mark.parametrize("N,bn", [(384, 128), (512, 256)])
def test_fp8_down_push_equals_gemm_then_scatter(N, bn):
    """``launch_fp8_gemm(push=)`` -- the FP8 down GEMM with the combine fused -- writes each
    real row's bits to its source rank's combine row token * k + slot and nothing else (every
    column tile: n0 > 0 too; padding rows of rank -1 not sent)."""
    _hopper()
    rng = np.random.default_rng(31)
    counts, R, T, k = [150, 0, 40, 96], 2, 64, 4
    args, pad = problem(33, counts, 256, N, gather=True, cut=20)
    a, a_scale, w, w_scale, off, nr = args
    C = a.shape[0]
    y = run(args, stages=3, bn=bn)
    real = np.setdiff1d(np.flatnonzero(y[:, 0] != POISON16), pad)
    src_rank, src_token, src_slot = push_route(rng, real, C, R, T, k)
    peers = tuple(to_dev(np.full(T * k * N // 2, 0xDEADBEEF, np.uint32)) for _ in range(R))
    launch_fp8_gemm(to_dev(a), to_dev(a_scale), to_dev(w), to_dev(w_scale), to_dev(off),
                    to_dev(nr), None, stages=3, bn=bn,
                    push=(to_dev(src_rank), to_dev(src_token), to_dev(src_slot), peers, k))
    want = np.full((R, T * k, N), 0xBEEF, np.uint16)
    want.view(np.uint32)[...] = 0xDEADBEEF
    want[src_rank[real], src_token[real] * k + src_slot[real]] = y[real]
    got = np.stack([to_host(p).view(np.uint16).reshape(T * k, N) for p in peers])
    assert len(real) > 100 and (np.diff(off) > 0).sum() == 3
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("limit,bn", [(None, 128), (0.5, 256)])
def test_fp8_gate_up_swiglu_matches_float64(limit, bn):
    """The SwiGLU epilogue: h = SwiGLU(A W_gate^T, A W_up^T) (clamped at ``limit``), gate and
    up promoted each with its own weight's scales (tiles of 64 + 64 or 128 + 128 columns),
    within rel-L1 5e-3 of float64 of the dequantised operands; padding rows zero, rows of no
    expert untouched."""
    _hopper()
    counts, K, I = [64, 130, 0, 32], 256, 256
    (a, a_scale, w_gate, s_gate, off, nr), pad = problem(9, counts, K, I, gather=True, cut=32)
    (_, _, w_up, s_up, _, _), _ = problem(10, counts, K, I, gather=True, cut=32)
    C = a.shape[0]
    h = to_dev(np.full((C, I), POISON16, np.uint16))
    fp8_gate_up_swiglu(to_dev(a), to_dev(a_scale), to_dev(w_gate), to_dev(s_gate),
                       to_dev(w_up), to_dev(s_up), to_dev(off), to_dev(nr), h,
                       swiglu_limit=limit, stages=3, bn=bn)
    got = to_host(h)
    g = grouped_gemm_fp8_reference(a, a_scale, w_gate, s_gate, off, nr)
    u = grouped_gemm_fp8_reference(a, a_scale, w_up, s_up, off, nr)
    written = ~np.isnan(g[:, 0])
    assert (got[~written] == POISON16).all()
    want = swiglu(g[written], u[written], limit)
    got_w = f64(got[written])
    assert np.isfinite(got_w).all()
    assert np.abs(got_w - want).sum() / np.abs(want).sum() < 5e-3
    pad = pad[written[pad]]
    assert len(pad) and (got[pad] == 0).all()


def swiglu_problem(seed):
    """A gate|up problem with padding rows (``problem``, gathered): (host arrays (a, a_scale,
    w_gate, s_gate, w_up, s_up, off, nr), the same on the device, C, I)."""
    counts, K, I = [64, 130, 0, 32], 256, 256
    (a, a_scale, w_gate, s_gate, off, nr), _ = problem(seed, counts, K, I, gather=True, cut=32)
    (_, _, w_up, s_up, _, _), _ = problem(seed + 1, counts, K, I, gather=True, cut=32)
    host = (a, a_scale, w_gate, s_gate, w_up, s_up, off, nr)
    return host, [to_dev(v) for v in host], a.shape[0], I


@pytest.mark.parametrize("bn", [128, 256])
def test_fp8_gate_up_saves_pre(bn):
    """``pre``: the FP32 gate and up values the SwiGLU read, within 5e-3 of float64 of the
    dequantised operands, written for the experts' rows only (the rest untouched); h
    unchanged by asking for them."""
    _hopper()
    host, args, C, I = swiglu_problem(15)
    a, a_scale, w_gate, s_gate, w_up, s_up, off, nr = host
    kw = dict(bn=bn, swiglu_limit=0.5)
    h = to_dev(np.full((C, I), POISON16, np.uint16))
    pre = (to_dev(np.full((C, I), np.nan, np.float32)), to_dev(np.full((C, I), np.nan,
                                                                        np.float32)))
    fp8_gate_up_swiglu(*args, h, pre=pre, **kw)
    plain = to_dev(np.full((C, I), POISON16, np.uint16))
    fp8_gate_up_swiglu(*args, plain, **kw)
    np.testing.assert_array_equal(to_host(h), to_host(plain))
    g_want = grouped_gemm_fp8_reference(a, a_scale, w_gate, s_gate, off, nr)
    u_want = grouped_gemm_fp8_reference(a, a_scale, w_up, s_up, off, nr)
    written = ~np.isnan(g_want[:, 0])
    for got, want in ((to_host(pre[0]), g_want), (to_host(pre[1]), u_want)):
        assert np.isnan(got[~written]).all(), "rows of no expert must be left as they were"
        g, r = got[written].astype(np.float64), want[written]
        assert np.abs(g - r).sum() / np.abs(r).sum() < 5e-3


def test_fp8_dgrad_on_transposed_weight_copies():
    """The dgrads' recipe (docs/design.md, FP8): d_x = [d_gate | d_up] [W_gate; W_up] reduces
    over 2I, so it is ``fp8_gemm`` with A = [d_gate | d_up] quantised 1 x 128 along 2I and
    W = ``quantize_expert_weights`` of [W_gate; W_up] ([E, 2I, H]) transposed ([E, H, 2I]);
    within rel-L1 5e-3 of float64 of the dequantised operands, i.e. of the product the
    weights as stored define (each quantised block of W^T is a transposed 128 x 128 block)."""
    from helpers import rand_bf16_bits
    from mok_core.quantize import quantize_expert_weights
    from mok_core.quantize_reference import dequantize_fp8
    _hopper()
    rng = np.random.default_rng(11)
    counts, H, I = [64, 0, 96], 128, 128
    E, C = len(counts), sum(counts)
    off = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    w_gu = rand_bf16_bits(rng, (E, 2 * I, H), -3)                 # [W_gate; W_up] as stored
    wt, wt_scale = quantize_expert_weights(to_dev(w_gu), transpose=True)
    wt, wt_scale = to_host(wt), to_host(wt_scale)
    assert wt.shape == (E, H, 2 * I)
    d_gu, d_scale = quantize_fp8_reference(rng.standard_normal((C, 2 * I)), (1, 128))
    d_x = run((d_gu, d_scale.astype(np.float32), wt, wt_scale, off, np.array([C], np.int32)))
    want = grouped_gemm_fp8_reference(d_gu, d_scale, wt, wt_scale, off, [C])
    g = f64(d_x)
    assert np.abs(g - want).sum() / np.abs(want).sum() < 5e-3
    # the same product from the weights as stored: W^T's blocks hold W's values
    W = np.stack([dequantize_fp8(wt[e], wt_scale[e], (128, 128)).T for e in range(E)])
    gu = (w_gu.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    assert np.abs(W - gu).max() <= 2.0 ** -4 * np.abs(gu).max()   # half an e4m3 step


@pytest.mark.parametrize("bn,stages", [(128, None), (256, None), (256, 4)])
def test_fp8_wgrad_matches_float64_of_the_dequantised_operands(bn, stages):
    """The weight gradient in FP8 (``fp8_wgrad``): per expert, sum over its rows of A[m, r]
    B[n, r] from the operands transposed and quantised along the rows (A 1 x 128, B 128 x
    128) -- segments of 256 / 0 / 128 / 128 / 128 rows, the operands zero past each expert's
    real rows, num_rows 48 rows into the fourth: the fifth's rows (data, not zeros) are past
    it, so its gradient is zeros like the empty expert's; M and N of two tiles each (N = 2 bn:
    more column tiles take the same path; ``stages`` None: ``FP8_TILES``' ring, or at 256 4
    slices -- the layer's where an expert's rows take more than three: a warp's rows staged a
    quarter tile at a time, ``sm90_fp8.wgrad_parts``) -- within rel-L1 5e-3 of float64 of the
    dequantised operands, every tile written; a rerun bit for bit. Then an Inf scale of A's row
    m = 200 in expert 2's slice reaches the error word (count: the row's N values, row 200,
    expert 2)."""
    _hopper()
    rng = np.random.default_rng(12)
    M, N = 256, 2 * bn
    seg = [256, 0, 128, 128, 128]                # padded segments (multiples of 128)
    real = [200, 0, 128, 48, 128]                # the rows each expert really holds
    off = np.concatenate([[0], np.cumsum(seg)]).astype(np.int32)
    R = int(off[-1])
    x = rng.standard_normal((R, M)).astype(np.float32)     # the rows, as wgrad stores them
    y = rng.standard_normal((R, N)).astype(np.float32) * 4
    for e in range(len(seg)):                    # padding rows are zero
        x[off[e] + real[e]:off[e + 1]] = 0
        y[off[e] + real[e]:off[e + 1]] = 0
    a, a_scale = quantize_fp8_reference(x, (1, 128), transpose=True)      # [M, R]
    b, b_scale = quantize_fp8_reference(y, (128, 128), transpose=True)    # [N, R]
    a_scale = a_scale.astype(np.float32)
    nr = np.array([off[3] + 48], np.int32)       # the fifth expert's rows lie past it
    E = len(seg)

    def run_wgrad(scale, errors=None):
        out = to_dev(np.full((E, M, N), POISON16, np.uint16))
        fp8_wgrad(to_dev(a), to_dev(scale), to_dev(b), to_dev(b_scale.astype(np.float32)),
                  to_dev(off), to_dev(nr), out, bn=bn, stages=stages, errors=errors)
        return to_host(out)
    got = run_wgrad(a_scale)
    want = grouped_wgrad_fp8_reference(a, a_scale, b, b_scale, off, nr)
    assert (got[1] == 0).all() and (got[4] == 0).all(), "experts of no rows get zeros"
    g = f64(got)
    assert np.isfinite(g).all()
    rel = np.abs(g - want).sum() / np.abs(want).sum()
    assert rel < 5e-3, rel
    for e in (0, 2, 3):                          # every tile: no row or column tile off
        assert np.abs(g[e] - want[e]).sum() / np.abs(want[e]).sum() < 5e-3, e
    np.testing.assert_array_equal(run_wgrad(a_scale), got)
    bad = a_scale.copy()
    bad[200, off[2] // 128] = np.inf
    words = to_dev(err.initial_error_word())
    run_wgrad(bad, errors=words)
    w = to_host(words)
    t = err.NF_WEIGHT_GRADS
    assert w[err.FLAGS] & err.ERR_NON_FINITE
    assert w[err.NONFINITE + 2 * t] == N
    assert err.from_key(w[err.NONFINITE + 2 * t + 1]) == 200
    assert err.from_key(w[err.NONFINITE_EXPERT + t]) == 2


def test_fp8_wgrad_splits_and_accumulates_fp32():
    """``fp8_wgrad``'s outputs as ``wgrad``'s: split at m_split into out0 / out1 (dW_gate /
    dW_up from one launch) bit for bit the unsplit bf16 gradient, on 256-wide tiles (N's
    default, and beside a 4-slice ring, the rows staged a quarter tile at a time) and 128-wide
    ones (the layer's where an expert's rows take at most two K
    slices: ``gemm.fp8_wgrad_cols``); FP32 outputs within 5e-3
    of float64, rounding to that bf16 gradient; ``accumulate`` adds them to the values there
    with one FP32 add (an expert of no rows left as it was); FP32 at 128-wide tiles (the
    default) and 256-wide alike, main-grad at 128 only; bad outputs refused by name."""
    _hopper()
    rng = np.random.default_rng(13)
    M, N, I = 256, 256, 128
    seg, real = [128, 0, 256], [100, 0, 256]
    off = np.concatenate([[0], np.cumsum(seg)]).astype(np.int32)
    R, E = int(off[-1]), len(seg)
    x = rng.standard_normal((R, M)).astype(np.float32)
    y = rng.standard_normal((R, N)).astype(np.float32)
    for e in range(E):
        x[off[e] + real[e]:off[e + 1]] = 0
        y[off[e] + real[e]:off[e + 1]] = 0
    a, a_s = quantize_fp8_reference(x, (1, 128), transpose=True)
    b, b_s = quantize_fp8_reference(y, (128, 128), transpose=True)
    ops = [to_dev(a), to_dev(a_s.astype(np.float32)), to_dev(b), to_dev(b_s.astype(np.float32)),
           to_dev(off), to_dev(np.array([R], np.int32))]
    whole = to_dev(np.full((E, M, N), POISON16, np.uint16))
    fp8_wgrad(*ops, whole)
    whole = to_host(whole)
    halves = [to_dev(np.full((E, I, N), POISON16, np.uint16)) for _ in range(2)]
    fp8_wgrad(*ops, halves[0], halves[1], I)
    np.testing.assert_array_equal(np.concatenate([to_host(h) for h in halves], 1), whole)
    narrow = [to_dev(np.full((E, I, N), POISON16, np.uint16)) for _ in range(2)]
    fp8_wgrad(*ops, narrow[0], narrow[1], I, bn=128)
    np.testing.assert_array_equal(np.concatenate([to_host(h) for h in narrow], 1), whole)
    deep = [to_dev(np.full((E, I, N), POISON16, np.uint16)) for _ in range(2)]
    fp8_wgrad(*ops, deep[0], deep[1], I, stages=4)     # (a quarter tile staged at a time)
    np.testing.assert_array_equal(np.concatenate([to_host(h) for h in deep], 1), whole)
    f32 = [to_dev(np.full((E, I, N), np.nan, np.float32)) for _ in range(2)]
    fp8_wgrad(*ops, f32[0], f32[1], I)
    d = np.concatenate([to_host(h) for h in f32], 1)
    want = grouped_wgrad_fp8_reference(a, a_s, b, b_s, off, [R])
    assert np.abs(d - want).sum() / np.abs(want).sum() < 5e-3
    assert (d[1] == 0).all()
    np.testing.assert_array_equal(d.astype(ml_dtypes.bfloat16).view(np.uint16), whole)
    base = rng.standard_normal((E, M, N)).astype(np.float32)
    acc = [to_dev(base[:, :I].copy()), to_dev(base[:, I:].copy())]
    fp8_wgrad(*ops, acc[0], acc[1], I, accumulate=True)
    got = np.concatenate([to_host(h) for h in acc], 1)
    np.testing.assert_array_equal(got, base + d)
    np.testing.assert_array_equal(got[1], base[1])
    # FP32 outputs take 128-wide tiles by default, a warp's rows staged whole
    # (``epilogue.f32_whole``); 256-wide ones stage them half at a time: the same sums.
    # Adding to them needs the whole rows (the output is loaded into the staging)
    f32_256 = to_dev(np.full((E, M, N), np.nan, np.float32))
    fp8_wgrad(*ops, f32_256, bn=256)
    np.testing.assert_array_equal(to_host(f32_256), d)
    with pytest.raises(ValueError, match="accumulate=True: bn=256"):
        fp8_wgrad(*ops, to_dev(base.copy()), bn=256, accumulate=True)
    with pytest.raises(ValueError, match="accumulate=True needs float32 outputs"):
        fp8_wgrad(*ops, halves[0], halves[1], I, accumulate=True)
    with pytest.raises(ValueError, match=r"out1: expected shape \(3, 128, 256\)"):
        fp8_wgrad(*ops, f32[0], to_dev(np.zeros((E, 64, N), np.float32)), I)
    with pytest.raises(ValueError, match="out1: must be C-contiguous"):
        fp8_wgrad(*ops, f32[0], to_dev(np.zeros((E, M, 2 * N), np.float32))[:, :, ::2], I)
    with pytest.raises(ValueError, match="m_split=64"):
        fp8_wgrad(*ops, f32[0], f32[1], 64)


def test_fp8_kernels_refuse_what_their_table_cannot_hold():
    """More experts than the shared table holds (``sm90.MAX_EXPERTS``) or K slices past 16
    bits: a ValueError naming the limit, before any launch."""
    from mok_core.gemm import sm90
    E = sm90.MAX_EXPERTS + 1
    off = to_dev(np.zeros(E + 1, np.int32))
    nr = to_dev(np.zeros(1, np.int32))
    with pytest.raises(ValueError, match=f"{E} experts in one launch"):
        fp8_gemm(to_dev(np.zeros((128, 128), np.uint8)), to_dev(np.ones((128, 1), np.float32)),
                 to_dev(np.zeros((E, 128, 128), np.uint8)),
                 to_dev(np.ones((E, 1, 1), np.float32)), off, nr,
                 to_dev(np.zeros((128, 128), np.uint16)))
    with pytest.raises(ValueError, match=f"{E} experts in one launch"):
        fp8_wgrad(to_dev(np.zeros((128, 128), np.uint8)), to_dev(np.ones((128, 1), np.float32)),
                  to_dev(np.zeros((128, 128), np.uint8)), to_dev(np.ones((1, 1), np.float32)),
                  off, nr, to_dev(np.zeros((E, 128, 128), np.uint16)))


def test_fp8_gemm_reports_non_finite_and_checks_inputs():
    """An Inf scale reaches the error word (count, row, expert); bad inputs raise naming the
    tensor."""
    _hopper()
    args = list(problem(3, [40, 64], 128, 128, gather=False)[0])
    w_scale = args[3].copy()
    w_scale[1, 0, 0] = np.inf
    args[3] = w_scale
    words = to_dev(err.initial_error_word())
    run(args, errors=words)
    w = to_host(words)
    t = err.NF_HIDDEN
    assert w[err.FLAGS] & err.ERR_NON_FINITE
    assert w[err.NONFINITE + 2 * t] == 64 * 128                    # expert 1: every value
    assert err.from_key(w[err.NONFINITE + 2 * t + 1]) == 40        # its first row
    assert err.from_key(w[err.NONFINITE_EXPERT + t]) == 1
    (a, a_scale, w8, ws, off, nr), _ = problem(3, [40, 64], 128, 128, gather=False)
    out = to_dev(np.zeros((104, 128), np.uint16))
    with pytest.raises(ValueError, match=r"a: K=100 \(its columns\) must be a positive "
                                         r"multiple of 128"):
        fp8_gemm(to_dev(a[:, :100]), to_dev(a_scale), to_dev(w8), to_dev(ws),
                 to_dev(off), to_dev(nr), out)
    with pytest.raises(ValueError, match=r"w_scale: expected shape \(2, 1, 1\)"):
        fp8_gemm(to_dev(a), to_dev(a_scale), to_dev(w8), to_dev(ws[:, :, :0]),
                 to_dev(off), to_dev(nr), out)
    with pytest.raises(TypeError, match="a: expected dtype uint8"):
        fp8_gemm(to_dev(a.astype(np.uint16)), to_dev(a_scale), to_dev(w8), to_dev(ws),
                 to_dev(off), to_dev(nr), out)
    with pytest.raises(ValueError, match=r"w_up: expected shape \(2, 128, 128\) \(as w_gate\)"):
        fp8_gate_up_swiglu(to_dev(a), to_dev(a_scale), to_dev(w8), to_dev(ws),
                           to_dev(w8[:1]), to_dev(ws[:1]), to_dev(off), to_dev(nr), out)
    # TMA loads a, 16-byte stores write out: both must start 16-byte aligned
    a_off = to_dev(np.zeros(a.size + 16, np.uint8))[8:8 + a.size].reshape(a.shape)
    with pytest.raises(ValueError, match="a: must start 16-byte aligned .*8 bytes past"):
        fp8_gemm(a_off, to_dev(a_scale), to_dev(w8), to_dev(ws), to_dev(off), to_dev(nr), out)
    out_off = to_dev(np.zeros(104 * 128 + 8, np.uint16))[2:2 + 104 * 128].reshape(104, 128)
    with pytest.raises(ValueError, match="out: must start 16-byte aligned .*4 bytes past"):
        fp8_gemm(to_dev(a), to_dev(a_scale), to_dev(w8), to_dev(ws), to_dev(off), to_dev(nr),
                 out_off)


def _e4m3_bytes(rng, shape):
    """Random e4m3 bytes, every finite value alike (the two NaN codes moved down one)."""
    b = rng.integers(0, 256, size=shape, dtype=np.uint8)
    return np.where((b & 0x7F) == 0x7F, b - 1, b).astype(np.uint8)


@pytest.mark.skipif(SIM, reason="a real shape: GPU only")
def test_fp8_gemm_real_shape(capsys):
    """kimi-k2.7's routed gate|up at 8192 tokens/rank of EP 8 (48 local experts, ~1365 rows
    each padded to 128, K = 7168, N = 2I = 4096): 16 rows of each of 4 experts vs float64 of
    the dequantised operands; then it and our BF16 GEMM on the same shape (``down``, the
    forward's wgmma kernel, bf16 operands of the same size) timed in turns, TFLOP/s and the
    ratio printed."""
    from mok_core.gemm import default_gemm, down
    from mok_core.quantize_reference import dequantize_fp8
    _hopper()
    E, K, N, per = 48, 7168, 4096, 1365
    rng = np.random.default_rng(0)
    counts = -(-rng.multinomial(E * per, np.ones(E) / E) // 128) * 128
    off = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    C = int(off[-1])
    a = _e4m3_bytes(rng, (C, K))
    w = _e4m3_bytes(rng, (E, N, K))
    a_scale = np.exp2(rng.uniform(-10, -6, (C, K // 128))).astype(np.float32)
    w_scale = np.exp2(rng.uniform(-10, -6, (E, N // 128, K // 128))).astype(np.float32)
    out = to_dev(np.zeros((C, N), np.uint16))
    dev = [to_dev(v) for v in (a, a_scale, w, w_scale, off, np.array([C], np.int32))]

    def fp8():
        fp8_gemm(dev[0], dev[1], dev[2], dev[3], dev[4], dev[5], out)
    fp8()
    got = to_host(out)
    for e in (0, 17, 30, E - 1):
        rows = off[e] + rng.choice(counts[e], 16, replace=False)
        want = dequantize_fp8(a[rows], a_scale[rows]) @ \
            dequantize_fp8(w[e], w_scale[e], (128, 128)).T
        g = f64(got[rows])
        assert np.abs(g - want).sum() / np.abs(want).sum() < 5e-3, e
    del a, w, got
    x16 = to_dev(rand_bf16_bits(rng, (C, K), -2))
    w16 = to_dev(rand_bf16_bits(rng, (E, N, K), -6))
    y16 = to_dev(np.zeros((C, N), np.uint16))
    cfg = default_gemm(C / E)

    def bf16():
        down(x16, w16, dev[4], dev[5], y16, config=cfg)
    ms = {"fp8": [], "bf16": []}
    for _ in range(5):                                   # in turns: the same machine state
        for name, fn in (("fp8", fp8), ("bf16", bf16)):
            ms[name].append(gpu_ms(fn, 5, 1))
    med = {k: float(np.median(v)) for k, v in ms.items()}
    flop = 2.0 * C * K * N
    with capsys.disabled():
        print(f"\n[fp8 gemm: rows={C} K={K} N={N} E={E}] fp8 {med['fp8']:.3f} ms = "
              f"{flop / med['fp8'] / 1e9:.0f} TFLOP/s, bf16 ({cfg.bm}x{cfg.bn}) "
              f"{med['bf16']:.3f} ms = {flop / med['bf16'] / 1e9:.0f} TFLOP/s "
              f"(fp8 x{med['bf16'] / med['fp8']:.2f})")


@pytest.mark.parametrize("swiglu", [False, True])
def test_fp8_192_row_tiles_equal_128(swiglu):
    """``bm=192`` (``fp8_rows_tile``: experts of 113-192 rows): three compute warpgroups, 192
    x 128 tiles -- bit-equal to the 128-row tiles (each output element's slices promoted in
    the same order by the same factors); rows of no expert untouched."""
    _hopper()
    from mok_core.gemm import launch_fp8_gemm
    counts, K, N = [160, 0, 150, 64, 200], 256, 256
    (a, a_scale, w, w_scale, off, nr), _ = problem(21, counts, K, N, gather=True, cut=30)
    (_, _, w1, w1_scale, _, _), _ = problem(22, counts, K, N, gather=True, cut=30)
    outs = []
    for bm in (128, 192):
        out = to_dev(np.full((a.shape[0], N), POISON16, np.uint16))
        up = dict(w_up=to_dev(w1), w_up_scale=to_dev(w1_scale)) if swiglu else {}
        launch_fp8_gemm(to_dev(a), to_dev(a_scale), to_dev(w), to_dev(w_scale), to_dev(off),
                        to_dev(nr), out, bn=128, bm=bm, stages=4, **up)
        outs.append(to_host(out))
    np.testing.assert_array_equal(outs[1], outs[0])
    assert (outs[0] != POISON16).any() and (outs[0] == POISON16).any()
