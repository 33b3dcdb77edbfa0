"""Epilogues of the grouped GEMMs: FP32 accumulators -> bf16 output rows.

    swiglu(g, u, L)   SiLU(min(g, L)) * clamp(u, -L, L) in float32 (L = +inf: plain SwiGLU);
                      both kernels' gate/up epilogue, rounded to bf16 once afterwards.

Staged epilogue of the wgmma kernel (``make_staged_epilogue``), per warp of a finished tile:

    1. the thread's fragment (rows r and r + 8, columns col + 8j (+1)) -> bf16 pairs in shared
       memory, row r at ``stage + r * stride``, column c at byte 2c (SWIGLU: gate columns
       [0, BN/2) and up columns [BN/2, BN) of the tile pair up into BN/2 hidden columns). The
       accumulator tuple is read at constant indices group by group (``tuple_groups``), never
       copied to local memory. ``stride`` = row bytes + 16, so the 8 rows of a store land in 8
       different bank groups.
    2. fence.proxy.async (generic-proxy st.shared -> bulk-copy reads), __syncwarp: a warp
       stages exactly the 16 rows it sends, so a warp barrier suffices.
    3. the warp's 16 rows leave by bulk stores (one per row, then one commit): lane 0 sends
       all 16 into the output, or -- ``push``, the down GEMM fused with the combine -- lanes
       0..15 one row each to its source rank's combine row
       ``peers[rank[r]][token[r] * k + slot[r]]`` (over NVLink for a peer; padding rows,
       rank < 0, are not sent), so the route lookups run in parallel.

The caller owns the ordering around it: the staging area (ring stages the next tile's prologue
leaves free) may be rewritten only after the sending lanes' ``bulk_wait_read`` and a block
barrier, and the block's last stores must be waited (``bulk_wait``) before it exits.
"""
from numba import float32

from ..cuda_compat import kjit
from ..intrinsics import (bulk_commit, bulk_store, ex2_approx, fence_proxy_async, pack_bf16x2,
                          rcp_approx, st_shared_u32, syncwarp, tuple_groups, tuple_pick, warp_all)

_NEG_LOG2E = float32(-1.4426950408889634)


@kjit(device=True, inline="always")
def swiglu(g, u, limit):
    """SiLU(min(g, L)) * clamp(u, -L, L) in float32, the sigmoid as 1 / (1 + 2^(-g log2 e)) by
    one SFU exp2 and one SFU reciprocal: a few float32 ulp for moderate g, more near g = -80
    (the rounding of g log2 e), and flushed to 0 below g ~ -87.3 (the SFU flushes denormals)
    -- all far below the bf16 rounding that follows. ``math.exp`` and ``/`` made each element
    a long dependent chain with a slow-path branch, unrolled over the whole tile (see
    docs/perf.md). Deterministic like the rest: same inputs, same bits."""
    g = min(g, limit)
    u = max(min(u, limit), -limit)
    return g * rcp_approx(float32(1.0) + ex2_approx(g * _NEG_LOG2E)) * u


def _stage_swiglu_group(j, smem, r, col, limit, base, stride, g0, g1, g2, g3, u0, u1, u2, u3):
    """8-column group j of a SwiGLU fragment: gate and up values of rows r (g0, g1 / u0, u1)
    and r + 8 (g2, g3 / u2, u3) -> bf16 pairs at hidden column col + 8j of the staging."""
    at = base + 2 * (col + 8 * j)
    st_shared_u32(smem, at + r * stride, pack_bf16x2(swiglu(g0, u0, limit), swiglu(g1, u1, limit)))
    st_shared_u32(smem, at + (r + 8) * stride,
                  pack_bf16x2(swiglu(g2, u2, limit), swiglu(g3, u3, limit)))


def _stage_plain_group(j, smem, r, col, limit, base, stride, a0, a1, a2, a3):
    """8-column group j of a plain fragment -> bf16 pairs of rows r and r + 8. (Both rows share
    the column offset: computed per row instead, ptxas keeps more registers and the 192-row
    kernels spill more.)"""
    at = base + 2 * (col + 8 * j)
    st_shared_u32(smem, at + r * stride, pack_bf16x2(a0, a1))
    st_shared_u32(smem, at + (r + 8) * stride, pack_bf16x2(a2, a3))


