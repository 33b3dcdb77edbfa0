"""The layer's backward as functions: validate once, then three phases with a barrier between.

    grads = backward(layer, ctx, d_out, router_weights, weights, *, grads=None,
                     accumulate=False, stream=s)

``ctx`` is the ``ForwardContext`` of the step being differentiated (the layer's last forward:
its T, schedule, gather index, token staging, SwiGLU output and saved FP32 pre-activations),
``d_out`` [T, H] uint16 (bf16 bits) the gradient of the step's output (T = ``ctx.tokens``),
``router_weights`` [T, k] float32 and ``weights`` the step's (``Weights``). Returns ``Grads``
(shapes there). Every launch is on ``stream``; nothing waits for the host and no count leaves
the GPU, so forward and backward can be captured in one CUDA graph.

The math (per route r = (token t, slot j) of expert e, w its router weight, h its bf16 SwiGLU
output; ``mok_core.reference.moe_backward`` is the float64 statement):

    p_r       = d_out[t] W_down[e]                    (the down GEMM's data gradient)
    d_w[t, j] = <p_r, h_r>  (= <d_out[t], y_r>)      (0 for masked routes)
    d_g, d_u  = SwiGLU'(g_r, u_r) applied to w p_r    (g, u saved by the forward: below)
    d_x[t]    = d_x_shared[t] + sum_j (d_g W_gate[e] + d_u W_up[e]),  slots ascending
    dW_down[e] = sum_r d_out[t_r]^T (w_r h_r),  dW_gate[e] = sum_r d_g^T x[t_r],  dW_up likewise

and the shared expert the same with w = 1 and no routing.

The phases (``backward_phases``), the only cross-rank synchronisation being the barriers:

    0 publish   d_out -> this rank's slice of the d_out staging (NaN/Inf counted as "d_out"),
                router weights -> this rank's symmetric copy                 | barrier |
    1 experts   shared expert: p = d_out W_sd, SwiGLU backward, d_x_s = [d_g | d_u]
                [W_sg; W_su], its three weight gradients;
                routed: pull of the d_out rows this rank's experts need (the forward's
                dispatch and schedule: a token crosses NVLink once per rank however many of
                its routes land there), p = d_out W_down, SwiGLU backward at the saved g, u
                with d_w pushed home (``mok_core.swiglu_backward``),
                d_x rows = [d_g | d_u] [W_gate; W_up] pushed home into the combine rows
                (from the GEMM's epilogue, or by ``combine.combine``), the three weight
                gradients                                                    | barrier |
    2 epilogue  d_x = d_x_s + sum_j (d_x row of route (t, j), pushed home) in FP32, slots
                ascending (the forward's epilogue with unit weights); d_router_weights
                from the pushed values, 0 on masked routes

Ordering duties the barriers carry: barrier 0->1 makes every rank's d_out and router weights
visible before anyone pulls them; 1->2 makes every pushed d_x row and d_w visible before the
epilogue reads them. Across calls: a peer pulls our d_out in its phase 1, we overwrite it in
the next backward's phase 0, after this backward's 1->2 barrier; the forward's next pushes into
the combine rows come after its own barriers, so after our epilogue read them.

g and u are saved by the forward, in FP32: its gate/up GEMMs write the accumulators their
SwiGLU epilogue consumed (before the clamp) into ``layer.grad.gate`` / ``up`` (``gate_s`` /
``up_s``: the shared expert's) when the layer has backward buffers (``mok_comm.functional``,
``mok_core.gemm.gate_up_swiglu``'s ``pre``). FP32, so the clamp masks are the forward's
(bf16 pre-activations flip masks within a rounding of the limit), and the very values: no
drift between the forward's h and the derivative. Saved, not recomputed: the recompute (two
FP32-output GEMMs from the staged x, a third of the forward's FLOPs again) measured a sixth
of the backward at qwen's shape (docs/perf.md, Backward); saving costs the forward's gate/up
epilogues 8 bytes of stores per (row, intermediate column) and no memory the backward
buffers did not hold already. ``recompute_forward_context`` rewrites them with the rest of
the context, bit for bit.

``MoKConfig(precision="fp8")``: the routed experts' two data gradients run in FP8 (DeepSeek-V3's
recipe): the d_out rows are quantised 1 x 128 into expert order on the way as the forward's
x is (where EP < k once a token -- the d_out staging's rows -- then gathered by
``mok_core.gather_rows``, else ``quantize_fp8(index=gather_index)``), [d_g | d_u] by the SwiGLU
backward's kernel as it writes them (``mok_core.swiglu_backward``'s ``quant``), and
``fp8_gemm`` multiplies them by the weights' transposed copies (``FP8Weights.w_down_t`` [E, I,
H] and ``w_gate_up_t`` [E, H, 2I], made with the forward's copies by ``quantize_weights``):
e4m3 wgmma reads both operands K-major, and these GEMMs reduce over the weights' other side.
The weight gradients run in FP8 too where ``Layer.fp8_wgrad`` (``MoKConfig.fp8_wgrad``
resolved: by default where the layer's experts take more than two 128-row K slices): then
``wgrad_rows`` lays
each expert's rows out from a multiple of 128 (``mok_core.wgrad_rows``: a 128-row scale block
must not hold two experts, and the schedule pads to ``row_align`` only), each weight
gradient's two operands are quantised transposed along those rows into the buffers the data
gradients' quantised rows used (read by then: one stream) -- d_out^T and [d_g | d_u]^T 1 x
128, (w h)^T and x^T 128 x 128, the tokens gathered on the way, zeros past an expert's rows
-- and ``fp8_wgrad`` reduces them (dW_gate / dW_up from one launch, split at I; FP32 into
``grads`` with ``accumulate``). Elsewhere bf16: with K an expert's rows, a few slices a tile,
the FP8 kernel wins only where experts hold enough rows, and its operands' quantisations take
most of that (docs/perf.md, FP8). The shared expert stays bf16, as in the forward.

GEMM tiles (the layer's, chosen at construction: ``mok_comm.layer``): the two data gradients
(p = d_out W_down, the d_x rows = [d_g | d_u] [W_gate; W_up]; ``mok_core.gemm.dgrad``,
weights read as stored) on ``layer.dgrad_gemm``: the wgmma kernel (``sm90``'s B_KN) where the
forward's tiles are wgmma and the shape splits into its tile, else ``layer.backward_gemm``
(mma.sync) -- FP8's routed ones on ``fp8_gemm`` at the forward's tile rows (``layer.fp8_bm``);
the weight gradients on ``layer.wgrad_gemm`` (FP32 ones, added to or not:
``layer.main_grad_gemm``): the wgmma kernel (``sm90_wgrad``, both operands MN-major) where the
forward's tiles are wgmma and the shape splits into its tile, else mma.sync (``fp8_wgrad``:
the routed ones on ``sm90_fp8``'s WGRAD, 128 columns wide into FP32 or where an expert's rows
take at most two K slices, else its tile by N, a slice deeper where they take more than three
-- ``layer.fp8_wgrad_tile``). The routed d_x
rows go home from the wgmma or FP8 GEMM's epilogue (a bulk copy a row, or 16-byte stores,
into the source rank's combine row: the forward's fused combine, ``Layer.fused_d_x_push``),
so they are never written here and read back; the mma.sync GEMM, or
``MoKConfig(fuse_combine=False)``, writes them and the combine kernel pushes them -- the same
bits either way.

Determinism: every GEMM has one owner per output tile and a fixed K order (weight gradients
sum an expert's rows in ascending row order), the SwiGLU backward's dot product a fixed
butterfly, the epilogue a fixed slot order: bitwise-identical gradients for identical inputs.
Padding rows are zeros (they contribute nothing); an expert with no rows gets zero weight
gradients (written, or with ``accumulate`` left as they were).
"""
from __future__ import annotations

