"""Deterministic synthetic layers and inputs for demos, tests and benchmarks at real shapes.

Every tensor comes from a torch generator seeded by (seed, what, index), so any rank can rebuild
any expert's weights -- what a float64 check of a sampled token needs when its experts live on
other ranks -- without ever holding all experts. Weights are scaled by fan-in^-1/2.
"""
from __future__ import annotations

import torch

from mok_core.config import LayerShape

_EXPERT, _SHARED, _TOKENS = 1, 2, 3


def _gen(device, seed, what, index):
    return torch.Generator(device=device).manual_seed((seed * 1000 + what) * 1_000_003 + index)


def expert_weights(shape: LayerShape, expert: int, device, seed: int = 0):
    """(w_gate [I, H], w_up [I, H], w_down [H, I]) bf16 of one global expert."""
    H, I = shape.hidden, shape.intermediate
    g = _gen(device, seed, _EXPERT, expert)
    wg = torch.randn(I, H, generator=g, device=device) * H ** -0.5
    wu = torch.randn(I, H, generator=g, device=device) * H ** -0.5
    wd = torch.randn(H, I, generator=g, device=device) * I ** -0.5
    return wg.bfloat16(), wu.bfloat16(), wd.bfloat16()


def local_expert_weights(shape: LayerShape, rank: int, device, seed: int = 0):
    """This rank's routed weights: [E_local, I, H] x2 and [E_local, H, I], bf16."""
    E_l, H, I = shape.experts_per_rank, shape.hidden, shape.intermediate
    wg = torch.empty(E_l, I, H, dtype=torch.bfloat16, device=device)
    wu = torch.empty_like(wg)
    wd = torch.empty(E_l, H, I, dtype=torch.bfloat16, device=device)
    for j in range(E_l):
        wg[j], wu[j], wd[j] = expert_weights(shape, rank * E_l + j, device, seed)
    return wg, wu, wd


def shared_weights(shape: LayerShape, device, seed: int = 0):
    """(w_shared_gate [I_s, H], w_shared_up [I_s, H], w_shared_down [H, I_s]) bf16."""
    H, I_s = shape.hidden, shape.shared_intermediate
    g = _gen(device, seed, _SHARED, 0)
    sg = torch.randn(I_s, H, generator=g, device=device) * H ** -0.5
    su = torch.randn(I_s, H, generator=g, device=device) * H ** -0.5
    sd = torch.randn(H, I_s, generator=g, device=device) * max(I_s, 1) ** -0.5
    return sg.bfloat16(), su.bfloat16(), sd.bfloat16()


def rank_inputs(shape: LayerShape, tokens: int, rank: int, device, seed: int = 0,
                skew: float = 0.0, masked: float = 0.0):
    """x [T, H] bf16, topk_ids [T, k] int64 (-1 for a ``masked`` fraction), router weights
    [T, k] float32 (softmax over the chosen experts' scores). ``skew`` > 0 favours
    low-numbered experts (score bias skew * -log(1 + e))."""
    E, k, H = shape.num_experts, shape.topk, shape.hidden
    g = _gen(device, seed, _TOKENS, rank)
    x = torch.randn(tokens, H, generator=g, device=device).bfloat16()
    scores = torch.randn(tokens, E, generator=g, device=device)
    if skew:
        scores = scores - skew * torch.log1p(torch.arange(E, device=device, dtype=torch.float32))
    top, ids = scores.topk(k, dim=1)
    weights = torch.softmax(top, dim=1).float()
    if masked:
        drop = torch.rand(tokens, k, generator=g, device=device) < masked
        ids = torch.where(drop, torch.full_like(ids, -1), ids)
    return x, ids, weights
