"""The communication protocol with R ranks emulated in one process (CUDA simulator in CI).

dispatch -> identity "expert" -> combine -> epilogue must reproduce, bit for bit, the float32
evaluation of out = y_shared + sum_j w_j x (slots ascending): every route was pulled from the
right peer, landed in the right row, went home to the right (token, slot) and was weighted in
the fixed order. Skewed routing, masked routes, ranks with no live tokens, R = 2, 3, 4; the SM
pull and the split (copy engine + SM) dispatch.
"""
import numpy as np
import pytest
from numba import cuda

from comm_support import (EmulatedGroup, bf16_bits, identity_expert_kernel, make_routing,
                          reference_round_trip)
from helpers import to_dev
from mok_comm import barrier, combine, dispatch, routing
from mok_core.config import MoKConfig
from mok_core.cuda_compat import SIM, kjit, to_host
from mok_core.errors_kernels import record_timeout
from mok_core.errors import MoKError
from mok_core.schedule import Schedule, build_schedule


def scheduled_group(R, T, H, k, E, x, ids, cfg):
    """R emulated ranks with tokens ``x`` [R, T, H] published, routed by ``ids`` [R, T, k]
    and scheduled: (group, schedules)."""
    group = EmulatedGroup(R, tokens_per_rank=T, hidden=H, topk=k, num_experts=E, config=cfg)
    wss = group.workspaces
    scheds = [Schedule.allocate(rank=r, ep_size=R, tokens_per_rank=T, topk=k, num_experts=E,
                                config=cfg, capacity=wss[r].capacity) for r in range(R)]
    group.each(lambda r, ws: publish(ws, x[r], ids[r]))
    group.barrier()
    group.each(lambda r, ws: build_schedule(scheds[r], ws.ids_table))
    return group, scheds


def publish(ws, x, ids, w=None):
    """The checked entry a direct caller uses: check once, then the trusted launches."""
    xv, wv = dispatch.check_x(ws, to_dev(x), None if w is None else to_dev(w))
    dispatch.publish_x(ws, xv, wv)
    routing.publish_ids(ws, routing.check_ids(ws, to_dev(ids)))


def round_trip_inputs(rng, R, T, H, k, E, skew=0.5, masked=0.2):
    """(ids, x, w, y_shared) of R ranks: skewed routing with masked routes, bf16 bits."""
    ids = make_routing(rng, R, T, k, E, skew=skew, masked=masked)
    x = bf16_bits(rng.standard_normal((R, T, H)))
    w = rng.random((R, T, k)).astype(np.float32)
    ys = bf16_bits(rng.standard_normal((R, T, H)))
    return ids, x, w, ys


def run_round_trip(R, T, H, k, E, x, ids, w, ys, cfg, variant="pull", ce_share=0.5):
    group, scheds = scheduled_group(R, T, H, k, E, x, ids, cfg)
    for ws in group.workspaces:     # stale NaN rows: a masked route's row is never added
        ws.combine_buf[:] = 0xFFFF
    C = group.workspaces[0].capacity
    index = [to_dev(np.zeros(C, np.int32)) for _ in range(R)]
    y = [to_dev(np.full((C, H), 0xFFFF, np.uint16)) for _ in range(R)]
    out = [to_dev(np.full((T, H), 0xFFFF, np.uint16)) for _ in range(R)]

    if variant == "split":
        group.each(lambda r, ws: dispatch.split(ws, scheds[r], ce_share=ce_share))
    else:
        group.each(lambda r, ws: dispatch.pull(ws, scheds[r]))
    group.each(lambda r, ws: dispatch.gather_index(ws, scheds[r], index[r]))
    group.each(lambda r, ws: identity_expert_kernel[2, 64](
        ws.x_recv.reshape(ws.x_recv.size), index[r], scheds[r].num_rows,
        y[r].reshape(y[r].size), H))
    group.each(lambda r, ws: combine.combine(ws, scheds[r], y[r]))
    group.barrier()
    group.each(lambda r, ws: combine.epilogue(
        ws, *combine.check_epilogue(ws, to_dev(w[r]), out[r], to_dev(ys[r]))))
    group.check()
    for s in scheds:
        s.check()
    return group, scheds, np.stack([to_host(o) for o in out])


