"""Baseline (b): the torch-native EP forward, with the token exchange done by torch symmetric
memory (``torch.ops.symm_mem.all_to_all_vdev``, NVSHMEM backend) instead of NCCL
``all_to_all_single`` with host-synced splits.

Same inputs and outputs as ``TorchNativeEP`` (x [T, H] bf16, topk_ids [T, k] int64 with -1
masked, router_weights [T, k] f32, weights bf16 of this rank's E_l experts). Deterministic: stable
sorts, scatters to unique rows, and a fixed-order weighted sum; no atomics.

Sizes. R ranks; N = tokens * k slots per rank (the ``tokens`` given at construction bounds T);
M = R * N received rows (the worst case: every rank sends all its slots here); W = row_width(H, R)
>= H + 2 bf16 columns per exchanged row (columns [H, H+2) carry the local expert id as one int32).
Symmetric buffers (allocated once, collectively): send [N, W] bf16, recv [M, W] bf16, and per
exchange in_splits [R] int64 + splits/offsets [2, R] int64 (dispatch and combine use separate ones).

Pipeline (all on the device, in stream order):
  0. shared expert: x [T, H] -> SwiGLU(x Wg^T, x Wu^T) Wd^T -> y_shared [T, H] bf16.
  1. plan: slot s = t*k + j goes to rank topk_ids[t, j] // E_l (masked -> R, sorted last);
     order [T*k] int64 = stable argsort by destination; send counts [R] int64 by searchsorted,
     copied into the dispatch in_splits. No .tolist(): the counts never reach the host.
  2. pack: send[:T*k, :H] = x[order // k]; send.view(int32)[:T*k, H // 2] = local expert id.
  3. dispatch: all_to_all_vdev(send, recv, in_splits, splits_offsets). One kernel trades the
     counts (remote puts + barrier), a second moves the rows: recv holds source 0's rows, then
     source 1's, ... from row 0; splits_offsets[0] = rows from each source, [1] = their offsets.
  4. expert layout: key = local expert id of each recv row, E_l for rows past
     total = sum(splits_offsets[0]) (stale); stable argsort by key; searchsorted gives per-expert
     counts; each group padded to 16 rows -> offs [E_l] int32 (group ends for torch._grouped_mm)
     and pos [M] int64 (the GEMM row of each recv row; stale rows go after the last group).
  5. xs [M + 16 E_l, H] bf16 (persistent): xs[pos] = recv[:, :H].
  6. gu = _grouped_mm(xs, [Wg|Wu]^T, offs) [., 2I] -> SwiGLU -> h [., I] ->
     ys = _grouped_mm(h, Wd^T, offs) [., H], bf16 between ops (like TorchNativeEP). Rows after
     offs[-1] and the padding rows are garbage and never read back.
  7. recv[:, :H] = ys[pos] (arrival order again); combine in_splits = splits_offsets[0].
  8. combine: all_to_all_vdev(recv, send, ...): every source gets its rows back in the order it
     sent them, in send[:sent, :H].
  9. per_slot[order] = send[:T*k, :H]; out = y_shared + sum_j w[t, j] * per_slot[t, j] in f32,
     masked slots -> 0, then bf16 [T, H].

Host syncs: none in this code. The split sizes and the group offsets stay on the device (torch's
bincount is avoided because it reads the max back). What the torch ops do inside is not ours:
``count_host_syncs`` counts the synchronizing calls torch's sync-debug mode sees in one forward,
and bench_layer records it. The price of not syncing: every per-row op after the dispatch runs
over the worst-case M = R*T*k received rows (about R times the real ones), and the receive and
GEMM buffers are sized for it; the GEMMs themselves only compute the rows inside groups.

Why the 1-D op: ``all_to_all_vdev_2d`` (splits per (rank, expert), major_align=16) would land the
rows expert-major and aligned directly, but it checks experts per rank <= 16 (NUM_TILES =
512 threads / 32) and our presets have 128-256 per rank at EP=2.

Alignment: the 1-D data kernel splits each peer's chunk evenly over num_blocks / R CTAs and
asserts it divides (a device assert, fatal to the CUDA context); num_blocks is at most 64 and
reaches 64 for buffers of 4 MiB and more. ``row_width`` makes a row's bytes a multiple of
64 // R (and of 16 for vector copies), so any row count divides.
"""
from __future__ import annotations

