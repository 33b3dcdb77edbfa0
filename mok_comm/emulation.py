"""R expert-parallel ranks in one process: the whole protocol on one GPU or on the CPU simulator.

Every rank gets its own workspace on one ``EmulatedHeap`` (rank i's peer views are the other
ranks' arrays). A step is a sequence of *phases* separated by barriers; between two barriers no
rank waits on another, so running a phase rank after rank is a legal interleaving of the real
concurrent execution. A barrier becomes two phases: every rank arrives, then every rank waits
(the waits then pass at once -- a spinning wait would deadlock the simulator, which runs blocks
one after another).
"""
from __future__ import annotations

from mok_core.config import LayerShape, MoKConfig

from . import barrier
from .heap import EmulatedHeap
from .workspace import create_workspace


def barrier_all(comm_workspaces, stream=0) -> None:
    """Emulated barrier over the ranks' comm workspaces: all arrive, then all wait."""
    for ws in comm_workspaces:
        barrier.arrive(ws, stream)
    for ws in comm_workspaces:
        barrier.wait(ws, stream)


def run_phases(comm_workspaces, phase_lists, stream=0) -> None:
    """Run phase i of every rank, then an emulated barrier, then phase i+1 ...

    ``phase_lists[r]`` is rank r's list of callables (same length for every rank).
    """
    for i in range(len(phase_lists[0])):
        if i:
            barrier_all(comm_workspaces, stream)
        for phases in phase_lists:
            phases[i]()


class EmulatedGroup:
    """Comm workspaces of R emulated ranks sharing one heap."""

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
        barrier_all(self.workspaces, self.stream)

    def check(self) -> None:
        self.each(lambda r, ws: ws.check(self.stream))


def emulated_layer(shape: LayerShape, tokens_per_rank: int, config: MoKConfig, gemm=None,
                   stream=0, gemm_down=None):
    """Layer workspaces of ``shape.ep_size`` emulated ranks (fingerprints verified)."""
    from .functional import default_gemm, get_workspace, verify_ranks_agree
    heap = EmulatedHeap(shape.ep_size, stream)
    lws = [get_workspace(shape, tokens_per_rank, config, heap=heap.for_rank(r),
                         gemm=gemm or default_gemm(), gemm_down=gemm_down, verify=False,
                         stream=stream)
           for r in range(shape.ep_size)]
    comms = [lw.comm for lw in lws]
    run_phases(comms, [list(verify_ranks_agree(lw, stream)) for lw in lws], stream)
    for lw in lws:
        lw.comm.check(stream)
    return lws
