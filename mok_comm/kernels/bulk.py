"""Row copies with bulk async copies through shared memory (the ``variant="bulk"`` dispatch and
combine): lane 0 of a warp moves a row src -> shared memory (``cp.async.bulk``, landing counted
in bytes on the warp's mbarrier) -> dst (bulk store), ``chunk`` bytes at a time. Either end may
be a peer's memory, so the SM's copy unit, not 32 lanes of 16-byte requests, holds the NVLink
traffic in flight.

Shared memory of a block: BULK_WARPS buffers of ``chunk`` bytes, then one mbarrier per warp
(``bulk_smem_bytes``). Every wait is bounded: a chunk that has not landed after
``timeout_cycles`` makes ``copy_row_bulk`` return early; the caller records it in the error
word (its counter names the phase) and the host raises.
"""
from numba import cuda

from mok_core.cuda_compat import kjit
from mok_core.intrinsics import (bulk_commit, bulk_load, bulk_store, bulk_wait, clock64,
                                 mbarrier_arrive_expect_tx, mbarrier_init, mbarrier_try_wait,
                                 shared_addr)

BULK_WARPS = 8                  # warps per block of a bulk kernel
BULK_CHUNK = 8192               # default bytes of shared memory per warp


def bulk_smem_bytes(chunk):
    """Dynamic shared memory of a bulk block: a chunk buffer + an mbarrier per warp."""
    return BULK_WARPS * (chunk + 8)


@kjit(device=True, inline="always")
def warp_buffer(smem, chunk):
    """(buffer, mbarrier) shared byte addresses of this warp; initialises the barriers (one
    arrival per phase: lane 0's expect_tx). Call once, from every thread of the block."""
    warps = cuda.blockDim.x // 32
    warp = cuda.threadIdx.x // 32
    base = shared_addr(smem)
    bar = base + warps * chunk + 8 * warp
    if cuda.threadIdx.x % 32 == 0:
        mbarrier_init(smem, bar, 1)
    cuda.syncthreads()
    return base + warp * chunk, bar


@kjit(device=True, inline="always")
def copy_row_bulk(smem, buf, bar, phase, src, src_off, dst, dst_off, width, chunk,
                  timeout_cycles):
    """Lane 0 only: ``width`` uint16 from src[src_off:] to dst[dst_off:] (16-byte aligned).
    Returns (mbarrier phase for the next call, bytes copied); fewer than ``2 * width`` bytes
    means a chunk timed out and the rest of the row was not written."""
    row_bytes = width * 2
    off = 0
    while off < row_bytes:
        n = min(chunk, row_bytes - off)
        mbarrier_arrive_expect_tx(smem, bar, n)
        bulk_load(smem, buf, src, src_off + off // 2, n, bar)
        start = clock64()
        while mbarrier_try_wait(smem, bar, phase) == 0:
            if clock64() - start > timeout_cycles:
                return phase, off
        phase ^= 1
        bulk_store(dst, dst_off + off // 2, smem, buf, n)
        bulk_commit()
        bulk_wait(0)                    # the buffer is free again and the chunk is written
        off += n
    return phase, off