import math
import warnings

import torch
import torch.distributed as dist

from mok_testing.torch_native import ALIGN, _swiglu


def available(group=None) -> tuple[bool, str]:
    """(True, "") when this torch can run the baseline here, else (False, why). Local checks
    only (same answer on every rank of one host); never raises."""
    try:
        import torch.distributed._symmetric_memory as symm_mem
        torch.ops.symm_mem.all_to_all_vdev      # AttributeError when the op is not registered
        if not torch.cuda.is_available():
            return False, "CUDA is not available"
        if not symm_mem.is_nvshmem_available():
            return False, ("NVSHMEM is not available to torch (built without it, or "
                           "libnvshmem_host.so.3 does not load)")
        if not dist.is_initialized():
            return False, "torch.distributed is not initialized"
        dist.get_world_size(group)
    except Exception as e:                      # noqa: BLE001 - any failure means unavailable
        return False, f"{type(e).__name__}: {e}"
    return True, ""


def row_width(hidden: int, ranks: int) -> int:
    """bf16 columns per exchanged row: hidden + one int32 (2 columns), rounded up so the row's
    bytes are a multiple of 16 and of 64 // ranks (see the module docstring)."""
    unit = math.lcm(16, max(64 // ranks, 1)) // 2       # in bf16 columns (16 | unit*2)
    return -(-(hidden + 2) // unit) * unit


def send_plan(topk_ids, experts_per_rank: int, ranks: int):
    """(order [T*k] int64: slots sorted by destination rank, masked slots last;
    counts [R] int64: slots for each rank). On the device, no host sync."""
    flat = topk_ids.reshape(-1)
    dest = torch.where(flat >= 0, flat // experts_per_rank, ranks)
    order = torch.argsort(dest, stable=True)
    bounds = torch.searchsorted(dest[order], torch.arange(ranks + 1, device=flat.device,
                                                          dtype=dest.dtype))
    return order, bounds.diff()


def expert_layout(recv_e, total, experts: int, align: int = ALIGN):
    """Grouped-GEMM layout of the received rows, on the device.

    recv_e [M] int: local expert of received row i; rows i >= total (0-dim tensor) are stale.
    Returns pos [M] int64 (GEMM row of received row i: each expert's rows contiguous in arrival
    order, groups padded to ``align`` rows, stale rows after the last group; all distinct and
    < M + (align - 1) * experts) and offs [experts] int32 (group ends, for torch._grouped_mm).
    """
    M = recv_e.shape[0]
    rows = torch.arange(M, device=recv_e.device)
    key = torch.where(rows < total, recv_e.long(), experts)
    perm = torch.argsort(key, stable=True)
    key_sorted = key[perm]
    start = torch.searchsorted(key_sorted, torch.arange(experts + 1, device=key.device))
    padded = (start.diff() + align - 1) // align * align
    pstart = torch.cat([padded.new_zeros(1), padded.cumsum(0)])      # [experts + 1]
    pos = torch.empty_like(perm)
    pos[perm] = pstart[key_sorted] + rows - start[key_sorted]
    return pos, pstart[1:].to(torch.int32)


def count_host_syncs(fn) -> int:
    """Synchronizing CUDA calls torch's sync-debug mode reports while ``fn()`` runs. It sees
    torch's own wrappers (.item(), .tolist(), nonzero, D2H copies, stream syncs); a
    cudaStreamSynchronize issued directly inside a C++ op or NVSHMEM is invisible to it."""
    prev = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(prev)
    return sum("synchroniz" in str(w.message) for w in caught)


class TorchSymmMemEP:
    """Like TorchNativeEP, plus the symmetric buffers, sized for ``tokens`` tokens of ``topk``
    slots per rank. Construction is collective (symmetric allocation + rendezvous)."""

    def __init__(self, w_shared_gate, w_shared_up, w_shared_down, w_gate, w_up, w_down,
                 group=None, *, tokens, topk):
        self.group = group
        self.group_name = (group or dist.group.WORLD).group_name
        self.R = dist.get_world_size(group)
        self.device = w_gate.device
        self.shared = (w_shared_gate, w_shared_up, w_shared_down)
        self.w_gu_t = torch.cat([w_gate, w_up], dim=1).transpose(1, 2)    # [E, H, 2I] view
        self.w_d_t = w_down.transpose(1, 2)                                 # [E, I, H] view
        self.E_local, self.I, H = w_gate.shape
        self.N = tokens * topk
        W = row_width(H, self.R)
        bf16, i64 = torch.bfloat16, torch.int64
        self.send = self._buffer((self.N, W), bf16)
        self.recv = self._buffer((self.R * self.N, W), bf16)
        self.in_splits = [self._buffer((self.R,), i64) for _ in range(2)]  # dispatch, combine
        self.splits_offsets = [self._buffer((2, self.R), i64) for _ in range(2)]
        self.xs = torch.zeros(self.R * self.N + ALIGN * self.E_local, H, dtype=bf16,
                              device=self.device)

    def _buffer(self, shape, dtype):
        """A zeroed symmetric tensor (NVSHMEM backend), rendezvoused on the group."""
        import torch.distributed._symmetric_memory as symm_mem
        if symm_mem.get_backend(self.device) != "NVSHMEM":
            symm_mem.set_backend("NVSHMEM")     # raises if another backend already allocated
        t = symm_mem.empty(shape, dtype=dtype, device=self.device)
        symm_mem.rendezvous(t, self.group_name)
        return t.zero_()

    def _exchange(self, inp, out, in_splits, splits_offsets):
        """all_to_all_vdev over the group; splits and offsets stay on the device."""
        torch.ops.symm_mem.all_to_all_vdev(inp, out, in_splits, splits_offsets, self.group_name)

    def forward(self, x, topk_ids, router_weights, swiglu_limit=None):
        T, H = x.shape
        k = topk_ids.shape[1]
        n = T * k
        if n > self.N:
            raise ValueError(f"{T} tokens x top-{k} exceeds the {self.N} slots built for")
        E_l, I = self.E_local, self.I
        sg, su, sd = self.shared
        y_shared = _swiglu(x @ sg.T, x @ su.T, swiglu_limit) @ sd.T

        # Dispatch: pack rows by destination rank, expert id in the int32 column.
        order, counts = send_plan(topk_ids, E_l, self.R)
        self.send[:n, :H] = x[order // k]
        self.send.view(torch.int32)[:n, H // 2] = topk_ids.reshape(-1)[order] % E_l
        self.in_splits[0].copy_(counts)
        self._exchange(self.send, self.recv, self.in_splits[0], self.splits_offsets[0])

        # Experts: group the received rows by local expert, grouped GEMMs.
        recv_counts = self.splits_offsets[0][0]
        pos, offs = expert_layout(self.recv.view(torch.int32)[:, H // 2], recv_counts.sum(),
                                  E_l)
        self.xs[pos] = self.recv[:, :H]
        gu = torch._grouped_mm(self.xs, self.w_gu_t, offs=offs)
        h = _swiglu(gu[:, :I], gu[:, I:], swiglu_limit)
        ys = torch._grouped_mm(h, self.w_d_t, offs=offs)

        # Combine: results back to their sources, in the order they were sent.
        self.recv[:, :H] = ys[pos]
        self.in_splits[1].copy_(recv_counts)
        self._exchange(self.recv, self.send, self.in_splits[1], self.splits_offsets[1])
        per_slot = x.new_empty(n, H)
        per_slot[order] = self.send[:n, :H]
        routed = (topk_ids >= 0).unsqueeze(-1)
        y = torch.where(routed, router_weights.unsqueeze(-1) * per_slot.view(T, k, H).float(), 0.0)
        return (y_shared.float() + y.sum(1)).to(torch.bfloat16)
