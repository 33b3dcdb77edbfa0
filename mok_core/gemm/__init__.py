"""Grouped expert GEMMs over the expert-sorted, row-padded layout of the schedule.

    gate_up_swiglu: hidden[r] = SwiGLU(A[r] W_gate[e]^T, A[r] W_up[e]^T)   (bf16 out; optionally
                    the two FP32 pre-activations too: what the backward differentiates)
    down:           y[r]      = hidden[r] W_down[e]^T                       (bf16 out)
    dgrad:          out[r]    = A[r] B[e], B[e] = [w0[e]; w1[e]] as stored  (bf16 out)

for every row r of expert e's segment [off[e], off[e+1]), and the backward's weight gradients

    wgrad:          D_e[m, n] = sum over the segment's rows r of A[ra(r), m] B[rb(r), n]
                    (bf16 or FP32 out, FP32 optionally accumulated into the output; rows
                    m < m_split to one output, the rest to another: dW_gate and dW_up from
                    one launch)

whose reduction runs over each expert's rows; and the FP8 GEMMs (issue 23)

    fp8_gemm:       out[r]    = A[r] W_e^T, A and W_e e4m3 with 1 x 128 / 128 x 128 scales
                    (bf16 out; Hopper only, ``sm90_fp8``); ``fp8_gate_up_swiglu`` the same
                    with gate_up_swiglu's epilogue; ``fp8_wgrad`` the weight gradient from
                    operands transposed and quantised along the rows (``sm90_fp8``'s WGRAD).

``dgrad`` is the backward's data gradient
(weights read as stored, [K, N] row-major, not transposed): d_hidden = d_out W_down[e] (A
gathered through an index) and d_x = [d_gate | d_up] [W_gate[e]; W_up[e]] (K split over two
weight arrays); it runs on both kernel families (wgmma: B read MN-major, ``push`` sends the
rows home like ``down``'s), and so does ``wgrad`` (wgmma: both operands read MN-major,
``sm90_wgrad``). Counts and offsets
are read on the device; A rows can be gathered through an index table (a token pulled once per
rank feeds all its local experts without a fan-out copy; -1 = padding row, read as zeros) --
wgrad gathers either operand's rows. The shared expert is the same kernels with one expert.
All bf16 tensors are uint16 bit arrays here (the adapters view framework bf16 as uint16).

``gate_up_swiglu`` / ``down`` / ``dgrad`` / ``wgrad`` validate their inputs (errors name the
tensor, the expected and the actual) and call ``launch_gate_up_swiglu`` / ``launch_down`` /
``launch_dgrad`` / ``launch_wgrad``, the trusted entries the layer uses with views it checked
once: numba device arrays of the right dtypes and shapes (outputs 16-byte aligned for wgmma),
a required ``config``. Kernels: ``sm90`` (wgmma, Hopper; ``dgrad`` with a wgmma config), ``sm80``
(mma.sync, elsewhere and on the simulator; ``dgrad``'s default everywhere: the layer's
backward passes a wgmma config on Hopper, ``mok_comm.layer.dgrad_gemm``),
``sm80_wgrad`` (mma.sync, both operands stored k-major: the rows are the reduction; ``wgrad``'s
default everywhere) and ``sm90_wgrad`` (the same on wgmma, Hopper: the layer's backward passes a
wgmma config there, ``mok_comm.layer.wgrad_gemm``), epilogues in ``epilogue``.
"""
from __future__ import annotations

import math

import numpy as np

from .. import errors as err
from ..cuda_compat import as_device_array, device_address, flat_view
from ..errors_kernels import scratch_error_word
from . import sm80, sm90
from . import sm80_wgrad, sm90_fp8, sm90_wgrad
from .config import (MMA_SYNC_GEMM, ROWS_FOR_192, SIM_GEMM, WGMMA_192_GEMM, WGMMA_GEMM,
                     GemmConfig, default_gemm)
from .epilogue import f32_whole

__all__ = ["GemmConfig", "default_gemm", "WGMMA_GEMM", "WGMMA_192_GEMM", "MMA_SYNC_GEMM",
           "SIM_GEMM", "ROWS_FOR_192", "gate_up_swiglu", "down", "dgrad", "wgrad",
           "launch_gate_up_swiglu", "launch_down", "launch_dgrad", "launch_wgrad", "fp8_gemm",
           "fp8_gate_up_swiglu", "fp8_wgrad", "launch_fp8_gemm", "launch_fp8_wgrad"]


# The FP8 GEMM's tile width and ring depth when the caller leaves them (None): 256 columns
# where they divide N, with the 3 slices that fit beside its staging, else 128 and 4 slices
# (docs/perf.md, FP8).
FP8_TILES = {256: 3, 128: 4}


def _fp8_tile(N, swiglu, bn, stages):
    """The (bn, stages) a call runs: the caller's, or the defaults above for N."""
    if bn is None:
        bn = 256 if N % (128 if swiglu else 256) == 0 else 128
    return bn, FP8_TILES.get(bn, 4) if stages is None else stages


def fp8_rows_tile(rows_per_expert):
    """The layer's FP8 tile rows (its forward GEMMs and data gradients) for experts of
    ``rows_per_expert`` rows: 192 where the bf16 kernel takes 192-row tiles
    (``config.ROWS_FOR_192`` < rows <= 192: two 128-row tiles would compute up to 256), else
    128."""
    return 192 if ROWS_FOR_192 < rows_per_expert <= 192 else 128


def fp8_wgrad_pays(rows_per_expert):
    """Whether the routed weight gradients in FP8 beat bf16 for experts of
    ``rows_per_expert`` rows (``MoKConfig(fp8_wgrad=None)``): where those rows take more
    than two 128-row K slices -- at two, the tiles' MMAs are shorter than their stores of a
    weight-sized output whatever their precision, and the operands' two transposed
    quantisations cost more than FP8 saves (docs/perf.md, FP8)."""
    return rows_per_expert > 2 * sm90_fp8.BK


