"""Device errors name what went wrong: bad expert ids with the source rank, token, slot and exact
int64 value; NaN/Inf inputs with the tensor and the first token; ranks that disagree with the
field and both values; emulated ranks that allocate different shapes with the argument. Emulated
ranks (1, 2, 4) on the simulator; unchanged on one GPU."""
import numpy as np
import pytest

from comm_support import EmulatedGroup
from helpers import to_dev
from layer_support import bf16_round, layer_inputs, reference_out, rel_l1
from mok_comm import dispatch, routing
from mok_comm.emulation import emulated_layers, run_phases, run_steps
from mok_comm.functional import step_phases
from mok_comm.heap import EmulatedHeap
from mok_comm.layer import Layer, Weights, agreement_phases
from mok_core import errors as err
from mok_core.config import LayerShape, MoKConfig
from mok_core.cuda_compat import to_host
from mok_core.errors import MoKError
from mok_core.errors_kernels import reset_error_word
from mok_core.gemm import SIM_GEMM

GEMM = SIM_GEMM
CFG = MoKConfig(row_align=32, minibatch_size=64, capacity_factor=1.0)
SMALL = MoKConfig(row_align=4, minibatch_size=8)
NAN16 = int(np.array([np.nan], np.float32).view(np.uint32)[0] >> 16)
INF16 = int(np.array([np.inf], np.float32).view(np.uint32)[0] >> 16)


def u16(a):
    return np.ascontiguousarray(np.asarray(a).view(np.uint16))


def message(fn):
    with pytest.raises(MoKError) as info:
        fn()
    return str(info.value)


# --- bad expert ids, checked on the source rank ------------------------------------------------

@pytest.mark.parametrize("R", [1, 2, 4])
@pytest.mark.parametrize("bad,dtype", [("E", np.int32), (1000, np.int32), (-2, np.int32),
                                       ("E", np.int64), (-2, np.int64), (2**32 + 1, np.int64),
                                       (-(2**40), np.int64)])
def test_bad_id_reported_exactly_by_its_source_rank(R, bad, dtype):
    T, k, E = 8, 2, 4 * R
    bad = E if bad == "E" else bad
    group = EmulatedGroup(R, tokens_per_rank=T, hidden=16, topk=k, num_experts=E, config=SMALL)
    me = R - 1
    ids = np.arange(T * k, dtype=dtype).reshape(T, k) % E
    ids[2, 0] = -1                                       # masked: fine
    ids[3, 1] = bad                                      # the first bad one (flat index 7)
    ids[6, 0] = E if bad != E else -3                    # a second one, another value
    d_out = to_dev(np.full((T, k), 77, np.int32))
    ws = group.workspaces[me]
    routing.check_and_publish_ids(ws, to_dev(ids), d_out)
    out = to_host(d_out)
    want_ids = ids.astype(np.int64)
    valid = (want_ids >= -1) & (want_ids < E)
    np.testing.assert_array_equal(out[valid], want_ids[valid])
    assert np.all(out[~valid] == err.ID_REPORTED)       # 2**32 + 1 never becomes expert 1
    assert message(ws.check) == (
        f"mok_comm (rank {me}): expert id out of range on rank {me}: topk_ids[3, 1] = {bad} "
        f"(valid: 0..{E - 1} or -1 for a masked route); 2 bad ids in all, those routes were "
        "skipped")
    for other in group.workspaces[:me]:
        other.check()                                    # only the source rank reports
    reset_error_word(ws.errors)                         # (the step's reset)
    routing.check_and_publish_ids(ws, to_dev(ids % E), d_out)       # a clean step after it
    ws.check()


