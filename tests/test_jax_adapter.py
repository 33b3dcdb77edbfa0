"""mok_jax_adapter: jax arrays through the layer in one XLA buffer callback, inside and outside
``jax.jit`` (EP = 1; the simulator on JAX's CPU backend in CI, unchanged on one GPU), against
the float64 reference and bit for bit against ``mok_comm.functional`` on the same inputs."""
import os

import numpy as np
import pytest

from helpers import to_dev
from layer_support import layer_inputs, reference_out, rel_l1
from mok_comm.heap import LocalHeap
from mok_comm.layer import Layer, Weights
from mok_core.config import LayerShape, MoKConfig
from mok_core.cuda_compat import SIM, to_host
from mok_core.errors import MoKError
from mok_core.gemm import SIM_GEMM

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
T = 40


def _inputs(seed=0, limit=None, shape=SHAPE):
    inp = layer_inputs(np.random.default_rng(seed), shape, T,
                       weight_scale=3.0 if limit else 1.0)
    args = (jnp.asarray(inp["x"][0]), jnp.asarray(inp["ids"][0].astype(np.int32)),
            jnp.asarray(inp["w"][0]), mok_jax_adapter.Weights(*(
                jnp.asarray(inp[n]) for n in ("w_sg", "w_su", "w_sd", "w_g", "w_u", "w_d"))))
    return inp, args


def _bits(a):
    return np.asarray(a).view(np.uint16)


@pytest.mark.parametrize("limit", [None, 1.0])
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
    eager = [layer(*args) for _ in range(2)]
    for o in (again, *eager):
        np.testing.assert_array_equal(_bits(o), _bits(out))
    # one buffer callback per layer: JAX compiles an eager call once
    assert layer._call() is layer._call()


def test_forward_without_shared_expert():
    shape = LayerShape(hidden=64, intermediate=32, shared_intermediate=0, num_experts=4,
                       topk=2, ep_size=1)
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
    with pytest.raises(TypeError, match="weights: expected 6 arrays"):
        layer(x, ids, w, tuple(W)[:5])
    with pytest.raises(ValueError, match=r"x: expected shape \(40, 64\)"):
        jax.jit(layer)(x[:8], ids, w, W)
    with pytest.raises(ValueError, match="swiglu_limit=-1.0"):
        mok_jax_adapter.Layer(SHAPE, T, CFG, gemm=GEMM, swiglu_limit=-1.0)


def test_out_of_range_expert_id_is_reported():
    _, (x, ids, w, W) = _inputs(3)
    layer = mok_jax_adapter.Layer(SHAPE, T, CFG, gemm=GEMM)
    bad = ids.at[5, 1].set(SHAPE.num_experts)             # one id past the last expert
    out = layer(x, bad, w, W)
    with pytest.raises(MoKError, match=r"expert id out of range on rank 0: topk_ids\[5, 1\] = 4 "
                                       r"\(valid: 0\.\.3 or -1 for a masked route\); 1 bad id "
                                       r"in all, that route was skipped$"):
        layer.check(out)
