"""Grouped GEMM specialisations compile for sm_90 with no local-memory traffic (the
accumulators and fragments must live in registers), and every production wgmma variant
assembles without serialised wgmmas."""
import re

import pytest
from numba import float32, int32, int64, types, uint16, uint32, uint64

from mok_core.gemm.sm80 import make_grouped_gemm
from ptx_util import (assemble_sm90a, compile_sm90, compile_sm90a, count, require_ptxas,
                      spill_bytes)

# out, then ``pre``: the saved gate / up pre-activations (a placeholder without SAVE_PRE)
_BASE = (uint16[::1], int32[::1], uint16[::1], uint16[::1], int32[::1], int32[::1], uint32[::1],
         types.UniTuple(float32[::1], 2), int64, int64, int64, float32)
# every kernel ends with the error word, the tensor id and the rank of its NaN/Inf check
_NF = (int32[::1], int32, int32)
SIG = _BASE + _NF
# wgmma kernels also take the weights' tensor maps (uint64 [16 per map]) after w1, and the
# push route (placeholders here: int32 arrays, a 1-tuple of the output).
_ROUTE = (int32[::1], int32[::1], int32[::1])
WG_SIG = (_BASE[:4] + (uint64[::1],) + _BASE[4:] + _ROUTE + (types.UniTuple(uint32[::1], 1),
                                                              int64) + _NF)
# down fused with the combine: out is a placeholder, the route is real (2 ranks).
PUSH_SIG = (WG_SIG[:7] + (int32[::1],) + WG_SIG[8:13] + _ROUTE
            + (types.UniTuple(uint32[::1], 2), int64) + _NF)
# the epilogue's NaN/Inf check: a fold per output pair, the vote, the bad path's reductions
NF_CHECK = (r"fma\.rn\.bf16x2", r"redux\.sync\.add\.s32", r"redux\.sync\.min\.s32",
            r"atom\.global\.max\.s32|atom\.max\.s32|red\.global\.max\.s32")
TMA = r"cp\.async\.bulk\.tensor\.2d\.shared::cluster\.global\.tile\.mbarrier"
ST_F32X2 = r"st(\.global)?\.v2\.f32"     # the saved pre-activations' 8-byte stores


def _wgmma_ptx(bn, stages, swiglu, push=False, bm=128, **kw):
    """PTX of the wgmma kernel (gate/up: gathered A; down: padding index) as the launch
    builds it (its launch bounds included)."""
    from mok_core.gemm.sm90 import make_wgmma_gemm
    kern = make_wgmma_gemm(bn, stages, swiglu, swiglu, True, push=push, bm=bm, **kw)
    return kern, compile_sm90a(kern, PUSH_SIG if push else WG_SIG)


@pytest.mark.parametrize("tile", [(128, 128, 32, 2, 4, 4), (128, 128, 64, 2, 4, 3),
                                  (32, 32, 32, 2, 1, 2), (64, 128, 32, 2, 2, 4)])
@pytest.mark.parametrize("swiglu,save_pre", [(True, False), (True, True), (False, False)],
                         ids=["swiglu", "swiglu-pre", "plain"])
