"""The layer's backward with R ranks emulated in one process (d_out pulled like x, d_x rows and
router-weight gradients pushed home, the shared expert local), all 8 gradients against the
float64 reference (``moe_backward``). CUDA simulator in CI; unchanged on one GPU."""
import ml_dtypes
import numpy as np
import pytest

from helpers import to_dev
from layer_support import bf16_round, layer_inputs, reference_out, rel_l1
from mok_comm.backward import Grads, backward_phases
from mok_comm.emulation import emulated_layers, run_steps
from mok_comm.functional import step_phases
from mok_core.config import LayerShape, MoKConfig
from mok_core.cuda_compat import to_host
from mok_core.gemm import SIM_GEMM
from mok_core.reference import moe_backward

from test_layer_emulated import rank_weights, u16

# row_align 32: on a GPU the backward then takes 32-row tiles too (``backward_gemm``)
CFG = MoKConfig(row_align=32, minibatch_size=64, capacity_factor=1.0)


def f64(bits):
    a = np.asarray(bits)
    if a.dtype == np.uint16:
        return a.view(ml_dtypes.bfloat16).astype(np.float64)
    return a.astype(np.float64)


def shape_for(R, shared=32):
    return LayerShape(hidden=64, intermediate=32, shared_intermediate=shared,
                      num_experts=max(4, 2 * R), topk=3, ep_size=R)


def run_forward(lws, inp, ids=None, weights=None):
    """The forward on every emulated rank (its context stays in the layers); ``weights``: one
    per rank (default ``rank_weights``)."""
    ids = inp["ids"] if ids is None else ids
    W = weights or [rank_weights(inp, r, lws[0].shape.experts_per_rank) for r in range(len(lws))]
    run_steps(lws, [step_phases(lw, to_dev(u16(inp["x"][r])), to_dev(ids[r]),
                                to_dev(inp["w"][r]), W[r])[0] for r, lw in enumerate(lws)])


def run_fwd_bwd(lws, inp, d_out, ids=None, grads=None, accumulate=False):
    """Forward then backward on every emulated rank; per rank ``Grads`` as host arrays."""
    run_forward(lws, inp, ids)
    return run_backward(lws, inp, d_out, grads, accumulate)


def run_backward(lws, inp, d_out, grads=None, accumulate=False, weights=None):
    """The backward of the layers' last forward on every emulated rank; per rank ``Grads`` as
    host arrays (the context is left as it was: a second backward may follow)."""
    R, E_l = len(lws), lws[0].shape.experts_per_rank
    W = weights or [rank_weights(inp, r, E_l) for r in range(R)]
    phases, outs = [], []
    for r, lw in enumerate(lws):
        p, G = backward_phases(lw, lw.context(), to_dev(u16(d_out[r])), to_dev(inp["w"][r]),
                               W[r], grads=None if grads is None else grads[r],
                               accumulate=accumulate)
        phases.append(p)
        outs.append(G)
    run_steps(lws, phases)
    for lw in lws:
        lw.check()
    return [Grads(*(None if a is None else to_host(a).copy() for a in G)) for G in outs]


def reference(inp, d_out, ids, limit):
    """float64 gradients: routed ones over every rank's tokens, shared weights' per rank."""
    R, T, H = inp["x"].shape
    k = ids.shape[2]
    f = lambda a: np.asarray(a).astype(np.float64)  # noqa: E731
    W = [f(inp[n]) for n in ("w_sg", "w_su", "w_sd", "w_g", "w_u", "w_d")]
    full = moe_backward(f(d_out).reshape(R * T, H), f(inp["x"]).reshape(R * T, H),
                        inp["w"].reshape(R * T, k).astype(np.float64), ids.reshape(R * T, k),
                        *W, swiglu_limit=limit)
    per_rank = [moe_backward(f(d_out[r]), f(inp["x"][r]), inp["w"][r].astype(np.float64),
                             ids[r], *W, swiglu_limit=limit) for r in range(R)]
    return full, per_rank


def check_grads(got, inp, d_out, ids, limit, tol=5e-3):
    """Every rank's 8 gradients against float64 within ``tol`` (rel-L1; a dict: per gradient
    name, each one named)."""
    R, T, H = inp["x"].shape
    full, per_rank = reference(inp, d_out, ids, limit)
    E_l = full.d_w_gate.shape[0] // R
    for r, G in enumerate(got):
        sl = slice(r * E_l, (r + 1) * E_l)
        want = {"d_x": full.d_x.reshape(R, T, H)[r],
                "d_router_weights": full.d_router_weights.reshape(R, T, -1)[r],
                "d_w_gate": full.d_w_gate[sl], "d_w_up": full.d_w_up[sl],
                "d_w_down": full.d_w_down[sl],
                "d_w_shared_gate": per_rank[r].d_w_shared_gate,
                "d_w_shared_up": per_rank[r].d_w_shared_up,
                "d_w_shared_down": per_rank[r].d_w_shared_down}
        for name, w in want.items():
            g = getattr(G, name)
            if g is None:
                assert not inp["w_sg"].size, name
                continue
            g = f64(g)
            assert np.isfinite(g).all(), (r, name)
            if not np.abs(w).sum():
                assert not np.abs(g).sum(), (r, name)
                continue
            bound = tol[name] if isinstance(tol, dict) else tol
            assert rel_l1(g, w) < bound, (r, name, rel_l1(g, w), bound)
        # masked routes get exactly zero
        np.testing.assert_array_equal(G.d_router_weights[ids[r] < 0], 0)


