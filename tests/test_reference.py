"""Checks the float64 NumPy MoE reference against an independent torch autograd implementation."""

import numpy as np
import pytest
import torch

from mok_core.reference import (
    MoEGrads,
    moe_backward,
    moe_forward,
    moe_forward_detailed,
    swiglu,
    swiglu_backward,
)

WEIGHT_NAMES = ("w_shared_gate", "w_shared_up", "w_shared_down", "w_gate", "w_up", "w_down")
GRAD_INPUTS = ("x", "router_weights") + WEIGHT_NAMES


def rel_err(a, b):
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    denom = np.linalg.norm(b)
    # Both sides exactly zero (e.g. an all-masked gradient) counts as a perfect match.
    if denom == 0.0:
        return float(np.linalg.norm(a))
    return float(np.linalg.norm(a - b) / denom)


def make_inputs(seed, n=64, h=48, i=32, i_s=32, e=6, k=3, scale=1.0, unused_expert=None, mask_frac=0.2):
    """Random MoE inputs with distinct experts per token, some masked routes and an optional idle expert."""
    rng = np.random.default_rng(seed)
    experts = np.array([x for x in range(e) if x != unused_expert])
    assert k <= len(experts)
    ids = np.stack([rng.permutation(experts)[:k] for _ in range(n)]).astype(np.int64)
    ids[rng.random((n, k)) < mask_frac] = -1
    ids[0, :] = -1  # one token with every route masked
    # Weight std chosen so pre-activations have std ~ `scale` regardless of H.
    ws = scale / np.sqrt(h)
    return dict(
        x=rng.standard_normal((n, h)),
        router_weights=rng.random((n, k)),
        topk_ids=ids,
        w_shared_gate=rng.standard_normal((i_s, h)) * ws,
        w_shared_up=rng.standard_normal((i_s, h)) * ws,
        w_shared_down=rng.standard_normal((h, i_s)) / np.sqrt(i_s),
        w_gate=rng.standard_normal((e, i, h)) * ws,
        w_up=rng.standard_normal((e, i, h)) * ws,
        w_down=rng.standard_normal((e, h, i)) / np.sqrt(i),
    )


def torch_moe(inp, swiglu_limit):
    """
    Plain slot-by-slot torch float64 implementation; returns (out, leaf tensors, pre-activations).

    The pre-activation list holds the (gate, up) values that actually reach the activation,
    so the caller can assert that the clamp is exercised.
    """
    leaves = {
        name: torch.tensor(inp[name], dtype=torch.float64, requires_grad=True) for name in GRAD_INPUTS
    }
    ids = torch.tensor(inp["topk_ids"])
    x = leaves["x"]

    def act(g, u):
        if swiglu_limit is not None:
            g = torch.clamp(g, max=swiglu_limit)
            u = torch.clamp(u, min=-swiglu_limit, max=swiglu_limit)
        return torch.nn.functional.silu(g) * u

    pre = []
    g_s = x @ leaves["w_shared_gate"].T
    u_s = x @ leaves["w_shared_up"].T
    pre.append((g_s.detach(), u_s.detach()))
    out = act(g_s, u_s) @ leaves["w_shared_down"].T

    for j in range(ids.shape[1]):
        e = ids[:, j]
        mask = e >= 0
        safe = e.clamp(min=0)
        g = torch.einsum("nh,nih->ni", x, leaves["w_gate"][safe])
        u = torch.einsum("nh,nih->ni", x, leaves["w_up"][safe])
        y = torch.einsum("ni,nhi->nh", act(g, u), leaves["w_down"][safe])
        pre.append((g.detach()[mask], u.detach()[mask]))
        contrib = leaves["router_weights"][:, j : j + 1] * y
        out = out + torch.where(mask[:, None], contrib, torch.zeros_like(contrib))
    return out, leaves, pre


