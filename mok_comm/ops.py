"""Host launch glue of the communication half (device bodies: ``mok_comm.kernels``).

Every function enqueues kernels on ``stream`` and returns; nothing synchronises with the host.
The forward uses them in this order (coarse cross-GPU sync, fine-grained readiness on the GPU):

    publish_ids     ids -> every rank's ids_table                 (NVLink pushes)
    barrier         every rank's ids_table is complete
    build_schedule  (mok_core.schedule, local)
    publish_x       x -> this rank's staging slice, NaN/Inf check (local copy)
    barrier         every rank's tokens are in place
    dispatch        pull each needed (token, rank) once into x_recv
    ... expert FFN on the expert-sorted rows (mok_core.grouped_gemm) ...
    combine         push y rows home into combine_buf[token*k + slot]
    barrier         every rank's rows have arrived
    epilogue        out = y_shared + sum_j w_j y_j, fixed order

Arrays here are numba device arrays (or NumPy on the simulator); bf16 as uint16 bits.
"""
from __future__ import annotations

import numpy as np

from mok_core.config import MoKConfig
from mok_core.cuda_compat import (SIM, as_device_array, device_copy, flat_view, launch,
                                  multiprocessor_count)

from .kernels.allgather import push_ids_kernel
from .kernels.barrier import arrive_kernel, barrier_kernel, wait_kernel
from .kernels.bulk import BULK_CHUNK, BULK_WARPS, bulk_smem_bytes
from .kernels.combine import push_combine_bulk_kernel, push_combine_kernel
from .kernels.dispatch import (publish_all_kernel, publish_tokens_kernel,
                               pull_dispatch_bulk_kernel, pull_dispatch_kernel)
from .kernels.epilogue import combine_epilogue_kernel
from .kernels.publish import publish_x_kernel
from .kernels.push_dispatch import push_dispatch_kernel, wait_arrivals_kernel
from .workspace import Workspace

COMM_WARPS = 4 if SIM else 16          # warps per comm block (one row / token each)
_COPY_THREADS = 64 if SIM else 256


def _comm_grid(ws: Workspace, num_blocks):
    """Blocks of a split (stand-alone) comm launch: two per SM keeps enough rows in flight."""
    return num_blocks or (2 if SIM else 2 * multiprocessor_count())


_flat = flat_view


