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
from mok_testing import synthetic
from mok_testing.sampled import covering_tokens, reference_tokens

DEV = "cpu" if SIM else "cuda"
GEMM = SIM_GEMM           # small tiles: quick in the simulator, the same on a GPU
CFG = MoKConfig(row_align=32, minibatch_size=64, capacity_factor=1.0)
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


def test_covering_tokens_reach_every_expert():
    """The GPU suite's float64 samples: the evenly spaced tokens, then each token that brings
    an expert no earlier pick reaches -- every expert the rank's tokens reach, no token twice."""
    shape = LayerShape(hidden=48, intermediate=32, shared_intermediate=0, num_experts=384,
                       topk=8)
    _, ids, _ = synthetic.rank_inputs(shape, 4096, 0, "cpu", masked=0.05, skew=0.5)
    pick = covering_tokens(ids, 24)
    assert pick.tolist() == sorted(set(pick.tolist()))
    assert set(torch.linspace(0, 4095, 24).long().tolist()) <= set(pick.tolist())
    reached = set(ids[pick].flatten().tolist()) - {-1}
    assert reached == set(ids.flatten().tolist()) - {-1}
    assert len(reached) > 300 and len(pick) < 1024      # a cover, not the whole batch
    lone = torch.full((10, 2), -1)
    lone[7] = torch.tensor([5, -1])                      # one token reaches expert 5
    assert covering_tokens(lone, 2).tolist() == [0, 7, 9]


def layer_weights(shape=SHAPE):
    return mok_torch.Weights(*synthetic.shared_weights(shape, DEV),
                             *synthetic.local_expert_weights(shape, 0, DEV))


@pytest.fixture(scope="module")
def ep1():
    """One EP = 1 layer and its forward, shared by the forward check and both backward cases
    (the backward leaves the context be) -> (layer, (x, ids, w), weights, out, ctx)."""
    T = 40
    x, ids, w = synthetic.rank_inputs(SHAPE, T, 0, DEV, masked=0.1, skew=0.5)
    W = layer_weights()
    layer = mok_torch.Layer(SHAPE, T, CFG, gemm=GEMM)
    out, ctx = layer.forward(x, ids, w, W)
    layer.check()
    return layer, (x, ids, w), W, out, ctx


def test_forward_ep1(ep1):
    layer, (x, ids, w), W, out, ctx = ep1
    T = x.shape[0]
    assert out.dtype == torch.bfloat16 and out.shape == (T, 64)
    want = full_reference(SHAPE, x, ids, w, weights=(W[:3], W[3:]))
    got = np64(out)
    assert np.isfinite(got).all()
    assert np.abs(got - want).sum() / np.abs(want).sum() < 5e-3
    assert ids.dtype == torch.int64
    assert torch.equal(layer(x, ids.int(), w, W), out)            # int32 ids: the same bits
    assert ctx.hidden is layer.hidden


@pytest.mark.parametrize("accumulate", [False, True])
def test_backward_ep1(ep1, accumulate):
    """``layer.backward``: fresh bf16 gradients (or the caller's float32 ones, accumulated),
    each of the 8 within 0.005 of float64."""
    from mok_testing.sampled import grad_errors
    layer, (x, ids, w), W, _, _ = ep1
    # test_forward_ep1 ran the layer again since: the forward's context, rebuilt
    ctx = layer.recompute_context(x, ids, w, W)
    T = x.shape[0]
    d_out = torch.randn(T, 64, generator=torch.Generator(DEV).manual_seed(5),
                        device=DEV).bfloat16()
    grads = None
    if accumulate:
        grads = mok_torch.Grads(torch.empty_like(x), torch.empty_like(w),
                                *(torch.zeros(a.shape, device=DEV) for a in W))
    G = layer.backward(ctx, d_out, w, W, grads=grads, accumulate=accumulate)
    layer.check()
    assert G.d_x.dtype == torch.bfloat16 and G.d_router_weights.dtype == torch.float32
    assert G.d_w_gate.dtype == (torch.float32 if accumulate else torch.bfloat16)
    errs = grad_errors([(x, ids, w)], [d_out], 0, G, W[:3],
                       lambda e: synthetic.expert_weights(SHAPE, e, DEV), SHAPE.experts_per_rank)
    assert len(errs) == 8 and all(e < 5e-3 for e in errs.values()), errs     # (NaN fails)


