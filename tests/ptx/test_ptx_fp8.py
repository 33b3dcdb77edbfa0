"""The FP8 grouped GEMM (``sm90_fp8``) compiles for sm_90a as its header says: 4 e4m3 wgmmas
per K slice and 128 columns, waited to zero before each promotion, the operands by TMA (2 + 2
boxes a slice and 128 columns, from one producer thread; full / empty mbarriers), the scales
by 4-byte cp.async (arrivals on full made as they land), setmaxnreg 232 / 40, the coalesced
epilogue with its NaN/Inf check (or its push home), no local memory in the PTX -- and ptxas
keeps the wgmmas unserialised (C7518), with no local memory in the K loop (where nvdisasm
shows the SASS). Needs a ptxas that reads numba's PTX (the ``nvidia-cuda-nvcc`` wheel of the
test extra)."""
import pytest
from numba import float32, int32, int64, types, uint32, uint64

from ptx_util import compile_sm90a, count, local_memory_between, sass_sm90a, spill_bytes


def sig(peers=1, out=uint32):
    """The FP8 GEMM kernel's argument types, ``peers`` ranks in the push route, ``out`` the
    outputs' element type (WGRAD: float32)."""
    return (float32[::1], float32[::1], float32[::1], uint64[::1], int32[::1], int32[::1],
            out[::1], out[::1], uint64[::1], float32[::1], float32[::1], int32[::1],
            int32[::1], int32[::1], types.UniTuple(uint32[::1], peers), int64, int64, int64,
            int64, int64, int64, float32, int32[::1], int32, int32)
NF_CHECK = (r"redux\.sync\.add\.s32", r"redux\.sync\.min\.s32",
            r"atom\.global\.max\.s32|atom\.max\.s32|red\.global\.max\.s32")


@pytest.mark.parametrize("swiglu,bn,pre,push", [
    (False, 128, False, False), (True, 128, False, False), (False, 256, False, False),
    (True, 256, False, False), (True, 256, True, False), (False, 256, False, True)],
    ids=["plain", "swiglu", "plain-256", "swiglu-256", "swiglu-256-pre", "plain-256-push"])