def inputs(R, T, seed, shared=32, masked=0.2, skew=0.3, limit=None):
    rng = np.random.default_rng(seed)
    shape = shape_for(R, shared)
    inp = layer_inputs(rng, shape, T, masked=masked, skew=skew,
                       weight_scale=3.0 if limit else 1.0)
    d_out = bf16_round(rng.standard_normal((R, T, shape.hidden)))
    return shape, inp, d_out


def context_bits(lws):
    """Every rank's forward context as bytes: the gather index, x_recv, the shared and routed
    hidden and the saved FP32 gate / up pre-activations (held in the gradient workspace)."""
    out = []
    for lw in lws:
        ctx = lw.context()
        g = lw.grad
        assert all(a is b for a, b in zip(ctx.pre + ctx.pre_shared,
                                          (g.gate, g.up, g.gate_s, g.up_s)))
        out.append([to_host(a).copy().view(np.uint8) for a in (
            ctx.gather_index, ctx.x_recv, ctx.hidden, ctx.hidden_shared, *ctx.pre,
            *ctx.pre_shared)])
    return out


@pytest.fixture(scope="module")
def two_ranks():
    """R = 2 with the SwiGLU clamp: one forward + backward on emulated layers, shared by the
    float64 check and the recompute test (which runs these layers on) -> (shape, inp, d_out,
    layers, per-rank Grads, the context's bits after the backward)."""
    R, T, limit = 2, 16, 1.0
    shape, inp, d_out = inputs(R, T, seed=10 + R, limit=limit)
    lws = emulated_layers(shape, T, CFG, SIM_GEMM, swiglu_limit=limit)
    got = run_fwd_bwd(lws, inp, d_out)
    return shape, inp, d_out, lws, got, context_bits(lws)


# R = 1 is test_accumulate_twice_is_twice_once's float64 check (and test_torch_adapter's, with
# the layer's own bf16 gradients); the bitwise rerun is test_recompute_forward_context_bit_equal;
# R = 3: every rank pulls d_out from, and pushes d_x rows home to, two peers
@pytest.mark.parametrize("R,limit", [(2, 1.0), (3, None)])
def test_backward_matches_float64(R, limit, request):
    T = 16
    if R == 2:
        _, inp, d_out, _, got, _ = request.getfixturevalue("two_ranks")
    else:
        shape, inp, d_out = inputs(R, T, seed=10 + R, limit=limit)
        lws = emulated_layers(shape, T, CFG, SIM_GEMM, swiglu_limit=limit)
        got = run_fwd_bwd(lws, inp, d_out)
    check_grads(got, inp, d_out, inp["ids"], limit)


def test_skew_masked_rank_and_empty_expert():
    """Rank 1's tokens all masked, every other route on expert 0 (the others get no rows:
    zero gradients, written over NaN-filled caller buffers), no shared expert."""
    R, T = 2, 16
    shape, inp, d_out = inputs(R, T, seed=3, shared=0)
    ids = inp["ids"].copy()
    ids[1] = -1
    ids[0] = np.where(ids[0] >= 0, 0, -1)
    ids[0, :, 1:] = -1                           # one route per token: expert 0 once
    lws = emulated_layers(shape, T, CFG, SIM_GEMM)
    E_l, H, I, k = shape.experts_per_rank, 64, 32, shape.topk
    nan = 0x7FC0                                 # bf16 NaN: a gradient left unwritten shows
    poisoned = [Grads(to_dev(np.full((T, H), nan, np.uint16)),
                      to_dev(np.full((T, k), np.nan, np.float32)), None, None, None,
                      *(to_dev(np.full(s, nan, np.uint16))
                        for s in ((E_l, I, H), (E_l, I, H), (E_l, H, I)))) for _ in range(R)]
    got = run_fwd_bwd(lws, inp, d_out, ids=ids, grads=poisoned)
    check_grads(got, inp, d_out, ids, None)
    assert not got[1].d_router_weights.any()
    np.testing.assert_array_equal(got[0].d_w_gate[1], 0)       # expert 1 took no rows
    assert not f64(got[1].d_w_down).any()                     # rank 1's experts took none


