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


def barrier_all(comm_workspaces, stream=0) -> None:
    """Emulated barrier over the ranks' comm workspaces: all arrive, then all wait."""
    for ws in comm_workspaces:
        barrier.arrive(ws, stream)
    for ws in comm_workspaces:
        barrier.wait(ws, stream)


def run_phases(comm_workspaces, phase_lists, stream=0) -> None:
    """Run phase i of every rank, then an emulated barrier, then phase i+1 ...

    ``phase_lists[r]`` is rank r's list of phases (same length for every rank); a phase is a
    callable or a list of callables run in order.
    """
    for i in range(len(phase_lists[0])):
        if i:
            barrier_all(comm_workspaces, stream)
        for phases in phase_lists:
            for call in (phases[i] if isinstance(phases[i], list) else [phases[i]]):
                call()


def emulated_layers(shape: LayerShape, tokens_per_rank: int, config: MoKConfig, gemm=None,
                    gemm_down=None, swiglu_limit=None, backward=True, stream=0):
    """``Layer``s of ``shape.ep_size`` emulated ranks on one heap, their agreement verified."""
    from mok_core.gemm import default_gemm
    from .layer import Layer, agreement_phases
    heap = EmulatedHeap(shape.ep_size, stream)
    layers = [Layer(shape, tokens_per_rank, config, heap=heap.for_rank(r),
                    gemm=gemm or default_gemm(), gemm_down=gemm_down,
                    swiglu_limit=swiglu_limit, verify=False, backward=backward,
                    stream=stream)
              for r in range(shape.ep_size)]
    run_phases([lay.comm for lay in layers], [agreement_phases(lay, stream) for lay in layers],
               stream)
    for lay in layers:
        lay.comm.check(stream)
    return layers


def run_steps(layers, phase_lists, stream=0) -> None:
    """Run every rank's ``functional.step_phases`` lists (phase by phase, barriers between)."""
    run_phases([lay.comm for lay in layers], phase_lists, stream)
