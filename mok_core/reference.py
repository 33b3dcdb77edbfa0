"""
Float64 NumPy reference for a DeepSeek-V3-style mixture-of-experts layer.

This module is the numerical ground truth that the optimised kernels are
tested against. It favours clarity and exactness (everything in float64) over
speed, but still loops over experts rather than tokens so that it stays usable
for a few thousand tokens.

Math
----
For a token ``x_t`` (a row of ``x``, length H) routed to experts
``e_1 .. e_k`` with router weights ``w_1 .. w_k``::

    act(g, u)  = SiLU(g') * u'                 SiLU(z) = z * sigmoid(z)
                 g' = min(g, L), u' = clip(u, -L, +L)   if swiglu_limit L is set
                 g' = g,         u' = u                 otherwise

    shared:     g_s = x_t W_sg^T,  u_s = x_t W_su^T,  y_s = act(g_s, u_s) W_sd^T
    routed j:   g_j = x_t W_g[e_j]^T,  u_j = x_t W_u[e_j]^T,
                y_j = act(g_j, u_j) W_d[e_j]^T

    out_t = y_s + sum_j w_j * y_j

A route whose expert id is ``-1`` is masked: it contributes nothing to the
output and receives a zero router-weight gradient. The shared expert is always
applied and is not weighted.

Backward (``d_out`` is the gradient of the loss w.r.t. ``out``)::

    d_w_j      = <d_out_t, y_j>                       (0 for masked routes)
    d_y_j      = w_j * d_out_t
    d_h_j      = d_y_j W_d[e_j]
    d_W_d[e]  += d_y_j^T h_j
    d_g_j, d_u_j = swiglu_backward(g_j, u_j, d_h_j)
    d_W_g[e]  += d_g_j^T x_t,   d_W_u[e] += d_u_j^T x_t
    d_x_t     += d_g_j W_g[e_j] + d_u_j W_u[e_j]      (and likewise for shared)

The clamp passes gradient exactly like ``torch.clamp``'s autograd: through
where ``lower <= v <= upper`` (equality included), zero where it was active.

Shapes: N tokens (the concatenation of all ranks' tokens -- expert parallelism
changes where work happens, not the math), H hidden, I routed intermediate,
I_s shared intermediate, E global experts, k top-k. Weights are stored
``nn.Linear``-style (``[out_features, in_features]``).
"""

from __future__ import annotations

import numbers
from typing import NamedTuple, Optional, Tuple

import numpy as np

__all__ = ["swiglu", "swiglu_backward", "moe_forward", "moe_forward_detailed", "moe_backward",
           "ForwardIntermediates", "MoEGrads"]


class ForwardIntermediates(NamedTuple):
    """
    Forward results of `moe_forward_detailed`, all `np.float64`.

    Fields:
        out: `[N, H]`, the layer output `y_shared + sum_j w_j * y_routed[:, j]`.
        y_shared: `[N, H]`, the shared-expert output (unweighted).
        y_routed: `[N, k, H]`, the unweighted output of each routed slot; zeros on masked routes.
        gate_shared: `[N, I_s]`, the shared-expert gate projection before activation.
        up_shared: `[N, I_s]`, the shared-expert up projection before activation.
        hidden_shared: `[N, I_s]`, `swiglu(gate_shared, up_shared)`.
    """

    out: np.ndarray
    y_shared: np.ndarray
    y_routed: np.ndarray
    gate_shared: np.ndarray
    up_shared: np.ndarray
    hidden_shared: np.ndarray


class MoEGrads(NamedTuple):
    """
    Gradients returned by `moe_backward`, all `np.float64`, each shaped like the input it belongs to.

    Fields:
        d_x: `[N, H]`.
        d_router_weights: `[N, k]`, `<d_out[t], y_routed[t, j]>`; zero on masked routes.
        d_w_gate: `[E, I, H]`; zero for experts that received no tokens.
        d_w_up: `[E, I, H]`; zero for experts that received no tokens.
        d_w_down: `[E, H, I]`; zero for experts that received no tokens.
        d_w_shared_gate: `[I_s, H]`.
        d_w_shared_up: `[I_s, H]`.
        d_w_shared_down: `[H, I_s]`.
    """

    d_x: np.ndarray
    d_router_weights: np.ndarray
    d_w_gate: np.ndarray
    d_w_up: np.ndarray
    d_w_down: np.ndarray
    d_w_shared_gate: np.ndarray
    d_w_shared_up: np.ndarray
    d_w_shared_down: np.ndarray


