"""The expert-parallel MoE layer forward, as a small functional API (MoK's ``functional``).

    lw = get_workspace(shape, tokens_per_rank, config, heap=heap)         # once per layer shape
    sched = build_schedule(lw, topk_ids, stream=s)                        # each step
    out, ctx = forward(config, lw, sched, x, router_weights,
                       w_shared_gate, w_shared_up, w_shared_down,
                       w_gate, w_up, w_down, swiglu_limit=None, stream=s)

Every step is a kernel launch on ``stream``; nothing waits for the host, and no count ever leaves
the GPU, so a whole step can be captured in a CUDA graph. The step is a sequence of *phases*
separated by device-side barriers (the only cross-GPU synchronisation):

    build_schedule   phase 0: ids -> every rank's table          | barrier |
                     phase 1: schedule (local)
    forward          phase 0: publish x (+ NaN/Inf check), shared expert FFN
                              (+ the push of this rank's tokens: ``config.dispatch="push"``)
                                                                              | barrier |
                     phase 1: dispatch (pull the rows, or wait for the pushed ones), gather
                              index, routed FFN, push combine                 | barrier |
                     phase 2: fixed-order epilogue -> out

With ``config.dispatch="split"`` the shared expert FFN moves into phase 1: the copy engine's
half of the dispatch starts first, the shared FFN runs on the SMs while it copies, then the SM
pull of the remaining tokens (``ops.dispatch_split_start`` / ``_finish``).

``*_phases`` return the phases as callables so that R ranks emulated in one process (CUDA
simulator, one GPU) can run each phase on every rank before the barrier.

The same launches, regrouped, make the *step* of the graphed fast path (``mok_torch.graphed``):
``step_io`` gives the launches that read the caller's per-step tensors (prologue: publish ids +
publish x; epilogue), ``step_core_phases`` everything between them (schedule, shared FFN on the
published copy ``x_buf``, dispatch .. combine), which reads only the workspace and the weights
and is therefore capturable once and replayable with new inputs; ``step_phases`` = all four.

Shapes (per rank; T tokens, H hidden, I / I_s routed / shared intermediate, E_local experts
here, k top-k, C schedule capacity) and dtypes (bf16 travels as uint16 bits at this level; the
torch/JAX adapters view their bf16 tensors as uint16, zero-copy):
    x [T, H] uint16, topk_ids [T, k] int32 or int64 (-1 = masked), router_weights [T, k] f32,
    w_shared_gate / w_shared_up [I_s, H], w_shared_down [H, I_s],
    w_gate / w_up [E_local, I, H], w_down [E_local, H, I]  (all uint16), out [T, H] uint16.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from mok_core.config import LayerShape, MoKConfig
from mok_core.cuda_compat import as_device_array, device_empty, device_full, launch, upload
from mok_core.gemm import GemmConfig, default_gemm, down, gate_up_swiglu
from mok_core.schedule import Schedule
from mok_core.schedule import build_schedule as _schedule_kernels

from . import ops
from .heap import Heap
from .kernels.agreement import compare_fingerprints_kernel, push_fingerprint_kernel
from .kernels.cast import ids_to_int32_kernel
from .workspace import Workspace, create_workspace  # noqa: F401  (Workspace: type)


@dataclass
class LayerWorkspace:
    """Everything one layer shape needs on one rank, allocated once from shapes.

    comm: the symmetric ``Workspace``; schedule: this rank's ``Schedule``; device buffers:
    ids32 [T, k], gather_index [C], hidden [C, I], y [C, H] (None when the combine is fused
    into the down GEMM), shared_index [T_pad] (row -> token,
    -1 past T), shared_offsets [2], shared_rows [1], hidden_shared [T_pad, I_s],
    y_shared [T_pad, H], out [T, H] (the default output; overwritten by the next call).
    """
    shape: LayerShape
    config: MoKConfig
    gemm: GemmConfig              # gate/up GEMMs (routed and shared)
    gemm_down: GemmConfig         # down GEMMs (``gemm`` unless given apart)
    tokens_per_rank: int
    comm: Workspace
    schedule: Schedule
    ids32: object
    gather_index: object
    hidden: object
    y: object
    shared_index: object
    shared_offsets: object
    shared_rows: object
    hidden_shared: object
    y_shared: object
    out: object
    fingerprint: object
    fingerprint_table: object
    peer_fingerprints: tuple

    @property
    def rank(self) -> int:
        return self.comm.rank

    def check(self, stream=0) -> None:
        """Raise ``MoKError`` for anything the last steps recorded on the device (syncs)."""
        self.schedule.check(stream)
        self.comm.check(stream)


class ForwardContext(NamedTuple):
    """What the backward needs; views into the workspace, valid until the next forward."""
    schedule: Schedule
    gather_index: object      # int32 [C] expert-sorted row -> staging row (-1 padding)
    x_recv: object            # uint16 [R*T, H] token staging
    hidden: object            # uint16 [C, I] routed SwiGLU output
    hidden_shared: object     # uint16 [T_pad, I_s]


def _fingerprint(shape: LayerShape, T: int, config: MoKConfig, gemm: GemmConfig,
                 gemm_down: GemmConfig) -> np.ndarray:
    vals = [shape.hidden, shape.intermediate, shape.shared_intermediate, shape.num_experts,
            shape.topk, shape.ep_size, T, config.row_align, config.minibatch_size,
            config.macrobatch_size, int(config.capacity_factor * 1e6), gemm.bm, gemm.bn,
            gemm.bk, _digest(config), _digest(gemm), _digest(gemm_down)]
    return np.array(vals, np.int32)


def _digest(cfg) -> int:
    """Same value in every process (``hash`` of a dataclass with a str field is salted per
    process, which made ranks 'disagree' on an identical GemmConfig)."""
    return zlib.crc32(repr(cfg).encode()) & 0x7FFFFFFF


def layer_gemm(shape: LayerShape, tokens_per_rank: int) -> GemmConfig:
    """The GEMM tiles ``get_workspace`` uses when given none: ``default_gemm`` for the mean
    rows per local expert, R*T*k/E (uniform routing)."""
    return default_gemm(shape.ep_size * tokens_per_rank * shape.topk / shape.num_experts)


def get_workspace(shape: LayerShape, tokens_per_rank: int, config: MoKConfig, *, heap: Heap,
                  gemm: GemmConfig | None = None, gemm_down: GemmConfig | None = None,
                  verify: bool = True, stream=0) -> LayerWorkspace:
    """Allocate the layer workspace on ``heap`` (collective on NVSHMEM: every rank calls it
    with the same arguments). With ``verify`` (default) the ranks compare fingerprints of their
    shapes and config on the device and a mismatch raises ``MoKError`` here -- the one host
    sync of the layer, at setup. (Emulated heaps: call ``verify_ranks_agree`` per phase.)

    ``gemm``: the tiles of the gate/up GEMMs (default ``layer_gemm``); ``gemm_down``: those of
    the down GEMMs, when they differ (the two shapes favour different tiles: N = 2I, K = H
    against N = H, K = I -- ``benchmarks/bench_ffn.py --sweep`` times them apart)."""
    T = tokens_per_rank
    gemm = gemm or layer_gemm(shape, tokens_per_rank)
    gemm_down = gemm_down or gemm
    if heap.ep_size != shape.ep_size:
        raise ValueError(f"shape.ep_size={shape.ep_size} but the heap has {heap.ep_size} ranks")
    H, I, I_s, k = shape.hidden, shape.intermediate, shape.shared_intermediate, shape.topk
    for g in {gemm, gemm_down}:
        if config.row_align % g.row_unit:
            raise ValueError(f"MoKConfig.row_align={config.row_align} must be a multiple of "
                             f"{g.row_unit} for {g}")
    # gate/up: K = H, N = I (bn/2 per SwiGLU tile); down: K = I, N = H
    for name, n, tile, g in (("hidden", H, gemm.bk, gemm), ("hidden", H, gemm_down.bn, gemm_down),
                             ("intermediate", I, gemm_down.bk, gemm_down),
                             ("intermediate", I, gemm.bn // 2, gemm)):
        if n % tile:
            raise ValueError(f"{name}={n}: must be a multiple of {tile} for {g}")
    if I_s and (I_s % gemm.bk or I_s % (gemm.bn // 2) or I_s % gemm_down.bk):
        raise ValueError(f"shared_intermediate={I_s}: must be a multiple of {gemm.bk}, "
                         f"{gemm.bn // 2} and {gemm_down.bk}")
    comm = create_workspace(heap, tokens_per_rank=T, hidden=H, topk=k,
                            num_experts=shape.num_experts, config=config, stream=stream)
    sched = Schedule.allocate(rank=heap.rank, ep_size=shape.ep_size, tokens_per_rank=T, topk=k,
                              num_experts=shape.num_experts, config=config,
                              capacity=comm.capacity, stream=stream)
    C = comm.capacity
    unit = math.lcm(gemm.bm, gemm_down.bm)            # the shared expert's rows, both GEMMs
    T_pad = max(unit, -(-T // unit) * unit)
    u16, i32 = np.uint16, np.int32
    shared_index = np.where(np.arange(T_pad) < T, np.arange(T_pad), -1).astype(i32)
    fp = _fingerprint(shape, T, config, gemm, gemm_down)
    table, peer_tables = heap.alloc((shape.ep_size, fp.size), i32, -1)
    lw = LayerWorkspace(
        shape=shape, config=config, gemm=gemm, gemm_down=gemm_down, tokens_per_rank=T,
        comm=comm, schedule=sched,
        ids32=device_empty((T, k), i32, stream),
        gather_index=device_full((C,), -1, i32, stream),
        hidden=device_empty((C, I), u16, stream),
        y=(None if _fused_combine(config, gemm_down) else device_empty((C, H), u16, stream)),
        shared_index=upload(shared_index, stream),
        shared_offsets=upload(np.array([0, T_pad], i32), stream),
        shared_rows=upload(np.array([T_pad], i32), stream),
        hidden_shared=device_empty((T_pad, max(I_s, 8)), u16, stream),
        y_shared=device_empty((T_pad, H), u16, stream),
        out=device_empty((T, H), u16, stream),
        fingerprint=upload(fp, stream), fingerprint_table=table,
        peer_fingerprints=tuple(p.reshape(p.size) for p in peer_tables),
    )
    heap.fence()                          # the fingerprint table's fill precedes peers' pushes
    if verify:
        push, compare = verify_ranks_agree(lw, stream)
        push()
        ops.barrier(comm, stream)
        compare()
        comm.check(stream)
    return lw


def verify_ranks_agree(lw: LayerWorkspace, stream=0):
    """Two phases (barrier between): push our fingerprint, compare everyone's."""
    def push():
        launch(push_fingerprint_kernel, 1, 32, stream, 0, lw.rank, lw.fingerprint,
               lw.peer_fingerprints)

    def compare():
        launch(compare_fingerprints_kernel, 1, 32, stream, 0, lw.rank, lw.fingerprint_table,
               lw.comm.errors)
    return push, compare


