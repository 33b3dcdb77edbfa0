"""Schedule kernels at real shapes on the GPU == the NumPy reference, bit for bit."""
import numpy as np
import pytest

from mok_core.config import MoKConfig
from mok_core.schedule import Schedule, build_schedule, build_schedule_numpy


def routing(rng, R, T, k, E):
    scores = rng.random((R * T, E), dtype=np.float32)
    ids = np.argpartition(scores, -k, axis=1)[:, -k:]
    ids = ids.reshape(R, T, k).astype(np.int32)
    ids[rng.random(ids.shape) < 0.01] = -1            # a few masked routes
    return ids


@pytest.mark.parametrize("R", [2, 8])
@pytest.mark.parametrize("T", [4096, 16384])
def test_schedule_real_shapes(dist, R, T):
    from numba import cuda
    k, E = 8, 384
    rng = np.random.default_rng(1000 * R + T)
    ids = routing(rng, R, T, k, E)
    cfg = MoKConfig(capacity_factor=1.0)
    rank = dist.rank % R
    s = Schedule.allocate(rank=rank, ep_size=R, tokens_per_rank=T, topk=k, num_experts=E,
                          config=cfg)
    d_ids = cuda.to_device(ids)
    build_schedule(s, d_ids)
    got = s.to_host()
    s.check()
    want = build_schedule_numpy(ids, rank, E // R, s.capacity, cfg.row_align,
                                minibatch_size=cfg.minibatch_size)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    # and a second build on the same buffers is identical
    build_schedule(s, d_ids)
    again = s.to_host()
    for name in want:
        np.testing.assert_array_equal(again[name], got[name], err_msg=name)


def test_host_array_rejected(dist):
    cfg = MoKConfig()
    s = Schedule.allocate(rank=0, ep_size=2, tokens_per_rank=8, topk=2, num_experts=4,
                          config=cfg)
    with pytest.raises(TypeError, match="host NumPy array"):
        build_schedule(s, np.zeros((2, 8, 2), np.int32))