from functools import partial
from typing import NamedTuple

import numpy as np

from mok_core import errors as err
from mok_core.cuda_compat import (as_device_array, device_copy, device_empty, flat_view,
                                  names_rank)
from mok_core.errors_kernels import scratch_error_word
from mok_core.gemm import launch_dgrad, launch_fp8_gemm, launch_fp8_wgrad, launch_wgrad
from mok_core.quantize import launch_quantize_cols
from mok_core.swiglu_backward import launch_swiglu_backward
from mok_core.wgrad_rows import launch_wgrad_rows

from . import combine, dispatch
from .functional import check_weights, combine_route, quantize_expert_rows, run_phases
from .layer import ForwardContext, Layer, Weights


class Grads(NamedTuple):
    """The backward's results on one rank.

    d_x uint16 (bf16) [T, H]; d_router_weights float32 [T, k] (0 on masked routes); the weight
    gradients shaped like ``Weights``' (None for the shared ones when I_s = 0): bf16 (uint16),
    or float32 when accumulated.
    """
    d_x: object
    d_router_weights: object
    d_w_shared_gate: object
    d_w_shared_up: object
    d_w_shared_down: object
    d_w_gate: object
    d_w_up: object
    d_w_down: object


def _grad_shapes(layer: Layer):
    s = layer.shape
    H, I, I_s, E_l = s.hidden, s.intermediate, s.shared_intermediate, s.experts_per_rank
    return ((I_s, H), (I_s, H), (H, I_s), (E_l, I, H), (E_l, I, H), (E_l, H, I))


