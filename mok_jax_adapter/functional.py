"""The MoE layer forward for JAX: ``jax.Array`` in, ``jax.Array`` out, inside or outside ``jit``.

How: one ``jax.experimental.buffer_callback`` per step. XLA hands the callback its device
buffers (inputs, and the output it allocated) and its compute stream; the callback runs
``mok_comm.functional.build_schedule`` + ``forward`` on that stream, reading the inputs and
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
  waits for ``out`` before it reads the workspace's error words (``lw.check()`` alone could
  read them before the step ran);
* no autodiff yet (``jax.grad`` raises: the backward comes with its own issue), no ``vmap``;
* not captured into XLA's command buffers (CUDA graphs): the callback runs Python each step.
"""
from __future__ import annotations

import numpy as np

from mok_comm import functional as F
from mok_comm.heap import LocalHeap, NvshmemHeap
from mok_core.config import LayerShape, MoKConfig
from mok_core.cuda_compat import SIM
from mok_core.gemm import GemmConfig


def get_workspace(shape: LayerShape, tokens_per_rank: int, config: MoKConfig = MoKConfig(), *,
                  gemm: GemmConfig | None = None, gemm_down: GemmConfig | None = None,
                  heap=None) -> F.LayerWorkspace:
    """Layer workspace for this process (see ``mok_torch.get_workspace``). EP = 1: local
    buffers. EP > 1: NVSHMEM from ``mok_comm.launch``'s environment or MPI (no torch needed)."""
    if heap is None:
        if shape.ep_size == 1:
            heap = LocalHeap(0)
        else:
            from mok_comm import bootstrap
            info = bootstrap.init("auto")
            if info.world_size != shape.ep_size:
                raise ValueError(f"shape.ep_size={shape.ep_size} but {info.world_size} processes "
                                 "are running (one EP rank per process)")
            heap = NvshmemHeap(0)
    return F.get_workspace(shape, tokens_per_rank, config, heap=heap, gemm=gemm,
                           gemm_down=gemm_down, stream=0)


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


def forward(config: MoKConfig, lw: F.LayerWorkspace, x, topk_ids, router_weights,
            w_shared_gate, w_shared_up, w_shared_down, w_gate, w_up, w_down,
            swiglu_limit=None):
    """MoE layer forward (routing all-gather + schedule + forward, as one XLA op).

    Shapes (jax.Array, this rank's): x [T, H] bf16, topk_ids [T, k] int32 (int64 too, with
    x64 on; -1 = masked route), router_weights [T, k] float32, shared weights [I_s, H] /
    [I_s, H] / [H, I_s] bf16, routed weights [E_local, I, H] / [E_local, I, H] /
    [E_local, H, I] bf16 (this rank's experts). Returns out [T, H] bf16. Traceable: call it
    inside ``jax.jit``; shapes are checked when it is traced."""
    import jax.numpy as jnp

    s = lw.shape
    T, H, k, I_s = lw.tokens_per_rank, s.hidden, s.topk, s.shared_intermediate
    E_l, I = s.experts_per_rank, s.intermediate
    bf16 = jnp.bfloat16
    _check(x, "x", (bf16,), (T, H))
    _check(topk_ids, "topk_ids", (jnp.int32, np.int64), (T, k))
    _check(router_weights, "router_weights", (jnp.float32,), (T, k))
    for a, n, shp in ((w_shared_gate, "w_shared_gate", (I_s, H)),
                      (w_shared_up, "w_shared_up", (I_s, H)),
                      (w_shared_down, "w_shared_down", (H, I_s)),
                      (w_gate, "w_gate", (E_l, I, H)), (w_up, "w_up", (E_l, I, H)),
                      (w_down, "w_down", (E_l, H, I))):
        _check(a, n, (bf16,), shp)
    if swiglu_limit is not None:
        swiglu_limit = float(swiglu_limit)
    F.check_swiglu_limit(swiglu_limit)
    call = _callback(lw, config, swiglu_limit)
    return call(x, topk_ids, router_weights, w_shared_gate, w_shared_up, w_shared_down,
                w_gate, w_up, w_down)


def check(lw: F.LayerWorkspace, out) -> None:
    """Wait for ``out`` (a step's output), then raise what the workspace's error words recorded
    (``MoKError``: bad expert ids, capacity overflow, NaN/Inf input, a peer that never came)."""
    out.block_until_ready()
    lw.check()


def _callback(lw, config, swiglu_limit):
    """The layer's buffer callback for (workspace, config, limit), made once: JAX keys its
    compilation cache on the callback object, so a fresh one per call would compile again."""
    import jax
    from jax.experimental.buffer_callback import buffer_callback
    cache = lw.__dict__.setdefault("_jax_callbacks", {})
    key = (config, swiglu_limit)
    call = cache.get(key)
    if call is None:
        T, H = lw.tokens_per_rank, lw.shape.hidden

        def mok_layer_step(ctx, out, x, topk_ids, router_weights, *weights):
            _step(config, lw, swiglu_limit, ctx, out, x, topk_ids, router_weights, *weights)

        call = cache[key] = buffer_callback(mok_layer_step,
                                            jax.ShapeDtypeStruct((T, H), jax.numpy.bfloat16),
                                            has_side_effect=True)
    return call


def _step(config, lw, swiglu_limit, ctx, out, x, topk_ids, router_weights, *weights):
    """The callback: XLA's buffers (views of its memory for the duration of the op) in, the
    layer's launches enqueued on XLA's stream, ``out`` written in place."""
    stream = 0
    if not SIM:
        from numba import cuda
        _check_device(out)
        stream = cuda.external_stream(int(ctx.stream))
    shared, routed = weights[:3], weights[3:]
    if not lw.shape.shared_intermediate:
        shared = (None, None, None)
    F.step(config, lw, topk_ids, x, router_weights, *shared, *routed, swiglu_limit, out=out,
           stream=stream)


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
