"""Forward epilogue on the source rank: out[t] = y_shared[t] + sum_j w[t, j] * y[t, j].

Slots j ascending, FP32, each multiply and add rounded once (``fmul_rn``/``fadd_rn`` are never
fused into an FMA), one bf16 rounding at the end -> bitwise deterministic and bit-equal to a
NumPy float32 evaluation of the same order. Masked routes (id -1) are skipped: their combine
rows were never written. Thread per 8 columns (16-byte loads/stores)."""
from numba import cuda, float32

from mok_core.bf16 import hi_bf16, lo_bf16
from mok_core.cuda_compat import kjit
from mok_core.intrinsics import fadd_rn, fmul_rn, ld_v4, pack_bf16x2, st_v4


@kjit
def combine_epilogue_kernel(y_shared, has_shared, combine, ids, weights, out, T, H, k):
    """Launch: any grid.

    y_shared  uint16 [T*H]     shared-expert output (ignored unless has_shared)
    combine   uint16 [T*k*H]   this rank's combine buffer (rows pushed by the expert ranks)
    ids       int32 [T*k]      this rank's top-k ids (-1 = masked)
    weights   float32 [T*k]    router weights
    out       uint16 [T*H]
    """
    acc = cuda.local.array(8, float32)
    chunks = H // 8
    i = cuda.grid(1)
    while i < T * chunks:
        t = i // chunks
        c = (i % chunks) * 8
        if has_shared:
            s0, s1, s2, s3 = ld_v4(y_shared, t * H + c)
            acc[0] = lo_bf16(s0)
            acc[1] = hi_bf16(s0)
            acc[2] = lo_bf16(s1)
            acc[3] = hi_bf16(s1)
            acc[4] = lo_bf16(s2)
            acc[5] = hi_bf16(s2)
            acc[6] = lo_bf16(s3)
            acc[7] = hi_bf16(s3)
        else:
            for q in range(8):
                acc[q] = float32(0.0)
        for j in range(k):
            if ids[t * k + j] >= 0:
                w = weights[t * k + j]
                v0, v1, v2, v3 = ld_v4(combine, (t * k + j) * H + c)
                acc[0] = fadd_rn(acc[0], fmul_rn(w, lo_bf16(v0)))
                acc[1] = fadd_rn(acc[1], fmul_rn(w, hi_bf16(v0)))
                acc[2] = fadd_rn(acc[2], fmul_rn(w, lo_bf16(v1)))
                acc[3] = fadd_rn(acc[3], fmul_rn(w, hi_bf16(v1)))
                acc[4] = fadd_rn(acc[4], fmul_rn(w, lo_bf16(v2)))
                acc[5] = fadd_rn(acc[5], fmul_rn(w, hi_bf16(v2)))
                acc[6] = fadd_rn(acc[6], fmul_rn(w, lo_bf16(v3)))
                acc[7] = fadd_rn(acc[7], fmul_rn(w, hi_bf16(v3)))
        st_v4(out, t * H + c, pack_bf16x2(acc[0], acc[1]), pack_bf16x2(acc[2], acc[3]),
              pack_bf16x2(acc[4], acc[5]), pack_bf16x2(acc[6], acc[7]))
        i += cuda.gridsize(1)
