"""The layer step as a CUDA graph with fresh inputs every call: MoK-Py's fast path.

    step = layer.compile(weights)                 # mok_torch.Layer, Weights of this rank
    out = step(x, topk_ids, router_weights)       # each training step, NEW tensors are fine

``out`` equals the eager step's bit for bit: the same phases of ``mok_comm.functional`` in the
same order. The eager step issues a few dozen Numba launches and is host-bound at training
sizes; here most of them are one graph replay.

What runs how (all on torch's current stream, nothing waits for the host):

    eager phase 0    ids checked, narrowed and all-gathered + publish_x: x -> this
                     rank's slice of the symmetric staging buffer (``x_buf``) and the NaN/Inf
                     check of x and router_weights. Reads the caller's x / ids / weights.
    graph (captured  barrier | phase 1 | barrier | phase 2 | barrier (``functional.run_core``):
      once)          schedule, shared expert FFN on ``x_buf``, dispatch, routed FFN, combine.
                     Reads only the layer's buffers and the weights.
    eager phase 3    out = y_shared + sum_j w_j y_j into a fresh bf16 [T, H] tensor; reads the
                     caller's router_weights.

So the graph holds no pointer to x, topk_ids or router_weights: callers pass new tensors every
step. It does hold the workspace's buffers and the weight pointers. Weights updated in place
(optimizer step, ``copy_``) are simply read by the next replay (an FP8 layer given bf16
weights quantises them again first, eagerly, into the same arrays: ``Layer.with_fp8``). A
weight *replaced* (a tensor given to ``set_weights``, or ``param.data = other`` on a tensor
this step holds -- it keeps the caller's tensor objects, not detached copies) is caught by a
per-call comparison of every weight's (data_ptr, shape, stride, dtype, device): the next call
runs the core eagerly and captures it again. The graph is tied to the layer: do not use the
step after ``layer.comm.free()``.

First call (and after a recapture): the core runs eagerly -- that step's result, and the warm-up
that makes Numba compile and load every kernel outside the capture -- and then the core is
captured (``torch.cuda.graph``: a device synchronisation and ``empty_cache`` at that point
only). Capturing launches nothing, so a rank that recaptures while others replay is fine.

Why phase 0 may publish x before the first barrier, and why the graph keeps three barriers:
``mok_comm.functional``'s docstring (the ordering duties of each barrier).

Under the CUDA simulator there are no CUDA graphs: the same pieces run eagerly in the same order
(the core's launches are built once per weight set, like a capture, so CI exercises the
ordering, the data flow through ``x_buf`` and the weight-swap detection).
"""
from __future__ import annotations

import torch

from mok_comm import functional as F
from mok_core.cuda_compat import SIM, names_rank

from .layer import (Layer, WeightsFP8, current_stream, inputs_key, tensor_view,
                    weight_views)


class CompiledStep:
    """``step(x, topk_ids, router_weights) -> out`` (also callable directly); see the module
    docstring. ``captures`` counts (re)builds of the core (graph captures on a GPU)."""

    def __init__(self, layer: Layer, weights):
        self.layer = layer
        self._weights = list(weights)
        self._sig = None          # weight signature the current core / graph was built for
        self._views = None
        self._graph = None
        self._core = None         # simulator: the core's launches, built once per weight set
        self._retired = None      # replaced graph + weight views, kept until the next capture
        self.captures = 0
        self._prepare()           # fail fast on bad weights

    def set_weights(self, **weights) -> None:
        """Replace some weights (by name: w_shared_gate ... w_down, and fp8 for a
        ``WeightsFP8``); the next call recaptures."""
        fields = WeightsFP8._fields[:len(self._weights)]
        new = list(self._weights)
        for name, t in weights.items():
            if name not in fields:
                raise TypeError(f"set_weights: unknown weight {name!r}")
            new[fields.index(name)] = t
        self._prepare(new)                # (a bad one leaves the step as it was)

    def _signature(self):
        w = self._weights
        fp8 = tuple(w[6]) if len(w) == 7 and w[6] is not None else ()
        return tuple(None if t is None else
                     (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device)
                     for t in (*w[:6], *fp8))

    @property
    def rank(self) -> int:
        return self.layer.rank

    @names_rank
    def _prepare(self, weights=None) -> None:
        """Check ``weights`` (default: the current ones), make them the step's and take device
        views of them; drop the graph (rebuilt lazily). The views are taken now, outside any
        capture: they keep the tensors' storage alive as long as the graph that bakes their
        pointers."""
        weights = self._weights if weights is None else weights
        views = F.check_weights(self.layer, weight_views(self.layer,
                                                         self.layer.with_fp8(weights)))
        self._weights = weights
        if self._graph is not None:
            # replays of the old graph may still run and read the old weights: keep both
            # alive until the next capture (torch.cuda.graph synchronises the device first)
            self._retired = (self._graph, self._views)
        self._views, self._sig = views, self._signature()
        self._graph = self._core = None

    def _capture(self) -> None:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            s = current_stream()                            # the capture stream
            F.run_core(F.core_phases(self.layer, self._views, s), self.layer, s)
        self._graph, self._retired = graph, None
        self.captures += 1

    @names_rank
    def step(self, x: torch.Tensor, topk_ids: torch.Tensor,
             router_weights: torch.Tensor) -> torch.Tensor:
        """x [T, H] bf16, topk_ids [T, k] int64/int32 (-1 = masked), router_weights [T, k] f32
        -> out [T, H] bf16, a fresh tensor; any 0 <= T <= T_max, the same graph (phase 0
        writes T's rows on the device). Everything is checked before anything launches."""
        layer = self.layer
        s = current_stream()
        xb = tensor_view(x, "x")
        out = torch.empty((F.step_tokens(layer, xb), layer.shape.hidden), dtype=torch.bfloat16,
                          device=xb.device)
        inputs = F.check_inputs(layer, xb, tensor_view(topk_ids, "topk_ids",
                                                       (torch.int64, torch.int32)),
                                tensor_view(router_weights, "router_weights", (torch.float32,)),
                                out.view(torch.uint16))
        if self._signature() != self._sig:                 # a weight tensor was replaced
            self._prepare()
        else:                       # an FP8 layer's own copies, again if updated in place
            layer.with_fp8(self._weights)
        layer.step_key = inputs_key(x, topk_ids, router_weights, self._weights)
        publish, epilogue = F.io_phases(layer, inputs, s)
        F.run_phases([publish], layer, s)
        if SIM:
            if self._core is None:
                self._core = F.core_phases(layer, self._views, s)
                self.captures += 1
            F.run_core(self._core, layer, s)
        elif self._graph is None:
            # Eager core: this step's result and the warm-up (Numba compiles and loads modules
            # here, never during the capture); then capture the core for the next calls.
            F.run_core(F.core_phases(layer, self._views, s), layer, s)
            F.run_phases([epilogue], layer, s)
            self._capture()
            return out
        else:
            self._graph.replay()
        F.run_phases([epilogue], layer, s)
        return out

    __call__ = step


__all__ = ["CompiledStep"]
