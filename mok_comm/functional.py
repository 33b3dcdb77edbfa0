"""The layer step as functions: validate once, then four phases with a barrier between each.

    out, ctx = forward(layer, x, topk_ids, router_weights, weights, out=None, stream=s)

``layer`` is a ``mok_comm.layer.Layer`` (it owns config, buffers and schedule). Every launch is
on ``stream``; nothing waits for the host and no count leaves the GPU, so a step can be captured
in a CUDA graph. Inputs (per rank; bf16 as uint16 bits):

    x [T, H] uint16, topk_ids [T, k] int32 or int64 (-1 = masked route), router_weights [T, k]
    float32, weights: ``Weights`` (shapes there), out [T, H] uint16 (default: ``layer.out``'s
    first T rows). T is x's rows, any 0 <= T <= T_max (``layer.tokens_per_rank``), different
    per rank and per step; the count reaches the other ranks as masked rows of the routing
    table (``mok_comm.routing``), so no count crosses and nothing waits for one.

The phases (``step_phases``), the only cross-rank synchronisation being the barriers:

    0 publish     ids -> row ``rank`` of every rank's ids table (-1 past T); x -> this rank's
                  token staging slice ``x_buf`` (NaN/Inf in x and router_weights counted);
                  the shared expert's rows for T (``token_rows``)                    | barrier |
    1 schedule    this rank's schedule from the complete ids table; with
                  ``dispatch="pull"`` also the shared expert FFN on ``x_buf``         | barrier |
    2 experts     dispatch (``"split"``: the copy engine starts, the shared expert FFN runs on
                  the SMs meanwhile, then the SM pull of the rest), gather index, routed
                  gate/up + SwiGLU, down with the combine pushed home from its epilogue
                  (or down into ``y`` + the combine kernel); every GEMM counts NaN/Inf in
                  its output tiles into the step's error word                          | barrier |
    3 epilogue    out = y_shared + sum_j w_j y_j, slots ascending, FP32, one bf16 rounding

``MoKConfig(precision="fp8")``: phase 2's routed gate/up first quantises the landed tokens
1 x 128 into expert order, rows below the schedule's num_rows (``quantize_expert_rows``, the
backward's d_out too: at EP < k once a token -- the staging's rows, ``x8_tokens`` --, then
gathered by ``mok_core.gather_rows``, else route by route, ``quantize_fp8(index=gather_index)``,
the same bytes), then runs the FP8 gate|up + SwiGLU GEMM on ``weights.fp8`` (saving its FP32
gate and up as the bf16 one does); the down step quantises h 1 x 128 and the FP8 down GEMM
pushes each row home from its epilogue as the bf16 one does (``fuse_combine``; else it writes
``y`` for the combine kernel). Tokens travel bf16; the shared expert stays bf16; the backward
(``mok_comm.backward``) differentiates at the FP8 forward's activations (its saved g / u and
h), its routed data gradients in FP8 (and where ``Layer.fp8_wgrad`` its routed weight
gradients).

A layer with backward buffers (``layer.grad``) also saves the gate and up pre-activations
from both gate/up GEMMs' epilogues, in FP32 (``BackwardBuffers.gate`` / ``up``, ``gate_s`` /
``up_s``): the backward differentiates the SwiGLU at them instead of recomputing them
(``mok_comm.backward``); a forward-only layer writes nothing more.

Phases 1 and 2 read only the layer's buffers and the weights -- never the caller's x, ids or
router weights -- so ``barrier, 1, barrier, 2, barrier`` is what a graphed step captures once
(``run_core``) while phases 0 and 3 run eagerly around the replay with fresh tensors. Eager and
graphed steps are therefore the same launches in the same order.

Ordering duties the barriers carry: barrier 0->1 makes every rank's ids and tokens visible
before anyone schedules or pulls; 1->2 is kept so that a peer's pull of step N (phase 2) and our
publish of step N+1 (phase 0) are always separated by the 2->3 barrier of step N (write after
read across steps); 2->3 makes every pushed combine row visible before the epilogue reads it.

``step_phases`` returns the phases as lists of named calls so that R ranks emulated in one
process (simulator, one GPU; ``mok_comm.emulation``) can run each phase on every rank before
the barrier.
"""
from __future__ import annotations

