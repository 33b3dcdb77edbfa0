"""R expert-parallel ranks in one process: the whole protocol on one GPU or on the CPU simulator.

Every rank gets its own ``Workspace`` on one ``EmulatedHeap`` (rank i's peer views are the other
ranks' arrays). The forward is a sequence of *phases* separated by barriers; between two
barriers no rank waits on another, so running a phase rank after rank is a legal interleaving
of the real concurrent execution. A barrier becomes two phases: every rank arrives, then every
rank waits (the waits then pass at once -- a spinning wait would deadlock the simulator, which
runs blocks one after another).
"""
from __future__ import annotations

from mok_core.config import MoKConfig

from . import ops
from .heap import EmulatedHeap
from .workspace import create_workspace


class EmulatedGroup:
    """Workspaces of R emulated ranks sharing one heap."""

    def __init__(self, ep_size: int, *, tokens_per_rank: int, hidden: int, topk: int,
                 num_experts: int, config: MoKConfig, stream=0):
        self.heap = EmulatedHeap(ep_size, stream)
        self.stream = stream
        self.workspaces = [
            create_workspace(self.heap.for_rank(r), tokens_per_rank=tokens_per_rank,
                             hidden=hidden, topk=topk, num_experts=num_experts, config=config,
                             stream=stream)
            for r in range(ep_size)]

    @property
    def ep_size(self) -> int:
        return len(self.workspaces)

    def each(self, fn) -> list:
        """Run ``fn(rank, workspace)`` for every rank in order (one phase)."""
        return [fn(r, ws) for r, ws in enumerate(self.workspaces)]

    def barrier(self) -> None:
        self.each(lambda r, ws: ops.barrier_arrive(ws, self.stream))
        self.each(lambda r, ws: ops.barrier_wait(ws, self.stream))

    def check(self) -> None:
        self.each(lambda r, ws: ws.check(self.stream))