def test_gemm_lowers_without_local_memory(tile, swiglu, save_pre):
    kern = make_grouped_gemm(*tile, swiglu, swiglu, save_pre=save_pre)
    ptx = compile_sm90(kern, SIG)
    bm, bn, bk, wm, wn, _ = tile
    mma_per_kslice = (bm // wm // 16) * (bn // wn // 8) * (bk // 16)
    n_mma = count(ptx, r"mma\.sync\.aligned\.m16n8k16")
    assert n_mma >= mma_per_kslice and n_mma % mma_per_kslice == 0   # (NVVM may unroll K)
    assert count(ptx, r"cp\.async\.cg\.shared\.global") >= 2
    assert count(ptx, r"ld\.local|st\.local") == 0, "accumulators spilled to local memory"
    for p in NF_CHECK:
        assert count(ptx, p) >= 1, p
    pairs = (bm // wm // 16) * (bn // wn // 8) * (2 if not swiglu else 1)
    assert count(ptx, r"fma\.rn\.bf16x2") == pairs        # one fold per written pair
    # SAVE_PRE: every accumulator pair once more, as FP32 (gate and up: 2 per hidden pair)
    assert count(ptx, ST_F32X2) == (2 * pairs if save_pre else 0)


@pytest.mark.parametrize("tile,gather", [((64, 128, 32, 2, 2, 4), True),
                                         ((128, 128, 64, 2, 4, 3), False)])
def test_dgrad_lowers_without_local_memory(tile, gather):
    """The B_KN specialisation (dgrad: weights read as stored, [K, N]; d_hidden gathers A,
    d_x reads it direct) at MMA_SYNC_GEMM's tile and a 128 x 128 one: B fragments by
    ldmatrix .trans, everything in registers, the plain epilogue's NaN/Inf check."""
    kern = make_grouped_gemm(*tile, False, gather, b_kn=True)
    ptx = compile_sm90(kern, SIG)
    bm, bn, bk, wm, wn, _ = tile
    mma_per_kslice = (bm // wm // 16) * (bn // wn // 8) * (bk // 16)
    n_mma = count(ptx, r"mma\.sync\.aligned\.m16n8k16")
    assert n_mma >= mma_per_kslice and n_mma % mma_per_kslice == 0
    n_trans = count(ptx, r"ldmatrix\.sync\.aligned\.m8n8\.x4\.trans\.shared\.b16")
    assert n_trans >= (bn // wn // 16) * (bk // 16)          # the B fragments of a slice
    assert count(ptx, r"ldmatrix\.sync\.aligned\.m8n8\.x4\.shared\.b16") >= 1   # A
    assert count(ptx, r"cp\.async\.cg\.shared\.global") >= 2
    assert count(ptx, r"ld\.local|st\.local") == 0, "accumulators spilled to local memory"
    for p in NF_CHECK:
        assert count(ptx, p) >= 1, p
    assert count(ptx, r"fma\.rn\.bf16x2") == (bm // wm // 16) * (bn // wn // 8) * 2


@pytest.mark.parametrize("bm", [128, 192])
@pytest.mark.parametrize("kind", ["gate_up", "gate_up_pre", "down", "down_push"])
def test_production_wgmma_kernels_lower_unserialised(bm, kind):
    """Every variant the layer launches (WGMMA_GEMM / WGMMA_192_GEMM: gate/up -- saving its
    FP32 pre-activations where the layer has a backward, ``_pre`` --, down, down fused with
    the combine): the arch-specific target, 4 wgmmas per slice with one group in flight, the
    TMA weight boxes (gate/up: two per slice, two maps acquired) on the full barriers, the
    staged epilogue (st.shared pairs, bulk stores, the read-wait before the next tile, the
    final wait; ``_pre``: one 8-byte FP32 store per accumulator pair), nothing in local memory
    in the K loop -- and ptxas keeps the wgmmas unserialised (C7518: a wgmma or warp barrier
    on a path it thinks divergent makes it serialise them all; the branches test a warp
    vote)."""
    swiglu, push, save_pre = kind.startswith("gate_up"), kind == "down_push", kind.endswith("pre")
    kern, ptx = _wgmma_ptx(256, 4, swiglu, push=push, bm=bm, save_pre=save_pre)
    assert ".target sm_90a" in ptx
    if bm > 128:
        assert ".maxntid 384, 1, 1" in ptx
    assert count(ptx, r"wgmma\.mma_async\.sync\.aligned\.m64n256k16\.f32\.bf16\.bf16") == 4
    assert count(ptx, r"wgmma\.wait_group\.sync\.aligned 1;") == 1
    assert count(ptx, r"vote\.sync\.all\.pred") >= 1
    boxes = 2 if swiglu else 1
    assert count(ptx, r"fence\.proxy\.tensormap::generic\.acquire") == boxes
    assert count(ptx, r"mbarrier\.arrive\.expect_tx") >= 1
    assert count(ptx, TMA) >= boxes and count(ptx, TMA) % boxes == 0
    assert count(ptx, r"cp\.async\.cg\.shared\.global") >= 1          # A rows (gathered)
    for p in (r"st\.shared\.u32", r"cp\.async\.bulk\.global\.shared::cta\.bulk_group",
              r"cp\.async\.bulk\.wait_group\.read 0", r"cp\.async\.bulk\.wait_group 0",
              *NF_CHECK):
        assert count(ptx, p) >= 1, p
    # one fold per staged pair: 256 columns (gate/up: 128 hidden) x 64 rows / 128 threads / 2
    assert count(ptx, r"fma\.rn\.bf16x2") == (32 if swiglu else 64)
    assert count(ptx, ST_F32X2) == (64 if save_pre else 0)     # 128 accumulators / 2
    loop = ptx[ptx.index("wgmma.fence"):ptx.index("wgmma.wait_group.sync.aligned 0;")]
    assert count(loop, r"ld\.local|st\.local") == 0, "accumulator in local memory in the K loop"
    report = assemble_sm90a(ptx)
    assert "C7518" not in report and "serialized" not in report, report[-600:]
    # 128 rows: no spills; 192 rows (384 threads, 168 registers): the staging's base made per
    # tile (``per_iteration``) keeps ptxas's spills to a few registers -- a bound, so that
    # they do not grow unseen
    assert spill_bytes(report) <= (0 if bm == 128 else 32), report[-600:]


@pytest.mark.parametrize("bn,stages", [(128, 5), (64, 3)])
def test_wgmma_tile_widths_lower_for_sm90a(bn, stages):
    """The other widths and ring depths GemmConfig allows: the MMA shape follows BN."""
    _, ptx = _wgmma_ptx(bn, stages, True)
    assert count(ptx, rf"wgmma\.mma_async\.sync\.aligned\.m64n{bn}k16\.f32\.bf16\.bf16") == 4
    loop = ptx[ptx.index("wgmma.fence"):ptx.index("wgmma.wait_group.sync.aligned 0;")]
    assert count(loop, r"ld\.local|st\.local") == 0


def test_wgmma_256_rows_lowers_unserialised():
    """4 warpgroups (512 threads, BN = 128, launch bounds): assembles, no serialised wgmma."""
    _, ptx = _wgmma_ptx(128, 4, False, push=True, bm=256)
    assert ".maxntid 512, 1, 1" in ptx
    assert count(ptx, r"wgmma\.mma_async\.sync\.aligned\.m64n128k16") == 4
    report = assemble_sm90a(ptx)
    assert "C7518" not in report and "serialized" not in report, report[-600:]


@pytest.mark.parametrize("swiglu", [True, False])
def test_two_blocks_per_sm_bound_the_registers(swiglu):
    """``blocks_per_sm=2`` must reach ptxas as launch bounds: unbounded, the 128 x 128 down
    kernel takes more registers than a second 256-thread block leaves room for."""
    from mok_core.gemm.sm90 import make_wgmma_gemm
    kern = make_wgmma_gemm(128, 3, swiglu, swiglu, True, bm=128, blocks_per_sm=2)
    assert kern.targetoptions.get("launch_bounds") == (256, 2)
    require_ptxas()                         # the rest is ptxas's register count
    _, ptx = _wgmma_ptx(128, 3, swiglu, bm=128, blocks_per_sm=2)
    report = assemble_sm90a(ptx)
    regs = [int(m) for m in re.findall(r"Used (\d+) registers", report)]
    assert regs and max(regs) <= 128, report[-400:]


@pytest.mark.parametrize("bn,gather,push", [(256, False, False), (128, True, False),
                                            (256, False, True)],
                         ids=["d_x", "d_hidden-bn128", "d_x-push"])
def test_wgmma_dgrad_lowers_unserialised(bn, gather, push):
    """sm90's B_KN specialisation (dgrad: weights as stored, MN-major B): the arch-specific
    target, 4 wgmmas per slice carrying imm-trans-a 0 / imm-trans-b 1, both weight maps
    acquired (w0 below K0, w1 above), TMA boxes on the full barriers, the staged plain
    epilogue with its NaN/Inf check (or the push), nothing in local memory in the K loop --
    and ptxas keeps the wgmmas unserialised (C7518)."""
    from mok_core.gemm.sm90 import make_wgmma_gemm
    kern = make_wgmma_gemm(bn, 4, False, gather, gather, push=push, bm=128, b_kn=True)
    ptx = compile_sm90a(kern, PUSH_SIG if push else WG_SIG)
    assert count(ptx, rf"wgmma\.mma_async\.sync\.aligned\.m64n{bn}k16\.f32\.bf16\.bf16") == 4
    assert count(ptx, r"wgmma\.mma_async[^;]*, p, 1, 1, 0, 1;") == 4
    assert count(ptx, r"wgmma\.wait_group\.sync\.aligned 1;") == 1
    assert count(ptx, r"fence\.proxy\.tensormap::generic\.acquire") == 2
    assert count(ptx, r"mbarrier\.arrive\.expect_tx") >= 1
    assert count(ptx, TMA) >= 1
    assert count(ptx, r"cp\.async\.cg\.shared\.global") >= 1          # A rows
    for p in (r"st\.shared\.u32", r"cp\.async\.bulk\.global\.shared::cta\.bulk_group",
              r"cp\.async\.bulk\.wait_group\.read 0", r"cp\.async\.bulk\.wait_group 0",
              *NF_CHECK):
        assert count(ptx, p) >= 1, p
    assert count(ptx, r"fma\.rn\.bf16x2") == bn // 4     # one fold per staged pair
    loop = ptx[ptx.index("wgmma.fence"):ptx.index("wgmma.wait_group.sync.aligned 0;")]
    assert count(loop, r"ld\.local|st\.local") == 0, "accumulator in local memory in the K loop"
    assert count(ptx, r"ld\.local|st\.local") == 0, "local memory in the dgrad kernel"
    report = assemble_sm90a(ptx)
    assert "C7518" not in report and "serialized" not in report, report[-600:]
