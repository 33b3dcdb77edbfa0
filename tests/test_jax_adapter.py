"""mok_jax_adapter: jax arrays through the layer in one XLA buffer callback, inside and outside
``jax.jit`` (EP = 1; the simulator on JAX's CPU backend in CI, unchanged on one GPU), against
the float64 reference and bit for bit against ``mok_comm.functional`` on the same inputs;
``jax.grad`` through it (``jax.custom_vjp``) bit for bit against ``mok_comm.backward``."""
import os

import numpy as np
import pytest

from helpers import to_dev
from layer_support import layer_inputs, reference_out, rel_l1
from mok_comm import backward as B
from mok_comm import functional as F
from mok_comm.heap import LocalHeap
from mok_comm.layer import FP8Weights, Layer, Weights, WeightsFP8, quantize_weights
from mok_core.config import LayerShape, MoKConfig
from mok_core.cuda_compat import SIM, to_host
from mok_core.errors import MoKError
from mok_core.gemm import SIM_GEMM
from mok_core.reference import moe_backward

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")   # leave the GPU to the rest
jax = pytest.importorskip("jax") if not SIM else __import__("jax")   # CI installs it (README)
if SIM:
    jax.config.update("jax_platforms", "cpu")        # the simulator's "device" is the host
else:
    if "LOCAL_RANK" in os.environ:      # one process per GPU (torchrun): JAX on this one only
        jax.config.update("jax_cuda_visible_devices", os.environ["LOCAL_RANK"])
    if jax.default_backend() != "gpu":
        pytest.skip("GPU run: this jax has no GPU backend", allow_module_level=True)
import jax.numpy as jnp  # noqa: E402

import mok_jax_adapter  # noqa: E402

GEMM = SIM_GEMM
CFG = MoKConfig(row_align=32, minibatch_size=64, capacity_factor=1.0)
SHAPE = LayerShape(hidden=64, intermediate=32, shared_intermediate=32, num_experts=4, topk=2,
                   ep_size=1)
NO_SHARED = LayerShape(hidden=64, intermediate=32, shared_intermediate=0, num_experts=4, topk=2,
                       ep_size=1)
NAMES = ("w_sg", "w_su", "w_sd", "w_g", "w_u", "w_d")
T = 40


def _jax_args(inp):
    """(x, topk_ids, router_weights, Weights) as jax arrays: rank 0's of ``layer_inputs``."""
    return (jnp.asarray(inp["x"][0]), jnp.asarray(inp["ids"][0].astype(np.int32)),
            jnp.asarray(inp["w"][0]), mok_jax_adapter.Weights(*(jnp.asarray(inp[n])
                                                                for n in NAMES)))


def _inputs(seed=0, limit=None, shape=SHAPE, t=T):
    inp = layer_inputs(np.random.default_rng(seed), shape, t,
                       weight_scale=3.0 if limit else 1.0)
    return inp, _jax_args(inp)


def _cotangent(seed, t, hidden):
    """A d_out c [t, hidden] in bf16 (NumPy) and its exact float32 (jax): sum(out * c) has
    gradient c."""
    c = np.asarray(np.random.default_rng(seed).standard_normal((t, hidden)),
                   np.float32).astype(jnp.bfloat16)
    return c, jnp.asarray(c.astype(np.float32))


def _bits(a):
    return np.asarray(a).view(np.uint16)


# limit None only: the clamp through the JAX layer is test_grad_matches_backward_and_reference's
# (limit 1.0, weights scaled so it bites: gradients bit for bit mok_comm's, float64 within 1e-2)
# and test_forward_without_shared_expert's (a NumPy-scalar limit, forward against float64)
@pytest.mark.parametrize("limit", [None])
def test_forward_matches_reference_and_functional(limit):
    inp, args = _inputs(1, limit)
    layer = mok_jax_adapter.Layer(SHAPE, T, CFG, gemm=GEMM, swiglu_limit=limit)
    step = jax.jit(layer)
    out = step(*args)
    layer.check(out)
    assert out.dtype == jnp.bfloat16 and out.shape == (T, SHAPE.hidden)
    got = np.asarray(out).astype(np.float64)
    assert np.isfinite(got).all()
    assert rel_l1(got, reference_out(inp, limit)[0]) < 5e-3
    # the same bits as the framework-neutral layer on the same inputs ...
    plain = Layer(SHAPE, T, CFG, gemm=GEMM, heap=LocalHeap(0), swiglu_limit=limit)
    want = plain(to_dev(_bits(inp["x"][0])), to_dev(inp["ids"][0].astype(np.int32)),
                 to_dev(inp["w"][0]),
                 Weights(*(to_dev(_bits(inp[n])) for n in ("w_sg", "w_su", "w_sd", "w_g", "w_u",
                                                           "w_d"))))
    np.testing.assert_array_equal(_bits(out), to_host(want).view(np.uint16))
    # ... again under jit, and eagerly (outside jit) -- deterministic; the outputs kept alive,
    # so each call writes a buffer of its own
    again = step(*args)
    eager = layer(*args)
    for o in (again, eager):
        np.testing.assert_array_equal(_bits(o), _bits(out))
    # one buffer callback per layer and token count: JAX compiles an eager call once
    assert layer._call(T) is layer._call(T)


