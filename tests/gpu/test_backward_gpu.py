"""The layer's backward on real GPUs at real shapes: every model preset, 4096 tokens/rank, the
output and all 8 gradients against float64 (sampled tokens for the output, d_x and the router
weights, sampled experts and intermediate columns for the weight gradients), 20 repetitions
bitwise identical, forward + backward captured in a CUDA graph equal to eager, one more eager
step issued without waiting for the device (``_no_host_waits``) -- in bf16 and
with ``MoKConfig(precision="fp8")`` (the layer given the bf16 weights quantises its routed
experts itself, as ``MoEBlock`` does; checked against the same float64 reference of the bf16
weights, at FP8's tolerance), and ``fp8w``: that layer with ``fp8_wgrad=True`` (its routed
weight gradients in FP8 too). And the routed d_x rows pushed home from their GEMM's epilogue
(the default) against the combine kernel's push: the same bits (qwen3.5-397b, bf16 and fp8).

EP 1: one process per GPU, each its own layer (``test_backward_ep1``); EP 2:
``torchrun --nproc-per-node=2`` or ``mok_comm.launch`` (``test_backward_ep``)."""
import contextlib
import gc
import warnings

import pytest

T = 4096
PRESETS = ["kimi-k2.7", "glm-5.2", "qwen3.5-397b", "deepseek-v4-pro"]
PRECISIONS = ["bf16", "fp8", "fp8w"]
CONFIGS = {"bf16": {}, "fp8": {"precision": "fp8"},
           "fp8w": {"precision": "fp8", "fp8_wgrad": True}}
REPEATS = 20
BF16 = (5e-3, 0.9999)      # the most rel-L1 and the least cosine similarity against float64
FP8 = (0.03, 0.999)        # FP8: the output and d_x (issue 23's bound) ...
FP8_ACT = (0.1, 0.995)     # ... and what is made from the FP8 forward's h and the FP8 p (d_router
# weights and the routed weight gradients): e4m3's 3 mantissa bits put ~2.3 % (rel-L1) into each
# FP8 GEMM's output on random operands whatever its K, and h = SiLU(g) u and <p, h> carry two
# such errors -- 0.045-0.072 in float64 emulation of the layer's quantisation at kimi's and
# qwen's shapes (benchmarks/probes/probe_fp8_error.py), up to 0.075 / cosine 0.9972 measured
# at glm's (docs/perf.md); the shared expert stays bf16 and keeps bf16's bound


def _bounds(precision, name):
    if precision == "bf16" or "shared" in name:
        return BF16
    return FP8_ACT if name.startswith(("d_router", "d_w_")) else FP8


def _digest(t, torch):
    """A position-weighted checksum of t's bits, in chunks (the weight gradients are tens of
    GB); on the device, nothing syncs."""
    bits = t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32).reshape(-1)
    n = 1 << 24
    mix = torch.arange(n, device=t.device, dtype=torch.int64) % 65521 + 1
    return sum((c.to(torch.int64) * mix[:c.numel()]).sum() for c in bits.split(n))


def _digests(tensors, torch):
    return torch.stack([_digest(t, torch) for t in tensors if t is not None])


def _fits(shape, precision, torch):
    """Whether the GPU holds a rank's routed weights, their gradients and (FP8) their two
    quantised copies, plus 12 GiB for the layer's buffers and the rest."""
    s = shape
    routed = 3 * s.experts_per_rank * s.intermediate * s.hidden
    need = routed * (2 + 2 + (0 if precision == "bf16" else 2)) + (12 << 30)
    return need <= torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory


