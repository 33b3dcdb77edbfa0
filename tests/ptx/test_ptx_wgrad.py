"""The wgrad GEMM's specialisations compile for sm_90 with no local-memory traffic (the
accumulators, fragments, per-thread addresses and prefetched gather rows must live in
registers): the mma.sync kernel (``sm80_wgrad``) with the transposing ldmatrix, the wgmma
kernel (``sm90_wgrad``) with both operands MN-major (imm-trans-a = imm-trans-b = 1) and no
serialised wgmma (C7518, where the local ptxas reads numba's PTX); and the layer's choice of
tiles (``mok_comm.layer.wgrad_gemm``)."""
import re

import pytest
from numba import float32, int32, int64, uint16, uint32, uint64

from mok_core.gemm.sm80_wgrad import make_wgrad_gemm
from ptx_util import compile_sm90, compile_sm90a, count


def wgrad_sig(out):
    """The wgrad kernels' argument types (both families), ``out`` the outputs' element type:
    uint32 (bf16 pairs) or float32."""
    return (uint16[::1], int32[::1], uint16[::1], int32[::1], int32[::1], int32[::1],
            out[::1], out[::1], int64, int64, int64, int32[::1], int32, int32)


def wgmma_wgrad_sig(out_f32):
    """``sm90_wgrad``'s: the wgrad signature + the outputs' tensor maps (the outputs
    themselves are not read: every tile leaves through the maps)."""
    return wgrad_sig(float32 if out_f32 else uint32) + (uint64[::1],)


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
    ptx = compile_sm90(kern, wgrad_sig(float32 if out_f32 else uint32))
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


# ---- the wgmma wgrad (``sm90_wgrad``) -----------------------------------------------------------

# the wgmma wgrad's: KINDS' and plain FP32 outputs; ``accumulate`` at tiles up to 128 wide
WGMMA_KINDS = dict(KINDS, f32=(False, True, True, False))
WGMMA_CASES = [(256, 3, "bf16"), (256, 4, "bf16"), (256, 3, "f32")] + [
    (bn, stages, kind) for bn, stages in ((128, 4), (64, 2)) for kind in WGMMA_KINDS]


def _wgmma_wgrad_ptx(bm, bn, stages, kind):
    """PTX of the wgmma wgrad as ``sm90_wgrad._kernel`` builds it (launch bounds included)."""
    from mok_core.gemm.sm90_wgrad import make_wgmma_wgrad
    gather_a, gather_b, out_f32, accumulate = WGMMA_KINDS[kind]
    kern = make_wgmma_wgrad(bm, bn, stages, gather_a, gather_b, out_f32, accumulate)
    return compile_sm90a(kern, wgmma_wgrad_sig(out_f32))


