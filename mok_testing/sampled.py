"""float64 reference of the layer for *sampled* tokens, in torch (on the GPU when there is one).

``mok_core.reference`` is the ground truth (NumPy, all tokens); at real shapes (thousands of
tokens, hundreds of 7168 x 2048 experts) it would take hours on a CPU, so large runs check a
sample of tokens with the same math here. ``tests/test_torch_adapter.py`` checks this module
against ``mok_core.reference`` on small shapes.
"""
from __future__ import annotations

import torch


def _act(g, u, limit):
    if limit is not None:
        g = torch.clamp(g, max=limit)
        u = torch.clamp(u, -limit, limit)
    return torch.nn.functional.silu(g) * u


def reference_tokens(x, topk_ids, router_weights, shared, expert_weight_fn, swiglu_limit=None):
    """out[n] = y_shared + sum_j w_j * y_j for n sampled tokens, float64.

    Arguments:
        x: [n, H] (any float dtype); topk_ids: [n, k] global expert ids, -1 masked;
        router_weights: [n, k]; shared: (w_gate [I_s, H], w_up [I_s, H], w_down [H, I_s]) or
        None; expert_weight_fn(e) -> (w_gate [I, H], w_up [I, H], w_down [H, I]).
    Returns:
        [n, H] float64.
    """
    xd = x.double()
    out = torch.zeros_like(xd)
    if shared is not None:
        sg, su, sd = (w.double() for w in shared)
        out += _act(xd @ sg.T, xd @ su.T, swiglu_limit) @ sd.T
    for (wg, wu, wd), n, j in _routes(topk_ids, expert_weight_fn):
        y = _act(xd[n] @ wg.T, xd[n] @ wu.T, swiglu_limit) @ wd.T
        out[n] += float(router_weights[n, j]) * y
    return out


def _routes(topk_ids, expert_weight_fn):
    """(float64 weights of the route's expert, token n, slot j) for every unmasked route,
    expert by expert (each expert's weights converted once)."""
    ids = topk_ids.tolist()
    for e in sorted({e for row in ids for e in row if e >= 0}):
        weights = tuple(w.double() for w in expert_weight_fn(e))
        for n, row in enumerate(ids):
            for j, ej in enumerate(row):
                if ej == e:
                    yield weights, n, j


def _act_grads(g, u, d_h, limit):
    """(h, d_g, d_u) of the SwiGLU at pre-activations g, u given d_h (clamp as torch's)."""
    gc, uc = g, u
    if limit is not None:
        gc, uc = torch.clamp(g, max=limit), torch.clamp(u, -limit, limit)
    s = torch.sigmoid(gc)
    d_g = d_h * uc * s * (1 + gc * (1 - s))
    d_u = d_h * gc * s
    if limit is not None:
        d_g = torch.where(g <= limit, d_g, torch.zeros_like(d_g))
        d_u = torch.where((u >= -limit) & (u <= limit), d_u, torch.zeros_like(d_u))
    return gc * s * uc, d_g, d_u


def reference_token_grads(x, topk_ids, router_weights, d_out, shared, expert_weight_fn,
                          swiglu_limit=None):
    """(d_x [n, H], d_router_weights [n, k]) of n sampled tokens, float64 (arguments as
    ``reference_tokens``, d_out [n, H] their output gradients)."""
    xd, dd = x.double(), d_out.double()
    d_x = torch.zeros_like(xd)
    d_w = torch.zeros(topk_ids.shape, dtype=torch.float64, device=x.device)
    if shared is not None:
        sg, su, sd = (w.double() for w in shared)
        _, d_g, d_u = _act_grads(xd @ sg.T, xd @ su.T, dd @ sd, swiglu_limit)
        d_x += d_g @ sg + d_u @ su
    for (wg, wu, wd), n, j in _routes(topk_ids, expert_weight_fn):
        p = dd[n] @ wd
        h, d_g, d_u = _act_grads(xd[n] @ wg.T, xd[n] @ wu.T, float(router_weights[n, j]) * p,
                                 swiglu_limit)
        d_w[n, j] = p @ h
        d_x[n] += d_g @ wg + d_u @ wu
    return d_x, d_w


def reference_weight_grads(x, d_out, scale, weights, cols, swiglu_limit=None):
    """Sampled entries of one expert's weight gradients, float64: the rows ``cols`` of
    dW_gate / dW_up and the columns ``cols`` of dW_down (intermediate columns), summed over the
    expert's n rows: x [n, H] its tokens, d_out [n, H] their output gradients, scale [n] the
    routes' router weights (ones for the shared expert), weights (w_gate, w_up, w_down)."""
    wg, wu, wd = (w.double() for w in weights)
    xd, dd = x.double(), d_out.double()
    g, u = xd @ wg[cols].T, xd @ wu[cols].T                  # [n, c]
    w = scale.double()[:, None]
    h, d_g, d_u = _act_grads(g, u, w * (dd @ wd[:, cols]), swiglu_limit)
    return d_g.T @ xd, d_u.T @ xd, (w * dd).T @ h


def _rel(got, want):
    return float((got.double() - want).abs().sum() / want.abs().sum())


def _cosine(got, want):
    got = got.double()
    return float((got * want).sum() / (got.norm() * want.norm()))


