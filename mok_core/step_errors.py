"""Per-step error reports that reach the host without a host sync.

Kernels record problems in device error words (``mok_core.errors``). A layer's words are
cleared on the stream when a step starts (``begin``) and, when it ends (``end``), copied
asynchronously into a slot of a pinned host ring, followed by an event. Nothing waits for the
copy: the next call on the layer first reads every slot whose event has completed
(``poll``: ``event.query()``, which never blocks) and raises ``MoKError`` for the first
finished step that recorded a problem, naming it. ``wait`` (what ``Layer.check`` does) first
waits for every step in flight. Everything is launched on the caller's stream, so a step
captured in a CUDA graph reports the same way (the graphed step runs ``begin`` and ``end`` in
its eager phases).

``MoKConfig.errors`` picks how soon a problem surfaces:
    "deferred"  as above (the default): at the next call, or at ``check``;
    "sync"      the host waits for each step's copy at its end and raises at once (debugging);
    "trap"      a one-thread kernel after each phase traps when a flag is set: the CUDA
                context dies at once, as MoK's kernels do (on the simulator: ``MoKError``).

The ring holds ``SLOTS`` steps; a caller that runs that far ahead of the GPU waits for the
oldest step's copy (the only wait ``end`` ever does), so memory stays bounded however many steps
run.

A step captured into a CUDA graph by the caller (``torch.cuda.graph`` around a forward and
backward, say) copies its words into one of ``CAPTURE_SLOTS`` slots of its own at every
replay, with an event recorded as an external graph node; ``poll`` and ``check`` read every
captured slot whose event has completed -- the report of that graph's latest replay (a clean
replay overwrites a bad one's report).
"""
from __future__ import annotations

from collections import deque

import numpy as np
from numba import cuda

from . import errors as err
from .cuda_compat import SIM, kjit, launch
from .errors_kernels import reset_error_word
from .intrinsics import trap

SLOTS = 64
CAPTURE_SLOTS = 8


@kjit
def _trap_if_flagged(a, b):
    if a[err.FLAGS] != 0 or b[err.FLAGS] != 0:
        trap()


def _driver_handle(obj, cls):
    """A numba event's or stream's handle as cuda.bindings' ``cls`` (CUevent, CUstream)."""
    h = obj.handle
    return h if isinstance(h, cls) else cls(int(getattr(h, "value", h) or 0))


def _completed(event) -> bool:
    """``event`` has completed (cuEventQuery straight from cuda.bindings: numba's
    ``Event.query`` logs every NOT_READY answer at error level)."""
    from cuda.bindings import driver as cu
    res, = cu.cuEventQuery(_driver_handle(event, cu.CUevent))
    if res == cu.CUresult.CUDA_ERROR_NOT_READY:
        return False
    if res != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuEventQuery failed: {res}")
    return True


def capturing(stream) -> bool:
    """``stream`` is being captured into a CUDA graph (then nothing may query events: under
    torch's default capture mode the query would invalidate the capture)."""
    if SIM or not stream:
        return False                      # (the legacy default stream is never captured)
    from cuda.bindings import driver as cu
    res, status = cu.cuStreamIsCapturing(_driver_handle(stream, cu.CUstream))
    if res != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuStreamIsCapturing failed: {res}")
    return status != cu.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE


