"""Inputs and reference for whole-layer tests (emulated ranks on the simulator, or GPUs)."""
import ml_dtypes
import numpy as np

from comm_support import make_routing


def bf16_round(a):
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16)


def layer_inputs(rng, shape, T, masked=0.1, skew=0.3, weight_scale=1.0):
    """Every rank's inputs (host): dict of bf16 arrays / ids / weights for the whole group."""
    R, H, I, I_s, E, k = (shape.ep_size, shape.hidden, shape.intermediate,
                          shape.shared_intermediate, shape.num_experts, shape.topk)
    ids = make_routing(rng, R, T, k, E, skew=skew, masked=masked)
    logits = rng.standard_normal((R, T, k)).astype(np.float32)
    w = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    return {
        "x": bf16_round(rng.standard_normal((R, T, H))),
        "ids": ids,
        "w": w.astype(np.float32),
        "w_sg": bf16_round(rng.standard_normal((I_s, H)) * weight_scale / np.sqrt(H)),
        "w_su": bf16_round(rng.standard_normal((I_s, H)) * weight_scale / np.sqrt(H)),
        "w_sd": bf16_round(rng.standard_normal((H, I_s)) / np.sqrt(max(I_s, 1))),
        "w_g": bf16_round(rng.standard_normal((E, I, H)) * weight_scale / np.sqrt(H)),
        "w_u": bf16_round(rng.standard_normal((E, I, H)) * weight_scale / np.sqrt(H)),
        "w_d": bf16_round(rng.standard_normal((E, H, I)) / np.sqrt(I)),
    }


def reference_out(inp, swiglu_limit=None):
    """float64 reference on all ranks' tokens -> [R, T, H]."""
    from mok_core.reference import moe_forward
    R, T, H = inp["x"].shape
    k = inp["ids"].shape[2]
    f = lambda a: np.asarray(a).astype(np.float64)  # noqa: E731
    out = moe_forward(f(inp["x"]).reshape(R * T, H), inp["w"].reshape(R * T, k).astype(np.float64),
                      inp["ids"].reshape(R * T, k), f(inp["w_sg"]), f(inp["w_su"]), f(inp["w_sd"]),
                      f(inp["w_g"]), f(inp["w_u"]), f(inp["w_d"]), swiglu_limit=swiglu_limit)
    return out.reshape(R, T, H)


def reference_out_fp8(inp, swiglu_limit=None):
    """float64 of what the FP8 layer computes, on all ranks' tokens -> [R, T, H]: the shared
    expert as ``reference_out``; each route's expert on the tokens and weights quantised as
    the layer quantises them (x 1 x 128, weights 128 x 128), h rounded to bf16 and quantised
    1 x 128 before the down GEMM -- so only the GEMMs' own arithmetic separates the two."""
    from mok_core.quantize_reference import dequantize_fp8, quantize_fp8_reference
    from mok_core.reference import moe_forward_detailed, swiglu
    R, T, H = inp["x"].shape
    k = inp["ids"].shape[2]
    f = lambda a: np.asarray(a).astype(np.float64)  # noqa: E731
    x = f(inp["x"]).reshape(R * T, H)
    ids = inp["ids"].reshape(R * T, k)
    w = inp["w"].reshape(R * T, k).astype(np.float64)
    shared = moe_forward_detailed(x, w, ids, f(inp["w_sg"]), f(inp["w_su"]), f(inp["w_sd"]),
                                  f(inp["w_g"]), f(inp["w_u"]), f(inp["w_d"]),
                                  swiglu_limit=swiglu_limit).y_shared

    def q(a, block):
        return dequantize_fp8(*quantize_fp8_reference(np.asarray(a, np.float32), block), block)
    xq = q(x, (1, 128))
    wg = [q(e, (128, 128)) for e in f(inp["w_g"])]
    wu = [q(e, (128, 128)) for e in f(inp["w_u"])]
    wd = [q(e, (128, 128)) for e in f(inp["w_d"])]
    out = shared.copy()
    for t in range(R * T):
        for j in range(k):
            e = ids[t, j]
            if e < 0:
                continue
            h = bf16_round(swiglu(xq[t] @ wg[e].T, xq[t] @ wu[e].T, swiglu_limit))
            out[t] += w[t, j] * (q(h[None], (1, 128))[0] @ wd[e].T)
    return out.reshape(R, T, H)


def rel_l1(got, want):
    return float(np.abs(got - want).sum() / np.abs(want).sum())
