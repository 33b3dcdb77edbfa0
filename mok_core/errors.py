"""Device error words: how kernels report bad input without a host sync.

Kernels never raise. When one meets bad data (an expert id out of range, more rows than the
schedule has room for, a peer that never signals) it sets bits and details in a small int32
device array, the *error word*, and carries on without writing out of bounds. The host reads
the word only when asked (``check_errors``: tests, debug mode, or once per step if the caller
wants), so the hot path stays free of synchronisation.

Layout (int32[ERROR_WORDS]); every detail slot is updated with an order-independent atomic
(max/min/or), so the final word is deterministic however blocks interleave:

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
    [NAN_COUNT]      non-finite values seen by a checking kernel
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
ERROR_WORDS = 16

INT32_MIN = -(1 << 31)
INT32_MAX = (1 << 31) - 1

# Names of the counters a kernel may spin on, indexed by the id stored in TIMEOUT_COUNTER
# (the grid barrier's flags are the only one now: mok_comm.barrier.COUNTER_BARRIER).
COUNTER_NAMES = {0: "barrier"}


class MoKError(RuntimeError):
    """Bad input or a failed cross-rank protocol, detected on the device."""


def initial_error_word() -> np.ndarray:
    """Host image of a cleared error word (upload it, or fill on device with ``reset``)."""
    w = np.zeros(ERROR_WORDS, dtype=np.int32)
    w[BAD_ID_MAX] = INT32_MIN
    w[BAD_ID_MIN] = INT32_MAX
    w[TIMEOUT_PEER] = -1
    return w


def describe(word: np.ndarray, *, num_experts: int | None = None) -> list[str]:
    """Human-readable messages for every flag set in a host copy of an error word."""
    w = np.asarray(word)
    flags = int(w[FLAGS])
    msgs = []
    if flags & ERR_BAD_EXPERT_ID:
        parts = []
        if int(w[BAD_ID_MAX]) != INT32_MIN:
            parts.append(f"largest bad id {int(w[BAD_ID_MAX])}")
        if int(w[BAD_ID_MIN]) != INT32_MAX:
            parts.append(f"smallest bad id {int(w[BAD_ID_MIN])}")
        rng = f"[0, {num_experts})" if num_experts is not None else "[0, num_experts)"
        msgs.append(f"expert id out of range: ids must be in {rng} or -1 (masked route); "
                    + ", ".join(parts) + "; those routes were skipped")
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
        msgs.append(f"non-finite input: {int(w[NAN_COUNT])} NaN/Inf values seen")
    if flags & ERR_RANK_MISMATCH:
        msgs.append("ranks disagree on the layer's shapes/config")
    return msgs


def raise_if_set(word: np.ndarray, *, context: str = "", num_experts: int | None = None) -> None:
    """Raise ``MoKError`` listing every problem recorded in a host copy of an error word."""
    msgs = describe(word, num_experts=num_experts)
    if msgs:
        prefix = f"{context}: " if context else ""
        raise MoKError(prefix + "; ".join(msgs))