CASES = [
    # (k, E, I_s): I_s != I (=32) in the k=3 case; E grows for k=8 so experts stay distinct per token.
    pytest.param(1, 6, 32, id="k1"),
    pytest.param(3, 6, 40, id="k3-Is40"),
    pytest.param(8, 10, 32, id="k8"),
]


@pytest.mark.parametrize("swiglu_limit", [None, 4.0], ids=["nolimit", "limit4"])
@pytest.mark.parametrize("k,e,i_s", CASES)
def test_matches_torch_autograd(k, e, i_s, swiglu_limit):
    unused = 2
    # Large pre-activations (std ~6) so that a limit of 4.0 is hit often.
    inp = make_inputs(seed=100 * k + e, k=k, e=e, i_s=i_s, scale=6.0, unused_expert=unused)
    ids = inp["topk_ids"]
    assert not (ids == unused).any()
    assert (ids == -1).any() and (ids >= 0).any()

    out_t, leaves, pre = torch_moe(inp, swiglu_limit)
    d_out = np.random.default_rng(7).standard_normal(out_t.shape)
    out_t.backward(torch.tensor(d_out))

    if swiglu_limit is not None:
        gates = torch.cat([g.reshape(-1) for g, _ in pre])
        ups = torch.cat([u.reshape(-1) for _, u in pre])
        gate_active = (gates > swiglu_limit).double().mean().item()
        up_active = (ups.abs() > swiglu_limit).double().mean().item()
        assert max(gate_active, up_active) > 0.05, (gate_active, up_active)

    out = moe_forward(**inp, swiglu_limit=swiglu_limit)
    assert out.dtype == np.float64 and out.shape == (64, 48)
    assert rel_err(out, out_t.detach().numpy()) < 1e-10

    det = moe_forward_detailed(**inp, swiglu_limit=swiglu_limit)
    np.testing.assert_array_equal(det.out, out)
    assert det.y_routed.shape == (64, k, 48)
    assert not det.y_routed[ids == -1].any()
    assert rel_err(det.gate_shared, pre[0][0].numpy()) < 1e-12
    assert rel_err(det.up_shared, pre[0][1].numpy()) < 1e-12
    assert rel_err(det.y_shared + np.einsum("nk,nkh->nh", inp["router_weights"], det.y_routed), out) < 1e-14

    grads = moe_backward(d_out, **inp, swiglu_limit=swiglu_limit)
    assert isinstance(grads, MoEGrads)
    expected = {
        "d_x": leaves["x"].grad,
        "d_router_weights": leaves["router_weights"].grad,
        **{"d_" + name: leaves[name].grad for name in WEIGHT_NAMES},
    }
    assert set(expected) == set(MoEGrads._fields)
    for name, ref in expected.items():
        got = getattr(grads, name)
        assert got.dtype == np.float64, name
        assert got.shape == tuple(ref.shape), name
        err = rel_err(got, ref.numpy())
        assert err < 1e-10, (name, err)

    assert not grads.d_router_weights[ids == -1].any()
    for name in ("d_w_gate", "d_w_up", "d_w_down"):
        assert not getattr(grads, name)[unused].any(), name


def test_duplicate_expert_in_one_token_matches_torch():
    # Not a DeepSeek routing pattern, but the reference must still be exact if it happens.
    inp = make_inputs(seed=3, k=3, e=3, mask_frac=0.1)
    rng = np.random.default_rng(4)
    inp["topk_ids"] = np.where(inp["topk_ids"] >= 0, rng.integers(0, 3, inp["topk_ids"].shape), -1)
    assert any(len(set(r[r >= 0])) < (r >= 0).sum() for r in inp["topk_ids"])
    out_t, leaves, _ = torch_moe(inp, 4.0)
    d_out = rng.standard_normal(out_t.shape)
    out_t.backward(torch.tensor(d_out))
    assert rel_err(moe_forward(**inp, swiglu_limit=4.0), out_t.detach().numpy()) < 1e-10
    grads = moe_backward(d_out, **inp, swiglu_limit=4.0)
    assert rel_err(grads.d_x, leaves["x"].grad.numpy()) < 1e-10
    assert rel_err(grads.d_w_gate, leaves["w_gate"].grad.numpy()) < 1e-10


