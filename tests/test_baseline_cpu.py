"""The torch-native EP baseline (benchmarks/baselines) is a correct MoE layer: one process,
gloo, CPU tensors, vs the float64 reference -- so the GPU benchmark compares like with like."""
import socket

import pytest
import torch
import torch.distributed as dist

from mok_core.config import LayerShape
from mok_torch import synthetic
from mok_torch.reference import reference_tokens


@pytest.fixture
def gloo_world_of_one(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("limit", [None, 0.7])
def test_torch_native_baseline_matches_reference(gloo_world_of_one, limit):
    from benchmarks.baselines.torch_native import TorchNativeEP
    shape = LayerShape(hidden=64, intermediate=32, shared_intermediate=32, num_experts=4,
                       topk=2, ep_size=1)
    x, ids, w = synthetic.rank_inputs(shape, 40, 0, "cpu", masked=0.1, skew=0.5)
    wg, wu, wd = synthetic.local_expert_weights(shape, 0, "cpu")
    shared = synthetic.shared_weights(shape, "cpu")
    out = TorchNativeEP(*shared, wg, wu, wd).forward(x, ids, w, swiglu_limit=limit)
    ref = reference_tokens(x, ids, w, shared, lambda e: synthetic.expert_weights(shape, e, "cpu"),
                           limit)
    assert float((out.double() - ref).abs().sum() / ref.abs().sum()) < 1e-2