def test_forward_without_shared_expert():
    shape = NO_SHARED
    inp, args = _inputs(5, shape=shape)
    layer = mok_jax_adapter.Layer(shape, T, CFG, gemm=GEMM,
                                  swiglu_limit=np.float32(4.0))      # a NumPy scalar is taken
    out = layer(*args)
    layer.check(out)
    got = np.asarray(out).astype(np.float64)
    assert rel_l1(got, reference_out(inp, 4.0)[0]) < 5e-3


def test_jax_inputs_checked():
    _, (x, ids, w, W) = _inputs(2)
    layer = mok_jax_adapter.Layer(SHAPE, T, CFG, gemm=GEMM)
    with pytest.raises(TypeError, match="x: expected dtype bfloat16, got float32"):
        layer(x.astype(jnp.float32), ids, w, W)
    with pytest.raises(TypeError, match="router_weights: expected dtype float32"):
        layer(x, ids, w.astype(jnp.bfloat16), W)
    with pytest.raises(TypeError, match="topk_ids: expected dtype int32"):
        layer(x, ids.astype(jnp.float32), w, W)
    with pytest.raises(ValueError, match=r"w_gate: expected shape \(4, 32, 64\)"):
        layer(x, ids, w, W._replace(w_gate=W.w_gate[:, :16]))
    with pytest.raises(TypeError, match="weights: expected 6 tensors"):
        layer(x, ids, w, tuple(W)[:5])
    with pytest.raises(ValueError, match=r"topk_ids: expected shape \(8, 2\), got \(40, 2\)"):
        jax.jit(layer)(x[:8], ids, w, W)             # fewer tokens: the others must follow
    with pytest.raises(ValueError, match=r"x: 41 tokens on rank 0, but the layer holds at most "
                                         r"tokens_per_rank=40"):
        layer(jnp.concatenate([x, x[:1]]), ids, w, W)
    with pytest.raises(ValueError, match=r"x: expected shape \(40, 64\), got \(40, 32\)"):
        jax.jit(layer)(x[:, :32], ids, w, W)
    with pytest.raises(ValueError, match="swiglu_limit=-1.0"):
        mok_jax_adapter.Layer(SHAPE, T, CFG, gemm=GEMM, swiglu_limit=-1.0)
    with pytest.raises(TypeError, match="w_shared_up: expected a jax.Array, got NoneType"):
        layer(x, ids, w, W._replace(w_shared_up=None))         # None only when I_s = 0
    # under jax.grad: the same checks, when traced
    loss = lambda x, w, W: jnp.sum(layer(x, ids, w, W).astype(jnp.float32))  # noqa: E731
    with pytest.raises(TypeError, match="w_down: expected dtype bfloat16, got float32"):
        jax.grad(loss, argnums=(0, 1, 2))(x, w, W._replace(w_down=W.w_down.astype(jnp.float32)))
    with pytest.raises(ValueError, match=r"router_weights: expected shape \(40, 2\), got "
                                         r"\(40, 3\)"):
        jax.jit(jax.grad(loss))(x, jnp.ones((T, 3), jnp.float32), W)
    # a forward-only layer refuses to be differentiated (when traced), and still runs forward
    infer = mok_jax_adapter.Layer(SHAPE, T, CFG, gemm=GEMM, backward=False)
    assert infer.grad is None
    with pytest.raises(ValueError, match="built with backward=False"):
        jax.grad(lambda x: jnp.sum(infer(x, ids, w, W).astype(jnp.float32)))(x)


def test_out_of_range_expert_id_is_reported():
    _, (x, ids, w, W) = _inputs(3)
    layer = mok_jax_adapter.Layer(SHAPE, T, CFG, gemm=GEMM)
    bad = ids.at[5, 1].set(SHAPE.num_experts)             # one id past the last expert
    out = layer(x, bad, w, W)
    with pytest.raises(MoKError, match=r"expert id out of range on rank 0: topk_ids\[5, 1\] = 4 "
                                       r"\(valid: 0\.\.3 or -1 for a masked route\); 1 bad id "
                                       r"in all, that route was skipped$"):
        layer.check(out)