from functools import partial
from typing import NamedTuple

import numpy as np

from mok_core import errors as err
from mok_core.cuda_compat import as_device_array, names_rank
from mok_core.errors_kernels import scratch_error_word
from mok_core.gather_rows import launch_gather_rows
from mok_core.gemm import launch_down, launch_fp8_gemm, launch_gate_up_swiglu
from mok_core.quantize import launch_quantize_rows
from mok_core.schedule import build_schedule, token_rows

from . import combine, dispatch, routing
from .barrier import barrier
from .layer import FP8Weights, ForwardContext, Layer, Weights, WeightsFP8, fp8_shapes


class StepInputs(NamedTuple):
    """One step's checked device views of the caller's tensors."""
    tokens: int               # T
    topk_ids: object          # int32 or int64 [T, k]
    x: object                 # uint16 [T, H]
    router_weights: object    # float32 [T, k]
    out: object               # uint16 [T, H]


def step_tokens(layer: Layer, x, name: str = "x") -> int:
    """T, the rows of ``x`` ([T, H]); ValueError past the layer's T_max."""
    shape = getattr(x, "shape", None)
    T = shape[0] if shape is not None and len(shape) == 2 else None
    if T is not None and T > layer.tokens_per_rank:
        raise ValueError(f"{name}: {T} tokens on rank {layer.rank}, but the layer holds at most "
                         f"tokens_per_rank={layer.tokens_per_rank} (T_max: build it with the "
                         "largest count a step brings)")
    return layer.tokens_per_rank if T is None else int(T)   # (the shape check names it)


@names_rank
def check_inputs(layer: Layer, x, topk_ids, router_weights, out=None) -> StepInputs:
    """Checked zero-copy views of a step's tensors (TypeError / ValueError naming the tensor);
    T is x's rows."""
    T, H = step_tokens(layer, x), layer.shape.hidden
    x, router_weights = dispatch.check_x(layer.comm, x, router_weights, T)
    ids = routing.check_ids(layer.comm, topk_ids, T)
    return StepInputs(T, ids, x, router_weights,
                      layer.out[:T] if out is None else as_device_array(
                          out, "out", dtype=np.uint16, shape=(T, H), align=16))


def check_weight_count(layer: Layer, weights) -> bool:
    """TypeError unless ``weights`` holds the layer's count -- 6 (``Weights``), or 7
    (``WeightsFP8``) for ``MoKConfig(precision="fp8")`` --; whether it is an FP8 layer."""
    fp8_layer = layer.config.precision == "fp8"
    if len(weights) != (7 if fp8_layer else 6):
        want = ("7: WeightsFP8(*weights, quantize_weights(weights)) (Weights' six and fp8, "
                "the routed experts quantised by the quantize_weights of mok_comm.layer, "
                "mok_torch or mok_jax_adapter)" if fp8_layer else
                f"6 tensors ({', '.join(Weights._fields)})")
        raise TypeError(f"weights: expected {want}, got {len(weights)}")
    return fp8_layer


