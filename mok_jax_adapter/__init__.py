"""JAX adapter (planned; not implemented yet -- see NOTES.md "Next").

Plan: inside ``jax.jit`` through ``jax.experimental.buffer_callback`` (the callback receives
XLA's buffers and stream; MoK-Py kernels launch on that stream and write the output buffer in
place, zero-copy), with ``jax.custom_vjp`` for the backward. Until then, JAX users can hand
single-device ``jax.Array``s to ``mok_comm.functional`` eagerly: inputs are read zero-copy via
DLPack / the CUDA array interface (bf16 as uint16 bits).
"""
