"""The whole EP forward on real GPUs (torchrun / mok_comm.launch, >= 2 processes): every model
preset at 4096 tokens/rank vs float64 on sampled tokens, 20 bitwise-identical repetitions,
CUDA-graph replay equal to eager, bad inputs rejected before launch."""
import pytest

T = 4096
SAMPLE = 24


@pytest.fixture(scope="module")
def torch_world(nvshmem_world):
    return nvshmem_world


@pytest.mark.parametrize("preset_name", ["kimi-k2.7", "glm-5.2", "qwen3.5-397b",
                                         "deepseek-v4-pro"])
def test_layer_preset(torch_world, preset_name):
    import torch

    import mok_torch
    from benchmarks.common import capture_graph
    from mok_core.config import MoKConfig, preset
    from mok_testing import synthetic
    from mok_testing.sampled import covering_tokens, reference_tokens
    R, me = torch_world.world_size, torch_world.rank
    shape = preset(preset_name, ep_size=R)
    dev = torch.device("cuda", torch.cuda.current_device())
    cfg = MoKConfig()
    x, ids, w = synthetic.rank_inputs(shape, T, me, dev, skew=0.3, masked=0.01)
    wg, wu, wd = synthetic.local_expert_weights(shape, me, dev)
    sg, su, sd = synthetic.shared_weights(shape, dev)
    weights = mok_torch.Weights(sg, su, sd, wg, wu, wd)
    layer = mok_torch.Layer(shape, T, cfg)
    try:
        def step():
            return layer(x, ids, w, weights)

        outs = [step() for _ in range(20)]
        torch.cuda.synchronize()
        layer.check()
        for rep, o in enumerate(outs[1:], 1):
            assert torch.equal(o, outs[0]), f"repetition {rep} differs"
        out = outs[0]
        assert torch.isfinite(out.float()).all()

        pick = covering_tokens(ids, SAMPLE)                 # every expert they reach
        ref = reference_tokens(x[pick], ids[pick], w[pick], (sg, su, sd),
                               lambda e: synthetic.expert_weights(shape, e, dev))
        err = (out[pick].double() - ref).abs().sum() / ref.abs().sum()
        assert err < 5e-3, f"rel-L1 {err:.2e}"

        # CUDA graph: capture the whole eager step (schedule + forward) once, replay, compare
        # with eager.
        graph, static_out = capture_graph(step)
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        layer.check()
        assert torch.equal(static_out, out), "graph replay differs from eager"

        # Bad inputs: rejected on the host, before any launch.
        with pytest.raises(TypeError, match="x: expected dtype torch.bfloat16"):
            layer(x.float(), ids, w, weights)
        with pytest.raises(ValueError, match="w_down: expected shape"):
            layer(x, ids, w, weights._replace(w_down=wg))
        with pytest.raises(ValueError, match="expected a cuda tensor"):
            layer(x.cpu(), ids, w, weights)
        with pytest.raises(ValueError, match="x: requires_grad=True"):
            layer(x.clone().requires_grad_(), ids, w, weights)
    finally:
        torch.cuda.synchronize()
        layer.comm.free()


@pytest.mark.parametrize("preset_name", ["kimi-k2.7", "glm-5.2", "qwen3.5-397b",
                                         "deepseek-v4-pro"])
def test_compiled_step_preset(torch_world, preset_name):
    """``Layer.compile`` (eager prologue + CUDA-graph core + eager epilogue) equals the eager
    step (``layer(x, ids, w, weights)``) bit for bit over 3 consecutive calls (the first
    captures, the others replay) with fresh input tensors of new values each call, and after a
    weight swap (recapture)."""
    import torch

    import mok_torch
    from mok_core.config import MoKConfig, preset
    from mok_testing import synthetic
    R, me = torch_world.world_size, torch_world.rank
    shape = preset(preset_name, ep_size=R)
    dev = torch.device("cuda", torch.cuda.current_device())
    cfg = MoKConfig()
    wg, wu, wd = synthetic.local_expert_weights(shape, me, dev)
    sg, su, sd = synthetic.shared_weights(shape, dev)
    layer = mok_torch.Layer(shape, T, cfg)
    step = None
    try:
        step = layer.compile(mok_torch.Weights(sg, su, sd, wg, wu, wd))

        def eager(x, ids, w, w_down):
            return layer(x, ids, w, mok_torch.Weights(sg, su, sd, wg, wu, w_down))

        keep, pairs = [], []          # inputs stay alive: no address is reused across calls
        for seed in (1, 2, 3):
            x, ids, w = synthetic.rank_inputs(shape, T, me, dev, seed=seed, skew=0.3,
                                              masked=0.01)
            want = eager(x, ids, w, wd)
            fresh = (x.clone(), ids.clone(), w.clone())
            keep += [x, ids, w, *fresh]
            pairs.append((step(*fresh), want))
        wd2 = wd.clone() * 2
        step.set_weights(w_down=wd2)
        x, ids, w = synthetic.rank_inputs(shape, T, me, dev, seed=4, skew=0.3, masked=0.01)
        pairs.append((step(x.clone(), ids.clone(), w.clone()), eager(x, ids, w, wd2)))
        torch.cuda.synchronize()
        layer.check()
        assert step.captures == 2
        for i, (got, want) in enumerate(pairs):
            assert torch.isfinite(got.float()).all(), f"call {i}: non-finite output"
            assert torch.equal(got, want), f"call {i}: compiled step differs from eager"
    finally:
        torch.cuda.synchronize()
        del step                      # the graph references the layer's buffers
        layer.comm.free()


@pytest.mark.parametrize("dispatch", ["split"])
@pytest.mark.parametrize("preset_name", ["kimi-k2.7", "qwen3.5-397b"])
def test_dispatch_mode_step_equals_pull(torch_world, preset_name, dispatch):
    """``MoKConfig(dispatch="split")`` at real shapes: the compiled step (the copy engine's
    half of the dispatch on a side stream forked and joined inside the captured graph) equals
    the pull layer's eager forward bit for bit over 3 calls with fresh inputs -- capture, then
    replays that reuse the peers' staging."""
    import torch

    import mok_torch
    from mok_core.config import MoKConfig, preset
    from mok_testing import synthetic
    R, me = torch_world.world_size, torch_world.rank
    shape = preset(preset_name, ep_size=R)
    dev = torch.device("cuda", torch.cuda.current_device())
    pull, mode = MoKConfig(), MoKConfig(dispatch=dispatch)
    wg, wu, wd = synthetic.local_expert_weights(shape, me, dev)
    sg, su, sd = synthetic.shared_weights(shape, dev)
    weights = mok_torch.Weights(sg, su, sd, wg, wu, wd)
    layer_pull = mok_torch.Layer(shape, T, pull)
    layer_mode = mok_torch.Layer(shape, T, mode)
    step = None
    try:
        step = layer_mode.compile(weights)
        keep, pairs = [], []
        for seed in (5, 6, 7):
            x, ids, w = synthetic.rank_inputs(shape, T, me, dev, seed=seed, skew=0.3,
                                              masked=0.01)
            want = layer_pull(x, ids, w, weights)
            keep += [x, ids, w]
            pairs.append((step(x, ids, w), want))
        torch.cuda.synchronize()
        layer_pull.check()
        layer_mode.check()
        for i, (got, want) in enumerate(pairs):
            assert torch.isfinite(got.float()).all(), f"call {i}: non-finite output"
            assert torch.equal(got, want), f"call {i}: {dispatch} step differs from the pull layer"
    finally:
        torch.cuda.synchronize()
        del step
        layer_mode.comm.free()
        layer_pull.comm.free()
