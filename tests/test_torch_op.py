"""torch.ops.mok.moe_forward / moe_backward: the layer step and its gradients as torch custom ops
(EP = 1; the simulator on CPU tensors in CI, unchanged on one GPU): bit-equal to
``mok_torch.Layer``, the same under ``torch.compile``, registration checked by
``torch.library.opcheck``, clear errors."""
import pytest
import torch

import mok_torch
from mok_testing import synthetic
from test_torch_adapter import CFG, DEV, GEMM, SHAPE

T = 24


def _layer_and_handle():
    lw = mok_torch.Layer(SHAPE, T, CFG, gemm=GEMM)
    return lw, mok_torch.register_layer(lw)


@pytest.fixture(scope="module")
def layer():
    x, ids, w = synthetic.rank_inputs(SHAPE, T, 0, DEV, masked=0.1, skew=0.5)
    weights = mok_torch.Weights(*synthetic.shared_weights(SHAPE, DEV),
                                *synthetic.local_expert_weights(SHAPE, 0, DEV))
    lw, handle = _layer_and_handle()
    yield lw, handle, (x, ids, w), weights
    mok_torch.unregister_layer(handle)


def test_op_equals_forward(layer):
    """(The op runs the registered layer as it was built: its SwiGLU limit is the layer's, no
    argument of the op -- one layer, the module's, serves.)"""
    lw, handle, (x, ids, w), weights = layer
    want = lw(x, ids, w, weights)
    got = torch.ops.mok.moe_forward(x, ids, w, *weights, handle)
    lw.check()
    assert got.dtype == torch.bfloat16 and got.shape == (T, SHAPE.hidden)
    assert torch.equal(got, want)
    assert torch.equal(torch.ops.mok.moe_forward(x, ids.int(), w, *weights, handle), want)


def test_op_under_torch_compile(layer):
    lw, handle, (x, ids, w), weights = layer

    def block(x, ids, w, layer):                # a little torch around the op, as in a model
        h = x * 1.0
        return torch.ops.mok.moe_forward(h, ids, w, *weights, layer) + x

    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    want = block(x, ids, w, handle)
    assert torch.equal(compiled(x, ids, w, handle), want)
    # a second layer (its own workspace) through the same compiled function: the handle is
    # pinned per call, never a symbolic int the registry cannot look up
    _, handle2 = _layer_and_handle()
    try:
        assert torch.equal(compiled(x, ids, w, handle2), want)
        assert torch.equal(compiled(x, ids, w, handle), want)
    finally:
        mok_torch.unregister_layer(handle2)


def test_opcheck(layer):
    lw, handle, (x, ids, w), weights = layer
    torch.library.opcheck(torch.ops.mok.moe_forward.default,
                          (x, ids, w, *weights, handle),
                          test_utils=("test_schema", "test_faketensor",
                                      "test_aot_dispatch_dynamic"))


def test_op_errors(layer):
    lw, handle, (x, ids, w), weights = layer
    with pytest.raises(ValueError, match="no such layer"):
        torch.ops.mok.moe_forward(x, ids, w, *weights, 10 ** 9)
    with pytest.raises(TypeError, match="x: expected dtype torch.bfloat16"):
        torch.ops.mok.moe_forward(x.float(), ids, w, *weights, handle)
    with pytest.raises(TypeError, match="layer: expected a mok_torch.Layer"):
        mok_torch.register_layer(object())
    with pytest.raises(TypeError, match="d_out: expected dtype torch.bfloat16, got torch.float32"):
        torch.ops.mok.moe_backward(x.float(), x, ids, w, *weights, handle)


def test_autograd_equals_manual_backward(layer):
    """mok_torch.moe's gradients (the backward op, the layer's context of this very step) are
    Layer.backward's bit for bit; the backward op itself passes opcheck."""
    lw, handle, (x, ids, w), weights = layer
    out, ctx = lw.forward(x, ids, w, weights)
    d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).bfloat16()
    want = lw.backward(ctx, d_out.to(x.device), w, weights)
    leaves = [t.clone().requires_grad_() for t in (x, w, *weights)]
    got = mok_torch.moe(lw, leaves[0], ids, leaves[1], leaves[2:])
    assert torch.equal(got, out)
    got.backward(d_out.to(x.device))
    for leaf, g in zip(leaves, want):
        assert torch.equal(leaf.grad, g)
    torch.library.opcheck(torch.ops.mok.moe_forward.default,
                          (leaves[0], ids, leaves[1], *leaves[2:], handle),
                          test_utils=("test_autograd_registration",))
    torch.library.opcheck(torch.ops.mok.moe_backward.default,
                          (d_out.to(x.device), x, ids, w, *weights, handle),
                          test_utils=("test_faketensor",))
