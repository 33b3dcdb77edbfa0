"""Thread-block clusters from numba (``cuda_compat.launch_cluster``): every block sees its rank
in its cluster, and a cluster barrier with blocks that really run side by side completes; the
multicast loads and remote mbarrier arrivals between the blocks of a cluster."""
import numpy as np
import pytest


@pytest.mark.parametrize("cluster", [1, 2, 4])
def test_cluster_launch_ranks(dist, cluster):
    from numba import cuda

    from mok_core.cuda_compat import launch_cluster, to_host
    from test_intrinsics import _cluster_ranks
    blocks, threads = 16, 64
    out = cuda.to_device(np.full(blocks * threads, -1, np.int32))
    launch_cluster(_cluster_ranks, blocks, cluster, threads, 0, 0, out)
    cuda.synchronize()
    want = np.repeat(np.arange(blocks) % cluster, threads).astype(np.int32)
    np.testing.assert_array_equal(to_host(out), want)


def test_cluster_share_multicast_and_remote_arrivals(dist):
    """Clusters of 2: each block's share of a slice (TMA box + bulk copy) lands in both blocks;
    arrivals on the peer's barrier through mapa are seen with acquire at cluster scope."""
    from numba import cuda

    from test_intrinsics import cluster_share_check
    cluster_share_check(2, 8)
    cuda.synchronize()
