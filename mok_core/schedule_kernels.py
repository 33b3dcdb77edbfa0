"""Device bodies of the schedule builder (host launch: ``mok_core.schedule``).

Four launches, each a pure function of the gathered routing table, no float math, no
order-dependent atomics -- so the schedule is bitwise deterministic:

    1. count_routes     grid (chunks, R): per-chunk histogram of routes over *global* experts
                        (shared-memory integer atomics: only the totals matter); validates ids
                        (the backstop: ``errors.ID_REPORTED`` is skipped silently, its source
                        rank has reported it);
                        marks every row of the pull table as padding (-1).
    2. scan_chunks      grid (E*R/B,): per (expert, source rank) exclusive prefix over chunks ->
                        where each chunk's routes start in that (expert, rank) list.
    3. expert_offsets   grid (1,): padded per-expert segments of every rank (exclusive scan),
                        row counts, capacity check.
    4. place_routes     grid (chunks, R): ordinal of every route within its (expert, rank) list,
                        in (token, slot) order, then its row = segment base + round-robin
                        interleave over source ranks. Writes the pull table and ``recv_row``
                        (the routes to this rank's experts).

A chunk is ``blockDim.x`` consecutive tokens of one source rank; warp w of the block owns tokens
[32w, 32w+32) of the chunk and walks their routes in groups of 32 (k groups). Inside a group a
route's rank among equal experts comes from ``match_any`` (the lanes holding the same expert,
one instruction; a compare loop over shared memory took most of the schedule's time -- see
docs/perf.md, "Schedule"); per-warp running counts in shared memory
carry the ordinal across groups and warps. Route order is therefore (token, slot) order --
independent of the block size, which the tests check.
"""
from numba import cuda, int32, int64

from . import errors as err
from .block_primitives import MAX_BLOCK_THREADS, block_scan_in_place
from .cuda_compat import kjit
from .intrinsics import match_any, syncwarp

GROUP = 32   # routes ranked together: one warp's worth


@kjit(device=True)
def _record_bad_id(errors, e):
    cuda.atomic.or_(errors, err.FLAGS, err.ERR_BAD_EXPERT_ID)
    if e >= 0:
        cuda.atomic.max(errors, err.BAD_ID_MAX, e)
    else:
        cuda.atomic.min(errors, err.BAD_ID_MIN, e)


@kjit
def count_routes_kernel(ids, rank_tokens, chunk_counts, src_rank, src_token, src_slot,
                        minibatch_rows, ready, errors):
    """Launch: grid (num_chunks, R), block B (multiple of 32), dynamic smem int32[E].

    ids            int32 [R, T, k]    global expert per route, -1 masked
    rank_tokens    int32 [R]          live tokens per rank (routes of later tokens ignored)
    chunk_counts   int32 [R, C, E]    out: routes of chunk c of rank r per global expert
    src_*          int32 [capacity]   out: every row set to -1 (padding) before placement
    minibatch_rows int32 [minibatches] out: zeroed (placement counts real rows into it)
    ready          int32 [minibatches] out: zeroed (dispatch counts staged rows into it; zeroing
                                       it here saves dispatch a launch of its own)
    errors         int32 [ERROR_WORDS]
    """
    hist = cuda.shared.array(0, int32)
    c = cuda.blockIdx.x
    r = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    nthreads = cuda.blockDim.x
    T = ids.shape[1]
    k = ids.shape[2]
    E = chunk_counts.shape[2]
    for e in range(tid, E, nthreads):
        hist[e] = 0
    cuda.syncthreads()

    n_live = min(rank_tokens[r], T)
    t0 = c * nthreads
    for i in range(tid, nthreads * k, nthreads):
        t = t0 + i // k
        if t < n_live:
            e = ids[r, t, i % k]
            if e >= 0 and e < E:
                cuda.atomic.add(hist, e, 1)
            elif e != -1 and e != err.ID_REPORTED:     # ID_REPORTED: its source reported it
                _record_bad_id(errors, e)
    cuda.syncthreads()
    for e in range(tid, E, nthreads):
        chunk_counts[r, c, e] = hist[e]

    # The pull table starts as all padding; placement overwrites real rows (next launches).
    flat = (r * cuda.gridDim.x + c) * nthreads + tid
    stride = cuda.gridDim.x * cuda.gridDim.y * nthreads
    for row in range(flat, src_rank.shape[0], stride):
        src_rank[row] = -1
        src_token[row] = -1
        src_slot[row] = -1
    for q in range(flat, minibatch_rows.shape[0], stride):
        minibatch_rows[q] = 0
        ready[q] = 0