def check_grads_given(grads, accumulate: bool) -> None:
    """What ``grads`` must be before its tensors are looked at: None (the layer's own
    buffers) or 8 tensors, and given where ``accumulate`` adds into them."""
    if grads is None and accumulate:
        raise ValueError("accumulate=True adds into caller-owned float32 gradients: pass "
                         "grads=Grads(...)")
    if grads is not None and len(grads) != len(Grads._fields):
        raise TypeError(f"grads: expected {len(Grads._fields)} tensors "
                        f"({', '.join(Grads._fields)}), got {len(grads)}")


@names_rank
def check_grads(layer: Layer, grads, accumulate: bool, tokens: int | None = None) -> Grads:
    """Checked views of caller-owned gradient buffers (the layer's own when ``grads`` is None;
    ``accumulate`` needs the caller's float32 buffers; the weight gradients 16-byte aligned);
    d_x and d_router_weights have ``tokens`` rows (the step's T; default T_max)."""
    T = layer.tokens_per_rank if tokens is None else tokens
    H, k = layer.shape.hidden, layer.shape.topk
    I_s = layer.shape.shared_intermediate
    shapes = _grad_shapes(layer)
    check_grads_given(grads, accumulate)
    if grads is None:
        g = layer.grad
        if g.grads is None:                 # once, outside any capture the caller may do
            g.grads = tuple(None if i < 3 and not I_s else device_empty(shp, np.uint16)
                            for i, shp in enumerate(shapes))
        return Grads(g.d_x[:T], g.d_router_out[:T], *g.grads)
    dtype = np.float32 if accumulate else None
    weights = []
    for i, (a, name, shp) in enumerate(zip(grads[2:], Grads._fields[2:], shapes)):
        if i < 3 and not I_s:
            weights.append(None)
            continue
        a = as_device_array(a, f"grads.{name}", dtype=dtype, shape=shp, align=16)
        if a.dtype not in (np.uint16, np.float32):
            raise TypeError(f"grads.{name}: expected uint16 (bf16 bits) or float32, got "
                            f"{a.dtype}")
        weights.append(a)
    if len({a.dtype for a in weights if a is not None}) > 1:
        raise TypeError("grads: the weight gradients must share one dtype (bf16 or float32)")
    return Grads(as_device_array(grads[0], "grads.d_x", dtype=np.uint16, shape=(T, H),
                                 align=16),
                 as_device_array(grads[1], "grads.d_router_weights", dtype=np.float32,
                                 shape=(T, k)), *weights)


# --- the phases' launches ------------------------------------------------------------------

def publish_d_out(layer: Layer, d_out, router_weights, stream):
    g = layer.grad
    dispatch.publish_x(g.comm, d_out, None, stream, tensor=err.NF_D_OUT)
    if router_weights.size:
        device_copy(g.router[:router_weights.size], flat_view(router_weights), stream)


def _nan_check(layer: Layer, tensor: int) -> dict:
    return {"errors": layer.comm.errors, "tensor": tensor, "rank": layer.rank}


