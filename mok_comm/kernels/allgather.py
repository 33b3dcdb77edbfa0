"""Routing all-gather: every rank pushes its top-k ids into row ``me`` of every rank's
gathered table ([R, T, k] int32) with direct stores over NVLink; a barrier then makes the whole
table visible everywhere. No multicast (off on our hosts), no host round trip."""
from numba import cuda

from mok_core.cuda_compat import kjit


@kjit
def push_ids_kernel(me, ids, peer_tables):
    """Launch: any grid. ids int32 [T*k] (this rank's); peer_tables: tuple of int32 [R*T*k]."""
    n = ids.shape[0]
    base = me * n
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < n:
        v = ids[i]
        for p in range(len(peer_tables)):
            peer_tables[p][base + i] = v
        i += stride
