"""Rows of an FP8 activation gathered into expert order, with their scales.

    out[r]       = src[index[r]]          (e4m3 bytes, K per row)
    out_scale[r] = src_scale[index[r]]    (float32, K / 128 per row)
    for r < num_rows[0]; index[r] < 0: a zero row with scales 1.0 (the row quantizer's padding
    row); rows from num_rows[0] on are not written.

Why: the 1 x 128 quantizer is row-wise, so the layer's tokens quantised once per token and
rank (``quantize_fp8`` of the landed rows, no index) and then gathered here are bit for bit
what ``quantize_fp8(..., index=gather_index)`` writes -- which reads and quantises every
route's bf16 row: a rank's T k routes against its R T staging rows, so the layer gathers
where EP < k. Here each route costs a copy of its e4m3 row (half the bytes, read from rows
that stay in L2) and no arithmetic.

Kernel (``gather_rows_kernel``): any grid of THREADS-thread blocks; a warp owns an output row
(grid stride over rows); lane l copies the row's 16-byte chunks l, l + 32, ... (K / 16 of
them: K a multiple of 128, so the rows are 16-byte aligned), CHUNKS_IN_FLIGHT loaded before
they are stored, and its scales l, l + 32, ...
Plain loads and stores, nothing staged, no barrier, no atomics: deterministic, capturable.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, int64, uint32, uint64

from .cuda_compat import flat_view, kjit, launch, multiprocessor_count
from .intrinsics import ld_v4, st_v4

THREADS = 256
CHUNKS_IN_FLIGHT = 4    # 16-byte chunks a lane loads before storing them
_BLOCKS_PER_SM = 8


def make_gather_rows_kernel(chunks_in_flight: int):
    """The kernel with a lane's ``chunks_in_flight`` chunks loaded before they are stored
    (``gather_rows_kernel``: CHUNKS_IN_FLIGHT; ``probe_gather_rows`` times other counts)."""
    @kjit
    def gather_rows_kernel(src32, src_scale, index, num_rows, rows, chunks, groups, out32,
                           out_scale):
        """src32 / out32 uint32 [.. * chunks * 4] (a row's bytes as words), src_scale /
        out_scale float32 [.. * groups], index int32 [rows], num_rows int32 [1] (module
        header)."""
        v = cuda.local.array((chunks_in_flight, 4), uint32)
        lane = int64(cuda.threadIdx.x % 32)
        warps = int64(cuda.gridDim.x) * (THREADS // 32)
        r = int64(cuda.blockIdx.x) * (THREADS // 32) + cuda.threadIdx.x // 32
        n = min(rows, int64(num_rows[0]))          # (< 0: no rows)
        while r < n:
            src = int64(index[uint64(r)])
            dst = uint64(r * chunks) * uint64(4)
            c = lane
            if src >= 0:
                at = uint64(src * chunks) * uint64(4)
                # chunks_in_flight loads before their stores: a store may alias the next
                # load, so a load-store loop keeps one load in flight.
                while c < chunks:
                    for b in range(chunks_in_flight):
                        cb = c + 32 * b
                        if cb < chunks:
                            v[b, 0], v[b, 1], v[b, 2], v[b, 3] = ld_v4(src32,
                                                                       at + uint64(4 * cb))
                    for b in range(chunks_in_flight):
                        cb = c + 32 * b
                        if cb < chunks:
                            st_v4(out32, dst + uint64(4 * cb), v[b, 0], v[b, 1], v[b, 2],
                                  v[b, 3])
                    c += 32 * chunks_in_flight
                g = lane
                while g < groups:
                    out_scale[uint64(r * groups + g)] = src_scale[uint64(src * groups + g)]
                    g += 32
            else:
                zero = uint64(0)
                while c < chunks:
                    st_v4(out32, dst + uint64(4 * c), zero, zero, zero, zero)
                    c += 32
                g = lane
                while g < groups:
                    out_scale[uint64(r * groups + g)] = float32(1.0)
                    g += 32
            r += warps
    return gather_rows_kernel


gather_rows_kernel = make_gather_rows_kernel(CHUNKS_IN_FLIGHT)


def launch_gather_rows(src, src_scale, index, num_rows, out, out_scale, *, stream):
    """``out[r] = src[index[r]]`` with the scales, r < num_rows[0] (module header), on trusted
    device views: ``src`` uint8 [R, K], ``src_scale`` float32 [R, K / 128], ``index`` int32
    [C], ``num_rows`` int32 [1], ``out`` uint8 [C, K], ``out_scale`` float32 [C, K / 128];
    K a multiple of 128. Allocates nothing."""
    rows, K = out.shape
    if not rows or not K:
        return
    grid = max(1, min(multiprocessor_count() * _BLOCKS_PER_SM, -(-rows // (THREADS // 32))))
    launch(gather_rows_kernel, grid, THREADS, stream, 0, flat_view(src, np.uint32),
           flat_view(src_scale), index, num_rows, np.int64(rows), np.int64(K // 16),
           np.int64(K // 128), flat_view(out, np.uint32), flat_view(out_scale))