class _Rows(NamedTuple):
    """The operands of one expert group's backward: the shared expert's (this rank's tokens:
    the staging slices, one expert) or the routed experts' (the staged rows)."""
    x: object            # token rows (gathered through ``index``)
    d_out: object        # d_out rows (gathered through ``index``)
    index: object        # expert-sorted row -> staging row (-1 padding)
    offsets: object      # expert offsets
    rows: object         # rows in use [1]
    gate: object         # float32 [., I] pre-activations, saved by the forward
    up: object
    p: object            # d_out W_down, then (routed) w h
    d_gu: object         # [d_g | d_u]
    hidden: object       # the forward's h
    w_h: object          # W_down's gradient's B operand: w h (routed: p), h (shared: w = 1)
    d_x: object          # the data gradient's output: d_x_s, or the routed d_x rows


def _rows(layer: Layer, shared: bool) -> _Rows:
    g = layer.grad
    if shared:
        return _Rows(layer.comm.x_buf, g.comm.x_buf, layer.shared_index, layer.shared_offsets,
                     layer.shared_rows, g.gate_s, g.up_s, g.p_s, g.d_gu_s, layer.hidden_shared,
                     layer.hidden_shared, g.d_x_s)
    s = layer.schedule
    return _Rows(layer.comm.x_recv, g.comm.x_recv, layer.gather_index, s.expert_offsets,
                 s.num_rows, g.gate, g.up, g.p, g.d_gu, layer.hidden, g.p, g.d_x_rows)


def _expert_weights(layer: Layer, W: Weights, shared: bool):
    """(w_gate, w_up [E, I, H], w_down [E, H, I]): the shared expert's as one expert."""
    if not shared:
        return W.w_gate, W.w_up, W.w_down
    H, I_s = layer.shape.hidden, layer.shape.shared_intermediate
    return (W.w_shared_gate.reshape((1, I_s, H)), W.w_shared_up.reshape((1, I_s, H)),
            W.w_shared_down.reshape((1, H, I_s)))


def _weight_grads(layer: Layer, G: Grads, shared: bool):
    """(d_w_gate, d_w_up, d_w_down) as [E, ., .] views (the shared ones as one expert)."""
    if not shared:
        return G.d_w_gate, G.d_w_up, G.d_w_down
    one = lambda a: a.reshape((1,) + a.shape)              # noqa: E731
    return one(G.d_w_shared_gate), one(G.d_w_shared_up), one(G.d_w_shared_down)


def _fp8(layer: Layer, shared: bool) -> bool:
    """The routed experts' data gradients run in FP8 (``MoKConfig(precision="fp8")``)."""
    return not shared and layer.config.precision == "fp8"


def _fp8_wgrad(layer: Layer, shared: bool) -> bool:
    """... and their weight gradients (``Layer.fp8_wgrad``: ``MoKConfig.fp8_wgrad``
    resolved)."""
    return not shared and layer.fp8_wgrad


def dgrad_down(layer: Layer, W: Weights, shared: bool, stream):
    """p = d_out W_down[e] (unweighted). FP8: the d_out rows quantised 1 x 128 into expert
    order on the way (as the forward's x), then the FP8 GEMM on W_down's transposed copy."""
    o = _rows(layer, shared)
    report = _nan_check(layer, err.NF_SHARED_D_HIDDEN if shared else err.NF_D_HIDDEN)
    if _fp8(layer, shared):
        g, q = layer.grad, W.fp8
        quantize_expert_rows(o.d_out, o.index, o.rows, g.d_out8, g.d_out8_scale,
                             g.d_out8_tokens, g.d_out8_tokens_scale, stream)
        launch_fp8_gemm(g.d_out8, g.d_out8_scale, q.w_down_t, q.w_down_t_scale, o.offsets,
                        o.rows, o.p, bm=layer.fp8_bm, stream=stream, **report)
        return
    launch_dgrad(o.d_out, o.index, _expert_weights(layer, W, shared)[2], None, o.offsets,
                 o.rows, o.p, config=layer.dgrad_gemm, stream=stream, **report)


