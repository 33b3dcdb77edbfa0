"""1,000 back-to-back steps with random valid routing (skewed, masked routes, a new routing every
step) through the compiled step: bitwise equal to a re-run, no error reported, no device memory
growth. One process per GPU; each rank runs its own EP-1 layer (qwen shape, 4096 tokens)."""
import pytest

STEPS = 1000


def _run(layer, step, inputs, torch):
    """Per-step checksums of the outputs (on the device: nothing syncs inside the loop), each
    element weighted by its position: rows swapped change the sum."""
    sums = torch.empty(STEPS, dtype=torch.int64, device="cuda")
    n = layer.tokens_per_rank * layer.shape.hidden
    mix = (torch.arange(n, device="cuda", dtype=torch.int64) % 65521 + 1).view(
        -1, layer.shape.hidden)
    for i in range(STEPS):
        x, ids, w = inputs(i)
        out = step(x, ids, w)
        sums[i] = (out.view(torch.int16).to(torch.int64) * mix).sum()
    return sums, out


def test_thousand_steps_bitwise_repeatable(dist):
    torch = pytest.importorskip("torch")
    import mok_torch
    from mok_core.config import MoKConfig, preset
    from mok_testing import synthetic

    shape, T, dev = preset("qwen3.5-397b", 1), 4096, "cuda"
    layer = mok_torch.Layer(shape, T, MoKConfig())
    W = mok_torch.Weights(*synthetic.shared_weights(shape, dev),
                          *synthetic.local_expert_weights(shape, 0, dev))
    step = layer.compile(W)
    base = [synthetic.rank_inputs(shape, T, 0, dev, seed=s, skew=s * 0.2, masked=0.02 * s)
            for s in range(4)]
    perms = torch.stack([torch.randperm(T, device=dev, generator=torch.Generator(dev)
                                        .manual_seed(i)) for i in range(16)])

    def inputs(i):                      # a different valid routing every step
        x, ids, w = base[i % 4]
        p = perms[i % 16]
        return x, ids[p].contiguous(), w[p].contiguous()

    runs = []
    for _ in range(2):
        sums, out = _run(layer, step, inputs, torch)
        pending = len(layer.errors.pending)       # bounded by the ring, whatever the host did
        layer.check()
        runs.append((sums.cpu(), out.cpu()))
        del sums, out
        torch.cuda.synchronize()
        if len(runs) == 1:
            mem = torch.cuda.memory_allocated()
        assert pending <= layer.errors.slots
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    assert torch.cuda.memory_allocated() <= mem
    assert step.captures == 1
