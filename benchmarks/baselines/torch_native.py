"""Baseline: expert-parallel MoE forward as torch users write it today (torchtitan style).

    route -> sort by destination rank -> counts all_to_all_single -> .tolist() (host sync)
    -> tokens all_to_all_single -> sort by local expert, pad groups to 16 rows
    -> torch._grouped_mm gate|up -> SwiGLU -> torch._grouped_mm down
    -> unpad/unsort -> all_to_all_single back -> weighted sum over slots (fixed order)
    shared expert: plain matmuls.

Same inputs and outputs as a ``mok_torch.Layer`` step (x [T, H] bf16, topk_ids [T, k] int64
with -1 masked, router_weights [T, k] f32, weights bf16 of this rank's experts). Deterministic:
the weighted sum is a fixed-order reduction, no index_add_ / atomics.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

ALIGN = 16          # torch._grouped_mm wants group offsets in multiples of 16 rows


def _swiglu(g, u, limit):
    if limit is not None:
        g = torch.clamp(g, max=limit)
        u = torch.clamp(u, -limit, limit)
    return F.silu(g) * u


class TorchNativeEP:
    """Holds the concatenated gate|up weights once (as a training framework would)."""

    def __init__(self, w_shared_gate, w_shared_up, w_shared_down, w_gate, w_up, w_down,
                 group=None):
        self.group = group
        self.shared = (w_shared_gate, w_shared_up, w_shared_down)
        self.w_gu_t = torch.cat([w_gate, w_up], dim=1).transpose(1, 2)    # [E, H, 2I] view
        self.w_d_t = w_down.transpose(1, 2)                                 # [E, I, H] view
        self.E_local = w_gate.shape[0]
        self.I = w_gate.shape[1]

    def forward(self, x, topk_ids, router_weights, swiglu_limit=None):
        T, H = x.shape
        k = topk_ids.shape[1]
        R = dist.get_world_size(self.group)
        E_l, I = self.E_local, self.I
        sg, su, sd = self.shared
        y_shared = _swiglu(x @ sg.T, x @ su.T, swiglu_limit) @ sd.T

        flat = topk_ids.reshape(-1)
        valid = flat >= 0
        dest = torch.where(valid, flat // E_l, torch.full_like(flat, R))
        order = torch.argsort(dest, stable=True)
        send_counts = torch.bincount(dest, minlength=R + 1)[:R]
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send_split = send_counts.tolist()                      # host syncs, as torch EP does
        recv_split = recv_counts.tolist()
        n_send, n_recv = sum(send_split), sum(recv_split)
        routed = order[:n_send]
        send_x = x[routed // k]
        send_e = (flat[routed] % E_l).to(torch.int32)
        recv_x = x.new_empty(n_recv, H)
        recv_e = send_e.new_empty(n_recv)
        dist.all_to_all_single(recv_x, send_x, recv_split, send_split, group=self.group)
        dist.all_to_all_single(recv_e, send_e, recv_split, send_split, group=self.group)

        # Sort received rows by local expert; pad each group to ALIGN rows for grouped_mm.
        perm = torch.argsort(recv_e, stable=True)
        counts = torch.bincount(recv_e.long(), minlength=E_l)
        padded = (counts + ALIGN - 1) // ALIGN * ALIGN
        start = torch.cumsum(counts, 0) - counts
        pstart = torch.cumsum(padded, 0) - padded
        e_sorted = recv_e[perm].long()
        dst = pstart[e_sorted] + torch.arange(n_recv, device=x.device) - start[e_sorted]
        rows = n_recv + ALIGN * E_l
        xs = x.new_zeros(rows, H)
        xs[dst] = recv_x[perm]
        offs = torch.cumsum(padded, 0).to(torch.int32)
        gu = torch._grouped_mm(xs, self.w_gu_t, offs=offs)
        h = _swiglu(gu[:, :I], gu[:, I:], swiglu_limit)
        ys = torch._grouped_mm(h, self.w_d_t, offs=offs)
        y_recv = torch.empty_like(recv_x)
        y_recv[perm] = ys[dst]

        back = x.new_empty(n_send, H)
        dist.all_to_all_single(back, y_recv, send_split, recv_split, group=self.group)
        per_slot = x.new_zeros(T * k, H)
        per_slot[routed] = back
        w = torch.where(topk_ids >= 0, router_weights, torch.zeros_like(router_weights))
        out = y_shared.float() + (w.unsqueeze(-1) * per_slot.view(T, k, H).float()).sum(1)
        return out.to(torch.bfloat16)
