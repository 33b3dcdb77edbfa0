"""Device error words: how kernels report bad input without a host sync.

Kernels never raise. When one meets bad data (an expert id out of range, more rows than the
schedule has room for, a peer that never signals) it sets bits and details in a small int32
device array, the *error word*, and carries on without writing out of bounds. The host reads
the word only when asked (``raise_if_set``, e.g. through ``Layer.check``: tests, debug mode, or
once per step if the caller wants), so the hot path stays free of synchronisation.

Layout (int32[ERROR_WORDS]); every detail slot is updated with an order-independent atomic
(max/min/or/add), or written with a value every writer agrees on, or written by the one thread
that holds the winning key, so the final word is deterministic however blocks interleave:

    [FLAGS]          bit set of ``ERR_*`` below
    [BAD_ID_MAX]     largest expert id seen that is >= num_experts (init INT32_MIN)
    [BAD_ID_MIN]     smallest expert id seen that is < -1 (init INT32_MAX)
    [OVERFLOW_ROWS]  most rows any rank needed (padded), when over capacity
    [OVERFLOW_RANK]  largest rank that overflowed
    [CAPACITY]       the capacity those rows were compared with
    [TIMEOUT_RANK]   rank whose wait timed out
    [TIMEOUT_COUNTER] id of the counter it waited on (see ``COUNTER_NAMES``)
    [TIMEOUT_EXPECTED] value it waited for
    [TIMEOUT_SEEN]   value it last saw
    [TIMEOUT_PEER]   peer rank the counter belongs to (-1 = local)
    [NAN_COUNT]      non-finite values seen by the checking kernels, all tensors together

Slots 12 on are 0 when clear (``reset`` needs no special value for them). "First" always
means the smallest index, kept as a *key* ``INT32_MAX - index`` under ``atomic.max`` (0: none
yet; ``from_key`` reads one back):

  Bad ids, checked on the source rank before the all-gather
  (``mok_comm.routing.check_and_publish_ids``):
    [BAD_ID_COUNT]   ids of this rank outside [-1, num_experts)
    [BAD_ID_FIRST]   key of the smallest flat index t*k + slot among them
    [BAD_ID_RANK]    the rank whose ids they are
    [BAD_ID_LIMIT]   num_experts they were checked against
    [BAD_ID_TOKEN], [BAD_ID_SLOT]        where the first one is (t, slot)
    [BAD_ID_VALUE_LO], [BAD_ID_VALUE_HI] its exact int64 value, low / high 32 bits
    [BAD_ID_DONE]    scratch: blocks of the checking launch that finished (the last one fills
                     TOKEN..VALUE_HI from the winning index, then puts it back to 0)
  Rank agreement (``mok_comm.routing.compare_fingerprints``):
    [MISMATCH_FIRST] key of field * R + rank, the first fingerprint entry that differs
                     (smallest field, then smallest rank)
    [MISMATCH_FIELD] that field (an index into ``FINGERPRINT_FIELDS``)
    [MISMATCH_RANK]  the rank that differs ...
    [MISMATCH_THEIRS] ... its value, and
    [MISMATCH_MINE]  this rank's value
    [MISMATCH_ME]    this rank
  Non-finite values (``mok_comm.dispatch.publish_x``: x, router weights, the backward's d_out;
  the grouped GEMMs' epilogues: their output tiles, ``mok_core.gemm``):
    [NONFINITE_RANK] the rank that saw them
    [NONFINITE + 2*tensor]      count of NaN/Inf in tensor ``tensor`` (``TENSOR_NAMES``)
    [NONFINITE + 2*tensor + 1]  key of the smallest token (row) holding one (GEMM outputs: the
                                smallest expert-sorted row)
    [NONFINITE_EXPERT + tensor] GEMM outputs: key of the smallest local expert holding one
  (GEMM counts are over the rows the GEMM writes, an expert's padding rows included: a NaN
  weight reaches those too.)
"""
from __future__ import annotations

import numpy as np

ERR_BAD_EXPERT_ID = 1
ERR_CAPACITY_OVERFLOW = 2
ERR_SPIN_TIMEOUT = 4
ERR_NON_FINITE = 8
ERR_RANK_MISMATCH = 16

