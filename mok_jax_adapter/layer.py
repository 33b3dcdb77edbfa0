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
from mok_core.cuda_compat import SIM

Weights = L.Weights


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


class Layer(L.Layer):
    """``mok_comm.layer.Layer`` taking and returning jax arrays, differentiable (module
    docstring). EP = 1: local buffers; EP > 1: NVSHMEM from ``mok_comm.launch``'s environment
    or MPI (no torch). ``backward=False``: a forward-only layer (no backward buffers)."""

    def __init__(self, shape: LayerShape, tokens_per_rank: int, config: MoKConfig = MoKConfig(),
                 *, gemm=None, gemm_down=None, swiglu_limit=None, heap=None,
                 backward: bool = True):
        super().__init__(shape, tokens_per_rank, config, heap=heap or _heap(shape), gemm=gemm,
                         gemm_down=gemm_down, swiglu_limit=swiglu_limit, backward=backward)
        self._callbacks, self._backward_callbacks, self._vjp = {}, {}, None

    def __call__(self, x, topk_ids, router_weights, weights):
        """One step as one XLA op. Shapes (jax.Array, this rank's; any T <= tokens_per_rank):
        x [T, H] bf16, topk_ids
        [T, k] int32 (int64 too, with x64 on; -1 = masked route), router_weights [T, k]
        float32, ``weights`` (``Weights``, bf16; the shared ones None or [0, .] when I_s = 0).
        Returns out [T, H] bf16. Traceable: call it inside ``jax.jit``; shapes are checked
        when it is traced. Differentiable in x, router_weights and weights (``jax.grad``,
        ``jax.vjp``): the gradients come from ``mok_comm.backward`` (module docstring)."""
        import jax.numpy as jnp
        s = self.shape
        T, H, k = F.step_tokens(self, x), s.hidden, s.topk
        _check(x, "x", (jnp.bfloat16,), (T, H))
        _check(topk_ids, "topk_ids", (jnp.int32, np.int64), (T, k))
        _check(router_weights, "router_weights", (jnp.float32,), (T, k))
        if len(weights) != 6:
            raise TypeError(f"weights: expected 6 arrays ({', '.join(Weights._fields)}), got "
                            f"{len(weights)}")
        weights = Weights(*weights)
        for i, (a, n, shp) in enumerate(zip(weights, Weights._fields, B._grad_shapes(self))):
            if not (i < 3 and a is None and not s.shared_intermediate):
                _check(a, n, (jnp.bfloat16,), shp)
        return self._differentiable()(x, topk_ids, router_weights, weights)

    def check(self, out=None, stream=0) -> None:
        """Wait for ``out`` (a step's output or gradients -- any pytree of jax arrays -- when
        given), then raise what the error words recorded (``MoKError``: bad expert ids,
        capacity overflow, NaN/Inf input, a peer that never came)."""
        if out is not None:
            import jax
            jax.block_until_ready(out)
        super().check(stream)

    def _present(self, weights):
        """The weights the callbacks take: the routed ones only when I_s = 0."""
        return tuple(weights) if self.shape.shared_intermediate else tuple(weights[3:])

    def _weights(self, present) -> Weights:
        """``Weights`` from the callbacks' weight buffers (None for absent shared ones)."""
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
            shapes += [jax.ShapeDtypeStruct(shp, jnp.bfloat16)
                       for shp in self._present(B._grad_shapes(self))]
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
        d_x, d_router, *d_w = self._backward_call(T)(x, topk_ids, router_weights, d_out,
                                                      *self._present(weights))
        if not self.shape.shared_intermediate:          # the shared weights' are empty
            d_w = [None if w is None else jnp.zeros(w.shape, w.dtype) for w in weights[:3]] + d_w
        return d_x, None, d_router, Weights(*d_w)

    def _stream(self, ctx, buf):
        """XLA's stream as numba's (0 on the simulator), ``buf`` checked to be on our GPU."""
        if SIM:
            return 0
        from numba import cuda
        _check_device(buf)
        return cuda.external_stream(int(ctx.stream))

    def _step(self, ctx, out, x, topk_ids, router_weights, *weights):
        """The forward callback: XLA's buffers (views of its memory for the duration of the
        op) in, the layer's launches enqueued on XLA's stream, ``out`` written in place."""
        F.forward(self, x, topk_ids, router_weights, self._weights(weights), out=out,
                  stream=self._stream(ctx, out))

    def _backward_step(self, ctx, grads, x, topk_ids, router_weights, d_out, *weights):
        """The backward callback: the forward's context recomputed (module docstring: why),
        then the backward into XLA's gradient buffers, all on XLA's stream."""
        stream = self._stream(ctx, grads[0])
        W = self._weights(weights)
        fctx = F.recompute_forward_context(self, x, topk_ids, router_weights, W, stream=stream)
        d_x, d_router, *d_w = grads
        B.backward(self, fctx, d_out, router_weights, W,
                   grads=B.Grads(d_x, d_router, *self._weights(d_w)), stream=stream)


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
