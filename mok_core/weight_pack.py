"""Packed expert weights: each box a wgmma tile reads stored contiguously, pre-swizzled.

A weight array W [E, N, K] (row-major, K contiguous) is read by the Hopper GEMMs one box at a
time: ``box_rows`` weight rows x 64 K values (128 bytes per row). In the natural layout such a
box is ``box_rows`` separate 128-byte pieces, one per row, 2K bytes apart -- every K slice
touches ``box_rows`` DRAM pages for 128 bytes each. Packed, the box is ``box_rows * 128``
contiguous bytes in exactly the order shared memory wants (the 128-byte swizzle: 16-byte
chunk c of box row r at chunk c ^ (r % 8)), so one 1-D bulk copy moves it with whole-page
DRAM reads and no tensor map.

Layout (same shape and dtype as W, contents permuted): the rows of all experts, flattened to
[E*N, K], are cut into tiles of ``box_rows`` rows; tile t's K slice s occupies elements

    [t * box_rows * K + s * box_rows * 64,  ... + box_rows * 64)

row r of the box at offset r * 64 within it, its 8-element chunk j holding W chunk j ^ (r % 8)
of that row (XOR is its own inverse, so unpacking is the same permutation).
Box rows are the config's: gate / up ``bn // 2`` each (the SwiGLU tile pairs them), down
``bn`` (``box_rows``). Works on NumPy arrays and on torch tensors (any device).
"""
from __future__ import annotations

import numpy as np

SLICE = 64                    # K values per box row: one 128-byte swizzle row of bf16


def box_rows(config, swiglu: bool) -> int:
    """Weight rows per box the GEMM with ``config`` reads: gate/up bn/2, down bn."""
    return config.bn // 2 if swiglu else config.bn


def _check(shape, rows):
    if len(shape) != 3:
        raise ValueError(f"weights: expected [E, N, K], got shape {tuple(shape)}")
    E, N, K = shape
    if rows % 8 or N % rows or K % SLICE:
        raise ValueError(f"weights [E={E}, N={N}, K={K}]: N must be a multiple of the box's "
                         f"{rows} rows (itself a multiple of 8) and K of {SLICE}")


def _swizzle_chunks(v):
    """v [tiles, slices, rows, 8 chunks, 8] -> chunk c of row r replaced by chunk c ^ (r % 8)
    (its own inverse)."""
    rows = v.shape[2]
    r = np.arange(rows)[:, None]
    j = np.arange(8)[None, :] ^ (r % 8)
    if hasattr(v, "permute"):                                   # torch
        import torch
        r, j = (torch.as_tensor(i, device=v.device) for i in (r, j))
    return v[:, :, r, j]


def _swap_row_and_slice(v):
    """[tiles, a, b, 8, 8] -> [tiles, b, a, 8, 8] (NumPy or torch)."""
    return v.permute(0, 2, 1, 3, 4) if hasattr(v, "permute") else v.transpose(0, 2, 1, 3, 4)


def pack_weights(w, rows: int):
    """W [E, N, K] (bf16 bits or bf16; NumPy array or torch tensor) -> a new array of the
    same shape in the packed layout for boxes of ``rows`` rows (module docstring)."""
    _check(w.shape, rows)
    E, N, K = w.shape
    v = w.reshape(E * N // rows, rows, K // SLICE, 8, 8)      # tile, row, slice, chunk, elem
    return _swizzle_chunks(_swap_row_and_slice(v)).reshape(E, N, K)


def unpack_weights(p, rows: int):
    """Inverse of ``pack_weights`` (tests, checkpoints)."""
    _check(p.shape, rows)
    E, N, K = p.shape
    v = p.reshape(E * N // rows, K // SLICE, rows, 8, 8)        # tile, slice, row, chunk, elem
    return _swap_row_and_slice(_swizzle_chunks(v)).reshape(E, N, K)
