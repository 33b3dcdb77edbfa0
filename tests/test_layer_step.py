"""The layer step of the graphed fast path (mok_torch.compile_step / functional.step_phases)
equals build_schedule + forward bit for bit: EP = 1 through torch (new input tensors every
call, weight swaps), and R emulated ranks through the functional phases (publish_x before the
first barrier, shared expert reading the staging copy). CUDA simulator in CI; unchanged on one
GPU (where compile_step captures a real CUDA graph)."""
import numpy as np
import pytest
import torch

import mok_torch
from helpers import to_dev
from layer_support import layer_inputs
from mok_comm.emulation import emulated_layer, run_phases
from mok_comm.functional import step_phases
from mok_core.config import LayerShape, MoKConfig
from mok_core.cuda_compat import SIM, to_host
from mok_torch import synthetic
from test_layer_emulated import run_layer, u16

DEV = "cpu" if SIM else "cuda"
CFG = MoKConfig(row_align=32, minibatch_size=64, macrobatch_size=256, capacity_factor=1.0)
SHAPE = LayerShape(hidden=64, intermediate=32, shared_intermediate=32, num_experts=4, topk=2,
                   ep_size=1)


def eager(lw, x, ids, w, weights):
    sched = mok_torch.build_schedule(lw, ids)
    return mok_torch.forward(CFG, lw, sched, x, w, *weights)[0]


def fresh_inputs(T, seed, masked=0.1):
    x, ids, w = synthetic.rank_inputs(SHAPE, T, 0, DEV, masked=masked, skew=0.5, seed=seed)
    return x.clone(), ids.clone(), w.clone()


def test_compiled_step_equals_eager_ep1():
    from mok_core.gemm import SIM_GEMM
    T = 40
    lw = mok_torch.get_workspace(SHAPE, T, CFG, gemm=SIM_GEMM)
    wg, wu, wd = synthetic.local_expert_weights(SHAPE, 0, DEV)
    sg, su, sd = synthetic.shared_weights(SHAPE, DEV)
    step = mok_torch.compile_step(CFG, lw, sg, su, sd, wg, wu, wd)
    weights = (sg, su, sd, wg, wu, wd)
    for seed, id_dtype in ((1, torch.int64), (2, torch.int32)):   # new tensors every call
        x, ids, w = fresh_inputs(T, seed)
        ids = ids.to(id_dtype)
        got = step(x, ids, w)
        want = eager(lw, x, ids, w, weights)
        assert got.dtype == torch.bfloat16 and got.shape == (T, 64)
        assert torch.equal(got, want)
    lw.check()
    assert step.captures == 1

    # a replaced weight tensor (param.data rebinding) is seen: rebuilt core, still equal
    wg.data = synthetic.local_expert_weights(SHAPE, 0, DEV, seed=7)[0]
    x, ids, w = fresh_inputs(T, 3)
    got = step(x, ids, w)
    assert step.captures == 2
    assert torch.equal(got, eager(lw, x, ids, w, weights))
    # set_weights: rebuilt once; then an in-place update (same pointer): read, no rebuild
    wd2 = wd.clone() * 2
    step.set_weights(w_down=wd2)
    got = step(x, ids, w)
    assert step.captures == 3
    assert torch.equal(got, eager(lw, x, ids, w, (sg, su, sd, wg, wu, wd2)))
    wd2.mul_(0.25)
    x, ids, w = fresh_inputs(T, 4)
    got = step(x, ids, w)
    assert step.captures == 3
    assert torch.equal(got, eager(lw, x, ids, w, (sg, su, sd, wg, wu, wd2)))
    lw.check()


def test_compiled_step_checks_inputs():
    from mok_core.gemm import SIM_GEMM
    T = 8
    lw = mok_torch.get_workspace(SHAPE, T, CFG, gemm=SIM_GEMM)
    wg, wu, wd = synthetic.local_expert_weights(SHAPE, 0, DEV)
    sg, su, sd = synthetic.shared_weights(SHAPE, DEV)
    with pytest.raises(ValueError, match="w_down: expected shape"):
        mok_torch.compile_step(CFG, lw, sg, su, sd, wg, wu, wg)
    with pytest.raises(ValueError, match="swiglu_limit"):
        mok_torch.compile_step(CFG, lw, sg, su, sd, wg, wu, wd, swiglu_limit=-1.0)
    step = mok_torch.compile_step(CFG, lw, sg, su, sd, wg, wu, wd)
    x, ids, w = fresh_inputs(T, 1)
    before = to_host(lw.comm.x_buf).copy()
    with pytest.raises(TypeError, match="x: expected dtype torch.bfloat16"):
        step(x.float(), ids, w)
    with pytest.raises(TypeError, match="topk_ids"):
        step(x, ids.float(), w)
    with pytest.raises(ValueError, match="router_weights: expected shape"):
        step(x, ids, w[:, :1].contiguous())
    with pytest.raises(TypeError, match="set_weights: unknown weight"):
        step.set_weights(w_gat=wg)
    np.testing.assert_array_equal(to_host(lw.comm.x_buf), before)     # nothing ran
    assert step.captures == 0


@pytest.mark.parametrize("dispatch,R", [("pull", 3), ("push", 2), ("split", 2)])
def test_step_phases_equal_eager_emulated(dispatch, R, limit=1.0):
    """R ranks: the step order (publish x before the first barrier, shared FFN from x_buf)
    gives the eager layer's bits, over two consecutive steps with different inputs on the same
    workspaces (the cross-step reuse of x_buf / ids table / combine buffer; with the push
    dispatch also of the peers' staging and the arrival counters). The eager layer pulls."""
    from dataclasses import replace

    from mok_core.gemm import SIM_GEMM
    T = 24
    shape = LayerShape(hidden=64, intermediate=32, shared_intermediate=32, num_experts=2 * R,
                       topk=3, ep_size=R)
    cfg = replace(CFG, dispatch=dispatch)
    lws = emulated_layer(shape, T, cfg, SIM_GEMM)
    eager_lws = emulated_layer(shape, T, CFG, SIM_GEMM)
    E_l = shape.experts_per_rank
    for seed in (R, R + 10):
        inp = layer_inputs(np.random.default_rng(seed), shape, T,
                           weight_scale=3.0 if limit else 1.0)
        outs = [to_dev(np.full((T, 64), 0xFFFF, np.uint16)) for _ in range(R)]
        phases = []
        for r, lw in enumerate(lws):
            sl = slice(r * E_l, (r + 1) * E_l)
            p, _ = step_phases(cfg, lw, to_dev(inp["ids"][r].astype(np.int64)),
                               to_dev(u16(inp["x"][r])), to_dev(inp["w"][r]),
                               to_dev(u16(inp["w_sg"])), to_dev(u16(inp["w_su"])),
                               to_dev(u16(inp["w_sd"])), to_dev(u16(inp["w_g"][sl])),
                               to_dev(u16(inp["w_u"][sl])), to_dev(u16(inp["w_d"][sl])),
                               swiglu_limit=limit, out=outs[r])
            assert len(p) == 4
            phases.append(p)
        run_phases([lw.comm for lw in lws], phases)
        for lw in lws:
            lw.check()
        got = np.stack([to_host(o).view(np.uint16) for o in outs])
        want = run_layer(eager_lws, inp, limit)
        np.testing.assert_array_equal(got, want)
