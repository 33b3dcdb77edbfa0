"""Pull dispatch: this rank's comm warps fetch, straight from peers' symmetric x buffers over
NVLink, the token rows its experts need -- each (token, rank) pair crosses NVLink once.

Roles and order. The expert-sorted rows are cut into *tasks* of 32 consecutive rows, dealt
round-robin to every warp of the grid (warp w: tasks w, w + all warps, ...; no block-wide
syncs, so a warp never idles behind its neighbours). In a task, lane i checks row i: the row's
token is pulled by its *owner* -- the smallest row of that token here -- into the token-indexed
staging buffer ``x_recv[src_rank * T + src_token]``; then the whole warp copies the owner rows
one after another. The other rows of a token (its other local experts) read the same staging
row through the GEMM's gather index: no fan-out copy. An owner row is its token's first row,
so every token minibatch q needs is pulled by the tasks of minibatches <= q.

Counter: ``ready[q]`` (int32, zeroed per launch) counts processed rows of minibatch q (owners,
non-owners and padding alike, rows < num_rows). Lane 0 adds a task's rows with a GPU-scope
*release* add after the warp's stores are fenced and the warp has synced, so a consumer that
acquires ``ready[0..q]`` at full count sees every staging row minibatch q reads.

Rows move as 16-byte loads/stores per lane with up to eight loads in flight per lane (unrolled
by hand: the compiler cannot hoist loads of a peer buffer over stores it cannot prove apart).
"""
from numba import cuda, int64

from mok_core.cuda_compat import kjit
from mok_core.intrinsics import ld_v4, red_add_release_gpu, st_v4, syncwarp

TASK_ROWS = 32          # rows per warp task: one per lane for the owner check
MAX_WARPS = 32          # warps per block (shared staging of owner tokens)
OWNER_SLOTS = MAX_WARPS * TASK_ROWS     # a module constant: shared array sizes must be literal


@kjit(device=True, inline="always")
def copy_row(src, src_off, dst, dst_off, width, lane):
    """One warp copies ``width`` uint16 (multiple of 8) from src[src_off:] to dst[dst_off:]."""
    nchunks = width // 8
    j = lane
    while j + 224 < nchunks:
        a0, a1, a2, a3 = ld_v4(src, src_off + j * 8)
        b0, b1, b2, b3 = ld_v4(src, src_off + (j + 32) * 8)
        c0, c1, c2, c3 = ld_v4(src, src_off + (j + 64) * 8)
        d0, d1, d2, d3 = ld_v4(src, src_off + (j + 96) * 8)
        e0, e1, e2, e3 = ld_v4(src, src_off + (j + 128) * 8)
        f0, f1, f2, f3 = ld_v4(src, src_off + (j + 160) * 8)
        g0, g1, g2, g3 = ld_v4(src, src_off + (j + 192) * 8)
        h0, h1, h2, h3 = ld_v4(src, src_off + (j + 224) * 8)
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
        a0, a1, a2, a3 = ld_v4(src, src_off + j * 8)
        b0, b1, b2, b3 = ld_v4(src, src_off + (j + 32) * 8)
        c0, c1, c2, c3 = ld_v4(src, src_off + (j + 64) * 8)
        d0, d1, d2, d3 = ld_v4(src, src_off + (j + 96) * 8)
        st_v4(dst, dst_off + j * 8, a0, a1, a2, a3)
        st_v4(dst, dst_off + (j + 32) * 8, b0, b1, b2, b3)
        st_v4(dst, dst_off + (j + 64) * 8, c0, c1, c2, c3)
        st_v4(dst, dst_off + (j + 96) * 8, d0, d1, d2, d3)
        j += 128
    while j < nchunks:
        a0, a1, a2, a3 = ld_v4(src, src_off + j * 8)
        st_v4(dst, dst_off + j * 8, a0, a1, a2, a3)
        j += 32


@kjit(device=True, inline="always")
def count_rows(ready, first, n, minibatch_rows):
    """Release-add rows [first, first + n) to their minibatches' counters."""
    q = first // minibatch_rows
    end = first + n
    while q * minibatch_rows < end:
        lo = max(first, q * minibatch_rows)
        hi = min(end, (q + 1) * minibatch_rows)
        red_add_release_gpu(ready, q, hi - lo)
        q += 1


@kjit
def pull_dispatch_kernel(peer_x, src_rank, src_token, recv_row, num_rows, x_recv, ready,
                         T, H, k, minibatch_rows):
    """Launch: grid = comm blocks, block = 32 * warps threads (warps <= MAX_WARPS).

    peer_x      tuple over ranks of uint16 [T*H]   every rank's symmetric x buffer
    src_rank, src_token  int32 [capacity]          schedule pull table (-1 = padding)
    recv_row    int32 [R*T*k]                      row here of route (r, t, s), -1 if not ours
    num_rows    int32 [1]                          rows in use
    x_recv      uint16 [R*T*H]                     out: staging, row r*T + t
    ready       int32 [ceil(capacity / minibatch_rows)]  out: rows done per minibatch
    """
    owners = cuda.shared.array(OWNER_SLOTS, int64)
    warps = cuda.blockDim.x // 32
    warp = cuda.threadIdx.x // 32
    lane = cuda.threadIdx.x % 32
    mine = warp * TASK_ROWS
    rows = num_rows[0]
    task = cuda.blockIdx.x * warps + warp
    while task * TASK_ROWS < rows:
        row = task * TASK_ROWS + lane
        token = -1
        if row < rows:
            r = src_rank[row]
            if r >= 0:
                route0 = (r * T + src_token[row]) * k
                token = r * T + src_token[row]
                for s in range(k):                 # the token's first row here pulls it
                    other = recv_row[route0 + s]
                    if other >= 0 and other < row:
                        token = -1
        owners[mine + lane] = token
        syncwarp()
        for i in range(TASK_ROWS):
            tok = owners[mine + i]
            if tok >= 0:
                copy_row(peer_x[tok // T], (tok % T) * H, x_recv, tok * H, H, lane)
        cuda.threadfence()
        syncwarp()                                 # every lane's stores precede the release
        if lane == 0:
            first = task * TASK_ROWS
            count_rows(ready, first, min(TASK_ROWS, rows - first), minibatch_rows)
        task += cuda.gridDim.x * warps
