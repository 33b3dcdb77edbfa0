"""Cross-rank barrier from flag words on peer memory (no NVSHMEM device calls, no multicast).

Counters:  flags[p] on rank q = the barrier epoch rank p has reached (written by p with a
           system-scope *release* store); epoch[0] = this rank's count of barriers (local).
Arrive:    epoch += 1; release-store epoch into flags[me] of every rank (me included).
Wait:      acquire-load flags[p] until it reaches epoch, for every p; bounded by
           ``timeout_cycles`` -- on expiry record (rank, counter 'barrier', expected, seen, peer)
           in the error word and return (the host raises; never a silent hang).
Epochs only grow, so nothing is reset between barriers and a CUDA-graph replay just keeps
counting. Kernel boundaries order the data: everything the stream wrote before the barrier
(including stores into peers' memory) is complete before the arrive's fenced release store.
"""
from numba import cuda

from mok_core.cuda_compat import kjit
from mok_core.errors_kernels import record_timeout
from mok_core.intrinsics import clock64, ld_acquire_sys, nanosleep, st_release_sys

COUNTER_BARRIER = 0


@kjit(device=True)
def arrive(me, epoch, peer_flags):
    """Thread 0 only. Returns the epoch this barrier waits for."""
    e = epoch[0] + 1
    epoch[0] = e
    cuda.threadfence_system()
    for p in range(len(peer_flags)):
        st_release_sys(peer_flags[p], me, e)
    return e


@kjit(device=True, inline="always")
def spin_at_least(counters, i, target, timeout_cycles):
    """Acquire-load ``counters[i]`` until it reaches ``target`` or ``timeout_cycles`` pass;
    returns the last value seen (< target: timed out -- the caller records what it waited
    on)."""
    start = clock64()
    seen = ld_acquire_sys(counters, i)
    while seen < target:
        if clock64() - start > timeout_cycles:
            return seen
        nanosleep(64)
        seen = ld_acquire_sys(counters, i)
    return seen


@kjit(device=True)
def wait(me, target, flags, timeout_cycles, errors):
    """Thread 0 only. Spin until every rank reached ``target`` or the wait times out."""
    for p in range(flags.shape[0]):
        seen = spin_at_least(flags, p, target, timeout_cycles)
        if seen < target:
            record_timeout(errors, me, COUNTER_BARRIER, target, seen, p)
            return False
    return True


@kjit
def barrier_kernel(me, epoch, flags, peer_flags, timeout_cycles, errors):
    """Launch [1, 1]: arrive then wait (one launch per barrier on real GPUs)."""
    if cuda.threadIdx.x == 0:
        target = arrive(me, epoch, peer_flags)
        wait(me, target, flags, timeout_cycles, errors)


@kjit
def arrive_kernel(me, epoch, peer_flags):
    """Launch [1, 1]: the arrive half (emulated ranks run every arrive, then every wait)."""
    if cuda.threadIdx.x == 0:
        arrive(me, epoch, peer_flags)


@kjit
def wait_kernel(me, epoch, flags, timeout_cycles, errors):
    """Launch [1, 1]: the wait half, for the epoch the last arrive published."""
    if cuda.threadIdx.x == 0:
        wait(me, epoch[0], flags, timeout_cycles, errors)
