"""Baseline: expert-parallel MoE forward as torch users write it today (torchtitan style).

    route -> sort by destination rank -> counts all_to_all_single -> .tolist() (host sync)
    -> tokens all_to_all_single -> sort by local expert, pad groups to 16 rows
    -> torch._grouped_mm gate|up -> SwiGLU -> torch._grouped_mm down
    -> unpad/unsort -> all_to_all_single back -> weighted sum over slots (fixed order)
    shared expert: plain matmuls.

Same inputs and outputs as a ``mok_torch.Layer`` step (x [T, H] bf16, topk_ids [T, k] int64
with -1 masked, router_weights [T, k] f32, weights bf16 of this rank's experts). Deterministic:
the weighted sum is a fixed-order reduction, no index_add_ / atomics.

Training: ``trainable()`` makes the weights autograd leaves as a framework holds them (the
routed gate|up concatenated, [E, 2I, H]); with grad enabled the exchanges are
``all_to_all_single_autograd`` (torch's differentiable functional collective), so ``out.backward``
gives every gradient by torch autograd (``grads`` reads them in ``mok_torch.Grads`` order).
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


def _exchange(out, inp, out_split, in_split, group):
    """all_to_all_single, differentiable when autograd records ``inp``."""
    if torch.is_grad_enabled() and inp.requires_grad:
        from torch.distributed._functional_collectives import all_to_all_single_autograd
        return all_to_all_single_autograd(inp, out_split, in_split,
                                          group if group is not None else dist.group.WORLD)
    dist.all_to_all_single(out, inp, out_split, in_split, group=group)
    return out


class TorchNativeEP:
    """Holds the concatenated gate|up weights once (as a training framework would)."""

    def __init__(self, w_shared_gate, w_shared_up, w_shared_down, w_gate, w_up, w_down,
                 group=None):
        self.group = group
        self.shared = (w_shared_gate, w_shared_up, w_shared_down)
        self.w_gu = torch.cat([w_gate, w_up], dim=1)                       # [E, 2I, H]
        self.w_d = w_down
        self.E_local = w_gate.shape[0]
        self.I = w_gate.shape[1]

    @classmethod
    def concatenated(cls, shared, w_gu, w_down, group=None) -> "TorchNativeEP":
        """Over a model's own tensors, no copy: ``shared`` (gate, up, down), ``w_gu``
        [E_local, 2I, H] (gate rows then up rows), ``w_down`` [E_local, H, I]; autograd
        reaches them as they are."""
        self = cls.__new__(cls)
        self.group, self.shared, self.w_gu, self.w_d = group, tuple(shared), w_gu, w_down
        self.E_local, self.I = w_gu.shape[0], w_gu.shape[1] // 2
        return self

    @property
    def w_gu_t(self):
        return self.w_gu.transpose(1, 2)                                    # [E, H, 2I] view

    @property
    def w_d_t(self):
        return self.w_d.transpose(1, 2)                                     # [E, I, H] view

    def trainable(self):
        """Make the weights autograd leaves (requires_grad)."""
        self.shared = tuple(w.detach().requires_grad_() for w in self.shared)
        self.w_gu = self.w_gu.detach().requires_grad_()
        self.w_d = self.w_d.detach().requires_grad_()

    def zero_grad(self):
        for w in (*self.shared, self.w_gu, self.w_d):
            w.grad = None

    def grads(self, x, router_weights):
        """(d_x, d_router_weights, d_w_shared_gate, d_w_shared_up, d_w_shared_down, d_w_gate,
        d_w_up, d_w_down) after ``out.backward`` (x and router_weights: the leaves passed)."""
        I = self.I
        return (x.grad, router_weights.grad, *(w.grad for w in self.shared),
                self.w_gu.grad[:, :I], self.w_gu.grad[:, I:], self.w_d.grad)

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
        recv_x = _exchange(recv_x, send_x, recv_split, send_split, self.group)
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

        back = _exchange(x.new_empty(n_send, H), y_recv, send_split, recv_split, self.group)
        per_slot = x.new_zeros(T * k, H)
        per_slot[routed] = back
        w = torch.where(topk_ids >= 0, router_weights, torch.zeros_like(router_weights))
        out = y_shared.float() + (w.unsqueeze(-1) * per_slot.view(T, k, H).float()).sum(1)
        return out.to(torch.bfloat16)