# --------------------------------------------------------------------------- #
# Activation
# --------------------------------------------------------------------------- #


def _check_limit(swiglu_limit) -> Optional[float]:
    if swiglu_limit is None:
        return None
    # bool is an Integral; a limit of True/False is certainly a caller bug.
    if isinstance(swiglu_limit, bool) or not isinstance(swiglu_limit, numbers.Real):
        raise ValueError(f"swiglu_limit must be a positive real number or None, got {swiglu_limit!r}")
    limit = float(swiglu_limit)
    # `not limit > 0` also rejects NaN, which would otherwise silently disable the clamp.
    if not limit > 0:
        raise ValueError(f"swiglu_limit must be > 0, got {swiglu_limit!r}")
    return limit


def _sigmoid(z: np.ndarray) -> np.ndarray:
    # Evaluate through exp(-|z|) so that large-magnitude inputs never overflow.
    e = np.exp(-np.abs(z))
    r = 1.0 / (1.0 + e)
    return np.where(z >= 0, r, e * r)


def _clamp(gate: np.ndarray, up: np.ndarray, limit: Optional[float]) -> Tuple[np.ndarray, np.ndarray]:
    if limit is None:
        return gate, up
    # The gate is only bounded above: SiLU already saturates to 0 for very negative inputs.
    return np.minimum(gate, limit), np.clip(up, -limit, limit)


def swiglu(gate, up, swiglu_limit: Optional[float] = None) -> np.ndarray:
    """
    SwiGLU activation `SiLU(gate') * up'` with the optional DeepSeek-style clamp.

    Arguments:
        gate: `[..., I]`, any float dtype, the gate projection.
        up: `[..., I]`, same shape as `gate`, the up projection.
        swiglu_limit: `None` (no clamp) or a float `L > 0`; then `gate' = min(gate, L)`
            and `up' = clip(up, -L, L)`.

    Returns:
        hidden: `[..., I]`, `np.float64`.
    """
    limit = _check_limit(swiglu_limit)
    gate = _as_f64("gate", gate)
    up = _as_f64("up", up)
    if gate.shape != up.shape:
        raise ValueError(f"gate and up must have the same shape, got {gate.shape} and {up.shape}")
    g, u = _clamp(gate, up, limit)
    return g * _sigmoid(g) * u


def swiglu_backward(gate, up, d_h, swiglu_limit: Optional[float] = None) -> Tuple[np.ndarray, np.ndarray]:
    """
    Gradient of `swiglu` w.r.t. its two inputs.

    The clamp passes gradient like `torch.clamp`'s autograd: where
    `lower <= v <= upper` (equality included) and zero where the clamp was active.

    Arguments:
        gate: `[..., I]`, any float dtype, the (unclamped) gate projection.
        up: `[..., I]`, same shape, the (unclamped) up projection.
        d_h: `[..., I]`, same shape, the gradient w.r.t. the activation output.
        swiglu_limit: `None` or a float `L > 0`, as in `swiglu`.

    Returns:
        d_gate: `[..., I]`, `np.float64`.
        d_up: `[..., I]`, `np.float64`.
    """
    limit = _check_limit(swiglu_limit)
    gate = _as_f64("gate", gate)
    up = _as_f64("up", up)
    d_h = _as_f64("d_h", d_h)
    if not (gate.shape == up.shape == d_h.shape):
        raise ValueError(
            f"gate, up and d_h must have the same shape, got {gate.shape}, {up.shape} and {d_h.shape}"
        )
    _, d_gate, d_up = _swiglu_fwd_bwd(gate, up, d_h, limit)
    return d_gate, d_up


def _swiglu_fwd_bwd(
    gate: np.ndarray, up: np.ndarray, d_h: np.ndarray, limit: Optional[float]
) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    # Fused so the backward pass evaluates the sigmoid once for both the recomputed
    # activation and its derivative; inputs must already be validated float64 arrays.
    g, u = _clamp(gate, up, limit)
    s = _sigmoid(g)
    silu = g * s
    hidden = silu * u
    # d/dz [z * sigmoid(z)] = s + z * s * (1 - s)
    d_gate = d_h * u * (s * (1.0 + g * (1.0 - s)))
    d_up = d_h * silu
    if limit is not None:
        d_gate = np.where(gate <= limit, d_gate, 0.0)
        d_up = np.where((up >= -limit) & (up <= limit), d_up, 0.0)
    return hidden, d_gate, d_up


