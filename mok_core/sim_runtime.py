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
from _thread import allocate_lock as _allocate_lock

import numpy as np

_installed = False


class _Aborted(RuntimeError):
    pass


class _Barrier:
    """Reusable barrier whose party count shrinks as threads finish.

    Each waiter sleeps on a lock of its own that the last arrival releases, so the woken
    threads go on without queueing for a shared lock again (a ``threading.Condition`` makes
    each of them re-acquire its lock in turn)."""

    def __init__(self, parties: int):
        self.mutex = threading.Lock()
        self.parties = parties
        self.sleepers = []                # [lock, aborted] of each waiting thread
        self.aborted = False

    def wait(self):
        with self.mutex:
            if self.aborted:
                raise _Aborted("block aborted")
            if len(self.sleepers) + 1 >= self.parties:
                self._trip(False)
                return
            me = [_allocate_lock(), False]
            me[0].acquire()
            self.sleepers.append(me)
        me[0].acquire()                   # until the last arrival (or an abort) releases it
        if me[1]:
            raise _Aborted("block aborted")

    def leave(self):
        with self.mutex:
            self.parties -= 1
            if self.parties > 0 and len(self.sleepers) >= self.parties:
                self._trip(False)

    def abort(self):
        with self.mutex:
            self.aborted = True
            self._trip(True)

    def _trip(self, aborted):
        sleepers, self.sleepers = self.sleepers, []
        for me in sleepers:
            me[1] = aborted
            me[0].release()


class _WarpExchange:
    """Per-warp rendezvous: every lane deposits a value, all see all 32 values.

    Two sets of slots (and results), used by turns: a lane's n-th exchange or collective
    writes set n % 2, and it can reach its (n + 2)-th only past the barrier of the (n + 1)-th,
    which every lane enters after it has read the n-th -- so one barrier per exchange (two per
    collective) is enough, none is needed to guard the slots against the next call."""

    def __init__(self):
        self.barrier = _Barrier(32)
        self.slots = ([None] * 32, [None] * 32)
        self.results = [None, None]
        self.turn = [0] * 32                  # each lane's count of exchanges and collectives


def _my_warp():
    """(this simulated thread's warp rendezvous, its lane)."""
    thread = threading.current_thread()
    return thread._manager._warps[thread.thread_id // 32], thread.thread_id % 32


def _my_turn(warp, lane):
    turn = warp.turn[lane] & 1
    warp.turn[lane] += 1
    return turn


def warp_exchange(value):
    """Deposit ``value`` for this lane; return the list of all 32 lanes' values.

    Every lane of the warp must call it (the warp is the 32 consecutive linear thread ids).
    Only for Python twins of warp-collective intrinsics under the simulator.
    """
    warp, lane = _my_warp()
    slots = warp.slots[_my_turn(warp, lane)]
    slots[lane] = value
    warp.barrier.wait()
    return list(slots)


def warp_barrier():
    """``__syncwarp()`` for simulator twins: every lane of the warp must call it."""
    _my_warp()[0].barrier.wait()


def warp_collective(value, compute):
    """Deposit ``value``; one lane runs ``compute(list of 32 values)`` and every lane gets its
    result (for twins whose per-warp work should be done once, not 32 times)."""
    warp, lane = _my_warp()
    turn = _my_turn(warp, lane)
    warp.slots[turn][lane] = value
    warp.barrier.wait()
    if lane == 0:
        warp.results[turn] = compute(list(warp.slots[turn]))
    warp.barrier.wait()
    return warp.results[turn]


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

    # numba's simulator swaps its fake ``cuda`` module into a device function's module globals
    # around every call (an import, two lock rounds and a context manager: most of what a small
    # device function costs). It runs one kernel at a time, so swap each module in once per
    # launch, at its first device call, and swap them all back when the launch ends.
    from numba.cuda.simulator import kernelapi
    kernel_call = simkernel.FakeCUDAKernel.__call__
    held = {}                 # id(module globals) -> its entered swap, for the running launch
    held_lock = threading.Lock()

    def call(self, *args):
        context = simkernel._kernel_context
        if context is None:
            if self._device:                      # a device function called from the host
                return kernel_call(self, *args)
            try:                                  # a launch
                return kernel_call(self, *args)
            finally:
                with held_lock:
                    swaps = list(held.values())
                    held.clear()
                for swap in reversed(swaps):
                    swap.__exit__(None, None, None)
        fn = self.fn
        key = id(fn.__globals__)
        if key not in held:
            with held_lock:
                if key not in held:
                    swap = kernelapi.swapped_cuda_module(fn, context)
                    swap.__enter__()
                    held[key] = swap
        return fn(*args)

    simkernel.FakeCUDAKernel.__call__ = call
    _installed = True
