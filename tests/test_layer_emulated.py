"""The whole EP forward (routing all-gather, schedule, pull dispatch, shared + routed FFN on the
tensor-core kernels, push combine, epilogue) with R ranks emulated in one process, against the
float64 reference layer on all ranks' tokens. CUDA simulator in CI; unchanged on one GPU."""
import numpy as np
import pytest

from helpers import to_dev
from layer_support import layer_inputs, reference_out, reference_out_fp8, rel_l1
from mok_comm.emulation import emulated_layers, run_phases, run_steps
from mok_comm.functional import step_phases
from mok_comm.heap import EmulatedHeap
from mok_comm.layer import (Layer, Weights, WeightsFP8, agreement_phases, fp8_shapes,
                            quantize_weights)
from mok_core.config import LayerShape, MoKConfig
from mok_core.cuda_compat import to_host
from mok_core.errors import MoKError
from mok_core.gemm import GemmConfig, SIM_GEMM
from mok_core.quantize import quantize_fp8

GEMM = SIM_GEMM           # small tiles: quick in the simulator, the same on a GPU
CFG = MoKConfig(row_align=32, minibatch_size=64, capacity_factor=1.0)


def u16(a):
    return np.ascontiguousarray(np.asarray(a).view(np.uint16))


def rank_weights(inp, r, E_l):
    sl = slice(r * E_l, (r + 1) * E_l)
    return Weights(to_dev(u16(inp["w_sg"])), to_dev(u16(inp["w_su"])), to_dev(u16(inp["w_sd"])),
                   to_dev(u16(inp["w_g"][sl])), to_dev(u16(inp["w_u"][sl])),
                   to_dev(u16(inp["w_d"][sl])))


def run_layer(lws, inp, ids=None, weights=None):
    R = len(lws)
    E_l = lws[0].shape.experts_per_rank
    ids = inp["ids"] if ids is None else ids
    weights = weights or [rank_weights(inp, r, E_l) for r in range(R)]
    outs = [to_dev(np.full(inp["x"].shape[1:], 0xFFFF, np.uint16)) for _ in range(R)]
    phases = [step_phases(lw, to_dev(u16(inp["x"][r])), to_dev(ids[r]), to_dev(inp["w"][r]),
                          weights[r], out=outs[r])[0]
              for r, lw in enumerate(lws)]
    run_steps(lws, phases)
    for lw in lws:
        lw.check()
    return np.stack([to_host(o).view(np.uint16) for o in outs])


def as_f64(bits):
    import ml_dtypes
    return bits.view(ml_dtypes.bfloat16).astype(np.float64)


@pytest.mark.parametrize("R,limit", [(2, None), (3, 1.0)])
def test_forward_matches_float64_reference(R, limit):
    rng = np.random.default_rng(R)
    T = 24
    shape = LayerShape(hidden=64, intermediate=32, shared_intermediate=32, num_experts=2 * R,
                       topk=3, ep_size=R)
    inp = layer_inputs(rng, shape, T, weight_scale=3.0 if limit else 1.0)
    lws = emulated_layers(shape, T, CFG, GEMM, swiglu_limit=limit)
    got = run_layer(lws, inp)
    want = reference_out(inp, limit)
    assert np.isfinite(as_f64(got)).all()
    assert rel_l1(as_f64(got), want) < 5e-3
    again = run_layer(lws, inp)                  # same workspaces, second step
    np.testing.assert_array_equal(again, got)