# --------------------------------------------------------------------------- #
# Validation
# --------------------------------------------------------------------------- #


def _as_f64(name: str, a) -> np.ndarray:
    arr = np.asarray(a)
    # Complex values would lose their imaginary part silently in astype.
    if arr.dtype.kind == "c":
        raise ValueError(f"{name} must be real-valued, got dtype {arr.dtype}")
    try:
        # astype (rather than asarray(dtype=...)) also handles ml_dtypes such as bfloat16.
        return arr.astype(np.float64, copy=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} could not be converted to float64 (dtype {arr.dtype})") from exc


class _Inputs(NamedTuple):
    x: np.ndarray
    router_weights: np.ndarray
    topk_ids: np.ndarray
    w_shared_gate: np.ndarray
    w_shared_up: np.ndarray
    w_shared_down: np.ndarray
    w_gate: np.ndarray
    w_up: np.ndarray
    w_down: np.ndarray
    swiglu_limit: Optional[float]
    d_out: Optional[np.ndarray]


def _validate(
    x,
    router_weights,
    topk_ids,
    w_shared_gate,
    w_shared_up,
    w_shared_down,
    w_gate,
    w_up,
    w_down,
    swiglu_limit,
    d_out=None,
    need_d_out: bool = False,
) -> _Inputs:
    """Convert every input to its canonical dtype and reject anything malformed, naming the argument."""
    limit = _check_limit(swiglu_limit)

    floats = {
        "x": x,
        "router_weights": router_weights,
        "w_shared_gate": w_shared_gate,
        "w_shared_up": w_shared_up,
        "w_shared_down": w_shared_down,
        "w_gate": w_gate,
        "w_up": w_up,
        "w_down": w_down,
    }
    if need_d_out:
        floats["d_out"] = d_out
    arrs = {name: _as_f64(name, a) for name, a in floats.items()}

    ndims = {
        "x": 2,
        "router_weights": 2,
        "w_shared_gate": 2,
        "w_shared_up": 2,
        "w_shared_down": 2,
        "w_gate": 3,
        "w_up": 3,
        "w_down": 3,
        "d_out": 2,
    }
    for name, arr in arrs.items():
        if arr.ndim != ndims[name]:
            raise ValueError(f"{name} must be {ndims[name]}-D, got shape {arr.shape}")

    ids = np.asarray(topk_ids)
    # Float ids are rejected rather than rounded: they usually mean arguments were swapped.
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"topk_ids must have an integer dtype, got {ids.dtype}")
    if ids.ndim != 2:
        raise ValueError(f"topk_ids must be 2-D [N, k], got shape {ids.shape}")

    n, h = arrs["x"].shape
    _, k = ids.shape
    e, i = arrs["w_gate"].shape[:2]
    i_s = arrs["w_shared_gate"].shape[0]

    expected = {
        "router_weights": (n, k),
        "w_shared_gate": (i_s, h),
        "w_shared_up": (i_s, h),
        "w_shared_down": (h, i_s),
        "w_gate": (e, i, h),
        "w_up": (e, i, h),
        "w_down": (e, h, i),
        "d_out": (n, h),
    }
    if ids.shape[0] != n:
        raise ValueError(f"topk_ids must have shape [N={n}, k], got {ids.shape}")
    for name, arr in arrs.items():
        if name in expected and arr.shape != expected[name]:
            raise ValueError(
                f"{name} has shape {arr.shape}, expected {expected[name]} "
                f"(N={n}, H={h}, k={k}, E={e}, I={i}, I_s={i_s})"
            )

    if ids.size:
        # Compare before casting so unsigned/huge values cannot wrap into range.
        if (ids < -1).any():
            raise ValueError(f"topk_ids must be >= -1 (-1 masks a route), got min {ids.min()}")
        if (ids >= e).any():
            raise ValueError(f"topk_ids must be < E={e}, got max {ids.max()}")
    ids = ids.astype(np.int64, copy=False)

    for name, arr in arrs.items():
        if not np.isfinite(arr).all():
            raise ValueError(f"{name} contains non-finite values (NaN or Inf)")

    return _Inputs(
        x=arrs["x"],
        router_weights=arrs["router_weights"],
        topk_ids=ids,
        w_shared_gate=arrs["w_shared_gate"],
        w_shared_up=arrs["w_shared_up"],
        w_shared_down=arrs["w_shared_down"],
        w_gate=arrs["w_gate"],
        w_up=arrs["w_up"],
        w_down=arrs["w_down"],
        swiglu_limit=limit,
        d_out=arrs.get("d_out"),
    )