FLAGS = 0
BAD_ID_MAX = 1
BAD_ID_MIN = 2
OVERFLOW_ROWS = 3
OVERFLOW_RANK = 4
CAPACITY = 5
TIMEOUT_RANK = 6
TIMEOUT_COUNTER = 7
TIMEOUT_EXPECTED = 8
TIMEOUT_SEEN = 9
TIMEOUT_PEER = 10
NAN_COUNT = 11
BAD_ID_COUNT = 12
BAD_ID_FIRST = 13
BAD_ID_RANK = 14
BAD_ID_LIMIT = 15
BAD_ID_TOKEN = 16
BAD_ID_SLOT = 17
BAD_ID_VALUE_LO = 18
BAD_ID_VALUE_HI = 19
BAD_ID_DONE = 20
MISMATCH_FIRST = 21
MISMATCH_FIELD = 22
MISMATCH_RANK = 23
MISMATCH_THEIRS = 24
MISMATCH_MINE = 25
MISMATCH_ME = 26
NONFINITE_RANK = 27
NONFINITE = 28                  # 2 slots per tensor id, NONFINITE_TENSORS of them
NONFINITE_TENSORS = 12
NONFINITE_EXPERT = NONFINITE + 2 * NONFINITE_TENSORS     # 1 slot per tensor id
ERROR_WORDS = NONFINITE_EXPERT + NONFINITE_TENSORS       # 64

INT32_MIN = -(1 << 31)
INT32_MAX = (1 << 31) - 1

# The int32 id the source rank's check writes in place of a bad id (it has counted and located
# it in its own word): the schedule skips it without reporting it again. An int64 id such as
# 2**32 + 1 is therefore never narrowed into a valid one.
ID_REPORTED = INT32_MIN

# Names of the counters a kernel may spin on, indexed by the id stored in TIMEOUT_COUNTER
# (the grid barrier's flags are the only one now: mok_comm.barrier.COUNTER_BARRIER).
COUNTER_NAMES = {0: "barrier"}

# Tensor ids of the non-finite slots. 0 and 1 are checked by the forward's ``publish_x``, 2 by
# the backward's; 3-6 are the output tiles of the forward's four GEMMs, 7-11 the backward's.
NF_X = 0
NF_ROUTER_WEIGHTS = 1
NF_D_OUT = 2
NF_HIDDEN = 3                   # routed gate/up + SwiGLU output
NF_Y = 4                        # routed down output (written, or pushed to the combine)
NF_SHARED_HIDDEN = 5
NF_SHARED_Y = 6
NF_D_HIDDEN = 7                 # routed d_out W_down (before the router weight)
NF_D_X_ROUTED = 8               # routed d_gate W_gate + d_up W_up (pushed home)
NF_SHARED_D_HIDDEN = 9
NF_SHARED_D_X = 10
NF_WEIGHT_GRADS = 11            # any weight gradient (row = output row, expert = local expert)
TENSOR_NAMES = {NF_X: "x", NF_ROUTER_WEIGHTS: "router_weights", NF_D_OUT: "d_out",
                NF_HIDDEN: "routed gate/up output (hidden)", NF_Y: "routed down output (y)",
                NF_SHARED_HIDDEN: "shared gate/up output", NF_SHARED_Y: "shared down output",
                NF_D_HIDDEN: "routed d_out . w_down (backward)",
                NF_D_X_ROUTED: "routed d_x (backward)",
                NF_SHARED_D_HIDDEN: "shared d_out . w_shared_down (backward)",
                NF_SHARED_D_X: "shared d_x (backward)", NF_WEIGHT_GRADS: "weight gradients"}
INPUT_TENSORS = (NF_X, NF_ROUTER_WEIGHTS, NF_D_OUT)
# GEMM outputs reported per local expert and expert-sorted row (the others by token).
ROUTED_TENSORS = (NF_HIDDEN, NF_Y, NF_D_HIDDEN, NF_D_X_ROUTED, NF_WEIGHT_GRADS)
# GEMM outputs: the weights that made them, and the tensors upstream of them in the step (a
# NaN/Inf there explains this one).
GEMM_WEIGHTS = {NF_HIDDEN: "w_gate/w_up", NF_Y: "w_down",
                NF_SHARED_HIDDEN: "w_shared_gate/w_shared_up", NF_SHARED_Y: "w_shared_down",
                NF_D_HIDDEN: "w_down", NF_D_X_ROUTED: "w_gate/w_up",
                NF_SHARED_D_HIDDEN: "w_shared_down", NF_SHARED_D_X: "w_shared_gate/w_shared_up"}
GEMM_UPSTREAM = {NF_HIDDEN: (NF_X,), NF_Y: (NF_X, NF_HIDDEN), NF_SHARED_HIDDEN: (NF_X,),
                 NF_SHARED_Y: (NF_X, NF_SHARED_HIDDEN), NF_D_HIDDEN: (NF_D_OUT,),
                 NF_D_X_ROUTED: (NF_X, NF_D_OUT, NF_HIDDEN, NF_D_HIDDEN),
                 NF_SHARED_D_HIDDEN: (NF_D_OUT,),
                 NF_SHARED_D_X: (NF_X, NF_D_OUT, NF_SHARED_HIDDEN, NF_SHARED_D_HIDDEN),
                 NF_WEIGHT_GRADS: (NF_X, NF_D_OUT, NF_HIDDEN, NF_D_HIDDEN, NF_SHARED_HIDDEN)}

