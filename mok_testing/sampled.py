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
    ids = topk_ids.tolist()
    for e in sorted({e for row in ids for e in row if e >= 0}):
        wg, wu, wd = (w.double() for w in expert_weight_fn(e))
        for n, row in enumerate(ids):
            for j, ej in enumerate(row):
                if ej == e:
                    y = _act(xd[n] @ wg.T, xd[n] @ wu.T, swiglu_limit) @ wd.T
                    out[n] += float(router_weights[n, j]) * y
    return out
