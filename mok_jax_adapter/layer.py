"""The MoE layer for JAX: ``jax.Array`` in, ``jax.Array`` out, inside or outside ``jit``,
differentiable.

    layer = mok_jax_adapter.Layer(shape, tokens_per_rank, config)     # NVSHMEM when EP > 1
    out = jax.jit(layer)(x, topk_ids, router_weights, weights)        # weights: Weights
    layer.check(out)                                                  # waits for out, raises
    grads = jax.grad(loss, argnums=(0, 2, 3))(x, topk_ids, router_weights, weights)

How: one ``jax.experimental.buffer_callback`` per step. XLA hands the callback its device
buffers (inputs, and the output it allocated) and its compute stream; the callback runs
``mok_comm.functional.forward`` on that stream, reading the inputs and
writing the output buffer in place -- zero-copy both ways, no host sync (the callback returns
as soon as the kernels are enqueued). Under the CUDA simulator (CI) the same code runs on JAX's
CPU backend (host buffers stand in for device memory).

Autodiff: the call is a ``jax.custom_vjp`` over (x, router_weights, weights); topk_ids is an
integer input (its cotangent is None). The residuals are the step's inputs themselves (jax
arrays, nothing copied). The backward is a second buffer callback: it rebuilds the forward's
context with ``mok_comm.functional.recompute_forward_context`` and runs
``mok_comm.backward.backward`` on XLA's stream, writing XLA's gradient buffers in place (d_x
bf16 [T, H], d_router_weights float32 [T, k], the six weight gradients bf16; none for the
shared expert's when I_s = 0). The gradients are bit for bit the functional (and torch) path's.

Why it always recomputes: the forward's context lives in the layer's buffers until its next
step, and under ``jit`` XLA orders the callbacks by data dependencies only -- a layer called
twice before its backwards (or another program's step on it) has overwritten the context by the
time a backward runs, and a callback cannot tell. Recomputing is bit-identical, so correctness
never depends on the order. Its cost is the forward minus the down GEMMs (routing, schedule,
dispatch, shared and routed gate/up + SwiGLU: about two thirds of the forward's FLOPs) on every
backward; a fused forward + backward callback that could prove the order is the way to save it.

FP8 (``MoKConfig(precision="fp8")``), as the torch path's manual API: the caller quantises the
routed weights once per optimizer step, ``fp8 = quantize_weights(weights)`` (a pure buffer
callback: e4m3 bytes and block scales as jax arrays, both orientations; nothing is
differentiated through it), and calls the layer with ``WeightsFP8(*weights, fp8)``. The
routed GEMMs read ``fp8``; the gradients are those of the bf16 weights (``fp8`` gets none), so
``jax.grad`` takes the six bf16 weights as before.

Variable tokens: x may hold any T <= ``tokens_per_rank`` rows per call and rank (topk_ids,
router_weights, out and the gradients follow), as on the torch path; T is static under ``jit``,
so each count is a trace of its own, with a buffer callback of its own (made once per count).

Contract and limits:
* one GPU per process, numba's current device (checked each step: the output buffer must live
  there); with NVSHMEM, EP > 1, start the processes with ``python -m mok_comm.launch`` or MPI,
  pin JAX to the rank's GPU (``jax_cuda_visible_devices``) and keep XLA from preallocating it
  (``XLA_PYTHON_CLIENT_PREALLOCATE=false``);
* every input is checked before the first launch (shapes and dtypes when traced, the backward's
  cotangent too); both callbacks are declared to have a side effect (the workspace, and at
  EP > 1 the other ranks), so XLA never drops them, even with their outputs unused; every rank
  must call the layer (and its backward) alike (the ranks' fingerprints are compared on the
  device, as in the torch path);
* a layer's callbacks share its buffers: they must run one at a time, in the order XLA enqueues
  them on its compute stream (as XLA runs custom calls);
* XLA's stream does not wait for the default stream nor the other way round: ``check(out)``
  waits for ``out`` before it reads the layer's error words (the plain ``Layer.check`` could
  read them before the step ran); errors of a backward surface at the layer's next call, or at
  ``check(grads)``;
* ``backward=False`` builds a forward-only (inference) layer: no backward buffers, and
  differentiating it raises when traced; no ``vmap``;
* not captured into XLA's command buffers (CUDA graphs): the callbacks run Python each step.
"""
from __future__ import annotations

import numpy as np

from mok_comm import backward as B
from mok_comm import functional as F
from mok_comm import layer as L
from mok_comm.heap import LocalHeap, NvshmemHeap
from mok_core.config import LayerShape, MoKConfig
from mok_core.cuda_compat import SIM, as_device_array, names_rank

Weights = L.Weights
WeightsFP8 = L.WeightsFP8
FP8Weights = L.FP8Weights