def test_inference_mode():
    """Tensors made under ``torch.inference_mode`` keep no version counter: the step runs on
    them (its key never matches a later step's) and equals the step on ordinary tensors."""
    T = 8
    x, ids, w = synthetic.rank_inputs(SHAPE, T, 0, DEV)
    W = layer_weights()
    layer = mok_torch.Layer(SHAPE, T, CFG, gemm=GEMM, backward=False)
    want = layer(x, ids, w, W)
    with torch.inference_mode():
        got = layer(x.clone(), ids.clone(), w.clone(), mok_torch.Weights(*(t.clone() for t in W)))
    assert torch.equal(got, want)


def test_torch_inputs_checked():
    T = 8
    x, ids, w = synthetic.rank_inputs(SHAPE, T, 0, DEV)
    W = layer_weights()
    layer = mok_torch.Layer(SHAPE, T, CFG, gemm=GEMM)
    before = layer.comm.x_buf.copy() if SIM else None
    with pytest.raises(TypeError, match="x: expected dtype torch.bfloat16, got torch.float32"):
        layer(x.float(), ids, w, W)
    with pytest.raises(ValueError, match="w_gate: must be contiguous"):
        layer(x, ids, w, W._replace(w_gate=W.w_gate.transpose(1, 2)))
    with pytest.raises(TypeError, match="router_weights: expected dtype torch.float32"):
        layer(x, ids, w.double(), W)
    with pytest.raises(TypeError, match="topk_ids: expected dtype torch.int64 or torch.int32"):
        layer(x, ids.float(), w, W)
    with pytest.raises(ValueError, match="w_up: expected shape"):
        layer(x, ids, w, W._replace(w_up=W.w_up[:1]))
    with pytest.raises(TypeError, match="x: expected a torch.Tensor, got ndarray"):
        layer(x.float().cpu().numpy(), ids, w, W)
    # the manual API records no autograd graph: a tensor that wants a gradient is refused, not
    # silently detached (layer(...) and mok_torch.moe take the autograd path)
    with pytest.raises(ValueError, match="x: requires_grad=True, but layer.forward / "
                                         "layer.backward are the manual API"):
        layer.forward(x.clone().requires_grad_(), ids, w, W)
    if SIM:
        np.testing.assert_array_equal(layer.comm.x_buf, before)        # nothing ran


def test_torch_backward_checks_its_context_and_grads():
    T = 8
    x, ids, w = synthetic.rank_inputs(SHAPE, T, 0, DEV)
    W = layer_weights()
    layer = mok_torch.Layer(SHAPE, T, CFG, gemm=GEMM)
    _, ctx = layer.forward(x, ids, w, W)
    d_out = torch.ones(T, SHAPE.hidden, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match="ctx: expected the ForwardContext .*got NoneType, on "
                                         "rank 0$"):
        layer.backward(None, d_out, w, W)
    with pytest.raises(ValueError, match="accumulate=True adds into caller-owned float32"):
        layer.backward(ctx, d_out, w, W, accumulate=True)
    with pytest.raises(TypeError, match="grads: expected 8 tensors"):
        layer.backward(ctx, d_out, w, W, grads=[d_out] * 7)
    other = mok_torch.Layer(SHAPE, T, CFG, gemm=GEMM)
    with pytest.raises(ValueError, match="ctx: the ForwardContext of another layer"):
        other.backward(ctx, d_out, w, W)
    layer.forward(x, ids, w, W)
    with pytest.raises(ValueError, match="ctx: the context of forward 1, but forward 2"):
        layer.backward(ctx, d_out, w, W)
    fresh = layer.backward(layer.context(), d_out, w, W)
    assert bool(torch.isfinite(fresh.d_x.float()).all()) and fresh.d_x.abs().sum() > 0
    with pytest.raises(TypeError, match="weights: expected 6 tensors"):
        mok_torch.quantize_weights(tuple(W)[3:])
    with torch.no_grad():
        assert layer(x.clone().requires_grad_(), ids, w, W).shape == (T, 64)


