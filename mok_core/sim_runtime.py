"""A faster block scheduler for numba's CUDA simulator (used only when ``SIM``).

numba's simulator runs each CUDA thread of a block as a Python thread and implements
``syncthreads`` by having the launching thread busy-poll every thread's state; with the GIL
shared, the poll loop starves the workers and a block with a few syncthreads costs seconds.
This replaces the per-block manager with a condition-variable barrier (threads sleep until the
last one arrives), same semantics: a thread that has returned no longer takes part in
barriers, and an exception in any thread aborts the block and is re-raised by the launch.

It also gives each block a *warp barrier* (``warp_exchange``) so Python twins of warp-collective
intrinsics (``mma.sync``, ``ldmatrix``) can trade per-lane values like the hardware does, and
passes NumPy kernel arguments by reference (numba copies them in and out, which breaks aliasing
that device pointers have).
"""
from __future__ import annotations

import threading

import numpy as np

_installed = False


class _Aborted(RuntimeError):
    pass


class _Barrier:
    """Reusable barrier whose party count shrinks as threads finish."""

    def __init__(self, parties: int):
        self.cond = threading.Condition()
        self.parties = parties
        self.waiting = 0
        self.generation = 0
        self.aborted = False

    def wait(self):
        with self.cond:
            if self.aborted:
                raise _Aborted("block aborted")
            gen = self.generation
            self.waiting += 1
            if self.waiting >= self.parties:
                self._trip()
            else:
                while gen == self.generation and not self.aborted:
                    self.cond.wait()
            if self.aborted:
                raise _Aborted("block aborted")

    def leave(self):
        with self.cond:
            self.parties -= 1
            if self.parties > 0 and self.waiting >= self.parties:
                self._trip()

    def abort(self):
        with self.cond:
            self.aborted = True
            self.cond.notify_all()

    def _trip(self):
        self.waiting = 0
        self.generation += 1
        self.cond.notify_all()


class _WarpExchange:
    """Per-warp rendezvous: every lane deposits a value, all see all 32 values."""

    def __init__(self):
        self.barrier = _Barrier(32)
        self.slots = [None] * 32


def _my_warp():
    """(this simulated thread's warp rendezvous, its lane)."""
    thread = threading.current_thread()
    return thread._manager._warps[thread.thread_id // 32], thread.thread_id % 32


def warp_exchange(value):
    """Deposit ``value`` for this lane; return the list of all 32 lanes' values.

    Every lane of the warp must call it (the warp is the 32 consecutive linear thread ids).
    Only for Python twins of warp-collective intrinsics under the simulator.
    """
    warp, lane = _my_warp()
    warp.slots[lane] = value
    warp.barrier.wait()
    values = list(warp.slots)
    warp.barrier.wait()          # nobody overwrites a slot before every lane has read
    return values


def warp_barrier():
    """``__syncwarp()`` for simulator twins: every lane of the warp must call it."""
    _my_warp()[0].barrier.wait()


def warp_collective(value, compute):
    """Deposit ``value``; one lane runs ``compute(list of 32 values)`` and every lane gets its
    result (for twins whose per-warp work should be done once, not 32 times)."""
    warp, lane = _my_warp()
    warp.slots[lane] = value
    warp.barrier.wait()
    if lane == 0:
        warp.result = compute(list(warp.slots))
    warp.barrier.wait()
    result = warp.result
    warp.barrier.wait()          # nobody starts the next collective before all have read
    return result


def install() -> None:
    """Patch numba's simulator block manager (idempotent)."""
    global _installed
    if _installed:
        return
    from numba.cuda.simulator import kernel as simkernel

    def run(self, grid_point, *args):
        n = int(np.prod(self._block_dim))
        barrier = _Barrier(n)
        self._barrier = barrier
        self._warps = [_WarpExchange() for _ in range((n + 31) // 32)]
        threads = []

        def target():
            try:
                self._f(*args)
            except BaseException:
                barrier.abort()
                for w in self._warps:
                    w.barrier.abort()
                raise
            finally:
                barrier.leave()

        for block_point in np.ndindex(*self._block_dim):
            threads.append(simkernel.BlockThread(target, self, grid_point, block_point,
                                                 self._debug))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        failures = [t.exception for t in threads if t.exception is not None]
        real = [f for f in failures if not issubclass(f[0].__class__, _Aborted)
                and "block aborted" not in str(f[0])]
        if real or failures:
            exc, tb = (real or failures)[0]
            raise exc.with_traceback(tb)

    def syncthreads(self):
        self._manager._barrier.wait()

    simkernel.BlockManager.run = run
    simkernel.BlockThread.syncthreads = syncthreads

    # numba's simulator copies every NumPy kernel argument in and back out, so two arguments
    # that alias (an array passed directly and again inside a tuple of peer views, as a rank's
    # own buffer is) stop aliasing, unlike device pointers. Pass them by reference instead.
    from numba.cuda.simulator import args as simargs
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
    copy_in_out = simargs.InOut.to_device

    def to_device(self, retr, stream=0):
        if isinstance(self.value, np.ndarray):
            return FakeCUDAArray(self.value)
        return copy_in_out(self, retr, stream)

    simargs.InOut.to_device = to_device
    _installed = True
