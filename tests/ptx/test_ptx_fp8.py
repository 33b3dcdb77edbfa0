"""The FP8 grouped GEMM (``sm90_fp8``) compiles for sm_90a as its header says: 4 e4m3 wgmmas
per K slice, waited to zero before the promotion, the operands' rows by cp.async (no TMA), the
coalesced epilogue with its NaN/Inf check, no local memory -- and ptxas keeps the wgmmas
unserialised (C7518) without spills (where the local ptxas reads numba's PTX)."""
import pytest
from numba import float32, int32, int64, uint16, uint32

from ptx_util import assemble_sm90a, compile_sm90a, count

SIG = (uint16[::1], float32[::1], int32[::1], uint16[::1], float32[::1], uint16[::1],
       float32[::1], int32[::1], int32[::1], uint32[::1], int64, int64, float32, int32[::1],
       int32, int32)
NF_CHECK = (r"redux\.sync\.add\.s32", r"redux\.sync\.min\.s32",
            r"atom\.global\.max\.s32|atom\.max\.s32|red\.global\.max\.s32")


@pytest.mark.parametrize("gather,swiglu", [(False, False), (True, True)],
                         ids=["direct", "gathered-swiglu"])
def test_fp8_gemm_lowers_unserialised(gather, swiglu):
    from mok_core.gemm.sm90_fp8 import make_fp8_gemm
    ptx = compile_sm90a(make_fp8_gemm(4, gather, swiglu), SIG)
    assert count(ptx, r"wgmma\.mma_async\.sync\.aligned\.m64n128k32\.f32\.e4m3\.e4m3") == 4
    assert count(ptx, r"wgmma\.wait_group\.sync\.aligned 0;") == 1
    assert count(ptx, r"wgmma\.wait_group\.sync\.aligned [1-9]") == 0
    assert count(ptx, r"cp\.async\.cg\.shared\.global") >= 2            # A and B rows
    assert count(ptx, r"cp\.async\.bulk") == 0                           # no TMA, no bulk
    assert 1 <= count(ptx, r"st\.(global\.)?v4\.u32") <= 8               # coalesced rows
    assert count(ptx, r"fma\.rn\.bf16x2") == (16 if swiglu else 32)      # one fold per pair
    if swiglu:
        assert count(ptx, r"ex2\.approx") == 32 and count(ptx, r"rcp\.approx") == 32
    for p in NF_CHECK:
        assert count(ptx, p) >= 1, p
    assert count(ptx, r"ld\.local|st\.local") == 0, "local memory in the FP8 GEMM"
    report = assemble_sm90a(ptx)
    assert "C7518" not in report and "serialized" not in report, report[-600:]
    assert " 0 bytes spill stores, 0 bytes spill loads" in report, report[-600:]


def test_fp8_wgrad_lowers_unserialised():
    """``sm90_fp8_wgrad``: the same slice (4 e4m3 wgmmas, waited to zero, promoted), both
    operands by cp.async, the coalesced epilogue, no local memory; ptxas: no C7518, no spills."""
    from mok_core.gemm.sm90_fp8_wgrad import make_fp8_wgrad
    sig = (uint16[::1], float32[::1], uint16[::1], float32[::1], int32[::1], int32[::1],
           uint32[::1], int64, int64, int64, int32[::1], int32, int32)
    ptx = compile_sm90a(make_fp8_wgrad(4), sig)
    assert count(ptx, r"wgmma\.mma_async\.sync\.aligned\.m64n128k32\.f32\.e4m3\.e4m3") == 4
    assert count(ptx, r"wgmma\.wait_group\.sync\.aligned 0;") == 1
    assert count(ptx, r"cp\.async\.cg\.shared\.global") >= 2
    assert count(ptx, r"cp\.async\.bulk") == 0
    assert count(ptx, r"fma\.rn\.bf16x2") == 32
    assert count(ptx, r"ld\.local|st\.local") == 0, "local memory in the FP8 wgrad"
    report = assemble_sm90a(ptx)
    assert "C7518" not in report and "serialized" not in report, report[-600:]
    assert " 0 bytes spill stores, 0 bytes spill loads" in report, report[-600:]
