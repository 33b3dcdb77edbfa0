"""Push combine: each expert output row goes home -- stored straight into its source rank's
symmetric combine buffer at the route's unique row ``token * k + slot`` (no atomics, no write
conflicts). Router weights are not applied here; the source's epilogue does that in a fixed
order. Warp per row, rows dealt in order to the comm blocks; padding rows are skipped."""
from numba import cuda

from mok_core.cuda_compat import kjit

from .dispatch import copy_row


@kjit
def push_combine_kernel(y, src_rank, src_token, src_slot, num_rows, peer_combine, H, k):
    """Launch: grid = comm blocks, block = 32 * warps threads.

    y             uint16 [capacity*H]         expert outputs, expert-sorted rows
    src_*         int32 [capacity]            schedule pull table
    peer_combine  tuple over ranks of uint16 [T*k*H]
    """
    warps = cuda.blockDim.x // 32
    lane = cuda.threadIdx.x % 32
    rows = num_rows[0]
    row = cuda.blockIdx.x * warps + cuda.threadIdx.x // 32
    while row < rows:
        r = src_rank[row]
        if r >= 0:
            dst = (src_token[row] * k + src_slot[row]) * H
            copy_row(y, row * H, peer_combine[r], dst, H, lane)
        row += cuda.gridDim.x * warps
