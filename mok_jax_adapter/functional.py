"""The MoE layer forward for JAX: ``jax.Array`` in, ``jax.Array`` out, inside or outside ``jit``.

How: one ``jax.experimental.buffer_callback`` per step. XLA hands the callback its device
buffers (inputs, and the output it allocated) and its compute stream; the callback runs
``mok_comm.functional.build_schedule`` + ``forward`` on that stream, reading the inputs and
writing the output buffer in place -- zero-copy both ways, no host sync (the callback returns
as soon as the kernels are enqueued). Under the CUDA simulator (CI) the same code runs on JAX's
CPU backend (host buffers stand in for device memory).

Contract and limits:
* one GPU per process (JAX's only device there; with NVSHMEM, EP > 1, start the processes with
  ``python -m mok_comm.launch`` or MPI and keep XLA from preallocating the GPU:
  ``XLA_PYTHON_CLIENT_PREALLOCATE=false``);
* the callback has a side effect (the workspace, and at EP > 1 the other ranks), so XLA keeps
  it and keeps its order; every rank must call the layer alike (the ranks' fingerprints are
  compared on the device, as in the torch path);
* no autodiff yet (``jax.grad`` raises: the backward comes with its own issue), no ``vmap``;
* not captured into XLA's command buffers (CUDA graphs): the callback runs Python each step.
"""
from __future__ import annotations

import functools

import numpy as np

from mok_comm import functional as F
from mok_comm.heap import LocalHeap, NvshmemHeap
from mok_core.config import LayerShape, MoKConfig
from mok_core.cuda_compat import SIM
from mok_core.grouped_gemm import GemmConfig


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
    import jax
    import jax.numpy as jnp
    from jax.experimental.buffer_callback import buffer_callback

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
    step = functools.partial(_step, config, lw, swiglu_limit)
    call = buffer_callback(step, jax.ShapeDtypeStruct((T, H), bf16), has_side_effect=True)
    return call(x, topk_ids, router_weights, w_shared_gate, w_shared_up, w_shared_down,
                w_gate, w_up, w_down)


def _step(config, lw, swiglu_limit, ctx, out, x, topk_ids, router_weights, *weights):
    """The callback: XLA's buffers (views of its memory for the duration of the op) in, the
    layer's launches enqueued on XLA's stream, ``out`` written in place."""
    stream = 0
    if not SIM:
        from numba import cuda
        stream = cuda.external_stream(int(ctx.stream))
    schedule = F.build_schedule(lw, topk_ids, stream=stream)
    shared, routed = weights[:3], weights[3:]
    if not lw.shape.shared_intermediate:
        shared = (None, None, None)
    F.forward(config, lw, schedule, x, router_weights, *shared, *routed, swiglu_limit,
              out=out, stream=stream)