def covering_tokens(topk_ids, samples):
    """``samples`` evenly spaced tokens and, in token order, each token that routes to an
    expert none of those before it reaches: a float64 check of them sees every expert these
    tokens reach, so a defect confined to one expert's rows cannot fall between the samples
    (a rank's thousands of tokens reach them all; two dozen evenly spaced ones miss a third to
    a half of 256-512 experts) -> int64 indices, ascending, on ``topk_ids``' device.
    (Test code: reads the ids back to the host.)"""
    ids = topk_ids.tolist()
    T = len(ids)
    pick = set(torch.linspace(0, T - 1, samples).long().tolist()) if T else set()
    seen = {e for t in pick for e in ids[t]}
    for t, row in enumerate(ids):
        new = set(row) - seen
        if new - {-1}:
            pick.add(t)
            seen |= new
    return torch.tensor(sorted(pick), dtype=torch.int64, device=topk_ids.device)


def grad_errors(inputs, d_outs, rank, grads, shared, expert_weight_fn, experts_per_rank,
                swiglu_limit=None, samples=16, measure="rel_l1"):
    """rel-L1 (``measure="cosine"``: the cosine similarity) of a rank's 8 gradients against
    float64, by name, on samples: d_x and the router weights' gradient of the rank's
    ``covering_tokens``, the weight gradients of every one of the rank's experts that has rows
    (every rank's tokens routed to it; each name's worst over them: the largest rel-L1, the
    least cosine) and of the shared expert, on ``samples`` intermediate columns.

    Arguments:
        inputs: every rank's (x [T, H], topk_ids [T, k], router_weights [T, k]); d_outs: every
            rank's d_out [T, H]; grads: the rank's gradients in ``Grads`` order (d_x,
            d_router_weights, d_w_shared_gate, d_w_shared_up, d_w_shared_down, d_w_gate,
            d_w_up, d_w_down; shared ones None without a shared expert); shared and
            expert_weight_fn as in ``reference_tokens``.
    """
    if measure not in ("rel_l1", "cosine"):
        raise ValueError(f"measure={measure!r}: 'rel_l1' or 'cosine'")
    compare = _rel if measure == "rel_l1" else _cosine
    d_x, d_rw, g_sg, g_su, g_sd, g_g, g_u, g_d = grads
    x, ids, w = inputs[rank]
    d_out = d_outs[rank]
    T, dev = x.shape[0], x.device
    if (shared is None) != (g_sg is None):
        raise ValueError(f"grad_errors: the shared expert's weights are "
                         f"{'absent' if shared is None else 'given'}, but its gradients "
                         f"{'are not' if g_sg is None else 'are'}")
    pick = covering_tokens(ids, samples)
    ref_dx, ref_dw = reference_token_grads(x[pick], ids[pick], w[pick], d_out[pick], shared,
                                           expert_weight_fn, swiglu_limit)
    errs = {"d_x": compare(d_x[pick], ref_dx), "d_router_weights": compare(d_rw[pick], ref_dw)}
    E_l, I = g_g.shape[0], g_g.shape[1]
    cols = torch.linspace(0, I - 1, samples, device=dev).long()
    all_ids = torch.stack([i for _, i, _ in inputs])                      # [R, T, k]
    valid = all_ids[all_ids >= 0].flatten()
    counts = torch.bincount(valid, minlength=len(inputs) * experts_per_rank)
    pick_worse = max if measure == "rel_l1" else min

    def worst(a, b):                     # a NaN stays (max and min would drop one that follows)
        return a if a != a else b if b != b else pick_worse(a, b)
    for j, n_rows in enumerate(counts[rank * E_l:(rank + 1) * E_l].tolist()):
        if not n_rows:                   # no rows: a zero gradient, exactly
            for name, g in (("d_w_gate", g_g[j]), ("d_w_up", g_u[j]), ("d_w_down", g_d[j])):
                assert not g.any(), f"{name}[{j}]: expert {rank * E_l + j} has no rows, " \
                                    "but its gradient is not zero"
            continue
        e = rank * E_l + j
        routes = [(a, *torch.nonzero(all_ids[a] == e, as_tuple=True))
                  for a in range(len(inputs))]
        xs = torch.cat([inputs[a][0][t] for a, t, _ in routes])
        ds = torch.cat([d_outs[a][t] for a, t, _ in routes])
        sc = torch.cat([inputs[a][2][t, s] for a, t, s in routes])
        rg, ru, rd = reference_weight_grads(xs, ds, sc, expert_weight_fn(e), cols, swiglu_limit)
        for name, got, want in (("d_w_gate", g_g[j][cols], rg), ("d_w_up", g_u[j][cols], ru),
                                ("d_w_down", g_d[j][:, cols], rd)):
            err = compare(got, want)
            errs[name] = worst(errs.get(name, err), err)
    if shared is not None:
        cs = torch.linspace(0, shared[0].shape[0] - 1, samples, device=dev).long()
        rg, ru, rd = reference_weight_grads(x, d_out, torch.ones(T, device=dev), shared, cs,
                                            swiglu_limit)
        errs["d_w_shared_gate"] = compare(g_sg[cs], rg)
        errs["d_w_shared_up"] = compare(g_su[cs], ru)
        errs["d_w_shared_down"] = compare(g_sd[:, cs], rd)
    return errs
