"""The FP8 weight gradient's rows: every expert's rows laid out again from a multiple of 128.

    launch_wgrad_rows(offsets, num_rows, gather_index, k_offsets, k_rows, rows_index,
                      tokens_index, stream=s)

Why: the FP8 weight gradient (``mok_core.gemm.fp8_wgrad``) reduces over an expert's rows in K
slices of 128, from operands quantised in 128-row blocks along the rows (``quantize_fp8(...,
transpose=True)``), so no block may hold two experts' rows; the schedule pads each expert only
to ``MoKConfig.row_align`` (64 by default: what the bf16 tiles want). This op gives the
weight gradient its own layout, K, in which expert e's n_e rows in use start at a multiple of
128:

    n_e             = min(offsets[e + 1], nr) - min(offsets[e], nr)     (nr = num_rows[0])
    k_offsets[e]    = sum over e' < e of ceil(n_e' / 128) * 128           (e <= E)
    k_rows[0]       = k_offsets[E]
    rows_index[c]   = min(offsets[e], nr) + c - k_offsets[e]   for c in [k_offsets[e],
                      k_offsets[e] + n_e), else -1 (the rest of e's last slice, and every c
                      from k_rows[0] on)
    tokens_index[c] = gather_index[rows_index[c]], -1 where rows_index[c] is

so the transposing quantiser gathers the expert-ordered operands (the SwiGLU backward's rows)
through ``rows_index`` and the staged tokens (x, d_out) through ``tokens_index``: zeros
wherever an index is -1, which is what the weight gradient's last slice of an expert must read.
Where ``row_align`` is a multiple of 128 the layout is the schedule's own (k_offsets = offsets
clamped to nr). ``k_capacity`` bounds K's length for a layer.

Kernel (``wgrad_rows_kernel``): any grid of THREADS-thread blocks. Every block computes
k_offsets into shared memory -- E + 1 values, ``block_scan_in_place`` over the experts: a
fixed order -- and block 0 writes them and k_rows; then each block takes
128-column chunks by a grid stride, thread t column t of a chunk: a chunk lies in one expert
(k_offsets are multiples of 128), found by a binary search of the shared k_offsets. Integer
work only: deterministic, no atomics, nothing waits, no host sync.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, int32, int64

from .block_primitives import MAX_BLOCK_THREADS, block_scan_in_place
from .cuda_compat import kjit, launch, multiprocessor_count

THREADS = 128           # = the chunk: one column a thread
K_BLOCK = 128           # the FP8 scale block along the rows
MAX_EXPERTS = MAX_BLOCK_THREADS
_KOFF_SLOTS = MAX_EXPERTS + 1   # k_offsets in shared memory (a literal for numba)


def k_capacity(capacity: int, experts: int, row_align: int) -> int:
    """Columns of K a layer needs at most: each expert's rows, padded to ``row_align`` in the
    schedule's ``capacity`` rows, grow by at most 128 - row_align when padded to 128 instead
    (both are multiples of row_align where row_align divides 128), rounded up to 128."""
    grow = experts * (K_BLOCK - row_align) if row_align < K_BLOCK else 0
    return -(-(capacity + grow) // K_BLOCK) * K_BLOCK


@kjit
def wgrad_rows_kernel(offsets, num_rows, gather_index, k_offsets, k_rows, rows_index,
                      tokens_index):
    """Launch: any grid of THREADS-thread blocks (module docstring).

    offsets       int32 [E + 1]   the schedule's expert offsets (E <= MAX_EXPERTS)
    num_rows      int32 [1]       rows the schedule filled
    gather_index  int32 [C]       expert-sorted row -> staging row (-1 padding)
    k_offsets     int32 [E + 1]   out
    k_rows        int32 [1]       out: k_offsets[E]
    rows_index, tokens_index  int32 [K]  out (K a multiple of 128)
    """
    koff = cuda.shared.array(_KOFF_SLOTS, int32)
    scratch = cuda.shared.array(MAX_BLOCK_THREADS, int32)
    tid = cuda.threadIdx.x
    E = offsets.shape[0] - 1
    nr = num_rows[0]
    for e in range(tid, E, THREADS):
        n = min(offsets[e + 1], nr) - min(offsets[e], nr)
        koff[e] = (max(n, 0) + K_BLOCK - 1) // K_BLOCK * K_BLOCK
    carry = block_scan_in_place(koff, E, scratch)
    if cuda.blockIdx.x == 0:
        for e in range(tid, E + 1, THREADS):
            k_offsets[e] = koff[e]
        if tid == 0:
            k_rows[0] = carry
    K = rows_index.shape[0]
    chunk = int64(cuda.blockIdx.x) * K_BLOCK
    while chunk < K:
        c = chunk + tid
        r = int32(-1)
        if chunk < carry:
            lo = 0                               # the last e with koff[e] <= chunk, e < E
            hi = E - 1
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if koff[mid] <= chunk:
                    lo = mid
                else:
                    hi = mid - 1
            first = min(offsets[lo], nr)
            n = min(offsets[lo + 1], nr) - first
            if c - koff[lo] < n:
                r = int32(first + c - koff[lo])
        rows_index[c] = r
        tokens_index[c] = gather_index[r] if r >= 0 else int32(-1)
        chunk += int64(cuda.gridDim.x) * K_BLOCK


def launch_wgrad_rows(offsets, num_rows, gather_index, k_offsets, k_rows, rows_index,
                      tokens_index, *, stream=0):
    """``wgrad_rows_kernel`` on trusted device views (the layer's buffers; module docstring):
    ``rows_index`` / ``tokens_index`` int32 [K], K a multiple of 128 and at least the layout's
    k_rows (``k_capacity``)."""
    E = offsets.shape[0] - 1
    if E > MAX_EXPERTS:
        raise ValueError(f"{E} experts: the FP8 weight gradient's row layout holds "
                         f"{MAX_EXPERTS}")
    K = rows_index.shape[0]
    grid = max(1, min(K // K_BLOCK, 4 * multiprocessor_count()))
    launch(wgrad_rows_kernel, grid, THREADS, stream, 0, offsets, num_rows, gather_index,
           k_offsets, k_rows, rows_index, tokens_index)


def wgrad_rows_reference(offsets, num_rows, gather_index, K):
    """The layout in numpy (module docstring): (k_offsets, k_rows, rows_index, tokens_index)
    for K columns."""
    offsets = np.asarray(offsets, np.int64)
    nr = int(np.asarray(num_rows).reshape(-1)[0])
    gather_index = np.asarray(gather_index)
    E = len(offsets) - 1
    k_off = np.zeros(E + 1, np.int32)
    rows = np.full(K, -1, np.int32)
    for e in range(E):
        first = min(offsets[e], nr)
        n = max(min(offsets[e + 1], nr) - first, 0)
        rows[k_off[e]:k_off[e] + n] = np.arange(first, first + n)
        k_off[e + 1] = k_off[e] + -(-n // K_BLOCK) * K_BLOCK
    tokens = np.where(rows >= 0, gather_index[np.maximum(rows, 0)], -1).astype(np.int32)
    return k_off, np.array([k_off[E]], np.int32), rows, tokens
