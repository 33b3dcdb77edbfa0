"""NaN/Inf caught in the GEMMs' output tiles (issue 21): a NaN/Inf weight is reported with the
tensor, count, first row and local expert by the step's report, on both GEMM kernels (the
mma.sync path, and wgmma with the combine fused into the down GEMM); clean weights report
nothing and give the same output bits. Emulated ranks on the simulator."""
import numpy as np
import pytest

from layer_support import layer_inputs, reference_out, rel_l1
from mok_comm.emulation import emulated_layers
from mok_core import errors as err
from mok_core.config import LayerShape, MoKConfig
from mok_core.cuda_compat import to_host
from mok_core.gemm import SIM_GEMM, GemmConfig
from test_error_details import _report, _step

CFG = MoKConfig(row_align=32, minibatch_size=64, capacity_factor=1.0)
WG_GEMM = GemmConfig(bm=128, bn=64, bk=64, wm=2, wn=1, stages=3, mma="wgmma")
WG_CFG = MoKConfig(row_align=64, minibatch_size=128, capacity_factor=1.0)
R, T = 2, 8


def _shape(H=64, I=32, shared=True):
    return LayerShape(hidden=H, intermediate=I, shared_intermediate=I if shared else 0,
                      num_experts=2 * R, topk=2, ep_size=R)


def _segments(lw):
    """Local expert -> (first row, rows) of this rank's last schedule."""
    off = to_host(lw.schedule.expert_offsets)
    return {e: (int(off[e]), int(off[e + 1] - off[e])) for e in range(len(off) - 1)}


def _busy_expert(lws):
    """(rank, local expert, first row, rows) of the first expert that got rows."""
    for r, lw in enumerate(lws):
        for e, (first, n) in _segments(lw).items():
            if n:
                return r, e, first, n
    raise AssertionError("no expert got rows")


def _run(lws, inp):
    got, msgs = _step(lws, inp, inp["ids"])
    return got, msgs


@pytest.mark.parametrize("gemm,cfg,H", [(SIM_GEMM, CFG, 64), (WG_GEMM, WG_CFG, 64)],
                         ids=["mma_sync", "wgmma_push"])
def test_nan_gate_then_inf_down_then_clean(gemm, cfg, H):
    # wgmma: no shared expert -- its clean GEMMs would check nothing here that
    # test_layer_emulated's wgmma layer does not (the NaN/Inf land in routed experts only)
    wgmma = gemm is WG_GEMM
    shape = _shape(H, 64 if wgmma else 32, shared=not wgmma)
    inp = layer_inputs(np.random.default_rng(3), shape, T)
    lws = emulated_layers(shape, T, cfg, gemm)
    clean, msgs = _run(lws, inp)                     # clean: no report, float64 bar
    assert msgs == [None] * R
    assert rel_l1(clean, reference_out(inp)) < 5e-3
    r, e, first, rows = _busy_expert(lws)
    E_l = shape.experts_per_rank

    bad = dict(inp, w_g=inp["w_g"].copy())
    bad["w_g"][r * E_l + e, 5, 7] = np.nan
    _, msgs = _run(lws, bad)
    where = f"local expert {e} (expert-sorted row {first})"
    assert msgs[r] == (
        f"step 2 of this layer (rank {r}): non-finite values on rank {r}: routed gate/up "
        f"output (hidden) has {rows} NaN/Inf values, first at {where} -- check w_gate/w_up "
        f"of that expert (or a token routed to it); routed down output (y) has {rows * H} NaN/Inf values, first at "
        f"{where} -- downstream of the NaN/Inf in routed gate/up output (hidden)")
    assert all(m is None for q, m in enumerate(msgs) if q != r)

    bad = dict(inp, w_d=inp["w_d"].copy())
    bad["w_d"][r * E_l + e, 9, 3] = -np.inf
    _, msgs = _run(lws, bad)
    assert msgs[r] == (
        f"step 3 of this layer (rank {r}): non-finite values on rank {r}: routed down output "
        f"(y) has {rows} NaN/Inf values, first at {where} -- check w_down of that expert")
    assert all(m is None for q, m in enumerate(msgs) if q != r)

    again, msgs = _run(lws, inp)                     # the next clean step: same bits
    assert msgs == [None] * R
    np.testing.assert_array_equal(again, clean)


def test_nan_in_the_shared_weights_names_the_shared_tensors():
    shape = _shape()
    inp = layer_inputs(np.random.default_rng(4), shape, T)
    lws = emulated_layers(shape, T, CFG, SIM_GEMM)
    bad = dict(inp, w_sg=inp["w_sg"].copy())
    bad["w_sg"][2, 11] = np.inf
    _, msgs = _run(lws, bad)
    rows = lws[0].shared_index.shape[0]              # every row of the shared expert
    for r, m in enumerate(msgs):
        assert m == (
            f"step 1 of this layer (rank {r}): non-finite values on rank {r}: shared gate/up "
            f"output has {rows} NaN/Inf values, first at token 0 -- check "
            f"w_shared_gate/w_shared_up; shared down output has {rows * 64} NaN/Inf values, "
            "first at token 0 -- downstream of the NaN/Inf in shared gate/up output")


def test_gemm_word_layout_is_described():
    w = err.initial_error_word()
    w[err.FLAGS] = err.ERR_NON_FINITE
    w[err.NONFINITE_RANK] = 3
    w[err.NONFINITE + 2 * err.NF_Y] = 12
    w[err.NONFINITE + 2 * err.NF_Y + 1] = err.INT32_MAX - 17
    w[err.NONFINITE_EXPERT + err.NF_Y] = err.INT32_MAX - 2
    assert err.describe(w) == [
        "non-finite values on rank 3: routed down output (y) has 12 NaN/Inf values, first at "
        "local expert 2 (expert-sorted row 17) -- check w_down of that expert"]
    assert err.ERROR_WORDS == err.NONFINITE_EXPERT + err.NONFINITE_TENSORS
    assert (err.initial_error_word()[err.NONFINITE_EXPERT:] == 0).all()