class StepErrors:
    """The error words of one layer on one rank and their per-step host copies.

    ``words``: the device error words a step writes (int32 [ERROR_WORDS] each);
    ``describe``: host word -> messages (``errors.describe`` with the layer's facts);
    ``rank``: for the messages; ``mode``: one of ``config.ERROR_MODES``."""

    def __init__(self, words, *, describe, rank: int, mode: str):
        self.words, self.describe, self.rank, self.mode = tuple(words), describe, rank, mode
        self.slots = SLOTS
        shape = (self.slots, len(self.words), err.ERROR_WORDS)
        self.host = np.zeros(shape, np.int32) if SIM else cuda.pinned_array(shape, np.int32)
        self.events = [None if SIM else cuda.event(timing=False) for _ in range(self.slots)]
        self.pending = deque()            # (step number, slot) copied but not yet read
        self.steps = 0                    # steps ended on this layer
        cap = (CAPTURE_SLOTS, len(self.words), err.ERROR_WORDS)
        self.captured_host = np.zeros(cap, np.int32) if SIM else cuda.pinned_array(cap, np.int32)
        self.captured_events = [None if SIM else cuda.event(timing=False)
                                for _ in range(CAPTURE_SLOTS)]
        self.captured = []                # capture slots in use (graphs captured so far)

    def begin(self, stream=0) -> None:
        """Launch: clear the words (a step's report holds that step's problems only)."""
        for w in self.words:
            reset_error_word(w, stream)

    def trap_check(self, stream=0) -> None:
        """Launch (mode "trap"): abort the context if any word has a flag set."""
        if SIM:
            self._raise_if_flagged(f"step {self.steps + 1}", [np.asarray(w) for w in self.words])
            return
        a, b = (self.words * 2)[:2]
        launch(_trap_if_flagged, 1, 1, stream, 0, a, b)

    def end(self, stream=0) -> None:
        """Launch: copy the words into the next ring slot and record its event; "sync" mode
        then waits for it and raises at once. Under a capture: into a capture slot (module
        docstring)."""
        if capturing(stream):
            self._end_captured(stream)
            return
        if len(self.pending) == self.slots:   # the host is that far ahead: wait for the oldest
            self._read(block=True, limit=1)
        self.steps += 1
        slot = self.steps % self.slots
        for i, w in enumerate(self.words):
            if SIM:
                self.host[slot, i] = np.asarray(w)
            else:
                w.copy_to_host(self.host[slot, i], stream=stream)
        if not SIM:
            self.events[slot].record(stream)
        self.pending.append((self.steps, slot))
        if self.mode == "sync":
            self.poll(block=True)

    def _end_captured(self, stream) -> None:
        from cuda.bindings import driver as cu
        slot = len(self.captured) % CAPTURE_SLOTS
        if slot not in self.captured:
            self.captured.append(slot)
        for i, w in enumerate(self.words):
            w.copy_to_host(self.captured_host[slot, i], stream=stream)
        # an external record node: the event is recorded at every replay (a plain record
        # inside a capture is only a dependency edge, never recorded)
        res, = cu.cuEventRecordWithFlags(_driver_handle(self.captured_events[slot], cu.CUevent),
                                         _driver_handle(stream, cu.CUstream),
                                         cu.CUevent_record_flags.CU_EVENT_RECORD_EXTERNAL)
        if res != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuEventRecordWithFlags failed: {res}")

    def _read_captured(self, block: bool) -> None:
        for slot in self.captured:
            event = self.captured_events[slot]
            if block:
                event.synchronize()
            elif not _completed(event):
                continue
            self._raise_if_flagged("a graph replay of a captured step",
                                   self.captured_host[slot])

    def poll(self, block: bool = False, stream=None) -> None:
        """Raise ``MoKError`` for the first finished step that recorded a problem (its report is
        consumed: the next call goes on). ``block``: wait for every step in flight first.
        A call launching on ``stream`` while it is being captured reads nothing (the steps
        in flight are read at the first call after the capture)."""
        if stream is not None and not block and capturing(stream):
            return
        self._read(block=block, limit=len(self.pending))
        self._read_captured(block)

    def _read(self, *, block: bool, limit: int) -> None:
        for _ in range(limit):
            step, slot = self.pending[0]
            event = self.events[slot]
            if event is not None and not block and not _completed(event):
                return                    # later steps are not done either (one stream)
            if event is not None and block:
                event.synchronize()
            self.pending.popleft()
            self._raise_if_flagged(f"step {step}", self.host[slot])

    def _raise_if_flagged(self, which: str, words) -> None:
        """MoKError naming ``which`` step ("step 3") if ``words`` hold a problem."""
        msgs = [m for w in words for m in self.describe(w)]
        if msgs:
            raise err.MoKError(f"{which} of this layer (rank {self.rank}): " + "; ".join(msgs))