# The layer's fingerprint (``mok_comm.layer.Layer``), entry by entry: every rank pushes these
# values and compares them with every other rank's. Entries in ``FINGERPRINT_DIGESTS`` are
# CRC digests of an object (named there); ``FINGERPRINT_SCALE`` entries are value * scale.
FINGERPRINT_FIELDS = ("hidden", "intermediate", "shared_intermediate", "num_experts", "topk",
                      "ep_size", "tokens_per_rank", "row_align", "minibatch_size",
                      "capacity_factor", "config", "gemm", "gemm_down", "swiglu_limit",
                      "backward")
FINGERPRINT_DIGESTS = {"config": "MoKConfig", "gemm": "gate/up GemmConfig",
                       "gemm_down": "down GemmConfig", "swiglu_limit": "swiglu_limit"}
FINGERPRINT_SCALE = {"capacity_factor": 1_000_000}


class MoKError(RuntimeError):
    """Bad input or a failed cross-rank protocol, detected on the device."""


def from_key(key: int) -> int | None:
    """The index a first-index slot holds, None when none was recorded."""
    return INT32_MAX - int(key) if int(key) else None


def initial_error_word() -> np.ndarray:
    """Host image of a cleared error word (upload it, or fill on device with ``reset``)."""
    w = np.zeros(ERROR_WORDS, dtype=np.int32)
    w[BAD_ID_MAX] = INT32_MIN
    w[BAD_ID_MIN] = INT32_MAX
    w[TIMEOUT_PEER] = -1
    return w


def _bad_id_messages(w, num_experts):
    """The source rank's exact report, else the schedule's backstop (ids that reached it
    without the source's check: ``build_schedule`` called directly)."""
    first = from_key(w[BAD_ID_FIRST])
    if first is not None:
        value = (int(w[BAD_ID_VALUE_HI]) << 32) | (int(w[BAD_ID_VALUE_LO]) & 0xFFFFFFFF)
        n = int(w[BAD_ID_COUNT])
        rest = ("1 bad id in all, that route was skipped" if n == 1 else
                f"{n} bad ids in all, those routes were skipped")
        return [f"expert id out of range on rank {int(w[BAD_ID_RANK])}: "
                f"topk_ids[{int(w[BAD_ID_TOKEN])}, {int(w[BAD_ID_SLOT])}] = {value} "
                f"(valid: 0..{int(w[BAD_ID_LIMIT]) - 1} or -1 for a masked route); {rest}"]
    parts = []
    if int(w[BAD_ID_MAX]) != INT32_MIN:
        parts.append(f"largest bad id {int(w[BAD_ID_MAX])}")
    if int(w[BAD_ID_MIN]) != INT32_MAX:
        parts.append(f"smallest bad id {int(w[BAD_ID_MIN])}")
    rng = f"[0, {num_experts})" if num_experts is not None else "[0, num_experts)"
    return [f"expert id out of range in the gathered routing table: ids must be in {rng} or "
            "-1 (masked route); " + ", ".join(parts) + "; those routes were skipped"]


def _fingerprint_value(name: str, v: int) -> str:
    scale = FINGERPRINT_SCALE.get(name)
    return f"{v / scale:g}" if scale else str(v)


def _mismatch_message(w) -> str:
    key = from_key(w[MISMATCH_FIRST])
    if key is None:
        return "ranks disagree on the layer's shapes/config"
    f, other, me = int(w[MISMATCH_FIELD]), int(w[MISMATCH_RANK]), int(w[MISMATCH_ME])
    theirs, mine = int(w[MISMATCH_THEIRS]), int(w[MISMATCH_MINE])
    name = FINGERPRINT_FIELDS[f] if 0 <= f < len(FINGERPRINT_FIELDS) else f"field#{f}"
    if name in FINGERPRINT_DIGESTS:
        return (f"ranks disagree on the layer's setup: rank {other} has a different "
                f"{FINGERPRINT_DIGESTS[name]} than rank {me} (digest {theirs:#x} vs {mine:#x})")
    return (f"ranks disagree on the layer's setup: rank {other} has "
            f"{name}={_fingerprint_value(name, theirs)}, rank {me} has "
            f"{_fingerprint_value(name, mine)}")


def _values(n: int) -> str:
    return f"{n} NaN/Inf value{'s' if n != 1 else ''}"