@kjit
def scan_chunks_kernel(chunk_counts, chunk_base, rank_counts):
    """Launch: grid ceil(E*R / B), block B; one thread per (expert, source rank).

    chunk_counts  int32 [R, C, E]
    chunk_base    int32 [R, C, E]  out: routes of (e, r) in chunks before c
    rank_counts   int32 [E, R]     out: routes of (e, r) in total
    A thread walks its C chunks in order (C = T / block size is small); neighbouring threads
    take neighbouring experts, so every step is one coalesced load per warp.
    """
    idx = cuda.grid(1)
    R = chunk_counts.shape[0]
    C = chunk_counts.shape[1]
    E = chunk_counts.shape[2]
    if idx < E * R:
        r = idx // E
        e = idx % E
        run = 0
        for c in range(C):
            n = chunk_counts[r, c, e]
            chunk_base[r, c, e] = run
            run += n
        rank_counts[e, r] = run


@kjit
def expert_offsets_kernel(rank_counts, experts_per_rank, row_align, capacity, me,
                          expert_scan, all_offsets, expert_counts, errors):
    """Launch: grid (1,), block B.

    rank_counts    int32 [E, R]
    expert_scan    int32 [E+1]             out (scratch): exclusive scan of padded counts
    all_offsets    int32 [R, E_local+1]    out: segment starts of every rank's experts; the
                                           last column is that rank's padded row count
    expert_counts  int32 [E_local]         out: unpadded routes per local expert of rank ``me``
    """
    scratch = cuda.shared.array(MAX_BLOCK_THREADS, int32)
    tid = cuda.threadIdx.x
    nthreads = cuda.blockDim.x
    E = rank_counts.shape[0]
    R = rank_counts.shape[1]
    for e in range(tid, E, nthreads):
        n = 0
        for r in range(R):
            n += rank_counts[e, r]
        expert_scan[e] = (n + row_align - 1) // row_align * row_align
        if e // experts_per_rank == me:
            expert_counts[e - me * experts_per_rank] = n
    # (it syncs after: expert_scan, global, is read by other threads below)
    block_scan_in_place(expert_scan, E, scratch)

    for idx in range(tid, R * (experts_per_rank + 1), nthreads):
        d = idx // (experts_per_rank + 1)
        j = idx % (experts_per_rank + 1)
        start = expert_scan[d * experts_per_rank]
        rows = expert_scan[d * experts_per_rank + j] - start
        # Clamped: past an overflow (flagged below) every consumer of the offsets -- GEMM
        # tiles, combine rows -- stays inside the capacity; placement drops those routes.
        all_offsets[d, j] = min(rows, capacity)
        if j == experts_per_rank:
            if rows > capacity:
                cuda.atomic.or_(errors, err.FLAGS, err.ERR_CAPACITY_OVERFLOW)
                cuda.atomic.max(errors, err.OVERFLOW_ROWS, rows)
                cuda.atomic.max(errors, err.OVERFLOW_RANK, d)
                errors[err.CAPACITY] = capacity


@kjit(device=True)
def _route_key(ids, r, t, s, n_live, me, experts_per_rank, E):
    """The route's global expert if it is *relevant* here (pulled by this rank), else -1
    (masked, bad id, past the rank's live tokens, or none of our business)."""
    if t >= n_live:
        return -1
    e = ids[r, t, s]
    if e >= 0 and e < E and e // experts_per_rank == me:
        return e
    return -1


@kjit(device=True)
def _rank_in_group(lane, key):
    """(# earlier lanes with this key, whether a later lane has it) within the warp's 32-route
    group. Every lane of the warp calls it."""
    mask = int64(match_any(key))
    before = cuda.popc(mask & ((int64(1) << lane) - 1))
    later = (mask >> (lane + 1)) != 0
    return before, later


