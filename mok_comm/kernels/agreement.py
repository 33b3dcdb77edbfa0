"""Do all ranks run the same layer? Each rank pushes a fingerprint of its shapes and config into
row ``me`` of every rank's table; after a barrier each rank compares every row with its own and
sets ERR_RANK_MISMATCH on any difference (the host checks once, at workspace creation)."""
from numba import cuda

from mok_core import errors as err
from mok_core.cuda_compat import kjit


@kjit
def push_fingerprint_kernel(me, mine, peer_tables):
    """Launch [1, 32]. mine int32 [W]; peer_tables: tuple of int32 [R*W]."""
    w = mine.shape[0]
    for i in range(cuda.threadIdx.x, w, cuda.blockDim.x):
        for p in range(len(peer_tables)):
            peer_tables[p][me * w + i] = mine[i]


@kjit
def compare_fingerprints_kernel(me, table, errors):
    """Launch [1, 32]. table int32 [R, W] (every rank's fingerprint)."""
    for i in range(cuda.threadIdx.x, table.shape[0] * table.shape[1], cuda.blockDim.x):
        r = i // table.shape[1]
        c = i % table.shape[1]
        if table[r, c] != table[me, c]:
            cuda.atomic.or_(errors, err.FLAGS, err.ERR_RANK_MISMATCH)