def test_accumulate_twice_is_twice_once():
    """float32 caller-owned gradients: accumulate over two identical micro-batches (the
    backward of one forward, twice) equals two times one, bit for bit (each step adds the same
    FP32 values in the same order)."""
    R, T = 1, 16
    shape, inp, d_out = inputs(R, T, seed=5)
    lws = emulated_layers(shape, T, CFG, SIM_GEMM)
    H, I, I_s, E_l, k = 64, 32, 32, shape.experts_per_rank, shape.topk
    shapes = ((I_s, H), (I_s, H), (H, I_s), (E_l, I, H), (E_l, I, H), (E_l, H, I))

    def buffers():
        return [Grads(to_dev(np.zeros((T, H), np.uint16)), to_dev(np.zeros((T, k), np.float32)),
                      *(to_dev(np.zeros(s, np.float32)) for s in shapes)) for _ in range(R)]
    acc = buffers()
    once = run_fwd_bwd(lws, inp, d_out, grads=acc, accumulate=True)      # into zeros
    twice = run_backward(lws, inp, d_out, grads=acc, accumulate=True)
    for a, b in zip(once, twice):
        for x, y in zip(a[2:], b[2:]):
            np.testing.assert_array_equal(np.float32(2) * x, y)
    check_grads(once, inp, d_out, inp["ids"], None)


def test_variable_tokens_per_rank():
    """One layer sized for T_max = 16 serves steps of 5 and 16 tokens, then 0 and 1 (different
    per rank, no reallocation): outputs and all 8 gradients equal the float64 reference of the
    T_max problem with the missing tokens masked and their d_out zero, so rows staged by an
    earlier step (or never written) contribute nothing."""
    R, T_max = 2, 16
    shape, inp, d_out = inputs(R, T_max, seed=21)
    lws = emulated_layers(shape, T_max, CFG, SIM_GEMM)
    E_l = shape.experts_per_rank
    W = [rank_weights(inp, r, E_l) for r in range(R)]
    for counts in ((5, 16), (0, 1)):
        outs = [to_dev(np.full((T, shape.hidden), 0x7FC0, np.uint16)) for T in counts]
        run_steps(lws, [step_phases(lw, to_dev(u16(inp["x"][r][:T])),
                                    to_dev(inp["ids"][r][:T]), to_dev(inp["w"][r][:T]), W[r],
                                    out=outs[r])[0]
                        for r, (lw, T) in enumerate(zip(lws, counts))])
        phases, grads = [], []
        for r, (lw, T) in enumerate(zip(lws, counts)):
            assert lw.context().tokens == T
            p, G = backward_phases(lw, lw.context(), to_dev(u16(d_out[r][:T])),
                                   to_dev(inp["w"][r][:T]), W[r])
            phases.append(p)
            grads.append(G)
        run_steps(lws, phases)
        for lw in lws:
            lw.check()
        ids, d_full = inp["ids"].copy(), d_out.astype(np.float32)
        for r, T in enumerate(counts):
            ids[r, T:] = -1
            d_full[r, T:] = 0
        want = reference_out(dict(inp, ids=ids))
        full = reference(dict(inp, ids=ids), bf16_round(d_full), ids, None)[0]
        for r, T in enumerate(counts):
            got = f64(to_host(outs[r]))
            assert got.shape == (T, shape.hidden)
            if T:
                assert rel_l1(got, want[r, :T]) < 5e-3, (counts, r)
            G = Grads(*(None if a is None else to_host(a).copy() for a in grads[r]))
            assert G.d_x.shape == (T, shape.hidden) and G.d_router_weights.shape == (T, 3)
            if T:
                assert rel_l1(f64(G.d_x), full.d_x.reshape(R, T_max, -1)[r, :T]) < 5e-3
        # the T_max-shaped check on zero-padded gradients: weights, router, the rest of d_x
        padded = []
        for r, T in enumerate(counts):
            G = Grads(*(None if a is None else to_host(a).copy() for a in grads[r]))
            d_x = np.zeros((T_max, shape.hidden), np.float32)
            d_x[:T] = f64(G.d_x)
            d_r = np.zeros((T_max, 3), np.float32)
            d_r[:T] = G.d_router_weights
            padded.append(G._replace(d_x=bf16_round(d_x).view(np.uint16), d_router_weights=d_r))
        check_grads(padded, inp, bf16_round(d_full), ids, None)


