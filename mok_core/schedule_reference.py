"""Readable NumPy reference of the pull-dispatch schedule (the spec the kernels must match).

See ``mok_core.schedule`` for the meaning of every output. The kernels compute the same
arrays bit for bit; this file says *what* they compute, in the plainest order.
"""
from __future__ import annotations

import numpy as np

from . import errors as err


def build_schedule_numpy(topk_ids_all, rank: int, experts_per_rank: int, capacity: int,
                         row_align: int, rank_tokens=None, minibatch_size: int = 4096) -> dict:
    """Schedule of rank ``rank`` from every rank's routing, on the host.

    Arguments:
        topk_ids_all: int [R, T, k]; ``topk_ids_all[r, t, s]`` is the global expert of slot s
            of token t on rank r; -1 = masked route. Rank r owns experts
            [r*experts_per_rank, (r+1)*experts_per_rank).
        rank: the rank whose schedule to build.
        experts_per_rank: E_local.
        capacity: rows of the padded, expert-sorted table.
        row_align: each expert's rows are padded to a multiple of this.
        rank_tokens: optional int [R]; tokens t >= rank_tokens[r] of rank r are ignored.
        minibatch_size: rows per minibatch (for ``minibatch_rows``).
    Returns:
        dict of NumPy int32 arrays, see ``mok_core.schedule.Schedule`` for each field:
        expert_counts [E_local], expert_rank_counts [E_local, R], expert_offsets [E_local+1],
        num_rows [1], src_rank / src_token / src_slot [capacity], recv_row [R, T, k],
        minibatch_rows [ceil(capacity / minibatch_size)],
        errors [ERROR_WORDS].
    """
    ids = np.asarray(topk_ids_all)
    R, T, k = ids.shape
    E_local = experts_per_rank
    E = R * E_local
    n_tok = np.full(R, T) if rank_tokens is None else np.minimum(np.asarray(rank_tokens), T)
    word = err.initial_error_word()

    # 1. Which routes count: real tokens, ids in range. Bad ids are reported and skipped
    #    (ID_REPORTED, already reported by its source rank, only skipped).
    live = np.arange(T)[None, :, None] < n_tok[:, None, None]
    bad = live & ((ids >= E) | ((ids < -1) & (ids != err.ID_REPORTED)))
    if bad.any():
        word[err.FLAGS] |= err.ERR_BAD_EXPERT_ID
        if (bad & (ids >= E)).any():
            word[err.BAD_ID_MAX] = ids[bad & (ids >= E)].max()
        if (bad & (ids < -1)).any():
            word[err.BAD_ID_MIN] = ids[bad & (ids < -1)].min()
    valid = live & (ids >= 0) & (ids < E)

    # 2. Routes per (expert, source rank), then per-rank padded, expert-sorted segments.
    counts = np.zeros((E, R), dtype=np.int64)
    for r in range(R):
        counts[:, r] = np.bincount(ids[r][valid[r]], minlength=E)
    padded = -(-counts.sum(1) // row_align) * row_align
    offsets = np.zeros((R, E_local + 1), dtype=np.int64)
    for d in range(R):
        offsets[d, 1:] = np.cumsum(padded[d * E_local:(d + 1) * E_local])
    for d in range(R):
        if offsets[d, -1] > capacity:
            word[err.FLAGS] |= err.ERR_CAPACITY_OVERFLOW
            word[err.OVERFLOW_ROWS] = max(word[err.OVERFLOW_ROWS], offsets[d, -1])
            word[err.OVERFLOW_RANK] = d
            word[err.CAPACITY] = capacity

    # 3. Place every route: within an expert's segment, rows go round-robin over source ranks
    #    (the 0th route of every rank in rank order, then every rank's 1st, ...), and a rank's
    #    routes keep their (token, slot) order. Spreads any window of rows across all sources.
    #    Equivalently: an expert's routes sorted by (ordinal within their rank, rank).
    r_of, t_of, s_of = np.nonzero(valid)            # every valid route, in (rank, token, slot)
    e_of = ids[r_of, t_of, s_of].astype(np.int64)
    by_expert_rank = np.lexsort((t_of * k + s_of, r_of, e_of))       # stable (e, r, route)
    group = e_of[by_expert_rank] * R + r_of[by_expert_rank]
    first = np.searchsorted(group, group)                              # start of each (e, r)
    ordinal = np.empty_like(e_of)
    ordinal[by_expert_rank] = np.arange(len(group)) - first
    placed = np.lexsort((r_of, ordinal, e_of))                         # (e, ordinal, r)
    seg_start = np.searchsorted(e_of[placed], e_of[placed])            # first route of e
    pos = np.empty_like(e_of)
    d_of = e_of // E_local
    pos[placed] = (offsets[d_of[placed], e_of[placed] % E_local]
                   + np.arange(len(placed)) - seg_start)

    src_rank = np.full(capacity, -1, np.int32)
    src_token = np.full(capacity, -1, np.int32)
    src_slot = np.full(capacity, -1, np.int32)
    recv_row = np.full((R, T, k), -1, np.int32)
    fits = pos < capacity                    # rows past capacity are never written
    here = fits & (d_of == rank)
    src_rank[pos[here]] = r_of[here]
    src_token[pos[here]] = t_of[here]
    src_slot[pos[here]] = s_of[here]
    recv_row[r_of[here], t_of[here], s_of[here]] = pos[here]

    me = slice(rank * E_local, (rank + 1) * E_local)
    return {
        "expert_counts": counts[me].sum(1).astype(np.int32),
        "expert_rank_counts": counts[me].astype(np.int32),
        # clamped to the capacity: after an overflow no consumer reads past the buffers
        "expert_offsets": np.minimum(offsets[rank], capacity).astype(np.int32),
        "num_rows": np.array([min(offsets[rank, -1], capacity)], np.int32),
        "src_rank": src_rank, "src_token": src_token, "src_slot": src_slot,
        "recv_row": recv_row,
        "minibatch_rows": np.bincount(pos[here] // minibatch_size,
                                      minlength=-(-capacity // minibatch_size)).astype(np.int32),
        "errors": word,
    }
