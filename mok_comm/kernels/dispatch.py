"""Pull dispatch: this rank's comm warps fetch, straight from peers' symmetric x buffers over
NVLink, the token rows its experts need -- each (token, rank) pair crosses NVLink once.

Roles and order. Work is *tokens*, not rows: the kernel's tokens (r, t), t >= ``t_begin`` of
every rank r (0: all R*T; the split dispatch leaves t < t_begin to the copy engine and counts
those rows with ``publish_tokens_kernel``), numbered v = r*(T - t_begin) + t - t_begin, are
dealt to warp v mod (warps in the grid). The warp reads the token's k entries of
``recv_row``; if any is >= 0 (the token routes to one of our experts) it copies the row from
rank r's x buffer into the token-indexed staging buffer ``x_recv[u]``, u = r*T + t -- unless
r is this rank: our own tokens already sit in their staging rows (the x buffer *is* that slice of ``x_recv``). Every other row of that
token (its other local experts) reads the same staging row through the GEMM's gather index: no
fan-out copy. Dealing tokens, not rows, keeps every warp equally busy -- rows are expert-sorted,
so the first rows of each token cluster in the low experts and a row-ordered walk leaves most
warps idle.

Counter: ``ready[q]`` (int32, ``Schedule.ready``: zeroed by ``build_schedule``, so one dispatch
per schedule build -- a second dispatch keeps counting) counts rows of minibatch q whose token
is staged.
After the copy every lane fences its stores (``fence``, the default; the warp barrier and the
release below already order them -- measured the same speed), the warp syncs, and the lanes
holding the token's local rows add 1 to their minibatch with a GPU-scope *release* add; a
consumer that acquires ``ready[q] == schedule.minibatch_rows[q]`` sees every staging row
minibatch q reads.

Rows move as 16-byte loads/stores per lane with up to eight loads in flight per lane (unrolled
by hand: the compiler cannot hoist loads of a peer buffer over stores it cannot prove apart).
"""
from numba import cuda, int32, uint16

from mok_core.cuda_compat import kjit
from mok_core.errors_kernels import record_timeout
from mok_core.intrinsics import ld_v4, ld_v4_nc, red_add_release_gpu, st_v4, syncwarp

from .bulk import copy_row_bulk, warp_buffer

COUNTER_BULK_COPY = 4           # errors.COUNTER_NAMES: a bulk row copy that never landed

def make_copy_row(load):
    """``copy_row(src, src_off, dst, dst_off, width, lane)``: one warp copies ``width`` uint16
    (multiple of 8) from src[src_off:] to dst[dst_off:], 16 bytes per lane and load ``load``
    (``ld_v4``, or ``ld_v4_nc``: the read-only path, for rows no one writes during the copy)."""

    @kjit(device=True, inline="always")
    def copy_row(src, src_off, dst, dst_off, width, lane):
        nchunks = width // 8
        j = lane
        while j + 224 < nchunks:
            a0, a1, a2, a3 = load(src, src_off + j * 8)
            b0, b1, b2, b3 = load(src, src_off + (j + 32) * 8)
            c0, c1, c2, c3 = load(src, src_off + (j + 64) * 8)
            d0, d1, d2, d3 = load(src, src_off + (j + 96) * 8)
            e0, e1, e2, e3 = load(src, src_off + (j + 128) * 8)
            f0, f1, f2, f3 = load(src, src_off + (j + 160) * 8)
            g0, g1, g2, g3 = load(src, src_off + (j + 192) * 8)
            h0, h1, h2, h3 = load(src, src_off + (j + 224) * 8)
            st_v4(dst, dst_off + j * 8, a0, a1, a2, a3)
            st_v4(dst, dst_off + (j + 32) * 8, b0, b1, b2, b3)
            st_v4(dst, dst_off + (j + 64) * 8, c0, c1, c2, c3)
            st_v4(dst, dst_off + (j + 96) * 8, d0, d1, d2, d3)
            st_v4(dst, dst_off + (j + 128) * 8, e0, e1, e2, e3)
            st_v4(dst, dst_off + (j + 160) * 8, f0, f1, f2, f3)
            st_v4(dst, dst_off + (j + 192) * 8, g0, g1, g2, g3)
            st_v4(dst, dst_off + (j + 224) * 8, h0, h1, h2, h3)
            j += 256
        while j + 96 < nchunks:
            a0, a1, a2, a3 = load(src, src_off + j * 8)
            b0, b1, b2, b3 = load(src, src_off + (j + 32) * 8)
            c0, c1, c2, c3 = load(src, src_off + (j + 64) * 8)
            d0, d1, d2, d3 = load(src, src_off + (j + 96) * 8)
            st_v4(dst, dst_off + j * 8, a0, a1, a2, a3)
            st_v4(dst, dst_off + (j + 32) * 8, b0, b1, b2, b3)
            st_v4(dst, dst_off + (j + 64) * 8, c0, c1, c2, c3)
            st_v4(dst, dst_off + (j + 96) * 8, d0, d1, d2, d3)
            j += 128
        while j < nchunks:
            a0, a1, a2, a3 = load(src, src_off + j * 8)
            st_v4(dst, dst_off + j * 8, a0, a1, a2, a3)
            j += 32

    return copy_row


copy_row = make_copy_row(ld_v4)