def swiglu_backward(layer: Layer, shared: bool, stream):
    """d_gu = SwiGLU'(g, u) (w p); routed: d_w pushed home, p becomes w h. FP8: the same
    kernel quantises [d_g | d_u] 1 x 128 into ``d_gu8`` as it writes it (bf16 d_gu is still
    written: the weight gradients read it, bf16 or transposed-quantised)."""
    o = _rows(layer, shared)
    route = quant = None
    if not shared:
        s, g = layer.schedule, layer.grad
        route = (s.src_rank, s.src_token, s.src_slot, g.peer_router, g.peer_d_router,
                 layer.shape.topk)
    if _fp8(layer, shared):
        # (the quantisation saturates an Inf to +-448, so it reports d_gu's NaN/Inf itself,
        # as the d_x rows' the bf16 GEMM would have written)
        report = _nan_check(layer, err.NF_D_X_ROUTED)
        quant = (layer.grad.d_gu8, layer.grad.d_gu8_scale, report["errors"], report["tensor"],
                 report["rank"])
    launch_swiglu_backward(o.p, o.gate, o.up, o.hidden, o.d_gu, o.index, o.rows,
                           limit=layer.swiglu_limit, route=route, quant=quant, stream=stream)


def dgrad_gate_up(layer: Layer, W: Weights, shared: bool, stream):
    """[d_g | d_u] [W_gate; W_up]: the shared expert's d_x, or the routed d_x rows -- pushed
    home from the epilogue into their source's combine rows where the layer fuses that
    (``Layer.fused_d_x_push``: no d_x rows written, no ``push_d_x``). FP8: the FP8 GEMM of
    [d_g | d_u] quantised 1 x 128 (by ``swiglu_backward``) on [W_gate; W_up]'s transposed
    copy."""
    o = _rows(layer, shared)
    report = _nan_check(layer, err.NF_SHARED_D_X if shared else err.NF_D_X_ROUTED)
    push = combine_route(layer) if not shared and layer.fused_d_x_push else None
    if _fp8(layer, shared):
        g, q = layer.grad, W.fp8
        launch_fp8_gemm(g.d_gu8, g.d_gu8_scale, q.w_gate_up_t, q.w_gate_up_t_scale, o.offsets,
                        o.rows, o.d_x, bm=layer.fp8_bm, push=push, stream=stream, **report)
        return
    w_g, w_u, _ = _expert_weights(layer, W, shared)
    launch_dgrad(o.d_gu, None, w_g, w_u, o.offsets, o.rows, o.d_x, push=push,
                 config=layer.dgrad_gemm, stream=stream, **report)


def push_d_x(layer: Layer, stream):
    """The routed d_x rows home, into their source's combine rows (the forward's combine
    kernel), where ``dgrad_gate_up`` did not push them itself."""
    combine.combine(layer.grad.comm, layer.schedule, layer.grad.d_x_rows, stream)


def wgrad_rows(layer: Layer, stream):
    """FP8: the weight gradients' row layout -- each expert's rows from a multiple of 128,
    their source rows and tokens (``mok_core.wgrad_rows``)."""
    g, s = layer.grad, layer.schedule
    launch_wgrad_rows(s.expert_offsets, s.num_rows, layer.gather_index, g.k_offsets, g.k_rows,
                      g.rows_index, g.tokens_index, stream=stream)


def _fp8_weight_gradient(layer: Layer, a, b, outs, accumulate, stream):
    """FP8 weight gradient D_e = A^T B over the layout's rows (``wgrad_rows``): ``a`` = (rows,
    index, q, q_scale, staged) -- A = rows gathered through index, quantised 1 x 128 along
    the rows into q [M, K] --, ``b`` likewise 128 x 128 into [N, K]; then ``fp8_wgrad`` into
    ``outs`` = (out0, out1, m_split). The quantiser saturates an Inf to +-448, so it reports
    the NaN/Inf of its input as the weight gradients' -- but for the staged tokens
    (``staged``: x, d_out), counted once already."""
    g = layer.grad
    report = _nan_check(layer, err.NF_WEIGHT_GRADS)
    for (rows, index, q, q_scale, staged), whole in ((a, False), (b, True)):
        launch_quantize_cols(rows, q, q_scale, whole_block=whole, index=index,
                             num_rows=g.k_rows, stream=stream,
                             **({"errors": scratch_error_word()} if staged else report))
    bn, stages = layer.fp8_wgrad_tile
    launch_fp8_wgrad(*a[2:4], *b[2:4], g.k_offsets, g.k_rows, *outs, accumulate=accumulate,
                     bn=bn, stages=stages, stream=stream, **report)


