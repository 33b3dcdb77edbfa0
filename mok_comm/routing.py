"""Routing all-gather: every rank learns every rank's top-k expert ids.

Roles: each rank pushes its ids [T, k] (int32, -1 = masked route) into row ``rank`` of every
rank's ``Workspace.ids_table`` (symmetric int32 [R, T, k]) with direct stores over NVLink
(``publish_ids``). Ordering duty (the caller's): a ``barrier`` after the push, before anything
reads the table -- the schedule reads all of it. No multicast (off on our hosts), no host round
trip; ids are range-checked later, on the device, by the schedule.

Routers produce int64 ids; ``ids_to_int32`` casts them on the device (values outside int32
become INT32_MIN, so the schedule still flags them as out of range).

Rank agreement: at setup each rank pushes a fingerprint of its shapes and config into row
``rank`` of every rank's table (``push_fingerprint``); after a barrier each rank compares every
row with its own (``compare_fingerprints``) and any difference sets ERR_RANK_MISMATCH in the
error word, which the host checks once, at workspace creation.

``publish_ids`` and ``ids_to_int32`` are trusted: they take device views already checked
(``check_ids`` checks a direct caller's ids once).
"""
import numpy as np
from numba import cuda, int32

from mok_core import errors as err
from mok_core.cuda_compat import as_device_array, kjit, launch

from .device import COPY_THREADS, flat


@kjit
def push_ids_kernel(me, ids, peer_tables):
    """Launch: any grid. ids int32 [T*k] (this rank's); peer_tables: tuple of int32 [R*T*k]."""
    n = ids.shape[0]
    base = me * n
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < n:
        v = ids[i]
        for p in range(len(peer_tables)):
            peer_tables[p][base + i] = v
        i += stride


@kjit
def ids_to_int32_kernel(ids64, ids32):
    """Launch: any grid. ids64 int64 [n] -> ids32 int32 [n]."""
    i = cuda.grid(1)
    while i < ids64.shape[0]:
        v = ids64[i]
        ids32[i] = int32(v) if -2147483648 <= v <= 2147483647 else int32(-2147483648)
        i += cuda.gridsize(1)


@kjit
def push_fingerprint_kernel(me, mine, peer_tables):
    """Launch [1, 32]. mine int32 [W]; peer_tables: tuple of int32 [R*W]."""
    w = mine.shape[0]
    for i in range(cuda.threadIdx.x, w, cuda.blockDim.x):
        for p in range(len(peer_tables)):
            peer_tables[p][me * w + i] = mine[i]


@kjit
def compare_fingerprints_kernel(me, table, errors):
    """Launch [1, 32]. table int32 [R, W] (every rank's fingerprint)."""
    for i in range(cuda.threadIdx.x, table.shape[0] * table.shape[1], cuda.blockDim.x):
        r = i // table.shape[1]
        c = i % table.shape[1]
        if table[r, c] != table[me, c]:
            cuda.atomic.or_(errors, err.FLAGS, err.ERR_RANK_MISMATCH)


def check_ids(ws, topk_ids):
    """``topk_ids`` as a device view, checked: [T, k], int32 or int64 (raises otherwise)."""
    ids = as_device_array(topk_ids, "topk_ids", ndim=2, shape=(ws.tokens_per_rank, ws.topk))
    if np.dtype(ids.dtype) not in (np.int32, np.int64):
        raise TypeError(f"topk_ids: expected dtype int32 or int64, got {np.dtype(ids.dtype)}")
    return ids


def publish_ids(ws, ids32, stream=0) -> None:
    """Push this rank's ids (int32 [T, k] device view) into row ``rank`` of every rank's ids
    table. A barrier must follow before the table is read."""
    n = ws.tokens_per_rank * ws.topk
    if n:
        blocks = min(256, -(-n // COPY_THREADS))
        launch(push_ids_kernel, blocks, COPY_THREADS, stream, 0, ws.rank, flat(ids32),
               ws.peer_ids_table)


def ids_to_int32(ids64, out, stream=0) -> None:
    """Cast int64 ids (device view, any shape) into ``out`` (int32, same size)."""
    n = ids64.size
    if n:
        launch(ids_to_int32_kernel, min(256, -(-n // 256)), 256, stream, 0, ids64.reshape(n),
               out.reshape(n))


def push_fingerprint(ws, mine, peer_tables, stream=0) -> None:
    """Push ``mine`` (int32 [W]) into row ``rank`` of every rank's fingerprint table
    (``peer_tables``: tuple of int32 [R*W]). A barrier must follow before the compare."""
    launch(push_fingerprint_kernel, 1, 32, stream, 0, ws.rank, mine, peer_tables)


def compare_fingerprints(ws, table, stream=0) -> None:
    """Flag ERR_RANK_MISMATCH in ``ws.errors`` if any row of ``table`` (int32 [R, W]) differs
    from this rank's."""
    launch(compare_fingerprints_kernel, 1, 32, stream, 0, ws.rank, table, ws.errors)
