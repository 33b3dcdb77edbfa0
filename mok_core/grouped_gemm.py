"""Grouped expert GEMMs over the expert-sorted, row-padded layout of the schedule.

    gate_up_swiglu: hidden[r] = SwiGLU(A[r] W_gate[e]^T, A[r] W_up[e]^T)   (bf16 out)
    down:           y[r]      = hidden[r] W_down[e]^T                       (bf16 out)

for every row r of expert e's segment [off[e], off[e+1]). Counts and offsets are read on the
device; A rows can be gathered through an index table (a token pulled once per rank feeds all
its local experts without a fan-out copy; -1 = padding row, read as zeros). The shared expert
is the same kernels with one expert. Device bodies: ``mok_core.grouped_gemm_kernels``.

All bf16 tensors are uint16 bit arrays here (the adapters view framework bf16 as uint16).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .cuda_compat import (SIM, as_device_array, device_address, flat_view, launch,
                          launch_cluster, multiprocessor_count, upload)
from .grouped_gemm_kernels import make_grouped_gemm
from . import grouped_gemm_wgmma_kernels as _wgmma
from . import grouped_gemm_wgmma_ws_kernels as _wgmma_ws
from .tensor_map import tensor_maps

MMA_KINDS = ("mma_sync", "wgmma", "wgmma_ws")


@dataclass(frozen=True)
class GemmConfig:
    """Tile shape of the grouped GEMMs (all compile-time).

    bm x bn output tile per block (bn counts gate+up columns for the SwiGLU GEMM), bk the K
    slice, wm x wn warps, ``stages`` slices in flight, ``blocks_per_sm`` persistent blocks per
    SM. ``bm`` must divide ``MoKConfig.row_align``.

    ``mma`` picks the tensor-core path: ``"mma_sync"`` (warp-level m16n8k16, any sm_80+ GPU and
    the simulator's default), ``"wgmma"`` (Hopper warpgroup MMA, all threads load, the GPU
    default) or ``"wgmma_ws"`` (warp-specialised: a producer warpgroup loads, mbarriers). For
    the wgmma kinds wm = bm / 64 warpgroups of 64 rows, wn = 1, bk = 64 (the 128-byte swizzle
    row), bn in {64, 128, 256}; bm = 128, or 192 / 256 for "wgmma" with ``tma`` (3 / 4
    warpgroups: an expert of up to 192 / 256 rows reads each weight tile once; 256 needs
    bn <= 128); ``blocks_per_sm`` > 1 also bounds the kernel's registers so that many blocks
    fit on an SM ("wgmma"); stages >= 3 ("wgmma") or >= 2
    ("wgmma_ws"). ``row_unit``: what expert segments must be padded to (MoKConfig.row_align
    a multiple of it): bm for mma.sync, 64 for "wgmma", 128 for "wgmma_ws". ``tma``
    (wgmma kinds only): the weight tiles come by TMA from tensor maps (``mok_core.tensor_map``,
    built once per weight array) instead of per-thread cp.async; A rows stay cp.async (they
    are gathered). ``l2_prefetch`` ("wgmma" with ``tma``): weight boxes this many slices
    past the newest load are prefetched into L2. ``probe``: measurement builds only (the
    "no_*" ones give wrong results; ``grouped_gemm_wgmma_kernels.PROBES``,
    ``benchmarks/probe_gemm.py``).
    ``async_ring`` ("wgmma"): full/empty mbarriers per stage instead of a block barrier per K
    slice; loads run STAGES - 1 slices ahead (``make_wgmma_grouped_gemm``).
    ``packed_weights`` ("wgmma" with ``tma``): the weight arrays passed in are in the packed
    layout of ``mok_core.weight_pack`` for this config (``pack_weights(w, box_rows(cfg,
    swiglu))``: gate/up boxes of bn/2 rows, down of bn): each weight box is then one
    contiguous bulk copy (whole DRAM pages) instead of a TMA box of 128-byte row pieces. The
    kernel cannot tell a packed array from a plain one: packing is the caller's contract.
    ``multicast`` ("wgmma" with ``tma``; 0 = off): thread-block clusters of that many blocks
    (2 on the GPU; 1 runs the same protocol on the simulator) share each weight slice: a
    work tile is ``multicast * bm`` rows of one expert, one block per ``bm`` rows, and each
    block fetches part of the slice from L2 and multicasts it to all (half the weight
    traffic from L2). Measured 1.3-2.2x *slower* than the plain kernel on H200 (NOTES.md,
    session 7): an opt-in for experiments.
    ``smem_epilogue`` ("wgmma", block ring: no ``async_ring`` / ``multicast``): the epilogue
    stages the output tile in the ring stages the next tile leaves free and sends it row by
    row with bulk stores, so the next tile's MMAs need not wait for the tile's global stores
    (with the fused combine, each row to its source rank's combine row). The Hopper default
    (``WGMMA_GEMM``): 7-10 % faster than the 192-row tiles where torch won (NOTES, session 9).
    """
    bm: int = 128
    bn: int = 128
    bk: int = 32
    wm: int = 2
    wn: int = 4
    stages: int = 4
    blocks_per_sm: int = 1
    max_registers: int = 0          # 0: compiler's choice; else cap (more warps per SM)
    mma: str = "mma_sync"
    tma: bool = False               # wgmma kinds: weight (B) tiles by TMA boxes, not cp.async
    l2_prefetch: int = 0            # "wgmma" + tma: L2 prefetch of the weights, slices ahead
    async_ring: bool = False        # "wgmma": stages handed over by mbarriers, no block barrier
    probe: str = ""                 # measurement builds only (the "no_*" ones: wrong results)
    packed_weights: bool = False    # "wgmma" + tma: weights in weight_pack's layout
    multicast: int = 0              # "wgmma" + tma: blocks per cluster sharing weight slices
    smem_epilogue: bool = False     # "wgmma": epilogue staged in shared memory + bulk stores

    def __post_init__(self):
        def req(cond, msg):
            if not cond:
                raise ValueError(f"GemmConfig{self}: {msg}")
        req(self.mma in MMA_KINDS, f"mma must be one of {MMA_KINDS}")
        req(self.blocks_per_sm >= 1, "blocks_per_sm must be >= 1")
        req(self.max_registers == 0 or 32 <= self.max_registers <= 255,
            "max_registers must be 0 or in [32, 255]")
        if self.mma != "mma_sync":
            req((self.bk, self.wn) == (64, 1) and self.bm in (128, 192, 256)
                and self.wm == self.bm // 64,
                "wgmma tiles are bm=128, 192 or 256, bk=64, wm=bm/64 (warpgroups), wn=1")
            req(self.bm == 128 or (self.mma == "wgmma" and self.tma),
                "bm=192 and 256 need mma='wgmma' with tma=True")
            req(self.bm < 256 or self.bn <= 128, "bm=256 (4 warpgroups) needs bn <= 128")
            req(self.bn in (64, 128, 256), "wgmma bn must be 64, 128 or 256")
            req(self.l2_prefetch == 0 or (self.mma == "wgmma" and self.tma
                                          and 0 < self.l2_prefetch <= 64),
                "l2_prefetch needs mma='wgmma' with tma=True (and at most 64 slices)")
            req(not self.async_ring or self.mma == "wgmma", "async_ring needs mma='wgmma'")
            req(not self.packed_weights or (self.mma == "wgmma" and self.tma
                                            and not self.l2_prefetch),
                "packed_weights needs mma='wgmma' with tma=True (and no l2_prefetch)")
            req(self.multicast in (0, 1, 2) and (not self.multicast or (
                self.mma == "wgmma" and self.tma and not self.async_ring
                and not self.l2_prefetch
                and _wgmma.probe_parts(self.probe) <= _wgmma.MC_PROBES)),
                "multicast is 0, 1 or 2 and needs mma='wgmma' with tma=True (no async_ring, "
                f"l2_prefetch or probe but {sorted(_wgmma.MC_PROBES)})")
            req(not self.smem_epilogue or (self.mma == "wgmma" and not self.async_ring
                                           and not self.multicast),
                "smem_epilogue needs mma='wgmma' with the block ring (no async_ring, multicast)")
            req(not self.smem_epilogue                 # the staging fits in 2 ring stages
                or self.bm * (2 * self.bn + 16) <= 2 * (self.bm + self.bn) * 128,
                "smem_epilogue: the output tile must fit in two ring stages")
            parts = _wgmma.probe_parts(self.probe)
            req(parts <= set(_wgmma.PROBES) and (not parts or self.mma == "wgmma")
                and (self.multicast or not parts & (_wgmma.MC_PROBES - {"mma_first"}))
                and ("no_b" not in parts or self.tma)
                and (self.smem_epilogue or not parts & _wgmma.STAGED_PROBES),
                f"probe: '+'-joined names from {_wgmma.PROBES} (mma='wgmma'; 'no_b' with tma; "
                "'mc_*' with multicast; 'rows16', 'stage_only' with smem_epilogue)")
            least = 3 if self.mma == "wgmma" else 2
            req(self.stages >= least, f"{self.mma} needs stages >= {least}")
        else:
            req(not (self.tma or self.l2_prefetch or self.probe or self.async_ring
                     or self.packed_weights or self.multicast or self.smem_epilogue),
                "tma, l2_prefetch, probe, async_ring, packed_weights, multicast and "
                "smem_epilogue need a wgmma kind")
            req(self.bk in (32, 64), "bk must be 32 or 64")
            req(self.bm % (self.wm * 16) == 0, "bm must be a multiple of 16*wm")
            req(self.bn % (self.wn * 16) == 0, "bn must be a multiple of 16*wn")
            req(self.stages >= 2, "stages must be >= 2")
            threads = self.wm * self.wn * 32
            req(threads <= 1024, "too many warps")
            req((self.bm * self.bk // 8) % threads == 0
                and (self.bn * self.bk // 8) % threads == 0,
                "tile chunks must divide evenly over threads")
        req(self.smem_bytes <= 227 * 1024, "shared memory over 227 KiB")

    @property
    def threads(self) -> int:
        if self.mma == "mma_sync":
            return self.wm * self.wn * 32
        return 2 * self.bm if self.mma == "wgmma" else _wgmma_ws.THREADS

    @property
    def smem_bytes(self) -> int:
        if self.mma == "wgmma":
            return _wgmma.smem_bytes(self.bn, self.stages, self.bm)
        if self.mma == "wgmma_ws":
            return _wgmma_ws.smem_bytes(self.bn, self.stages)
        return (self.bm + self.bn) * self.bk * 2 * self.stages

    @property
    def row_unit(self) -> int:
        """Expert segments must be padded to a multiple of this many rows."""
        return {"mma_sync": self.bm, "wgmma": 64, "wgmma_ws": 128}[self.mma]


# Hopper: 2 warpgroups x 64 rows, B by TMA, the epilogue staged in shared memory and sent by
# bulk stores. The fastest or within noise of it for both GEMMs at every preset and T of the
# FFN benchmark (NOTES.md, session 9, run 53); the staging matters most to the down GEMM.
WGMMA_GEMM = GemmConfig(bm=128, bn=256, bk=64, wm=2, wn=1, stages=4, mma="wgmma", tma=True,
                        smem_epilogue=True)
# Hopper, 3 warpgroups: an expert of <= 192 rows reads its weights once (one row tile instead
# of two). Staged like WGMMA_GEMM: since the staging reads the accumulator at constant indices
# it spills 64 / 120 bytes (gate/up / down) and beats the direct epilogue (NOTES, sessions
# 10-11: FFN probe in turns, and the layer, run 66).
WGMMA_192_GEMM = GemmConfig(bm=192, bn=256, bk=64, wm=3, wn=1, stages=4, mma="wgmma", tma=True,
                            smem_epilogue=True)
# Mean rows per expert above which one 192-row tile beats 128-row tiles: the per-expert count
# of a routing scatters around the mean (~sqrt(mean) for uniform routing), so from here on a
# good share of experts holds > 128 rows and would take two 128-row tiles (two weight reads).
ROWS_FOR_192 = 112
MMA_SYNC_GEMM = GemmConfig(bm=64, bn=128, bk=32, wm=2, wn=2, stages=4, blocks_per_sm=2)
SIM_GEMM = GemmConfig(bm=32, bn=32, bk=32, wm=2, wn=1, stages=2)


def default_gemm(rows_per_expert: float | None = None) -> GemmConfig:
    """The tiles used when a caller passes none: wgmma on Hopper (sm_90 -- wgmma exists only
    there), mma.sync on other GPUs (sm_80+), small mma.sync tiles on the simulator. Asks the
    current device, so call it where a CUDA context exists (at launch or workspace creation).

    ``rows_per_expert`` (the expected mean, e.g. R*T*k/E for a layer) picks the Hopper row
    tile: weight traffic from L2 bounds these GEMMs and every row tile of an expert reads its
    weights once, so ``WGMMA_192_GEMM`` for a mean of ``ROWS_FOR_192``-192 rows (one tile
    instead of two for most experts: half the weight reads), else ``WGMMA_GEMM`` (128 rows;
    also without a hint). Where 192 saves less (3 tiles instead of 4, 2 instead of 3) 128
    wins or ties. Both stage the epilogue. Measured in the layer (compiled step): 2 H200
    (NOTES, session 9, run 55, 192 direct / 128 staged): kimi 4096 (170 rows) 8.57 / 9.85 ms,
    kimi 8192 (341) 16.31 / 16.39, glm 4096 (255) 8.59 / 7.67, glm 8192 (511) 13.64 / 12.53;
    one H200, EP 1, 8192 tokens (session 11, run 66, 192 staged / before): deepseek-v4-pro
    (128 rows, was 128 staged) 17.31 / 22.00 ms, kimi (171, was 192 direct) 13.52 / 14.31,
    qwen (160) 5.72 / 5.97. The threshold between 112 and 128 is not measured."""
    if SIM:
        return SIM_GEMM
    from numba import cuda
    if cuda.get_current_device().compute_capability != (9, 0):
        return MMA_SYNC_GEMM
    if rows_per_expert is not None and ROWS_FOR_192 < rows_per_expert <= 192:
        return WGMMA_192_GEMM
    return WGMMA_GEMM


def _require_arch(cfg: GemmConfig):
    if cfg.mma == "mma_sync" or SIM:
        return
    from numba import cuda
    cc = cuda.get_current_device().compute_capability
    if cc != (9, 0):
        raise ValueError(f"GemmConfig(mma={cfg.mma!r}) needs a Hopper GPU (sm_90); this device "
                         f"is sm_{cc[0]}{cc[1]}: use mma='mma_sync' (e.g. MMA_SYNC_GEMM)")


@lru_cache(maxsize=None)
def _kernel(cfg: GemmConfig, swiglu: bool, gather: bool, padding_index: bool, push=False):
    _require_arch(cfg)
    if cfg.mma == "wgmma":
        return _wgmma.make_wgmma_grouped_gemm(cfg.bn, cfg.stages, swiglu, gather, padding_index,
                                              max_registers=cfg.max_registers, tma_b=cfg.tma,
                                              push=push, bm=cfg.bm,
                                              l2_prefetch=cfg.l2_prefetch, probe=cfg.probe,
                                              async_ring=cfg.async_ring,
                                              packed_b=cfg.packed_weights,
                                              blocks_per_sm=cfg.blocks_per_sm,
                                              multicast=cfg.multicast,
                                              smem_epilogue=cfg.smem_epilogue)
    if cfg.mma == "wgmma_ws":
        return _wgmma_ws.make_wgmma_ws_grouped_gemm(cfg.bn, cfg.stages, swiglu, gather,
                                                    padding_index,
                                                    max_registers=cfg.max_registers,
                                                    tma_b=cfg.tma, push=push)
    return make_grouped_gemm(cfg.bm, cfg.bn, cfg.bk, cfg.wm, cfg.wn, cfg.stages, swiglu, gather,
                             max_registers=cfg.max_registers)


def _operands(a, a_name, w, w_name, dims, expert_offsets, num_rows):
    """A [rows, K] and W [E, N, K] (uint16, K must agree; ``dims`` = the letters of N and K in
    messages), offsets [E + 1] and num_rows [1] (int32): checked device views + E, N, K."""
    a = as_device_array(a, a_name, dtype=np.uint16, ndim=2)
    K = a.shape[1]
    w = as_device_array(w, w_name, dtype=np.uint16, ndim=3)
    E, N, K2 = w.shape
    if K2 != K:
        raise ValueError(f"{w_name}: expected [E, {dims[0]}, {K}] ({dims[1]} of {a_name}), "
                         f"got {tuple(w.shape)}")
    off = as_device_array(expert_offsets, "expert_offsets", dtype=np.int32, shape=(E + 1,))
    nr = as_device_array(num_rows, "num_rows", dtype=np.int32, shape=(1,))
    return a, w, off, nr, E, N, K


def _launch(kern, cfg: GemmConfig, C, N, n_tile, stream, a, a_index, w0, w1, off, *rest,
            swiglu, route=None):
    """Persistent launch: one block per SM (x blocks_per_sm), never more than tiles. wgmma
    kernels also take the weights' tensor maps (``w0``, ``w1`` [E, N_w, K] as 2-D [E N_w, K],
    boxes of the B rows a slice needs: BN/2 per gate/up half, BN for down; unused without
    ``cfg.tma`` or with ``cfg.packed_weights``: then a 16-element placeholder) and the push
    route (rank, token, slot, peers, k; placeholders when None)."""
    tiles = (C // cfg.row_unit) * (N // n_tile)        # an upper bound on the tiles
    grid = max(1, min(tiles, multiprocessor_count() * cfg.blocks_per_sm))
    cluster = max(cfg.multicast, 1)
    grid = max(cluster, grid // cluster * cluster)     # whole clusters
    if cfg.mma == "wgmma" and off.shape[0] - 1 > _wgmma.MAX_EXPERTS:
        raise ValueError(f"{off.shape[0] - 1} experts in one launch: the wgmma kernel's tile "
                         f"table holds {_wgmma.MAX_EXPERTS}")
    if cfg.mma == "wgmma" and C // 64 >= 1 << 16:
        raise ValueError(f"rows {C}: the wgmma kernel's tile table counts row tiles in 16 bits "
                         f"(at most {(1 << 16) * 64 - 1} rows per launch)")
    args = (_flat(a), a_index, _flat(w0), _flat(w1))
    if cfg.mma != "mma_sync":
        if cfg.tma and not cfg.packed_weights:   # gate/up: gate and up maps, BN/2-row boxes
            box = cfg.bn // 2 if swiglu or cfg.multicast else cfg.bn   # (shared: halves)
            maps = tensor_maps([w.reshape((w.shape[0] * w.shape[1], w.shape[2]))
                                for w in ((w0, w1) if swiglu else (w0,))], box, stream)
        else:
            maps = _placeholder_maps()
        args += (maps,)
    args += (off,) + rest
    if cfg.mma != "mma_sync":
        nr = rest[0]                                   # num_rows: an int32 placeholder
        args += route if route is not None else (nr, nr, nr, (rest[1],), np.int64(0))
    if cfg.multicast:                                  # persistent: every cluster resident
        launch_cluster(kern, grid, cluster, cfg.threads, stream, cfg.smem_bytes, *args,
                       persistent=True)
    else:
        launch(kern, grid, cfg.threads, stream, cfg.smem_bytes, *args)


@lru_cache(maxsize=None)
def _placeholder_maps():
    return upload(np.zeros(16, np.uint64))


def gate_up_swiglu(x, a_index, w_gate, w_up, expert_offsets, num_rows, hidden, *,
                   swiglu_limit=None, config: GemmConfig | None = None, stream=0):
    """hidden[r] = SwiGLU(x[a_index[r]] W_gate[e]^T, x[a_index[r]] W_up[e]^T), bf16.

    Arguments:
        x: uint16 (bf16 bits) [A_rows, H] -- source rows (token staging buffer or local x).
        a_index: int32 [C]: row of x for each expert-sorted row; -1 = padding (zeros).
        w_gate, w_up: uint16 [E, I, H].
        expert_offsets: int32 [E + 1] padded offsets (multiples of config.row_unit);
        num_rows: int32 [1] rows in use (device; never read by the host).
        hidden: uint16 [C, I] output; rows past num_rows untouched, padding rows = 0.
        swiglu_limit: None or float L > 0 (gate clamped above at L, up to [-L, L]).
    """
    config = config or default_gemm()
    x, w_gate, off, nr, E, I, H = _operands(x, "x", w_gate, "w_gate", "IH", expert_offsets,
                                            num_rows)
    w_up = as_device_array(w_up, "w_up", dtype=np.uint16, shape=(E, I, H))
    a_index = as_device_array(a_index, "a_index", dtype=np.int32, ndim=1)
    C = a_index.shape[0]
    hidden = as_device_array(hidden, "hidden", dtype=np.uint16, shape=(C, I))
    _check_staged_out(config, hidden, "hidden")
    limit = math.inf if swiglu_limit is None else float(swiglu_limit)
    if not limit > 0:
        raise ValueError(f"swiglu_limit={swiglu_limit!r}: must be None or > 0")
    _check_dims(config, C=C, K=H, N=I, n_tile=config.bn // 2, name_k="hidden size H",
                name_n="intermediate I")
    _launch(_kernel(config, True, True, True), config, C, I, config.bn // 2, stream,
            x, a_index, w_gate, w_up, off, nr, _flat32(hidden),
            np.int64(H), np.int64(I), np.int64(I), np.float32(limit), swiglu=True)


def down(hidden, w_down, expert_offsets, num_rows, y, *, row_index=None, push=None,
         config: GemmConfig | None = None, stream=0):
    """y[r] = hidden[r] W_down[e]^T, bf16.

    Arguments:
        hidden: uint16 [C, I] (expert-sorted rows, padding rows zero).
        w_down: uint16 [E, H, I].
        expert_offsets, num_rows: as in ``gate_up_swiglu``.
        y: uint16 [C, H] output (unused, may be None, with ``push``).
        row_index: optional int32 [C], < 0 on padding rows (the gate/up ``a_index``): lets the
            wgmma kernel skip all-padding half tiles (their y rows are written as zeros).
        push: optional ``(src_rank, src_token, src_slot, peer_combine, k)`` -- the combine
            fused into the epilogue (wgmma kinds only): row r goes straight to
            ``peer_combine[src_rank[r]]`` (tuple over ranks of uint16 [T*k*H]) at row
            ``src_token[r] * k + src_slot[r]``; rows with src_rank < 0 are dropped. The bits
            equal ``down`` into y followed by ``mok_comm.ops.combine``.
    """
    config = config or default_gemm()
    hidden, w_down, off, nr, E, H, I = _operands(hidden, "hidden", w_down, "w_down", "HI",
                                                 expert_offsets, num_rows)
    C = hidden.shape[0]
    _check_dims(config, C=C, K=I, N=H, n_tile=config.bn, name_k="intermediate I",
                name_n="hidden size H")
    route = None
    if push is not None:
        if config.mma == "mma_sync":
            raise ValueError("down(push=...) needs a wgmma GemmConfig (the mma.sync kernel "
                             "writes y; combine it with mok_comm.ops.combine)")
        rank, token, slot, peers, k = push
        rank, token, slot = (as_device_array(v, n, dtype=np.int32, shape=(C,)) for v, n in
                             ((rank, "src_rank"), (token, "src_token"), (slot, "src_slot")))
        peers = tuple(flat_view(as_device_array(p, "peer_combine", dtype=np.uint16, ndim=1),
                                np.uint32) for p in peers)
        if any(p.shape[0] % (H // 2) for p in peers):
            raise ValueError(f"peer_combine: each buffer must hold whole rows of H={H}")
        for p in peers:
            _check_staged_out(config, p, "peer_combine")
        route = (rank, token, slot, peers, np.int64(k))
        y = nr                                         # unused placeholder
    else:
        y = as_device_array(y, "y", dtype=np.uint16, shape=(C, H))
        _check_staged_out(config, y, "y")
        y = _flat32(y)
    if row_index is not None:
        row_index = as_device_array(row_index, "row_index", dtype=np.int32, shape=(C,))
    use_index = row_index is not None and config.mma != "mma_sync"
    index = row_index if use_index else nr             # unused without an index
    _launch(_kernel(config, False, False, use_index, route is not None), config, C, H,
            config.bn, stream, hidden, index, w_down, w_down, off, nr, y,
            np.int64(I), np.int64(H), np.int64(H), np.float32(math.inf), swiglu=False,
            route=route)


def _check_staged_out(cfg, out, name):
    """``smem_epilogue`` sends output rows by bulk stores: 16-byte aligned addresses only (the
    row pitch always is; the array's start is the caller's)."""
    if not cfg.smem_epilogue:               # (no address lookup on the common path)
        return
    off = device_address(out) % 16
    if off:
        raise ValueError(f"{name}: GemmConfig(smem_epilogue=True) writes it by bulk stores, "
                         f"which need a 16-byte aligned start (this one is {off} bytes past)")


def _check_dims(cfg, *, C, K, N, n_tile, name_k, name_n):
    if C % cfg.row_unit:
        raise ValueError(f"rows {C}: must be a multiple of {cfg.row_unit} for {cfg} "
                         "(MoKConfig.row_align must be a multiple of GemmConfig.row_unit)")
    if K % cfg.bk:
        raise ValueError(f"{name_k}={K}: must be a multiple of {cfg.bk}")
    if N % n_tile:
        raise ValueError(f"{name_n}={N}: must be a multiple of {n_tile}")


_flat = flat_view


def _flat32(a):
    """uint16 [.., N] (N even) -> flat uint32 view of packed bf16 pairs."""
    return flat_view(a, np.uint32)