def _heap(shape: LayerShape):
    if shape.ep_size == 1:
        return LocalHeap(0)
    from mok_comm.launch import bootstrap
    info = bootstrap.init("auto")
    if info.world_size != shape.ep_size:
        raise ValueError(f"LayerShape.ep_size={shape.ep_size} but {info.world_size} processes "
                         "are running (one EP rank per process)")
    return NvshmemHeap(0)


def _check(a, name, dtypes, shape):
    """Trace-time check of a jax array's dtype and shape (clear errors before any launch)."""
    import jax.numpy as jnp
    if not hasattr(a, "shape") or not hasattr(a, "dtype"):
        raise TypeError(f"{name}: expected a jax.Array, got {type(a).__name__}")
    if not any(jnp.dtype(a.dtype) == jnp.dtype(d) for d in dtypes):
        want = " or ".join(str(jnp.dtype(d)) for d in dtypes)
        raise TypeError(f"{name}: expected dtype {want}, got {a.dtype}")
    if tuple(a.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(a.shape)}")


def _xla_stream(ctx, buf):
    """XLA's stream of a buffer callback as numba's (0 on the simulator), ``buf`` checked to
    be on our GPU."""
    if SIM:
        return 0
    from numba import cuda
    _check_device(buf)
    return cuda.external_stream(int(ctx.stream))


# (E, I, H, backward) -> quantize_weights' buffer callback, made once: JAX keys its
# compilation cache on the callback object
_quantizers = {}


def quantize_weights(weights, *, backward: bool = True) -> FP8Weights:
    """The routed experts of ``weights`` (``Weights`` of bf16 jax arrays) quantised for a
    ``MoKConfig(precision="fp8")`` layer: an ``FP8Weights`` of jax arrays (e4m3 bytes uint8,
    a float32 scale per 128 x 128 block; with ``backward`` also the transposed copies the
    backward's data gradients read), from ``mok_comm.layer.quantize_weights`` in one buffer
    callback on XLA's stream. Traceable (inside ``jit`` or not); no gradient flows through it
    (its inputs are ``stop_gradient``-ed): call it once per optimizer step and pass
    ``WeightsFP8(*weights, fp8)`` to the layer. ``backward`` is a Python bool (under
    ``jax.jit`` a static argument: ``static_argnames="backward"``)."""
    import jax
    import jax.numpy as jnp
    if not isinstance(backward, (bool, np.bool_)):
        raise TypeError(f"backward: expected a Python bool (static under jit), got "
                        f"{type(backward).__name__}")
    L.check_six_weights(weights)
    W = Weights(*weights)
    if not hasattr(W.w_gate, "shape") or len(W.w_gate.shape) != 3:
        raise ValueError(f"w_gate: expected a [E, I, H] jax.Array, got "
                         f"{getattr(W.w_gate, 'shape', type(W.w_gate).__name__)}")
    E, I, H = W.w_gate.shape
    for a, n, shp in ((W.w_gate, "w_gate", (E, I, H)), (W.w_up, "w_up", (E, I, H)),
                      (W.w_down, "w_down", (E, H, I))):
        _check(a, n, (jnp.bfloat16,), shp)
    L.check_fp8_experts(E, I, H)
    key = (E, I, H, bool(backward))
    if key not in _quantizers:
        from jax.experimental.buffer_callback import buffer_callback
        specs = tuple(jax.ShapeDtypeStruct(shp, dtype)
                      for dtype, shp in L.fp8_shapes(E, I, H, backward).values())

        def run(ctx, out, w_gate, w_up, w_down):
            routed = [as_device_array(a, n, dtype=np.uint16) for a, n in
                      ((w_gate, "w_gate"), (w_up, "w_up"), (w_down, "w_down"))]
            views = [as_device_array(o, f"fp8.{n}") for o, n in zip(out, FP8Weights._fields)]
            L.quantize_weights(Weights(None, None, None, *routed), backward=backward,
                               out=FP8Weights(*views), stream=_xla_stream(ctx, out[0]))

        _quantizers[key] = buffer_callback(run, specs)
    out = _quantizers[key](*(jax.lax.stop_gradient(a) for a in (W.w_gate, W.w_up, W.w_down)))
    return FP8Weights(*out)