def test_fp8_forward(limit=None):
    """``MoKConfig(precision="fp8")`` at EP 2: tokens quantised on arrival into expert order
    (k = 4 > EP: once a token, then gathered -- the bytes of quantising each route's row --;
    rank 0 forced onto the route-by-route path that EP >= k takes),
    the FP8 gate|up + SwiGLU GEMM and the down GEMM pushing rows home (the fused combine), on
    weights from ``quantize_weights`` -- within 5e-3 of float64 of the same quantised operands
    (so the kernels add almost nothing), within e4m3's rounding of the bf16 layer's float64
    (random operands: x, W and h each carry ~2-3 % rounding), bit-equal on a second step; and
    the layer refuses bf16-only weights and a hidden size that is not a multiple of 128. (The
    clamp of the FP8 SwiGLU epilogue: ``test_gemm_fp8``.)"""
    from dataclasses import replace
    rng = np.random.default_rng(17)
    R, T = 2, 16
    shape = LayerShape(hidden=128, intermediate=128, shared_intermediate=128, num_experts=8,
                       topk=4, ep_size=R)
    inp = layer_inputs(rng, shape, T, weight_scale=3.0 if limit else 1.0)
    cfg = replace(CFG, precision="fp8")
    lws = emulated_layers(shape, T, cfg, GEMM, swiglu_limit=limit, backward=False)
    assert all(lw.y is None and lw.fused_combine and lw.x8 is not None
               and lw.x8_tokens is not None for lw in lws)
    lws[0].x8_tokens = None          # rank 0 route by route (the path at EP >= k), 1 by token
    E_l = shape.experts_per_rank
    weights = []
    for r in range(R):                           # (a forward-only layer: no transposed copies)
        w = rank_weights(inp, r, E_l)
        weights.append(WeightsFP8(*w, quantize_weights(w, backward=False)))
    got = run_layer(lws, inp, weights=weights)
    for lw in lws:                               # gathered = each route's row quantised
        n = int(to_host(lw.schedule.num_rows)[0])
        want, want_s = quantize_fp8(lw.comm.x_recv, index=lw.gather_index)
        np.testing.assert_array_equal(to_host(lw.x8)[:n], to_host(want)[:n])
        np.testing.assert_array_equal(to_host(lw.x8_scale)[:n], to_host(want_s)[:n])
    assert np.isfinite(as_f64(got)).all()
    assert rel_l1(as_f64(got), reference_out_fp8(inp, limit)) < 5e-3
    bf16_ref = reference_out(inp, limit)
    g, b = as_f64(got).ravel(), bf16_ref.ravel()
    cosine = g @ b / np.sqrt((g @ g) * (b @ b))
    print(f"fp8 layer vs float64 of bf16: rel-L1 {rel_l1(g, b):.4f}, cosine {cosine:.5f}")
    assert rel_l1(g, b) < 0.06 and cosine > 0.995
    np.testing.assert_array_equal(run_layer(lws, inp, weights=weights), got)
    with pytest.raises(TypeError, match=r"weights: expected 7: WeightsFP8\(\*weights"):
        run_layer(lws, inp)
    with pytest.raises(ValueError, match=r"LayerShape.hidden=192: .* multiple of 128"):
        emulated_layers(replace(shape, hidden=192), T, cfg, GEMM, backward=False)


def test_down_gemm_with_tiles_of_its_own():
    """``gemm_down``: the down GEMMs (routed and shared) run their own tiles; same float64
    bar, and the fingerprint carries both configs."""
    down_tiles = GemmConfig(bm=32, bn=64, bk=32, wm=2, wn=2, stages=2)
    rng = np.random.default_rng(4)
    T = 24
    shape = LayerShape(hidden=64, intermediate=32, shared_intermediate=32, num_experts=4,
                       topk=3, ep_size=2)
    inp = layer_inputs(rng, shape, T)
    lws = emulated_layers(shape, T, CFG, GEMM, gemm_down=down_tiles)
    assert all(lw.gemm == GEMM and lw.gemm_down == down_tiles for lw in lws)
    got = run_layer(lws, inp)
    assert rel_l1(as_f64(got), reference_out(inp)) < 5e-3
    same = emulated_layers(shape, T, CFG, GEMM)[0]
    assert not np.array_equal(to_host(same.fingerprint), to_host(lws[0].fingerprint))


def test_wgmma_layer_with_the_combine_fused_into_the_down_gemm():
    """The Hopper path: 192-row wgmma GEMMs with TMA weight tiles, and the down GEMM pushing
    rows home from its epilogue (no y buffer, no combine launch) -- the float64 bar over all
    ranks' tokens. (That the push writes the same bits as y + combine is
    ``test_grouped_gemm.test_down_push_equals_down_then_scatter``.)"""
    gemm = GemmConfig(bm=192, bn=64, bk=64, wm=3, wn=1, stages=3, mma="wgmma")
    cfg = MoKConfig(row_align=64, minibatch_size=128, capacity_factor=1.0)
    rng = np.random.default_rng(9)
    R, T = 2, 12
    shape = LayerShape(hidden=128, intermediate=64, shared_intermediate=64, num_experts=4,
                       topk=2, ep_size=R)
    inp = layer_inputs(rng, shape, T)
    lws = emulated_layers(shape, T, cfg, gemm)
    assert all(lw.y is None for lw in lws)           # fused: no y buffer at all
    got = run_layer(lws, inp)
    assert np.isfinite(as_f64(got)).all()
    assert rel_l1(as_f64(got), reference_out(inp, None)) < 5e-3