def test_fp8_gemm_lowers_unserialised(swiglu, bn, pre, push):
    from mok_core.gemm import sm90_fp8
    from mok_core.gemm.sm90_fp8 import make_fp8_gemm
    halves = bn // 128
    ptx = compile_sm90a(make_fp8_gemm(4 if bn == 128 else 3, swiglu, bn, pre, push),
                        sig(2 if push else 1))
    assert (count(ptx, r"st\.global\.v2\.f32") > 0) == pre        # g and u, 8 bytes a pair
    assert count(ptx, r"wgmma\.mma_async\.sync\.aligned\.m64n128k32\.f32\.e4m3\.e4m3") \
        == 4 * halves
    assert count(ptx, r"wgmma\.wait_group\.sync\.aligned 0;") == halves   # one per half
    assert count(ptx, r"wgmma\.wait_group\.sync\.aligned [1-9]") == 0
    assert count(ptx, r"cp\.async\.bulk\.tensor\.2d") == 2 + 2 * halves   # the slice's boxes
    assert count(ptx, r"cp\.async\.cg\.shared\.global") == 0
    report, sass = sass_sm90a(ptx)
    # empty[s] (the compute threads); full[s]: TMA, and the producer threads' arrivals made
    # once their scales' copies landed
    assert count(ptx, r"mbarrier\.arrive\.shared") == 1
    assert count(ptx, r"mbarrier\.arrive\.expect_tx") == 1
    assert count(ptx, r"cp\.async\.mbarrier\.arrive\.noinc\.shared::cta\.b64") == 1
    # the slice's scales: copied by the producer warpgroup (a row's, w0's, w1's: cp.async,
    # no load it waits on), read from shared memory by the compute threads (their two rows',
    # w0's, w1's)
    assert count(ptx, r"cp\.async\.ca\.shared\.global \[[^]]+\], \[g\], 4, z;") == 3
    assert count(ptx, r"ld\.global(\.nc)?\.f32") == 0 == count(ptx, r"st\.shared\.f32")
    assert count(ptx, r"ld\.shared\.f32") == 4
    # the producer's and the compute warpgroups' registers: the block's launch registers
    assert count(ptx, rf"setmaxnreg\.dec\.sync\.aligned\.u32 {sm90_fp8.PRODUCER_REGS};") == 1
    assert count(ptx, rf"setmaxnreg\.inc\.sync\.aligned\.u32 {sm90_fp8.COMPUTE_REGS};") == 1
    assert f"Used {sm90_fp8.LAUNCH_REGS} registers" in report, report[-600:]
    assert 1 <= count(ptx, r"st\.(global\.)?v4\.u32") <= 16    # a lane: one per chunk, 16 at most
    # push: each row's route (rank, token, slot) loaded once a tile, before the staging, and
    # handed to the lanes storing its chunks by two shuffles a chunk -- not loaded behind
    # every chunk's store (the stores may alias it: no load passes one)
    route_loads = r"ld\.global(\.nc)?\.[us]32"
    assert count(ptx, r"shfl\.sync\.idx\.b32") == (2 * (bn // 16) if push else 0)  # chunks
    if push:
        plain = compile_sm90a(make_fp8_gemm(4 if bn == 128 else 3, swiglu, bn, pre, False),
                              sig(1))
        assert count(ptx, route_loads) == count(plain, route_loads) + 3
    pairs = (16 if swiglu else 32) * halves                             # one fold per pair
    assert count(ptx, r"fma\.rn\.bf16x2") == pairs
    if swiglu:
        assert count(ptx, r"ex2\.approx") == 2 * pairs == count(ptx, r"rcp\.approx")
    for p in NF_CHECK:
        assert count(ptx, p) >= 1, p
    assert count(ptx, r"ld\.local|st\.local") == 0, "local memory in the FP8 GEMM"
    assert "C7518" not in report and "serialized" not in report, report[-600:]
    # no spills: the epilogue's staging addresses are made per tile (``per_iteration``) --
    # hoisted out of the tile loop beside two FP32 sums and a fragment they were ptxas's
    # spills, reloaded every tile
    assert spill_bytes(report) == 0, report[-600:]
    if sass is None:
        pytest.skip("nvdisasm not installed: where the kernel's spills are")
    inside = local_memory_between(sass, r"WARPGROUP\.ARRIVE", r"WARPGROUP\.DEPBAR")
    assert not inside, inside


def sm90_fp8_make(*args, **kw):
    from mok_core.gemm.sm90_fp8 import make_fp8_gemm
    return make_fp8_gemm(*args, **kw)


@pytest.mark.parametrize("bn,out,stages", [(128, "bf16", 4), (256, "bf16", 3), (256, "bf16", 4),
                                           (256, "f32", 3), (128, "f32", 4), (128, "acc", 4)])
def test_fp8_wgrad_lowers_unserialised(bn, out, stages):
    """WGRAD (``make_fp8_gemm(wgrad=True)``): the forward's slice, ring and promotion with its
    own tiles and K ranges -- 4 e4m3 wgmmas per K slice and 128 columns, waited to zero, the
    operands by TMA from the producer (no cp.async), the TMA epilogue: bf16 (a store per 64
    columns, one fold a pair) or FP32 (8-byte shared stores, a store per 32 columns, in two
    halves at 256 columns, whole at 128: ``epilogue.f32_whole``; ``acc``, main-grad: the
    output's tile TMA-loaded into the staging at the tile's start, the pairs added to it
    there; the warps neither store nor load the output; bf16 beside 256's 4-slice ring a
    quarter of the tile at a time, a wait for the staging's reads before each: ``wgrad_parts``)
    -- and ptxas keeps the wgmmas
    unserialised with no local memory in the K loop."""
    from mok_core.gemm import sm90_fp8
    from mok_core.gemm.epilogue import f32_whole
    halves = bn // 128
    f32 = out != "bf16"
    ptx = compile_sm90a(sm90_fp8_make(stages, False, bn, False, False,
                                      wgrad=True, out_f32=f32, accumulate=out == "acc"),
                        sig(out=uint32))
    assert count(ptx, r"wgmma\.mma_async\.sync\.aligned\.m64n128k32\.f32\.e4m3\.e4m3") \
        == 4 * halves
    assert count(ptx, r"wgmma\.wait_group\.sync\.aligned 0;") == halves
    loads = count(ptx, r"cp\.async\.bulk\.tensor\.2d\.shared") - (2 + 2 * halves)  # operands
    assert (1 <= loads <= bn // 32) if out == "acc" else loads == 0      # + the output's
    assert count(ptx, r"mbarrier\.arrive\.expect_tx") == (2 if out == "acc" else 1)
    assert count(ptx, r"cp\.async\.cg\.shared\.global") == 0
    store = r"cp\.async\.bulk\.tensor\.2d\.global"
    assert count(ptx, r"cp\.reduce\.async\.bulk") == 0
    if f32:                     # BN / 32 boxes, in two halves at 256 (the loops may roll)
        assert 2 <= count(ptx, store) <= bn // 32
        assert count(ptx, r"st\.shared\.v2\.f32") == 32 * halves
        assert count(ptx, r"add\.rn\.f32") == (64 if out == "acc" else 0)
        waits = count(ptx, r"cp\.async\.bulk\.wait_group\.read 0;")
        assert waits == (1 if f32_whole(bn) else 2), waits
    else:
        assert count(ptx, store) == 2 * halves                  # a box each, whatever the parts
        assert count(ptx, r"fma\.rn\.bf16x2") == 32 * halves
        waits = count(ptx, r"cp\.async\.bulk\.wait_group\.read 0;")
        assert waits == sm90_fp8.wgrad_parts(stages, bn) == (4 if (bn, stages) == (256, 4) else 1)
    assert count(ptx, r"st\.(global\.)?(v2\.)?f32") == 0      # (the scales: ld.global.nc)
    assert count(ptx, r"ld\.f32") == 0
    report, sass = sass_sm90a(ptx)
    assert f"Used {sm90_fp8.LAUNCH_REGS} registers" in report, report[-600:]
    assert "C7518" not in report and "serialized" not in report, report[-600:]
    # a few values at most (12 bytes at 128 columns; before the epilogues made their
    # addresses per tile, 88-112 bytes reloaded every tile)
    assert spill_bytes(report) <= (0 if bn == 256 else 16), report[-600:]
    if sass is None:
        pytest.skip("nvdisasm not installed: where the kernel's spills are")
    inside = local_memory_between(sass, r"WARPGROUP\.ARRIVE", r"WARPGROUP\.DEPBAR")
    assert not inside, inside


def test_fp8_gemm_192_row_tiles_lower_unserialised():
    """``bm=192``: three compute warpgroups and the producer's at 128 registers a thread
    (setmaxnreg 160 / 32), 3 A boxes + 2 B boxes a slice, one 4-wgmma group a slice; no
    C7518, no local memory in the K loop; the plain and SwiGLU builds spill nothing (the
    save_pre and push epilogues a few words, outside the K loop)."""
    from mok_core.gemm import sm90_fp8
    from mok_core.gemm.sm90_fp8 import make_fp8_gemm
    for swiglu, pre, push, spills in [(False, False, False, 0), (True, False, False, 0),
                                      (True, True, False, 24), (False, False, True, 24)]:
        ptx = compile_sm90a(make_fp8_gemm(4, swiglu, 128, pre, push, bm=192),
                            sig(2 if push else 1))
        assert count(ptx, r"wgmma\.mma_async\.sync\.aligned\.m64n128k32\.f32\.e4m3\.e4m3") == 4
        assert count(ptx, r"cp\.async\.bulk\.tensor\.2d") == 5
        assert count(ptx, r"shfl\.sync\.idx\.b32") == (2 * 8 if push else 0)  # 8 chunks a lane
        regs = sm90_fp8.ROWS192_REGS
        assert count(ptx, rf"setmaxnreg\.dec\.sync\.aligned\.u32 {regs[1]};") == 1
        assert count(ptx, rf"setmaxnreg\.inc\.sync\.aligned\.u32 {regs[0]};") == 1
        report, sass = sass_sm90a(ptx)
        assert "Used 128 registers" in report, report[-600:]
        assert "C7518" not in report and "serialized" not in report, report[-600:]
        assert spill_bytes(report) <= spills, report[-600:]
        if sass is not None:
            inside = local_memory_between(sass, r"WARPGROUP\.ARRIVE", r"WARPGROUP\.DEPBAR")
            assert not inside, inside