def test_fp8_forward_and_compiled_step():
    """``MoKConfig(precision="fp8")`` through torch (EP 1): the routed experts quantised by
    ``mok_torch.quantize_weights`` and passed in a ``WeightsFP8``; the output within 5e-3 of
    float64 of the same quantised operands (``layer_support.reference_out_fp8``), the
    compiled step bit-equal to the eager one, before and after ``set_weights`` hands it
    re-quantised weights."""
    from dataclasses import replace

    from layer_support import reference_out_fp8, rel_l1
    shape = LayerShape(hidden=128, intermediate=128, shared_intermediate=128, num_experts=2,
                       topk=2, ep_size=1)
    T = 8
    x, ids, w = synthetic.rank_inputs(shape, T, 0, DEV, masked=0.1)
    weights = layer_weights(shape)
    weights = mok_torch.WeightsFP8(*weights, mok_torch.quantize_weights(weights))
    layer = mok_torch.Layer(shape, T, replace(CFG, precision="fp8"), gemm=GEMM, backward=False)
    out = layer(x, ids, w, weights)
    f = lambda t: t.detach().float().cpu().numpy()                        # noqa: E731
    inp = dict(x=f(x)[None], ids=ids.cpu().numpy()[None], w=f(w)[None],
               **{k: f(t) for k, t in zip(("w_sg", "w_su", "w_sd", "w_g", "w_u", "w_d"),
                                          weights[:6])})
    assert rel_l1(np64(out), reference_out_fp8(inp)[0]) < 5e-3
    step = layer.compile(weights)
    assert torch.equal(step(x, ids, w), out)
    # an optimizer step: new bf16 weights, re-quantised, handed to the compiled step by name
    w_up = (weights.w_up.float() * 1.5).bfloat16()
    fp8 = mok_torch.quantize_weights(weights[:4] + (w_up, weights.w_down))
    step.set_weights(w_up=w_up, fp8=fp8)
    want = layer(x, ids, w, mok_torch.WeightsFP8(*weights[:4], w_up, weights.w_down, fp8))
    assert not torch.equal(want, out) and torch.equal(step(x, ids, w), want)


def test_fp8_layer_quantises_bf16_weights_once_per_update():
    """An FP8 layer given the six bf16 weights quantises the routed ones itself
    (``Layer.with_fp8``): forward, backward and the compiled step bit for bit what explicit
    ``WeightsFP8(*weights, quantize_weights(weights))`` give; once for any number of calls
    until a routed weight is updated in place (an optimizer step), then once again, the
    compiled step and the eager one reading the update."""
    from dataclasses import replace
    shape = LayerShape(hidden=128, intermediate=128, shared_intermediate=128, num_experts=2,
                       topk=2, ep_size=1)
    T = 8
    x, ids, w = synthetic.rank_inputs(shape, T, 0, DEV, masked=0.1)
    weights = layer_weights(shape)
    d_out = torch.randn(T, 128, generator=torch.Generator(DEV).manual_seed(3),
                        device=DEV).bfloat16()
    layer = mok_torch.Layer(shape, T, replace(CFG, precision="fp8"), gemm=GEMM)

    def explicit():
        return mok_torch.WeightsFP8(*weights, mok_torch.quantize_weights(weights))

    w8 = explicit()
    want, ctx = layer.forward(x, ids, w, w8)
    want_g = layer.backward(ctx, d_out, w, w8)
    out, ctx = layer.forward(x, ids, w, weights)
    g = layer.backward(ctx, d_out, w, weights)
    assert torch.equal(out, want) and layer.fp8_quantizations == 1
    assert all(torch.equal(a, b) for a, b in zip(g, want_g) if a is not None)
    step = layer.compile(weights)
    assert torch.equal(step(x, ids, w), want) and layer.fp8_quantizations == 1
    with torch.no_grad():                                # an optimizer step, in place
        weights.w_gate.mul_(1.5)
    out2 = step(x, ids, w)
    assert layer.fp8_quantizations == 2
    want2 = layer(x, ids, w, explicit())
    assert not torch.equal(want2, want) and torch.equal(out2, want2)
    assert torch.equal(layer(x, ids, w, weights), want2) and layer.fp8_quantizations == 2
    layer.check()