def _functional_grads(inp, d_out, shape, limit, config=CFG, t=T, out=None):
    """``mok_comm``'s forward + backward on the same inputs: the 8 gradients on the host (FP8:
    the weights quantised by ``mok_comm.layer.quantize_weights``); ``out`` (a list): gets the
    forward's output bits."""
    plain = Layer(shape, t, config, gemm=GEMM, heap=LocalHeap(0), swiglu_limit=limit)
    W = Weights(*(None if i < 3 and not shape.shared_intermediate else to_dev(_bits(inp[n]))
                  for i, n in enumerate(NAMES)))
    if config.precision == "fp8":
        W = WeightsFP8(*W, quantize_weights(W))
    w = to_dev(inp["w"][0])
    y, ctx = F.forward(plain, to_dev(_bits(inp["x"][0])), to_dev(inp["ids"][0].astype(np.int32)),
                       w, W)
    if out is not None:
        out.append(to_host(y).view(np.uint16))
    G = B.backward(plain, ctx, to_dev(_bits(d_out)), w, W)
    plain.check()
    return [None if g is None else to_host(g) for g in G]


@pytest.mark.parametrize("shape, limit", [(SHAPE, None), (NO_SHARED, 1.0)],
                         ids=["shared", "no-shared-limit"])
def test_grad_matches_backward_and_reference(shape, limit):
    """jax.grad of sum(out * c) through jax.jit(layer): d_x, d_router_weights and the weight
    gradients bit for bit mok_comm.backward's with d_out = c (bf16), within 1e-2 of float64.
    No shared expert: its weights None (or [0, .]), and so their gradients."""
    inp, (x, ids, w, W) = _inputs(6, limit, shape=shape)
    c, c32 = _cotangent(7, T, shape.hidden)                    # d_out: c in bf16, exactly
    if not shape.shared_intermediate:
        W = W._replace(w_shared_gate=None, w_shared_up=None, w_shared_down=None)
    layer = mok_jax_adapter.Layer(shape, T, CFG, gemm=GEMM, swiglu_limit=limit)
    step = jax.jit(layer)

    def loss(x, w, W):
        return jnp.sum(step(x, ids, w, W).astype(jnp.float32) * c32)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    d_x, d_w, d_W = grad(x, w, W)
    layer.check((d_x, d_w, d_W))
    assert d_x.dtype == jnp.bfloat16 and d_w.dtype == jnp.float32
    assert all(g.dtype == jnp.bfloat16 for g in d_W if g is not None)
    got = [d_x, d_w, *d_W]          # Grads' order
    want = _functional_grads(inp, c, shape, limit)
    for name, a, b in zip(B.Grads._fields, got, want):
        if b is None:                       # no shared expert: no gradient (the input is None)
            assert a is None, name
            continue
        np.testing.assert_array_equal(np.asarray(a).view(b.dtype), b, err_msg=name)
    assert (np.asarray(d_w)[inp["ids"][0] < 0] == 0).all()      # masked routes

    f = lambda a: np.asarray(a).astype(np.float64)  # noqa: E731
    ref = moe_backward(f(c), f(inp["x"][0]), f(inp["w"][0]), inp["ids"][0],
                       *(f(inp[n]) for n in NAMES), swiglu_limit=limit)
    for name in B.Grads._fields:
        r = getattr(ref, name)
        g = got[B.Grads._fields.index(name)]
        if r.size:
            assert rel_l1(f(g), r) < 1e-2, name

    if not shape.shared_intermediate:       # [0, .] shared weights instead of None: [0, .] grads
        W0 = W._replace(**{n: jnp.zeros(s, jnp.bfloat16) for n, s in zip(
            Weights._fields[:3], ((0, shape.hidden), (0, shape.hidden), (shape.hidden, 0)))})
        d_W0 = jax.eval_shape(jax.grad(loss, argnums=2), x, w, W0)
        assert [(a.shape, a.dtype) for a in d_W0] == [(a.shape, a.dtype) for a in W0]


def test_grad_when_the_layer_ran_again_before_its_backward():
    """The layer's second call (other tokens) is forced between the first's forward and
    backward -- its input is the first's output, the first's d_out its output -- so the
    first's context in the layer is gone: the backward recomputes it, and the gradients are
    still bit for bit mok_comm.backward's for that d_out."""
    inp, (x, ids, w, W) = _inputs(8)
    layer = mok_jax_adapter.Layer(SHAPE, T, CFG, gemm=GEMM)

    def loss(x, w, W):
        out = layer(x, ids, w, W)
        again = layer(*jax.lax.stop_gradient((out[::-1], ids[::-1], w[::-1], W)))
        d_out = jax.lax.stop_gradient(again)
        return jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32)), d_out

    grads, d_out = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(x, w, W)
    layer.check((grads, d_out))
    want = _functional_grads(inp, np.asarray(d_out), SHAPE, None)
    for name, a, b in zip(B.Grads._fields, jax.tree_util.tree_leaves(grads), want):
        np.testing.assert_array_equal(np.asarray(a).view(b.dtype), b, err_msg=name)


