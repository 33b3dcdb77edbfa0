"""The backward's element-wise kernels compile for sm_90 (typing, no local memory): the SwiGLU
backward (a warp a row: routed, with the router weights read from and d_w pushed to 2 or 8
ranks; shared; either with the FP8 layer's 1 x 128 quantisation of [d_g | d_u]) and the
router-gradient epilogue; the layer's choice of dgrad tiles and the wgmma dgrad kernels it
launches on Hopper at real presets' shapes."""
import re

import pytest
from numba import float32, int32, int64, types, uint8, uint32, uint64

from mok_comm.combine import router_grads_kernel
from mok_core.swiglu_backward import _make_kernel
from ptx_util import assemble_sm90a, compile_sm90, count, spill_bytes

u32, i32, f32, u64, u8 = uint32[::1], int32[::1], float32[::1], uint64[::1], uint8[::1]


def swiglu_backward_sig(R):
    """``launch_swiglu_backward``'s kernel arguments (peers: R ranks)."""
    peers = types.UniTuple(f32, R)
    return (u64, f32, f32, u64, u64, i32, i32, i32, i32, i32, peers, peers, int64, int64,
            float32, u32, f32, u8, i32, int32, int32)


@pytest.mark.parametrize("routed,quant,R", [(True, False, 2), (True, False, 8),
                                            (False, False, 1), (True, True, 2)],
                         ids=["routed-2", "routed-8", "shared", "routed-quant"])
def test_swiglu_backward_lowers(routed, quant, R):
    """A warp a row: 16-byte loads of g and u, 8-byte ones of p (and h, routed), 8-byte
    stores; no shared memory, no barrier; d_w by the five-shuffle butterfly (routed);
    ``quant``: the row quantiser's e4m3 packs, warp amax and NaN/Inf vote."""
    ptx = compile_sm90(_make_kernel(routed, quant), swiglu_backward_sig(R))
    assert count(ptx, r"ld\.local|st\.local") == 0
    assert count(ptx, r"ex2\.approx") >= 1 and count(ptx, r"rcp\.approx") >= 1
    assert count(ptx, r"ld\.global\.v4\.[fub]32") == 2                    # g and u
    assert count(ptx, r"ld\.global\.u64") == (2 if routed else 1)        # p (and h)
    assert count(ptx, r"st\.global\.u64") == (3 if routed else 2)        # d_g, d_u (w h)
    assert count(ptx, r"bar\.sync|barrier\.sync|bar\.warp") == 0
    assert ".shared" not in ptx
    assert count(ptx, r"shfl\.sync\.bfly\.b32") == (5 if routed else 0)
    e4m3 = count(ptx, r"cvt\.rn\.satfinite\.e4m3x2\.f32")
    assert (e4m3 >= 4 and count(ptx, r"vote\.sync\.all\.pred") == 1
            and count(ptx, r"redux\.sync\.min\.s32") == 2) if quant else e4m3 == 0
    assert spill_bytes(assemble_sm90a(ptx)) == 0          # (skipped without a matching ptxas)


def test_router_grads_lowers():
    compile_sm90(router_grads_kernel, (i32, f32, f32))


# ---- the backward's wgmma dgrads (``mok_comm.layer.dgrad_gemm``) --------------------------------

_DGRAD_PRESETS = ("qwen3.5-397b", "kimi-k2.7")


def _layer_dgrad_gemms():
    """The dgrad tiles a Hopper layer takes at the presets' shapes (EP 1 and 8) behind either
    forward tile ``default_gemm`` picks there (128 or 192 rows)."""
    from mok_comm.layer import backward_gemm, dgrad_gemm
    from mok_core.config import MoKConfig, preset
    from mok_core.gemm import WGMMA_192_GEMM, WGMMA_GEMM
    cfg = MoKConfig()
    return {dgrad_gemm(shape, cfg, (fwd, fwd), backward_gemm(shape, cfg))
            for shape in (preset(p, ep) for p in _DGRAD_PRESETS for ep in (1, 8))
            for fwd in (WGMMA_GEMM, WGMMA_192_GEMM)}


