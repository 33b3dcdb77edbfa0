"""Training integration on real GPUs at a real shape: variable tokens per step on one workspace
(eager, CUDA graph and backward: a token's results never depend on the other tokens of its step,
bit for bit), and ``mok_torch.MoEBlock`` through autograd and ``torch.compile`` equal to the
manual layer path, in bf16 and FP8.

One process: EP 1. ``torchrun --nproc-per-node=2`` / ``mok_comm.launch``: EP 2, every rank
bringing a different count."""
import pytest

T_MAX = 4096
PRESET = "qwen3.5-397b"
COUNTS = [(4096, 4096), (1000, 4096), (1, 0), (0, 1), (4096, 2500)]


@pytest.fixture(scope="module")
def ep(dist):
    """(rank, world): EP 1 in one process, else the NVSHMEM world over torch.distributed."""
    if dist.world < 2:
        return 0, 1
    import os

    import torch.distributed as td

    from mok_comm.launch import bootstrap
    if not td.is_initialized():
        td.init_process_group("cpu:gloo,cuda:nccl")
    bootstrap.init("env" if os.environ.get("MOK_UID_FILE") else "torch")
    return dist.rank, dist.world


def _setup(ep, torch):
    import mok_torch
    from mok_core.config import preset
    from mok_testing import synthetic
    me, R = ep
    shape = preset(PRESET, ep_size=R)
    dev = torch.device("cuda", torch.cuda.current_device())
    x, ids, w = synthetic.rank_inputs(shape, T_MAX, me, dev, skew=0.3, masked=0.01)
    weights = mok_torch.Weights(*synthetic.shared_weights(shape, dev),
                                *synthetic.local_expert_weights(shape, me, dev))
    d_out = torch.randn(T_MAX, shape.hidden, device=dev,
                        generator=torch.Generator(dev).manual_seed(7 + me)).bfloat16()
    return shape, (x, ids, w), weights, d_out


def test_variable_tokens(ep):
    import torch

    import mok_torch
    me, R = ep
    shape, (x, ids, w), weights, d_out = _setup(ep, torch)
    layer = mok_torch.Layer(shape, T_MAX)
    step = layer.compile(weights)
    full, ctx = layer.forward(x, ids, w, weights)
    g_full = layer.backward(ctx, d_out, w, weights)
    for counts in COUNTS:
        T = counts[me % 2]
        out, ctx = layer.forward(x[:T], ids[:T], w[:T], weights)
        g = layer.backward(ctx, d_out[:T], w[:T], weights)
        graphed = step(x[:T], ids[:T], w[:T])
        torch.cuda.synchronize()
        layer.check()
        assert out.shape == (T, shape.hidden) and g.d_x.shape == (T, shape.hidden)
        assert torch.equal(out, full[:T]), counts
        assert torch.equal(graphed, full[:T]), counts
        assert torch.equal(g.d_x, g_full.d_x[:T]), counts
        assert torch.equal(g.d_router_weights, g_full.d_router_weights[:T]), counts
    assert step.captures == 1                     # one graph served every count
    with pytest.raises(ValueError, match=f"x: {T_MAX + 1} tokens on rank {me}"):
        layer.forward(torch.cat([x, x[:1]]), torch.cat([ids, ids[:1]]),
                      torch.cat([w, w[:1]]), weights)


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_module_autograd_and_compile(ep, precision):
    """MoEBlock's forward and every gradient equal the manual layer step's and backward's on
    the same parameters and routing, eager and under torch.compile(fullgraph=True); FP8: the
    block and the manual layer each quantise the bf16 weights they are given."""
    import torch

    import mok_torch
    from mok_core.config import MoKConfig
    me, R = ep
    shape, _, weights, d_out = _setup(ep, torch)
    dev = d_out.device
    torch.manual_seed(0)
    block = mok_torch.MoEBlock(shape.hidden, shape.intermediate, shape.shared_intermediate,
                               shape.num_experts, shape.topk, max_tokens=T_MAX,
                               config=MoKConfig(precision=precision))
    with torch.no_grad():
        for p, w in zip(block.expert_weights(), weights):
            p.copy_(w)
    # the manual path reads the block's own storage (detached): a second copy of the weights
    # would not leave an H100 room for the gradients compared below (FP8: and its copies)
    weights = mok_torch.Weights(*(p.detach() for p in block.expert_weights()))
    x = torch.randn(T_MAX, shape.hidden, device=dev,
                    generator=torch.Generator(dev).manual_seed(11 + me)).bfloat16()

    def run(fn):
        block.zero_grad(set_to_none=True)
        xl = x.clone().requires_grad_()
        y = fn(xl)
        y.backward(d_out)
        return y.detach(), xl.grad, [p.grad for p in block.expert_weights()]

    y, d_x, d_w = run(block)
    ids, rw = block.router(x)
    ids, rw = ids.detach(), rw.detach().float().contiguous()
    out, ctx = block.layer.forward(x, ids, rw, weights)
    want = block.layer.backward(ctx, d_out, rw, weights)
    torch.cuda.synchronize()
    block.layer.check()
    assert torch.equal(y, out)
    for got, ref in zip(d_w, want[2:]):
        assert torch.equal(got, ref)
    # d_x: the layer's plus the router's path (x -> scores -> weights): not the layer's alone
    assert torch.isfinite(d_x.float()).all() and not torch.equal(d_x, want.d_x)
    del want, ctx, out                  # (memory: at most two sets of gradients from here on)
    # aot_eager: the same torch ops around the two custom ops, so bit for bit
    yc, d_xc, d_wc = run(torch.compile(block, backend="aot_eager", fullgraph=True))
    assert torch.equal(yc, y) and torch.equal(d_xc, d_x)
    for a, b in zip(d_wc, d_w):
        assert torch.equal(a, b)
    # (memory: d_w waits on the host -- beside the block's weights, FP8 copies and the
    # inductor run's gradients an H100 has no room for a second set)
    del d_wc
    d_w = [None if g is None else g.cpu() for g in d_w]
    torch.cuda.empty_cache()
    # inductor fuses the router's float ops (its own roundings): close, not bitwise
    yi, d_xi, d_wi = run(torch.compile(block, fullgraph=True))

    def rel(a, b):                      # 2**26 elements at a time: no float copy of a
        num = den = 0.0                 # weight-sized gradient (an H100 has no room for it)
        rows = max(1, (1 << 26) // a[0].numel())
        for x, y in zip(a.split(rows), b.split(rows)):
            y = y.to(x.device)
            num += float((x.float() - y.float()).abs().sum())
            den += float(y.float().abs().sum())
        return num / den
    assert rel(yi, y) < 1e-2 and rel(d_xi, d_x) < 1e-2
    for a, b in zip(d_wi, d_w):
        assert a is None or rel(a, b) < 1e-2
