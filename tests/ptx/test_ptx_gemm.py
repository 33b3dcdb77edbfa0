"""Grouped GEMM specialisations compile for sm_90 with no local-memory traffic (the
accumulators and fragments must live in registers)."""
import pytest
from numba import float32, int32, int64, uint16, uint32

from mok_core.grouped_gemm_kernels import make_grouped_gemm
from ptx_util import compile_sm90, count

SIG = (uint16[::1], int32[::1], uint16[::1], uint16[::1], int32[::1], int32[::1], uint32[::1],
       int64, int64, int64, float32)


@pytest.mark.parametrize("tile", [(128, 128, 32, 2, 4, 4), (128, 128, 64, 2, 4, 3),
                                  (32, 32, 32, 2, 1, 2)])
@pytest.mark.parametrize("swiglu", [True, False])
def test_gemm_lowers_without_local_memory(tile, swiglu):
    kern = make_grouped_gemm(*tile, swiglu, swiglu)
    ptx = compile_sm90(kern, SIG)
    bm, bn, bk, wm, wn, _ = tile
    mma_per_kslice = (bm // wm // 16) * (bn // wn // 8) * (bk // 16)
    n_mma = count(ptx, r"mma\.sync\.aligned\.m16n8k16")
    assert n_mma >= mma_per_kslice and n_mma % mma_per_kslice == 0   # (NVVM may unroll K)
    assert count(ptx, r"cp\.async\.cg\.shared\.global") >= 2
    assert count(ptx, r"ld\.local|st\.local") == 0, "accumulators spilled to local memory"
