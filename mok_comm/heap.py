"""Where symmetric buffers live: the NVSHMEM heap, one local GPU, or R emulated ranks.

A *heap* allocates symmetric buffers -- the same shape on every rank -- and hands each rank its
own array plus the tuple of every rank's array (its *peer views*: entry p is rank p's copy, as
this rank can address it). Kernels take those tuples and load/store peers' memory directly
(NVLink within one node), so the same kernel source serves all backends:

* ``NvshmemHeap``  -- one process per GPU; buffers from ``nvshmem.core.buffer`` (collective:
  every rank allocates in the same order), peer views from ``get_peer_buffer`` (``nvshmem_ptr``).
  The host makes the views; kernels never call NVSHMEM device APIs (their Numba bindings do
  not build on our GPU host, and direct loads/stores do the same job inside one node).
* ``LocalHeap``    -- EP = 1: plain device arrays, no NVSHMEM at all.
* ``EmulatedHeap`` -- R ranks in one process (CUDA simulator in CI, or one GPU): every buffer is
  R arrays; rank i's peer views are all R arrays. Kernels of one phase run rank after rank.
"""
from __future__ import annotations

import numpy as np

from mok_core.cuda_compat import SIM, device_full


class Heap:
    """Interface: ``alloc(shape, dtype, fill, name=, dims=) -> (local array, tuple of peer
    arrays)``. ``name`` (the buffer) and ``dims`` (per dimension, the argument that sets it,
    e.g. ``("tokens_per_rank", "hidden")``; the heap's EP size is common to all ranks) only
    serve error messages: a heap that can see every rank's request (``EmulatedHeap``) says
    which argument the ranks disagree on."""
    ep_size: int
    rank: int

    def alloc(self, shape, dtype, fill=0, *, name=None, dims=None):
        raise NotImplementedError

    def fence(self):
        """Make every rank's allocations (and their fills) complete before any rank writes
        into a peer's buffers. Collective; a no-op where ranks cannot race."""

    def free(self):
        pass


class LocalHeap(Heap):
    """EP = 1 without NVSHMEM."""

    def __init__(self, stream=0):
        self.ep_size, self.rank, self.stream = 1, 0, stream

    def alloc(self, shape, dtype, fill=0, *, name=None, dims=None):
        arr = device_full(shape, fill, dtype, self.stream)
        return arr, (arr,)


class EmulatedHeap:
    """R ranks in one process. ``for_rank(i)`` gives rank i's ``Heap`` view; allocations must
    be made through every rank's view in the same order (as with NVSHMEM)."""

    def __init__(self, ep_size: int, stream=0):
        if ep_size < 1:
            raise ValueError(f"ep_size={ep_size}: must be >= 1")
        self.ep_size = ep_size
        self.stream = stream
        self._buffers: list[list] = []        # allocation i -> R arrays
        self._requests: list[tuple] = []      # allocation i -> (rank, shape, dtype, name, dims)
        self._cursor = [0] * ep_size          # next allocation index per rank

    def for_rank(self, rank: int) -> "Heap":
        return _EmulatedRankHeap(self, rank)

    def _alloc(self, rank, shape, dtype, fill, name=None, dims=None):
        i = self._cursor[rank]
        shape, dtype = tuple(int(n) for n in shape), np.dtype(dtype)
        if i == len(self._buffers):
            self._buffers.append([device_full(shape, fill, dtype, self.stream)
                                  for _ in range(self.ep_size)])
            self._requests.append((rank, shape, dtype, name, dims))
        first, shape0, dtype0, name0, dims0 = self._requests[i]
        if shape != shape0 or dtype != dtype0 or name != name0:
            raise ValueError(_disagreement(i, (first, shape0, dtype0, name0, dims0),
                                           (rank, shape, dtype, name, dims)))
        self._cursor[rank] += 1
        return self._buffers[i][rank], tuple(self._buffers[i])


def _disagreement(i, a, b) -> str:
    """Why emulated ranks' requests for allocation ``i`` differ, in words."""
    (ra, sa, da, na, dims), (rb, sb, db, nb, _) = a, b

    def show(shape, dtype):
        return f"[{', '.join(map(str, shape))}]" + ("" if da == db else f" {dtype}")

    if na != nb:
        return (f"emulated ranks allocated symmetric buffers in different orders: allocation "
                f"{i} is {na or 'unnamed'} {show(sa, da)} on rank {ra} but {nb or 'unnamed'} "
                f"{show(sb, db)} on rank {rb}")
    what = na or f"symmetric allocation {i}"
    if da != db or len(sa) != len(sb):
        field = f"the dtype or number of dimensions of {what}"
    else:
        j = next(j for j in range(len(sa)) if sa[j] != sb[j])
        field = dims[j] if dims else f"dimension {j} of {what}"
    return (f"emulated ranks disagree on {field}: rank {ra} allocated {what} {show(sa, da)}, "
            f"rank {rb} {show(sb, db)} (every rank must build its layer alike)")


class _EmulatedRankHeap(Heap):
    def __init__(self, parent: EmulatedHeap, rank: int):
        self.parent, self.rank, self.ep_size = parent, rank, parent.ep_size

    def alloc(self, shape, dtype, fill=0, *, name=None, dims=None):
        return self.parent._alloc(self.rank, shape, dtype, fill, name, dims)


class NvshmemHeap(Heap):
    """Symmetric buffers on the NVSHMEM heap (after ``mok_comm.launch.bootstrap.init``).

    ``pes`` selects the EP group's PEs (default: the whole world); peer views are made for
    them in that order.
    """

    def __init__(self, stream=0, pes=None):
        if SIM:
            raise RuntimeError("NvshmemHeap needs GPUs; use EmulatedHeap on the simulator")
        import nvshmem.core as nvs
        self._nvs = nvs
        self.stream = stream
        world_rank, world = nvs.my_pe(), nvs.n_pes()
        self.pes = tuple(range(world)) if pes is None else tuple(pes)
        if world_rank not in self.pes:
            raise ValueError(f"this PE ({world_rank}) is not in the EP group {self.pes}")
        self.ep_size = len(self.pes)
        self.rank = self.pes.index(world_rank)
        self._buffers = []

    def alloc(self, shape, dtype, fill=0, *, name=None, dims=None):
        from numba import cuda

        from mok_core.cuda_compat import fill as fill_array
        dtype = np.dtype(dtype)
        nbytes = max(16, int(np.prod(shape)) * dtype.itemsize)
        buf = self._nvs.buffer(nbytes)                       # collective
        self._buffers.append(buf)

        def view(b):
            cai = {"shape": tuple(shape), "strides": None, "typestr": dtype.str,
                   "data": (int(b.handle), False), "version": 2}
            return cuda.from_cuda_array_interface(cai, owner=b, sync=False)

        local = view(buf)
        fill_array(local, fill, self.stream)
        peers = tuple(local if pe == self.pes[self.rank] else
                      view(self._nvs.get_peer_buffer(buf, pe)) for pe in self.pes)
        return local, peers

    def fence(self):
        """Our fill kernels are done, then a barrier of all PEs: a fast peer must not write
        into a buffer (a barrier flag, a pushed id) that our fill would then overwrite."""
        from numba import cuda
        cuda.synchronize()
        stream = self.stream if hasattr(self.stream, "__cuda_stream__") else cuda.default_stream()
        self._nvs.barrier_all(stream)
        cuda.synchronize()

    def free(self):
        """Free every buffer (collective: all ranks call it, after a device sync)."""
        from numba import cuda
        cuda.synchronize()
        for buf in reversed(self._buffers):
            self._nvs.free(buf)
        self._buffers.clear()