def publish_ids(ws: Workspace, topk_ids, stream=0) -> None:
    """Push this rank's top-k ids into row ``rank`` of every rank's ids table.

    Arguments:
        topk_ids: int32 [T, k] global expert ids, -1 = masked route (range checked later, on
            the device, by the schedule).
    """
    T, k = ws.tokens_per_rank, ws.topk
    ids = as_device_array(topk_ids, "topk_ids", dtype=np.int32, shape=(T, k))
    if T * k:
        blocks = min(256, -(-T * k // _COPY_THREADS))
        launch(push_ids_kernel, blocks, _COPY_THREADS, stream, 0, ws.rank, _flat(ids),
               ws.peer_ids_table)


def publish_x(ws: Workspace, x, router_weights=None, stream=0) -> None:
    """Copy this rank's tokens into its slice of the symmetric staging buffer (peers pull from
    there) and count NaN/Inf in x and the router weights into the error word.

    Arguments:
        x: uint16 (bf16 bits) [T, H]; router_weights: float32 [T, k] or None.
    """
    T, H, k = ws.tokens_per_rank, ws.hidden, ws.topk
    x = as_device_array(x, "x", dtype=np.uint16, shape=(T, H))
    w = (as_device_array(router_weights, "router_weights", dtype=np.float32, shape=(T, k))
         if router_weights is not None else ws.errors[:0].view(np.float32))
    if T == 0:
        return
    blocks = 2 if SIM else min(4 * multiprocessor_count(), -(-T * H // 8 // _COPY_THREADS))
    launch(publish_x_kernel, blocks, _COPY_THREADS, stream, 0, _flat(x), _flat(ws.x_buf),
           _flat(w), ws.errors)


def publish_tokens(ws: Workspace, x, topk_ids, stream=0) -> None:
    """``publish_x`` + ``publish_ids`` (both must precede the barrier before dispatch)."""
    publish_x(ws, x, None, stream)
    publish_ids(ws, topk_ids, stream)


def barrier(ws: Workspace, stream=0) -> None:
    """Device-side barrier of the EP group (one 1-thread launch; bounded wait, see kernels)."""
    launch(barrier_kernel, 1, 1, stream, 0, ws.rank, ws.barrier_epoch, ws.barrier_flags,
           ws.peer_barrier_flags, ws.config.spin_timeout_cycles, ws.errors)


def barrier_arrive(ws: Workspace, stream=0) -> None:
    """First half of ``barrier`` (emulated ranks: every rank arrives, then every rank waits)."""
    launch(arrive_kernel, 1, 1, stream, 0, ws.rank, ws.barrier_epoch, ws.peer_barrier_flags)


def barrier_wait(ws: Workspace, stream=0) -> None:
    launch(wait_kernel, 1, 1, stream, 0, ws.rank, ws.barrier_epoch, ws.barrier_flags,
           ws.config.spin_timeout_cycles, ws.errors)


COPY_VARIANTS = ("ld", "bulk")
DISPATCH_VARIANTS = COPY_VARIANTS + ("copy_engine", "push", "split")
# variant "split": share of each peer's tokens the copy engine moves (MoKConfig's default)
SPLIT_CE_SHARE = MoKConfig.dispatch_ce_share


def _bulk_launch(kernel, ws, num_blocks, stream, bulk_chunk, *args):
    """Launch a ``variant="bulk"`` comm kernel: its chunk, bounded wait and error word last."""
    if bulk_chunk <= 0 or bulk_chunk % 16:
        raise ValueError(f"bulk_chunk={bulk_chunk}: must be a positive multiple of 16 bytes")
    blocks = num_blocks or (2 if SIM else 3 * multiprocessor_count())
    launch(kernel, blocks, 32 * BULK_WARPS, stream, bulk_smem_bytes(bulk_chunk), *args,
           np.int64(bulk_chunk), np.int64(ws.config.spin_timeout_cycles), ws.errors)


def _check_variant(variant, allowed=COPY_VARIANTS):
    if variant not in allowed:
        raise ValueError(f"variant={variant!r}: must be one of {allowed}")


def dispatch(ws: Workspace, schedule, stream=0, num_blocks=None, variant="ld",
             bulk_chunk=BULK_CHUNK, ce_share=SPLIT_CE_SHARE) -> None:
    """Pull the rows this rank's experts need into ``ws.x_recv`` (row ``r*T + t``).

    Afterwards the GEMM A rows of the expert-sorted space are
    ``x_recv[src_rank*T + src_token]`` (see ``gather_index``); ``schedule.ready[q]``
    (zeroed by ``build_schedule``: call it once per dispatch) reaches
    ``schedule.minibatch_rows[q]`` once minibatch q's tokens are staged.
    ``variant``: "ld" (32 lanes of 16-byte loads per row; the layer's default), "bulk"
    (lane 0 moves the row with bulk async copies through shared memory, ``bulk_chunk`` bytes
    at a time) or "copy_engine" (every peer's whole x buffer by one async device-to-device
    copy each, then one launch marks all rows ready: no SM moves a byte, but tokens no local
    expert needs cross NVLink too -- worth it where nearly all are needed, e.g. EP=2 top-8:
    1 - 2^-8 of them) or "push" (every rank writes its own tokens into the ranks that need
    them, then waits for its own rows: ``dispatch_push`` + ``wait_dispatch_push`` -- every
    rank of the group must call it; emulated ranks call the two halves, every rank's push
    before any wait) or "split" (``dispatch_split``: the copy engine moves the first
    ``ce_share`` of every peer's tokens while the SMs pull the rows needed among the rest).
    Every variant stages every needed row and gives the same ``ready`` totals (copy_engine
    and split also stage unneeded tokens of the copied ranges).
    """
    _check_variant(variant, DISPATCH_VARIANTS)
    if variant == "split":
        dispatch_split(ws, schedule, stream, num_blocks, ce_share)
        return
    if variant == "push":
        dispatch_push(ws, schedule, stream, num_blocks)
        wait_dispatch_push(ws, schedule, stream)
        return
    if variant == "copy_engine":
        _copy_peer_tokens(ws, ws.tokens_per_rank, stream)
        q = schedule.ready.shape[0]
        launch(publish_all_kernel, max(1, -(-q // _COPY_THREADS)), _COPY_THREADS, stream, 0,
               schedule.minibatch_rows, schedule.ready)
        return
    args = pull_dispatch_args(ws, schedule)
    if variant == "ld":
        launch(pull_dispatch_kernel, _comm_grid(ws, num_blocks), 32 * COMM_WARPS, stream, 0,
               *args)
    else:
        _bulk_launch(pull_dispatch_bulk_kernel, ws, num_blocks, stream, bulk_chunk, *args)


def _copy_peer_tokens(ws: Workspace, tokens: int, stream) -> None:
    """Copy-engine copies (one per peer, on ``stream``) of every peer's first ``tokens``
    tokens from its x buffer into their staging rows here."""
    T, H = ws.tokens_per_rank, ws.hidden
    if not tokens:
        return
    staging = _flat(ws.x_recv)
    for r in range(ws.ep_size):
        if r != ws.rank:
            device_copy(staging[r * T * H:(r * T + tokens) * H], ws.peer_x[r][:tokens * H],
                        stream)


def split_tokens(ws: Workspace, ce_share) -> int:
    """Tokens of each peer that ``dispatch_split`` leaves to the copy engine (t < this)."""
    if (not isinstance(ce_share, (int, float)) or isinstance(ce_share, bool)
            or not 0.0 <= ce_share <= 1.0):
        raise ValueError(f"ce_share={ce_share!r}: must be a number in [0, 1]")
    return int(round(ce_share * ws.tokens_per_rank))


def dispatch_split(ws: Workspace, schedule, stream=0, num_blocks=None,
                   ce_share=SPLIT_CE_SHARE) -> None:
    """``dispatch(variant="split")``: two engines pull at once. On a side stream forked from
    ``stream`` the copy engine copies tokens t < ``split_tokens(ws, ce_share)`` of every peer
    (one contiguous copy per peer, unneeded tokens included) while the SM pull kernel stages
    the needed tokens t >= that of every rank and counts their rows ready as it goes; after the
    join one launch counts the copy engine's rows. Why: SM-issued NVLink reads stall at ~0.89
    of the copy engine's rate whatever the kernel does (NOTES, sessions 5-6), and the copy
    engine needs no SM -- the two share the link. Capturable (the fork and join are events on
    ``ws.side``, made with the workspace).
    Readiness: the copy engine's rows count only after the join, and nearly every minibatch
    holds some, so a consumer polling ``ready`` sees minibatches complete only at the end --
    fine while the GEMM follows the dispatch in stream order, not for an overlapped one.
    In two halves, ``dispatch_split_start`` + ``dispatch_split_finish``: launches on ``stream``
    between them run while the copy engine copies (the layer puts the shared expert there)."""
    dispatch_split_start(ws, stream, ce_share)
    dispatch_split_finish(ws, schedule, stream, num_blocks, ce_share)


def dispatch_split_start(ws: Workspace, stream=0, ce_share=SPLIT_CE_SHARE) -> None:
    """First half of ``dispatch_split``: fork the side stream and enqueue the copy engine's
    copies. Needs no schedule (the copied ranges are fixed), only every peer's published x."""
    t_ce = split_tokens(ws, ce_share)
    if ws.side.pending is not None:
        raise RuntimeError("dispatch_split_start called twice without dispatch_split_finish")
    ws.side.pending = t_ce
    if ws.tokens_per_rank == 0 or t_ce == 0:
        return
    ws.side.fork(stream)
    _copy_peer_tokens(ws, t_ce, ws.side.stream)


def dispatch_split_finish(ws: Workspace, schedule, stream=0, num_blocks=None,
                          ce_share=SPLIT_CE_SHARE) -> None:
    """Second half: the SM pull of tokens t >= ``split_tokens(ws, ce_share)``, the join, and
    the count of the copy engine's rows. ``ce_share`` must be the start's."""
    T = ws.tokens_per_rank
    t_ce = split_tokens(ws, ce_share)
    if ws.side.pending != t_ce:
        raise RuntimeError(f"dispatch_split_finish for {t_ce} copy-engine tokens per peer, but "
                           f"dispatch_split_start enqueued {ws.side.pending}: call start first, "
                           "with the same ce_share")
    ws.side.pending = None
    if T == 0:
        return
    if t_ce < T:
        args = pull_dispatch_args(ws, schedule, t_begin=t_ce)
        launch(pull_dispatch_kernel, _comm_grid(ws, num_blocks), 32 * COMM_WARPS, stream, 0,
               *args)
    if t_ce:
        ws.side.join(stream)
        launch(publish_tokens_kernel, _PUBLISH_BLOCKS, _COPY_THREADS, stream, 0,
               _flat(schedule.recv_row), schedule.ready, np.int64(T), np.int64(ws.topk),
               np.int64(schedule.minibatch_size), np.int64(t_ce))


_PUBLISH_BLOCKS = 2 if SIM else 64


def pull_dispatch_args(ws: Workspace, schedule, t_begin=0) -> tuple:
    """The pull dispatch kernels' arguments (``kernels.dispatch``; the bulk one takes three
    more). ``t_begin``: the kernel stages tokens t >= t_begin of every rank."""
    return (ws.rank, ws.peer_x, _flat(schedule.recv_row), _flat(ws.x_recv), schedule.ready,
            np.int64(ws.tokens_per_rank), np.int64(ws.hidden), np.int64(ws.topk),
            np.int64(schedule.minibatch_size), np.int64(t_begin))


def push_dispatch_args(ws: Workspace, schedule) -> tuple:
    """The push dispatch kernel's arguments (``kernels.push_dispatch``)."""
    return (ws.rank, _flat(ws.x_buf), ws.peer_x_recv, _flat(schedule.dest_rank),
            _flat(schedule.dest_row), ws.peer_push_arrivals, np.int64(ws.tokens_per_rank),
            np.int64(ws.hidden), np.int64(ws.topk), np.int64(schedule.minibatch_size),
            np.int64(schedule.ready.shape[0]))


def dispatch_push(ws: Workspace, schedule, stream=0, num_blocks=None) -> None:
    """First half of ``dispatch(variant="push")``: write this rank's tokens into the staging
    rows of every rank whose experts need them (row ``me*T + t`` there, once per (token,
    rank)) and count them into that rank's ``push_arrivals`` (``schedule.dest_rank`` /
    ``dest_row`` say where each route lands). Emulated ranks: every rank pushes, then every
    rank waits."""
    if ws.tokens_per_rank == 0:
        return
    launch(push_dispatch_kernel, _comm_grid(ws, num_blocks), 32 * COMM_WARPS, stream, 0,
           *push_dispatch_args(ws, schedule))


def wait_dispatch_push(ws: Workspace, schedule, stream=0) -> None:
    """Second half: wait (bounded) until every minibatch's rows have landed here, then
    ``schedule.ready[q] += minibatch_rows[q]``; ``push_arrivals`` goes back to zero."""
    q = schedule.ready.shape[0]
    launch(wait_arrivals_kernel, max(1, -(-q // _COPY_THREADS)), _COPY_THREADS, stream, 0,
           ws.rank, ws.push_arrivals, schedule.minibatch_rows, schedule.ready,
           np.int64(ws.config.spin_timeout_cycles), ws.errors)


def combine(ws: Workspace, schedule, y, stream=0, num_blocks=None, variant="ld",
            bulk_chunk=BULK_CHUNK) -> None:
    """Push expert outputs ``y`` (uint16 [capacity, H], expert-sorted rows) home.
    ``variant`` as in ``dispatch`` ("bulk": y row -> shared memory -> the source's row)."""
    _check_variant(variant)
    y = as_device_array(y, "y", dtype=np.uint16, shape=(ws.capacity, ws.hidden))
    args = (_flat(y), schedule.src_rank, schedule.src_token, schedule.src_slot,
            schedule.num_rows, ws.peer_combine, np.int64(ws.hidden), np.int64(ws.topk))
    if variant == "ld":
        launch(push_combine_kernel, _comm_grid(ws, num_blocks), 32 * COMM_WARPS, stream, 0,
               *args)
    else:
        _bulk_launch(push_combine_bulk_kernel, ws, num_blocks, stream, bulk_chunk, ws.rank,
                     *args)


def epilogue(ws: Workspace, router_weights, out, y_shared=None, stream=0) -> None:
    """out = y_shared + sum_j w_j * y_j (slots ascending, FP32, one bf16 rounding).

    Arguments:
        router_weights: float32 [T, k]; out: uint16 [T, H]; y_shared: uint16 [T, H] or None.
    The masks come from this rank's row of the ids table (pushed by ``publish_tokens``).
    """
    T, H, k = ws.tokens_per_rank, ws.hidden, ws.topk
    w = as_device_array(router_weights, "router_weights", dtype=np.float32, shape=(T, k))
    out = as_device_array(out, "out", dtype=np.uint16, shape=(T, H))
    has_shared = y_shared is not None
    ys = (as_device_array(y_shared, "y_shared", dtype=np.uint16, shape=(T, H)) if has_shared
          else out)
    if T == 0:
        return
    chunks = T * H // 8
    blocks = min(4 * multiprocessor_count() if not SIM else 2, -(-chunks // _COPY_THREADS))
    launch(combine_epilogue_kernel, blocks, _COPY_THREADS, stream, 0,
           _flat(ys), has_shared, _flat(ws.combine_buf), _flat(ws.ids_table[ws.rank]), _flat(w),
           _flat(out), np.int64(T), np.int64(H), np.int64(k))


def gather_index(ws: Workspace, schedule, out, stream=0) -> None:
    """GEMM row index into ``x_recv`` for every expert-sorted row (-1 on padding)."""
    from .kernels.index import gather_index_kernel
    out = as_device_array(out, "gather_index", dtype=np.int32, shape=(ws.capacity,))
    blocks = max(1, min(1024, -(-ws.capacity // _COPY_THREADS)))
    launch(gather_index_kernel, blocks, _COPY_THREADS, stream, 0, schedule.src_rank,
           schedule.src_token, np.int64(ws.tokens_per_rank), out)