def test_first_bad_id_is_the_smallest_index_across_blocks():
    """Several blocks (10 on the simulator, 3 on a GPU): the first bad id is in block 0, the
    block that finishes last fills in its value; one bad id alone is reported in the
    singular."""
    T, k, E = 300, 2, 8
    group = EmulatedGroup(1, tokens_per_rank=T, hidden=16, topk=k, num_experts=E, config=SMALL)
    ws = group.workspaces[0]
    ids = np.zeros((T, k), np.int64)
    ids.reshape(-1)[[100, 300, 599]] = [1000, 2**32 + 1, -2]
    out = to_dev(np.zeros((T, k), np.int32))
    routing.check_and_publish_ids(ws, to_dev(ids), out)
    assert message(ws.check).endswith(
        "topk_ids[50, 0] = 1000 (valid: 0..7 or -1 for a masked route); 3 bad ids in all, "
        "those routes were skipped")
    assert to_host(ws.errors)[err.BAD_ID_DONE] == 0     # the block counter is back to 0
    reset_error_word(ws.errors)
    ids[:] = 0
    ids[299, 1] = -7
    routing.check_and_publish_ids(ws, to_dev(ids), out)
    assert message(ws.check).endswith(
        "topk_ids[299, 1] = -7 (valid: 0..7 or -1 for a masked route); 1 bad id in all, that "
        "route was skipped")


def test_schedule_skips_reported_ids_and_keeps_its_backstop():
    """``ID_REPORTED`` reaches the schedule as a skipped route with no second report; any other
    bad id that bypassed the source check is still flagged there."""
    from mok_core.schedule import Schedule, build_schedule
    R, T, k, E = 2, 16, 2, 4
    s = Schedule.allocate(rank=0, ep_size=R, tokens_per_rank=T, topk=k, num_experts=E,
                          config=SMALL)
    ids = np.zeros((R, T, k), np.int32)
    ids[1, 3, 1] = err.ID_REPORTED
    build_schedule(s, to_dev(ids))
    s.check()
    assert (to_host(s.recv_row)[1, 3, 1]) == -1
    ids[0, 5, 0] = 9
    build_schedule(s, to_dev(ids))
    assert message(s.check) == (
        "schedule (rank 0): expert id out of range in the gathered routing table: ids must be "
        "in [0, 4) or -1 (masked route); largest bad id 9; those routes were skipped")


# --- non-finite inputs --------------------------------------------------------------------------

@pytest.mark.parametrize("R", [1, 2, 4])
def test_non_finite_input_names_tensor_and_first_token(R):
    T, H, k = 40, 16, 2
    group = EmulatedGroup(R, tokens_per_rank=T, hidden=H, topk=k, num_experts=2 * R,
                          config=SMALL)
    me = R - 1
    ws = group.workspaces[me]
    x = u16(bf16_round(np.ones((T, H))))
    x[33, 0] = NAN16                                     # a later token, a low thread
    x[17, 9] = INF16
    x[17, 15] = NAN16 | 0x8000
    w = np.ones((T, k), np.float32)
    dispatch.publish_x(ws, *dispatch.check_x(ws, to_dev(x), to_dev(w)))
    assert message(ws.check) == (
        f"mok_comm (rank {me}): non-finite input on rank {me}: x has 3 NaN/Inf values, first "
        "at token 17; router_weights has 0")
    reset_error_word(ws.errors)
    w[21, 1] = np.inf
    w[38, 0] = np.nan
    x = u16(bf16_round(np.ones((T, H))))
    dispatch.publish_x(ws, *dispatch.check_x(ws, to_dev(x), to_dev(w)))
    assert message(ws.check) == (
        f"mok_comm (rank {me}): non-finite input on rank {me}: x has 0; router_weights has 2 "
        "NaN/Inf values, first at token 21")
    reset_error_word(ws.errors)
    w[:] = 1
    dispatch.publish_x(ws, *dispatch.check_x(ws, to_dev(x), to_dev(w)))
    ws.check()                                           # the clean step after it
    for other in group.workspaces[:me]:
        other.check()


def test_non_finite_word_without_a_tensor_keeps_the_total():
    """A kernel that only counts (NAN_COUNT) is still described."""
    w = err.initial_error_word()
    w[err.FLAGS] = err.ERR_NON_FINITE
    w[err.NAN_COUNT] = 5
    assert err.describe(w) == ["non-finite input: 5 NaN/Inf values seen"]