def test_layer_dgrad_gemm_choice():
    """wgmma (``DGRAD_GEMM``) behind a wgmma forward where the shape splits into its tile; the
    mma.sync ``backward_gemm`` behind an mma.sync forward, or where I (N of d_hidden, K0 of
    d_x) is no multiple of its bn, or row_align of its row_unit."""
    from mok_comm.layer import DGRAD_GEMM, backward_gemm, dgrad_gemm
    from mok_core.config import LayerShape, MoKConfig, preset
    from mok_core.gemm import MMA_SYNC_GEMM, WGMMA_GEMM
    assert _layer_dgrad_gemms() == {DGRAD_GEMM} and DGRAD_GEMM.mma == "wgmma"
    cfg = MoKConfig()
    qwen = preset("qwen3.5-397b")
    bwd = backward_gemm(qwen, cfg)
    assert bwd.mma == "mma_sync"
    assert dgrad_gemm(qwen, cfg, (MMA_SYNC_GEMM, MMA_SYNC_GEMM), bwd) is bwd
    assert dgrad_gemm(qwen, cfg, (WGMMA_GEMM, MMA_SYNC_GEMM), bwd) is bwd
    odd = LayerShape(hidden=4096, intermediate=1088, shared_intermediate=1024, num_experts=512,
                     topk=10)
    assert dgrad_gemm(odd, cfg, (WGMMA_GEMM, WGMMA_GEMM), backward_gemm(odd, cfg)).mma == \
        "mma_sync"
    cfg32 = MoKConfig(row_align=32, minibatch_size=64)
    assert dgrad_gemm(qwen, cfg32, (WGMMA_GEMM, WGMMA_GEMM), bwd) is bwd


@pytest.mark.parametrize("use", ["d_hidden", "d_x"])
def test_layer_wgmma_dgrad_lowers_unserialised(use):
    """The wgmma dgrad kernels the backward launches on Hopper at the qwen3.5-397b and
    kimi-k2.7 shapes (``_layer_dgrad_gemms``: one tile), built as ``sm90._kernel`` builds them
    for ``launch_dgrad``: d_hidden = d_out W_down gathers A through the padding index, d_x =
    [d_g | d_u] [W_gate; W_up] reads it direct. Arch-specific target, 4 wgmmas per slice with
    imm-trans-b 1, both weight maps acquired, TMA boxes, the plain staged epilogue with its
    NaN/Inf check, no local memory anywhere -- and ptxas (where it reads numba's PTX) keeps
    the wgmmas unserialised (C7518) without spills."""
    from mok_core.gemm.sm90 import make_wgmma_gemm
    from ptx_util import compile_sm90a
    from test_ptx_gemm import NF_CHECK, TMA, WG_SIG
    (g,) = _layer_dgrad_gemms()
    gather = use == "d_hidden"
    kern = make_wgmma_gemm(g.bn, g.stages, False, gather, gather, push=False, bm=g.bm,
                           max_registers=g.max_registers, blocks_per_sm=g.blocks_per_sm,
                           b_kn=True)
    ptx = compile_sm90a(kern, WG_SIG)
    assert count(ptx, rf"wgmma\.mma_async\.sync\.aligned\.m64n{g.bn}k16\.f32\.bf16\.bf16") == 4
    assert count(ptx, r"wgmma\.mma_async[^;]*, p, 1, 1, 0, 1;") == 4
    assert count(ptx, r"wgmma\.wait_group\.sync\.aligned 1;") == 1
    assert count(ptx, r"vote\.sync\.all\.pred") >= 1
    assert count(ptx, r"fence\.proxy\.tensormap::generic\.acquire") == 2
    assert count(ptx, TMA) >= 1
    assert count(ptx, r"cp\.async\.cg\.shared\.global") >= 1          # A rows
    for p in (r"cp\.async\.bulk\.global\.shared::cta\.bulk_group", *NF_CHECK):
        assert count(ptx, p) >= 1, p
    assert count(ptx, r"fma\.rn\.bf16x2") == g.bn // 4     # one fold per staged pair
    assert count(ptx, r"ld\.local|st\.local") == 0, "local memory in the dgrad kernel"
    report = assemble_sm90a(ptx)
    assert "C7518" not in report and "serialized" not in report, report[-600:]
    assert not re.search(r"[1-9]\d* bytes spill", report), report[-600:]
