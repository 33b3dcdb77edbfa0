"""The pull-dispatch schedule: which rows each rank pulls, and where every route lands.

Each rank builds, on the GPU and without any host sync, the schedule of its *own* experts from
the all-gathered routing table of every rank (``[R, T, k]`` int32, -1 = masked route):

* its local experts' routes, sorted by expert, each expert's segment padded to ``row_align``
  rows (so no GEMM M tile spans two experts), rows of a segment interleaved round-robin over
  source ranks (any window of rows pulls from all peers evenly), and within one source rank in
  (token, slot) order;
* the pull table: for every row, the source (rank, token, slot), -1 on padding rows;
* ``recv_row``: for every route of every rank, the row it occupies here (-1 if not ours) -- the
  dispatch pulls a token once per rank and fans it out to these rows.

Sizes are functions of shapes only (``MoKConfig.schedule_capacity``); counts stay on the
device. Bad expert ids and capacity overflow set the device error word (``mok_core.errors``)
and are never written out of bounds; ``Schedule.check()`` reads the word when asked. (In a
layer step the source rank has checked its ids already and replaced a bad one with
``errors.ID_REPORTED``, which is skipped here without a second report; this check is the
backstop for tables built without it.)

``token_rows`` is the trivial schedule of a rank's own tokens for one expert (the shared
expert's): rows in token order, padded to the GEMMs' row unit, written on the device from this
step's token count so a captured step serves any count.

Host launch glue only; the device bodies are in ``mok_core.schedule_kernels``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import errors as err
from .config import MoKConfig
from .cuda_compat import SIM, as_device_array, device_empty, launch, to_host, upload
from .errors_kernels import reset_error_word
from .schedule_kernels import (count_routes_kernel, expert_offsets_kernel, place_routes_kernel,
                               scan_chunks_kernel, token_rows_kernel)
from .schedule_reference import build_schedule_numpy

__all__ = ["Schedule", "build_schedule", "build_schedule_numpy", "token_rows"]

# Threads per schedule block = tokens per chunk. The simulator runs each thread as a Python
# thread, so it gets small blocks; the result does not depend on this (tests check).
SCHEDULE_THREADS = 32 if SIM else 512
_OFFSETS_THREADS = 64 if SIM else 1024
_SMEM_LIMIT = 48 * 1024


@dataclass
class Schedule:
    """One rank's schedule; caller-owned device buffers, refilled by ``build_schedule``.

    Geometry (host ints): rank, ep_size (R), tokens_per_rank (T), topk (k), num_experts (E,
    global), experts_per_rank (E_local), capacity (rows), row_align.

    Device arrays (int32), written by ``build_schedule``:
        expert_counts       [E_local]        routes per local expert (unpadded)
        expert_rank_counts  [E_local, R]     routes per (local expert, source rank)
        expert_offsets      [E_local + 1]    first row of each local expert's padded segment;
                                             the last entry is the padded row count
        num_rows            [1]              padded rows in use (= expert_offsets[-1]; both
                                             clamped to the capacity after an overflow)
        src_rank, src_token, src_slot  [capacity]  source of each row; -1 on padding rows
        recv_row            [R, T, k]        row here of route (r, t, s); -1 if not ours
        minibatch_rows      [ceil(capacity / minibatch_size)]  real (non-padding) rows per
                                             minibatch: the count dispatch readiness reaches
        ready               [ceil(capacity / minibatch_size)]  zeroed here; the dispatch
                                             (any variant) counts staged rows per minibatch
                                             into it
        errors              [ERROR_WORDS]    device error word (see mok_core.errors)
    Internal scratch: chunk_counts / chunk_base [R, C, E], rank_counts [E, R],
    expert_scan [E + 1], all_offsets [R, E_local + 1], live_tokens [R].
    """
    rank: int
    ep_size: int
    tokens_per_rank: int
    topk: int
    num_experts: int
    experts_per_rank: int
    capacity: int
    row_align: int
    minibatch_size: int
    expert_counts: object
    expert_rank_counts: object
    expert_offsets: object
    num_rows: object
    src_rank: object
    src_token: object
    src_slot: object
    recv_row: object
    minibatch_rows: object
    ready: object
    errors: object
    chunk_counts: object
    chunk_base: object
    rank_counts: object
    expert_scan: object
    all_offsets: object
    live_tokens: object

    @classmethod
    def allocate(cls, *, rank: int, ep_size: int, tokens_per_rank: int, topk: int,
                 num_experts: int, config: MoKConfig, capacity: int | None = None,
                 stream=0) -> "Schedule":
        """Allocate every buffer from shapes alone (``capacity`` defaults to the config's)."""
        R, T, k, E = ep_size, tokens_per_rank, topk, num_experts
        if not (0 <= rank < R):
            raise ValueError(f"rank={rank}: must be in [0, ep_size={R})")
        if E % R:
            raise ValueError(f"num_experts={E}: must be divisible by ep_size={R}")
        if T < 0 or k < 1:
            raise ValueError(f"tokens_per_rank={T}, topk={k}: need T >= 0 and k >= 1")
        E_local = E // R
        smem = 4 * (SCHEDULE_THREADS + SCHEDULE_THREADS // 32 * E)
        if smem > _SMEM_LIMIT or SCHEDULE_THREADS > 1024:
            raise ValueError(f"num_experts={E}: too many experts for the schedule kernel's "
                             f"shared memory ({smem} > {_SMEM_LIMIT} bytes)")
        if capacity is None:
            capacity = config.schedule_capacity(T, k, R, E_local)
        if capacity % config.row_align:
            raise ValueError(f"capacity={capacity}: must be a multiple of row_align")
        C = max(1, -(-T // SCHEDULE_THREADS))
        minibatches = -(-capacity // config.minibatch_size)
        i32 = np.int32
        rank_counts = device_empty((E, R), i32, stream)
        all_offsets = device_empty((R, E_local + 1), i32, stream)
        expert_scan = device_empty((E + 1,), i32, stream)
        live = upload(np.full(R, T, i32), stream)
        return cls(
            rank=rank, ep_size=R, tokens_per_rank=T, topk=k, num_experts=E,
            experts_per_rank=E_local, capacity=capacity, row_align=config.row_align,
            minibatch_size=config.minibatch_size,
            expert_counts=device_empty((E_local,), i32, stream),
            expert_rank_counts=rank_counts[rank * E_local:(rank + 1) * E_local],
            expert_offsets=all_offsets[rank],
            num_rows=all_offsets[rank, E_local:],
            src_rank=device_empty((capacity,), i32, stream),
            src_token=device_empty((capacity,), i32, stream),
            src_slot=device_empty((capacity,), i32, stream),
            recv_row=device_empty((R, T, k), i32, stream),
            minibatch_rows=device_empty((minibatches,), i32, stream),
            ready=device_empty((minibatches,), i32, stream),
            errors=device_empty((err.ERROR_WORDS,), i32, stream),
            chunk_counts=device_empty((R, C, E), i32, stream),
            chunk_base=device_empty((R, C, E), i32, stream),
            rank_counts=rank_counts, expert_scan=expert_scan, all_offsets=all_offsets,
            live_tokens=live,
        )

    @property
    def num_chunks(self) -> int:
        return self.chunk_counts.shape[1]

    def to_host(self, stream=0) -> dict:
        """Host copies of the public arrays (synchronises; for tests and debugging)."""
        names = ("expert_counts", "expert_rank_counts", "expert_offsets", "num_rows", "src_rank",
                 "src_token", "src_slot", "recv_row", "minibatch_rows",
                 "errors")
        return {n: to_host(getattr(self, n), stream) for n in names}

    def check(self, stream=0) -> None:
        """Raise ``MoKError`` if the last build recorded bad input (synchronises)."""
        err.raise_if_set(to_host(self.errors, stream), context=f"schedule (rank {self.rank})",
                         num_experts=self.num_experts)


def build_schedule(schedule: Schedule, topk_ids_all, *, rank_tokens=None, stream=0) -> Schedule:
    """Fill ``schedule`` from every rank's routing; four launches on ``stream``, no host sync.

    Arguments:
        schedule: buffers from ``Schedule.allocate`` (their geometry fixes R, T, k, E).
        topk_ids_all: int32 [R, T, k] device array (any CAI/DLPack producer): global expert id of
            slot s of token t on rank r; -1 = masked route (contributes nothing);
            ``errors.ID_REPORTED`` = a bad id its source rank already reported (skipped, not
            reported again).
        rank_tokens: optional int32 [R] device array: rank r has only its first rank_tokens[r]
            tokens (later routes ignored). Default: all T.
        stream: numba stream (or 0).
    Returns:
        ``schedule`` (same object). Errors (ids outside [-1, E), capacity overflow) are recorded
        on the device; call ``schedule.check()`` to raise them.
    """
    for _, run in schedule_launches(schedule, topk_ids_all, rank_tokens=rank_tokens,
                                    stream=stream):
        run()
    return schedule


def schedule_launches(schedule: Schedule, topk_ids_all, *, rank_tokens=None, stream=0):
    """``build_schedule``'s launches as (name, launch) in order, inputs checked first (what
    ``benchmarks/bench_schedule.py --per-kernel`` times one by one)."""
    s = schedule
    R, T, k, E = s.ep_size, s.tokens_per_rank, s.topk, s.num_experts
    ids = as_device_array(topk_ids_all, "topk_ids_all", dtype=np.int32, shape=(R, T, k))
    live = s.live_tokens if rank_tokens is None else as_device_array(
        rank_tokens, "rank_tokens", dtype=np.int32, shape=(R,))
    B = SCHEDULE_THREADS
    grid = (s.num_chunks, R)

    def reset():
        reset_error_word(s.errors, stream)

    def count():
        launch(count_routes_kernel, grid, B, stream, 4 * E, ids, live, s.chunk_counts,
               s.src_rank, s.src_token, s.src_slot, s.minibatch_rows, s.ready, s.errors)

    def scan():
        launch(scan_chunks_kernel, -(-(E * R) // B), B, stream, 0, s.chunk_counts,
               s.chunk_base, s.rank_counts)

    def offsets():
        launch(expert_offsets_kernel, 1, _OFFSETS_THREADS, stream, 0,
               s.rank_counts, s.experts_per_rank, s.row_align, s.capacity, s.rank,
               s.expert_scan, s.all_offsets, s.expert_counts, s.errors)

    def place():
        launch(place_routes_kernel, grid, B, stream, 4 * (B // 32 * E),
               ids, live, s.rank, s.experts_per_rank, s.chunk_base, s.rank_counts,
               s.all_offsets, s.src_rank, s.src_token, s.src_slot, s.recv_row,
               s.minibatch_size, s.minibatch_rows)

    return [("reset", reset), ("count_routes", count), ("scan_chunks", scan),
            ("expert_offsets", offsets), ("place_routes", place)]


def token_rows(index, offsets, num_rows, tokens: int, unit: int, stream=0) -> None:
    """The one-expert schedule of this rank's first ``tokens`` tokens, in order: ``index``
    (int32 [T_pad]) row -> token, -1 from ``tokens`` on; ``offsets`` (int32 [2]) = [0, rows]
    and ``num_rows`` (int32 [1]) = rows, ``tokens`` rounded up to ``unit`` (<= T_pad)."""
    if not 0 <= tokens <= index.shape[0] or -(-tokens // unit) * unit > index.shape[0]:
        raise ValueError(f"tokens={tokens}: must be in [0, {index.shape[0]}] (rounded up to "
                         f"{unit}, within the index)")
    blocks = 1 if SIM else max(1, min(64, -(-index.shape[0] // 256)))
    launch(token_rows_kernel, blocks, 32 if SIM else 256, stream, 0, np.int64(tokens),
           np.int64(unit), index, offsets, num_rows)