@names_rank
def check_weights(layer: Layer, weights, *, backward: bool = False):
    """Checked views of ``weights`` (a ``Weights`` or a 6-sequence in its order; with
    ``MoKConfig(precision="fp8")`` a ``WeightsFP8``, its 7th the quantised routed experts:
    an ``FP8Weights``, whose transposed copies ``backward`` requires): the same type back, the
    shared ones None when the shape has no shared expert."""
    s = layer.shape
    H, I, I_s, E_l = s.hidden, s.intermediate, s.shared_intermediate, s.experts_per_rank
    fp8_layer = check_weight_count(layer, weights)
    shapes = ((I_s, H), (I_s, H), (H, I_s), (E_l, I, H), (E_l, I, H), (E_l, H, I))
    checked = [None if i < 3 and not I_s else
               as_device_array(w, name, dtype=np.uint16, shape=shp, align=16)
               for i, (w, name, shp) in enumerate(zip(weights, Weights._fields, shapes))]
    if not fp8_layer:
        return Weights(*checked)
    fp8 = weights[6]
    if fp8 is None or len(fp8) not in (6, len(FP8Weights._fields)):
        raise TypeError("weights.fp8: MoKConfig(precision='fp8') needs the routed experts "
                        "quantised, an FP8Weights (mok_comm.layer.quantize_weights)")
    views = []
    specs = fp8_shapes(E_l, I, H).items()
    for i, (a, (name, (dtype, shp))) in enumerate(zip(FP8Weights(*fp8), specs)):
        if a is None and i >= 6:            # the transposed copies: the backward's only
            if backward:
                raise ValueError(f"weights.fp8.{name}: None, but the FP8 backward's data "
                                 "gradients read it (quantize_weights(weights, backward=True))")
            views.append(None)
            continue
        views.append(as_device_array(a, f"weights.fp8.{name}", dtype=dtype, shape=shp,
                                     align=16))
    return WeightsFP8(*checked, FP8Weights(*views))


# --- the phases' launches (named, so that traces and per-launch timers read them) --------------

def publish_ids(layer: Layer, ids, stream):
    """This rank's ids, checked and narrowed to int32 (``layer.ids32``; bad ones recorded and
    replaced), into row ``rank`` of every ids table: one launch."""
    routing.check_and_publish_ids(layer.comm, ids, layer.ids32, stream)


def publish_x(layer: Layer, x, router_weights, stream):
    dispatch.publish_x(layer.comm, x, router_weights, stream)


def shared_rows(layer: Layer, tokens: int, stream):
    """The shared expert's rows: this rank's first ``tokens`` tokens, in order."""
    if layer.shape.shared_intermediate:
        token_rows(layer.shared_index, layer.shared_offsets, layer.shared_rows, tokens,
                   layer.shared_unit, stream)


def schedule(layer: Layer, stream):
    build_schedule(layer.schedule, layer.comm.ids_table, stream=stream)


def _nan_check(layer: Layer, tensor: int) -> dict:
    """Where a GEMM reports NaN/Inf in its output tile: the step's word, as ``tensor``."""
    return {"errors": layer.comm.errors, "tensor": tensor, "rank": layer.rank}


def _saved_pre(layer: Layer, shared: bool):
    """Where the gate/up GEMM saves its FP32 pre-activations for the backward: the layer's
    backward buffers (``BackwardBuffers.gate`` / ``up``, ``gate_s`` / ``up_s``), None for a
    forward-only layer (nothing more written)."""
    g = layer.grad
    if g is None:
        return None
    return (g.gate_s, g.up_s) if shared else (g.gate, g.up)


def shared_gate_up(layer: Layer, W: Weights, stream):
    """The shared expert's gate/up + SwiGLU on this rank's tokens, read from ``x_buf``."""
    H, I_s = layer.shape.hidden, layer.shape.shared_intermediate
    launch_gate_up_swiglu(layer.comm.x_buf, layer.shared_index, W.w_shared_gate.reshape((1, I_s, H)),
                          W.w_shared_up.reshape((1, I_s, H)), layer.shared_offsets,
                          layer.shared_rows, layer.hidden_shared, pre=_saved_pre(layer, True),
                          swiglu_limit=layer.swiglu_limit, config=layer.gemm, stream=stream,
                          **_nan_check(layer, err.NF_SHARED_HIDDEN))