@pytest.mark.parametrize("R,case,variant,k", [
    (2, "skewed", "pull", 3), (3, "skewed", "pull", 3), (4, "skewed", "pull", 3),
    (2, "masked_and_empty_rank", "pull", 3), (3, "masked_and_empty_rank", "pull", 3),
    (4, "masked_and_empty_rank", "pull", 3),
    # split: the copy engine takes each peer's first tokens, the SM pull the rest (all of
    # them to the copy engine, none of them: the two ends of the share)
    (2, "skewed", "split", 3), (3, "masked_and_empty_rank", "split", 3),
    (3, "skewed", "split_all", 3), (2, "masked_and_empty_rank", "split_none", 3),
    # more slots than the epilogue's group of rows in flight (combine.ROUTES_IN_FLIGHT)
    (2, "masked_and_empty_rank", "pull", 6), (2, "skewed", "pull", 9),
])
def test_round_trip_exact(R, case, variant, k):
    rng = np.random.default_rng(R * 10 + len(case) + k)
    T, H, E = 24, 32, (2 * R if k <= 2 * R else R * k)
    skew, masked, empty = (0.7, 0.0, ()) if case == "skewed" else (0.0, 0.3, (R - 1,))
    ids = make_routing(rng, R, T, k, E, skew=skew, masked=masked, empty_ranks=empty)
    x = bf16_bits(rng.standard_normal((R, T, H)))
    w = rng.random((R, T, k)).astype(np.float32)
    ys = bf16_bits(rng.standard_normal((R, T, H)))
    cfg = MoKConfig(row_align=4, minibatch_size=8, capacity_factor=1.0)
    variant, ce_share = {"split": ("split", 0.3), "split_all": ("split", 1.0),
                         "split_none": ("split", 0.0)}.get(variant, (variant, 0.5))
    group, scheds, out = run_round_trip(R, T, H, k, E, x, ids, w, ys, cfg, variant, ce_share)
    np.testing.assert_array_equal(out, reference_round_trip(x, ids, w, ys))

    # Dispatch progress counters: every real row counted once, in its minibatch -- the totals
    # the schedule announces.
    for s in scheds:
        src = to_host(s.src_rank)
        real_rows = np.nonzero(src >= 0)[0]
        want = np.bincount(real_rows // cfg.minibatch_size, minlength=len(to_host(s.ready)))
        np.testing.assert_array_equal(to_host(s.ready), want)
        np.testing.assert_array_equal(to_host(s.minibatch_rows), want)


@pytest.mark.parametrize("variant,ce_tokens", [("pull", 0), ("split", 5)])
def test_staging_pulls_each_token_once_per_rank(variant, ce_tokens):
    """x_recv holds exactly the peers' tokens with >= 1 route to this rank (the rest stays
    zero), plus this rank's own tokens in its own slice (written by publish, never copied).
    The split dispatch's copy engine also
    brings each peer's first ``ce_tokens`` tokens, needed or not (5 of 16: ce_share 0.3)."""
    rng = np.random.default_rng(9)
    R, T, H, k, E = 2, 16, 16, 4, 8
    ids = make_routing(rng, R, T, k, E)
    ids[:, 2] = -1                          # tokens no rank needs: inside the copy-engine range
    ids[:, T - 1] = -1                      # and outside it
    x = bf16_bits(rng.standard_normal((R, T, H)) + 3.0)      # no zero rows
    w = rng.random((R, T, k)).astype(np.float32)
    ys = bf16_bits(np.zeros((R, T, H)))
    cfg = MoKConfig(row_align=4, minibatch_size=8, capacity_factor=1.0)
    group, _, _ = run_round_trip(R, T, H, k, E, x, ids, w, ys, cfg, variant, ce_share=0.3)
    for me, ws in enumerate(group.workspaces):
        staged = to_host(ws.x_recv).reshape(R, T, H)
        needed = ((ids >= 0) & (ids // (E // R) == me)).any(axis=2)
        needed[:, :ce_tokens] = True
        needed[me] = True
        np.testing.assert_array_equal(staged[needed], x[needed])
        assert not staged[~needed].any()


@pytest.mark.skipif(not SIM, reason="a compiled kernel keeps the AGG_SLOTS it was built with")
def test_split_dispatch_counts_without_shared_counters(monkeypatch):
    """The copy engine's rows counted one global add per row when the minibatches outnumber
    the block's shared counters (``AGG_SLOTS``): the same ``ready`` totals and output."""
    monkeypatch.setattr(dispatch, "AGG_SLOTS", 1)
    R, T, H, k, E = 2, 12, 16, 3, 4
    ids, x, w, ys = round_trip_inputs(np.random.default_rng(21), R, T, H, k, E)
    cfg = MoKConfig(row_align=4, minibatch_size=4, capacity_factor=1.0)
    _, scheds, out = run_round_trip(R, T, H, k, E, x, ids, w, ys, cfg, "split", ce_share=0.6)
    np.testing.assert_array_equal(out, reference_round_trip(x, ids, w, ys))
    for s in scheds:
        assert len(to_host(s.ready)) > 1
        np.testing.assert_array_equal(to_host(s.ready), to_host(s.minibatch_rows))


def test_split_share_out_of_range_is_refused():
    cfg = MoKConfig(row_align=4, minibatch_size=8)
    group = EmulatedGroup(2, tokens_per_rank=4, hidden=16, topk=1, num_experts=2, config=cfg)
    with pytest.raises(ValueError, match="ce_share"):
        dispatch.split_tokens(group.workspaces[0], 1.5)


def test_repeated_forward_is_bitwise_identical():
    rng = np.random.default_rng(4)
    R, T, H, k, E = 2, 16, 32, 2, 4
    ids = make_routing(rng, R, T, k, E, skew=0.5)
    x = bf16_bits(rng.standard_normal((R, T, H)))
    w = rng.random((R, T, k)).astype(np.float32)
    ys = bf16_bits(rng.standard_normal((R, T, H)))
    cfg = MoKConfig(row_align=4, minibatch_size=8, capacity_factor=1.0)
    a = run_round_trip(R, T, H, k, E, x, ids, w, ys, cfg)[2]
    b = run_round_trip(R, T, H, k, E, x, ids, w, ys, cfg)[2]
    np.testing.assert_array_equal(a, b)


def test_peer_that_never_arrives_times_out_with_clear_error():
    cfg = MoKConfig(row_align=4, minibatch_size=8,
                    spin_timeout_cycles=2_000_000)
    group = EmulatedGroup(2, tokens_per_rank=4, hidden=16, topk=1, num_experts=2, config=cfg)
    ws0 = group.workspaces[0]
    barrier.arrive(ws0)              # rank 1 never arrives
    barrier.wait(ws0)
    with pytest.raises(MoKError, match=r"spin-wait timeout on rank 0: counter 'barrier' of "
                                       r"peer rank 1 expected >= 1, saw 0"):
        ws0.check()


@kjit
def _two_timeouts(errors):
    if cuda.threadIdx.x == 0:
        record_timeout(errors, 1, 0, 8, 4, 0)
        record_timeout(errors, 1, 0, 99, 98, 0)      # a later timeout: must not mix in


def test_first_timeout_is_the_one_reported():
    """Many threads of a wait can expire at once; the error word keeps the first whole."""
    from mok_core import errors as err
    from mok_core.errors_kernels import reset_error_word
    word = to_dev(np.zeros(err.ERROR_WORDS, np.int32))
    reset_error_word(word)
    _two_timeouts[1, 32](word)
    with pytest.raises(MoKError, match=r"spin-wait timeout on rank 1: counter 'barrier' of "
                                       r"peer rank 0 expected >= 8, saw 4"):
        err.raise_if_set(to_host(word), context="test")


def test_publish_rejects_bad_input():
    cfg = MoKConfig(row_align=4, minibatch_size=8)
    group = EmulatedGroup(2, tokens_per_rank=4, hidden=16, topk=2, num_experts=4, config=cfg)
    ws = group.workspaces[0]
    with pytest.raises(ValueError, match="x: expected shape"):
        dispatch.check_x(ws, to_dev(np.zeros((5, 16), np.uint16)))
    with pytest.raises(TypeError, match="topk_ids: expected dtype int32 or int64"):
        routing.check_ids(ws, to_dev(np.zeros((4, 2), np.float32)))
    with pytest.raises(ValueError, match="topk_ids: expected shape"):
        routing.check_ids(ws, to_dev(np.zeros((4, 3), np.int32)))
    with pytest.raises(TypeError, match="router_weights: expected dtype float32"):
        combine.check_epilogue(ws, to_dev(np.zeros((4, 2), np.float64)),
                               to_dev(np.zeros((4, 16), np.uint16)))
    with pytest.raises(ValueError, match="y: expected shape"):
        combine.check_y(ws, to_dev(np.zeros((ws.capacity + 1, 16), np.uint16)))


def test_non_finite_inputs_are_reported():
    cfg = MoKConfig(row_align=4, minibatch_size=8)
    group = EmulatedGroup(2, tokens_per_rank=4, hidden=16, topk=2, num_experts=4, config=cfg)
    ws = group.workspaces[0]
    x = bf16_bits(np.ones((4, 16)))
    x[2, 5] = bf16_bits(np.array([np.nan]))[0]
    x[3, 0] = bf16_bits(np.array([np.inf]))[0]
    w = np.ones((4, 2), np.float32)
    w[1, 1] = np.nan
    dispatch.publish_x(ws, *dispatch.check_x(ws, to_dev(x), to_dev(w)))
    with pytest.raises(MoKError, match="non-finite input on rank 0: x has 2 NaN/Inf values, "
                                       "first at token 2; router_weights has 1 NaN/Inf value, "
                                       "first at token 1$"):
        ws.check()
    np.testing.assert_array_equal(to_host(ws.x_buf), x)       # still copied, just flagged


def test_split_halves_must_pair():
    """``split_finish`` counts the copy engine's rows: it refuses to run without the
    start that enqueued them, or for another share; a start twice over is refused too."""
    rng = np.random.default_rng(5)
    R, T, H, k, E = 2, 8, 16, 2, 4
    ids, x, _, _ = round_trip_inputs(rng, R, T, H, k, E)
    cfg = MoKConfig(row_align=4, minibatch_size=8, capacity_factor=1.0)
    group, scheds = scheduled_group(R, T, H, k, E, x, ids, cfg)
    ws, sched = group.workspaces[0], scheds[0]
    with pytest.raises(RuntimeError, match="call start first"):
        dispatch.split_finish(ws, sched, ce_share=0.5)
    dispatch.split_start(ws, ce_share=0.5)
    with pytest.raises(RuntimeError, match="twice"):
        dispatch.split_start(ws, ce_share=0.5)
    with pytest.raises(RuntimeError, match="same ce_share"):
        dispatch.split_finish(ws, sched, ce_share=0.25)
    dispatch.split_finish(ws, sched, ce_share=0.5)      # the pair completes: nothing pending
    assert ws.side.pending is None
