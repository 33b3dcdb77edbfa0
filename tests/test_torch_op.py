"""torch.ops.mok.moe_forward: the layer step as a torch custom op (EP = 1; the simulator on CPU
tensors in CI, unchanged on one GPU): bit-equal to ``mok_torch.forward``, the same under
``torch.compile``, registration checked by ``torch.library.opcheck``, clear errors."""
import pytest
import torch

import mok_torch
from mok_torch import synthetic
from test_torch_adapter import CFG, DEV, GEMM, SHAPE

T = 24


@pytest.fixture(scope="module")
def layer():
    x, ids, w = synthetic.rank_inputs(SHAPE, T, 0, DEV, masked=0.1, skew=0.5)
    weights = (*synthetic.shared_weights(SHAPE, DEV), *synthetic.local_expert_weights(SHAPE, 0,
                                                                                      DEV))
    lw = mok_torch.get_workspace(SHAPE, T, CFG, gemm=GEMM)
    handle = mok_torch.register_layer(CFG, lw)
    yield lw, handle, (x, ids, w), weights
    mok_torch.unregister_layer(handle)


def _eager(lw, inputs, weights, limit=None):
    x, ids, w = inputs
    sched = mok_torch.build_schedule(lw, ids)
    return mok_torch.forward(CFG, lw, sched, x, w, *weights, swiglu_limit=limit)[0]


@pytest.mark.parametrize("limit", [None, 0.5])
def test_op_equals_forward(layer, limit):
    lw, handle, (x, ids, w), weights = layer
    want = _eager(lw, (x, ids, w), weights, limit)
    got = torch.ops.mok.moe_forward(x, ids, w, *weights, handle, limit)
    lw.check()
    assert got.dtype == torch.bfloat16 and got.shape == (T, SHAPE.hidden)
    assert torch.equal(got, want)
    assert torch.equal(torch.ops.mok.moe_forward(x, ids.int(), w, *weights, handle, limit), want)


def test_op_under_torch_compile(layer):
    lw, handle, (x, ids, w), weights = layer

    def block(x, ids, w, layer):                # a little torch around the op, as in a model
        h = x * 1.0
        return torch.ops.mok.moe_forward(h, ids, w, *weights, layer, None) + x

    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    want = block(x, ids, w, handle)
    assert torch.equal(compiled(x, ids, w, handle), want)
    assert torch.equal(compiled(x, ids, w, handle), want)
    # a second layer (its own workspace) through the same compiled function: the handle is
    # pinned per call, never a symbolic int the registry cannot look up
    lw2 = mok_torch.get_workspace(SHAPE, T, CFG, gemm=GEMM)
    handle2 = mok_torch.register_layer(CFG, lw2)
    try:
        assert torch.equal(compiled(x, ids, w, handle2), want)
        assert torch.equal(compiled(x, ids, w, handle), want)
    finally:
        mok_torch.unregister_layer(handle2)


def test_opcheck(layer):
    lw, handle, (x, ids, w), weights = layer
    torch.library.opcheck(torch.ops.mok.moe_forward.default,
                          (x, ids, w, *weights, handle, None),
                          test_utils=("test_schema", "test_faketensor",
                                      "test_aot_dispatch_dynamic"))


def test_op_errors(layer):
    lw, handle, (x, ids, w), weights = layer
    with pytest.raises(ValueError, match="no such layer"):
        torch.ops.mok.moe_forward(x, ids, w, *weights, 10 ** 9, None)
    with pytest.raises(TypeError, match="x: expected dtype torch.bfloat16"):
        torch.ops.mok.moe_forward(x.float(), ids, w, *weights, handle, None)
    wg = weights[3].clone().requires_grad_(True)
    out = torch.ops.mok.moe_forward(x, ids, w, *weights[:3], wg, *weights[4:], handle, None)
    with pytest.raises(RuntimeError, match="no autograd formula"):
        out.float().sum().backward()