@kjit(device=True, inline="always")
def token_needed(recv_row, first, k):
    """Does token ``first // k`` route to any expert of this rank?"""
    for s in range(k):
        if recv_row[first + s] >= 0:
            return True
    return False


@kjit(device=True, inline="always")
def publish_rows(recv_row, first, k, ready, minibatch_size, lane, fence):
    """After this warp's copy of a token, count its local rows as ready. The warp barrier
    orders every lane's stores before the releasing lanes' adds, and a release is cumulative,
    so the adds alone publish the row; ``fence`` adds a full ``membar.gl`` first (kept as the
    default: the barrier's memory ordering is PTX prose, not the formal model; same speed)."""
    if fence:
        cuda.threadfence()
    syncwarp()                                  # every lane's stores precede the release
    for s in range(lane, k, 32):
        row = recv_row[first + s]
        if row >= 0:
            red_add_release_gpu(ready, row // minibatch_size, 1)


def make_pull_dispatch_kernel(fence=True, nc_loads=False):
    """The pull dispatch kernel; ``fence``: a ``membar.gl`` before each token's ready adds;
    ``nc_loads``: peers' rows read with ``ld.global.nc.L1::no_allocate.L2::256B`` (the x
    buffers are read-only between the barrier before dispatch and the next publish)."""
    copy = make_copy_row(ld_v4_nc if nc_loads else ld_v4)

    @kjit(max_registers=64)         # two 512-thread comm blocks per SM
    def pull_dispatch_kernel(me, peer_x, recv_row, x_recv, ready, T, H, k, minibatch_size,
                             t_begin):
        """Launch: grid = comm blocks, block = 32 * warps threads.

        peer_x      tuple over ranks of uint16 [T*H]   every rank's symmetric x buffer
        recv_row    int32 [R*T*k]                      row here of route (r, t, s), -1 if not ours
        x_recv      uint16 [R*T*H]                     out: staging, row r*T + t
        ready       int32 [ceil(capacity / minibatch_size)]  out: staged rows per minibatch
        t_begin     tokens t >= t_begin of every rank are this kernel's (0: all of them; the
                    split dispatch leaves t < t_begin to the copy engine)
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
                    copy(peer_x[r], (u - r * T) * H, x_recv, u * H, H, lane)
                publish_rows(recv_row, first, k, ready, minibatch_size, lane, fence)
            v += cuda.gridDim.x * warps

    return pull_dispatch_kernel


pull_dispatch_kernel = make_pull_dispatch_kernel()


@kjit
def pull_dispatch_bulk_kernel(me, peer_x, recv_row, x_recv, ready, T, H, k, minibatch_size,
                              t_begin, chunk, timeout_cycles, errors):
    """Variant of ``pull_dispatch_kernel`` (same arguments + the bounded-wait pair, same
    result): lane 0 of each warp moves the row with bulk async copies (``kernels.bulk``),
    ``chunk`` bytes at a time.

    Launch: block = 32 * BULK_WARPS threads, dynamic shared memory ``bulk_smem_bytes(chunk)``.
    A chunk that has not landed after ``timeout_cycles`` is recorded in ``errors`` (rank,
    counter 'dispatch_bulk_copy', row bytes expected / copied, peer) and the warp stops."""
    smem = cuda.shared.array(0, uint16)
    buf, bar = warp_buffer(smem, chunk)
    warps = cuda.blockDim.x // 32
    lane = cuda.threadIdx.x % 32
    phase = 0
    per_rank = T - t_begin
    v = cuda.blockIdx.x * warps + cuda.threadIdx.x // 32
    while v < len(peer_x) * per_rank:
        r = v // per_rank
        u = r * T + t_begin + v % per_rank
        first = u * k
        if token_needed(recv_row, first, k):      # uniform over the warp
            if r != me and lane == 0:
                phase, done = copy_row_bulk(smem, buf, bar, phase, peer_x[r], (u - r * T) * H,
                                            x_recv, u * H, H, chunk, timeout_cycles)
                if done < 2 * H:
                    record_timeout(errors, me, COUNTER_BULK_COPY, 2 * H, done, r)
                    return
            publish_rows(recv_row, first, k, ready, minibatch_size, lane, True)
        v += cuda.gridDim.x * warps


AGG_SLOTS = 4096                # shared int32 counters per block for counts aggregated per
                                # minibatch (16 KiB; above that, one global add per row)


@kjit
def publish_tokens_kernel(recv_row, ready, T, k, minibatch_size, t_end):
    """After the copy engine staged tokens t < ``t_end`` of every rank (the split dispatch:
    ``ops.dispatch(variant="split")``, stream-ordered before this launch): count their rows
    into ``ready``, as the pull kernel counts the tokens it copies.

    Launch: any 1-D grid. recv_row, ready: as in ``pull_dispatch_kernel``. Each block counts
    its share of the routes per minibatch in shared memory and adds the counts once (release):
    minibatches are thousands of rows, so one global add per row would queue thousands of
    atomics on each counter."""
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
def publish_all_kernel(minibatch_rows, ready):
    """After the dense copy-engine pull (``ops.dispatch(variant="copy_engine")``: every peer's
    whole x buffer copied, stream-ordered before this launch), every row of minibatch q is
    staged: ready[q] += minibatch_rows[q] (release; one thread per minibatch)."""
    q = cuda.grid(1)
    if q < ready.shape[0]:
        red_add_release_gpu(ready, q, minibatch_rows[q])