def _gemm_non_finite_message(w, counts) -> str | None:
    """The GEMM output tensors that held NaN/Inf: count, first local expert and row, and what
    to check (the tensor's weights, unless a tensor upstream of it in this word explains it)."""
    parts = []
    for t in range(NONFINITE_TENSORS):
        if t in INPUT_TENSORS or not counts[t]:
            continue
        name = TENSOR_NAMES.get(t, f"tensor#{t}")
        row = from_key(w[NONFINITE + 2 * t + 1])
        expert = from_key(w[NONFINITE_EXPERT + t])
        where = f"token {row}"                      # the shared expert's rows are tokens
        if t == NF_WEIGHT_GRADS:
            where = f"local expert {expert} (row {row} of a gradient; the shared expert's: 0)"
        elif t in ROUTED_TENSORS:
            where = f"local expert {expert} (expert-sorted row {row})"
        part = f"{name} has {_values(counts[t])}, first at {where}"
        upstream = [u for u in GEMM_UPSTREAM.get(t, ()) if counts[u]]
        if upstream:
            part += " -- downstream of the NaN/Inf in " + TENSOR_NAMES[upstream[-1]]
        elif t in (NF_HIDDEN, NF_D_HIDDEN):   # rows come from every rank: x / d_out may be a
            part += (f" -- check {GEMM_WEIGHTS[t]} of that expert (or a token routed to it)")
        elif t in GEMM_WEIGHTS:
            of = " of that expert" if t in ROUTED_TENSORS else ""
            part += f" -- check {GEMM_WEIGHTS[t]}{of}"
        parts.append(part)
    if not parts:
        return None
    return f"non-finite values on rank {int(w[NONFINITE_RANK])}: " + "; ".join(parts)


def _non_finite_messages(w) -> list[str]:
    counts = {t: int(w[NONFINITE + 2 * t]) for t in range(NONFINITE_TENSORS)}
    if not any(counts.values()):            # recorded by a kernel that names no tensor
        return [f"non-finite input: {int(w[NAN_COUNT])} NaN/Inf values seen"]
    gemm = _gemm_non_finite_message(w, counts)
    if not any(counts[t] for t in INPUT_TENSORS):
        return [gemm]
    return [_non_finite_input_message(w, counts)] + ([gemm] if gemm else [])


def _non_finite_input_message(w, counts) -> str:
    shown = [t for t in INPUT_TENSORS if counts[t]]
    if counts[NF_X] or counts[NF_ROUTER_WEIGHTS]:           # publish_x checks both: say so
        shown = sorted(set(shown) | {NF_X, NF_ROUTER_WEIGHTS})
    parts = []
    for t in shown:
        name = TENSOR_NAMES.get(t, f"tensor#{t}")
        n = counts[t]
        if not n:
            parts.append(f"{name} has 0")
            continue
        first = from_key(w[NONFINITE + 2 * t + 1])
        parts.append(f"{name} has {n} NaN/Inf value{'s' if n != 1 else ''}, first at token {first}")
    return f"non-finite input on rank {int(w[NONFINITE_RANK])}: " + "; ".join(parts)


def describe(word: np.ndarray, *, num_experts: int | None = None) -> list[str]:
    """Human-readable messages for every flag set in a host copy of an error word."""
    w = np.asarray(word)
    flags = int(w[FLAGS])
    msgs = []
    if flags & ERR_BAD_EXPERT_ID:
        msgs += _bad_id_messages(w, num_experts)
    if flags & ERR_CAPACITY_OVERFLOW:
        msgs.append(f"schedule capacity overflow: rank {int(w[OVERFLOW_RANK])} needs "
                    f"{int(w[OVERFLOW_ROWS])} padded rows but capacity is {int(w[CAPACITY])}; "
                    "raise MoKConfig.capacity_factor (1.0 never overflows); rows past capacity "
                    "were not written")
    if flags & ERR_SPIN_TIMEOUT:
        name = COUNTER_NAMES.get(int(w[TIMEOUT_COUNTER]), f"counter#{int(w[TIMEOUT_COUNTER])}")
        peer = int(w[TIMEOUT_PEER])
        where = f" of peer rank {peer}" if peer >= 0 else ""
        msgs.append(f"spin-wait timeout on rank {int(w[TIMEOUT_RANK])}: counter '{name}'{where} "
                    f"expected >= {int(w[TIMEOUT_EXPECTED])}, saw {int(w[TIMEOUT_SEEN])} "
                    "(a peer never arrived, or it failed earlier)")
    if flags & ERR_NON_FINITE:
        msgs += _non_finite_messages(w)
    if flags & ERR_RANK_MISMATCH:
        msgs.append(_mismatch_message(w))
    return msgs


def raise_if_set(word: np.ndarray, *, context: str = "", num_experts: int | None = None) -> None:
    """Raise ``MoKError`` listing every problem recorded in a host copy of an error word."""
    msgs = describe(word, num_experts=num_experts)
    if msgs:
        prefix = f"{context}: " if context else ""
        raise MoKError(prefix + "; ".join(msgs))
