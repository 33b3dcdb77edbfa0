"""The layer's backward on real GPUs at real shapes: every model preset, 4096 tokens/rank, all 8
gradients against float64 (sampled tokens for d_x and the router weights, sampled experts and
intermediate columns for the weight gradients), repetitions bitwise identical, forward +
backward captured in a CUDA graph equal to eager.

EP 1: one process per GPU, each its own layer (``test_backward_ep1``); EP 2:
``torchrun --nproc-per-node=2`` or ``mok_comm.launch`` (``test_backward_ep``)."""
import gc

import pytest

T = 4096
PRESETS = ["kimi-k2.7", "glm-5.2", "qwen3.5-397b", "deepseek-v4-pro"]
REPEATS = 5
TOL = 5e-3


def _digest(t, torch):
    """A position-weighted checksum of t's bits, in chunks (the weight gradients are tens of
    GB); on the device, nothing syncs."""
    bits = t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32).reshape(-1)
    n = 1 << 24
    mix = torch.arange(n, device=t.device, dtype=torch.int64) % 65521 + 1
    return sum((c.to(torch.int64) * mix[:c.numel()]).sum() for c in bits.split(n))


def _digests(tensors, torch):
    return torch.stack([_digest(t, torch) for t in tensors if t is not None])


def _check_preset(preset_name, R, me, torch):
    import mok_torch
    from benchmarks.common import capture_graph
    from mok_core.config import MoKConfig, preset
    from mok_testing import synthetic
    from mok_testing.sampled import grad_errors
    shape = preset(preset_name, ep_size=R)
    dev = torch.device("cuda", torch.cuda.current_device())
    E_l = shape.experts_per_rank
    inputs = [synthetic.rank_inputs(shape, T, r, dev, skew=0.3, masked=0.01) for r in range(R)]
    d_outs = [torch.randn(T, shape.hidden, device=dev,
                          generator=torch.Generator(dev).manual_seed(100 + r)).bfloat16()
              for r in range(R)]
    x, ids, w = inputs[me]
    d_out = d_outs[me]
    shared = synthetic.shared_weights(shape, dev)
    wg, wu, wd = synthetic.local_expert_weights(shape, me, dev)
    weights = mok_torch.Weights(*shared, wg, wu, wd)
    layer = mok_torch.Layer(shape, T, MoKConfig())
    grads = graph = None
    try:

        def step():
            nonlocal grads
            out, ctx = layer.forward(x, ids, w, weights)
            grads = layer.backward(ctx, d_out, w, weights, grads=grads)
            return out, grads

        digests = []
        for _ in range(REPEATS):
            out, G = step()
            digests.append(_digests((out, *G), torch))
        torch.cuda.synchronize()
        layer.check()
        for rep in range(1, REPEATS):
            assert torch.equal(digests[rep], digests[0]), f"repetition {rep} differs"

        assert (G.d_router_weights[ids < 0] == 0).all()
        errs = grad_errors(inputs, d_outs, me, G, shared,
                           lambda e: synthetic.expert_weights(shape, e, dev), E_l)
        bad = {n: e for n, e in errs.items() if not e < TOL}
        assert not bad, f"{preset_name} rank {me}: rel-L1 over {TOL}: {bad} (all: {errs})"

        # forward + backward as one CUDA graph (into the same gradient buffers): bit for bit
        # the eager step
        graph, (s_out, _) = capture_graph(step)
        s_out.fill_(0)
        for g in grads:
            if g is not None:
                g.fill_(0)
        for _ in range(2):
            graph.replay()
        torch.cuda.synchronize()
        layer.check()
        assert torch.equal(_digests((s_out, *grads), torch), digests[0]), \
            "the graphed forward + backward differs from eager"
        return errs
    finally:
        torch.cuda.synchronize()
        layer.comm.free()
        del layer, weights, inputs, d_outs, grads, graph
        gc.collect()                     # the next preset needs the memory back
        torch.cuda.empty_cache()


@pytest.mark.parametrize("preset_name", PRESETS)
def test_backward_ep1(dist, preset_name):
    torch = pytest.importorskip("torch")
    errs = _check_preset(preset_name, 1, 0, torch)
    print(f"{preset_name} EP1 rel-L1: " + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()))


@pytest.mark.parametrize("preset_name", PRESETS)
def test_backward_ep(nvshmem_world, preset_name):
    torch = pytest.importorskip("torch")
    errs = _check_preset(preset_name, nvshmem_world.world_size, nvshmem_world.rank, torch)
    print(f"{preset_name} EP{nvshmem_world.world_size} rank {nvshmem_world.rank} rel-L1: "
          + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()))