@kjit
def place_routes_kernel(ids, rank_tokens, me, experts_per_rank, chunk_base, rank_counts,
                        all_offsets, src_rank, src_token, src_slot, recv_row,
                        minibatch_size, minibatch_rows):
    """Launch: grid (num_chunks, R), block B (multiple of 32), dynamic smem int32[(B/32)*E].

    A route (r, t, s) -> expert e on rank d = e // E_local is *relevant* here if d == me (it
    is pulled by this rank: pull table + recv_row).

    src_rank/src_token/src_slot  int32 [capacity]  row -> source route (padding stays -1)
    recv_row                      int32 [R, T, k]  route -> row here, -1 if not ours to pull
    minibatch_rows                int32 [minibatches]  real rows per minibatch of rows here
                                  (integer atomics: only the totals matter)
    """
    dyn = cuda.shared.array(0, int32)
    c = cuda.blockIdx.x
    r = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    nthreads = cuda.blockDim.x
    warp = tid // GROUP
    lane = tid % GROUP
    nwarps = nthreads // GROUP
    T = ids.shape[1]
    k = ids.shape[2]
    R = ids.shape[0]
    E = rank_counts.shape[0]
    capacity = src_rank.shape[0]
    hist_base = 0                 # [0, W*E): per-warp running count per expert

    for i in range(tid, nwarps * E, nthreads):
        dyn[hist_base + i] = 0
    n_live = min(rank_tokens[r], T)
    first_route = c * nthreads * k + warp * GROUP * k

    cuda.syncthreads()

    # Pass 1: routes per (warp, expert) in this chunk. A warp's counts are its own: warp-level
    # ordering suffices (the last lane holding a key bumps its count, once per group).
    for g in range(k):
        route = first_route + g * GROUP + lane
        key = _route_key(ids, r, route // k, route % k, n_live, me, experts_per_rank, E)
        before, later = _rank_in_group(lane, key)
        if key >= 0 and not later:
            dyn[hist_base + warp * E + key] += before + 1
        syncwarp()
    cuda.syncthreads()

    # Warp bases: where each warp's routes of expert e start in the (e, r) list.
    for e in range(tid, E, nthreads):
        run = chunk_base[r, c, e]
        for w in range(nwarps):
            n = dyn[hist_base + w * E + e]
            dyn[hist_base + w * E + e] = run
            run += n
    cuda.syncthreads()

    # Pass 2: ordinal -> row; write both maps.
    for g in range(k):
        route = first_route + g * GROUP + lane
        t = route // k
        s = route % k
        key = _route_key(ids, r, t, s, n_live, me, experts_per_rank, E)
        before, later = _rank_in_group(lane, key)
        ordinal = 0
        if key >= 0:
            ordinal = dyn[hist_base + warp * E + key] + before
        syncwarp()                # every lane has read its count before the bump
        if key >= 0 and not later:
            dyn[hist_base + warp * E + key] += before + 1
        syncwarp()                # the bump lands before the next group reads

        if t < T:
            row = -1
            d = -1
            if key >= 0:
                d = key // experts_per_rank
                # Round-robin over source ranks: the ordinal-th route of rank r follows every
                # rank's first `ordinal` routes (capped by what each has) and the ordinal-th
                # route of lower ranks.
                row = all_offsets[d, key - d * experts_per_rank]
                for q in range(R):
                    n = rank_counts[key, q]
                    row += min(n, ordinal)
                    if q < r and n > ordinal:
                        row += 1
                if row >= capacity:       # overflow: flagged by expert_offsets; never write
                    row = -1
            if d == me and row >= 0:
                src_rank[row] = r
                src_token[row] = t
                src_slot[row] = s
                cuda.atomic.add(minibatch_rows, row // minibatch_size, 1)
            recv_row[r, t, s] = row if d == me else -1


@kjit
def token_rows_kernel(tokens, unit, index, offsets, num_rows):
    """Launch: any 1-D grid. The one-expert schedule of a rank's own tokens (the shared
    expert's): index int32 [T_pad] row -> token (r < tokens, else -1); offsets int32 [2] =
    [0, rows], num_rows int32 [1] = rows, rows = tokens rounded up to ``unit``."""
    i = cuda.grid(1)
    while i < index.shape[0]:
        index[i] = i if i < tokens else -1
        i += cuda.gridsize(1)
    if cuda.grid(1) == 0:
        rows = (tokens + unit - 1) // unit * unit
        offsets[0] = 0
        offsets[1] = rows
        num_rows[0] = rows