def test_split_dispatch_layer_equals_pull_layer():
    """``MoKConfig(dispatch="split")``: the copy engine takes the peers' first 40 % of tokens,
    the SM pull the rest -- the same output bits as the pull, skewed routing with masked
    routes."""
    from dataclasses import replace
    R, T = 2, 24
    shape = LayerShape(hidden=64, intermediate=32, shared_intermediate=32, num_experts=2 * R,
                       topk=3, ep_size=R)
    pull = replace(CFG, dispatch="pull")
    split = replace(CFG, dispatch="split", dispatch_ce_share=0.4)
    inp = layer_inputs(np.random.default_rng(11), shape, T, masked=0.2, skew=0.6)
    want = run_layer(emulated_layers(shape, T, pull, GEMM), inp)
    got = run_layer(emulated_layers(shape, T, split, GEMM), inp)
    np.testing.assert_array_equal(got, want)
    assert rel_l1(as_f64(got), reference_out(inp)) < 5e-3


def test_int64_ids_and_rank_without_tokens():
    rng = np.random.default_rng(5)
    R, T = 2, 16
    shape = LayerShape(hidden=64, intermediate=32, shared_intermediate=32, num_experts=4,
                       topk=2, ep_size=R)
    inp = layer_inputs(rng, shape, T)
    inp["ids"][1] = -1                                  # rank 1 routes nothing (T = 0 in effect)
    lws = emulated_layers(shape, T, CFG, GEMM)
    got = run_layer(lws, inp, ids=inp["ids"].astype(np.int64))
    assert rel_l1(as_f64(got), reference_out(inp)) < 5e-3


def test_bad_inputs_rejected_before_any_launch():
    rng = np.random.default_rng(1)
    R, T = 2, 8
    shape = LayerShape(hidden=64, intermediate=32, shared_intermediate=32, num_experts=4,
                       topk=2, ep_size=R)
    inp = layer_inputs(rng, shape, T)
    lw = emulated_layers(shape, T, CFG, GEMM)[1]       # rank 1: the messages name it
    E_l = 2
    good = dict(x=to_dev(u16(inp["x"][1])), topk_ids=to_dev(inp["ids"][1]),
                router_weights=to_dev(inp["w"][1]), weights=rank_weights(inp, 1, E_l))
    W = good["weights"]
    before = to_host(lw.comm.x_buf).copy()

    def off(shape, dtype, elements):
        """A device array of ``shape`` starting ``elements`` past an aligned allocation."""
        return to_dev(np.zeros(int(np.prod(shape)) + elements, dtype))[elements:].reshape(shape)
    wide = to_dev(np.zeros((T, 128), np.uint16))
    cases = [
        ("x", to_dev(np.zeros((T, 64), np.float32)), TypeError,
         "x: expected dtype uint16, got float32, on rank 1$"),
        ("x", to_dev(np.zeros((T + 1, 64), np.uint16)), ValueError,
         f"x: {T + 1} tokens on rank 1, but the layer holds at most tokens_per_rank={T}"),
        ("x", wide[:, ::2], ValueError,
         r"x: must be C-contiguous .*strides \(256, 4\) for shape \(8, 64\), on rank 1$"),
        ("x", off((T, 64), np.uint16, 1), ValueError,
         "x: must start 16-byte aligned .*this one is 2 bytes past, on rank 1$"),
        ("out", to_dev(np.zeros((T, 128), np.uint16))[:, ::2], ValueError,
         "out: must be C-contiguous"),
        ("out", off((T, 64), np.uint16, 4), ValueError,
         "out: must start 16-byte aligned .*8 bytes past, on rank 1$"),
        ("router_weights", to_dev(np.zeros((T, 4), np.float32))[:, ::2], ValueError,
         "router_weights: must be C-contiguous"),
        ("weights", W._replace(w_gate=off((E_l, 32, 64), np.uint16, 3)), ValueError,
         "w_gate: must start 16-byte aligned .*6 bytes past, on rank 1$"),
        ("weights", W._replace(w_down=to_dev(np.zeros((E_l, 64, 64), np.uint16))[:, :, ::2]),
         ValueError,
         "w_down: must be C-contiguous"),
        ("x", to_dev(np.zeros((T, 48), np.uint16)), ValueError, "x: expected shape"),
        ("topk_ids", to_dev(inp["ids"][0][:T - 1]), ValueError, "topk_ids: expected shape"),
        ("router_weights", to_dev(np.zeros((T, 2), np.float64)), TypeError, "router_weights"),
        ("topk_ids", to_dev(np.zeros((T, 2), np.int16)), TypeError,
         "topk_ids: expected dtype int32 or int64"),
        ("weights", W._replace(w_gate=to_dev(u16(inp["w_g"]))), ValueError,
         "w_gate: expected shape"),
        ("weights", W._replace(w_down=W.w_gate), ValueError, "w_down"),
        ("weights", W._replace(w_shared_down=W.w_shared_gate), ValueError, "w_shared_down"),
        ("weights", tuple(W)[:5], TypeError, "weights: expected 6 tensors"),
    ]
    for name, bad, exc, msg in cases:
        args = dict(good, **{name: bad})
        with pytest.raises(exc, match=msg):
            step_phases(lw, **args)
    np.testing.assert_array_equal(to_host(lw.comm.x_buf), before)   # nothing ran