def schedule_phases(lw: LayerWorkspace, topk_ids, stream=0):
    """[publish ids, build schedule] -- a barrier goes between them."""
    return [_routing_allgather_step(lw, topk_ids, stream), _schedule_step(lw, stream)]


def _routing_allgather_step(lw: LayerWorkspace, topk_ids, stream):
    """Launch: this rank's ids (int64 cast to int32 into ``lw.ids32`` first) into row ``rank``
    of every rank's ids table. Reads the caller's ``topk_ids``."""
    T, k = lw.tokens_per_rank, lw.shape.topk
    ids = as_device_array(topk_ids, "topk_ids", ndim=2, shape=(T, k))
    if np.dtype(ids.dtype) == np.int64:
        n = T * k

        def routing_allgather():
            if n:
                launch(ids_to_int32_kernel, min(256, -(-n // 256)), 256, stream, 0,
                       ids.reshape(n), lw.ids32.reshape(n))
            ops.publish_ids(lw.comm, lw.ids32, stream)
    elif np.dtype(ids.dtype) == np.int32:
        def routing_allgather():
            ops.publish_ids(lw.comm, ids, stream)
    else:
        raise TypeError(f"topk_ids: expected dtype int32 or int64, got {np.dtype(ids.dtype)}")
    return routing_allgather


def _schedule_step(lw: LayerWorkspace, stream):
    """Launch: this rank's schedule from the (complete) ids table -- workspace only."""
    def schedule():
        _schedule_kernels(lw.schedule, lw.comm.ids_table, stream=stream)
    return schedule


def build_schedule(lw: LayerWorkspace, topk_ids, *, stream=0) -> Schedule:
    """Routing all-gather + this rank's schedule (see ``mok_core.schedule``), on the device."""
    for _, run in with_barriers(schedule_phases(lw, topk_ids, stream), lw.comm, stream):
        run()
    return lw.schedule


class _Weights(NamedTuple):
    """Checked device views of one rank's layer weights (shared ones None when I_s = 0)."""
    sg: object
    su: object
    sd: object
    wg: object
    wu: object
    wd: object
    swiglu_limit: object


def _check_config(config: MoKConfig, lw: LayerWorkspace):
    if config != lw.config:
        raise ValueError("config differs from the one the workspace was built with")


def _check_x(lw: LayerWorkspace, x, router_weights):
    T, H, k = lw.tokens_per_rank, lw.shape.hidden, lw.shape.topk
    return (as_device_array(x, "x", dtype=np.uint16, shape=(T, H)),
            as_device_array(router_weights, "router_weights", dtype=np.float32, shape=(T, k)))


def _check_out(lw: LayerWorkspace, out):
    T, H = lw.tokens_per_rank, lw.shape.hidden
    return lw.out if out is None else as_device_array(out, "out", dtype=np.uint16, shape=(T, H))


def _check_weights(lw: LayerWorkspace, w_shared_gate, w_shared_up, w_shared_down, w_gate,
                   w_up, w_down, swiglu_limit) -> _Weights:
    s = lw.shape
    H, I, I_s, E_l = s.hidden, s.intermediate, s.shared_intermediate, s.experts_per_rank
    u16 = np.uint16
    wg = as_device_array(w_gate, "w_gate", dtype=u16, shape=(E_l, I, H))
    wu = as_device_array(w_up, "w_up", dtype=u16, shape=(E_l, I, H))
    wd = as_device_array(w_down, "w_down", dtype=u16, shape=(E_l, H, I))
    sg = su = sd = None
    if I_s:
        sg = as_device_array(w_shared_gate, "w_shared_gate", dtype=u16, shape=(I_s, H))
        su = as_device_array(w_shared_up, "w_shared_up", dtype=u16, shape=(I_s, H))
        sd = as_device_array(w_shared_down, "w_shared_down", dtype=u16, shape=(H, I_s))
    return _Weights(sg, su, sd, wg, wu, wd, swiglu_limit)


def check_swiglu_limit(swiglu_limit):
    """ValueError unless ``swiglu_limit`` is None or a finite number > 0."""
    if swiglu_limit is not None and not (isinstance(swiglu_limit, (int, float))
                                         and math.isfinite(swiglu_limit) and swiglu_limit > 0):
        raise ValueError(f"swiglu_limit={swiglu_limit!r}: must be None or a finite number > 0")


def _publish_x_step(lw: LayerWorkspace, x, w, stream):
    """Launch: x -> this rank's slice of the staging buffer (``lw.comm.x_buf``) + NaN/Inf check
    of x and the router weights. Reads the caller's ``x`` and ``router_weights``."""
    def publish_x():
        ops.publish_x(lw.comm, x, w, stream)
    return publish_x


def _shared_steps(lw: LayerWorkspace, x, W: _Weights, stream):
    """Launches of the shared expert FFN on the [T, H] token rows ``x`` -> ``lw.y_shared``
    (none when I_s = 0). ``x`` is the caller's input (eager forward) or ``lw.comm.x_buf``, the
    published copy of it (the step): the same bits either way."""
    H, I_s = lw.shape.hidden, lw.shape.shared_intermediate
    if not I_s:
        return []

    def shared_gate_up():
        gate_up_swiglu(x, lw.shared_index, W.sg.reshape((1, I_s, H)), W.su.reshape((1, I_s, H)),
                       lw.shared_offsets, lw.shared_rows, lw.hidden_shared,
                       swiglu_limit=W.swiglu_limit, config=lw.gemm, stream=stream)

    def shared_down():
        down(lw.hidden_shared, W.sd.reshape((1, H, I_s)), lw.shared_offsets, lw.shared_rows,
             lw.y_shared, row_index=lw.shared_index, config=lw.gemm_down, stream=stream)
    return [shared_gate_up, shared_down]


def _fused_combine(config: MoKConfig, gemm: GemmConfig) -> bool:
    return config.fuse_combine and gemm.mma != "mma_sync"


def _routed_steps(lw: LayerWorkspace, schedule: Schedule, W: _Weights, stream):
    """Launches from dispatch to combine: workspace and weights only, no caller input. With
    ``config.fuse_combine`` and a wgmma GEMM the down GEMM's epilogue pushes the rows home
    itself (no y, no combine launch)."""
    g, gd = lw.gemm, lw.gemm_down
    fused = _fused_combine(lw.config, gd)

    def dispatch():
        if lw.config.dispatch == "push":    # the rows were pushed in the phase before
            ops.wait_dispatch_push(lw.comm, schedule, stream)
        elif lw.config.dispatch == "split":     # the copy engine started before the shared FFN
            ops.dispatch_split_finish(lw.comm, schedule, stream,
                                      ce_share=lw.config.dispatch_ce_share)
        else:
            ops.dispatch(lw.comm, schedule, stream)
        ops.gather_index(lw.comm, schedule, lw.gather_index, stream)

    def routed_gate_up():
        gate_up_swiglu(lw.comm.x_recv, lw.gather_index, W.wg, W.wu, schedule.expert_offsets,
                       schedule.num_rows, lw.hidden, swiglu_limit=W.swiglu_limit, config=g,
                       stream=stream)

    def routed_down():
        down(lw.hidden, W.wd, schedule.expert_offsets, schedule.num_rows, lw.y,
             row_index=lw.gather_index, config=gd, stream=stream)

    def combine():
        ops.combine(lw.comm, schedule, lw.y, stream)

    def routed_down_push():
        down(lw.hidden, W.wd, schedule.expert_offsets, schedule.num_rows, None,
             row_index=lw.gather_index, push=(schedule.src_rank, schedule.src_token,
                                              schedule.src_slot, lw.comm.peer_combine,
                                              lw.shape.topk), config=gd, stream=stream)
    if fused:
        return [dispatch, routed_gate_up, routed_down_push]
    return [dispatch, routed_gate_up, routed_down, combine]


def _dispatch_phase(lw: LayerWorkspace, schedule: Schedule, W: _Weights, shared_x, stream):
    """The phase after the barrier that follows the x publish: dispatch .. combine. With
    ``config.dispatch == "split"`` the copy engine's half of the dispatch starts first and the
    shared expert FFN (on ``shared_x``) runs on the SMs while it copies -- the copy engine
    needs none; otherwise the shared FFN sits in the phase before (``_early_shared_steps``)."""
    steps = _routed_steps(lw, schedule, W, stream)
    if lw.config.dispatch != "split":
        return _phase(*steps)

    def dispatch_split_start():
        ops.dispatch_split_start(lw.comm, stream, lw.config.dispatch_ce_share)
    return _phase(dispatch_split_start, *_shared_steps(lw, shared_x, W, stream), *steps)


def _early_shared_steps(lw: LayerWorkspace, x, W: _Weights, stream):
    """The shared expert FFN in the phase before the dispatch's (see ``_dispatch_phase``)."""
    return [] if lw.config.dispatch == "split" else _shared_steps(lw, x, W, stream)


def _push_steps(lw: LayerWorkspace, schedule: Schedule, stream):
    """With ``config.dispatch == "push"``: the launch that writes this rank's tokens into the
    ranks that need them, last in the phase before the dispatch's -- after the schedule (it
    says where each route lands) and this rank's x publish, and a barrier away from the
    peers' reads of their staging in the previous step (``kernels.push_dispatch``: the
    caller's ordering duty). The dispatch step then waits for the rows (``_routed_steps``)."""
    if lw.config.dispatch != "push":
        return []

    def dispatch_push():
        ops.dispatch_push(lw.comm, schedule, stream)
    return [dispatch_push]


def _epilogue_step(lw: LayerWorkspace, w, out, stream):
    """Launch: out = y_shared + sum_j w_j y_j. Reads the caller's ``router_weights``."""
    T = lw.tokens_per_rank
    y_shared = lw.y_shared[:T] if lw.shape.shared_intermediate else None

    def epilogue():
        ops.epilogue(lw.comm, w, out, y_shared, stream)
    return epilogue


def forward_phases(config: MoKConfig, lw: LayerWorkspace, schedule: Schedule, x, router_weights,
                   w_shared_gate, w_shared_up, w_shared_down, w_gate, w_up, w_down,
                   swiglu_limit=None, out=None, stream=0):
    """Validate every input, then return the forward's three phases (barriers between) and the
    output array. Nothing is launched before all inputs have passed their checks."""
    _check_config(config, lw)
    if schedule is not lw.schedule:
        raise ValueError("schedule was not built on this workspace (use build_schedule(lw, ...))")
    x, w = _check_x(lw, x, router_weights)
    W = _check_weights(lw, w_shared_gate, w_shared_up, w_shared_down, w_gate, w_up, w_down,
                       swiglu_limit)
    out = _check_out(lw, out)
    check_swiglu_limit(swiglu_limit)
    phase0 = _phase(_publish_x_step(lw, x, w, stream), *_early_shared_steps(lw, x, W, stream),
                    *_push_steps(lw, schedule, stream))
    phase1 = _dispatch_phase(lw, schedule, W, x, stream)
    phase2 = _phase(_epilogue_step(lw, w, out, stream))
    return [phase0, phase1, phase2], out


# --- the whole step (schedule + forward) split for CUDA-graph capture -------------------------

def step_io(lw: LayerWorkspace, topk_ids, x, router_weights, out=None, stream=0):
    """The launches of a step that read the caller's per-step tensors, checked:
    ``(prologue, epilogue, out)``.

    prologue: routing all-gather (ids -> every rank's ids table) + ``publish_x`` (x -> this
    rank's staging slice ``lw.comm.x_buf``, NaN/Inf check of x and router weights).
    epilogue: out = y_shared + sum_j w_j y_j (reads router_weights, writes ``out``).
    Everything between them (``step_core_phases``) reads only the workspace and the weights,
    so it can be captured once in a CUDA graph and replayed with new x / ids / weights
    tensors every step."""
    prologue_ids = _routing_allgather_step(lw, topk_ids, stream)
    x, w = _check_x(lw, x, router_weights)
    out = _check_out(lw, out)
    return _phase(prologue_ids, _publish_x_step(lw, x, w, stream)), \
        _phase(_epilogue_step(lw, w, out, stream)), out


def step_core_phases(config: MoKConfig, lw: LayerWorkspace, w_shared_gate, w_shared_up,
                     w_shared_down, w_gate, w_up, w_down, swiglu_limit=None, stream=0):
    """The step between prologue and epilogue as two phases (a barrier before, between and
    after them, see ``run_step_core``): [schedule, shared FFN on ``lw.comm.x_buf``] and
    [dispatch, gather index, routed gate/up, routed down, combine] (``dispatch="split"``: the
    shared FFN in the second, after the copy engine's start). No caller input is read:
    the shared expert takes its tokens from this rank's staging slice, which ``publish_x``
    (prologue) filled with the same bits. Weights are checked here."""
    _check_config(config, lw)
    W = _check_weights(lw, w_shared_gate, w_shared_up, w_shared_down, w_gate, w_up, w_down,
                       swiglu_limit)
    check_swiglu_limit(swiglu_limit)
    x_buf = lw.comm.x_buf
    return [_phase(_schedule_step(lw, stream), *_early_shared_steps(lw, x_buf, W, stream),
                   *_push_steps(lw, lw.schedule, stream)),
            _dispatch_phase(lw, lw.schedule, W, x_buf, stream)]


def run_step_core(core_phases, comm, stream=0):
    """barrier, core phase 0, barrier, core phase 1, barrier (what a step's graph holds)."""
    ops.barrier(comm, stream)
    for _, run in with_barriers(core_phases, comm, stream):
        run()
    ops.barrier(comm, stream)


def step_phases(config: MoKConfig, lw: LayerWorkspace, topk_ids, x, router_weights,
                w_shared_gate, w_shared_up, w_shared_down, w_gate, w_up, w_down,
                swiglu_limit=None, out=None, stream=0):
    """The whole step (``build_schedule`` + ``forward``) in the order of the graphed fast path,
    as four phases with a barrier between consecutive ones, and the output array:

        [publish ids, publish x] | [schedule, shared FFN (from x_buf)] |
        [dispatch .. combine] | [epilogue]

    (``dispatch="split"``: the shared FFN in the dispatch phase, after the copy engine starts.)

    Same kernels, same data and the same three barriers as ``build_schedule`` + ``forward``;
    only ``publish_x`` moves before the first barrier (safe: see ``mok_torch.graphed``). The
    output equals ``forward``'s bit for bit. Everything is checked before anything launches."""
    prologue, epilogue, out = step_io(lw, topk_ids, x, router_weights, out, stream)
    core = step_core_phases(config, lw, w_shared_gate, w_shared_up, w_shared_down, w_gate,
                            w_up, w_down, swiglu_limit, stream)
    return [prologue, *core, epilogue], out


def step(config: MoKConfig, lw: LayerWorkspace, topk_ids, x, router_weights, w_shared_gate,
         w_shared_up, w_shared_down, w_gate, w_up, w_down, swiglu_limit=None, *, out=None,
         stream=0):
    """``build_schedule`` + ``forward`` in one call, every input checked before the first
    launch (``step_phases``; at EP > 1 a rank that refuses its inputs launches nothing, so no
    peer is left waiting at a barrier it would have reached). Returns ``out`` (uint16 [T, H]),
    bit for bit ``forward``'s; no ``ForwardContext`` (what the framework ops use)."""
    phases, out = step_phases(config, lw, topk_ids, x, router_weights, w_shared_gate,
                              w_shared_up, w_shared_down, w_gate, w_up, w_down, swiglu_limit,
                              out, stream)
    for _, run in with_barriers(phases, lw.comm, stream):
        run()
    return out


def with_barriers(phases, comm, stream=0):
    """(name, launch) of every launch group of ``phases`` in order (a phase's own ``.steps``
    when it has them), with the cross-rank barrier on ``comm`` between consecutive phases --
    how ``build_schedule`` and ``forward`` run, and what a per-step timer walks."""
    def barrier():
        ops.barrier(comm, stream)
    for i, phase in enumerate(phases):
        if i:
            yield "barrier", barrier
        for step in getattr(phase, "steps", (phase,)):
            yield step.__name__, step


def _phase(*steps):
    """A phase = its launches in order; ``.steps`` exposes them one by one (per-step timing)."""
    def run():
        for step in steps:
            step()
    run.steps = steps
    return run


def forward(config: MoKConfig, workspace: LayerWorkspace, schedule: Schedule, x, router_weights,
            w_shared_gate, w_shared_up, w_shared_down, w_gate, w_up, w_down,
            swiglu_limit=None, *, out=None, stream=0):
    """The MoE layer forward on this rank (see the module docstring for shapes).

    Returns:
        (out uint16 [T, H], ForwardContext). ``out`` defaults to the workspace's output buffer
        (overwritten by the next call); pass ``out=`` to keep results.
    Raises:
        TypeError / ValueError for a wrong dtype, shape or device -- before any launch.
        Device-side problems (bad expert ids, capacity overflow, NaN/Inf input, a peer that
        never arrives) are recorded in the error words; ``workspace.check()`` raises them.
    """
    phases, out = forward_phases(config, workspace, schedule, x, router_weights, w_shared_gate,
                                 w_shared_up, w_shared_down, w_gate, w_up, w_down,
                                 swiglu_limit, out, stream)
    for _, run in with_barriers(phases, workspace.comm, stream):
        run()
    return out, _context(workspace, schedule)


def _context(lw: LayerWorkspace, schedule: Schedule) -> ForwardContext:
    return ForwardContext(schedule, lw.gather_index, lw.comm.x_recv, lw.hidden,
                          lw.hidden_shared)


def context_of(lw: LayerWorkspace) -> ForwardContext:
    """The forward context of the last forward run on ``lw``."""
    return _context(lw, lw.schedule)


__all__ = ["ForwardContext", "LayerWorkspace", "build_schedule", "context_of", "forward",
           "forward_phases", "get_workspace", "layer_gemm", "run_step_core",
           "schedule_phases", "step_core_phases", "step_io", "step_phases",
           "verify_ranks_agree", "with_barriers"]
