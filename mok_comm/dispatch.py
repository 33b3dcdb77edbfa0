"""Dispatch: every rank stages the token rows its experts need, each (token, rank) pair crossing
NVLink once.

Layouts (``Workspace``, per rank; T tokens per rank, H hidden, k top-k, R ranks):
    x_recv [R*T, H] uint16   symmetric token staging: token t of rank r lives in row r*T + t.
                             Slice r = me *is* this rank's x buffer (``x_buf``): ``publish_x``
                             writes our tokens there once, peers pull them from it, and our
                             own rows are never copied again.
    schedule.recv_row [R*T*k] row here of route (r, t, s), -1 if no expert of ours takes it
    schedule.ready [Q]       int32 counter per minibatch of expert-sorted rows (below)
The GEMM's A row of expert-sorted row i is then ``x_recv[gather_index[i]]``, gather_index[i] =
src_rank*T + src_token (-1 on padding; ``gather_index``): every local expert of a token reads
the same staging row, no fan-out copy.

Phases and ordering (the caller's duties):
    publish_x      x -> x_buf + NaN/Inf count of x and the router weights (local)
    barrier        every rank's tokens are in place, and every rank has stopped reading the
                   previous step's staging (our next pull overwrites it)
    pull / split   stage the needed rows, count them into ``ready``
    gather_index   the GEMM's row index
A rank's x_buf must not change between that barrier and every peer's dispatch: publish_x of
the next step comes after the combine's barrier.

Pull (``pull``, SM only). Work is *tokens*, not rows: tokens (r, t), t >= t_begin, of every
rank are dealt to the warps in order, v = r*(T - t_begin) + t - t_begin to warp v mod (warps in
the grid). The warp reads the token's k entries of ``recv_row``; if any is >= 0 it copies the
row from rank r's x buffer into x_recv[r*T + t] (unless r is this rank). Dealing tokens keeps
every warp equally busy: rows are expert-sorted, so a row-ordered walk clusters each token's
first rows in the low experts and leaves most warps idle.

Counter ``ready[q]`` counts rows of minibatch q whose token is staged. It is zeroed by
``build_schedule``: one dispatch per schedule build (a second one keeps counting). After its
copy every lane of the warp fences its stores (``membar.gl``), the warp syncs, and the lanes
holding the token's local rows add 1 to their minibatch with a GPU-scope *release* add; a
consumer that acquires ``ready[q] == schedule.minibatch_rows[q]`` sees every staging row
minibatch q reads. (The warp barrier and the cumulative release already order the stores; the
fence stays because that barrier's memory ordering is PTX prose, not the formal model, and it
measured the same speed -- see docs/perf.md.)

Split (``split_start`` + ``split_finish``, the default of ``MoKConfig.dispatch``): two engines
pull at once, because SM-issued NVLink reads stall below the copy engine's rate whatever the
kernel does and the copy engine needs no SM (see docs/perf.md). ``split_start`` forks the
workspace's side stream from ``stream`` and enqueues, per peer, one contiguous copy-engine
copy of its tokens t < ``split_tokens(ws, ce_share)`` (needed or not; it needs no schedule,
only the published x). Launches on ``stream`` between the two halves run while the copy engine
copies (the layer puts the shared expert there). ``split_finish`` pulls the needed tokens
t >= that on the SMs, joins the side stream, and counts the copy engine's rows into ``ready``
(``count_copied_kernel``: per-block shared counts, one release add per minibatch and block).
The copy engine's rows count only after the join and nearly every minibatch holds some, so a
consumer polling ``ready`` sees minibatches complete only at the end: fine while the GEMM
follows the dispatch in stream order, not for an overlapped one. Safety: the workspace
remembers the pending start (``ws.side.pending``); a second start before the finish, or a
finish without its start or with another share, raises before launching anything. The fork
and join are events made with the workspace, so the pair is capturable in a CUDA graph.

Either way every needed row is staged and ``ready`` reaches the same totals (the split also
stages unneeded tokens of the copied ranges).

Errors: ``publish_x`` records, per tensor (x, router weights), the count of non-finite values
and the smallest token holding one in the error word and sets ERR_NON_FINITE
(``Workspace.check`` raises, naming the rank, the tensor and the token); the data is still
copied. Nothing here waits on a peer (the barrier before does), so nothing here can time out.

Entries: ``publish_x``, ``pull``, ``split_start``, ``split_finish``, ``split`` and
``gather_index`` are trusted -- they take device views already checked (``check_x`` checks a
direct caller's x and router weights once).
"""
import math

