"""Push dispatch: each rank *writes* its own tokens into the staging rows of the ranks whose
experts need them -- the mirror image of the pull dispatch (``dispatch.py``), same result:
``x_recv[r*T + t]`` on rank d holds token t of rank r for every (token, rank) pair routed to d,
each pair crossing NVLink once. Why a second direction: NVLink stores are posted writes, while
an SM's remote loads are round trips (SM pulls reach ~0.89 of the copy engine's pull, the push
combine ~0.93 of its push). Measured (NOTES, sessions 6-7): since the wait shares the barrier's
bounded spin, this push with its wait takes 345 us at 8192 tokens per rank (the pull 367),
0.89-0.90 of the copy-engine push of the same rows -- an option; the layer keeps the pull
until it is measured in the layer.

Roles and order. Work is (token, destination) pairs: pair u = t*R + d of this rank's T*R pairs
is dealt to warp u mod (warps in the grid). The warp reads token t's k routes (``dest_rank`` /
``dest_row``, from this rank's schedule, which places every route on every rank); if one goes to
rank d != me it copies x_buf[t] into rank d's ``x_recv[me*T + t]`` (our own staging slice is
already in place: the x buffer *is* that slice).

Counters: ``arrivals[q]`` on rank d (int32, symmetric, ``Workspace.push_arrivals``) counts rows
of d's minibatch q whose token has landed. Each block counts its routes per (d, minibatch) in
shared memory; when it has pushed all its pairs every thread fences its stores (``membar.sys``
-- the readers are on another GPU), the block syncs, and the counts go to
``arrivals[dest_row // minibatch]`` on d with system-scope *release* adds (one per nonzero
(d, minibatch) and block; ``make_push_dispatch_kernel`` says why not per route). Then on each
rank ``wait_arrivals_kernel`` acquires ``arrivals[q] >= minibatch_rows[q]`` for
every q (bounded: 'dispatch_push_arrivals' in the error word), subtracts what it consumed (so
the counters return to zero with no reset launch, and a CUDA-graph replay keeps working) and
publishes ``ready[q] += minibatch_rows[q]`` -- the pull dispatch's contract.

Ordering across steps (the caller's duty): peers write into *this* rank's staging, so a cross-
rank barrier must separate this rank's last read of ``x_recv`` (its routed FFN) and its wait of
step i from any peer's push of step i+1 -- the forward's phase order (barrier after the combine,
barrier after the x publish) provides both. Without it an early count of step i+1 could
satisfy step i's wait. After a timeout the counters are left as they are: the workspace is in
error (its error word is never cleared) and must be recreated.
"""
from numba import cuda, int32

from mok_core.cuda_compat import kjit
from mok_core.errors_kernels import record_timeout
from mok_core.intrinsics import red_add_release_gpu, red_add_release_sys, syncwarp

from .barrier import spin_at_least
from .dispatch import AGG_SLOTS, copy_row

COUNTER_PUSH_ARRIVALS = 6       # errors.COUNTER_NAMES: a minibatch whose rows never all arrived


@kjit(device=True, inline="always")
def routes_to(dest_rank, dest_row, first, k, d):
    """Does token ``first // k`` have a placed route to rank ``d``?"""
    for s in range(k):
        if dest_rank[first + s] == d and dest_row[first + s] >= 0:
            return True
    return False


# AGG_SLOTS (dispatch.py) shared (dest rank, minibatch) counters per block: EP 8 x T 16384 x
# top-8 at minibatch 4096 needs 8 x 257