def test_bad_inputs_raise_before_launch():
    R, T = 1, 16
    shape, inp, d_out = inputs(R, T, seed=1)
    lw = emulated_layers(shape, T, CFG, SIM_GEMM)[0]
    W = rank_weights(inp, 0, shape.experts_per_rank)
    x, ids, w = to_dev(u16(inp["x"][0])), to_dev(inp["ids"][0]), to_dev(inp["w"][0])
    run_steps([lw], [step_phases(lw, x, ids, w, W)[0]])
    ctx = lw.context()
    with pytest.raises(ValueError, match=r"d_out.*\(16, 64\)"):
        backward_phases(lw, ctx, to_dev(np.zeros((8, 64), np.uint16)), w, W)
    with pytest.raises(ValueError, match="router_weights"):
        backward_phases(lw, ctx, to_dev(u16(d_out[0])), to_dev(np.zeros((16, 2), np.float32)),
                        W)
    with pytest.raises(ValueError, match="accumulate=True"):
        backward_phases(lw, ctx, to_dev(u16(d_out[0])), w, W, accumulate=True)
    H, I, I_s, E_l, k = 64, 32, 32, shape.experts_per_rank, shape.topk
    shapes = ((I_s, H), (I_s, H), (H, I_s), (E_l, I, H), (E_l, I, H), (E_l, H, I))
    grads = [to_dev(np.zeros((T, H), np.uint16)), to_dev(np.zeros((T, k), np.float32)),
             *(to_dev(np.zeros(s, np.float32)) for s in shapes)]
    n = int(np.prod(shapes[5]))
    grads[7] = to_dev(np.zeros(n + 1, np.float32))[1:].reshape(shapes[5])     # 4 bytes past
    with pytest.raises(ValueError, match=r"grads\.d_w_down: must start 16-byte aligned .*"
                                         r"4 bytes past, on rank 0"):
        backward_phases(lw, ctx, to_dev(u16(d_out[0])), w, W, grads=Grads(*grads),
                        accumulate=True)
    with pytest.raises(ValueError, match="ForwardContext"):
        backward_phases(lw, None, to_dev(u16(d_out[0])), w, W)
    with pytest.raises(ValueError, match=r"x: 17 tokens on rank 0, but the layer holds at most "
                                         r"tokens_per_rank=16"):
        step_phases(lw, to_dev(np.zeros((17, 64), np.uint16)), to_dev(np.zeros((17, 3), np.int32)),
                    to_dev(np.zeros((17, 3), np.float32)), W)
    with pytest.raises(ValueError, match=r"topk_ids.*\(4, 3\)"):
        step_phases(lw, to_dev(np.zeros((4, 64), np.uint16)), ids, to_dev(np.zeros((4, 3),
                                                                                  np.float32)), W)
    d_off = to_dev(np.zeros(T * 64 + 1, np.uint16))[1:].reshape(T, 64)
    with pytest.raises(ValueError, match="d_out: must start 16-byte aligned .*on rank 0$"):
        backward_phases(lw, ctx, d_off, w, W)
    # another forward overwrites what ctx points to: the backward refuses it, not the new one
    run_steps([lw], [step_phases(lw, x, ids, w, W)[0]])
    with pytest.raises(ValueError, match=r"ctx: the context of forward 1, but forward 2 has run "
                                         r"on this layer since.*on rank 0$"):
        backward_phases(lw, ctx, to_dev(u16(d_out[0])), w, W)
    backward_phases(lw, lw.context(), to_dev(u16(d_out[0])), w, W)


