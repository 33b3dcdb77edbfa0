"""MoK-Py's few GPU intrinsics, each with a simulator twin (same name, same behaviour).

    memory:       ld_v4, st_v4                      16-byte vector load/store
                  st_v2_f32                         8-byte store of two float32
    ordering:     ld_acquire_sys, st_release_sys, red_add_release_gpu, clock64, nanosleep,
                  syncwarp, warp_all (a vote ptxas knows is warp-uniform), warp_sum /
                  warp_min (int32 over the warp, redux.sync), warp_fsum (float32 over
                  the warp: a fixed shfl.sync.bfly butterfly, deterministic),
                  warp_read (int32 from a lane of the warp, shfl.sync.idx),
                  match_any (the lanes holding the same value: ranks equal keys),
                  tuple_pick (a UniTuple element by selects: no branch for ptxas to see),
                  per_iteration (an integer the compiler cannot hoist out of its loop)
    fp8:          pack_e4m3x4 (four float32 -> e4m3 bytes, RNE, saturating)
    bf16 / fp32:  u32_as_f32, f32_as_u32, pack_bf16x2, fmul_rn, fadd_rn, ffma_rn, fdiv_rn,
                  fold_nonfinite_bf16x2 (a running NaN/Inf check of packed output words: one
                  fma.rn.bf16x2 per word), max_u16x2 (the larger of each 16-bit half:
                  column maxima of packed |bf16| bits, sm_90),
                  ex2_approx, rcp_approx (one SFU instruction each: the SwiGLU epilogue)
    tensor cores: mma_bf16_16816, cp_async_commit, cp_async_wait; shared_addr +
                  ldmatrix_x4_at (and ``_trans_at``: the operand stored transposed) /
                  cp_async_16_at, cp_async_4_at (32-bit shared byte addresses for hot
                  loops), st_shared_u32, st_shared_v2_f32, add_shared_v2_f32 (two float32
                  added to shared memory's, IEEE)
    wgmma:        wgmma_m64n{64,128,256}k16_bf16 (B K-major) and ``_tb`` (B MN-major:
                  transposed, the weights as stored for dgrad) and ``_tatb`` (A and B
                  MN-major: both operands stored k-major, the weight gradients),
                  wgmma_m64n{64,128,256}k32_e4m3 (FP8, both K-major; m64n128k32_e4m3_fresh:
                  scale-d 0, the accumulator's input ignored), promote_fp8 (a
                  slice's FP8 fragment, scaled per row, into the FP32 sum),
                  wgmma_fence, wgmma_commit,
                  wgmma_wait,
                  fence_proxy_async, f32_zeros (the accumulator travels as a UniTuple),
                  tuple_groups (a per-group function over the accumulator, unrolled: constant
                  indices, no local-memory copy), tuple_fold (the same with a carried value)
    mbarriers:    mbarrier_init, mbarrier_arrive, mbarrier_try_wait, trap,
                  cp_async_mbarrier_arrive (an arrival once this thread's cp.async copies
                  landed)
    registers:    setmaxnreg_inc, setmaxnreg_dec (a warpgroup's registers per thread, moved
                  between warpgroups of a warp-specialised kernel)
    bulk copies:  mbarrier_arrive_expect_tx, bulk_store, bulk_commit, bulk_wait (shared ->
                  global), bulk_wait_read (the shared source may be reused)
    TMA:          tensormap_acquire, tma_load_2d (a swizzled box of a 2-D tensor map -> shared,
                  completes an mbarrier's byte count), tma_store_2d (shared -> a box of the
                  map, clipped at its end; a bulk store), fence_mbarrier_init

GPU versions: ``ptx.py`` (inline PTX via ``@intrinsic``); twins: ``twins.py``.
"""
import importlib

from ..cuda_compat import SIM

__all__ = [
    "ld_v4", "st_v4", "st_v2_f32",
    "ld_acquire_sys", "st_release_sys", "red_add_release_gpu", "clock64", "nanosleep",
    "syncwarp", "warp_all", "warp_sum", "warp_min", "warp_fsum", "warp_read", "match_any",
    "tuple_pick", "per_iteration",
    "u32_as_f32", "f32_as_u32", "pack_bf16x2", "fold_nonfinite_bf16x2", "max_u16x2",
    "fmul_rn", "fadd_rn", "ffma_rn", "fdiv_rn",
    "pack_e4m3x4",
    "ex2_approx", "rcp_approx",
    "mma_bf16_16816", "cp_async_commit", "cp_async_wait", "shared_addr", "ldmatrix_x4_at",
    "ldmatrix_x4_trans_at", "cp_async_16_at", "cp_async_4_at",
    "wgmma_m64n64k16_bf16", "wgmma_m64n128k16_bf16", "wgmma_m64n256k16_bf16",
    "wgmma_m64n64k16_bf16_tb", "wgmma_m64n128k16_bf16_tb", "wgmma_m64n256k16_bf16_tb",
    "wgmma_m64n64k16_bf16_tatb", "wgmma_m64n128k16_bf16_tatb", "wgmma_m64n256k16_bf16_tatb",
    "wgmma_m64n64k32_e4m3", "wgmma_m64n128k32_e4m3", "wgmma_m64n256k32_e4m3",
    "wgmma_m64n128k32_e4m3_fresh", "promote_fp8",
    "wgmma_fence",
    "wgmma_commit", "wgmma_wait", "fence_proxy_async", "f32_zeros", "tuple_groups",
    "tuple_fold",
    "mbarrier_init", "mbarrier_arrive", "mbarrier_try_wait", "trap",
    "cp_async_mbarrier_arrive",
    "setmaxnreg_inc", "setmaxnreg_dec",
    "mbarrier_arrive_expect_tx", "bulk_store", "bulk_commit", "bulk_wait",
    "bulk_wait_read", "st_shared_u32", "st_shared_v2_f32", "add_shared_v2_f32",
    "tensormap_acquire", "tma_load_2d", "tma_store_2d",
    "fence_mbarrier_init",
]

_impl = importlib.import_module(".twins" if SIM else ".ptx", __name__)
globals().update({name: getattr(_impl, name) for name in __all__})