def _group_by_expert(topk_ids: np.ndarray, num_experts: int):
    """Yield `(expert, token_idx, slot_idx)` for every expert with at least one unmasked route."""
    k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    valid = np.flatnonzero(flat >= 0)
    # A stable sort keeps each expert's routes in token order, so results are deterministic.
    order = valid[np.argsort(flat[valid], kind="stable")]
    counts = np.bincount(flat[valid], minlength=num_experts)
    bounds = np.concatenate(([0], np.cumsum(counts)))
    for expert in np.flatnonzero(counts):
        pairs = order[bounds[expert] : bounds[expert + 1]]
        yield int(expert), pairs // k, pairs % k


# --------------------------------------------------------------------------- #
# Forward
# --------------------------------------------------------------------------- #


def moe_forward_detailed(
    x,
    router_weights,
    topk_ids,
    w_shared_gate,
    w_shared_up,
    w_shared_down,
    w_gate,
    w_up,
    w_down,
    swiglu_limit: Optional[float] = None,
) -> ForwardIntermediates:
    """
    MoE forward pass that also returns the per-slot and shared-expert intermediates.

    Arguments:
        x: `[N, H]`, any float dtype, the tokens of all ranks concatenated.
        router_weights: `[N, k]`, any float dtype, the weight of each routed slot.
        topk_ids: `[N, k]`, integer dtype, global expert ids in `[0, E)`, or `-1` for a masked route.
        w_shared_gate: `[I_s, H]`, any float dtype.
        w_shared_up: `[I_s, H]`, any float dtype.
        w_shared_down: `[H, I_s]`, any float dtype.
        w_gate: `[E, I, H]`, any float dtype.
        w_up: `[E, I, H]`, any float dtype.
        w_down: `[E, H, I]`, any float dtype.
        swiglu_limit: `None` or a float `L > 0` (see `swiglu`).

    Returns:
        intermediates: a `ForwardIntermediates` of `np.float64` arrays
            (`out` `[N, H]`, `y_shared` `[N, H]`, `y_routed` `[N, k, H]`,
            `gate_shared`, `up_shared`, `hidden_shared` `[N, I_s]`).

    Raises:
        ValueError: on shape mismatches, non-integer or out-of-range `topk_ids`,
            non-finite inputs, or `swiglu_limit <= 0`.
    """
    p = _validate(
        x, router_weights, topk_ids, w_shared_gate, w_shared_up, w_shared_down, w_gate, w_up, w_down, swiglu_limit
    )
    n, h = p.x.shape
    k = p.topk_ids.shape[1]

    gate_s = p.x @ p.w_shared_gate.T
    up_s = p.x @ p.w_shared_up.T
    hidden_s = swiglu(gate_s, up_s, p.swiglu_limit)
    y_shared = hidden_s @ p.w_shared_down.T

    # Each (token, slot) pair is written exactly once, so plain fancy-index assignment is
    # safe even if a token lists the same expert twice.
    y_routed = np.zeros((n, k, h), dtype=np.float64)
    for expert, tok, slot in _group_by_expert(p.topk_ids, p.w_gate.shape[0]):
        xe = p.x[tok]
        hidden = swiglu(xe @ p.w_gate[expert].T, xe @ p.w_up[expert].T, p.swiglu_limit)
        y_routed[tok, slot] = hidden @ p.w_down[expert].T

    # Masked slots hold zeros in y_routed, so their (finite) router weight cannot leak in.
    out = y_shared + np.einsum("nk,nkh->nh", p.router_weights, y_routed)
    return ForwardIntermediates(
        out=out,
        y_shared=y_shared,
        y_routed=y_routed,
        gate_shared=gate_s,
        up_shared=up_s,
        hidden_shared=hidden_s,
    )


