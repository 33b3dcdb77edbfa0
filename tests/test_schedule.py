"""Schedule builder kernels == NumPy reference, bit for bit, plus invariants and bad input.

Runs under the CUDA simulator in CI (tiny shapes) and unchanged on a GPU.
"""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mok_core.schedule as sched_mod
from helpers import guarded, to_dev
from mok_core import errors as err
from mok_core.config import MoKConfig
from mok_core.cuda_compat import SIM
from mok_core.errors import MoKError
from mok_core.schedule import Schedule, build_schedule, build_schedule_numpy

FIELDS = ("expert_counts", "expert_rank_counts", "expert_offsets", "num_rows", "src_rank",
          "src_token", "src_slot", "recv_row", "minibatch_rows",
          "errors")


def make_ids(rng, R, T, k, E, mode):
    if mode == "uniform":
        ids = np.stack([np.stack([rng.permutation(E)[:k] for _ in range(T)]) if T else
                        np.zeros((0, k), np.int64) for _ in range(R)])
    elif mode == "one_expert":                   # every route to one expert
        ids = np.full((R, T, k), rng.integers(E))
    elif mode == "masked":                       # most routes masked
        ids = rng.integers(0, E, size=(R, T, k))
        ids[rng.random((R, T, k)) < 0.7] = -1
    elif mode == "skewed":                       # heavy hitters on rank 0's experts
        ids = np.where(rng.random((R, T, k)) < 0.6, rng.integers(0, max(1, E // R), (R, T, k)),
                       rng.integers(0, E, (R, T, k)))
    else:
        raise ValueError(mode)
    return np.ascontiguousarray(ids.reshape(R, T, k).astype(np.int32))


def run_kernel(ids, rank, E, cfg, rank_tokens=None, capacity=None):
    R, T, k = ids.shape
    s = Schedule.allocate(rank=rank, ep_size=R, tokens_per_rank=T, topk=k, num_experts=E,
                          config=cfg, capacity=capacity)
    build_schedule(s, to_dev(ids),
                   rank_tokens=None if rank_tokens is None else to_dev(rank_tokens))
    return s, s.to_host()


def assert_same(got, ref):
    for name in FIELDS:
        np.testing.assert_array_equal(got[name], ref[name], err_msg=name)


def check_invariants(ids, rank, E_local, row_align, got, rank_tokens=None, minibatch_size=None):
    """What the schedule means, checked without the reference."""
    R, T, k = ids.shape
    n_tok = np.full(R, T) if rank_tokens is None else rank_tokens
    live = np.arange(T)[None, :, None] < n_tok[:, None, None]
    mine = live & (ids // E_local == rank) & (ids >= 0)
    off = got["expert_offsets"]
    assert off[0] == 0 and np.all(off % row_align == 0) and np.all(np.diff(off) >= 0)
    assert got["num_rows"][0] == off[-1]
    # Every route to our experts sits in exactly one row, inside its expert's segment.
    rows = got["recv_row"][mine]
    assert np.all(rows >= 0) and len(np.unique(rows)) == len(rows)
    assert np.all(got["recv_row"][~mine] == -1)
    r_idx, t_idx, s_idx = np.nonzero(mine)
    e_local = ids[mine] - rank * E_local
    assert np.all((off[e_local] <= rows) & (rows < off[e_local + 1]))
    np.testing.assert_array_equal(got["src_rank"][rows], r_idx)
    np.testing.assert_array_equal(got["src_token"][rows], t_idx)
    np.testing.assert_array_equal(got["src_slot"][rows], s_idx)
    # Everything else is padding.
    if minibatch_size:
        np.testing.assert_array_equal(
            got["minibatch_rows"],
            np.bincount(rows // minibatch_size, minlength=len(got["minibatch_rows"])))
    pad = np.ones(len(got["src_rank"]), bool)
    pad[rows] = False
    assert np.all(got["src_rank"][pad] == -1) and np.all(got["src_token"][pad] == -1)
    # Inside a segment, sources alternate round-robin (while each still has rows).
    for j in range(E_local):
        seg = got["src_rank"][off[j]:off[j + 1]]
        seg = seg[seg >= 0]
        cnt = got["expert_rank_counts"][j]
        expect = [r for jj in range(cnt.max(initial=0)) for r in range(R) if jj < cnt[r]]
        np.testing.assert_array_equal(seg, expect)


@pytest.mark.parametrize("R,T,k,E_local,mode", [
    (1, 37, 3, 5, "uniform"),
    (2, 64, 8, 6, "uniform"),
    (3, 50, 4, 2, "skewed"),
    (4, 33, 2, 3, "one_expert"),
    (2, 40, 5, 4, "masked"),
])
def test_matches_reference_all_ranks(R, T, k, E_local, mode):
    rng = np.random.default_rng(R * 1000 + T)
    E = R * E_local
    ids = make_ids(rng, R, T, k, E, mode)
    cfg = MoKConfig(row_align=4, minibatch_size=16, capacity_factor=1.0)
    for rank in range(R):
        s, got = run_kernel(ids, rank, E, cfg)
        ref = build_schedule_numpy(ids, rank, E_local, s.capacity, cfg.row_align,
                                   minibatch_size=s.minibatch_size)
        assert_same(got, ref)
        check_invariants(ids, rank, E_local, cfg.row_align, got,
                         minibatch_size=cfg.minibatch_size)
        s.check()                                # no error on valid input


@settings(max_examples=80, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_property_random_routing(data):
    R = data.draw(st.integers(1, 8), label="R")
    k = data.draw(st.integers(1, 10), label="k")
    E_local = data.draw(st.integers(1, 3), label="E_local")
    T = data.draw(st.integers(0, 40), label="T")
    mode = data.draw(st.sampled_from(["uniform", "one_expert", "masked", "skewed"]), label="mode")
    row_align = data.draw(st.sampled_from([1, 4, 8]), label="row_align")
    rank = data.draw(st.integers(0, R - 1), label="rank")
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    rng = np.random.default_rng(seed)
    E = R * E_local
    ids = make_ids(rng, R, T, k, E, "masked" if (mode == "uniform" and E < k) else mode)
    rank_tokens = None
    if data.draw(st.booleans(), label="ragged"):   # some ranks have fewer (or zero) tokens
        rank_tokens = rng.integers(0, T + 1, R).astype(np.int32)
        rank_tokens[rng.integers(R)] = 0
    cfg = MoKConfig(row_align=row_align, minibatch_size=8 * row_align,
                    capacity_factor=1.0)
    s, got = run_kernel(ids, rank, E, cfg, rank_tokens=rank_tokens)
    ref = build_schedule_numpy(ids, rank, E_local, s.capacity, row_align, rank_tokens,
                               minibatch_size=s.minibatch_size)
    assert_same(got, ref)
    check_invariants(ids, rank, E_local, row_align, got, rank_tokens, cfg.minibatch_size)


def test_block_size_does_not_change_result(monkeypatch):
    rng = np.random.default_rng(7)
    R, T, k, E = 2, 100, 6, 8
    ids = make_ids(rng, R, T, k, E, "skewed")
    cfg = MoKConfig(row_align=4, minibatch_size=16)
    results = []
    for threads in (32, 64):
        monkeypatch.setattr(sched_mod, "SCHEDULE_THREADS", threads)
        results.append(run_kernel(ids, 1, E, cfg)[1])
    assert_same(results[0], results[1])


def test_deterministic_repeat():
    rng = np.random.default_rng(3)
    ids = make_ids(rng, 2, 48, 4, 8, "uniform")
    cfg = MoKConfig(row_align=8, minibatch_size=16)
    a = run_kernel(ids, 0, 8, cfg)[1]
    b = run_kernel(ids, 0, 8, cfg)[1]
    assert_same(a, b)


# ---- bad input ---------------------------------------------------------------------------

def _small_schedule(R=2, T=16, k=2, E=4, **kw):
    cfg = MoKConfig(row_align=4, minibatch_size=16)
    return Schedule.allocate(rank=0, ep_size=R, tokens_per_rank=T, topk=k, num_experts=E,
                             config=cfg, **kw)


def test_rejects_wrong_dtype():
    s = _small_schedule()
    with pytest.raises(TypeError, match="topk_ids_all.*int32"):
        build_schedule(s, to_dev(np.zeros((2, 16, 2), np.int64)))


@pytest.mark.parametrize("shape", [(2, 16), (2, 16, 3), (3, 16, 2), (2, 15, 2)])
def test_rejects_wrong_shape(shape):
    s = _small_schedule()
    with pytest.raises(ValueError, match="topk_ids_all"):
        build_schedule(s, to_dev(np.zeros(shape, np.int32)))


def test_rejects_non_array():
    s = _small_schedule()
    with pytest.raises(TypeError, match="topk_ids_all"):
        build_schedule(s, [[[0, 1]]])


def test_rejects_bad_rank_tokens():
    s = _small_schedule()
    with pytest.raises(ValueError, match="rank_tokens"):
        build_schedule(s, to_dev(np.zeros((2, 16, 2), np.int32)),
                       rank_tokens=to_dev(np.zeros(3, np.int32)))


def test_allocate_rejects_bad_geometry():
    cfg = MoKConfig(row_align=4, minibatch_size=16)
    with pytest.raises(ValueError, match="rank"):
        Schedule.allocate(rank=2, ep_size=2, tokens_per_rank=4, topk=1, num_experts=4, config=cfg)
    with pytest.raises(ValueError, match="num_experts"):
        Schedule.allocate(rank=0, ep_size=3, tokens_per_rank=4, topk=1, num_experts=4, config=cfg)


def _guard_schedule(s):
    """Swap the pull table for views into guard-padded buffers."""
    guards = {}
    for name in ("src_rank", "src_token", "src_slot"):
        full, view = guarded(s.capacity, np.int32, 0)
        guards[name] = full
        setattr(s, name, to_dev(view) if not SIM else view)
    return guards


@pytest.mark.parametrize("bad", [4, 99, -2, -1000])
def test_out_of_range_ids_flagged_and_skipped(bad):
    rng = np.random.default_rng(11)
    R, T, k, E = 2, 16, 2, 4
    ids = make_ids(rng, R, T, k, E, "uniform")
    ids[1, 5, 1] = bad
    ids[0, 0, 0] = bad
    s = _small_schedule()
    guards = _guard_schedule(s) if SIM else None
    build_schedule(s, to_dev(ids))
    with pytest.raises(MoKError, match=rf"expert id out of range.*{bad}"):
        s.check()
    got = s.to_host()
    ref = build_schedule_numpy(ids, 0, E // R, s.capacity, 4, minibatch_size=s.minibatch_size)
    assert_same(got, ref)                       # the valid routes are scheduled as usual
    assert got["errors"][err.FLAGS] == err.ERR_BAD_EXPERT_ID
    if guards:
        for full in guards.values():
            assert np.all(full[:64] == -777) and np.all(full[-64:] == -777)


def test_capacity_overflow_flagged_nothing_out_of_bounds():
    rng = np.random.default_rng(5)
    R, T, k, E = 2, 16, 2, 4
    ids = make_ids(rng, R, T, k, E, "one_expert")    # 64 routes to one expert
    ids[:] = 0                                       # ... on rank 0
    s = _small_schedule(capacity=32)
    guards = _guard_schedule(s) if SIM else None
    build_schedule(s, to_dev(ids))
    with pytest.raises(MoKError, match="capacity overflow: rank 0 needs 64 .* capacity is 32"):
        s.check()
    got = s.to_host()
    ref = build_schedule_numpy(ids, 0, E // R, 32, 4, minibatch_size=s.minibatch_size)
    assert_same(got, ref)
    assert np.all(got["src_rank"] >= 0)               # the 32 rows that fit are real routes
    assert (got["recv_row"] >= 0).sum() == 32
    assert got["num_rows"][0] == 32 and got["expert_offsets"].max() == 32   # clamped
    if guards:
        for full in guards.values():
            assert np.all(full[:64] == -777) and np.all(full[-64:] == -777)


def test_overflow_of_other_rank_is_reported_everywhere():
    R, T, k, E = 2, 16, 2, 4
    ids = np.full((R, T, k), 3, np.int32)             # all to expert 3 (rank 1)
    s = _small_schedule(capacity=32)
    build_schedule(s, to_dev(ids))
    with pytest.raises(MoKError, match="rank 1 needs 64"):
        s.check()
