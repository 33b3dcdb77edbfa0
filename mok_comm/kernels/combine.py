"""Push combine: each expert output row goes home -- stored straight into its source rank's
symmetric combine buffer at the route's unique row ``token * k + slot`` (no atomics, no write
conflicts). Router weights are not applied here; the source's epilogue does that in a fixed
order. Warp per row, rows dealt in order to the comm blocks; padding rows are skipped."""
from numba import cuda, uint16

from mok_core.cuda_compat import kjit
from mok_core.errors_kernels import record_timeout

from .bulk import copy_row_bulk, warp_buffer
from .dispatch import copy_row

COUNTER_BULK_COPY = 5           # errors.COUNTER_NAMES: a bulk row push that never landed


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


@kjit
def push_combine_bulk_kernel(me, y, src_rank, src_token, src_slot, num_rows, peer_combine, H, k,
                             chunk, timeout_cycles, errors):
    """Variant of ``push_combine_kernel`` (+ this rank, the bounded-wait pair; same result):
    lane 0 of each warp pushes the row with bulk async copies (``kernels.bulk``): y -> shared
    memory -> the source rank's combine row. Launch: block = 32 * BULK_WARPS threads,
    dynamic shared memory ``bulk_smem_bytes(chunk)``. A timed-out chunk is recorded (counter
    'combine_bulk_copy') and the warp stops."""
    smem = cuda.shared.array(0, uint16)
    buf, bar = warp_buffer(smem, chunk)
    warps = cuda.blockDim.x // 32
    phase = 0
    rows = num_rows[0]
    row = cuda.blockIdx.x * warps + cuda.threadIdx.x // 32
    while row < rows:
        r = src_rank[row]
        if r >= 0 and cuda.threadIdx.x % 32 == 0:
            dst = (src_token[row] * k + src_slot[row]) * H
            phase, done = copy_row_bulk(smem, buf, bar, phase, y, row * H, peer_combine[r], dst,
                                        H, chunk, timeout_cycles)
            if done < 2 * H:
                record_timeout(errors, me, COUNTER_BULK_COPY, 2 * H, done, r)
                return
        row += cuda.gridDim.x * warps
