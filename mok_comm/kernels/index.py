"""Row index of every expert-sorted row into the token staging buffer (GEMM A gather)."""
from numba import cuda

from mok_core.cuda_compat import kjit


@kjit
def gather_index_kernel(src_rank, src_token, T, out):
    """out[row] = src_rank*T + src_token, or -1 on padding rows. Any grid."""
    i = cuda.grid(1)
    while i < out.shape[0]:
        r = src_rank[i]
        out[i] = r * T + src_token[i] if r >= 0 else -1
        i += cuda.gridsize(1)