def test_layer_refuses_bad_construction():
    shape = LayerShape(hidden=64, intermediate=32, shared_intermediate=32, num_experts=4,
                       topk=2, ep_size=2)
    heap = EmulatedHeap(2).for_rank(0)
    with pytest.raises(ValueError, match="swiglu_limit"):
        Layer(shape, 8, CFG, heap=heap, gemm=GEMM, swiglu_limit=-2.0, verify=False)
    with pytest.raises(TypeError, match="config: expected a MoKConfig"):
        Layer(shape, 8, {"row_align": 32}, heap=heap, gemm=GEMM, verify=False)
    with pytest.raises(ValueError, match="LayerShape.ep_size=1 but the heap has 2 ranks"):
        Layer(shape.with_ep(1), 8, CFG, heap=heap, gemm=GEMM, verify=False)
    for args, kw, exc, msg in (
            (({"hidden": 64}, 8, CFG), {}, TypeError, "shape: expected a LayerShape, got dict"),
            ((shape, 8.0, CFG), {}, ValueError, r"tokens_per_rank=8\.0: must be an int >= 0"),
            ((shape, True, CFG), {}, ValueError, "tokens_per_rank=True"),
            ((shape, 8, CFG), {"gemm": {"bm": 32}}, TypeError,
             "gemm: expected a GemmConfig or None, got dict"),
            ((shape, 8, CFG), {"backward": "no"}, TypeError, "backward='no': expected a bool")):
        with pytest.raises(exc, match=msg):
            Layer(*args, heap=heap, verify=False, **{"gemm": GEMM, **kw})
    lw = Layer(shape, np.int64(8), CFG, heap=heap, gemm=GEMM, verify=False)   # numpy ints do
    assert lw.tokens_per_rank == 8 and type(lw.tokens_per_rank) is int


def test_ranks_that_disagree_are_detected():
    shape = LayerShape(hidden=64, intermediate=32, shared_intermediate=32, num_experts=4,
                       topk=2, ep_size=2)
    heap = EmulatedHeap(2)
    other = MoKConfig(row_align=32, minibatch_size=32, capacity_factor=1.0)
    lws = [Layer(shape, 8, cfg, heap=heap.for_rank(r), gemm=GEMM, verify=False)
           for r, cfg in enumerate([CFG, other])]
    run_phases([lw.comm for lw in lws], [agreement_phases(lw) for lw in lws])
    with pytest.raises(MoKError, match="ranks disagree on the layer's setup: rank 1 has "
                                       "minibatch_size=32, rank 0 has 64$"):
        lws[0].comm.check()


def test_out_of_range_expert_id_is_reported():
    rng = np.random.default_rng(2)
    R, T = 2, 8
    shape = LayerShape(hidden=64, intermediate=32, shared_intermediate=32, num_experts=4,
                       topk=2, ep_size=R)
    inp = layer_inputs(rng, shape, T)
    inp["ids"][0, 3, 1] = 4                             # E = 4: out of range
    lws = emulated_layers(shape, T, CFG, GEMM)
    with pytest.raises(MoKError, match=r"expert id out of range on rank 0: topk_ids\[3, 1\] = 4 "
                                       r"\(valid: 0\.\.3 or -1 for a masked route\); 1 bad id "
                                       r"in all, that route was skipped$"):
        run_layer(lws, inp)


def test_quantize_weights_checks_its_arguments():
    E, I, H = 2, 128, 256
    routed = [to_dev(np.zeros(s, np.uint16)) for s in ((E, I, H), (E, I, H), (E, H, I))]
    W = Weights(None, None, None, *routed)
    fwd_only = [to_dev(np.zeros(shp, dt)) for dt, shp in fp8_shapes(E, I, H, False).values()]
    for weights, kw, exc, msg in (
            (routed, {}, TypeError, "weights: expected 6 tensors"),
            (W._replace(w_down=routed[0]), {}, ValueError,
             r"w_down: expected shape \(2, 256, 128\), got \(2, 128, 256\)"),
            (W._replace(w_up=routed[0][:1]), {}, ValueError, "w_up: expected shape"),
            (W._replace(w_gate=routed[0][0]), {}, ValueError, "w_gate: expected 3 dimensions"),
            (W, {"out": fwd_only}, ValueError,
             r"out.w_down_t: None, but quantize_weights\(backward=True\) writes it"),
            (W, {"out": fwd_only[:5]}, TypeError, "out: expected an FP8Weights"),
            (W, {"backward": 1}, TypeError, "backward=1: expected a bool")):
        with pytest.raises(exc, match=msg):
            quantize_weights(weights, **kw)