def make_push_dispatch_kernel(fence=True, aggregate=True):
    """The push dispatch kernel.

    ``aggregate`` (default): the block counts its pushed rows per (dest rank, minibatch) in
    shared memory and publishes them once, after every thread's ``membar.sys`` and a block
    barrier -- a system-scope release is a full system fence, and one per route cost the
    per-route version 20-30 % (run 29). Arrivals then land when a block finishes rather than
    per token; falls back to per-route adds when R * minibatches > ``AGG_SLOTS``.
    ``fence`` (per-route path): a ``membar.sys`` before each pair's release adds (the warp
    barrier and the cumulative release order the stores without it, as in the pull)."""

    @kjit(max_registers=64)         # two 512-thread comm blocks per SM, like the pull
    def push_dispatch_kernel(me, x_buf, peer_x_recv, dest_rank, dest_row, peer_arrivals, T, H,
                             k, minibatch_size, minibatches):
        """Launch: grid = comm blocks, block = 32 * warps threads.

        me             this rank; T, H, k: tokens per rank, hidden size, top-k
        x_buf          uint16 [T*H]                   this rank's tokens (its staging slice)
        peer_x_recv    tuple over ranks of uint16 [R*T*H]  every rank's staging buffer
        dest_rank/row  int32 [T*k]                    expert rank / row there of route (t, s)
        peer_arrivals  tuple over ranks of int32 [>= minibatches]  out: landed rows per
                       minibatch (``minibatches``: the schedule's count, same on every rank)
        minibatch_size rows per minibatch (``MoKConfig.minibatch_size``)
        """
        counts = cuda.shared.array(AGG_SLOTS, int32)
        warps = cuda.blockDim.x // 32
        lane = cuda.threadIdx.x % 32
        R = len(peer_x_recv)
        agg = aggregate and R * minibatches <= AGG_SLOTS
        if agg:
            for i in range(cuda.threadIdx.x, R * minibatches, cuda.blockDim.x):
                counts[i] = 0
            cuda.syncthreads()
        u = cuda.blockIdx.x * warps + cuda.threadIdx.x // 32
        while u < T * R:
            t = u // R
            d = u % R
            first = t * k
            if routes_to(dest_rank, dest_row, first, k, d):     # uniform over the warp
                if d != me:
                    copy_row(x_buf, t * H, peer_x_recv[d], (me * T + t) * H, H, lane)
                if not agg:
                    if fence and d != me:
                        cuda.threadfence_system()
                    syncwarp()                      # every lane's stores precede the release
                for s in range(lane, k, 32):
                    row = dest_row[first + s]
                    if dest_rank[first + s] == d and row >= 0:
                        q = row // minibatch_size
                        if agg:
                            cuda.atomic.add(counts, d * minibatches + q, 1)
                        else:
                            red_add_release_sys(peer_arrivals[d], q, 1)
            u += cuda.gridDim.x * warps
        if agg:
            cuda.threadfence_system()               # this thread's pushes, system-wide ...
            cuda.syncthreads()                      # ... before any of the block's releases
            for i in range(cuda.threadIdx.x, R * minibatches, cuda.blockDim.x):
                c = counts[i]
                if c:
                    red_add_release_sys(peer_arrivals[i // minibatches], i % minibatches, c)

    return push_dispatch_kernel


push_dispatch_kernel = make_push_dispatch_kernel()


@kjit
def wait_arrivals_kernel(me, arrivals, minibatch_rows, ready, timeout_cycles, errors):
    """Launch: any 1-D grid (a thread per minibatch, grid-strided).

    arrivals        int32 [>= minibatches]  symmetric; peers' (and our) release adds land here
    minibatch_rows  int32 [minibatches]   real rows per minibatch (the schedule's target)
    ready           int32 [minibatches]   out: += minibatch_rows once the rows are staged

    A minibatch that stays short after ``timeout_cycles`` is recorded (rank, counter
    'dispatch_push_arrivals', its expected and seen count; peer -1: any rank may be the late
    one) and the thread stops; the host raises at the next check. The subtraction needs no
    system scope: by the ordering above no peer adds to a minibatch whose target is met."""
    q = cuda.grid(1)
    while q < minibatch_rows.shape[0]:
        want = minibatch_rows[q]
        if want > 0:
            seen = spin_at_least(arrivals, q, want, timeout_cycles)
            if seen < want:
                record_timeout(errors, me, COUNTER_PUSH_ARRIVALS, want, seen, -1)
                return
            cuda.atomic.sub(arrivals, q, want)
            red_add_release_gpu(ready, q, want)
        q += cuda.gridsize(1)
