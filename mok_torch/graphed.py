"""The layer step as a CUDA graph with fresh inputs every call: MoK-Py's fast path.

    step = mok_torch.compile_step(config, lw, w_shared_gate, w_shared_up, w_shared_down,
                                  w_gate, w_up, w_down, swiglu_limit=None)
    out = step(x, topk_ids, router_weights)       # each training step, NEW tensors are fine

``out`` equals ``build_schedule`` + ``forward``'s output bit for bit (same kernels, same data).
The eager pair issues ~22 Numba launches per step and is host-bound (Python launch overhead
exceeds the GPU time at training sizes); here most of them are one graph replay.

What runs how (all on torch's current stream, nothing waits for the host):

    eager prologue   routing all-gather (int64 ids -> int32 first) + publish_x: x -> this
                     rank's slice of the symmetric staging buffer (``lw.comm.x_buf``) and the
                     NaN/Inf check of x and router_weights. Reads the caller's x / ids / weights.
    graph (captured  barrier | schedule, shared gate/up + down reading ``x_buf`` (not the
      once)          caller's x) | barrier | dispatch, gather index, routed gate/up, routed down,
                     combine | barrier. Reads only the workspace and the layer weights.
                     (``dispatch="split"``: the shared FFN after the barrier, beside the
                     copy engine's half of the dispatch.)
    eager epilogue   out = y_shared + sum_j w_j y_j into a fresh bf16 [T, H] tensor; reads the
                     caller's router_weights.

So the graph holds no pointer to x, topk_ids or router_weights: callers pass new tensors every
step. It does hold the workspace's buffers and the weight pointers. Weights updated in place
(optimizer step, ``copy_``) are simply read by the next replay. A weight *replaced* (a tensor
given to ``set_weights``, or ``param.data = other`` on a tensor this step holds -- it keeps the
caller's tensor objects, not detached copies) is caught by a per-call comparison of every
weight's (data_ptr, shape, stride, dtype, device): the next call runs the core eagerly and
captures it again. The graph is tied to ``lw``: do not use the step after ``lw.comm.free()``.

First call (and after a recapture): the core runs eagerly -- that step's result, and the warm-up
that makes Numba compile and load every kernel outside the capture -- and then the core is
captured (``torch.cuda.graph``: a device synchronisation and ``empty_cache`` at that point
only). Capturing launches nothing, so a rank that recaptures while others replay is fine.

Why ``publish_x`` may run before the first barrier (eager ``forward`` runs it after the
schedule barrier). Readers of this rank's ``x_buf``: (a) peers' dispatch of the same step, which
starts after barrier 2 -- we published before barrier 1, so even earlier than eager does;
(b) our own shared FFN and routed gate/up (local tokens are read in place from ``x_buf``) --
same stream, before our barrier 3. The one new risk is write-after-read across steps: our
publish_x of step N+1 overwriting tokens a peer is still pulling for step N. It cannot: a
peer's dispatch of step N is stream-ordered before its arrival at barrier 3 of step N; we pass
our barrier 3 of step N only after every peer has arrived there, and our publish_x of step N+1
comes after that barrier on our stream (then epilogue N, then prologue N+1). The routing publish
is first in both orders, so its argument is the eager one. The step keeps the eager path's
three barriers (the middle one is not needed for data in this order, but keeping it makes eager
steps, graph replays and plain ``forward`` interchangeable step by step and rank by rank: in
each pairing every x is published before barrier 2 and overwritten only after barrier 3).

Under the CUDA simulator there are no CUDA graphs: the same pieces run eagerly in the same order
(the core's launches are built once per weight set, like a capture, so CI exercises the
ordering, the data flow through ``x_buf`` and the weight-swap detection).
"""
from __future__ import annotations

import torch

from mok_comm import functional as F
from mok_core.config import MoKConfig
from mok_core.cuda_compat import SIM, as_device_array

from .functional import _bits, _check, _ids, _stream

_WEIGHT_NAMES = ("w_shared_gate", "w_shared_up", "w_shared_down", "w_gate", "w_up", "w_down")