import numpy as np
from numba import cuda, int32

from mok_core import errors as err
from mok_core.bf16 import nonfinite_bf16x2
from mok_core.cuda_compat import (SIM, as_device_array, device_copy, kjit, launch,
                                  multiprocessor_count)
from mok_core.errors_record import record_non_finite
from mok_core.intrinsics import ld_v4, red_add_release_gpu, st_v4, syncwarp

from .device import COMM_WARPS, COPY_THREADS, comm_grid, copy_row, flat

AGG_SLOTS = 4096                # shared int32 counters per block for counts aggregated per
                                # minibatch (16 KiB; above that, one global add per row)
_COUNT_BLOCKS = 2 if SIM else 64


# ---- device ------------------------------------------------------------------------------

@kjit
def publish_x_kernel(me, x, x_buf, weights, H, k, errors, x_tensor):
    """Launch: any grid. x, x_buf uint16 [T*H] (H % 8 == 0); weights float32 [T*k]. The
    NaN/Inf check rides on the copy: it costs no extra pass over x. Per tensor, the count and
    the smallest token holding one go to the error word (``record_non_finite``): a thread walks
    its elements in increasing order, so its first bad one is its smallest."""
    bad_x = 0
    first_x = 0
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < x.shape[0] // 8:
        a, b, c, d = ld_v4(x, i * 8)
        st_v4(x_buf, i * 8, a, b, c, d)
        n = nonfinite_bf16x2(a) + nonfinite_bf16x2(b) + nonfinite_bf16x2(c) \
            + nonfinite_bf16x2(d)
        if n:
            if bad_x == 0:
                first_x = i * 8 // H
            bad_x += n
        i += stride
    bad_w = 0
    first_w = 0
    i = cuda.grid(1)
    while i < weights.shape[0]:
        if not math.isfinite(weights[i]):
            if bad_w == 0:
                first_w = i // k
            bad_w += 1
        i += stride
    if bad_x:
        record_non_finite(errors, x_tensor, me, bad_x, first_x)
    if bad_w:
        record_non_finite(errors, err.NF_ROUTER_WEIGHTS, me, bad_w, first_w)


@kjit(device=True, inline="always")
def token_needed(recv_row, first, k):
    """Does token ``first // k`` route to any expert of this rank?"""
    for s in range(k):
        if recv_row[first + s] >= 0:
            return True
    return False


