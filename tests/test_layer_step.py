"""The graphed fast path (``mok_torch.Layer.compile``) equals the eager step bit for bit: EP = 1
through torch (new input tensors every call, weight swaps), and R emulated ranks over
consecutive steps (the cross-step reuse of the staging, ids table and combine rows), pull and
split dispatch alike. CUDA simulator in CI; unchanged on one GPU (where ``compile`` captures a
real CUDA graph)."""
import numpy as np
import pytest
import torch

import mok_torch
from layer_support import layer_inputs
from mok_comm.emulation import emulated_layers
from mok_core.config import LayerShape, MoKConfig
from mok_core.cuda_compat import SIM, to_host
from mok_core.gemm import SIM_GEMM
from mok_testing import synthetic
from test_layer_emulated import run_layer

DEV = "cpu" if SIM else "cuda"
CFG = MoKConfig(row_align=32, minibatch_size=64, capacity_factor=1.0)
SHAPE = LayerShape(hidden=64, intermediate=32, shared_intermediate=32, num_experts=4, topk=2,
                   ep_size=1)


def eager(lw, x, ids, w, weights):
    return lw(x, ids, w, mok_torch.Weights(*weights))


def fresh_inputs(T, seed, masked=0.1):
    x, ids, w = synthetic.rank_inputs(SHAPE, T, 0, DEV, masked=masked, skew=0.5, seed=seed)
    return x.clone(), ids.clone(), w.clone()


def test_compiled_step_equals_eager_ep1():
    T = 40
    lw = mok_torch.Layer(SHAPE, T, CFG, gemm=SIM_GEMM)
    wg, wu, wd = synthetic.local_expert_weights(SHAPE, 0, DEV)
    sg, su, sd = synthetic.shared_weights(SHAPE, DEV)
    weights = (sg, su, sd, wg, wu, wd)
    step = lw.compile(weights)
    x, ids, w = fresh_inputs(T, 1)                      # new tensors every call (each step here)
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
    ids = ids.to(torch.int32)                           # int32 ids (int64 before): no rebuild
    got = step(x, ids, w)
    assert step.captures == 3
    assert torch.equal(got, eager(lw, x, ids, w, (sg, su, sd, wg, wu, wd2)))
    lw.check()


def test_compiled_step_checks_inputs():
    T = 8
    lw = mok_torch.Layer(SHAPE, T, CFG, gemm=SIM_GEMM)
    wg, wu, wd = synthetic.local_expert_weights(SHAPE, 0, DEV)
    sg, su, sd = synthetic.shared_weights(SHAPE, DEV)
    with pytest.raises(ValueError, match="w_down: expected shape"):
        lw.compile((sg, su, sd, wg, wu, wg))
    step = lw.compile((sg, su, sd, wg, wu, wd))
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
    with pytest.raises(ValueError, match="w_down: expected shape .*, on rank 0$"):
        step.set_weights(w_down=wg)
    np.testing.assert_array_equal(to_host(lw.comm.x_buf), before)     # nothing ran
    assert step.captures == 0
    # the refused weight was not kept: the step still runs on the ones it had
    assert torch.equal(step(x, ids, w), eager(lw, x, ids, w, (sg, su, sd, wg, wu, wd)))


@pytest.mark.parametrize("dispatch,R", [("pull", 3), ("split", 2)])
def test_consecutive_steps_emulated(dispatch, R, limit=1.0):
    """R ranks, two consecutive steps with different inputs on the same layers (the cross-step
    reuse of x_buf / ids table / combine buffer): the second gives the bits of fresh layers."""
    from dataclasses import replace
    T = 24
    shape = LayerShape(hidden=64, intermediate=32, shared_intermediate=32, num_experts=2 * R,
                       topk=3, ep_size=R)
    cfg = replace(CFG, dispatch=dispatch)
    lws = emulated_layers(shape, T, cfg, SIM_GEMM, swiglu_limit=limit)
    first, second = (layer_inputs(np.random.default_rng(seed), shape, T,
                                  weight_scale=3.0 if limit else 1.0) for seed in (R, R + 10))
    run_layer(lws, first)
    got = run_layer(lws, second, ids=second["ids"].astype(np.int64))
    want = run_layer(emulated_layers(shape, T, cfg, SIM_GEMM, swiglu_limit=limit), second)
    np.testing.assert_array_equal(got, want)
