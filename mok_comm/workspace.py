"""The symmetric workspace of one MoE layer shape: buffers, peer views, counters.

Allocated once from shapes alone (``tokens_per_rank`` T, hidden H, top-k k, experts E, EP size R,
config) and reused by every call; nothing in it depends on routing data, so the host never
reads counts back.

Symmetric (same shape on every rank; peer views are tuples indexed by rank):
    x_recv         uint16 [R*T, H]     token staging: token (r, t) lives in row r*T + t. Its
                                       slice r = me *is* this rank's x buffer (``x_buf``): our
                                       own tokens are written there once and peers pull them
                                       from it, so local tokens are never copied again.
    ids_table      int32  [R, T, k]    every rank's top-k ids (row r pushed by rank r)
    combine_buf    uint16 [T*k, H]     expert outputs pushed home, row token*k + slot
    barrier_flags  int32  [R]          epoch each rank reached (see ``barrier``)
Local:
    barrier_epoch  int32 [1]           barriers this rank passed
    errors         int32 [ERROR_WORDS] device error word (timeouts, non-finite input)
    side           SideStream          the split dispatch's copy-engine stream (made here: the
                                       first dispatch may be inside a graph capture)
Which op reads and writes which buffer, and in which order: the op modules' docstrings
(``routing``, ``dispatch``, ``combine``, ``barrier``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mok_core import errors as err
from mok_core.config import MoKConfig
from mok_core.cuda_compat import SideStream, device_full, to_host
from mok_core.errors_kernels import reset_error_word

from .heap import Heap


@dataclass
class Workspace:
    rank: int
    ep_size: int
    tokens_per_rank: int
    hidden: int
    topk: int
    num_experts: int
    config: MoKConfig
    capacity: int
    heap: Heap
    x_buf: object
    ids_table: object
    combine_buf: object
    barrier_flags: object
    peer_x: tuple
    peer_ids_table: tuple
    peer_combine: tuple
    peer_barrier_flags: tuple
    barrier_epoch: object
    x_recv: object
    errors: object
    side: object

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.ep_size

    def check(self, stream=0) -> None:
        """Raise ``MoKError`` if a kernel recorded a failure (synchronises)."""
        err.raise_if_set(to_host(self.errors, stream), context=f"mok_comm (rank {self.rank})",
                         num_experts=self.num_experts)

    def free(self) -> None:
        """Release the symmetric heap (collective on NVSHMEM)."""
        self.heap.free()


def create_workspace(heap: Heap, *, tokens_per_rank: int, hidden: int, topk: int,
                     num_experts: int, config: MoKConfig, stream=0) -> Workspace:
    """Allocate a workspace on ``heap`` (collective on NVSHMEM: every rank, same arguments).

    Arguments:
        heap: ``LocalHeap`` (EP = 1), ``NvshmemHeap`` or an ``EmulatedHeap.for_rank(i)``.
        tokens_per_rank: T (every rank the same; a rank with fewer tokens masks the rest).
        hidden, topk, num_experts: H, k, E (global experts; R = heap.ep_size must divide E).
        config: ``MoKConfig``.
    """
    R, T, H, k, E = heap.ep_size, tokens_per_rank, hidden, topk, num_experts
    for name, v, low in (("tokens_per_rank", T, 0), ("hidden", H, 1), ("topk", k, 1),
                         ("num_experts", E, 1)):
        if not isinstance(v, int) or isinstance(v, bool) or v < low:
            raise ValueError(f"{name}={v!r}: must be an int >= {low}")
    if H % 8:
        raise ValueError(f"hidden={H}: must be a multiple of 8 (16-byte rows)")
    if E % R:
        raise ValueError(f"num_experts={E}: must be divisible by the EP size {R}")
    capacity = config.schedule_capacity(T, k, R, E // R)
    u16, i32 = np.uint16, np.int32
    x_recv, peer_recv = heap.alloc((R * T, H), u16, name="x_recv",
                                   dims=("tokens_per_rank", "hidden"))
    ids_table, peer_ids = heap.alloc((R, T, k), i32, -1, name="ids_table",
                                     dims=("ep_size", "tokens_per_rank", "topk"))
    combine_buf, peer_combine = heap.alloc((T * k, H), u16, name="combine_buf",
                                           dims=("tokens_per_rank * topk", "hidden"))
    flags, peer_flags = heap.alloc((R,), i32, name="barrier_flags", dims=("ep_size",))
    ws = Workspace(
        rank=heap.rank, ep_size=R, tokens_per_rank=T, hidden=H, topk=k, num_experts=E,
        config=config, capacity=capacity, heap=heap,
        x_buf=x_recv[heap.rank * T:(heap.rank + 1) * T], ids_table=ids_table,
        combine_buf=combine_buf, barrier_flags=flags,
        peer_x=tuple(p.reshape(p.size)[q * T * H:(q + 1) * T * H]
                     for q, p in enumerate(peer_recv)),
        peer_ids_table=tuple(p.reshape(p.size) for p in peer_ids),
        peer_combine=tuple(p.reshape(p.size) for p in peer_combine),
        peer_barrier_flags=peer_flags,
        barrier_epoch=device_full((1,), 0, i32, stream),
        x_recv=x_recv,
        errors=device_full((err.ERROR_WORDS,), 0, i32, stream),
        side=SideStream(),
    )
    reset_error_word(ws.errors, stream)
    heap.fence()              # nobody writes into a peer before the peer's fills are done
    return ws