def shared_down(layer: Layer, W: Weights, stream):
    H, I_s = layer.shape.hidden, layer.shape.shared_intermediate
    launch_down(layer.hidden_shared, W.w_shared_down.reshape((1, H, I_s)), layer.shared_offsets,
                layer.shared_rows, layer.y_shared, row_index=layer.shared_index,
                config=layer.gemm_down, stream=stream, **_nan_check(layer, err.NF_SHARED_Y))


def split_start(layer: Layer, stream):
    dispatch.split_start(layer.comm, stream, layer.config.dispatch_ce_share)


def pull(layer: Layer, stream):
    """The SM pull of the needed tokens (``"split"``: of those the copy engine does not move,
    joining its side stream), then the GEMMs' gather index."""
    if layer.config.dispatch == "split":
        dispatch.split_finish(layer.comm, layer.schedule, stream, layer.config.dispatch_ce_share)
    else:
        dispatch.pull(layer.comm, layer.schedule, stream)
    dispatch.gather_index(layer.comm, layer.schedule, layer.gather_index, stream)


def quantize_expert_rows(staging, index, num_rows, out8, out8_scale, tokens8, tokens8_scale,
                         stream):
    """A token staging's rows (x or d_out, bf16 [R*T, H]) quantised 1 x 128 into expert order:
    ``out8`` e4m3 [C, H] with ``out8_scale`` [C, H / 128], rows below ``num_rows`` through
    ``index``. With ``tokens8`` / ``tokens8_scale`` (the staging's shape; the layer has them
    where EP < k: a rank gets more routes than staging rows): once a token -- every staging
    row: those no expert here wants are stale, their bytes never read -- then gathered
    (``mok_core.gather_rows``: the same bytes); None: route by route. The staging's NaN/Inf
    were counted at publish: the quantiser reports to a scratch word."""
    if tokens8 is not None:
        launch_quantize_rows(staging, tokens8, tokens8_scale, stream=stream,
                             errors=scratch_error_word())
        launch_gather_rows(tokens8, tokens8_scale, index, num_rows, out8, out8_scale,
                           stream=stream)
    else:
        launch_quantize_rows(staging, out8, out8_scale, index=index, num_rows=num_rows,
                             stream=stream, errors=scratch_error_word())


def routed_gate_up(layer: Layer, W: Weights, stream):
    s = layer.schedule
    if layer.config.precision == "fp8":
        quantize_expert_rows(layer.comm.x_recv, layer.gather_index, s.num_rows, layer.x8,
                             layer.x8_scale, layer.x8_tokens, layer.x8_tokens_scale, stream)
        q = W.fp8
        launch_fp8_gemm(layer.x8, layer.x8_scale, q.w_gate, q.w_gate_scale, s.expert_offsets,
                        s.num_rows, layer.hidden, w_up=q.w_up, w_up_scale=q.w_up_scale,
                        swiglu_limit=layer.swiglu_limit, pre=_saved_pre(layer, False),
                        bm=layer.fp8_bm, stream=stream, **_nan_check(layer, err.NF_HIDDEN))
        return
    launch_gate_up_swiglu(layer.comm.x_recv, layer.gather_index, W.w_gate, W.w_up,
                          s.expert_offsets, s.num_rows, layer.hidden,
                          pre=_saved_pre(layer, False), swiglu_limit=layer.swiglu_limit,
                          config=layer.gemm, stream=stream, **_nan_check(layer, err.NF_HIDDEN))


def combine_route(layer: Layer) -> tuple:
    """The fused combine's route, as the GEMMs' ``push`` takes it: each expert-sorted row's
    (source rank, token, slot) and every rank's combine rows (the forward's y, the
    backward's routed d_x rows)."""
    s = layer.schedule
    return s.src_rank, s.src_token, s.src_slot, layer.peer_combine32, layer.shape.topk


