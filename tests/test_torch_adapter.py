"""mok_torch: torch tensors through the layer (EP = 1, simulator in CI; unchanged on a GPU),
the synthetic-layer helpers, and the sampled-token float64 reference vs mok_core.reference."""
import numpy as np
import pytest
import torch

import mok_torch
from mok_core.config import LayerShape, MoKConfig
from mok_core.cuda_compat import SIM
from mok_core.gemm import SIM_GEMM
from mok_core.reference import moe_forward
from mok_torch import synthetic
from mok_torch.reference import reference_tokens

DEV = "cpu" if SIM else "cuda"
GEMM = SIM_GEMM           # small tiles: quick in the simulator, the same on a GPU
CFG = MoKConfig(row_align=32, minibatch_size=64, macrobatch_size=256, capacity_factor=1.0)
SHAPE = LayerShape(hidden=64, intermediate=32, shared_intermediate=32, num_experts=4, topk=2,
                   ep_size=1)


def np64(t):
    return t.detach().double().cpu().numpy()


def full_reference(shape, x, ids, w, limit=None, seed=0, weights=None):
    """float64 layer on all experts; ``weights`` = (shared (3), routed (3)) tensors, else the
    synthetic ones rebuilt on the CPU (a CUDA generator draws other numbers: a GPU run must
    pass the weights it used)."""
    if weights is None:
        ew = [synthetic.expert_weights(shape, e, "cpu", seed) for e in range(shape.num_experts)]
        weights = (synthetic.shared_weights(shape, "cpu", seed),
                   [torch.stack([a[i] for a in ew]) for i in range(3)])
    shared, routed = weights
    return moe_forward(np64(x), np64(w), ids.cpu().numpy(), *(np64(a) for a in shared),
                       *(np64(a) for a in routed), swiglu_limit=limit)


@pytest.mark.parametrize("limit", [None, 0.5])
def test_sampled_reference_equals_numpy_reference(limit):
    shape = LayerShape(hidden=48, intermediate=32, shared_intermediate=16, num_experts=6,
                       topk=3)
    x, ids, w = synthetic.rank_inputs(shape, 20, 0, "cpu", masked=0.2)
    got = reference_tokens(x, ids, w, synthetic.shared_weights(shape, "cpu"),
                           lambda e: synthetic.expert_weights(shape, e, "cpu"), limit)
    want = full_reference(shape, x, ids, w, limit)
    assert np.abs(np64(got) - want).max() / np.abs(want).max() < 1e-10


@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
def test_forward_ep1(id_dtype):
    T = 40
    x, ids, w = synthetic.rank_inputs(SHAPE, T, 0, DEV, masked=0.1, skew=0.5)
    wg, wu, wd = synthetic.local_expert_weights(SHAPE, 0, DEV)
    sg, su, sd = synthetic.shared_weights(SHAPE, DEV)
    lw = mok_torch.get_workspace(SHAPE, T, CFG, gemm=GEMM)
    sched = mok_torch.build_schedule(lw, ids.to(id_dtype))
    out, ctx = mok_torch.forward(CFG, lw, sched, x, w, sg, su, sd, wg, wu, wd)
    lw.check()
    assert out.dtype == torch.bfloat16 and out.shape == (T, 64)
    want = full_reference(SHAPE, x, ids, w, weights=((sg, su, sd), (wg, wu, wd)))
    got = np64(out)
    assert np.isfinite(got).all()
    assert np.abs(got - want).sum() / np.abs(want).sum() < 5e-3
    out2, _ = mok_torch.forward(CFG, lw, sched, x, w, sg, su, sd, wg, wu, wd)
    assert torch.equal(out2, out)
    assert ctx.hidden is lw.hidden


def test_torch_inputs_checked():
    T = 8
    x, ids, w = synthetic.rank_inputs(SHAPE, T, 0, DEV)
    wg, wu, wd = synthetic.local_expert_weights(SHAPE, 0, DEV)
    sg, su, sd = synthetic.shared_weights(SHAPE, DEV)
    lw = mok_torch.get_workspace(SHAPE, T, CFG, gemm=GEMM)
    sched = mok_torch.build_schedule(lw, ids)
    with pytest.raises(TypeError, match="x: expected dtype torch.bfloat16"):
        mok_torch.forward(CFG, lw, sched, x.float(), w, sg, su, sd, wg, wu, wd)
    with pytest.raises(ValueError, match="w_gate: must be contiguous"):
        mok_torch.forward(CFG, lw, sched, x, w, sg, su, sd, wg.transpose(1, 2), wu, wd)
    with pytest.raises(TypeError, match="router_weights: expected dtype torch.float32"):
        mok_torch.forward(CFG, lw, sched, x, w.double(), sg, su, sd, wg, wu, wd)
    with pytest.raises(TypeError, match="topk_ids"):
        mok_torch.build_schedule(lw, ids.float())
    with pytest.raises(ValueError, match="w_up: expected shape"):
        mok_torch.forward(CFG, lw, sched, x, w, sg, su, sd, wg, wu[:1], wd)
    # tensors that require grad are read through .detach()
    out, _ = mok_torch.forward(CFG, lw, sched, x.requires_grad_(), w, sg, su, sd, wg, wu, wd)
    assert out.shape == (T, 64)