def moe_forward(
    x,
    router_weights,
    topk_ids,
    w_shared_gate,
    w_shared_up,
    w_shared_down,
    w_gate,
    w_up,
    w_down,
    swiglu_limit: Optional[float] = None,
) -> np.ndarray:
    """
    MoE forward pass: `out = shared(x) + sum_j router_weights[:, j] * expert_{topk_ids[:, j]}(x)`.

    Arguments and errors as `moe_forward_detailed`; returns its `out` (`[N, H]`, `np.float64`).
    """
    return moe_forward_detailed(
        x, router_weights, topk_ids, w_shared_gate, w_shared_up, w_shared_down, w_gate, w_up, w_down, swiglu_limit
    ).out


# --------------------------------------------------------------------------- #
# Backward
# --------------------------------------------------------------------------- #


def moe_backward(
    d_out,
    x,
    router_weights,
    topk_ids,
    w_shared_gate,
    w_shared_up,
    w_shared_down,
    w_gate,
    w_up,
    w_down,
    swiglu_limit: Optional[float] = None,
) -> MoEGrads:
    """
    Gradients of the MoE layer w.r.t. every input, given the gradient of its output.

    Intermediates are recomputed from the inputs, so no forward state is needed.

    Arguments:
        d_out: `[N, H]`, any float dtype, the gradient w.r.t. `moe_forward`'s output; the rest
            as `moe_forward_detailed`.

    Returns:
        grads: a `MoEGrads` of `np.float64` arrays, each shaped like its input. Masked routes get
            a zero router-weight gradient; experts that received no tokens get zero weight gradients.

    Raises:
        ValueError: on shape mismatches, non-integer or out-of-range `topk_ids`,
            non-finite inputs (including `d_out`), or `swiglu_limit <= 0`.
    """
    p = _validate(
        x,
        router_weights,
        topk_ids,
        w_shared_gate,
        w_shared_up,
        w_shared_down,
        w_gate,
        w_up,
        w_down,
        swiglu_limit,
        d_out=d_out,
        need_d_out=True,
    )
    n = p.x.shape[0]
    k = p.topk_ids.shape[1]
    d_out = p.d_out

    # Shared expert: its output enters `out` with weight 1.
    gate_s = p.x @ p.w_shared_gate.T
    up_s = p.x @ p.w_shared_up.T
    hidden_s, d_gate_s, d_up_s = _swiglu_fwd_bwd(gate_s, up_s, d_out @ p.w_shared_down, p.swiglu_limit)
    d_w_shared_down = d_out.T @ hidden_s
    d_w_shared_gate = d_gate_s.T @ p.x
    d_w_shared_up = d_up_s.T @ p.x
    d_x = d_gate_s @ p.w_shared_gate + d_up_s @ p.w_shared_up

    d_router_weights = np.zeros((n, k), dtype=np.float64)
    d_w_gate = np.zeros_like(p.w_gate)
    d_w_up = np.zeros_like(p.w_up)
    d_w_down = np.zeros_like(p.w_down)

    for expert, tok, slot in _group_by_expert(p.topk_ids, p.w_gate.shape[0]):
        xe = p.x[tok]
        d_out_e = d_out[tok]
        # <d_out, h W_d^T> == <d_out W_d, h>: reusing proj = d_out W_d for both the router-weight
        # gradient and d_h saves recomputing the expert output y.
        proj = d_out_e @ p.w_down[expert]
        rw = p.router_weights[tok, slot][:, None]
        hidden, d_gate, d_up = _swiglu_fwd_bwd(
            xe @ p.w_gate[expert].T, xe @ p.w_up[expert].T, rw * proj, p.swiglu_limit
        )
        d_router_weights[tok, slot] = np.einsum("ni,ni->n", proj, hidden)
        d_w_down[expert] = (rw * d_out_e).T @ hidden
        d_w_gate[expert] = d_gate.T @ xe
        d_w_up[expert] = d_up.T @ xe
        d_xe = d_gate @ p.w_gate[expert] + d_up @ p.w_up[expert]
        # Tokens come out of _group_by_expert sorted, so a repeat can only be adjacent. Repeats
        # (a token listing this expert twice) need the unbuffered add.at, or contributions are lost.
        if tok.size > 1 and (tok[1:] == tok[:-1]).any():
            np.add.at(d_x, tok, d_xe)
        else:
            d_x[tok] += d_xe

    return MoEGrads(
        d_x=d_x,
        d_router_weights=d_router_weights,
        d_w_gate=d_w_gate,
        d_w_up=d_w_up,
        d_w_down=d_w_down,
        d_w_shared_gate=d_w_shared_gate,
        d_w_shared_up=d_w_shared_up,
        d_w_shared_down=d_w_shared_down,
    )