@contextlib.contextmanager
def _no_host_waits(torch):
    """Inside: what made the host wait for the device, or launch the slow way, in the list
    yielded -- ``mok_testing.host_waits`` (numba's calls, launches sent to numba's
    dispatcher) and torch's synchronising ops (``set_sync_debug_mode``)."""
    from mok_testing import host_waits
    mode = torch.cuda.get_sync_debug_mode()
    try:
        # "warn", not "error": a step cut short would leave its EP peers at a barrier
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught, host_waits.watch() as seen:
            warnings.simplefilter("always")
            yield seen
    finally:
        torch.cuda.set_sync_debug_mode(mode)
    for w in caught:
        if "synchroniz" in str(w.message):
            seen.append(f"torch: {w.message}")
        else:                            # the rest as they came
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def _check_preset(preset_name, R, me, torch, precision):
    import mok_torch
    from benchmarks.common import capture_graph
    from mok_core.config import MoKConfig, preset
    from mok_testing import synthetic
    from mok_testing.sampled import covering_tokens, grad_errors, reference_tokens
    shape = preset(preset_name, ep_size=R)
    if not _fits(shape, precision, torch):
        pytest.skip(f"{preset_name} EP{R} {precision}: a rank's weights, gradients and "
                    f"buffers exceed this GPU's memory")
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
    layer = mok_torch.Layer(shape, T, MoKConfig(**CONFIGS[precision]))
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
        with _no_host_waits(torch) as waits:  # (the same gradients again; asserted last)
            step()

        assert (G.d_router_weights[ids < 0] == 0).all()
        expert = lambda e: synthetic.expert_weights(shape, e, dev)          # noqa: E731
        pick = covering_tokens(ids, 24)                     # every expert they reach
        ref = reference_tokens(x[pick], ids[pick], w[pick], shared, expert)
        got = out[pick].double()
        errs = {"out": float((got - ref).abs().sum() / ref.abs().sum())}
        cos = {"out": float((got * ref).sum() / (got.norm() * ref.norm()))}
        errs.update(grad_errors(inputs, d_outs, me, G, shared, expert, E_l))
        cos.update(grad_errors(inputs, d_outs, me, G, shared, expert, E_l, measure="cosine"))
        bad = {n: (e, cos[n], _bounds(precision, n)) for n, e in errs.items()
               if not (e < _bounds(precision, n)[0] and cos[n] >= _bounds(precision, n)[1])}
        assert not bad, (f"{preset_name} {precision} rank {me}: (rel-L1, cosine, bounds) out "
                         f"of bounds: {bad} (all rel-L1: {errs})")

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
        assert not waits, f"{preset_name} {precision} rank {me}: the eager step waited: {waits}"
        return errs, cos
    finally:
        torch.cuda.synchronize()
        layer.comm.free()
        del layer, weights, inputs, d_outs, grads, graph
        gc.collect()                     # the next preset needs the memory back
        torch.cuda.empty_cache()


def _check_fused_push(R, me, torch, precision):
    """The routed d_x rows pushed home from the d_x GEMM's epilogue (the default,
    ``Layer.fused_d_x_push``) against written and sent by the combine kernel
    (``MoKConfig(fuse_combine=False)``): the output and all 8 gradients bit for bit."""
    import dataclasses

    import mok_torch
    from mok_core.config import MoKConfig, preset
    from mok_testing import synthetic
    shape = preset("qwen3.5-397b", ep_size=R)
    if not _fits(shape, precision, torch):
        pytest.skip(f"qwen3.5-397b EP{R} {precision}: a rank's weights, gradients and buffers "
                    "exceed this GPU's memory")
    dev = torch.device("cuda", torch.cuda.current_device())
    x, ids, w = synthetic.rank_inputs(shape, T, me, dev, skew=0.3, masked=0.01)
    d_out = torch.randn(T, shape.hidden, device=dev,
                        generator=torch.Generator(dev).manual_seed(100 + me)).bfloat16()
    weights = mok_torch.Weights(*synthetic.shared_weights(shape, dev),
                                *synthetic.local_expert_weights(shape, me, dev))
    digests = []
    for fuse in (True, False):
        cfg = dataclasses.replace(MoKConfig(**CONFIGS[precision]), fuse_combine=fuse)
        layer = mok_torch.Layer(shape, T, cfg)
        try:
            assert layer.fused_d_x_push == fuse and (layer.grad.d_x_rows is None) == fuse
            out, ctx = layer.forward(x, ids, w, weights)
            G = layer.backward(ctx, d_out, w, weights)
            digests.append(_digests((out, *G), torch))
            torch.cuda.synchronize()
            layer.check()
        finally:
            torch.cuda.synchronize()
            layer.comm.free()
            del layer
            gc.collect()
            torch.cuda.empty_cache()
    assert torch.equal(digests[0], digests[1]), \
        f"{precision} EP{R}: the pushing d_x GEMM differs from the combine kernel's rows"


def _summary(errs, cos):
    return (", ".join(f"{k} {v:.1e}" for k, v in errs.items())
            + f"; cosine min {min(cos.values()):.6f}")


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("preset_name", PRESETS)
def test_backward_ep1(dist, preset_name, precision):
    torch = pytest.importorskip("torch")
    errs, cos = _check_preset(preset_name, 1, 0, torch, precision)
    print(f"{preset_name} {precision} EP1 rel-L1: {_summary(errs, cos)}")


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("preset_name", PRESETS)
def test_backward_ep(nvshmem_world, preset_name, precision):
    torch = pytest.importorskip("torch")
    R, me = nvshmem_world.world_size, nvshmem_world.rank
    errs, cos = _check_preset(preset_name, R, me, torch, precision)
    print(f"{preset_name} {precision} EP{R} rank {me} rel-L1: {_summary(errs, cos)}")


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_fused_d_x_push_ep1(dist, precision):
    torch = pytest.importorskip("torch")
    _check_fused_push(1, 0, torch, precision)


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_fused_d_x_push_ep(nvshmem_world, precision):
    torch = pytest.importorskip("torch")
    _check_fused_push(nvshmem_world.world_size, nvshmem_world.rank, torch, precision)
