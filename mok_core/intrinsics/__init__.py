"""MoK-Py's few GPU intrinsics, each with a simulator twin (same name, same behaviour).

    memory:       ld_v4, st_v4                      16-byte vector load/store
    ordering:     ld_acquire_sys, ld_acquire_gpu, st_release_sys, red_add_release_gpu, clock64,
                  nanosleep, syncwarp
    bf16 / fp32:  u32_as_f32, f32_as_u32, f32_to_bf16, pack_bf16x2, fmul_rn, fadd_rn
    tensor cores: mma_bf16_16816, ldmatrix_x4, ldmatrix_x2,
                  cp_async_16, cp_async_commit, cp_async_wait

GPU versions: ``ptx.py`` (inline PTX via ``@intrinsic``); twins: ``twins.py``.
"""
from ..cuda_compat import SIM

if SIM:
    from .twins import (clock64, cp_async_16, cp_async_commit, cp_async_wait, f32_as_u32,
                        f32_to_bf16, fadd_rn, fmul_rn, ld_acquire_gpu, ld_acquire_sys, ld_v4, ldmatrix_x2,
                        ldmatrix_x4, mma_bf16_16816, nanosleep, pack_bf16x2, red_add_release_gpu,
                        st_release_sys, st_v4, syncwarp, u32_as_f32)
else:
    from .ptx import (clock64, cp_async_16, cp_async_commit, cp_async_wait, f32_as_u32,
                      f32_to_bf16, fadd_rn, fmul_rn, ld_acquire_gpu, ld_acquire_sys, ld_v4, ldmatrix_x2,
                      ldmatrix_x4, mma_bf16_16816, nanosleep, pack_bf16x2, red_add_release_gpu,
                      st_release_sys, st_v4, syncwarp, u32_as_f32)

__all__ = ["clock64", "cp_async_16", "cp_async_commit", "cp_async_wait", "f32_as_u32",
           "f32_to_bf16", "fadd_rn", "fmul_rn", "ld_acquire_gpu", "ld_acquire_sys", "ld_v4", "ldmatrix_x2",
           "ldmatrix_x4", "mma_bf16_16816", "nanosleep", "pack_bf16x2", "red_add_release_gpu",
           "st_release_sys", "st_v4", "syncwarp", "u32_as_f32"]
