"""The MoE layer for JAX: ``jax.Array`` in, ``jax.Array`` out, inside or outside ``jit``.

    layer = mok_jax_adapter.Layer(shape, tokens_per_rank, config)     # NVSHMEM when EP > 1
    out = jax.jit(layer)(x, topk_ids, router_weights, weights)        # weights: Weights
    layer.check(out)                                                  # waits for out, raises

How: one ``jax.experimental.buffer_callback`` per step. XLA hands the callback its device
buffers (inputs, and the output it allocated) and its compute stream; the callback runs
``mok_comm.functional.forward`` on that stream, reading the inputs and
writing the output buffer in place -- zero-copy both ways, no host sync (the callback returns
as soon as the kernels are enqueued). Under the CUDA simulator (CI) the same code runs on JAX's
CPU backend (host buffers stand in for device memory).

Contract and limits:
* one GPU per process, numba's current device (checked each step: the output buffer must live
  there); with NVSHMEM, EP > 1, start the processes with ``python -m mok_comm.launch`` or MPI,
  pin JAX to the rank's GPU (``jax_cuda_visible_devices``) and keep XLA from preallocating it
  (``XLA_PYTHON_CLIENT_PREALLOCATE=false``);
* every input is checked before the first launch (shapes and dtypes when traced); the callback
  is declared to have a side effect (the workspace, and at EP > 1 the other ranks), so XLA
  never drops it, even with its output unused; every rank must call the layer alike (the
  ranks' fingerprints are compared on the device, as in the torch path);
* XLA's stream does not wait for the default stream nor the other way round: ``check(lw, out)``
  waits for ``out`` before it reads the layer's error words (the plain ``Layer.check`` could
  read them before the step ran);
* no autodiff yet (``jax.grad`` raises: the backward comes with its own issue), no ``vmap``;
* not captured into XLA's command buffers (CUDA graphs): the callback runs Python each step.
"""
from __future__ import annotations

import numpy as np

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
    """``mok_comm.layer.Layer`` taking and returning jax arrays (module docstring). EP = 1:
    local buffers; EP > 1: NVSHMEM from ``mok_comm.launch``'s environment or MPI (no torch)."""

    def __init__(self, shape: LayerShape, tokens_per_rank: int, config: MoKConfig = MoKConfig(),
                 *, gemm=None, gemm_down=None, swiglu_limit=None, heap=None):
        # forward only until the adapter has its custom_vjp: no backward buffers to hold
        super().__init__(shape, tokens_per_rank, config, heap=heap or _heap(shape), gemm=gemm,
                         gemm_down=gemm_down, swiglu_limit=swiglu_limit, backward=False)
        self._callback = None

    def __call__(self, x, topk_ids, router_weights, weights):
        """One step as one XLA op. Shapes (jax.Array, this rank's): x [T, H] bf16, topk_ids
        [T, k] int32 (int64 too, with x64 on; -1 = masked route), router_weights [T, k]
        float32, ``weights`` (``Weights``, bf16). Returns out [T, H] bf16. Traceable: call it
        inside ``jax.jit``; shapes are checked when it is traced."""
        import jax.numpy as jnp
        s = self.shape
        T, H, k, I_s = self.tokens_per_rank, s.hidden, s.topk, s.shared_intermediate
        E_l, I = s.experts_per_rank, s.intermediate
        bf16 = jnp.bfloat16
        _check(x, "x", (bf16,), (T, H))
        _check(topk_ids, "topk_ids", (jnp.int32, np.int64), (T, k))
        _check(router_weights, "router_weights", (jnp.float32,), (T, k))
        if len(weights) != 6:
            raise TypeError(f"weights: expected 6 arrays ({', '.join(Weights._fields)}), got "
                            f"{len(weights)}")
        for a, n, shp in zip(weights, Weights._fields, ((I_s, H), (I_s, H), (H, I_s),
                                                        (E_l, I, H), (E_l, I, H), (E_l, H, I))):
            _check(a, n, (bf16,), shp)
        return self._call()(x, topk_ids, router_weights, *weights)

    def check(self, out=None, stream=0) -> None:
        """Wait for ``out`` (a step's output, when given), then raise what the error words
        recorded (``MoKError``: bad expert ids, capacity overflow, NaN/Inf input, a peer that
        never came)."""
        if out is not None:
            out.block_until_ready()
        super().check(stream)

    def _call(self):
        """The layer's buffer callback, made once: JAX keys its compilation cache on the
        callback object, so a fresh one per call would compile again."""
        if self._callback is None:
            import jax
            from jax.experimental.buffer_callback import buffer_callback
            shape = jax.ShapeDtypeStruct((self.tokens_per_rank, self.shape.hidden),
                                         jax.numpy.bfloat16)
            self._callback = buffer_callback(self._step, shape, has_side_effect=True)
        return self._callback

    def _step(self, ctx, out, x, topk_ids, router_weights, *weights):
        """The callback: XLA's buffers (views of its memory for the duration of the op) in,
        the layer's launches enqueued on XLA's stream, ``out`` written in place."""
        stream = 0
        if not SIM:
            from numba import cuda
            _check_device(out)
            stream = cuda.external_stream(int(ctx.stream))
        F.forward(self, x, topk_ids, router_weights, weights, out=out, stream=stream)
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
