"""Device-side problems reach the caller by themselves (``mok_core.step_errors``): the next call
on the layer raises ``MoKError`` naming the step, flags are per step (a clean step after a bad
one passes), ``errors="sync"`` raises at the step itself, ``errors="trap"`` stops it, and a
capacity overflow is reported, never a silently wrong output. Simulator in CI; unchanged on one
GPU (where "trap" is not run: it kills the CUDA context)."""
from dataclasses import replace

import numpy as np
import pytest
import torch

import mok_torch
from layer_support import layer_inputs, reference_out, rel_l1
from mok_comm.emulation import emulated_layers
from mok_core.config import LayerShape, MoKConfig
from mok_core.cuda_compat import SIM
from mok_core.errors import MoKError
from mok_core.gemm import SIM_GEMM
from mok_testing import synthetic
from test_layer_emulated import as_f64, run_layer

DEV = "cpu" if SIM else "cuda"
CFG = MoKConfig(row_align=32, minibatch_size=64)
SHAPE = LayerShape(hidden=64, intermediate=32, shared_intermediate=32, num_experts=4, topk=2,
                   ep_size=1)
T = 16


def _setup(cfg=CFG):
    layer = mok_torch.Layer(SHAPE, T, cfg, gemm=SIM_GEMM)
    W = mok_torch.Weights(*synthetic.shared_weights(SHAPE, DEV),
                          *synthetic.local_expert_weights(SHAPE, 0, DEV))
    x, ids, w = synthetic.rank_inputs(SHAPE, T, 0, DEV)
    return layer, W, x, ids, w


def test_deferred_error_raised_by_the_next_call_then_cleared():
    layer, W, x, ids, w = _setup()
    bad = x.clone()
    bad[5, 3] = float("nan")
    layer(x, ids, w, W)                                   # step 1: clean
    layer(bad, ids, w, W)                                 # step 2: NaN -- no raise, no sync
    with pytest.raises(MoKError, match=r"step 2 of this layer \(rank 0\): non-finite input"):
        layer(x, ids, w, W)                               # step 3 is refused before launching
    out = layer(x, ids, w, W)                             # step 3: clean -> flags were reset
    layer.check()
    assert torch.equal(out, layer(x, ids, w, W))
    layer.check()


def test_check_waits_and_reports_the_step():
    layer, W, x, ids, w = _setup()
    ids = ids.clone()
    ids[2, 1] = SHAPE.num_experts                         # out of range
    layer(x, ids, w, W)
    with pytest.raises(MoKError, match=r"step 1 of this layer.*expert id out of range"):
        layer.check()
    layer.check()                                         # consumed: nothing left to report


def test_sync_mode_raises_at_the_step():
    layer, W, x, ids, w = _setup(replace(CFG, errors="sync"))
    bad = x.clone()
    bad[0, 0] = float("inf")
    with pytest.raises(MoKError, match=r"step 1 of this layer.*non-finite"):
        layer(bad, ids, w, W)
    layer(x, ids, w, W)                                   # the next clean step passes


@pytest.mark.skipif(not SIM, reason="a trap kills the CUDA context")
def test_trap_mode_stops_the_step():
    layer, W, x, ids, w = _setup(replace(CFG, errors="trap"))
    bad = x.clone()
    bad[1, 1] = float("nan")
    with pytest.raises(MoKError, match="non-finite"):
        layer(bad, ids, w, W)


def test_compiled_step_reports_the_same_way():
    layer, W, x, ids, w = _setup()
    step = layer.compile(W)
    step(x, ids, w)
    bad = x.clone()
    bad[7, 0] = float("nan")
    step(bad, ids, w)
    with pytest.raises(MoKError, match=r"step 2 of this layer.*non-finite"):
        step(x, ids, w)
    step(x, ids, w)
    layer.check()


def test_many_steps_keep_the_ring_bounded(monkeypatch):
    """More steps than ring slots between two checks (a 2-slot ring here, 64 by default): the
    bad step's report lands in a slot used before, and is read from there."""
    from mok_core import step_errors
    monkeypatch.setattr(step_errors, "SLOTS", 2)
    layer, W, x, ids, w = _setup()
    step = layer.compile(W)
    bad = x.clone()
    bad[0, 0] = float("nan")
    for i in range(4):
        if i == 2:                                        # step 3 (slot 1 again) goes bad
            with pytest.raises(MoKError, match="step 3 of this layer"):
                step(bad, ids, w)
                step(x, ids, w)
                layer.check()
        else:
            step(x, ids, w)
        assert len(layer.errors.pending) <= 2
    layer.check()
    assert not layer.errors.pending


def test_capacity_overflow_reported_not_silent():
    """A lowered capacity_factor at EP 4 with every route on one rank: the step reports the
    overflow (the default 1.0 holds that routing: same routing, correct output)."""
    R, T4 = 4, 16
    shape = LayerShape(hidden=64, intermediate=32, shared_intermediate=32, num_experts=4,
                       topk=2, ep_size=R)
    inp = layer_inputs(np.random.default_rng(3), shape, T4, masked=0.0)
    inp["ids"][..., 0], inp["ids"][..., 1] = 0, 0         # everything on rank 0's expert 0
    low = replace(CFG, capacity_factor=0.25)
    with pytest.raises(MoKError, match=r"step 1 of this layer \(rank 0\).*capacity overflow"):
        run_layer(emulated_layers(shape, T4, low, SIM_GEMM), inp)
    got = run_layer(emulated_layers(shape, T4, CFG, SIM_GEMM), inp)
    assert rel_l1(as_f64(got), reference_out(inp)) < 5e-3


def test_errors_field_checked():
    with pytest.raises(ValueError, match="errors='loud'"):
        MoKConfig(errors="loud")


def test_nbytes_by_buffer():
    layer, *_ = _setup()
    sizes = layer.nbytes
    assert sizes["x_recv (symmetric)"] == T * SHAPE.hidden * 2
    assert sizes["hidden"] == layer.comm.capacity * SHAPE.intermediate * 2
    assert all(v > 0 for v in sizes.values())