class Layer(L.Layer):
    """``mok_comm.layer.Layer`` taking and returning jax arrays, differentiable (module
    docstring). EP = 1: local buffers; EP > 1: NVSHMEM from ``mok_comm.launch``'s environment
    or MPI (no torch). ``backward=False``: a forward-only layer (no backward buffers)."""

    def __init__(self, shape: LayerShape, tokens_per_rank: int, config: MoKConfig = MoKConfig(),
                 *, gemm=None, gemm_down=None, swiglu_limit=None, heap=None,
                 backward: bool = True):
        L.check_layer_args(shape, tokens_per_rank, config, gemm, gemm_down, backward)
        super().__init__(shape, tokens_per_rank, config, heap=heap or _heap(shape), gemm=gemm,
                         gemm_down=gemm_down, swiglu_limit=swiglu_limit, backward=backward)
        self._callbacks, self._backward_callbacks, self._vjp = {}, {}, None

    @names_rank
    def __call__(self, x, topk_ids, router_weights, weights):
        """One step as one XLA op. Shapes (jax.Array, this rank's; any T <= tokens_per_rank):
        x [T, H] bf16, topk_ids
        [T, k] int32 (int64 too, with x64 on; -1 = masked route), router_weights [T, k]
        float32, ``weights`` (``Weights``, bf16; the shared ones None or [0, .] when I_s = 0;
        with ``MoKConfig(precision="fp8")`` ``WeightsFP8(*weights, quantize_weights(weights))``).
        Returns out [T, H] bf16. Traceable: call it inside ``jax.jit``; shapes are checked
        when it is traced. Differentiable in x, router_weights and weights (``jax.grad``,
        ``jax.vjp``): the gradients come from ``mok_comm.backward`` (module docstring)."""
        import jax.numpy as jnp
        s = self.shape
        T, H, k = F.step_tokens(self, x), s.hidden, s.topk
        _check(x, "x", (jnp.bfloat16,), (T, H))
        _check(topk_ids, "topk_ids", (jnp.int32, np.int64), (T, k))
        _check(router_weights, "router_weights", (jnp.float32,), (T, k))
        fp8 = F.check_weight_count(self, weights)
        for i, (a, n, shp) in enumerate(zip(weights, Weights._fields, B._grad_shapes(self))):
            if not (i < 3 and a is None and not s.shared_intermediate):
                _check(a, n, (jnp.bfloat16,), shp)
        if not fp8:
            return self._differentiable()(x, topk_ids, router_weights, Weights(*weights))
        q = weights[6]
        if q is None or len(q) not in (6, len(FP8Weights._fields)):
            raise TypeError("weights.fp8: expected an FP8Weights (quantize_weights(weights)), "
                            f"got {type(q).__name__}")
        q = FP8Weights(*q)
        # the callbacks take the arrays given, by position: the forward's six, and the four
        # transposed copies all or none
        if sum(a is None for a in q[6:]) not in (0, 4):
            raise ValueError("weights.fp8: the transposed copies (w_down_t ... "
                             "w_gate_up_t_scale) must be all given or all None")
        specs = L.fp8_shapes(s.experts_per_rank, s.intermediate, s.hidden)
        for i, (a, (n, (dtype, shp))) in enumerate(zip(q, specs.items())):
            if a is not None or i < 6:
                _check(a, f"weights.fp8.{n}", (dtype,), shp)
        return self._differentiable()(x, topk_ids, router_weights, WeightsFP8(*weights[:6], q))

    def check(self, out=None, stream=0) -> None:
        """Wait for ``out`` (a step's output or gradients -- any pytree of jax arrays -- when
        given), then raise what the error words recorded (``MoKError``: bad expert ids,
        capacity overflow, NaN/Inf input, a peer that never came)."""
        if out is not None:
            import jax
            jax.block_until_ready(out)
        super().check(stream)

    def _present(self, weights):
        """The weight arrays the callbacks take: the six (the routed ones only when I_s = 0),
        then with FP8 the quantised ones given (``FP8Weights``' first six, or all ten)."""
        six = tuple(weights[:6]) if self.shape.shared_intermediate else tuple(weights[3:6])
        if len(weights) < 7:
            return six
        return six + tuple(a for a in weights[6] if a is not None)

    def _weights(self, present):
        """``Weights`` (FP8: ``WeightsFP8``) from the callbacks' weight buffers (None for
        absent shared ones and transposed copies)."""
        n = 6 if self.shape.shared_intermediate else 3
        six = tuple(present[:n]) if n == 6 else (None, None, None, *present[:n])
        if self.config.precision != "fp8":
            return Weights(*six)
        return WeightsFP8(*six, FP8Weights(*present[n:]))

    def _grads(self, present) -> Weights:
        """The six weight gradients from the backward callback's buffers (None for absent
        shared ones)."""
        return Weights(*present) if self.shape.shared_intermediate else Weights(None, None,
                                                                                None, *present)

    def _call(self, T):
        """The layer's forward buffer callback for T tokens, made once per count: JAX keys its
        compilation cache on the callback object, so a fresh one per call would compile
        again."""
        if T not in self._callbacks:
            import jax
            from jax.experimental.buffer_callback import buffer_callback
            shape = jax.ShapeDtypeStruct((T, self.shape.hidden), jax.numpy.bfloat16)
            self._callbacks[T] = buffer_callback(self._step, shape, has_side_effect=True)
        return self._callbacks[T]

    def _backward_call(self, T):
        """The backward's buffer callback for T tokens, made once per count: outputs d_x,
        d_router_weights and the weight gradients present (the shared ones only when
        I_s > 0)."""
        if T not in self._backward_callbacks:
            import jax
            import jax.numpy as jnp
            from jax.experimental.buffer_callback import buffer_callback
            H, k = self.shape.hidden, self.shape.topk
            shapes = [jax.ShapeDtypeStruct((T, H), jnp.bfloat16),
                      jax.ShapeDtypeStruct((T, k), jnp.float32)]
            shared = self.shape.shared_intermediate
            shapes += [jax.ShapeDtypeStruct(shp, jnp.bfloat16)
                       for shp in B._grad_shapes(self)[0 if shared else 3:]]
            self._backward_callbacks[T] = buffer_callback(self._backward_step, tuple(shapes),
                                                          has_side_effect=True)
        return self._backward_callbacks[T]

    def _differentiable(self):
        """The step as a ``jax.custom_vjp`` (made once, as the callbacks)."""
        if self._vjp is None:
            import jax

            def forward(x, topk_ids, router_weights, weights):
                return self._call(x.shape[0])(x, topk_ids, router_weights,
                                              *self._present(weights))

            def forward_with_residuals(*args):     # the residuals: the inputs themselves
                return forward(*args), args

            step = jax.custom_vjp(forward)
            step.defvjp(forward_with_residuals, self._bwd)
            self._vjp = step
        return self._vjp

    def _bwd(self, residuals, d_out):
        """custom_vjp's backward (traced): the gradients from one buffer callback."""
        import jax.numpy as jnp
        if self.grad is None:
            raise ValueError("this layer was built with backward=False (forward only): build "
                             "it with backward=True to differentiate it")
        x, topk_ids, router_weights, weights = residuals
        T = x.shape[0]
        _check(d_out, "d_out (the output's cotangent)", (jnp.bfloat16,), (T, self.shape.hidden))
        if len(weights) == 7 and weights[6].w_down_t is None:      # (all four or none)
            raise ValueError("weights.fp8.w_down_t: None, but the FP8 backward's data gradients "
                             "read the transposed copies: quantize_weights(weights, "
                             "backward=True)")
        d_x, d_router, *d_w = self._backward_call(T)(x, topk_ids, router_weights, d_out,
                                                      *self._present(weights))
        if not self.shape.shared_intermediate:          # the shared weights' are empty
            d_w = [None if w is None else jnp.zeros(w.shape, w.dtype) for w in weights[:3]] + d_w
        if len(weights) == 7:                           # the quantised copies: no gradient
            return d_x, None, d_router, WeightsFP8(*d_w, None)
        return d_x, None, d_router, Weights(*d_w)

    def _step(self, ctx, out, x, topk_ids, router_weights, *weights):
        """The forward callback: XLA's buffers (views of its memory for the duration of the
        op) in, the layer's launches enqueued on XLA's stream, ``out`` written in place."""
        F.forward(self, x, topk_ids, router_weights, self._weights(weights), out=out,
                  stream=_xla_stream(ctx, out))

    def _backward_step(self, ctx, grads, x, topk_ids, router_weights, d_out, *weights):
        """The backward callback: the forward's context recomputed (module docstring: why),
        then the backward into XLA's gradient buffers, all on XLA's stream."""
        stream = _xla_stream(ctx, grads[0])
        W = self._weights(weights)
        fctx = F.recompute_forward_context(self, x, topk_ids, router_weights, W, stream=stream)
        d_x, d_router, *d_w = grads
        B.backward(self, fctx, d_out, router_weights, W,
                   grads=B.Grads(d_x, d_router, *self._grads(d_w)), stream=stream)


def _check_device(out) -> None:
    """XLA's buffers must live on numba's current device (the workspace's)."""
    from cuda.bindings import driver as cu
    from numba import cuda
    ptr = int(out.__cuda_array_interface__["data"][0])
    attr = cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
    err, ordinal = cu.cuPointerGetAttribute(attr, ptr)
    here = cuda.get_current_device().id
    if err == cu.CUresult.CUDA_SUCCESS and int(ordinal) != here:
        raise RuntimeError(f"mok_jax_adapter: XLA placed the layer on GPU {int(ordinal)}, but "
                           f"this process's workspace is on GPU {here}: one GPU per process "
                           "(pin JAX with jax_cuda_visible_devices, or put the inputs there)")