# --- rank agreement -----------------------------------------------------------------------------

def _agree(lws):
    run_phases([lw.comm for lw in lws], [agreement_phases(lw) for lw in lws])


def _shape(R):
    return LayerShape(hidden=64, intermediate=32, shared_intermediate=32, num_experts=2 * R,
                      topk=2, ep_size=R)


def test_disagreeing_config_names_the_field_and_both_ranks():
    heap = EmulatedHeap(2)
    other = MoKConfig(row_align=32, minibatch_size=32, capacity_factor=1.0)
    lws = [Layer(_shape(2), 8, cfg, heap=heap.for_rank(r), gemm=GEMM, verify=False)
           for r, cfg in enumerate([CFG, other])]
    _agree(lws)
    assert message(lws[0].comm.check) == (
        "mok_comm (rank 0): ranks disagree on the layer's setup: rank 1 has minibatch_size=32, "
        "rank 0 has 64")
    assert message(lws[1].comm.check) == (
        "mok_comm (rank 1): ranks disagree on the layer's setup: rank 0 has minibatch_size=64, "
        "rank 1 has 32")


def test_disagreement_at_ep4_names_the_first_field_and_the_rank():
    """Rank 2 differs in capacity_factor, rank 3 in the MoKConfig only (dispatch): every rank
    reports the smallest field first; rank 3's own view names rank 0 for the digest."""
    from dataclasses import replace
    heap = EmulatedHeap(4)
    cfgs = [CFG, CFG, replace(CFG, capacity_factor=0.5), replace(CFG, dispatch="pull")]
    lws = [Layer(_shape(4), 8, c, heap=heap.for_rank(r), gemm=GEMM, verify=False)
           for r, c in enumerate(cfgs)]
    _agree(lws)
    assert message(lws[0].comm.check) == (
        "mok_comm (rank 0): ranks disagree on the layer's setup: rank 2 has "
        "capacity_factor=0.5, rank 0 has 1")
    assert message(lws[2].comm.check) == (
        "mok_comm (rank 2): ranks disagree on the layer's setup: rank 0 has "
        "capacity_factor=1, rank 2 has 0.5")
    got = message(lws[3].comm.check)
    d = [int(to_host(lw.fingerprint)[err.FINGERPRINT_FIELDS.index("config")]) for lw in lws]
    assert got == (
        "mok_comm (rank 3): ranks disagree on the layer's setup: rank 2 has "
        "capacity_factor=0.5, rank 3 has 1")
    # without the capacity factor's difference, the MoKConfig digest is the first field
    heap = EmulatedHeap(2)
    lws = [Layer(_shape(2), 8, c, heap=heap.for_rank(r), gemm=GEMM, verify=False)
           for r, c in enumerate([CFG, cfgs[3]])]
    _agree(lws)
    assert message(lws[0].comm.check) == (
        "mok_comm (rank 0): ranks disagree on the layer's setup: rank 1 has a different "
        f"MoKConfig than rank 0 (digest {d[3]:#x} vs {d[0]:#x})")


def test_fingerprint_compare_names_tokens_per_rank():
    """What NVSHMEM ranks with different T see (the emulated heap refuses them earlier)."""
    lws = emulated_layers(_shape(2), 8, CFG, GEMM)
    lw = lws[0]
    table = np.stack([to_host(lw.fingerprint)] * 2)
    table[1, err.FINGERPRINT_FIELDS.index("tokens_per_rank")] = 16
    table[1, err.FINGERPRINT_FIELDS.index("topk")] = 3          # a later field: not first
    routing.compare_fingerprints(lw.comm, to_dev(table))
    assert message(lw.comm.check) == (
        "mok_comm (rank 0): ranks disagree on the layer's setup: rank 1 has topk=3, rank 0 "
        "has 2")
    reset_error_word(lw.comm.errors)
    table[1, err.FINGERPRINT_FIELDS.index("topk")] = 2
    routing.compare_fingerprints(lw.comm, to_dev(table))
    assert message(lw.comm.check) == (
        "mok_comm (rank 0): ranks disagree on the layer's setup: rank 1 has tokens_per_rank=16, "
        "rank 0 has 8")


