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
    from mok_torch import synthetic
    from mok_torch.reference import reference_tokens
    R, me = torch_world.world_size, torch_world.rank
    shape = preset(preset_name, ep_size=R)
    dev = torch.device("cuda", torch.cuda.current_device())
    cfg = MoKConfig()
    x, ids, w = synthetic.rank_inputs(shape, T, me, dev, skew=0.3, masked=0.01)
    wg, wu, wd = synthetic.local_expert_weights(shape, me, dev)
    sg, su, sd = synthetic.shared_weights(shape, dev)
    lw = mok_torch.get_workspace(shape, T, cfg)
    try:
        def step():
            sched = mok_torch.build_schedule(lw, ids)
            return mok_torch.forward(cfg, lw, sched, x, w, sg, su, sd, wg, wu, wd)[0]

        outs = [step() for _ in range(20)]
        torch.cuda.synchronize()
        lw.check()
        for rep, o in enumerate(outs[1:], 1):
            assert torch.equal(o, outs[0]), f"repetition {rep} differs"
        out = outs[0]
        assert torch.isfinite(out.float()).all()

        pick = torch.linspace(0, T - 1, SAMPLE, device=dev).long()
        ref = reference_tokens(x[pick], ids[pick], w[pick], (sg, su, sd),
                               lambda e: synthetic.expert_weights(shape, e, dev))
        err = (out[pick].double() - ref).abs().sum() / ref.abs().sum()
        assert err < 5e-3, f"rel-L1 {err:.2e}"

        # CUDA graph: capture schedule + forward once, replay, compare with eager.
        graph, static_out = capture_graph(step)
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        lw.check()
        assert torch.equal(static_out, out), "graph replay differs from eager"

        # Bad inputs: rejected on the host, before any launch.
        with pytest.raises(TypeError, match="x: expected dtype torch.bfloat16"):
            mok_torch.forward(cfg, lw, lw.schedule, x.float(), w, sg, su, sd, wg, wu, wd)
        with pytest.raises(ValueError, match="w_down: expected shape"):
            mok_torch.forward(cfg, lw, lw.schedule, x, w, sg, su, sd, wg, wu, wg)
        with pytest.raises(ValueError, match="expected a cuda tensor"):
            mok_torch.forward(cfg, lw, lw.schedule, x.cpu(), w, sg, su, sd, wg, wu, wd)
    finally:
        torch.cuda.synchronize()
        lw.comm.free()


@pytest.mark.parametrize("preset_name", ["kimi-k2.7", "glm-5.2", "qwen3.5-397b",
                                         "deepseek-v4-pro"])
def test_compiled_step_preset(torch_world, preset_name):
    """mok_torch.compile_step (eager prologue + CUDA-graph core + eager epilogue) equals eager
    build_schedule + forward bit for bit over 3 consecutive calls (the first captures, the
    others replay) with fresh input tensors of new values each call, and after a weight swap
    (recapture)."""
    import torch

    import mok_torch
    from mok_core.config import MoKConfig, preset
    from mok_torch import synthetic
    R, me = torch_world.world_size, torch_world.rank
    shape = preset(preset_name, ep_size=R)
    dev = torch.device("cuda", torch.cuda.current_device())
    cfg = MoKConfig()
    wg, wu, wd = synthetic.local_expert_weights(shape, me, dev)
    sg, su, sd = synthetic.shared_weights(shape, dev)
    lw = mok_torch.get_workspace(shape, T, cfg)
    step = None
    try:
        step = mok_torch.compile_step(cfg, lw, sg, su, sd, wg, wu, wd)

        def eager(x, ids, w, w_down):
            sched = mok_torch.build_schedule(lw, ids)
            return mok_torch.forward(cfg, lw, sched, x, w, sg, su, sd, wg, wu, w_down)[0]

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
        lw.check()
        assert step.captures == 2
        for i, (got, want) in enumerate(pairs):
            assert torch.isfinite(got.float()).all(), f"call {i}: non-finite output"
            assert torch.equal(got, want), f"call {i}: compiled step differs from eager"
    finally:
        torch.cuda.synchronize()
        del step                      # the graph references the workspace's buffers
        lw.comm.free()


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
    from mok_torch import synthetic
    R, me = torch_world.world_size, torch_world.rank
    shape = preset(preset_name, ep_size=R)
    dev = torch.device("cuda", torch.cuda.current_device())
    pull, mode = MoKConfig(), MoKConfig(dispatch=dispatch)
    wg, wu, wd = synthetic.local_expert_weights(shape, me, dev)
    sg, su, sd = synthetic.shared_weights(shape, dev)
    lw_pull = mok_torch.get_workspace(shape, T, pull)
    lw_mode = mok_torch.get_workspace(shape, T, mode)
    step = None
    try:
        step = mok_torch.compile_step(mode, lw_mode, sg, su, sd, wg, wu, wd)
        keep, pairs = [], []
        for seed in (5, 6, 7):
            x, ids, w = synthetic.rank_inputs(shape, T, me, dev, seed=seed, skew=0.3,
                                              masked=0.01)
            sched = mok_torch.build_schedule(lw_pull, ids)
            want = mok_torch.forward(pull, lw_pull, sched, x, w, sg, su, sd, wg, wu, wd)[0]
            keep += [x, ids, w]
            pairs.append((step(x, ids, w), want))
        torch.cuda.synchronize()
        lw_pull.check()
        lw_mode.check()
        for i, (got, want) in enumerate(pairs):
            assert torch.isfinite(got.float()).all(), f"call {i}: non-finite output"
            assert torch.equal(got, want), f"call {i}: {dispatch} step differs from the pull layer"
    finally:
        torch.cuda.synchronize()
        del step
        lw_mode.comm.free()
        lw_pull.comm.free()
