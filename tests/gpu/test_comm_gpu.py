"""mok_comm across real GPUs over NVSHMEM: round trip at real shapes, bitwise repeatability,
and a peer that never arrives. Run with >= 2 processes (torchrun or mok_comm.launch)."""
import numpy as np
import pytest

from comm_support import identity_expert_kernel, reference_round_trip

H, E, K = 7168, 384, 8


def _inputs(R, T, seed):
    from benchmarks.common import gumbel_topk_ids
    rng = np.random.default_rng(seed)          # same on every rank: all ranks know all inputs
    ids = gumbel_topk_ids(rng, R, T, E, K)
    ids[rng.random(ids.shape) < 0.02] = -1
    return ids


@pytest.mark.parametrize("T,variant", [(4096, "pull"), (8192, "pull"), (4096, "split"),
                                       (8192, "split")])
def test_round_trip_real_shape(nvshmem_world, T, variant):
    import torch
    from numba import cuda

    from benchmarks.common import comm_setup, numba_stream
    from mok_comm import barrier, combine, dispatch, routing
    from mok_core.config import MoKConfig
    from mok_core.schedule import build_schedule
    R, me = nvshmem_world.world_size, nvshmem_world.rank
    ids = _inputs(R, T, seed=T)
    g = torch.Generator(device="cuda").manual_seed(100 + me)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.rand(T, K, device="cuda", dtype=torch.float32, generator=g)
    ys = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
    s = numba_stream()
    cfg = MoKConfig(capacity_factor=1.0)
    heap, ws, sched = comm_setup(T, H, K, E, cfg, s)
    idx = cuda.device_array(ws.capacity, np.int32)
    y = torch.empty(ws.capacity, H, device="cuda", dtype=torch.bfloat16)
    u16 = torch.uint16
    d_ids = routing.check_ids(ws, torch.from_numpy(ids[me]).cuda())
    xv, _ = dispatch.check_x(ws, x.view(u16))
    yv = combine.check_y(ws, y.view(u16))

    def forward(out):
        dispatch.publish_x(ws, xv, None, stream=s)
        routing.publish_ids(ws, d_ids, stream=s)
        barrier.barrier(ws, stream=s)
        build_schedule(sched, ws.ids_table, stream=s)
        if variant == "split":
            dispatch.split(ws, sched, stream=s, ce_share=0.5)
        else:
            dispatch.pull(ws, sched, stream=s)
        dispatch.gather_index(ws, sched, idx, stream=s)
        identity_expert_kernel[264, 256, s](ws.x_recv.reshape(ws.x_recv.size), idx,
                                            sched.num_rows, yv.reshape(yv.size), H)
        combine.combine(ws, sched, yv, stream=s)
        barrier.barrier(ws, stream=s)
        combine.epilogue(ws, *combine.check_epilogue(ws, w, out.view(u16), ys.view(u16)),
                         stream=s)

    try:
        outs = run_reps(forward, T)
        ws.check()                                     # no timeout recorded
        sched.check()                                  # no bad id / overflow recorded
        # the last repetition's dispatch counted every staged row once, in its minibatch
        from mok_core.cuda_compat import to_host
        np.testing.assert_array_equal(to_host(sched.ready), to_host(sched.minibatch_rows))
    finally:
        torch.cuda.synchronize()
        heap.free()
    want = reference_round_trip(x.view(u16).cpu().numpy()[None], ids[me:me + 1],
                                w.cpu().numpy()[None], ys.view(u16).cpu().numpy()[None])[0]
    np.testing.assert_array_equal(outs[0].view(u16).cpu().numpy(), want)
    for rep, o in enumerate(outs[1:], 1):
        assert torch.equal(o.view(u16), outs[0].view(u16)), f"repetition {rep} differs"


def run_reps(forward, T, reps=20):
    import torch
    outs = []
    for rep in range(reps):
        out = torch.full((T, H), float("nan"), device="cuda", dtype=torch.bfloat16)
        forward(out)
        outs.append(out)
    torch.cuda.synchronize()
    return outs


def test_peer_never_arrives_times_out(nvshmem_world):
    import torch

    from benchmarks.common import numba_stream
    from mok_comm.barrier import barrier
    from mok_comm.heap import NvshmemHeap
    from mok_comm.workspace import create_workspace
    from mok_core.config import MoKConfig
    from mok_core.errors import MoKError
    me = nvshmem_world.rank
    s = numba_stream()
    heap = NvshmemHeap(stream=s)
    small = dict(tokens_per_rank=8, hidden=64, topk=1, num_experts=8, stream=s)
    try:
        ws = create_workspace(heap, config=MoKConfig(spin_timeout_cycles=200_000_000), **small)
        sync_ws = create_workspace(heap, config=MoKConfig(), **small)   # a healthy barrier
        torch.cuda.synchronize()
        barrier(ws, stream=s)                      # everyone in step: epoch 1
        torch.cuda.synchronize()
        if me == 0:
            barrier(ws, stream=s)                  # nobody else comes (for now)
            torch.cuda.synchronize()
            with pytest.raises(MoKError, match=r"spin-wait timeout on rank 0: counter "
                                               r"'barrier' of peer rank 1 expected >= 2, saw 1"):
                ws.check()
        barrier(sync_ws, stream=s)                 # rank 0 comes here after its timeout
        torch.cuda.synchronize()
        if me != 0:
            barrier(ws, stream=s)                  # late arrivals: epoch 2 completes
        torch.cuda.synchronize()
        sync_ws.check()
    finally:
        torch.cuda.synchronize()
        heap.free()
