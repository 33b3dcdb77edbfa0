"""Routing all-gather: every rank learns every rank's top-k expert ids.

Roles: each rank pushes its ids [T, k] (int32, -1 = masked route) into row ``rank`` of every
rank's ``Workspace.ids_table`` (symmetric int32 [R, T_max, k]) with direct stores over NVLink
(``check_and_publish_ids`` in a layer step, ``publish_ids`` for int32 ids checked elsewhere).
Ordering duty (the caller's): a ``barrier`` after the push, before anything reads the table --
the schedule reads all of it. No multicast (off on our hosts), no host round trip.

Checking: the source rank checks its own ids as it pushes them (``check_and_publish_ids``:
int32 or int64 in, int32 out, one launch). An id < -1 or >= num_experts sets
ERR_BAD_EXPERT_ID in the workspace's error word with the count of bad ids, the first one's
token and slot (smallest t*k + slot) and its exact int64 value, and is replaced by
``errors.ID_REPORTED``, which the schedule skips without reporting it again -- so an int64 id
such as 2**32 + 1 never narrows into expert 1. The schedule's own range check stays as the
backstop for tables that bypass this check.

Rank agreement: at setup each rank pushes a fingerprint of its shapes and config
(``errors.FINGERPRINT_FIELDS``) into row ``rank`` of every rank's table (``push_fingerprint``);
after a barrier each rank compares every row with its own (``compare_fingerprints``): any
difference sets ERR_RANK_MISMATCH, with the first differing field (smallest field, then
smallest rank) and both values, in the error word, which the host checks once, at layer
creation.

Variable tokens: a rank may bring any T <= T_max (``tokens_per_rank``) tokens to a step;
``check_and_publish_ids`` writes its T rows and -1 (masked) in the rows T..T_max-1, so the
count reaches the other ranks as masked routes in the table -- no count crosses on its own and
nothing downstream needs one.

``publish_ids`` and ``check_and_publish_ids`` are trusted: they take device views already
checked (``check_ids`` checks a direct caller's ids once).
"""
import numpy as np
from numba import cuda, int32

from mok_core import errors as err
from mok_core.cuda_compat import as_device_array, kjit, launch
from mok_core.errors_record import finish_bad_ids, record_bad_id

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
def check_push_ids_kernel(me, ids, n, ids32, k, num_experts, peer_tables, errors):
    """Launch: any 1-D grid; every thread of every block runs to the end (``finish_bad_ids``).

    ids          int32 or int64 [>= n] this rank's ids, n = T*k (the first n are read)
    ids32        int32 [N]             out: the checked ids, narrowed; -1 past n (N = T_max*k)
    peer_tables  tuple of int32 [R*N]  out: row ``me`` of every rank's ids table, the same
    A bad id is recorded (``record_bad_id``) and becomes ``ID_REPORTED`` in both outputs."""
    N = ids32.shape[0]
    base = me * N
    i = cuda.grid(1)
    while i < N:
        v32 = int32(-1)
        if i < n:
            v = ids[i]
            v32 = int32(err.ID_REPORTED)
            if v >= -1 and v < num_experts:
                v32 = int32(v)
            else:
                record_bad_id(errors, me, num_experts, i)
        ids32[i] = v32
        for p in range(len(peer_tables)):
            peer_tables[p][base + i] = v32
        i += cuda.gridsize(1)
    finish_bad_ids(ids, k, errors)


@kjit
def push_fingerprint_kernel(me, mine, peer_tables):
    """Launch [1, 32]. mine int32 [W]; peer_tables: tuple of int32 [R*W]."""
    w = mine.shape[0]
    for i in range(cuda.threadIdx.x, w, cuda.blockDim.x):
        for p in range(len(peer_tables)):
            peer_tables[p][me * w + i] = mine[i]


@kjit
def compare_fingerprints_kernel(me, table, errors):
    """Launch [1, any]. table int32 [R, W] (every rank's fingerprint). The first difference
    (smallest field, then smallest rank) is found in shared memory; one thread records it with
    both values, unless the word already holds an earlier one."""
    best = cuda.shared.array(1, int32)
    R = table.shape[0]
    W = table.shape[1]
    if cuda.threadIdx.x == 0:
        best[0] = 0
    cuda.syncthreads()
    for i in range(cuda.threadIdx.x, R * W, cuda.blockDim.x):
        c = i // R                                  # i = field * R + rank: the key's order
        r = i % R
        if table[r, c] != table[me, c]:
            cuda.atomic.max(best, 0, err.INT32_MAX - i)
    cuda.syncthreads()
    key = best[0]
    if cuda.threadIdx.x == 0 and key != 0:
        i = err.INT32_MAX - key
        c = i // R
        r = i % R
        if cuda.atomic.max(errors, err.MISMATCH_FIRST, key) < key:
            errors[err.MISMATCH_FIELD] = c
            errors[err.MISMATCH_RANK] = r
            errors[err.MISMATCH_THEIRS] = table[r, c]
            errors[err.MISMATCH_MINE] = table[me, c]
            errors[err.MISMATCH_ME] = me
        cuda.atomic.or_(errors, err.FLAGS, err.ERR_RANK_MISMATCH)


def check_ids(ws, topk_ids, tokens=None):
    """``topk_ids`` as a device view, checked: [tokens, k] (default T_max), int32 or int64
    (raises otherwise)."""
    T = ws.tokens_per_rank if tokens is None else tokens
    ids = as_device_array(topk_ids, "topk_ids", ndim=2, shape=(T, ws.topk))
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


def check_and_publish_ids(ws, ids, ids32, stream=0) -> None:
    """Check this rank's ids (int32 or int64 [T, k] device view, T <= T_max), write them as
    int32 into ``ids32`` (int32 [T_max, k]; -1 past T) and push them into row ``rank`` of every
    rank's ids table, in one launch: bad ids are recorded in ``ws.errors`` and become
    ``ID_REPORTED`` (module docstring). A barrier must follow before the table is read."""
    n, N = ids.size, ids32.size
    if N:
        flat_ids = ids.reshape(n) if n else ids32.reshape(N)     # (nothing read when T = 0)
        launch(check_push_ids_kernel, min(256, -(-N // COPY_THREADS)), COPY_THREADS, stream, 0,
               ws.rank, flat_ids, np.int64(n), ids32.reshape(N), ws.topk, ws.num_experts,
               ws.peer_ids_table, ws.errors)


def push_fingerprint(ws, mine, peer_tables, stream=0) -> None:
    """Push ``mine`` (int32 [W]) into row ``rank`` of every rank's fingerprint table
    (``peer_tables``: tuple of int32 [R*W]). A barrier must follow before the compare."""
    launch(push_fingerprint_kernel, 1, 32, stream, 0, ws.rank, mine, peer_tables)


def compare_fingerprints(ws, table, stream=0) -> None:
    """Flag ERR_RANK_MISMATCH in ``ws.errors`` if any row of ``table`` (int32 [R, W]) differs
    from this rank's, with the first differing field, the rank and both values."""
    launch(compare_fingerprints_kernel, 1, 32, stream, 0, ws.rank, table, ws.errors)
