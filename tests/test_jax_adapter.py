"""mok_jax_adapter: jax arrays through the layer in one XLA buffer callback, inside and outside
``jax.jit`` (EP = 1; the simulator on JAX's CPU backend in CI, unchanged on one GPU), against
the float64 reference and bit for bit against ``mok_comm.functional`` on the same inputs."""
import os

import numpy as np
import pytest

from helpers import to_dev
from layer_support import layer_inputs, reference_out, rel_l1
from mok_comm import functional as F
from mok_comm.heap import LocalHeap
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
CFG = MoKConfig(row_align=32, minibatch_size=64, macrobatch_size=256, capacity_factor=1.0)
SHAPE = LayerShape(hidden=64, intermediate=32, shared_intermediate=32, num_experts=4, topk=2,
                   ep_size=1)
T = 40


def _inputs(seed=0, limit=None):
    inp = layer_inputs(np.random.default_rng(seed), SHAPE, T,
                       weight_scale=3.0 if limit else 1.0)
    args = (jnp.asarray(inp["x"][0]), jnp.asarray(inp["ids"][0].astype(np.int32)),
            jnp.asarray(inp["w"][0]), *(jnp.asarray(inp[n]) for n in
                                        ("w_sg", "w_su", "w_sd", "w_g", "w_u", "w_d")))
    return inp, args


def _bits(a):
    return np.asarray(a).view(np.uint16)


@pytest.mark.parametrize("limit", [None, 1.0])
def test_forward_matches_reference_and_functional(limit):
    inp, args = _inputs(1, limit)
    lw = mok_jax_adapter.get_workspace(SHAPE, T, CFG, gemm=GEMM)
    step = jax.jit(lambda *a: mok_jax_adapter.forward(CFG, lw, *a, swiglu_limit=limit))
    out = step(*args)
    mok_jax_adapter.check(lw, out)
    assert out.dtype == jnp.bfloat16 and out.shape == (T, SHAPE.hidden)
    got = np.asarray(out).astype(np.float64)
    assert np.isfinite(got).all()
    assert rel_l1(got, reference_out(inp, limit)[0]) < 5e-3
    # the same bits as the framework-neutral layer on the same inputs ...
    lw2 = F.get_workspace(SHAPE, T, CFG, gemm=GEMM, heap=LocalHeap(0))
    sched = F.build_schedule(lw2, to_dev(inp["ids"][0].astype(np.int32)))
    want, _ = F.forward(CFG, lw2, sched, *(to_dev(_bits(inp[n][0]) if n == "x" else inp[n][0])
                                           for n in ("x", "w")),
                        *(to_dev(_bits(inp[n])) for n in ("w_sg", "w_su", "w_sd", "w_g", "w_u",
                                                          "w_d")),
                        limit)
    np.testing.assert_array_equal(_bits(out), to_host(want).view(np.uint16))
    # ... again under jit, and eagerly (outside jit) -- deterministic; the outputs kept alive,
    # so each call writes a buffer of its own
    again = step(*args)
    eager = [mok_jax_adapter.forward(CFG, lw, *args, swiglu_limit=limit) for _ in range(2)]
    for o in (again, *eager):
        np.testing.assert_array_equal(_bits(o), _bits(out))
    # one buffer callback per (workspace, config, limit): JAX compiles an eager call once
    from mok_jax_adapter.functional import _callback
    assert _callback(lw, CFG, limit) is _callback(lw, CFG, limit)
    assert len(lw._jax_callbacks) == 1


def test_forward_without_shared_expert():
    shape = LayerShape(hidden=64, intermediate=32, shared_intermediate=0, num_experts=4,
                       topk=2, ep_size=1)
    inp = layer_inputs(np.random.default_rng(5), shape, T)
    lw = mok_jax_adapter.get_workspace(shape, T, CFG, gemm=GEMM)
    out = mok_jax_adapter.forward(CFG, lw, jnp.asarray(inp["x"][0]),
                                  jnp.asarray(inp["ids"][0].astype(np.int32)),
                                  jnp.asarray(inp["w"][0]),
                                  *(jnp.asarray(inp[n]) for n in ("w_sg", "w_su", "w_sd", "w_g",
                                                                  "w_u", "w_d")),
                                  swiglu_limit=np.float32(4.0))       # a NumPy scalar is taken
    mok_jax_adapter.check(lw, out)
    got = np.asarray(out).astype(np.float64)
    assert rel_l1(got, reference_out(inp, 4.0)[0]) < 5e-3


def test_jax_inputs_checked():
    _, args = _inputs(2)
    lw = mok_jax_adapter.get_workspace(SHAPE, T, CFG, gemm=GEMM)
    x, ids, w, sg, su, sd, wg, wu, wd = args
    fwd = mok_jax_adapter.forward
    with pytest.raises(TypeError, match="x: expected dtype bfloat16, got float32"):
        fwd(CFG, lw, x.astype(jnp.float32), ids, w, sg, su, sd, wg, wu, wd)
    with pytest.raises(TypeError, match="router_weights: expected dtype float32"):
        fwd(CFG, lw, x, ids, w.astype(jnp.bfloat16), sg, su, sd, wg, wu, wd)
    with pytest.raises(TypeError, match="topk_ids: expected dtype int32"):
        fwd(CFG, lw, x, ids.astype(jnp.float32), w, sg, su, sd, wg, wu, wd)
    with pytest.raises(ValueError, match=r"w_gate: expected shape \(4, 32, 64\)"):
        fwd(CFG, lw, x, ids, w, sg, su, sd, wg[:, :16], wu, wd)
    with pytest.raises(ValueError, match=r"x: expected shape \(40, 64\)"):
        jax.jit(lambda *a: fwd(CFG, lw, *a))(x[:8], ids, w, sg, su, sd, wg, wu, wd)
    with pytest.raises(ValueError, match="swiglu_limit=-1.0"):
        fwd(CFG, lw, x, ids, w, sg, su, sd, wg, wu, wd, swiglu_limit=-1.0)


def test_out_of_range_expert_id_is_reported():
    _, args = _inputs(3)
    lw = mok_jax_adapter.get_workspace(SHAPE, T, CFG, gemm=GEMM)
    bad = args[1].at[5, 1].set(SHAPE.num_experts)         # one id past the last expert
    out = mok_jax_adapter.forward(CFG, lw, args[0], bad, *args[2:])
    with pytest.raises(MoKError, match=r"expert id out of range.*largest bad id 4"):
        mok_jax_adapter.check(lw, out)
