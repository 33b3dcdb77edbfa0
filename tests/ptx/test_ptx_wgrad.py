"""The wgrad GEMM's specialisations compile for sm_90 with no local-memory traffic (the
accumulators, fragments, per-thread addresses and prefetched gather rows must live in
registers) and use the transposing ldmatrix and mma.sync."""
import pytest
from numba import float32, int32, int64, uint16, uint32

from mok_core.gemm.sm80_wgrad import make_wgrad_gemm
from ptx_util import compile_sm90, count


def _sig(out):
    return (uint16[::1], int32[::1], uint16[::1], int32[::1], int32[::1], int32[::1],
            out[::1], out[::1], int64, int64, int64, int32[::1], int32, int32)


# (gather A, gather B, FP32 out, accumulate): dW_down's form (A gathered, bf16 out) and
# dW_gate/up's (B gathered) with main-grad accumulation
KINDS = {"bf16": (True, False, False, False), "f32_accumulate": (False, True, True, True)}
NF_CHECK = (r"redux\.sync\.add\.s32", r"redux\.sync\.min\.s32",
            r"atom\.global\.max\.s32|atom\.max\.s32|red\.global\.max\.s32")


@pytest.mark.parametrize("tile", [(64, 128, 32, 2, 2, 4), (128, 128, 32, 2, 4, 3)])
@pytest.mark.parametrize("kind", list(KINDS))
def test_wgrad_lowers_without_local_memory(tile, kind):
    gather_a, gather_b, out_f32, accumulate = KINDS[kind]
    kern = make_wgrad_gemm(*tile, gather_a, gather_b, out_f32, accumulate)
    ptx = compile_sm90(kern, _sig(float32 if out_f32 else uint32))
    bm, bn, bk, wm, wn, _ = tile
    mi_n, ni_n, kk_n = bm // wm // 16, bn // wn // 8, bk // 16
    n_mma = count(ptx, r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32")
    assert n_mma >= mi_n * ni_n * kk_n and n_mma % (mi_n * ni_n * kk_n) == 0
    n_ldm = count(ptx, r"ldmatrix\.sync\.aligned\.m8n8\.x4\.trans\.shared\.b16")
    per_slice = (mi_n + ni_n // 2) * kk_n
    assert n_ldm >= per_slice and n_ldm % per_slice == 0
    assert count(ptx, r"ldmatrix\.sync\.aligned\.m8n8\.x4\.shared") == 0   # only .trans
    assert count(ptx, r"cp\.async\.cg\.shared\.global") >= 2
    assert count(ptx, r"ld\.local|st\.local") == 0, "registers spilled to local memory"
    for p in NF_CHECK:
        assert count(ptx, p) >= 1, p
    if out_f32:
        # each element stored once (after its FP32 add to the value read: accumulate)
        assert count(ptx, r"st\.(global\.)?f32") == mi_n * ni_n * 4
        assert count(ptx, r"ld\.(global\.)?f32") >= mi_n * ni_n * 4
    else:
        assert count(ptx, r"fma\.rn\.bf16x2") == mi_n * ni_n * 2     # one fold per pair
