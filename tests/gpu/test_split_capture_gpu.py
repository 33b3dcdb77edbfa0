"""The split dispatch's side stream on a real GPU, inside and outside a CUDA graph: R ranks
emulated on one GPU (any process count), so the fork / join and the copy-engine copies between
ranks' staging buffers are checked before any multi-GPU run."""
import numpy as np

from comm_support import make_routing

H, E, K = 7168, 384, 8


def test_split_dispatch_captured_equals_eager(dist):
    import torch

    from benchmarks.common import numba_stream
    from mok_comm import dispatch, routing
    from comm_support import EmulatedGroup
    from mok_core.config import MoKConfig
    from mok_core.cuda_compat import to_host
    from mok_core.schedule import Schedule, build_schedule
    R, T = 2, 512
    rng = np.random.default_rng(3)
    ids = make_routing(rng, R, T, K, E, skew=0.3, masked=0.02)
    cfg = MoKConfig(capacity_factor=1.0, minibatch_size=1024)
    s = numba_stream()
    group = EmulatedGroup(R, tokens_per_rank=T, hidden=H, topk=K, num_experts=E, config=cfg,
                          stream=s)
    wss = group.workspaces
    scheds = [Schedule.allocate(rank=r, ep_size=R, tokens_per_rank=T, topk=K, num_experts=E,
                                config=cfg, capacity=wss[r].capacity, stream=s)
              for r in range(R)]
    x = [torch.randn(T, H, device="cuda", dtype=torch.bfloat16) for _ in range(R)]
    for r, ws in enumerate(wss):
        dispatch.publish_x(ws, *dispatch.check_x(ws, x[r].view(torch.uint16)), stream=s)
        routing.publish_ids(ws, routing.check_ids(ws, torch.from_numpy(ids[r]).cuda()), stream=s)
    group.barrier()
    for r, ws in enumerate(wss):
        build_schedule(scheds[r], ws.ids_table, stream=s)
    staging = [torch.as_tensor(ws.x_recv, device="cuda").view(torch.int16).view(R, T, H)
               for ws in wss]                       # int16 views: torch's uint16 has few ops

    def dispatch_all():
        for r, ws in enumerate(wss):
            dispatch.split(ws, scheds[r], stream=numba_stream(), ce_share=0.5)

    def clear_peer_slices():
        for r in range(R):
            for q in range(R):
                if q != r:
                    staging[r][q].zero_()

    clear_peer_slices()
    dispatch_all()                                   # eager
    torch.cuda.synchronize()
    eager = [st.clone() for st in staging]
    for r, ws in enumerate(wss):                     # every needed token staged
        needed = ((ids >= 0) & (ids // (E // R) == r)).any(axis=2)
        needed[r] = True
        got = eager[r].cpu().numpy()
        for q in range(R):
            want = x[q].view(torch.int16).cpu().numpy()
            np.testing.assert_array_equal(got[q][needed[q]], want[needed[q]])
        np.testing.assert_array_equal(to_host(scheds[r].ready), to_host(scheds[r].minibatch_rows))

    clear_peer_slices()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        dispatch_all()
    g.replay()
    torch.cuda.synchronize()
    for r in range(R):
        assert torch.equal(staging[r], eager[r]), f"rank {r}: captured split dispatch differs"
        # no schedule rebuild in between: the replay counted every row a second time
        np.testing.assert_array_equal(to_host(scheds[r].ready),
                                      2 * to_host(scheds[r].minibatch_rows))
    group.check()
    del g