@pytest.mark.parametrize("limit", [None, 0.7])
def test_sampled_grad_reference_equals_numpy(limit):
    """``mok_testing.sampled``'s float64 gradients (what the GPU suite checks real shapes
    with) equal ``mok_core.reference.moe_backward``."""
    torch = pytest.importorskip("torch")
    from mok_testing.sampled import reference_token_grads, reference_weight_grads
    R, T = 1, 20
    shape, inp, d_out = inputs(R, T, seed=7, limit=limit)
    ids = inp["ids"][0]
    t = lambda a: torch.from_numpy(np.asarray(a, np.float64))  # noqa: E731
    W = [t(np.asarray(inp[n], np.float64)) for n in ("w_g", "w_u", "w_d")]
    shared = tuple(t(np.asarray(inp[n], np.float64)) for n in ("w_sg", "w_su", "w_sd"))
    x, w, d = t(np.asarray(inp["x"][0], np.float64)), t(inp["w"][0]), t(np.asarray(d_out[0],
                                                                                  np.float64))
    full = reference(inp, d_out, inp["ids"], limit)[0]
    dx, dw = reference_token_grads(x, torch.from_numpy(ids), w, d, shared,
                                   lambda e: (W[0][e], W[1][e], W[2][e]), limit)
    np.testing.assert_allclose(dx.numpy(), full.d_x, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(dw.numpy(), full.d_router_weights, rtol=1e-9, atol=1e-9)
    cols = torch.tensor([0, 5, 31])
    e = int(ids[ids >= 0][0])
    tok, slot = np.nonzero(ids == e)
    rg, ru, rd = reference_weight_grads(x[tok], d[tok], w[tok, slot], (W[0][e], W[1][e], W[2][e]),
                                        cols, limit)
    np.testing.assert_allclose(rg.numpy(), full.d_w_gate[e][cols.numpy()], rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(ru.numpy(), full.d_w_up[e][cols.numpy()], rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(rd.numpy(), full.d_w_down[e][:, cols.numpy()], rtol=1e-9,
                               atol=1e-9)
    rg, _, rd = reference_weight_grads(x, d, torch.ones(T, dtype=torch.float64), shared, cols,
                                       limit)
    np.testing.assert_allclose(rg.numpy(), full.d_w_shared_gate[cols.numpy()], rtol=1e-9,
                               atol=1e-9)
    np.testing.assert_allclose(rd.numpy(), full.d_w_shared_down[:, cols.numpy()], rtol=1e-9,
                               atol=1e-9)


def test_recompute_forward_context_bit_equal(two_ranks):
    """Forward + backward, then another step with other tokens clobbers the context; the
    recomputed one -- the saved FP32 gate / up pre-activations included -- is bit for bit the
    saved one, and so is the backward taken from it (a bitwise rerun of the backward)."""
    from mok_comm.functional import recompute_phases
    shape, inp, d_out, lws, want, saved = two_ranks
    R = len(lws)
    other = bf16_round(np.random.default_rng(9).standard_normal(inp["x"].shape))
    W = [rank_weights(inp, r, shape.experts_per_rank) for r in range(R)]
    run_steps(lws, [step_phases(lw, to_dev(u16(other[r])), to_dev(inp["ids"][r]),
                                to_dev(inp["w"][r]), W[r])[0] for r, lw in enumerate(lws)])
    assert any(not np.array_equal(x, y) for a, b in zip(saved, context_bits(lws))
               for x, y in zip(a, b))                     # the other step did clobber it
    run_steps(lws, [recompute_phases(lw, to_dev(u16(inp["x"][r])), to_dev(inp["ids"][r]),
                                     to_dev(inp["w"][r]), W[r]) for r, lw in enumerate(lws)])
    for a, b in zip(saved, context_bits(lws)):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)
    phases = [backward_phases(lw, lw.context(), to_dev(u16(d_out[r])), to_dev(inp["w"][r]),
                              W[r])[0] for r, lw in enumerate(lws)]
    run_steps(lws, phases)
    for lw, G in zip(lws, want):
        lw.check()
        g = lw.grad
        np.testing.assert_array_equal(to_host(g.d_x), G.d_x)
        np.testing.assert_array_equal(to_host(g.d_router_out), G.d_router_weights)
        for a, b in zip(g.grads, G[2:]):
            np.testing.assert_array_equal(to_host(a), b)


def test_non_finite_d_out_reported_then_clean():
    """A NaN in d_out is reported by the next call (the tensor, the rank, the first token),
    and the next clean backward (of the same forward) passes (flags per step)."""
    from mok_core.errors import MoKError
    R, T = 1, 16
    shape, inp, d_out = inputs(R, T, seed=4, shared=0)
    lws = emulated_layers(shape, T, CFG, SIM_GEMM)
    bad = d_out.copy()
    bad[0, 5, 3] = np.nan
    run_forward(lws, inp)
    with pytest.raises(MoKError, match=r"d_out has 1 NaN/Inf value, first at token 5"):
        run_backward(lws, inp, bad)
    run_backward(lws, inp, d_out)                           # clean: nothing raised


def test_peer_that_never_arrives_in_the_backward_times_out():
    """Rank 1 runs its forward but never its backward: rank 0's backward barrier gives up after
    the spin timeout and the next check names the peer (nothing hangs)."""
    from mok_comm.functional import run_phases
    from mok_core.errors import MoKError
    R, T = 2, 16
    shape, inp, d_out = inputs(R, T, seed=6, shared=0)
    cfg = MoKConfig(row_align=32, minibatch_size=64, spin_timeout_cycles=2_000_000)
    lws = emulated_layers(shape, T, cfg, SIM_GEMM)
    W = [rank_weights(inp, r, shape.experts_per_rank) for r in range(R)]
    run_steps(lws, [step_phases(lw, to_dev(u16(inp["x"][r])), to_dev(inp["ids"][r]),
                                to_dev(inp["w"][r]), W[r])[0] for r, lw in enumerate(lws)])
    phases, _ = backward_phases(lws[0], lws[0].context(), to_dev(u16(d_out[0])),
                                to_dev(inp["w"][0]), W[0])
    run_phases(phases, lws[0])                   # rank 1 never arrives
    with pytest.raises(MoKError, match=r"spin-wait timeout on rank 0: counter 'barrier' of "
                                       r"peer rank 1"):
        lws[0].check()


def test_fp8_backward_gradients_in_fp8():
    """``MoKConfig(precision="fp8")`` trains in FP8: the forward's routed GEMMs, the backward's
    two routed data gradients (d_out and [d_g | d_u] quantised 1 x 128 on the way -- d_out, at
    k = 3 > EP, once a token and then gathered: bit-equal to each route's row quantised;
    [d_g | d_u] by the SwiGLU backward's kernel, bit-equal to its bf16 rows quantised --, the
    weights' transposed copies from ``quantize_weights``) and its three routed weight
    gradients (their operands transposed and quantised along the rows, each expert's from a
    multiple of 128: ``mok_core.wgrad_rows``, here with row_align 32); rank 0 on 128-row FP8
    tiles and route-by-route quantisation, rank 1 on 192-row tiles and the token path. Each
    FP8 GEMM against float64 of its own dequantised operands (the GEMM adds almost nothing),
    the operands bit for bit the reference quantizer's of the layer's bf16 rows; all 8
    gradients within e4m3's rounding of the float64 reference; bitwise repeatable; a
    forward-only FP8Weights refused by the backward, naming the missing copy."""
    from dataclasses import replace

    from mok_comm import backward as B
    from mok_comm.functional import check_weights
    from mok_comm.layer import WeightsFP8, quantize_weights
    from mok_core.gemm import launch_fp8_gemm
    from mok_core.quantize_reference import (grouped_gemm_fp8_reference,
                                             grouped_wgrad_fp8_reference, quantize_fp8_reference)
    from mok_core.wgrad_rows import wgrad_rows_reference
    R, T = 2, 16
    rng = np.random.default_rng(23)
    shape = LayerShape(hidden=128, intermediate=128, shared_intermediate=128, num_experts=4,
                       topk=3, ep_size=R)
    inp = layer_inputs(rng, shape, T, masked=0.1)
    d_out = bf16_round(rng.standard_normal((R, T, shape.hidden)))
    lws = emulated_layers(shape, T, replace(CFG, precision="fp8", fp8_wgrad=True), SIM_GEMM)
    assert all(lw.grad.d_out8_tokens is not None for lw in lws)
    # rank 1's FP8 GEMMs on 192-row tiles (``fp8_rows_tile``'s pick at 113-192 rows an expert;
    # these experts hold ~24), rank 0's x and d_out quantised route by route (the path at
    # EP >= k): the checks below hold both ranks to the same bounds and bytes
    lws[1].fp8_bm = 192
    lws[0].x8_tokens = lws[0].grad.d_out8_tokens = None
    E_l, H, I = shape.experts_per_rank, shape.hidden, shape.intermediate
    W = [WeightsFP8(*w, quantize_weights(w)) for w in (rank_weights(inp, r, E_l)
                                                          for r in range(R))]

    run_forward(lws, inp, weights=W)
    got = run_backward(lws, inp, d_out, weights=W)
    full, _ = reference(inp, d_out, inp["ids"], None)
    print("fp8 layer, rank 0 rel-L1 vs float64: "
          f"d_x {rel_l1(f64(got[0].d_x), full.d_x.reshape(R, T, -1)[0]):.4f}, d_w_gate "
          f"{rel_l1(f64(got[0].d_w_gate), full.d_w_gate[:E_l]):.4f}, d_w_down "
          f"{rel_l1(f64(got[0].d_w_down), full.d_w_down[:E_l]):.4f}")
    # each gradient at its own bound (docs/perf.md, the FP8 layer's error budget): what the
    # FP8 h feeds (d_router_weights, the routed weight gradients) 0.1, d_x (~0.033 here) 0.045,
    # the shared expert's -- bf16 in the FP8 layer -- bf16's 5e-3
    fp8_tol = dict(d_x=0.045, d_router_weights=0.1, d_w_gate=0.1, d_w_up=0.1, d_w_down=0.1,
                   d_w_shared_gate=5e-3, d_w_shared_up=5e-3, d_w_shared_down=5e-3)
    check_grads(got, inp, d_out, inp["ids"], None, tol=fp8_tol)
    # FP32 weight gradients accumulated (main-grad): once = the first backward's bf16 ones
    # (shared and routed) before their rounding, twice = 2 x once, bit for bit, and d_x and
    # d_router of both equal the first backward's: the bitwise repeat of all 8 gradients
    # (a backward of its own for it cost this simulator test a sixth of its time)
    T_, H_, I_, I_s, k = T, shape.hidden, shape.intermediate, shape.shared_intermediate, shape.topk
    f32_shapes = ((I_s, H_), (I_s, H_), (H_, I_s), (E_l, I_, H_), (E_l, I_, H_), (E_l, H_, I_))
    acc = [Grads(to_dev(np.zeros((T_, H_), np.uint16)), to_dev(np.zeros((T_, k), np.float32)),
                 *(to_dev(np.zeros(sh, np.float32)) for sh in f32_shapes)) for _ in range(R)]
    once = run_backward(lws, inp, d_out, grads=acc, accumulate=True, weights=W)
    twice = run_backward(lws, inp, d_out, grads=acc, accumulate=True, weights=W)
    for G1, G2, G in zip(once, twice, got):
        for name in ("d_x", "d_router_weights"):
            np.testing.assert_array_equal(getattr(G1, name), getattr(G, name))
            np.testing.assert_array_equal(getattr(G2, name), getattr(G, name))
        for name in ("d_w_shared_gate", "d_w_shared_up", "d_w_shared_down",
                     "d_w_gate", "d_w_up", "d_w_down"):
            a = getattr(G1, name)
            np.testing.assert_array_equal(np.float32(2) * a, getattr(G2, name))
            np.testing.assert_array_equal(a.astype(ml_dtypes.bfloat16).view(np.uint16),
                                          getattr(G, name))

    f32 = lambda bits: f64(bits).astype(np.float32)                      # noqa: E731
    for r, lw in enumerate(lws):
        g, s, q = lw.grad, lw.schedule, W[r].fp8
        off, nr = to_host(s.expert_offsets), to_host(s.num_rows)
        n = int(nr[0])
        assert n > 0
        index = to_host(lw.gather_index)
        # the weight gradients: their layout, operands (the last launch's: x^T and
        # [d_g | d_u]^T) and sums. d_out rows through the tokens index, w h (in p) and
        # [d_g | d_u] through the rows index
        K = g.rows_index.shape[0]
        k_off, k_rows, rows_at, tokens_at = wgrad_rows_reference(off, nr, index, K)
        assert (k_off != off).any(), "row_align 32: the layout differs from the schedule's"
        np.testing.assert_array_equal(to_host(g.k_offsets), k_off)

        def gathered(src, at):
            return f32(np.where(at[:, None] >= 0, to_host(src)[np.maximum(at, 0)], 0)
                       .astype(np.uint16))
        kr = int(k_rows[0])
        ops = {}
        for name, src, at, block in (("d_out", g.comm.x_recv, tokens_at, (1, 128)),
                                     ("wh", g.p, rows_at, (128, 128)),
                                     ("d_gu", g.d_gu, rows_at, (1, 128)),
                                     ("x", lw.comm.x_recv, tokens_at, (128, 128))):
            ops[name] = quantize_fp8_reference(gathered(src, at), block, transpose=True)
        a8, a8_s = ops["d_gu"]
        np.testing.assert_array_equal(to_host(g.q_i).reshape(2 * I, K)[:, :kr], a8[:, :kr])
        np.testing.assert_array_equal(
            to_host(g.q_i_scale)[:2 * I * K // 128].reshape(2 * I, K // 128)[:, :kr // 128],
            a8_s[:, :kr // 128])
        b8, b8_s = ops["x"]
        np.testing.assert_array_equal(to_host(g.q_h).reshape(H, K)[:, :kr], b8[:, :kr])
        want = grouped_wgrad_fp8_reference(a8, a8_s, b8, b8_s, k_off, k_rows)
        gu = np.concatenate([f64(got[r].d_w_gate), f64(got[r].d_w_up)], 1)
        assert rel_l1(gu, want) < 5e-3
        want = grouped_wgrad_fp8_reference(*ops["d_out"], *ops["wh"], k_off, k_rows)
        assert rel_l1(f64(got[r].d_w_down), want) < 5e-3
        # the data gradients rerun in order (the weight gradients' operands overwrote their
        # quantised rows, and the backward p with w h): d_out's rows in expert order, as
        # quantised (padding rows zero), and p = d_out W_down
        Wc = check_weights(lw, W[r], backward=True)
        d_gu = to_host(g.d_gu)[:n].copy()
        index = index[:n]
        rows = np.where(index[:, None] >= 0, to_host(g.comm.x_recv)[np.maximum(index, 0)], 0)
        d_out8, d_out8_s = quantize_fp8_reference(f32(rows.astype(np.uint16)))
        B.dgrad_down(lw, Wc, False, 0)
        np.testing.assert_array_equal(to_host(g.d_out8)[:n], d_out8)
        np.testing.assert_array_equal(to_host(g.d_out8_scale)[:n], d_out8_s)
        want = grouped_gemm_fp8_reference(d_out8, d_out8_s, to_host(q.w_down_t),
                                          to_host(q.w_down_t_scale), off, [n])
        assert rel_l1(f64(to_host(g.p)[:n]), want) < 5e-3
        # the SwiGLU backward: the same bf16 [d_g | d_u], quantised 1 x 128 by the same
        # kernel as it wrote it; then the routed d_x rows its FP8 GEMM wrote
        B.swiglu_backward(lw, False, 0)
        np.testing.assert_array_equal(to_host(g.d_gu)[:n], d_gu)
        d_gu8, d_gu8_s = quantize_fp8_reference(f32(d_gu))
        np.testing.assert_array_equal(to_host(g.d_gu8)[:n], d_gu8)
        np.testing.assert_array_equal(to_host(g.d_gu8_scale)[:n], d_gu8_s)
        # (the FP8 GEMM pushes them home from its epilogue: no d_x rows buffer; each real
        # row is read back from its source rank's combine row token * k + slot, the bits the
        # same GEMM writes unfused)
        assert lw.fused_d_x_push and g.d_x_rows is None
        for o in lws:                  # (the backwards above pushed the same rows: clear them)
            o.comm.combine_buf[:] = 0
        B.dgrad_gate_up(lw, Wc, False, 0)
        want = grouped_gemm_fp8_reference(d_gu8, d_gu8_s, to_host(q.w_gate_up_t),
                                          to_host(q.w_gate_up_t_scale), off, [n])
        real = np.flatnonzero(index[:n] >= 0)
        src = [to_host(a)[real] for a in (s.src_rank, s.src_token, s.src_slot)]
        homes = np.stack([to_host(o.comm.combine_buf).reshape(-1, shape.hidden) for o in lws])
        pushed = homes[src[0], src[1] * shape.topk + src[2]]
        assert rel_l1(f64(pushed), want[real]) < 5e-3
        rows = to_dev(np.zeros((index.shape[0], shape.hidden), np.uint16))
        launch_fp8_gemm(g.d_gu8, g.d_gu8_scale, q.w_gate_up_t, q.w_gate_up_t_scale,
                        s.expert_offsets, s.num_rows, rows, bm=lw.fp8_bm)
        np.testing.assert_array_equal(pushed, to_host(rows)[real])

    # an Inf in [d_g | d_u] (here from an Inf saved up pre-activation) is reported: the
    # quantisers saturate it to +-448, so they count it (the d_x rows', the weight gradients')
    from mok_core.errors import MoKError
    row = int(np.flatnonzero(to_host(lws[0].gather_index) >= 0)[0])
    lws[0].grad.up[row, 3] = np.float32(np.inf)
    with pytest.raises(MoKError, match=r"routed d_x \(backward\) has \d+ NaN/Inf value.*"
                                       r"weight gradients has \d+ NaN/Inf value"):
        run_backward(lws, inp, d_out, weights=W)

    forward_only = WeightsFP8(*W[0][:6], quantize_weights(rank_weights(inp, 0, E_l),
                                                          backward=False))
    with pytest.raises(ValueError, match=r"weights.fp8.w_down_t: None, but the FP8 backward's "
                                         r"data gradients read it"):
        backward_phases(lws[0], lws[0].context(), to_dev(u16(d_out[0])), to_dev(inp["w"][0]),
                        forward_only)


def test_fp8_wgrad_tile_follows_an_experts_rows(monkeypatch):
    """``fp8_wgrad``'s tile (``gemm.fp8_wgrad_tile`` of the rows an expert gets at the layer's
    shape): 128 columns where those rows take at most two 128-row K slices (a tile's store then
    outlasts its MMAs, and narrower tiles store closer to the write ceiling: docs/perf.md,
    FP8), the kernel's default width (None: 256 where it divides N) above, and a 4-slice ring
    where they take more than three -- and the backward hands the layer's tile to both weight
    gradients' launches."""
    from mok_comm import backward as B
    from mok_core.gemm import fp8_wgrad_tile
    assert [fp8_wgrad_tile(r) for r in (24, 256, 256.5, 320, 384, 385, 512)] == [
        (128, None), (128, None), (None, None), (None, None), (None, None), (None, 4),
        (None, 4)]
    shape = LayerShape(hidden=256, intermediate=128, shared_intermediate=0, num_experts=4,
                       topk=2, ep_size=2)
    cfg = MoKConfig(row_align=32, minibatch_size=64, precision="fp8", fp8_wgrad=True)
    seen = []
    monkeypatch.setattr(B, "launch_quantize_cols", lambda *a, **k: None)
    monkeypatch.setattr(B, "launch_fp8_wgrad", lambda *a, **k: seen.append((k["bn"],
                                                                              k["stages"])))
    for T, tile in ((256, (128, None)), (320, (None, None)), (512, (None, 4))):
        lay = emulated_layers(shape, T, cfg, SIM_GEMM)[0]     # T rows an expert
        assert lay.fp8_wgrad_tile == tile
        E, H, I = shape.experts_per_rank, shape.hidden, shape.intermediate
        G = Grads(None, None, None, None, None, *(to_dev(np.zeros(s, np.uint16))
                                                  for s in ((E, I, H), (E, I, H), (E, H, I))))
        seen.clear()
        for wgrad in (B.wgrad_gate_up, B.wgrad_down):
            wgrad(lay, G, False, False, 0)
        assert seen == [tile, tile]