@pytest.mark.parametrize("bn,stages,kind", WGMMA_CASES)
def test_wgmma_wgrad_lowers_unserialised(bn, stages, kind):
    """``sm90_wgrad`` at the layer's 128 x 256 tiles (``WGRAD_WGMMA_GEMM``: 3 stages, the bf16
    rows staged whole; ``WGRAD_WGMMA_DEEP_GEMM``: 4, half a tile at a time; FP32 outputs: 3),
    128 x 128 (4 stages beside a whole FP32 tile's staging: main-grad's) and the narrowest one (2
    stages, the shallowest ring): the arch-specific target, the two roles meeting at
    mbarriers (the producer's arrivals made by the hardware as its cp.async copies land,
    ``.noinc``: no wait for them in its stream; a proxy fence after each wait on them), 4
    wgmmas per slice
    carrying imm-trans-a 1 and imm-trans-b 1 (both operands MN-major), one group left in
    flight in the K loop, the operands' rows by cp.async; the TMA epilogue (staged values, a
    proxy fence, a TMA store a box -- the maps acquired first --, the staging reused after a
    wait for their reads, the stores waited before the exit; the warps neither store nor load
    output themselves): bf16 pairs with one fold each, or FP32 pairs by 8-byte shared stores
    (at 256 columns in two halves: two waits for the reads; ``f32_whole``: one) -- with
    ``accumulate`` added (IEEE adds) to the output's values, TMA-loaded into the staging at
    the tile's start on the warp's own mbarrier; the NaN/Inf check; no local memory anywhere
    -- and ptxas keeps the wgmmas unserialised (C7518) without spills."""
    from ptx_util import assemble_sm90a

    from mok_core.gemm.epilogue import f32_whole
    from mok_core.gemm.sm90_wgrad import bf16_parts
    gather_a, gather_b, out_f32, accumulate = WGMMA_KINDS[kind]
    ptx = _wgmma_wgrad_ptx(128, bn, stages, kind)
    assert ".target sm_90a" in ptx
    assert count(ptx, rf"wgmma\.mma_async\.sync\.aligned\.m64n{bn}k16\.f32\.bf16\.bf16") == 4
    assert count(ptx, r"wgmma\.mma_async[^;]*, p, 1, 1, 1, 1;") == 4
    assert count(ptx, r"wgmma\.wait_group\.sync\.aligned 1;") == 1
    assert count(ptx, r"cp\.async\.cg\.shared\.global") >= 2            # A and B rows
    tma_loads = count(ptx, r"cp\.async\.bulk\.tensor\.\dd\.shared")  # main-grad's output
    assert (1 <= tma_loads <= bn // 32) if accumulate else tma_loads == 0
    assert count(ptx, r"mbarrier\.init") >= 3                # full[], empty[], the warps'
    assert count(ptx, r"cp\.async\.mbarrier\.arrive\.noinc\.shared") == 1   # the producer's
    assert count(ptx, r"(?<!cp\.async\.)mbarrier\.arrive\.shared") >= 2  # the compute side's
    assert count(ptx, r"mbarrier\.try_wait\.parity") >= 2 + accumulate   # + the prefetch's
    assert count(ptx, r"mbarrier\.arrive\.expect_tx") == (1 if accumulate else 0)
    assert count(ptx, r"cp\.async\.wait_group") == 1                   # the exit's only
    assert count(ptx, r"bar\.sync|barrier\.sync") == 1                 # the block's one barrier
    for p in NF_CHECK:
        assert count(ptx, p) >= 1, p
    values = 64 * bn // 128                  # accumulator values per thread
    assert count(ptx, r"cp\.async\.bulk\.global") == 0            # no per-row bulk copies
    # the warps neither store output nor read it
    assert count(ptx, r"st\.(global\.)?(v4\.u32|v2\.f32|f32)") == 0
    assert count(ptx, r"ld\.(global\.)?(v2\.)?f32") == 0
    assert count(ptx, r"fence\.proxy\.tensormap::generic\.acquire") >= 2     # both maps
    assert count(ptx, r"fence\.proxy\.async") >= 2                  # loads' and stores'
    # the slice's chunks fenced into the async proxy right after the wait that saw them land
    assert re.search(r"mbarrier\.try_wait\.parity[^\n]*\n(?:(?!wgmma)[^\n]*\n){0,12}?"
                     r"[^\n]*fence\.proxy\.async", ptx), "no proxy fence after the full[] wait"
    assert count(ptx, r"cp\.async\.bulk\.wait_group 0;") >= 1            # before the exit
    store = r"cp\.async\.bulk\.tensor\.2d\.global\.shared::cta\.bulk_group"
    assert count(ptx, r"cp\.reduce\.async\.bulk") == 0
    if out_f32:
        assert count(ptx, r"st\.shared\.v2\.f32") == values // 2    # a pair each
        assert count(ptx, r"ld\.shared\.v2\.f32") == (values // 2 if accumulate else 0)
        assert count(ptx, r"add\.rn\.f32") == (values if accumulate else 0)
        waits = count(ptx, r"cp\.async\.bulk\.wait_group\.read 0;")   # (+1 between halves)
        assert waits == (1 if f32_whole(bn) else 2), waits
        assert 2 <= count(ptx, store) <= bn // 32               # a box each (may roll)
    else:
        assert count(ptx, r"st\.shared\.u32") >= 1
        assert 1 <= count(ptx, store) <= bn // 64                 # a box each (may roll)
        waits = count(ptx, r"cp\.async\.bulk\.wait_group\.read 0;")   # (one a part)
        assert waits == bf16_parts(bn, stages), waits
        assert count(ptx, r"fma\.rn\.bf16x2") == values // 2        # one fold per pair
    assert count(ptx, r"ld\.local|st\.local") == 0, "local memory in the wgrad kernel"
    report = assemble_sm90a(ptx)
    assert "C7518" not in report and "serialized" not in report, report[-600:]
    assert " 0 bytes spill stores, 0 bytes spill loads" in report, report[-600:]


def test_layer_wgrad_gemm_choice():
    """``WGRAD_WGMMA_GEMM`` (wgmma, 128 x 256, 3 stages; ``WGRAD_WGMMA_DEEP_GEMM``, 4, where an
    expert's rows take more than two 64-row slices; main-grad's ``WGRAD_MAIN_GRAD_GEMM``, 128 x
    128 with a whole FP32 tile's staging, which it needs) behind a wgmma forward at the presets'
    shapes, tiles ``sm90_wgrad`` takes; the mma.sync ``WGRAD_GEMM`` behind an mma.sync
    forward or where H, I or I_s is no multiple of the wgmma tile's sides (and the backward's
    tiles where not even that one fits)."""
    from mok_comm.layer import (WGRAD_GEMM, WGRAD_MAIN_GRAD_GEMM, WGRAD_WGMMA_DEEP_GEMM,
                                WGRAD_WGMMA_GEMM, backward_gemm, wgrad_gemm)
    from mok_core.config import LayerShape, MoKConfig, preset
    from mok_core.gemm import MMA_SYNC_GEMM, WGMMA_192_GEMM, WGMMA_GEMM
    from mok_core.gemm.epilogue import f32_whole
    from mok_core.gemm.sm90_wgrad import SMEM_LIMIT, bf16_parts, smem_bytes, tile_ok
    g, deep = WGRAD_WGMMA_GEMM, WGRAD_WGMMA_DEEP_GEMM
    mg = WGRAD_MAIN_GRAD_GEMM
    assert g.mma == deep.mma == "wgmma" and tile_ok(g.bm, g.bn) and (g.bm, g.bn) == (
        deep.bm, deep.bn) and deep.stages == g.stages + 1
    assert mg.mma == "wgmma" and tile_ok(mg.bm, mg.bn) and f32_whole(mg.bn)
    assert smem_bytes(mg.bn, mg.stages, True) <= SMEM_LIMIT
    # bf16: the 3-slice ring beside a whole tile's staging, the 4-slice one beside half; FP32
    # gradients would not fit beside the deep one (``backward._wgrad_tiles``: main-grad's tile)
    assert bf16_parts(g.bn, g.stages) == 1 and bf16_parts(deep.bn, deep.stages) == 2
    assert smem_bytes(deep.bn, deep.stages) <= SMEM_LIMIT < smem_bytes(deep.bn, deep.stages, True)
    cfg = MoKConfig()
    for name in ("qwen3.5-397b", "kimi-k2.7", "glm-5.2"):
        for ep in (1, 8):
            shape = preset(name, ep)
            bwd = backward_gemm(shape, cfg)
            for fwd in (WGMMA_GEMM, WGMMA_192_GEMM):
                assert wgrad_gemm(shape, bwd, (fwd, fwd)) is g, (name, ep, fwd)
                assert wgrad_gemm(shape, bwd, (fwd, fwd), rows=128) is g      # two slices
                assert wgrad_gemm(shape, bwd, (fwd, fwd), rows=128.5) is deep
                assert wgrad_gemm(shape, bwd, (fwd, fwd), main_grad=True, rows=500) is mg
            assert wgrad_gemm(shape, bwd, (MMA_SYNC_GEMM, MMA_SYNC_GEMM)) is WGRAD_GEMM
            assert wgrad_gemm(shape, bwd, (WGMMA_GEMM, MMA_SYNC_GEMM)) is WGRAD_GEMM
            assert wgrad_gemm(shape, bwd) is WGRAD_GEMM
    # the backward launches FP32 gradients (added to or not) on main-grad's tile, bf16 on the
    # layer's (whose deep ring has no room for FP32 staging)
    import types

    import numpy as np

    from mok_comm.backward import _wgrad_tiles
    stub = types.SimpleNamespace(wgrad_gemm=deep, main_grad_gemm=mg)
    assert _wgrad_tiles(stub, np.zeros(1, np.float32)) is mg
    assert _wgrad_tiles(stub, np.zeros(1, np.uint16)) is deep
    odd = LayerShape(hidden=4096, intermediate=1152, shared_intermediate=1024,
                     num_experts=512, topk=10)                 # I: 9 x 128, no multiple of 256
    assert wgrad_gemm(odd, backward_gemm(odd, cfg), (WGMMA_GEMM, WGMMA_GEMM)) is WGRAD_GEMM
    odd = LayerShape(hidden=4096, intermediate=1088, shared_intermediate=1024,
                     num_experts=512, topk=10)                 # I = 17 x 64: the backward's
    bwd = backward_gemm(odd, cfg)
    assert wgrad_gemm(odd, bwd, (WGMMA_GEMM, WGMMA_GEMM)) is bwd