# --- shapes that differ between emulated ranks ---------------------------------------------------

@pytest.mark.parametrize("R", [2, 4])
def test_emulated_ranks_with_different_token_counts(R):
    heap = EmulatedHeap(R)
    for r in range(R - 1):
        Layer(_shape(R), 8, CFG, heap=heap.for_rank(r), gemm=GEMM, verify=False)
    with pytest.raises(ValueError) as info:
        Layer(_shape(R), 16, CFG, heap=heap.for_rank(R - 1), gemm=GEMM, verify=False)
    assert str(info.value) == (
        f"emulated ranks disagree on tokens_per_rank: rank 0 allocated x_recv [{8 * R}, 64], "
        f"rank {R - 1} [{16 * R}, 64] (every rank must build its layer alike)")


def test_emulated_ranks_with_different_hidden_or_topk_or_order():
    heap = EmulatedHeap(2)
    Layer(_shape(2), 8, CFG, heap=heap.for_rank(0), gemm=GEMM, verify=False)
    wide = LayerShape(hidden=128, intermediate=32, shared_intermediate=32, num_experts=4,
                      topk=2, ep_size=2)
    with pytest.raises(ValueError, match=r"^emulated ranks disagree on hidden: rank 0 "
                                         r"allocated x_recv \[16, 64\], rank 1 \[16, 128\]"):
        Layer(wide, 8, CFG, heap=heap.for_rank(1), gemm=GEMM, verify=False)
    heap = EmulatedHeap(2)
    Layer(_shape(2), 8, CFG, heap=heap.for_rank(0), gemm=GEMM, verify=False)
    with pytest.raises(ValueError, match=r"^emulated ranks disagree on topk: rank 0 allocated "
                                         r"ids_table \[2, 8, 2\], rank 1 \[2, 8, 3\]"):
        Layer(LayerShape(hidden=64, intermediate=32, shared_intermediate=32, num_experts=4,
                         topk=3, ep_size=2), 8, CFG, heap=heap.for_rank(1), gemm=GEMM,
              verify=False)
    heap = EmulatedHeap(2)
    h0, h1 = heap.for_rank(0), heap.for_rank(1)
    h0.alloc((4,), np.int32, name="a")
    with pytest.raises(ValueError, match=r"^emulated ranks allocated symmetric buffers in "
                                         r"different orders: allocation 0 is a \[4\] on rank 0 "
                                         r"but b \[4\] on rank 1$"):
        h1.alloc((4,), np.int32, name="b")


# --- whole steps: the error, then a clean step ----------------------------------------------------

def _weights(inp, r, E_l):
    sl = slice(r * E_l, (r + 1) * E_l)
    return Weights(to_dev(u16(inp["w_sg"])), to_dev(u16(inp["w_su"])), to_dev(u16(inp["w_sd"])),
                   to_dev(u16(inp["w_g"][sl])), to_dev(u16(inp["w_u"][sl])),
                   to_dev(u16(inp["w_d"][sl])))


def _report(lw):
    """What ``Layer.check`` raises for the steps run (None: nothing)."""
    try:
        lw.check()
    except MoKError as e:
        return str(e)
    return None


def _step(lws, inp, ids):
    """One step on every emulated rank (it clears its error words first); returns the outputs
    and every rank's report."""
    E_l = lws[0].shape.experts_per_rank
    outs = [to_dev(np.full(inp["x"].shape[1:], 0xFFFF, np.uint16)) for _ in lws]
    phases = [step_phases(lw, to_dev(u16(inp["x"][r])), to_dev(ids[r]), to_dev(inp["w"][r]),
                          _weights(inp, r, E_l), out=outs[r])[0] for r, lw in enumerate(lws)]
    run_steps(lws, phases)
    msgs = [_report(lw) for lw in lws]
    got = np.stack([to_host(o).view(np.uint16) for o in outs])
    import ml_dtypes
    return got.view(ml_dtypes.bfloat16).astype(np.float64), msgs


