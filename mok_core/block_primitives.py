"""Block-wide device primitives shared by kernels (integer, deterministic, simulator-safe).

They use shared memory and ``syncthreads`` only -- no warp shuffles -- so the same code runs
under the CUDA simulator. Every thread of the block must call them (they synchronise).
"""
from numba import cuda, int32

from .cuda_compat import kjit

MAX_BLOCK_THREADS = 1024


@kjit(device=True)
def block_exclusive_scan(value, scratch):
    """Exclusive prefix sum of one int per thread over the block, in thread order.

    Arguments:
        value: this thread's int.
        scratch: shared int32[>= blockDim.x], clobbered.
    Returns:
        (sum of values of lower threads, sum over the whole block).
    """
    tid = cuda.threadIdx.x
    n = cuda.blockDim.x
    scratch[tid] = value
    cuda.syncthreads()
    offset = 1
    while offset < n:                 # Hillis-Steele: log2(n) rounds, fixed order, no atomics
        addend = int32(0)
        if tid >= offset:
            addend = scratch[tid - offset]
        cuda.syncthreads()
        scratch[tid] += addend
        cuda.syncthreads()
        offset *= 2
    inclusive = scratch[tid]
    total = scratch[n - 1]
    cuda.syncthreads()                # scratch may be reused by the caller right away
    return inclusive - value, total


@kjit(device=True)
def block_scan_in_place(a, n, scratch):
    """a[0:n] -> its exclusive prefix sums and a[n] -> their total, in index order (chunks of
    the block's threads, each ``block_exclusive_scan``ned: a fixed order). ``a`` (int32, n + 1
    slots, shared or global) may be written by any thread of the block before the call (it
    syncs first); the total is returned to every thread.

    Arguments:
        a: int32[>= n + 1], scanned in place.
        n: how many values.
        scratch: shared int32[>= blockDim.x], clobbered.
    """
    cuda.syncthreads()
    tid = cuda.threadIdx.x
    carry = 0
    for base in range(0, n, cuda.blockDim.x):   # uniform trip count: every thread scans
        i = base + tid
        v = 0
        if i < n:
            v = a[i]
        before, total = block_exclusive_scan(v, scratch)    # (every read of a chunk first)
        if i < n:
            a[i] = carry + before
        carry += total
    if tid == 0:
        a[n] = carry
    cuda.syncthreads()
    return carry