def _swiglu_layout(count):      # group j: gate elements 4j.., up elements 4(j + half)..
    half = count // 8
    return [[4 * j + i for i in range(4)] + [4 * (j + half) + i for i in range(4)]
            for j in range(half)]


def _plain_layout(count):
    return [[4 * j + i for i in range(4)] for j in range(count // 4)]


def make_stage_tile(swiglu_epilogue):
    """``stage_tile(acc, (smem, r, col, limit, base, stride))``: step 1 of the header."""
    if swiglu_epilogue:      # (plain functions: tuple_groups compiles them inline per group)
        return tuple_groups(_stage_swiglu_group, _swiglu_layout)
    return tuple_groups(_stage_plain_group, _plain_layout)


def make_row_sender(push):
    """``send_row(out, peers, route_rank, route_token, route_slot, k, n_out, grow, col0, smem,
    src, nbytes)``: one staged row (``nbytes`` at the shared byte address ``src``) by a bulk
    store to row ``grow`` of ``out`` (uint32 view, n_out bf16 columns) from column ``col0`` on,
    or with ``push`` to its source rank's combine row (not sent for rank < 0)."""
    @kjit(device=True, inline="always")
    def send_row(out, peers, route_rank, route_token, route_slot, k, n_out, grow, col0, smem,
                 src, nbytes):
        if push:
            rank = route_rank[grow]
            if rank >= 0:
                # tuple_pick: ``peers[rank]`` lowers to a switch, which ptxas treats as
                # divergence and then serialises every wgmma of the kernel (C7518)
                bulk_store(tuple_pick(peers, rank),
                           ((route_token[grow] * k + route_slot[grow]) * n_out + col0) // 2,
                           smem, src, nbytes)
        else:
            bulk_store(out, (grow * n_out + col0) // 2, smem, src, nbytes)
    return send_row


def make_staged_epilogue(bn, swiglu_epilogue, push, stage_offset):
    """``stage_and_send(smem, acc, out, peers, route_rank, route_token, route_slot, k, n_out,
    limit, ring, lane, frag_row, frag_col, row0, col0, stores)``: steps 1-3 of the header for
    the tile at (row0, col0), staged at ``ring + stage_offset``; ``stores``: this warp's rows
    are the expert's (else it does nothing). Returns it and the staging's bytes per tile row
    (the caller checks they fit)."""
    out_row_bytes = (bn // 2 if swiglu_epilogue else bn) * 2     # bf16 of one output row
    stride = out_row_bytes + 16             # +16: a warp's 8 rows land in 8 bank groups
    stage_tile = make_stage_tile(swiglu_epilogue)
    send_row = make_row_sender(push)

    @kjit(device=True, inline="always")
    def stage_and_send(smem, acc, out, peers, route_rank, route_token, route_slot, k, n_out,
                       limit, ring, lane, frag_row, frag_col, row0, col0, stores):
        # The vote makes the branch warp-uniform to ptxas: a warp barrier on a path it thinks
        # divergent serialises every wgmma of the kernel (C7518).
        if warp_all(stores) != 0:
            epi0 = ring + stage_offset
            stage_tile(acc, (smem, frag_row, frag_col, limit, epi0, stride))
            fence_proxy_async()            # generic-proxy writes -> bulk reads
            syncwarp()
            if push:
                if lane < 16:
                    srow = frag_row - lane // 4 + lane    # the warp's first row + i
                    send_row(out, peers, route_rank, route_token, route_slot, k, n_out,
                             row0 + srow, col0, smem, epi0 + srow * stride, out_row_bytes)
                    bulk_commit()
            elif lane == 0:
                for i in range(16):            # lane 0's row is the warp's first
                    send_row(out, peers, route_rank, route_token, route_slot, k, n_out,
                             row0 + frag_row + i, col0, smem, epi0 + (frag_row + i) * stride,
                             out_row_bytes)
                bulk_commit()

    return stage_and_send, stride