def _wgrad_tiles(layer: Layer, out):
    """The weight gradients' tiles: bf16 ``out``, ``layer.wgrad_gemm``; FP32 (added to --
    main-grad -- or not), ``layer.main_grad_gemm``, whose staging holds an FP32 tile whole."""
    return layer.main_grad_gemm if out.dtype == np.float32 else layer.wgrad_gemm


def wgrad_down(layer: Layer, G: Grads, accumulate, shared: bool, stream):
    """dW_down[e] = sum_r d_out[t_r]^T (w_r h_r) (the shared expert: w = 1, h itself). FP8:
    d_out^T (1 x 128) and (w h)^T (128 x 128) quantised along the layout's rows."""
    o = _rows(layer, shared)
    d_w_down = _weight_grads(layer, G, shared)[2]
    if _fp8_wgrad(layer, shared):
        g = layer.grad
        _fp8_weight_gradient(layer, (o.d_out, g.tokens_index, g.d_out8t, g.d_out8t_scale, True),
                             (o.w_h, g.rows_index, g.wh8t, g.wh8t_scale, False),
                             (d_w_down, None, layer.shape.hidden), accumulate, stream)
        return
    launch_wgrad(o.d_out, o.index, o.w_h, None, o.offsets, o.rows, d_w_down, d_w_down,
                 layer.shape.hidden, accumulate=accumulate,
                 config=_wgrad_tiles(layer, d_w_down),
                 stream=stream, **_nan_check(layer, err.NF_WEIGHT_GRADS))


def wgrad_gate_up(layer: Layer, G: Grads, accumulate, shared: bool, stream):
    """dW_gate[e] = d_g^T x, dW_up[e] = d_u^T x (one launch, split at I). FP8: [d_g | d_u]^T
    (1 x 128) and x^T (128 x 128) quantised along the layout's rows."""
    o = _rows(layer, shared)
    d_w_gate, d_w_up, _ = _weight_grads(layer, G, shared)
    if _fp8_wgrad(layer, shared):
        g = layer.grad
        _fp8_weight_gradient(layer, (o.d_gu, g.rows_index, g.d_gu8t, g.d_gu8t_scale, False),
                             (o.x, g.tokens_index, g.x8t, g.x8t_scale, True),
                             (d_w_gate, d_w_up, layer.shape.intermediate), accumulate, stream)
        return
    launch_wgrad(o.d_gu, None, o.x, o.index, o.offsets, o.rows, d_w_gate, d_w_up,
                 o.d_gu.shape[1] // 2, accumulate=accumulate,
                 config=_wgrad_tiles(layer, d_w_gate),
                 stream=stream, **_nan_check(layer, err.NF_WEIGHT_GRADS))


def pull_d_out(layer: Layer, stream):
    """The d_out rows this rank's experts need, staged like the forward's x (SM pull)."""
    dispatch.pull(layer.grad.comm, layer.schedule, stream)


def expert_backward(layer: Layer, W: Weights, G: Grads, accumulate, shared: bool, stream):
    """The launches of one expert group's backward, in order (named: traces and timers read
    them): routed ones push d_w and the d_x rows home."""
    calls = [partial(dgrad_down, layer, W, shared, stream),
             partial(swiglu_backward, layer, shared, stream),
             partial(dgrad_gate_up, layer, W, shared, stream)]
    if not shared and not layer.fused_d_x_push:
        calls.append(partial(push_d_x, layer, stream))
    if _fp8_wgrad(layer, shared):
        calls.append(partial(wgrad_rows, layer, stream))
    return calls + [partial(wgrad_down, layer, G, accumulate, shared, stream),
                    partial(wgrad_gate_up, layer, G, accumulate, shared, stream)]