def routed_down_push(layer: Layer, W: Weights, stream):
    """down with the combine fused: each row goes home from the GEMM's epilogue."""
    s, route = layer.schedule, combine_route(layer)
    if layer.config.precision == "fp8":
        _quantize_hidden(layer, stream)
        q = W.fp8
        launch_fp8_gemm(layer.h8, layer.h8_scale, q.w_down, q.w_down_scale, s.expert_offsets,
                        s.num_rows, None, push=route, bm=layer.fp8_bm, stream=stream,
                        **_nan_check(layer, err.NF_Y))
        return
    launch_down(layer.hidden, W.w_down, s.expert_offsets, s.num_rows, None,
                row_index=layer.gather_index,
                push=route, config=layer.gemm_down, stream=stream,
                **_nan_check(layer, err.NF_Y))


def _quantize_hidden(layer: Layer, stream):
    """FP8: h quantised 1 x 128, the rows the schedule filled (its NaN/Inf were counted by
    the gate/up epilogue that wrote it: the quantizer's report goes to a scratch word)."""
    launch_quantize_rows(layer.hidden, layer.h8, layer.h8_scale,
                         num_rows=layer.schedule.num_rows, stream=stream,
                         errors=scratch_error_word())


def routed_down(layer: Layer, W: Weights, stream):
    s = layer.schedule
    if layer.config.precision == "fp8":
        _quantize_hidden(layer, stream)
        q = W.fp8
        launch_fp8_gemm(layer.h8, layer.h8_scale, q.w_down, q.w_down_scale, s.expert_offsets,
                        s.num_rows, layer.y, bm=layer.fp8_bm, stream=stream,
                        **_nan_check(layer, err.NF_Y))
        return
    launch_down(layer.hidden, W.w_down, s.expert_offsets, s.num_rows, layer.y,
                row_index=layer.gather_index, config=layer.gemm_down, stream=stream,
                **_nan_check(layer, err.NF_Y))


def combine_rows(layer: Layer, stream):
    combine.combine(layer.comm, layer.schedule, layer.y, stream)


def epilogue(layer: Layer, router_weights, out, stream):
    T = out.shape[0]
    y_shared = layer.y_shared[:T] if layer.shape.shared_intermediate else None
    combine.epilogue(layer.comm, router_weights, out, y_shared, stream)


# --- phases -------------------------------------------------------------------------------------

def _trap_checks(layer: Layer, stream):
    """``MoKConfig(errors="trap")``: a launch that aborts the context on any flag, per phase."""
    return [partial(layer.errors.trap_check, stream)] if layer.config.errors == "trap" else []


def io_phases(layer: Layer, inputs: StepInputs, stream=0):
    """(phase 0, phase 3): the launches that read the caller's tensors, and the step's error
    report (cleared first, copied to the host last). A problem an earlier step recorded is
    raised here, before anything launches. The layer's ``tokens`` becomes this step's T and
    its ``steps`` counts it (the contexts of earlier steps are stale from here)."""
    layer.errors.poll(stream=stream)
    layer.tokens = inputs.tokens
    layer.steps += 1
    p0 = [partial(layer.errors.begin, stream), partial(publish_ids, layer, inputs.topk_ids, stream),
          partial(publish_x, layer, inputs.x, inputs.router_weights, stream),
          partial(shared_rows, layer, inputs.tokens, stream), *_trap_checks(layer, stream)]
    p3 = [partial(epilogue, layer, inputs.router_weights, inputs.out, stream),
          *_trap_checks(layer, stream), partial(layer.errors.end, stream)]
    return p0, p3


def core_phases(layer: Layer, W: Weights, stream=0, *, down: bool = True):
    """[phase 1, phase 2]: the launches that read only the layer's buffers and ``W``
    (``down=False``: up to the SwiGLU outputs -- what the backward's context holds)."""
    shared = []
    if layer.shape.shared_intermediate:
        shared = [partial(shared_gate_up, layer, W, stream)]
        shared += [partial(shared_down, layer, W, stream)] if down else []
    split = layer.config.dispatch == "split"
    p1 = [partial(schedule, layer, stream)] + ([] if split else shared)
    p2 = ([partial(split_start, layer, stream)] + shared if split else [])
    p2 += [partial(pull, layer, stream), partial(routed_gate_up, layer, W, stream)]
    if down and layer.fused_combine:
        p2.append(partial(routed_down_push, layer, W, stream))
    elif down:
        p2 += [partial(routed_down, layer, W, stream), partial(combine_rows, layer, stream)]
    return [p1 + _trap_checks(layer, stream), p2 + _trap_checks(layer, stream)]


