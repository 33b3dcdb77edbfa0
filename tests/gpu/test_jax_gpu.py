"""The JAX adapter on GPUs (torchrun / mok_comm.launch; any number of processes, EP = their
number): a real preset at 4096 tokens/rank through ``mok_jax_adapter.Layer`` under ``jax.jit``
equals ``mok_torch.Layer`` on the same inputs bit for bit, three calls alike; ``jax.grad``
through it (EP 1, one process) equals ``mok_torch.Layer.backward`` bit for bit."""
import os

import pytest

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")   # NVSHMEM's heap must fit

T = 4096


def _to_jax(t):
    """torch tensor -> jax array on the same GPU through DLPack (no copy: the preset's weights
    are 13 GB, a round trip through the host took minutes)."""
    import jax
    return jax.dlpack.from_dlpack(t.contiguous())


def _assert_same_bits(a, b, what):
    """jax array ``a`` == torch tensor ``b`` bit for bit, compared on the GPU."""
    import torch
    a = torch.from_dlpack(a)
    assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, a.dtype, b.shape, b.dtype)
    ab, bb = a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    if not torch.equal(ab, bb):
        n = int((ab != bb).sum())
        raise AssertionError(f"{what}: {n} of {ab.numel()} bytes differ")


def _jax(dist):
    """jax with a GPU backend, or skip (EP > 1 through JAX does not work yet: run 74)."""
    jax = pytest.importorskip("jax")
    if dist.world > 1:
        # run 74: with JAX pinned to GPU 1, XLA raised "Device id 1 is out of range [0, 1)"
        # on rank 1 -- EP > 1 through JAX is not working yet (NOTES, Next)
        # (what it tried: jax.config.update("jax_cuda_visible_devices", str(local_rank)))
        pytest.skip("the JAX adapter at EP > 1 on GPUs: not working yet (run 74)")
    if jax.default_backend() != "gpu":
        pytest.skip("this jax has no GPU backend")
    return jax


def test_jax_layer_equals_torch_layer(request, dist):
    R, me = dist.world, dist.rank
    if R > 1:
        request.getfixturevalue("nvshmem_world")
    jax = _jax(dist)
    import torch

    import mok_jax_adapter
    import mok_torch
    from mok_core.config import MoKConfig, preset
    from mok_testing import synthetic
    shape = preset("qwen3.5-397b", ep_size=R)
    dev = torch.device("cuda", torch.cuda.current_device())
    cfg = MoKConfig()
    x, ids, w = synthetic.rank_inputs(shape, T, me, dev, skew=0.3, masked=0.01)
    wg, wu, wd = synthetic.local_expert_weights(shape, me, dev)
    sg, su, sd = synthetic.shared_weights(shape, dev)
    torch_layer = mok_torch.Layer(shape, T, cfg)
    jax_layer = None
    try:
        want = torch_layer(x, ids, w, mok_torch.Weights(sg, su, sd, wg, wu, wd))
        torch.cuda.synchronize()
        torch_layer.check()
        jax_layer = mok_jax_adapter.Layer(shape, T, cfg)
        ids = ids.int()
        x_j, ids_j, w_j, *weights = [_to_jax(t) for t in (x, ids, w, sg, su, sd, wg, wu, wd)]
        weights = mok_jax_adapter.Weights(*weights)
        step = jax.jit(jax_layer)
        outs = [step(x_j, ids_j, w_j, weights) for _ in range(3)]   # kept alive: three buffers
        jax_layer.check(outs[-1])
        for rep, o in enumerate(outs):
            _assert_same_bits(o, want, f"out, call {rep}")
    finally:
        torch.cuda.synchronize()
        if jax_layer is not None:
            jax_layer.comm.free()
        torch_layer.comm.free()


def test_jax_grad_equals_torch_backward(dist):
    """jax.grad of sum(out * c) through jax.jit(layer) (the preset at EP 1, 4096 tokens): the
    8 gradients bit for bit ``mok_torch.Layer.backward``'s with d_out = c (bf16), twice."""
    jax = _jax(dist)
    import jax.numpy as jnp
    import torch

    import mok_jax_adapter
    import mok_torch
    from mok_core.config import MoKConfig, preset
    from mok_testing import synthetic
    shape = preset("qwen3.5-397b", ep_size=1)
    dev = torch.device("cuda", torch.cuda.current_device())
    cfg = MoKConfig()
    x, ids, w = synthetic.rank_inputs(shape, T, 0, dev, skew=0.3, masked=0.01)
    weights = mok_torch.Weights(*synthetic.shared_weights(shape, dev),
                                *synthetic.local_expert_weights(shape, 0, dev))
    c = torch.randn(T, shape.hidden, device=dev,
                    generator=torch.Generator(dev).manual_seed(100)).bfloat16()
    torch_layer = mok_torch.Layer(shape, T, cfg)
    jax_layer = None
    try:
        _, ctx = torch_layer.forward(x, ids, w, weights)
        want = torch_layer.backward(ctx, c, w, weights)
        torch.cuda.synchronize()
        torch_layer.check()
        del ctx
        jax_layer = mok_jax_adapter.Layer(shape, T, cfg)
        ids = ids.int()
        x_j, ids_j, w_j, c_j = [_to_jax(t) for t in (x, ids, w, c)]
        W_j = mok_jax_adapter.Weights(*(_to_jax(t) for t in weights))
        step = jax.jit(jax_layer)

        def loss(x, w, W):
            return jnp.sum(step(x, ids_j, w, W).astype(jnp.float32) * c_j.astype(jnp.float32))

        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        for rep in range(2):
            got = jax.tree_util.tree_leaves(grad(x_j, w_j, W_j))    # Grads' order
            jax_layer.check(got)
            for name, a, b in zip(mok_torch.Grads._fields, got, want):
                _assert_same_bits(a, b, f"{name}, call {rep}")
            del got
    finally:
        torch.cuda.synchronize()
        if jax_layer is not None:
            jax_layer.comm.free()
        torch_layer.comm.free()