def test_variable_tokens():
    """A layer built for T_max = 40 takes a step of 17 tokens (a trace and a callback of its
    own): the output within 5e-3 of float64 on those tokens, jax.grad bit for bit the
    functional path's at 17 tokens."""
    t = 17
    inp, _ = _inputs(9)
    inp = {n: a[:, :t] if n in ("x", "ids", "w") else a for n, a in inp.items()}
    x, ids, w, W = _jax_args(inp)
    c, c32 = _cotangent(10, t, SHAPE.hidden)
    layer = mok_jax_adapter.Layer(SHAPE, T, CFG, gemm=GEMM)
    step = jax.jit(layer)

    def loss(x, w, W):
        return jnp.sum(step(x, ids, w, W).astype(jnp.float32) * c32)

    out = step(x, ids, w, W)
    d_x, d_w, d_W = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, w, W)
    layer.check((out, d_x, d_w, d_W))
    assert out.shape == (t, SHAPE.hidden) and d_x.shape == (t, SHAPE.hidden)
    assert rel_l1(np.asarray(out).astype(np.float64), reference_out(inp)[0]) < 5e-3
    for name, a, b in zip(B.Grads._fields, [d_x, d_w, *d_W],
                          _functional_grads(inp, c, SHAPE, None)):
        np.testing.assert_array_equal(np.asarray(a).view(b.dtype), b, err_msg=name)


def test_fp8_layer_with_quantize_weights():
    """MoKConfig(precision="fp8"): ``quantize_weights`` under jit is bit for bit
    ``mok_comm.layer.quantize_weights``; the layer on ``WeightsFP8(*W, fp8)`` and ``jax.grad``
    through it (the six bf16 weights' gradients, none for fp8) bit for bit the functional FP8
    forward and backward; a bf16 ``Weights`` or a forward-only quantisation is refused, by
    name, when traced."""
    from dataclasses import replace
    t = 16
    shape = LayerShape(hidden=128, intermediate=128, shared_intermediate=128, num_experts=2,
                       topk=2, ep_size=1)
    cfg = replace(CFG, precision="fp8")
    inp, (x, ids, w, W) = _inputs(11, shape=shape, t=t)
    c, c32 = _cotangent(12, t, shape.hidden)
    fp8 = jax.jit(mok_jax_adapter.quantize_weights)(W)
    want_q = quantize_weights(Weights(*(to_dev(_bits(inp[n])) for n in NAMES)))
    assert isinstance(fp8, FP8Weights)
    for name, a, b in zip(FP8Weights._fields, fp8, want_q):
        np.testing.assert_array_equal(np.asarray(a), to_host(b), err_msg=name)

    layer = mok_jax_adapter.Layer(shape, t, cfg, gemm=GEMM)
    step = jax.jit(layer)

    def loss(x, w, W):        # (the output as aux: one forward, not a second one for it)
        out = step(x, ids, w, mok_jax_adapter.WeightsFP8(*W, fp8))
        return jnp.sum(out.astype(jnp.float32) * c32), out

    (_, out), (d_x, d_w, d_W) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2),
                                                           has_aux=True))(x, w, W)
    layer.check((out, d_x, d_w, d_W))
    want_out = []
    want = _functional_grads(inp, c, shape, None, cfg, t, want_out)
    np.testing.assert_array_equal(_bits(out), want_out[0])
    for name, a, b in zip(B.Grads._fields, [d_x, d_w, *d_W], want):
        np.testing.assert_array_equal(np.asarray(a).view(b.dtype), b, err_msg=name)

    with pytest.raises(TypeError, match=r"weights: expected 7: WeightsFP8\(\*weights, "
                                        r"quantize_weights\(weights\)\)"):
        layer(x, ids, w, W)
    fwd_only = mok_jax_adapter.quantize_weights(W, backward=False)
    assert fwd_only.w_down_t is None
    with pytest.raises(ValueError, match="weights.fp8.w_down_t: None"):
        jax.grad(lambda x: jnp.sum(layer(x, ids, w, mok_jax_adapter.WeightsFP8(
            *W, fwd_only)).astype(jnp.float32)))(x)
    with pytest.raises(TypeError, match=r"weights.fp8.w_gate: expected dtype uint8"):
        layer(x, ids, w, mok_jax_adapter.WeightsFP8(*W, fp8._replace(w_gate=W.w_gate)))
    with pytest.raises(TypeError, match="weights.fp8.w_gate_scale: expected a jax.Array"):
        layer(x, ids, w, mok_jax_adapter.WeightsFP8(*W, fp8._replace(w_gate_scale=None)))
    with pytest.raises(ValueError, match="the transposed copies .* all given or all None"):
        layer(x, ids, w, mok_jax_adapter.WeightsFP8(*W, fp8._replace(w_gate_up_t=None)))
