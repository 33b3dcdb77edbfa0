"""Cross-rank barrier of the EP group, from flag words in peer memory (no NVSHMEM device calls,
no multicast).

Roles: every rank of the group calls ``barrier`` on its own stream the same number of times;
it is one single-thread launch that arrives and then waits.

Counters (``Workspace``):
    barrier_flags[p] on rank q   the barrier epoch rank p has reached (symmetric int32 [R],
                                 written by p with a system-scope *release* store)
    barrier_epoch[0]             this rank's count of barriers passed (local)
Arrive: epoch += 1; release-store the epoch into flags[me] of every rank (me included).
Wait:   acquire-load flags[p] until it reaches the epoch, for every p.

Ordering: kernel boundaries order the data -- everything the stream wrote before the barrier
(stores into peers' memory included) is complete before the arrive's fenced release store, and
the acquire makes it visible to whatever this rank launches after the barrier. Epochs only
grow, so nothing is reset between barriers and a CUDA-graph replay just keeps counting.

Errors: the wait is bounded by ``MoKConfig.spin_timeout_cycles``; on expiry it records (rank,
counter 'barrier', expected epoch, seen epoch, peer) in the workspace's error word and returns
(``Workspace.check`` raises; never a silent hang).

Emulated ranks (``mok_comm.emulation``) run the two halves apart, ``arrive`` on every rank and
then ``wait`` on every rank: the simulator runs one kernel at a time, so a rank spinning on a
peer that has not arrived yet would never see it.
"""
from numba import cuda

from mok_core.cuda_compat import kjit, launch
from mok_core.errors_kernels import record_timeout
from mok_core.intrinsics import clock64, ld_acquire_sys, nanosleep, st_release_sys

COUNTER_BARRIER = 0             # errors.COUNTER_NAMES


@kjit(device=True)
def arrive_device(me, epoch, peer_flags):
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
def wait_device(me, target, flags, timeout_cycles, errors):
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
        target = arrive_device(me, epoch, peer_flags)
        wait_device(me, target, flags, timeout_cycles, errors)


@kjit
def arrive_kernel(me, epoch, peer_flags):
    """Launch [1, 1]: the arrive half."""
    if cuda.threadIdx.x == 0:
        arrive_device(me, epoch, peer_flags)


@kjit
def wait_kernel(me, epoch, flags, timeout_cycles, errors):
    """Launch [1, 1]: the wait half, for the epoch the last arrive published."""
    if cuda.threadIdx.x == 0:
        wait_device(me, epoch[0], flags, timeout_cycles, errors)


def barrier(ws, stream=0) -> None:
    """Device-side barrier of the EP group on ``stream`` (``ws``: a comm ``Workspace``)."""
    launch(barrier_kernel, 1, 1, stream, 0, ws.rank, ws.barrier_epoch, ws.barrier_flags,
           ws.peer_barrier_flags, ws.config.spin_timeout_cycles, ws.errors)


def arrive(ws, stream=0) -> None:
    """First half of ``barrier`` (emulated ranks: every rank arrives, then every rank waits)."""
    launch(arrive_kernel, 1, 1, stream, 0, ws.rank, ws.barrier_epoch, ws.peer_barrier_flags)


def wait(ws, stream=0) -> None:
    """Second half of ``barrier``: wait for the epoch this rank's last ``arrive`` published."""
    launch(wait_kernel, 1, 1, stream, 0, ws.rank, ws.barrier_epoch, ws.barrier_flags,
           ws.config.spin_timeout_cycles, ws.errors)