@pytest.mark.parametrize("R", [1, 2, 4])
def test_layer_step_with_bad_ids_then_a_clean_step(R):
    rng = np.random.default_rng(20 + R)
    T = 8
    shape = _shape(R)
    inp = layer_inputs(rng, shape, T)
    lws = emulated_layers(shape, T, CFG, GEMM)
    src = R - 1
    ids = inp["ids"].astype(np.int64)
    ids[src, 3, 1] = 2**32 + 1                          # would wrap to expert 1 in int32
    ids[src, 5, 0] = 1000
    got, msgs = _step(lws, inp, ids)
    assert msgs[src] == (
        f"step 1 of this layer (rank {src}): expert id out of range on rank {src}: "
        f"topk_ids[3, 1] = 4294967297 (valid: 0..{2 * R - 1} or -1 for a masked route); 2 bad "
        "ids in all, those routes were skipped")
    assert all(m is None for r, m in enumerate(msgs) if r != src)
    for lw in lws:                                       # what every rank gathered
        assert list(to_host(lw.comm.ids_table)[src, [3, 5], [1, 0]]) == [err.ID_REPORTED] * 2
    masked = dict(inp, ids=np.where((ids < -1) | (ids >= 2 * R), -1, ids).astype(np.int32))
    want = reference_out(masked)
    assert rel_l1(got, want) < 5e-3                      # skipped, never expert 1
    assert rel_l1(got[src, 3], want[src, 3]) < 5e-3
    got, msgs = _step(lws, inp, inp["ids"])               # the next clean step passes
    assert msgs == [None] * R
    assert rel_l1(got, reference_out(inp)) < 5e-3


def test_layer_step_with_nan_inputs_then_a_clean_step():
    rng = np.random.default_rng(7)
    R, T = 2, 8
    shape = _shape(R)
    inp = layer_inputs(rng, shape, T)
    lws = emulated_layers(shape, T, CFG, GEMM)
    bad = dict(inp, x=inp["x"].copy(), w=inp["w"].copy())
    bad["x"][1, 5, 3] = np.nan
    bad["w"][0, 2, 1] = np.nan
    _, msgs = _step(lws, bad, bad["ids"])
    # token 5 of rank 1 goes to experts 3 and 1 (local expert 1 of both ranks): the GEMMs'
    # output checks see its row there too (one row: I = 32 hidden, H = 64 y values)
    assert bad["ids"][1, 5].tolist() == [3, 1]
    routed = ("routed gate/up output (hidden) has 32 NaN/Inf values, first at local expert 1 "
              "(expert-sorted row {row}) -- {why}; routed down output (y) has 64 NaN/Inf values, "
              "first at local expert 1 (expert-sorted row {row}) -- downstream of the NaN/Inf "
              "in routed gate/up output (hidden)")
    assert msgs == [
        "step 1 of this layer (rank 0): non-finite input on rank 0: x has 0; router_weights "
        "has 1 NaN/Inf value, first at token 2; non-finite values on rank 0: "
        + routed.format(row=39, why="check w_gate/w_up of that expert (or a token routed to "
                                    "it)"),
        "step 1 of this layer (rank 1): non-finite input on rank 1: x has 1 NaN/Inf value, "
        "first at token 5; router_weights has 0; non-finite values on rank 1: "
        + routed.format(row=35, why="downstream of the NaN/Inf in x")
        + "; shared gate/up output has 32 NaN/Inf values, first at token 5 -- downstream of "
        "the NaN/Inf in x; shared down output has 64 NaN/Inf values, first at token 5 -- "
        "downstream of the NaN/Inf in shared gate/up output"]
    got, msgs = _step(lws, inp, inp["ids"])
    assert msgs == [None] * R
    assert rel_l1(got, reference_out(inp)) < 5e-3