def step_phases(layer: Layer, x, topk_ids, router_weights, weights, *, out=None, stream=0):
    """Every input checked, then ``([phase 0, 1, 2, 3], out)``: each phase a list of calls."""
    inputs = check_inputs(layer, x, topk_ids, router_weights, out)
    W = check_weights(layer, weights)
    p0, p3 = io_phases(layer, inputs, stream)
    return [p0, *core_phases(layer, W, stream), p3], inputs.out


def recompute_phases(layer: Layer, x, topk_ids, router_weights, weights, *, stream=0):
    """``recompute_forward_context``'s phases: the forward's without the down GEMMs, the
    combine and the epilogue (the last phase only ends the step's error report; the barrier
    before it keeps the forward's ordering duties)."""
    inputs = check_inputs(layer, x, topk_ids, router_weights)
    W = check_weights(layer, weights)
    p0, _ = io_phases(layer, inputs, stream)
    return [p0, *core_phases(layer, W, stream, down=False), [partial(layer.errors.end, stream)]]


def recompute_forward_context(layer: Layer, x, topk_ids, router_weights, weights, *,
                              stream=0) -> ForwardContext:
    """Activation checkpointing: rebuild the ``ForwardContext`` of a step from its inputs
    (routing, schedule, dispatch, shared and routed gate/up + SwiGLU with their saved FP32
    pre-activations), bit for bit what the forward left, without the down GEMMs, the combine
    or the epilogue. A caller that drops the
    context between forward and backward (another layer's step reused the buffers, or it runs
    the layer again) calls this right before ``mok_comm.backward.backward``."""
    run_phases(recompute_phases(layer, x, topk_ids, router_weights, weights, stream=stream),
               layer, stream)
    return layer.context()


def run_phases(phases, layer: Layer, stream=0) -> None:
    """Run the phases in order with the cross-rank barrier between consecutive ones."""
    for i, phase in enumerate(phases):
        if i:
            barrier(layer.comm, stream)
        for call in phase:
            call()


def run_core(core, layer: Layer, stream=0) -> None:
    """barrier, phase 1, barrier, phase 2, barrier: what a graphed step captures."""
    barrier(layer.comm, stream)
    run_phases(core, layer, stream)
    barrier(layer.comm, stream)


def forward(layer: Layer, x, topk_ids, router_weights, weights, *, out=None, stream=0):
    """One step of the MoE layer on this rank (shapes: module docstring).

    Returns:
        (out uint16 [T, H], ForwardContext). ``out`` defaults to ``layer.out``'s first T rows
        (overwritten by the next step); pass ``out=`` to keep results.
    Raises:
        TypeError / ValueError for a wrong dtype, shape or device, before any launch (at EP > 1
        a rank that refuses its inputs launches nothing, so no peer waits at a barrier it
        would have reached). Device-side problems (bad expert ids, capacity overflow, NaN/Inf
        input, a peer that never arrives) go to the error words; ``layer.check()`` raises them.
    """
    phases, out = step_phases(layer, x, topk_ids, router_weights, weights, out=out,
                              stream=stream)
    run_phases(phases, layer, stream)
    return out, layer.context()


__all__ = ["StepInputs", "check_inputs", "check_weights", "combine_route", "core_phases",
           "forward", "io_phases", "recompute_forward_context", "recompute_phases", "run_core",
           "run_phases", "step_phases", "step_tokens"]