def fp8_wgrad_tile(rows_per_expert):
    """The layer's FP8 weight-gradient tile (columns, ring slices) for experts of
    ``rows_per_expert`` rows, ``fp8_wgrad``'s ``bn`` and ``stages`` (None: its defaults):
    128 columns where those rows take at most two 128-row K slices -- a tile's MMAs are then
    shorter than its store of a weight-sized output, and the narrower tiles store closer to the
    write ceiling --, else ``FP8_TILES``' width for N (256 where it divides N, faster once the
    MMAs dominate); where they take more than three, a 4-slice ring (each warp's bf16 rows
    staged a quarter tile at a time to make room: ``sm90_fp8.wgrad_parts``) -- at three the
    quarters' waits cost what the deeper ring hides (docs/perf.md, FP8)."""
    slices = -(-rows_per_expert // sm90_fp8.BK)
    return (128 if slices <= 2 else None), (4 if slices > 3 else None)


def _fp8_wgrad_tile(N, out0, out1, bn, stages):
    """(bn, stages, FP32 outputs) of the FP8 weight gradient into ``out0`` / ``out1`` (one may
    be None): ``_fp8_tile``'s, but float32 outputs take 128-wide tiles by default (a warp's
    rows of one staged whole: measured faster, docs/perf.md)."""
    f32 = np.dtype((out1 if out0 is None else out0).dtype) == np.float32
    if bn is None and f32:
        bn = 128
    return (*_fp8_tile(N, False, bn, stages), f32)


def _error_word(errors):
    """``errors``, or (None) this device's scratch word that nobody reads: the kernels always
    check, so there is one production path."""
    return scratch_error_word() if errors is None else errors


def launch_gate_up_swiglu(x, a_index, w_gate, w_up, expert_offsets, num_rows, hidden, *,
                          pre=None, swiglu_limit=None, config: GemmConfig, stream=0,
                          errors=None, tensor=err.NF_HIDDEN, rank=0):
    """``gate_up_swiglu`` without the checks (arguments as there, ``config`` required)."""
    E, I, H = w_gate.shape
    limit = math.inf if swiglu_limit is None else float(swiglu_limit)
    args = (config, stream, x, a_index, w_gate, w_up, expert_offsets, num_rows,
            flat_view(hidden, np.uint32), H, I, I, limit)
    nf = {"errors": _error_word(errors), "tensor": tensor, "rank": rank}
    if pre is not None:
        pre = (flat_view(pre[0]), flat_view(pre[1]))
    if config.mma == "wgmma":
        sm90.launch_gemm(*args, swiglu=True, gather=True, padding_index=True, pre=pre, **nf)
    else:
        sm80.launch_gemm(*args, swiglu=True, gather=True, pre=pre, **nf)


def _route_and_out(push, out, placeholder):
    """(route, out) as ``sm90.launch_gemm`` takes them: the push route (k as int64) with
    ``placeholder`` for the unused output, or no route and ``out`` as packed uint32 words."""
    if push is None:
        return None, flat_view(out, np.uint32)
    src_rank, token, slot, peers, k = push
    return (src_rank, token, slot, peers, np.int64(k)), placeholder


def launch_down(hidden, w_down, expert_offsets, num_rows, y, *, row_index=None, push=None,
                config: GemmConfig, stream=0, errors=None, tensor=err.NF_Y, rank=0):
    """``down`` without the checks (arguments as there, ``config`` required; ``push`` only
    with a wgmma config, its peer buffers as flat uint32 views)."""
    E, H, I = w_down.shape
    nf = {"errors": _error_word(errors), "tensor": tensor, "rank": rank}
    if config.mma != "wgmma":
        sm80.launch_gemm(config, stream, hidden, num_rows, w_down, w_down, expert_offsets,
                         num_rows, flat_view(y, np.uint32), I, H, H, math.inf, swiglu=False,
                         gather=False, **nf)
        return
    route, y = _route_and_out(push, y, num_rows)
    index = num_rows if row_index is None else row_index   # unused without an index
    sm90.launch_gemm(config, stream, hidden, index, w_down, w_down, expert_offsets, num_rows,
                     y, I, H, H, math.inf, swiglu=False, gather=False,
                     padding_index=row_index is not None, route=route, **nf)


def launch_dgrad(a, a_index, w0, w1, expert_offsets, num_rows, out, *, push=None,
                 config: GemmConfig, stream=0, errors=None, tensor=err.NF_HIDDEN, rank=0):
    """``dgrad`` without the checks (arguments as there, ``config`` required; ``push`` only
    with a wgmma config, its peer buffers as flat uint32 views)."""
    nf = {"errors": _error_word(errors), "tensor": tensor, "rank": rank}
    gather = a_index is not None
    if config.mma != "wgmma":
        E, K0, N = w0.shape
        sm80.launch_gemm(config, stream, a, a_index if gather else num_rows, w0,
                         w0 if w1 is None else w1, expert_offsets, num_rows,
                         flat_view(out, np.uint32), a.shape[1], K0, N, math.inf, swiglu=False,
                         gather=gather, b_kn=True, **nf)
        return
    # The wgmma kernel reads each matrix through a TMA map: an empty one gets none (K0 = 0:
    # all of B is w1; K - K0 = 0: w0 stands in for the w1 map, never read).
    if w1 is not None and w0.shape[1] == 0:
        w0, w1 = w1, None
    if w1 is None or w1.shape[1] == 0:
        w1 = w0
    E, K0, N = w0.shape
    route, out = _route_and_out(push, out, num_rows)
    sm90.launch_gemm(config, stream, a, a_index if gather else num_rows, w0, w1,
                     expert_offsets, num_rows, out, a.shape[1], K0, N, math.inf, swiglu=False,
                     gather=gather, padding_index=gather, route=route, b_kn=True, **nf)


def launch_wgrad(a, a_index, b, b_index, expert_offsets, num_rows, out0, out1, m_split, *,
                 accumulate=False, config: GemmConfig, stream=0, errors=None, tensor=err.NF_Y,
                 rank=0):
    """``wgrad`` without the checks (arguments as there, ``config`` required: mma.sync, or
    wgmma on Hopper; ``out0`` / ``out1`` may be None where they would hold no rows)."""
    M = a.shape[1]
    N = b.shape[1]
    kernels = sm90_wgrad if config.mma == "wgmma" else sm80_wgrad
    kernels.launch_wgrad(config, stream, a, a_index, b, b_index, expert_offsets, num_rows, out0,
                         out1, M, N, m_split, accumulate=accumulate,
                         errors=_error_word(errors), tensor=tensor, rank=rank)


def gate_up_swiglu(x, a_index, w_gate, w_up, expert_offsets, num_rows, hidden, *, pre=None,
                   swiglu_limit=None, config: GemmConfig | None = None, stream=0, errors=None,
                   tensor=err.NF_HIDDEN, rank=0):
    """hidden[r] = SwiGLU(x[a_index[r]] W_gate[e]^T, x[a_index[r]] W_up[e]^T), bf16; with
    ``pre``, the two pre-activations too.

    Arguments:
        x: uint16 (bf16 bits) [A_rows, H] -- source rows (token staging buffer or local x).
        a_index: int32 [C]: row of x for each expert-sorted row; -1 = padding (zeros).
        w_gate, w_up: uint16 [E, I, H].
        expert_offsets: int32 [E + 1] padded offsets (multiples of config.row_unit);
        num_rows: int32 [1] rows in use (device; never read by the host).
        hidden: uint16 [C, I] output; rows past num_rows untouched, padding rows = 0.
        pre: optional ``(gate, up)``, float32 [C, I] each, C-contiguous with 8-byte aligned
            starts: written with g = x W_gate[e]^T and u = x W_up[e]^T exactly as the FP32
            accumulators the SwiGLU consumed (before its clamp: the backward's clamp masks
            are then the forward's). Rows as ``hidden``'s: past num_rows untouched, padding
            rows = 0. The backward's saved activations (``mok_comm.backward``); not checked
            for NaN/Inf (h, computed from them, is). None: nothing more written or paid.
        swiglu_limit: None or float L > 0 (gate clamped above at L, up to [-L, L]).
        errors, tensor, rank: NaN/Inf in the output (checked in the epilogue, always) are
            recorded in the error word ``errors`` (int32 [ERROR_WORDS]; None: a scratch word
            nobody reads) as tensor id ``tensor`` (``mok_core.errors.TENSOR_NAMES``) seen on
            ``rank``, with the smallest expert-sorted row and local expert holding one.
    """
    config = config or default_gemm()
    x, w_gate, off, nr, E, I, H = _operands(x, "x", w_gate, "w_gate", "IH", expert_offsets,
                                            num_rows)
    w_up = as_device_array(w_up, "w_up", dtype=np.uint16, shape=(E, I, H))
    a_index = as_device_array(a_index, "a_index", dtype=np.int32, ndim=1)
    C = a_index.shape[0]
    hidden = as_device_array(hidden, "hidden", dtype=np.uint16, shape=(C, I))
    _check_staged_out(config, hidden, "hidden")
    pre = _checked_pre(pre, C, I)
    _check_swiglu_limit(swiglu_limit)
    _check_dims(config, E=E, C=C, K=H, N=I, n_tile=config.bn // 2, name_k="hidden size H",
                name_n="intermediate I")
    errors, tensor = _check_errors(errors, tensor)
    launch_gate_up_swiglu(x, a_index, w_gate, w_up, off, nr, hidden, pre=pre,
                          swiglu_limit=swiglu_limit, config=config, stream=stream, errors=errors,
                          tensor=tensor, rank=int(rank))


def down(hidden, w_down, expert_offsets, num_rows, y, *, row_index=None, push=None,
         config: GemmConfig | None = None, stream=0, errors=None, tensor=err.NF_Y, rank=0):
    """y[r] = hidden[r] W_down[e]^T, bf16.

    Arguments:
        hidden: uint16 [C, I] (expert-sorted rows, padding rows zero).
        w_down: uint16 [E, H, I].
        expert_offsets, num_rows: as in ``gate_up_swiglu``.
        y: uint16 [C, H] output (unused, may be None, with ``push``).
        row_index: optional int32 [C], < 0 on padding rows (the gate/up ``a_index``): lets the
            wgmma kernel skip all-padding warpgroups (their y rows are written as zeros).
        push: optional ``(src_rank, src_token, src_slot, peer_combine, k)`` -- the combine
            fused into the epilogue (wgmma only): row r goes straight to
            ``peer_combine[src_rank[r]]`` (tuple over ranks of uint16 [T*k*H]) at row
            ``src_token[r] * k + src_slot[r]``; rows with src_rank < 0 are dropped. The bits
            equal ``down`` into y followed by the combine.
        errors, tensor, rank: as in ``gate_up_swiglu`` (the values checked are those written
            to y, or pushed).
    """
    config = config or default_gemm()
    hidden, w_down, off, nr, E, H, I = _operands(hidden, "hidden", w_down, "w_down", "HI",
                                                 expert_offsets, num_rows)
    C = hidden.shape[0]
    _check_dims(config, E=E, C=C, K=I, N=H, n_tile=config.bn, name_k="intermediate I",
                name_n="hidden size H")
    y, push = _out_or_push(config, "down", y, "y", push, C, H)
    if row_index is not None:
        row_index = as_device_array(row_index, "row_index", dtype=np.int32, shape=(C,))
        if config.mma != "wgmma":        # (the mma.sync kernel computes every row)
            row_index = None
    errors, tensor = _check_errors(errors, tensor)
    launch_down(hidden, w_down, off, nr, y, row_index=row_index, push=push, config=config,
                stream=stream, errors=errors, tensor=tensor, rank=int(rank))


def dgrad(a, a_index, w0, w1, expert_offsets, num_rows, out, *, push=None,
          config: GemmConfig | None = None, stream=0, errors=None, tensor=err.NF_HIDDEN,
          rank=0):
    """out[r] = a[row(r)] B[e], bf16, with B[e] = w0[e] (rows k < K0) over w1[e] (rows
    k >= K0) read as stored, [K, N] row-major: the backward's data gradients
    (d_hidden = d_out W_down[e]: w0 = W_down, w1 = None, a_index the rows of d_out;
    d_x = [d_gate | d_up] [W_gate[e]; W_up[e]]: w0 = W_gate, w1 = W_up, rows direct).

    Arguments:
        a: uint16 (bf16 bits) [A_rows, K].
        a_index: int32 [C]: row of ``a`` for each expert-sorted row, -1 = padding (zeros);
            None: rows direct (row(r) = r, C = A_rows; padding rows of ``a`` must be zeros).
        w0: uint16 [E, K0, N]; K0 a multiple of ``config.bk`` (each K slice reads one matrix).
        w1: uint16 [E, K - K0, N], or None (then K0 = K).
        expert_offsets, num_rows: as in ``gate_up_swiglu`` (offsets multiples of
            config.row_unit; num_rows on the device, never read by the host).
        out: uint16 [C, N]; rows past num_rows untouched, padding rows get what A's zero rows
            give (zeros; wgmma with ``a_index``: all-padding 64-row groups skip their MMAs and
            write zeros). Unused (may be None) with ``push``.
        push: optional ``(src_rank, src_token, src_slot, peer_combine, k)`` as in ``down``
            (wgmma only): row r goes to ``peer_combine[src_rank[r]]`` (uint16 [T*k*N] each) at
            row ``src_token[r] * k + src_slot[r]``, rows with src_rank < 0 dropped -- the
            routed d_x rows pushed home; the bits equal ``dgrad`` into out, then the scatter.
        config: a ``GemmConfig``. mma.sync: bn = 16, 32 or a multiple of 64. wgmma (Hopper;
            ``sm90``'s B_KN: TMA boxes of the weights as stored, MN-major wgmma B): any valid
            wgmma config, ``out`` 16-byte aligned, K > 0. N a multiple of bn, K and K0 of bk,
            C of row_unit. Default: the device's mma.sync tiles, on Hopper too (pass a wgmma
            config for the wgmma kernel, as the layer's backward does on Hopper where the
            shape fits its tile: ``mok_comm.layer.dgrad_gemm``).
        errors, tensor, rank: NaN/Inf written to ``out`` (checked, always) as in
            ``gate_up_swiglu``.
    """
    if config is None:
        config = default_gemm()
        if config.mma != "mma_sync":          # (see ``config`` above)
            config = MMA_SYNC_GEMM
    if not isinstance(config, GemmConfig):
        raise TypeError(f"config: expected a GemmConfig, got {type(config).__name__}")
    if config.mma == "mma_sync" and not sm80.b_kn_width_ok(config.bn):
        raise ValueError(f"dgrad: config.bn={config.bn}: the weight tile's rows are bn wide, "
                         "which must be 16, 32 or a multiple of 64 (the shared-memory swizzle)")
    a = as_device_array(a, "a", dtype=np.uint16, ndim=2)
    K = a.shape[1]
    w0 = as_device_array(w0, "w0", dtype=np.uint16, ndim=3)
    E, K0, N = w0.shape
    if w1 is None:
        if K0 != K:
            raise ValueError(f"w0: expected [E, {K}, N] (K of a; no w1), got {tuple(w0.shape)}")
    else:
        if K0 > K:
            raise ValueError(f"w0: expected [E, K0 <= {K}, N] (K of a, split with w1), got "
                             f"{tuple(w0.shape)}")
        w1 = as_device_array(w1, "w1", dtype=np.uint16, shape=(E, K - K0, N))
    off = as_device_array(expert_offsets, "expert_offsets", dtype=np.int32, shape=(E + 1,))
    nr = as_device_array(num_rows, "num_rows", dtype=np.int32, shape=(1,))
    if a_index is not None:
        a_index = as_device_array(a_index, "a_index", dtype=np.int32, ndim=1)
        C = a_index.shape[0]
    else:
        C = a.shape[0]
    out, push = _out_or_push(config, "dgrad", out, "out", push, C, N)
    _check_dims(config, E=E, C=C, K=K, N=N, n_tile=config.bn, name_k="K (columns of a)",
                name_n="N (columns of w0)")
    if K0 % config.bk:
        raise ValueError(f"w0: K0={K0} rows per expert must be a multiple of bk={config.bk} "
                         "(each K slice reads one of w0, w1)")
    if config.mma == "wgmma" and K == 0:
        raise ValueError("a: K=0 columns: the wgmma dgrad runs at least one K slice per tile")
    errors, tensor = _check_errors(errors, tensor)
    launch_dgrad(a, a_index, w0, w1, off, nr, out, push=push, config=config, stream=stream,
                 errors=errors, tensor=tensor, rank=int(rank))


def wgrad(a, a_index, b, b_index, expert_offsets, num_rows, out0, out1, m_split, *,
          accumulate=False, config: GemmConfig | None = None, stream=0, errors=None,
          tensor=err.NF_Y, rank=0):
    """Weight gradients of every local expert e, over its rows r of [off[e], off[e+1]):

        D_e[m, n] = sum_r A[ra(r), m] * B[rb(r), n]      (FP32, rows in ascending order)

    rows m < m_split of D_e -> out0[e, m], the others -> out1[e, m - m_split]. Uses:
    dW_down[e] (A = d_out staging gathered by the forward's index, B = the hidden rows;
    out0 = out1, m_split = M), dW_gate / dW_up (A = d(gate|up) rows [C, 2I], B = x staging
    gathered; m_split = I: two [E, I, H] outputs from one launch); the shared expert with E = 1.

    Arguments:
        a: uint16 (bf16 bits) [A_rows, M].
        a_index: int32 [C] row of ``a`` per expert-sorted row (-1: padding, read as zeros), or
            None: row r of ``a`` itself (C = A_rows).
        b, b_index: likewise, uint16 [B_rows, N] (both sides must give the same C).
        expert_offsets: int32 [E + 1] row offsets (device). Precondition: each segment a
            multiple of config.bk rows (MoKConfig.row_align is a multiple of 64); any other
            boundary still gives the right sums (the tail slice is zero-filled).
        num_rows: int32 [1] rows in use (device; never read by the host): segments are clamped
            to it, rows past it ignored.
        out0: [E, m_split, N], out1: [E, M - m_split, N], both uint16 (bf16, rounded once
            from FP32) or both float32. The one holding no rows may be None (or, with
            m_split = M, out1 may be out0 itself: never touched). Every tile is written: an
            expert with no rows gets zeros.
        m_split: a multiple of config.bm in [0, M].
        accumulate: float32 outputs only: out += D (one FP32 add; an empty expert leaves the
            values as they are) -- main-grad accumulation.
        config: a GemmConfig, M a multiple of bm, N of bn. mma.sync: bm and bn 16, 32 or a
            multiple of 64. wgmma (Hopper; ``sm90_wgrad``: both operands MN-major): bm = 128
            with bn = 64, 128 or 256 (the 128 x 256 tile fits 3 stages, 4 with bf16 outputs
            -- a warp's rows then staged half a tile at a time --; ``accumulate``: 128 at
            most); outputs 16-byte aligned (TMA). None: ``default_gemm()`` where that
            is mma.sync, else ``MMA_SYNC_GEMM`` (pass a wgmma config for the wgmma kernel,
            as the layer's backward does on Hopper where the shape fits its tile:
            ``mok_comm.layer.wgrad_gemm``).
        errors, tensor, rank: NaN/Inf written (checked always) are recorded in the error word
            ``errors`` (None: a scratch word nobody reads) as tensor id ``tensor`` seen on
            ``rank``, with the smallest output row m (of D_e) and the local expert.

    Deterministic: one block owns each output tile, no split-K, no atomics on data (the two
    kernel families round differently: each is bitwise repeatable, not equal to the other).
    """
    if config is None:
        config = default_gemm()
        if config.mma != "mma_sync":
            config = MMA_SYNC_GEMM
    if not isinstance(config, GemmConfig):
        raise TypeError(f"config: expected a GemmConfig, got {type(config).__name__}")
    if config.mma == "wgmma":
        if not sm90_wgrad.tile_ok(config.bm, config.bn):
            raise ValueError(f"config: the wgmma wgrad takes bm=128 (two compute warpgroups) "
                             f"with bn=64, 128 or 256 (one wgmma's N), got "
                             f"bm={config.bm}, bn={config.bn}")
        _check_accumulate_tile(accumulate, config.bn)
    for name, size in (("bm", config.bm), ("bn", config.bn)):
        if config.mma == "mma_sync" and not sm80_wgrad.swizzle_ok(size):
            raise ValueError(f"config: wgrad needs {name} = 16, 32 or a multiple of 64 (its "
                             f"staged rows are swizzled per 128-byte line), got {name}={size}")
    a = as_device_array(a, "a", dtype=np.uint16, ndim=2)
    b = as_device_array(b, "b", dtype=np.uint16, ndim=2)
    M, N = a.shape[1], b.shape[1]
    C = []
    for index, name, src, src_name in ((a_index, "a_index", a, "a"),
                                       (b_index, "b_index", b, "b")):
        if index is None:
            C.append((src.shape[0], f"{src_name} rows (no {name})"))
        else:
            index = as_device_array(index, name, dtype=np.int32, ndim=1)
            C.append((index.shape[0], f"{name} length"))
        if name == "a_index":
            a_index = index
        else:
            b_index = index
    if C[0][0] != C[1][0]:
        raise ValueError(f"rows: the two sides must agree: {C[0][1]} is {C[0][0]}, "
                         f"{C[1][1]} is {C[1][0]}")
    off = as_device_array(expert_offsets, "expert_offsets", dtype=np.int32, ndim=1)
    E = off.shape[0] - 1
    if E < 1:
        raise ValueError(f"expert_offsets: expected [E + 1] with E >= 1, got {tuple(off.shape)}")
    nr = as_device_array(num_rows, "num_rows", dtype=np.int32, shape=(1,))
    if M % config.bm:
        raise ValueError(f"a: M={M} (its columns) must be a multiple of bm={config.bm}")
    if N % config.bn:
        raise ValueError(f"b: N={N} (its columns) must be a multiple of bn={config.bn}")
    m_split, out0, out1 = _wgrad_outputs(out0, out1, m_split, f"bm={config.bm}", config.bm,
                                         E, M, N, accumulate, config)
    errors, tensor = _check_errors(errors, tensor)
    launch_wgrad(a, a_index, b, b_index, off, nr, out0, out1, m_split,
                 accumulate=bool(accumulate), config=config, stream=stream, errors=errors,
                 tensor=tensor, rank=int(rank))


def _wgrad_outputs(out0, out1, m_split, unit_name, unit, E, M, N, accumulate, config):
    """``wgrad`` / ``fp8_wgrad``'s split and outputs checked: (m_split -- a multiple of
    ``unit`` in [0, M] --, out0, out1), the one holding no rows None; both uint16 (bf16) or
    both float32 (which ``accumulate`` needs), ``_check_staged_out`` by ``config`` (TMA
    stores), shaped [E, m_split, N] and [E, M - m_split, N], not the same memory."""
    if not (isinstance(m_split, (int, np.integer)) and 0 <= m_split <= M
            and m_split % unit == 0):
        raise ValueError(f"m_split={m_split!r}: must be a multiple of {unit_name} in "
                         f"[0, M={M}]")
    m_split = int(m_split)
    outs = []
    for out, name, rows in ((out0, "out0", m_split), (out1, "out1", M - m_split)):
        if rows == 0 and (out is None or out is out0):
            outs.append(None)                       # holds no rows: never touched
            continue
        out = as_device_array(out, name, ndim=3)
        if np.dtype(out.dtype) not in (np.dtype(np.uint16), np.dtype(np.float32)):
            raise TypeError(f"{name}: expected dtype uint16 (bf16) or float32, got "
                            f"{np.dtype(out.dtype)}")
        if tuple(out.shape) != (E, rows, N):
            raise ValueError(f"{name}: expected shape {(E, rows, N)}, got {tuple(out.shape)}")
        outs.append(out)
    out0, out1 = outs
    if out0 is not None and out1 is not None:
        if out0.dtype != out1.dtype:
            raise TypeError(f"out1: expected dtype {np.dtype(out0.dtype)} (that of out0), got "
                            f"{np.dtype(out1.dtype)}")
        if device_address(out0) == device_address(out1):
            raise ValueError("out0, out1: both hold rows (0 < m_split < M) but are the same "
                             "memory")
    dtype = np.dtype((out0 if out0 is not None else out1).dtype)
    for out, name in ((out0, "out0"), (out1, "out1")):
        if out is not None:
            _check_staged_out(config, out, name)
    if accumulate and dtype != np.float32:
        raise ValueError(f"accumulate=True needs float32 outputs, got {dtype}")
    return m_split, out0, out1


def _check_accumulate_tile(accumulate, bn):
    """ValueError where ``accumulate`` meets a TMA kernel's tile ``bn`` over 128 columns wide
    (``epilogue.f32_whole``: a warp's staging holds its rows of the output tile, loaded
    before the add)."""
    if accumulate and not f32_whole(bn):
        raise ValueError(f"accumulate=True: bn={bn}, but the tiles it adds to are at most 128 "
                         "columns wide (a warp's staging holds its rows of the output tile, "
                         "loaded before the add)")


def _checked_pre(pre, C, I):
    """The gate|up GEMMs' ``pre`` = (gate, up), float32 [C, I] each, checked (None stays
    None): their epilogues write it with 8-byte stores."""
    if pre is None:
        return None
    if len(pre) != 2:
        raise TypeError(f"pre: expected (gate, up), got {len(pre)} tensors")
    names = ("pre[0] (gate)", "pre[1] (up)")
    pre = tuple(as_device_array(a, n, dtype=np.float32, shape=(C, I))
                for a, n in zip(pre, names))
    for a, n in zip(pre, names):
        if device_address(a) % 8:
            raise ValueError(f"{n}: written by 8-byte stores, which need an 8-byte aligned "
                             f"start (this one is {device_address(a) % 8} bytes past)")
    return pre


def _check_swiglu_limit(swiglu_limit):
    if swiglu_limit is not None and not float(swiglu_limit) > 0:
        raise ValueError(f"swiglu_limit={swiglu_limit!r}: must be None or > 0")


def _check_errors(errors, tensor):
    if errors is not None:
        errors = as_device_array(errors, "errors", dtype=np.int32, shape=(err.ERROR_WORDS,))
    if not (isinstance(tensor, (int, np.integer)) and 0 <= tensor < err.NONFINITE_TENSORS):
        raise ValueError(f"tensor={tensor!r}: must be a tensor id in "
                         f"[0, {err.NONFINITE_TENSORS}) (mok_core.errors.TENSOR_NAMES)")
    return errors, int(tensor)


def _operands(a, a_name, w, w_name, dims, expert_offsets, num_rows):
    """A [rows, K] and W [E, N, K] (uint16, K must agree; ``dims`` = the letters of N and K in
    messages), offsets [E + 1] and num_rows [1] (int32): checked device views + E, N, K."""
    a = as_device_array(a, a_name, dtype=np.uint16, ndim=2)
    K = a.shape[1]
    w = as_device_array(w, w_name, dtype=np.uint16, ndim=3)
    E, N, K2 = w.shape
    if K2 != K:
        raise ValueError(f"{w_name}: expected [E, {dims[0]}, {K}] ({dims[1]} of {a_name}), "
                         f"got {tuple(w.shape)}")
    off = as_device_array(expert_offsets, "expert_offsets", dtype=np.int32, shape=(E + 1,))
    nr = as_device_array(num_rows, "num_rows", dtype=np.int32, shape=(1,))
    return a, w, off, nr, E, N, K


def _out_or_push(cfg, op, out, name, push, C, N):
    """(out, push) checked for a GEMM ``op`` of C rows and N columns: a push route (wgmma
    only) or the output array ``name`` [C, N]."""
    if push is not None:
        if cfg.mma != "wgmma":
            raise ValueError(f"{op}(push=...) needs a wgmma GemmConfig (the mma.sync kernel "
                             f"writes {name}; send its rows home afterwards)")
        return out, _check_push(cfg, push, C, N)
    out = as_device_array(out, name, dtype=np.uint16, shape=(C, N))
    _check_staged_out(cfg, out, name)
    return out, None


def _check_push(cfg, push, C, N):
    """A push route ``(src_rank, src_token, src_slot, peer_combine, k)`` for C rows of N
    columns: checked device views, the peer buffers as flat uint32."""
    src_rank, token, slot, peers, k = push
    src_rank, token, slot = (as_device_array(v, n, dtype=np.int32, shape=(C,)) for v, n in
                             ((src_rank, "src_rank"), (token, "src_token"), (slot, "src_slot")))
    peers = tuple(flat_view(as_device_array(p, "peer_combine", dtype=np.uint16, ndim=1),
                            np.uint32) for p in peers)
    if any(p.shape[0] % (N // 2) for p in peers):
        raise ValueError(f"peer_combine: each buffer must hold whole rows of N={N}")
    for p in peers:
        _check_staged_out(cfg, p, "peer_combine")
    return (src_rank, token, slot, peers, k)


def _check_staged_out(cfg, out, name):
    """The wgmma epilogues send output rows by bulk or TMA stores: 16-byte aligned addresses
    only (the row pitch always is; the array's start is the caller's)."""
    if cfg.mma != "wgmma":                   # (no address lookup on the mma.sync path)
        return
    off = device_address(out) % 16
    if off:
        raise ValueError(f"{name}: the wgmma GEMM writes it by bulk stores, which need a "
                         f"16-byte aligned start (this one is {off} bytes past)")


def _check_dims(cfg, *, E, C, K, N, n_tile, name_k, name_n):
    if C % cfg.row_unit:
        raise ValueError(f"rows {C}: must be a multiple of {cfg.row_unit} for {cfg} "
                         "(MoKConfig.row_align must be a multiple of GemmConfig.row_unit)")
    if K % cfg.bk:
        raise ValueError(f"{name_k}={K}: must be a multiple of {cfg.bk}")
    if N % n_tile:
        raise ValueError(f"{name_n}={N}: must be a multiple of {n_tile}")
    if cfg.mma == "wgmma" and E > sm90.MAX_EXPERTS:
        raise ValueError(f"{E} experts in one launch: the wgmma kernel's tile table holds "
                         f"{sm90.MAX_EXPERTS}")
    if cfg.mma == "wgmma" and C // 64 >= 1 << 16:
        raise ValueError(f"rows {C}: the wgmma kernel's tile table counts row tiles in 16 bits "
                         f"(at most {(1 << 16) * 64 - 1} rows per launch)")


def launch_fp8_gemm(a, a_scale, w, w_scale, expert_offsets, num_rows, out, *, w_up=None,
                    w_up_scale=None, swiglu_limit=None, stages=None, bn=None, bm=128, pre=None,
                    push=None, stream=0, errors=None, tensor=err.NF_HIDDEN, rank=0):
    """``fp8_gemm`` / ``fp8_gate_up_swiglu`` (``w`` = W_gate with ``w_up``) without the
    checks (arguments as there); ``push`` = (src_rank, src_token, src_slot, peers, k) as
    ``launch_down``'s (``out`` None): rows go home into the peers' combine rows. ``bm`` =
    192: tiles of 192 rows x 128 columns (``fp8_rows_tile``)."""
    if bm == 192 and bn is None:      # (192-row tiles are 128 wide: sm90_fp8 asserts it)
        bn = 128
    bn, stages = _fp8_tile(w.shape[1], w_up is not None, bn, stages)
    route, rows = None, None
    if push is not None:
        src_rank, token, slot, peers, k = push
        route = (src_rank, token, slot, peers, np.int64(k))
        rows, out = src_rank.shape[0], peers[0]        # (out: a placeholder, not written)
    sm90_fp8.launch_fp8(a, a_scale, w, w_scale, expert_offsets, num_rows, out, w1=w_up,
                        w1_scale=w_up_scale, swiglu_limit=swiglu_limit, stages=stages, bn=bn,
                        bm=bm, pre=pre, route=route, rows=rows, stream=stream,
                        errors=_error_word(errors), tensor=tensor, rank=rank)


def _fp8_operands(a, a_scale, weights, expert_offsets, num_rows, out, stages, bn):
    """Checked views (errors name the tensor): ``weights`` ((w, name), (w_scale, name)) pairs
    of the same shape, ``out`` (array, name) -> (a, a_scale, [(w, w_scale), ...], off, nr,
    out, bn, stages)."""
    a = as_device_array(a, "a", dtype=np.uint8, ndim=2, align=16)      # (TMA loads)
    A_rows, K = a.shape
    if K % 128 or K == 0:
        raise ValueError(f"a: K={K} (its columns) must be a positive multiple of 128")
    a_scale = as_device_array(a_scale, "a_scale", dtype=np.float32, shape=(A_rows, K // 128))
    checked = []
    for (w, w_name), (w_scale, s_name) in weights:
        w = as_device_array(w, w_name, dtype=np.uint8, ndim=3)
        E, N = w.shape[0], w.shape[1]
        if w.shape[2] != K:
            raise ValueError(f"{w_name}: expected K={K} columns (a's), got shape "
                             f"{tuple(w.shape)}")
        if N % 128 or N == 0:
            raise ValueError(f"{w_name}: N={N} (its rows per expert) must be a positive "
                             "multiple of 128")
        if checked and tuple(w.shape) != tuple(checked[0][0].shape):
            raise ValueError(f"{w_name}: expected shape {tuple(checked[0][0].shape)} (as "
                             f"{weights[0][0][1]}), got {tuple(w.shape)}")
        w_scale = as_device_array(w_scale, s_name, dtype=np.float32,
                                  shape=(E, N // 128, K // 128))
        checked.append((w, w_scale))
    E, N = checked[0][0].shape[0], checked[0][0].shape[1]
    C = A_rows
    _check_fp8_table(E, C // 128 + E, "row tiles")
    off = as_device_array(expert_offsets, "expert_offsets", dtype=np.int32, shape=(E + 1,))
    nr = as_device_array(num_rows, "num_rows", dtype=np.int32, shape=(1,))
    out, out_name = out
    out = as_device_array(out, out_name, dtype=np.uint16, shape=(C, N), align=16)
    swiglu = len(weights) == 2
    bn, stages = _fp8_tile(N, swiglu, bn, stages)
    _check_fp8_tile(N, swiglu, bn, stages)
    return a, a_scale, checked, off, nr, out, bn, int(stages)


def _check_fp8_table(E, entries, what):
    """ValueError unless the FP8 kernels' shared table (uint16 [E + 1], ``sm90.MAX_EXPERTS``
    at most) holds E experts and counts ``entries`` (``what``) in 16 bits."""
    if E > sm90.MAX_EXPERTS:
        raise ValueError(f"{E} experts in one launch: the FP8 kernels' table in shared memory "
                         f"holds {sm90.MAX_EXPERTS}")
    if entries >= 1 << 16:
        raise ValueError(f"{entries} {what}: the FP8 kernels' table counts them in 16 bits")


def _check_fp8_tile(N, swiglu, bn, stages, wgrad=False, out_f32=False):
    """ValueError unless ``bn`` divides N (with ``swiglu``: twice the output columns) and the
    ring of ``stages`` fits beside the staging (WGRAD: of bf16 or, ``out_f32``, FP32 tiles)."""
    if bn not in (128, 256) or N % (bn // 2 if swiglu else bn):
        raise ValueError(f"bn={bn!r}: the tile width must be 128 or 256 and divide N={N} "
                         f"({'twice ' if swiglu else ''}the output columns)")
    if not isinstance(stages, (int, np.integer)) or stages < 2:
        raise ValueError(f"stages={stages!r}: must be an int >= 2")
    need = sm90_fp8.smem_bytes(int(stages), bn, swiglu, wgrad, out_f32)
    if need > 227 * 1024:
        raise ValueError(f"stages={stages}, bn={bn}: {need} bytes of shared memory, over "
                         "227 KiB")


def fp8_gemm(a, a_scale, w, w_scale, expert_offsets, num_rows, out, *, stages=None, bn=None,
             stream=0, errors=None, tensor=err.NF_HIDDEN, rank=0):
    """FP8 grouped GEMM (Hopper; ``sm90_fp8``): for the rows r of each expert e,

        out[r] = bf16( A[r] W_e^T ),  A = a x a_scale (1 x 128),  W_e = w[e] x w_scale[e]
        (128 x 128 blocks)

    FP32 accumulation promoted from the tensor cores every 128 of K.

    Arguments:
        a: uint8 (e4m3) [C, K], K a multiple of 128, 16-byte aligned; a_scale: float32
            [C, K / 128] (``mok_core.quantize.quantize_fp8(x, (1, 128))``, whose ``index=``
            gathers rows into expert order on the way).
        w: uint8 (e4m3) [E, N, K], N a multiple of 128; w_scale: float32 [E, N / 128, K / 128]
            (``mok_core.quantize.quantize_expert_weights``).
        expert_offsets: int32 [E + 1]; num_rows: int32 [1] (device; segments clamped to it).
        out: uint16 (bf16) [C, N]; rows of no expert are left as they are.
        errors, tensor, rank: NaN/Inf written are recorded in the error word (as ``wgrad``).
        stages, bn: ring slices (32 KiB each at bn = 128, 48 KiB at 256) and the tile's width
            (128 or 256 columns, dividing N); the ring and the output staging must fit in
            227 KiB of shared memory. None: 256 where it divides N, with 3 slices, else 128
            with 4.

    The TMA tensor maps of ``a`` and ``w`` are built at the first call for their addresses:
    make it outside a CUDA-graph capture. Deterministic: one block owns a tile, slices
    promoted in ascending K.
    """
    a, a_scale, ((w, w_scale),), off, nr, out, bn, stages = _fp8_operands(
        a, a_scale, [((w, "w"), (w_scale, "w_scale"))], expert_offsets, num_rows,
        (out, "out"), stages, bn)
    launch_fp8_gemm(a, a_scale, w, w_scale, off, nr, out, stages=stages, bn=bn,
                    stream=stream, errors=errors, tensor=tensor, rank=rank)


def fp8_gate_up_swiglu(a, a_scale, w_gate, w_gate_scale, w_up, w_up_scale, expert_offsets,
                       num_rows, hidden, *, swiglu_limit=None, stages=None, bn=None,
                       pre=None, stream=0, errors=None, tensor=err.NF_HIDDEN, rank=0):
    """``gate_up_swiglu`` in FP8 (Hopper; ``sm90_fp8``): hidden[r] = SwiGLU(A[r] W_gate[e]^T,
    A[r] W_up[e]^T), bf16, operands as in ``fp8_gemm`` (w_gate, w_up: uint8 [E, I, K] each with
    float32 [E, I / 128, K / 128] scales; hidden [C, I]); the gate and up sums promoted and
    clamped (``swiglu_limit``) exactly as the bf16 kernels' epilogue does; a tile of ``bn``
    columns is bn / 2 gate and bn / 2 up columns. ``pre`` = (gate, up) float32 [C, I] each: the
    FP32 gate and up values too, before the clamp, for the rows the GEMM writes (what the
    backward differentiates the SwiGLU at, as ``gate_up_swiglu(pre=)`` saves them).
    """
    _check_swiglu_limit(swiglu_limit)
    a, a_scale, ((wg, sg), (wu, su)), off, nr, hidden, bn, stages = _fp8_operands(
        a, a_scale, [((w_gate, "w_gate"), (w_gate_scale, "w_gate_scale")),
                     ((w_up, "w_up"), (w_up_scale, "w_up_scale"))],
        expert_offsets, num_rows, (hidden, "hidden"), stages, bn)
    pre = _checked_pre(pre, *hidden.shape)
    launch_fp8_gemm(a, a_scale, wg, sg, off, nr, hidden, w_up=wu, w_up_scale=su,
                    swiglu_limit=swiglu_limit, stages=stages, bn=bn, pre=pre, stream=stream,
                    errors=errors, tensor=tensor, rank=rank)


def launch_fp8_wgrad(a, a_scale, b, b_scale, expert_offsets, num_rows, out0, out1, m_split, *,
                     accumulate=False, stages=None, bn=None, stream=0, errors=None,
                     tensor=err.NF_WEIGHT_GRADS, rank=0):
    """``fp8_wgrad`` without the checks (arguments as there: the layer's checked views)."""
    bn, stages, _ = _fp8_wgrad_tile(b.shape[0], out0, out1, bn, stages)
    sm90_fp8.launch_fp8_wgrad(a, a_scale, b, b_scale, expert_offsets, num_rows, out0, out1,
                              m_split, accumulate=accumulate, stages=int(stages), bn=bn,
                              stream=stream, errors=_error_word(errors), tensor=tensor,
                              rank=rank)


def fp8_wgrad(a, a_scale, b, b_scale, expert_offsets, num_rows, out0, out1=None, m_split=None,
              *, accumulate=False, stages=None, bn=None, stream=0, errors=None,
              tensor=err.NF_WEIGHT_GRADS, rank=0):
    """``wgrad`` in FP8 (Hopper; ``sm90_fp8``'s WGRAD, read its header): for each expert e,

        D_e[m, n] = sum over its rows r of A[m, r] B[n, r]     (FP32, rows m < m_split of
                                                                D_e -> out0[e], the rest ->
                                                                out1[e], as ``wgrad``'s)

    from the two operands transposed and quantised along the rows -- ``a`` uint8 [M, R] with
    float32 scales [M, R / 128] (``quantize_fp8(x, (1, 128), transpose=True)``), ``b`` uint8
    [N, R] with [N / 128, R / 128] (``quantize_fp8(y, (128, 128), transpose=True)``); M and N
    multiples of 128, R of 128. ``expert_offsets`` int32 [E + 1] (multiples of 128: device
    values, a precondition), ``num_rows`` int32 [1]; ``out0`` [E, m_split, N] and ``out1``
    [E, M - m_split, N] (``m_split`` None: M, out1 unused), 16-byte aligned (TMA), both bf16
    (uint16, rounded once from FP32) or both float32 (``accumulate``: out += D, one FP32 add) --
    every tile is written (an expert of no rows gets zeros; accumulated: left as it was).
    Each expert's last K slice is read whole: both operands must be zero from its last row --
    min(offsets[e + 1], num_rows[0]) -- to the slice's end (``quantize_fp8(...,
    transpose=True, num_rows=)`` quantises zeros from num_rows to the end of its 128-row
    block, and the layer's ``mok_core.wgrad_rows`` layout zeros past each expert's rows through
    its index). ``bn`` / ``stages``: the
    tile's width and ring depth (None: ``FP8_TILES``'s for N, 128 wide for float32 outputs;
    ``accumulate`` takes 128 at most). ``errors``, ``tensor``, ``rank``: NaN/Inf written, as
    ``wgrad``'s."""
    a = as_device_array(a, "a", dtype=np.uint8, ndim=2)
    b = as_device_array(b, "b", dtype=np.uint8, ndim=2)
    M, R = a.shape
    N = b.shape[0]
    for name, n, what in (("a", M, "rows (M)"), ("b", N, "rows (N)"), ("a", R, "columns (R)")):
        if n % 128 or n == 0:
            raise ValueError(f"{name}: {what} = {n} must be a positive multiple of 128")
    if b.shape[1] != R:
        raise ValueError(f"b: expected R={R} columns (a's), got shape {tuple(b.shape)}")
    a_scale = as_device_array(a_scale, "a_scale", dtype=np.float32, shape=(M, R // 128))
    b_scale = as_device_array(b_scale, "b_scale", dtype=np.float32, shape=(N // 128, R // 128))
    off = as_device_array(expert_offsets, "expert_offsets", dtype=np.int32, ndim=1)
    E = off.shape[0] - 1
    if E < 1:
        raise ValueError(f"expert_offsets: expected [E + 1] with E >= 1, got {tuple(off.shape)}")
    _check_fp8_table(E, R // 128, "K slices (R / 128)")
    nr = as_device_array(num_rows, "num_rows", dtype=np.int32, shape=(1,))
    # (its bf16 tiles are stored by TMA, as the wgmma kernels' are: WGMMA_GEMM's checks)
    m_split, out0, out1 = _wgrad_outputs(out0, out1, M if m_split is None else m_split, "128",
                                         128, E, M, N, accumulate, WGMMA_GEMM)
    bn, stages, f32 = _fp8_wgrad_tile(N, out0, out1, bn, stages)
    _check_fp8_tile(N, False, bn, stages, wgrad=True, out_f32=f32)
    _check_accumulate_tile(accumulate, bn)
    errors, tensor = _check_errors(errors, tensor)
    launch_fp8_wgrad(a, a_scale, b, b_scale, off, nr, out0, out1, m_split,
                     accumulate=bool(accumulate), stages=stages, bn=bn, stream=stream,
                     errors=errors, tensor=tensor, rank=int(rank))