def test_swiglu_clamp_gradient_matches_torch_at_boundaries():
    limit = 2.0
    vals = np.array([-3.0, -2.0, -1.0, 0.0, 1.5, 2.0, 2.5, -2.5])
    gate, up = np.meshgrid(vals, vals, indexing="ij")
    d_h = np.random.default_rng(0).standard_normal(gate.shape)

    g_t = torch.tensor(gate, requires_grad=True)
    u_t = torch.tensor(up, requires_grad=True)
    h_t = torch.nn.functional.silu(torch.clamp(g_t, max=limit)) * torch.clamp(u_t, min=-limit, max=limit)
    h_t.backward(torch.tensor(d_h))

    np.testing.assert_allclose(swiglu(gate, up, limit), h_t.detach().numpy(), rtol=1e-14, atol=1e-15)
    d_gate, d_up = swiglu_backward(gate, up, d_h, limit)
    np.testing.assert_allclose(d_gate, g_t.grad.numpy(), rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(d_up, u_t.grad.numpy(), rtol=1e-13, atol=1e-15)
    # Equality with the bound passes gradient (like torch.clamp); strictly beyond it does not.
    assert (d_gate[vals == 2.0] != 0).any() and not d_gate[vals == 2.5].any()
    assert (d_up[:, vals == -2.0] != 0).any() and not d_up[:, vals == -3.0].any()


def test_swiglu_extreme_inputs_are_finite():
    gate = np.array([-1e4, -800.0, 0.0, 800.0, 1e4])
    # Underflow to 0 is expected and harmless; overflow or NaN production is not.
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        h = swiglu(gate, np.ones_like(gate))
        d_gate, d_up = swiglu_backward(gate, np.ones_like(gate), np.ones_like(gate))
    assert np.isfinite(h).all() and np.isfinite(d_gate).all() and np.isfinite(d_up).all()
    # and right: SiLU's limits (0 far below, g far above; its slope 0 and 1 there, 1/2 at 0)
    np.testing.assert_allclose(h, [0, 0, 0, 800, 1e4], atol=1e-300)
    np.testing.assert_allclose(d_gate, [0, 0, 0.5, 1, 1], atol=1e-300)
    np.testing.assert_array_equal(d_up, h)


def test_accepts_lower_precision_inputs():
    inp = make_inputs(seed=5)
    low = {k: (v.astype(np.float32) if v.dtype.kind == "f" else v.astype(np.int32)) for k, v in inp.items()}
    out = moe_forward(**low)
    assert out.dtype == np.float64
    ref = moe_forward(**{k: (v.astype(np.float64) if v.dtype.kind == "f" else v) for k, v in low.items()})
    np.testing.assert_array_equal(out, ref)


# --------------------------------------------------------------------------- #
# Masked routes
# --------------------------------------------------------------------------- #


def test_masked_routes_contribute_nothing():
    inp = make_inputs(seed=11, k=3, e=6)
    # Mask every route to expert 4, so that expert is referenced by no live route at all.
    inp["topk_ids"][inp["topk_ids"] == 4] = -1
    ids = inp["topk_ids"]
    masked = ids == -1
    assert masked.sum() > 5
    base = moe_forward(**inp, swiglu_limit=4.0)

    perturbed = dict(inp)
    perturbed["router_weights"] = np.where(masked, 1e3, inp["router_weights"])
    for name in ("w_gate", "w_up", "w_down"):
        w = inp[name].copy()
        w[4] = 1e2
        perturbed[name] = w
    np.testing.assert_array_equal(moe_forward(**perturbed, swiglu_limit=4.0), base)

    # A masked route is equivalent to a live route with router weight 0, whatever its expert.
    zero_weighted = dict(inp)
    zero_weighted["topk_ids"] = np.where(masked, 4, ids)
    zero_weighted["router_weights"] = np.where(masked, 0.0, inp["router_weights"])
    np.testing.assert_allclose(moe_forward(**zero_weighted, swiglu_limit=4.0), base, rtol=1e-13, atol=1e-13)

    grads = moe_backward(np.ones_like(base), **perturbed, swiglu_limit=4.0)
    assert not grads.d_router_weights[masked].any()
    assert not grads.d_w_gate[4].any() and not grads.d_w_up[4].any() and not grads.d_w_down[4].any()


def test_all_masked_is_shared_expert_only():
    inp = make_inputs(seed=12, k=2)
    inp["topk_ids"][:] = -1
    det = moe_forward_detailed(**inp)
    np.testing.assert_array_equal(det.out, det.y_shared)
    np.testing.assert_array_equal(det.y_shared, det.hidden_shared @ inp["w_shared_down"].T)


# --------------------------------------------------------------------------- #
# Validation
# --------------------------------------------------------------------------- #


def _bad(seed=21, **changes):
    inp = make_inputs(seed=seed, k=3, e=6)
    inp.update(changes)
    return inp


@pytest.mark.parametrize("fn", ["forward", "backward"])
@pytest.mark.parametrize(
    "mutate,match",
    [
        pytest.param(lambda d: d["topk_ids"].__setitem__((1, 0), 6), r"topk_ids.*< E=6", id="id-eq-E"),
        pytest.param(lambda d: d["topk_ids"].__setitem__((1, 0), -2), r"topk_ids.*>= -1", id="id-minus-2"),
        pytest.param(lambda d: d["x"].__setitem__((3, 3), np.nan), r"^x contains non-finite", id="nan-x"),
        pytest.param(lambda d: d["w_up"].__setitem__((0, 0, 0), np.inf), r"^w_up contains non-finite", id="inf-w_up"),
        pytest.param(
            lambda d: d["router_weights"].__setitem__((0, 0), np.nan), r"^router_weights contains", id="nan-rw"
        ),
        pytest.param(lambda d: d.update(w_down=d["w_down"][:, :, :-1]), r"^w_down has shape", id="shape-w_down"),
        pytest.param(
            lambda d: d.update(w_shared_up=d["w_shared_up"][:-1]), r"^w_shared_up has shape", id="shape-shared"
        ),
        pytest.param(
            lambda d: d.update(router_weights=d["router_weights"][:, :2]), r"^router_weights has shape", id="shape-rw"
        ),
        pytest.param(lambda d: d.update(topk_ids=d["topk_ids"][:-1]), r"^topk_ids must have shape", id="shape-ids"),
        pytest.param(lambda d: d.update(x=d["x"][None]), r"^x must be 2-D", id="ndim-x"),
        pytest.param(
            lambda d: d.update(topk_ids=d["topk_ids"].astype(np.float64)), r"topk_ids must have an integer", id="float-ids"
        ),
    ],
)
def test_invalid_inputs_raise(fn, mutate, match):
    inp = _bad()
    mutate(inp)
    with pytest.raises(ValueError, match=match):
        if fn == "forward":
            moe_forward(**inp)
        else:
            moe_backward(np.zeros((64, 48)), **inp)


@pytest.mark.parametrize("limit", [0.0, -1.0, float("nan")])
def test_nonpositive_swiglu_limit_raises(limit):
    with pytest.raises(ValueError, match="swiglu_limit"):
        moe_forward(**_bad(), swiglu_limit=limit)
    with pytest.raises(ValueError, match="swiglu_limit"):
        swiglu(np.zeros(3), np.zeros(3), limit)


def test_bad_d_out_raises():
    inp = _bad()
    with pytest.raises(ValueError, match=r"^d_out has shape"):
        moe_backward(np.zeros((64, 47)), **inp)
    d_out = np.zeros((64, 48))
    d_out[0, 0] = np.nan
    with pytest.raises(ValueError, match=r"^d_out contains non-finite"):
        moe_backward(d_out, **inp)