def compile_step(config: MoKConfig, lw: F.LayerWorkspace, w_shared_gate, w_shared_up,
                 w_shared_down, w_gate, w_up, w_down, swiglu_limit=None) -> "LayerStep":
    """A ``LayerStep`` for this rank's weights (shapes and dtypes as in ``mok_torch.forward``;
    the shared ones may be None when the shape has no shared expert). Checks everything now;
    the graph is captured on the first call."""
    return LayerStep(config, lw, (w_shared_gate, w_shared_up, w_shared_down, w_gate, w_up,
                                  w_down), swiglu_limit)


class LayerStep:
    """``step(x, topk_ids, router_weights) -> out`` (also callable directly); see the module
    docstring. ``captures`` counts (re)builds of the core (graph captures on a GPU)."""

    def __init__(self, config: MoKConfig, lw: F.LayerWorkspace, weights, swiglu_limit=None):
        self.config, self.lw, self.swiglu_limit = config, lw, swiglu_limit
        self._weights = list(weights)
        self._sig = None          # weight signature the current core / graph was built for
        self._views = None
        self._graph = None
        self._core = None         # simulator: the core's launches, built once per weight set
        self._retired = None      # replaced graph + weight views, kept until the next capture
        self.captures = 0
        self._prepare()           # fail fast on bad weights, config or limit

    def set_weights(self, **weights) -> None:
        """Replace some weights (by name: w_shared_gate ... w_down); the next call recaptures."""
        for name, t in weights.items():
            if name not in _WEIGHT_NAMES:
                raise TypeError(f"set_weights: unknown weight {name!r}")
            self._weights[_WEIGHT_NAMES.index(name)] = t
        self._prepare()

    def context(self) -> F.ForwardContext:
        """The forward context of the last step (views into the workspace)."""
        return F.context_of(self.lw)

    def _signature(self):
        return tuple(None if t is None else
                     (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device)
                     for t in self._weights)

    def _prepare(self) -> None:
        """Check the weights and take uint16 views of them; drop the graph (rebuilt lazily)."""
        has_shared = bool(self.lw.shape.shared_intermediate)
        # numba views now, outside any capture (they keep the tensors' storage alive as long
        # as the graph that bakes their pointers)
        views = [(as_device_array(_bits(t, n), n) if (has_shared or i >= 3) else None)
                 for i, (t, n) in enumerate(zip(self._weights, _WEIGHT_NAMES))]
        self._core_phases(views, 0)   # shapes, config, swiglu_limit: checked, nothing launched
        if self._graph is not None:
            # replays of the old graph may still run and read the old weights: keep both
            # alive until the next capture (torch.cuda.graph synchronises the device first)
            self._retired = (self._graph, self._views)
        self._views, self._sig = views, self._signature()
        self._graph = self._core = None

    def _core_phases(self, views, stream):
        return F.step_core_phases(self.config, self.lw, *views, self.swiglu_limit, stream)

    def _capture(self) -> None:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            s = _stream()                                   # the capture stream
            F.run_step_core(self._core_phases(self._views, s), self.lw.comm, s)
        self._graph, self._retired = graph, None
        self.captures += 1

    def step(self, x: torch.Tensor, topk_ids: torch.Tensor,
             router_weights: torch.Tensor) -> torch.Tensor:
        """x [T, H] bf16, topk_ids [T, k] int64/int32 (-1 = masked), router_weights [T, k] f32
        -> out [T, H] bf16, a fresh tensor. Everything is checked before anything launches."""
        lw = self.lw
        s = _stream()
        ids = _ids(topk_ids)
        xb = _bits(x, "x")
        w = _check(router_weights, "router_weights", torch.float32)
        out = torch.empty((lw.tokens_per_rank, lw.shape.hidden), dtype=torch.bfloat16,
                          device=xb.device)
        prologue, epilogue, _ = F.step_io(lw, ids, xb, w, out.view(torch.uint16), s)
        if self._signature() != self._sig:                 # a weight tensor was replaced
            self._prepare()
        prologue()
        if SIM:
            if self._core is None:
                self._core = self._core_phases(self._views, s)
                self.captures += 1
            F.run_step_core(self._core, lw.comm, s)
            epilogue()
        elif self._graph is None:
            # Eager core: this step's result and the warm-up (Numba compiles and loads modules
            # here, never during the capture); then capture the core for the next calls.
            F.run_step_core(self._core_phases(self._views, s), lw.comm, s)
            epilogue()
            self._capture()
        else:
            self._graph.replay()
            epilogue()
        return out

    __call__ = step


__all__ = ["LayerStep", "compile_step"]
