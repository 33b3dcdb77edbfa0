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
that device pointers have). Simulator-only speed-ups, the same results: a block's threads run
on Python threads kept from block to block (not one new thread each), a warp collective's work
is done by its last lane to arrive (one barrier, not two), a static shared array is found by
its caller's frame (not a stack summary), and a kernel's ``uint32(v)`` goes straight to
NumPy's cast.
"""
from __future__ import annotations

import sys
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
        self.last = None                  # run by the arrival that trips the barrier

    def wait(self, last=None):
        """Sleep until every party has arrived (or left); ``last`` (the same work from every
        party of one round) is run once, by the party that trips the barrier, before any
        sleeper wakes."""
        with self.mutex:
            if self.aborted:
                raise _Aborted("block aborted")
            if last is not None:
                self.last = last
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
        last, self.last = self.last, None
        if last is not None and not aborted:
            last()
        sleepers, self.sleepers = self.sleepers, []
        for me in sleepers:
            me[1] = aborted
            me[0].release()


class _WarpExchange:
    """Per-warp rendezvous: every lane deposits a value, all see all 32 values.

    Two sets of slots (and results), used by turns: a lane's n-th exchange or collective
    writes set n % 2, and it can reach its (n + 2)-th only past the barrier of the (n + 1)-th,
    which every lane enters after it has read the n-th -- so one barrier per exchange or
    collective is enough, none is needed to guard the slots against the next call."""

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
    result (for twins whose per-warp work should be done once, not 32 times): the last lane to
    arrive, before the others wake -- one barrier, as an exchange."""
    warp, lane = _my_warp()
    turn = _my_turn(warp, lane)
    warp.slots[turn][lane] = value

    def last():
        warp.results[turn] = compute(list(warp.slots[turn]))
    warp.barrier.wait(last)
    return warp.results[turn]


class _Done:
    """Counts a block's threads down; ``wait`` returns once all have finished."""

    def __init__(self, n: int):
        self.mutex = _allocate_lock()
        self.left = n
        self.all_done = _allocate_lock()
        self.all_done.acquire()

    def one_done(self):
        with self.mutex:
            self.left -= 1
            last = self.left == 0
        if last:
            self.all_done.release()

    def wait(self):
        self.all_done.acquire()


_workers = []                 # the simulated threads, kept between blocks (one block at a time)
_worker_class = None
_pool = _allocate_lock()      # held by the launch running on them: another host thread's
                              # launch meanwhile gets threads of its own


def _make_worker_class():
    """A ``BlockThread`` that stays alive and runs one simulated thread of each block it is
    handed: creating (and joining) a Python thread for every CUDA thread of every block cost
    a launch about as much as the kernel's own code. Each block hands it what a new
    ``BlockThread`` is made with -- its manager, block and thread index, no exception, no
    abort -- and drops the per-thread state the intrinsics' twins keep on the thread
    (``mok_*`` attributes: a new thread has none)."""
    from numba.cuda.simulator import kernel as simkernel
    from numba.cuda.simulator.kernelapi import Dim3

    class Worker(simkernel.BlockThread):
        def __init__(self):                   # (BlockThread's own state: ``assign``)
            threading.Thread.__init__(self, daemon=True)
            self.go = _allocate_lock()
            self.go.acquire()
            self.job = None

        def assign(self, manager, grid_point, block_point, target, done):
            for key in [k for k in vars(self) if k.startswith("mok_")]:
                delattr(self, key)
            self._manager = manager
            self.blockIdx = Dim3(*grid_point)
            self.threadIdx = Dim3(*block_point)
            self.exception = None
            self.abort = False
            self.debug = False
            self.syncthreads_blocked = False
            dim = manager._block_dim
            self.thread_id = block_point[0] + dim[0] * (block_point[1] + dim[1] * block_point[2])
            self.job = (target, done)

        def run(self):
            while True:
                self.go.acquire()
                target, done = self.job
                self.job = None
                try:
                    target()
                except Exception as e:            # as BlockThread.run words it
                    tid = "tid=%s" % list(self.threadIdx)
                    ctaid = "ctaid=%s" % list(self.blockIdx)
                    msg = "%s %s" % (tid, ctaid) if str(e) == "" else \
                        "%s %s: %s" % (tid, ctaid, e)
                    self.exception = (type(e)(msg), sys.exc_info()[2])
                except BaseException as e:        # (a new thread would die of it, unseen)
                    self.exception = (e, e.__traceback__)
                finally:
                    done.one_done()

    return Worker


def _run_on_workers(manager, grid_point, target, n):
    """Run ``target`` as the n threads of one block on kept worker threads; returns them."""
    global _worker_class
    if _worker_class is None:
        _worker_class = _make_worker_class()
    while len(_workers) < n:
        w = _worker_class()
        w.start()
        _workers.append(w)
    done = _Done(n)
    threads = _workers[:n]
    for w, block_point in zip(threads, np.ndindex(*manager._block_dim)):   # (3-D: numba's)
        w.assign(manager, grid_point, block_point, target, done)
    for w in threads:
        w.go.release()
    done.wait()
    return threads


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

        # kept worker threads, unless debugging (numba's threads then) or another host
        # thread's launch holds them
        if not self._debug and _pool.acquire(False):
            try:
                threads = _run_on_workers(self, grid_point, target, n)
            finally:
                _pool.release()
        else:
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

    # numba's simulator keys a static shared array by its caller's (file, line), found with
    # ``traceback.extract_stack`` -- every frame of the thread's stack summarised, each one's
    # source file stat-ed and its line read, at every thread's every ``cuda.shared.array``
    # (most of what a short kernel's thread costs). The caller's frame gives the same key.
    from numba.cuda.np import numpy_support
    from numba.cuda.types import Type
    shared_array = kernelapi.FakeCUDAShared.array

    def array(self, shape, dtype, alignment=None):
        if alignment is not None or shape == 0:
            return shared_array(self, shape, dtype, alignment)
        frame = sys._getframe(1)
        caller = (frame.f_code.co_filename, frame.f_lineno)
        res = self._allocations.get(caller)
        if res is None:                     # (setdefault: the block's threads race to it)
            if isinstance(dtype, Type):
                dtype = numpy_support.as_dtype(dtype)
            res = self._allocations.setdefault(caller, np.empty(shape, dtype))
        return res

    kernelapi.FakeCUDAShared.array = array

    # A kernel's ``uint32(v)`` / ``float32(v)`` calls numba's type object, whose ``__call__``
    # imports ``signature`` and asks an ABC isinstance before ``cast_python_value`` -- NumPy's
    # type of the same name, for both classes (checked: a numba that casts otherwise keeps its
    # own path). For values of the plain kinds (never a numba type) call that directly.
    from numba.core.types import abstract, scalars
    plain = frozenset((int, float, bool, np.int8, np.int16, np.int32, np.int64, np.uint8,
                       np.uint16, np.uint32, np.uint64, np.float16, np.float32, np.float64,
                       np.bool_))

    def cast(self, *args, _general=abstract.Type.__call__, _np=np, _plain=plain):
        if len(args) == 1 and type(args[0]) in _plain:
            return getattr(_np, self.name)(args[0])
        return _general(self, *args)

    for cls in (scalars.Integer, scalars.Float):
        if (cls.cast_python_value.__code__.co_names == ("getattr", "np", "name")
                and "__call__" not in vars(cls) and cls.__call__ is abstract.Type.__call__):
            cls.__call__ = cast
    _installed = True
