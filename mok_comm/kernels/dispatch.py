"""Pull dispatch: this rank's comm blocks fetch, straight from peers' symmetric x buffers over
NVLink, the token rows its experts need -- each (token, rank) pair crosses NVLink once.

Roles and order. Rows of the expert-sorted space are walked in order, ``warps`` rows per task,
tasks dealt round-robin to the comm blocks (block b: tasks b, b + grid, ...). A row's token is
pulled by the row that is its *owner* -- the smallest row of that token here -- into the
token-indexed staging buffer ``x_recv[src_rank * T + src_token]``; the other rows of the token
(its other local experts) read the same staging row through the GEMM's gather index, so no
fan-out copy is written. Because an owner row is the token's first row, every token a minibatch
needs has been pulled by the time the tasks of that minibatch and all earlier ones are done.

Counter: ``ready[q]`` (int32, zeroed per launch) counts processed rows of minibatch q (owner,
non-owner and padding alike, rows < num_rows); it is bumped with a GPU-scope *release* add after
the block's stores are fenced, so a consumer that acquires ``ready[0..q]`` at their full counts
sees every staging row minibatch q reads.

Loads/stores are 16 bytes per lane, four in flight per lane (the loop is unrolled by hand:
the compiler cannot hoist loads of ``peer_x`` over stores to ``x_recv`` it cannot prove apart).
"""
from numba import cuda

from mok_core.cuda_compat import kjit
from mok_core.intrinsics import ld_v4, red_add_release_gpu, st_v4


@kjit(device=True, inline="always")
def copy_row(src, src_off, dst, dst_off, width, lane):
    """One warp copies ``width`` uint16 (multiple of 8) from src[src_off:] to dst[dst_off:]."""
    nchunks = width // 8
    j = lane
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


@kjit
def pull_dispatch_kernel(peer_x, src_rank, src_token, recv_row, num_rows, x_recv, ready,
                         T, H, k, minibatch_rows):
    """Launch: grid = comm blocks, block = 32 * warps threads.

    peer_x      tuple over ranks of uint16 [T*H]   every rank's symmetric x buffer
    src_rank, src_token  int32 [capacity]          schedule pull table (-1 = padding)
    recv_row    int32 [R*T*k]                      row here of route (r, t, s), -1 if not ours
    num_rows    int32 [1]                          rows in use
    x_recv      uint16 [R*T*H]                     out: staging, row r*T + t
    ready       int32 [ceil(capacity / minibatch_rows)]  out: rows done per minibatch
    """
    warps = cuda.blockDim.x // 32
    warp = cuda.threadIdx.x // 32
    lane = cuda.threadIdx.x % 32
    rows = num_rows[0]
    task = cuda.blockIdx.x
    while task * warps < rows:
        row = task * warps + warp
        if row < rows:
            r = src_rank[row]
            if r >= 0:
                t = src_token[row]
                route0 = (r * T + t) * k
                owner = True
                for s in range(k):                 # the token's first row here pulls it
                    other = recv_row[route0 + s]
                    if other >= 0 and other < row:
                        owner = False
                if owner:
                    copy_row(peer_x[r], t * H, x_recv, (r * T + t) * H, H, lane)
        cuda.threadfence()
        cuda.syncthreads()
        if cuda.threadIdx.x == 0:
            for w in range(warps):
                done = task * warps + w
                if done < rows:
                    red_add_release_gpu(ready, done // minibatch_rows, 1)
        task += cuda.gridDim.x