def backward_epilogue(layer: Layer, G: Grads, stream):
    g, T = layer.grad, G.d_x.shape[0]
    d_x_s = g.d_x_s[:T] if layer.shape.shared_intermediate else None
    combine.epilogue(g.comm, g.ones[:T], G.d_x, d_x_s, stream)
    combine.router_grads(layer.ids32[:T], g.d_router, G.d_router_weights, stream)


# --- phases ---------------------------------------------------------------------------------

def check_context(layer: Layer, ctx) -> None:
    """ValueError unless ``ctx`` is the context of this layer's last forward: the buffers it
    points into hold that step only (a later forward overwrote an earlier one's)."""
    if not isinstance(ctx, ForwardContext):
        raise ValueError(f"ctx: expected the ForwardContext of this layer's last forward "
                         f"(layer.context()), got {type(ctx).__name__}")
    if ctx.schedule is not layer.schedule:
        raise ValueError("ctx: the ForwardContext of another layer (each layer's backward "
                         "takes its own forward's)")
    if ctx.step != layer.steps:
        raise ValueError(f"ctx: the context of forward {ctx.step}, but forward {layer.steps} "
                         f"has run on this layer since and overwrote what it points to: run "
                         f"each backward before the layer's next forward, or rebuild the "
                         f"context (functional.recompute_forward_context; mok_torch: "
                         f"Layer.recompute_context)")


@names_rank
def backward_phases(layer: Layer, ctx: ForwardContext, d_out, router_weights, weights, *,
                    grads=None, accumulate: bool = False, stream=0):
    """Every input checked, then ``([phase 0, 1, 2], Grads)``: each phase a list of calls."""
    if layer.grad is None:
        raise ValueError("this layer was built with backward=False (forward only)")
    check_context(layer, ctx)
    T, H, k = ctx.tokens, layer.shape.hidden, layer.shape.topk
    d_out = as_device_array(d_out, "d_out", dtype=np.uint16, shape=(T, H), align=16)
    router_weights = as_device_array(router_weights, "router_weights", dtype=np.float32,
                                     shape=(T, k))
    W = check_weights(layer, weights, backward=True)
    G = check_grads(layer, grads, accumulate, T)
    layer.errors.poll(stream=stream)
    shared = []
    if layer.shape.shared_intermediate:
        shared = expert_backward(layer, W, G, accumulate, True, stream)
    p0 = [partial(layer.errors.begin, stream),
          partial(publish_d_out, layer, d_out, router_weights, stream)]
    p1 = shared + [partial(pull_d_out, layer, stream),
                   *expert_backward(layer, W, G, accumulate, False, stream)]
    p2 = [partial(backward_epilogue, layer, G, stream), partial(layer.errors.end, stream)]
    if layer.config.errors == "trap":
        trap = partial(layer.errors.trap_check, stream)
        p0, p1, p2 = p0 + [trap], p1 + [trap], p2[:1] + [trap] + p2[1:]
    return [p0, p1, p2], G


def backward(layer: Layer, ctx: ForwardContext, d_out, router_weights, weights, *, grads=None,
             accumulate: bool = False, stream=0) -> Grads:
    """The gradients of one forward step on this rank (module docstring).

    Arguments:
        layer, ctx: the layer and the ``ForwardContext`` its last forward returned (the
            backward reads the layer's buffers: run it before the layer's next forward).
        d_out: uint16 (bf16 bits) [T, H]; router_weights: float32 [T, k], the forward's;
        weights: the forward's ``Weights``.
        grads: ``Grads`` of caller-owned buffers (bf16 = uint16, or float32 weight gradients),
            or None: the layer's own (overwritten by the next backward).
        accumulate: add the weight gradients into ``grads``' float32 buffers (gradient
            accumulation over micro-batches, Megatron's ``main_grad``); d_x and the router
            weights' gradient are always written.
    Raises:
        TypeError / ValueError before any launch; device-side problems (NaN/Inf in d_out or a
        GEMM's output, a peer that never arrives) at the next call or ``layer.check()``.
    """
    phases, G = backward_phases(layer, ctx, d_out, router_weights, weights, grads=grads,
                                accumulate=accumulate, stream=stream)
    run_phases(phases, layer, stream)
    return G


__all__ = ["Grads", "backward", "backward_phases", "check_grads"]