@kjit(device=True, inline="always")
def publish_rows(recv_row, first, k, ready, minibatch_size, lane):
    """After this warp's copy of a token, count its local rows as ready (module docstring:
    fence, warp barrier, release adds)."""
    cuda.threadfence()
    syncwarp()                                  # every lane's stores precede the release
    for s in range(lane, k, 32):
        row = recv_row[first + s]
        if row >= 0:
            red_add_release_gpu(ready, row // minibatch_size, 1)


@kjit(max_registers=64)         # two 512-thread comm blocks per SM
def pull_dispatch_kernel(me, peer_x, recv_row, x_recv, ready, T, H, k, minibatch_size,
                         t_begin):
    """Launch: grid = comm blocks, block = 32 * warps threads.

    peer_x      tuple over ranks of uint16 [T*H]   every rank's symmetric x buffer
    recv_row    int32 [R*T*k]                      row here of route (r, t, s), -1 if not ours
    x_recv      uint16 [R*T*H]                     out: staging, row r*T + t
    ready       int32 [ceil(capacity / minibatch_size)]  out: staged rows per minibatch
    t_begin     tokens t >= t_begin of every rank are this kernel's (0: all of them)
    """
    warps = cuda.blockDim.x // 32
    lane = cuda.threadIdx.x % 32
    per_rank = T - t_begin
    v = cuda.blockIdx.x * warps + cuda.threadIdx.x // 32
    while v < len(peer_x) * per_rank:
        r = v // per_rank
        u = r * T + t_begin + v % per_rank          # token (r, t) = staging row u
        first = u * k
        needed = token_needed(recv_row, first, k)
        if needed:                                  # uniform over the warp: same loads
            if r != me:
                copy_row(peer_x[r], (u - r * T) * H, x_recv, u * H, H, lane)
            publish_rows(recv_row, first, k, ready, minibatch_size, lane)
        v += cuda.gridDim.x * warps


@kjit
def count_copied_kernel(recv_row, ready, T, k, minibatch_size, t_end):
    """After the copy engine staged tokens t < ``t_end`` of every rank (stream-ordered before
    this launch): count their rows into ``ready``, as the pull kernel counts the tokens it
    copies.

    Launch: any 1-D grid. recv_row, ready: as in ``pull_dispatch_kernel``. Each block counts
    its share of the routes per minibatch in shared memory and adds the counts once (release):
    minibatches are thousands of rows, so one global add per row would queue thousands of
    atomics on each counter. More minibatches than ``AGG_SLOTS``: one release add per row."""
    counts = cuda.shared.array(AGG_SLOTS, int32)
    minibatches = ready.shape[0]
    agg = minibatches <= AGG_SLOTS
    if agg:
        for q in range(cuda.threadIdx.x, minibatches, cuda.blockDim.x):
            counts[q] = 0
        cuda.syncthreads()
    R = recv_row.shape[0] // (T * k)
    per_rank = t_end * k
    i = cuda.grid(1)
    while i < R * per_rank:
        row = recv_row[(i // per_rank) * T * k + i % per_rank]
        if row >= 0:
            if agg:
                cuda.atomic.add(counts, row // minibatch_size, 1)
            else:
                red_add_release_gpu(ready, row // minibatch_size, 1)
        i += cuda.gridsize(1)
    if agg:
        cuda.syncthreads()
        for q in range(cuda.threadIdx.x, minibatches, cuda.blockDim.x):
            c = counts[q]
            if c:
                red_add_release_gpu(ready, q, c)


@kjit
def gather_index_kernel(src_rank, src_token, T, out):
    """out[row] = src_rank*T + src_token, or -1 on padding rows. Any grid."""
    i = cuda.grid(1)
    while i < out.shape[0]:
        r = src_rank[i]
        out[i] = r * T + src_token[i] if r >= 0 else -1
        i += cuda.gridsize(1)


# ---- host --------------------------------------------------------------------------------

def check_x(ws, x, router_weights=None, tokens=None):
    """(x, router_weights) as device views, checked: uint16 (bf16 bits) [T, H] and float32
    [T, k] (or None); T = ``tokens``, default T_max."""
    T, H, k = ws.tokens_per_rank if tokens is None else tokens, ws.hidden, ws.topk
    x = as_device_array(x, "x", dtype=np.uint16, shape=(T, H), align=16)
    if router_weights is not None:
        router_weights = as_device_array(router_weights, "router_weights", dtype=np.float32,
                                         shape=(T, k))
    return x, router_weights


def publish_x(ws, x, router_weights=None, stream=0, tensor=err.NF_X) -> None:
    """Copy this rank's tokens (uint16 [T, H], T <= T_max) into the first rows of its slice of
    the symmetric staging buffer and record NaN/Inf in x (as tensor id ``tensor``: the
    backward publishes d_out) and the router weights (float32 [T, k], or None) in the error
    word (count and first token per tensor). A barrier must follow before any peer's
    dispatch."""
    T, H = x.shape[0], ws.hidden
    w = router_weights if router_weights is not None else ws.errors[:0].view(np.float32)
    if T == 0:
        return
    blocks = 2 if SIM else min(4 * multiprocessor_count(), -(-T * H // 8 // COPY_THREADS))
    launch(publish_x_kernel, blocks, COPY_THREADS, stream, 0, ws.rank, flat(x), flat(ws.x_buf),
           flat(w), np.int64(H), np.int64(ws.topk), ws.errors, np.int32(tensor))


def _pull(ws, schedule, stream, t_begin) -> None:
    launch(pull_dispatch_kernel, comm_grid(), 32 * COMM_WARPS, stream, 0, ws.rank, ws.peer_x,
           flat(schedule.recv_row), flat(ws.x_recv), schedule.ready,
           np.int64(ws.tokens_per_rank), np.int64(ws.hidden), np.int64(ws.topk),
           np.int64(schedule.minibatch_size), np.int64(t_begin))


def pull(ws, schedule, stream=0) -> None:
    """The SM pull of every needed token into ``ws.x_recv``; ``schedule.ready`` counts them."""
    _pull(ws, schedule, stream, 0)


def split_tokens(ws, ce_share=None) -> int:
    """Tokens of each peer the split dispatch leaves to the copy engine (t < this) for a share
    ``ce_share`` of them (None: the workspace config's ``dispatch_ce_share``, checked there;
    an override is checked here)."""
    if ce_share is None:
        ce_share = ws.config.dispatch_ce_share
    elif (not isinstance(ce_share, (int, float)) or isinstance(ce_share, bool)
            or not 0.0 <= ce_share <= 1.0):
        raise ValueError(f"ce_share={ce_share!r}: must be a number in [0, 1]")
    return int(round(ce_share * ws.tokens_per_rank))


def _copy_peer_tokens(ws, tokens: int, stream) -> None:
    """Copy-engine copies (one per peer, on ``stream``) of every peer's first ``tokens``
    tokens from its x buffer into their staging rows here."""
    T, H = ws.tokens_per_rank, ws.hidden
    if not tokens:
        return
    staging = flat(ws.x_recv)
    for r in range(ws.ep_size):
        if r != ws.rank:
            device_copy(staging[r * T * H:(r * T + tokens) * H], ws.peer_x[r][:tokens * H],
                        stream)


def split_start(ws, stream=0, ce_share=None) -> None:
    """First half of the split dispatch: fork the side stream and enqueue the copy engine's
    copies. ``ce_share``: share of each peer's tokens the copy engine moves (default: the
    workspace config's ``dispatch_ce_share``)."""
    t_ce = split_tokens(ws, ce_share)
    if ws.side.pending is not None:
        raise RuntimeError("dispatch.split_start called twice without dispatch.split_finish")
    ws.side.pending = t_ce
    if ws.tokens_per_rank == 0 or t_ce == 0:
        return
    ws.side.fork(stream)
    _copy_peer_tokens(ws, t_ce, ws.side.stream)


def split_finish(ws, schedule, stream=0, ce_share=None) -> None:
    """Second half: the SM pull of tokens t >= ``split_tokens(ws, ce_share)``, the join, and
    the count of the copy engine's rows. ``ce_share`` must be the start's."""
    T = ws.tokens_per_rank
    t_ce = split_tokens(ws, ce_share)
    if ws.side.pending != t_ce:
        raise RuntimeError(f"dispatch.split_finish for {t_ce} copy-engine tokens per peer, but "
                           f"dispatch.split_start enqueued {ws.side.pending}: call start first, "
                           "with the same ce_share")
    ws.side.pending = None
    if T == 0:
        return
    if t_ce < T:
        _pull(ws, schedule, stream, t_ce)
    if t_ce:
        ws.side.join(stream)
        launch(count_copied_kernel, _COUNT_BLOCKS, COPY_THREADS, stream, 0,
               flat(schedule.recv_row), schedule.ready, np.int64(T), np.int64(ws.topk),
               np.int64(schedule.minibatch_size), np.int64(t_ce))


def split(ws, schedule, stream=0, ce_share=None) -> None:
    """``split_start`` + ``split_finish`` back to back (nothing between the halves)."""
    split_start(ws, stream, ce_share)
    split_finish(ws, schedule, stream, ce_share)


def gather_index(ws, schedule, out, stream=0) -> None:
    """GEMM row index into ``x_recv`` (int32 [capacity] device view) for every expert-sorted
    row, -1 on padding."""
    blocks = max(1, min(1024, -(-ws.capacity // COPY_THREADS)))
    launch(gather_index_kernel, blocks, COPY_THREADS, stream, 0, schedule.src_rank,
           schedule.src_token, np.int64(ws.tokens_per_rank), out)
