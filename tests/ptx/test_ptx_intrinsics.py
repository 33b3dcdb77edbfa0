"""The intrinsics lower to the instructions they promise (sm_90 PTX, no GPU needed)."""
import pytest
from numba import float32, int32, int64, types, uint16, uint32, uint64

import test_intrinsics as ti
from ptx_util import compile_sm90, count

u16, u32, f32, i32 = uint16[::1], uint32[::1], float32[::1], int32[::1]

CASES = {
    "ld_st_v4": (ti._copy_rows_v4, (u16, u16, i32, int32),
                 [r"ld(\.global)?\.v4\.u32", r"st(\.global)?\.v4\.u32"]),
    "st_v2_f32": (ti._swap_pairs_v2, (f32, f32), [r"st(\.global)?\.v2\.f32"]),
    "sfu": (ti._sfu, (f32, f32), [r"ex2\.approx\.ftz\.f32", r"rcp\.approx\.ftz\.f32"]),
    "bf16": (ti._convert, (f32, u32, f32), [r"cvt\.rn\.bf16x2\.f32"]),
    "max_u16x2": (ti._max_halves, (u32, u32, u32), [r"max\.u16x2"]),
    "flags": (ti._flags, (i32, i32), [r"ld\.acquire\.sys", r"st\.release\.sys",
                                      r"red\.release\.gpu\.add"]),
    "mma": (ti._mma_tile_at, (u16, u16, f32, f32),
            [r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32",
             r"cvta\.to\.shared\.u64", r"ldmatrix\.sync\.aligned\.m8n8\.x4\.shared\.b16",
             r"cp\.async\.cg\.shared\.global"]),
    "mma_trans": (ti._mma_tile_trans, (u16, u16, f32, f32),
                  [r"ldmatrix\.sync\.aligned\.m8n8\.x4\.trans\.shared\.b16"]),
    "tma": (ti._tma_box, (uint64[::1], u16, int32, int32, int32),
            [r"cp\.async\.bulk\.tensor\.2d\.shared::cluster\.global\.tile\.mbarrier::"
             r"complete_tx::bytes", r"fence\.proxy\.tensormap::generic\.acquire\.sys",
             r"fence\.mbarrier_init\.release\.cluster", r"mbarrier\.arrive\.expect_tx"]),
    "staged_stores": (ti._staged_stores, (u32, int32),
                      [r"st\.shared\.u32", r"cp\.async\.bulk\.global\.shared::cta\.bulk_group",
                       r"cp\.async\.bulk\.wait_group\.read 0", r"cp\.async\.bulk\.wait_group 0"]),
    "tma_f32": (ti._tma_f32_box, (uint64[::1], f32, int32, int32, int32, int32),
                [r"st\.shared\.v2\.f32", r"cp\.async\.bulk\.tensor\.2d\.global\.shared::cta"
                 r"\.bulk_group", r"ld\.shared\.v2\.f32 \{o0, o1\}", r"add\.rn\.f32 o0, o0",
                 r"cp\.async\.bulk\.tensor\.2d\.shared::cluster\.global"]),
    "tuple_pick": (ti._pick_write, (i32, i32, i32, i32), [r"selp\.b64"]),
    "match_any": (ti._match_masks, (i32, u32), [r"match\.any\.sync\.b32"]),
    "warp_fsum": (ti._warp_fsums, (f32, f32), [r"shfl\.sync\.bfly\.b32 t, s, 16, 31, -1;",
                                               r"shfl\.sync\.bfly\.b32 t, s, 1, 31, -1;",
                                               r"add\.rn\.f32 s, s, t;"]),
    "per_iteration": (ti._per_iteration_rows, (i32, int64[::1], int32),
                      [r"begin inline asm\s+mov\.b32", r"begin inline asm\s+mov\.b64"]),
    "tuple_groups": (ti._tuple_groups_kernel, (f32, f32, int64), [r"fma\.rn\.f32|mul\.f32"]),
    "cp_async_arrive": (ti._cp_async_arrivals, (f32, i32, f32),
                        [r"cp\.async\.ca\.shared\.global \[[^]]+\], \[g\], 4, z;",
                         r"cp\.async\.mbarrier\.arrive\.noinc\.shared::cta\.b64"]),
    "cp_async": (ti._cp_async_rows, (u16, i32, u16, int32),
                 [r"cp\.async\.cg\.shared\.global", r"cp\.async\.commit_group",
                  r"cp\.async\.wait_group 0"]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_intrinsic_lowers(name):
    kernel, sig, patterns = CASES[name]
    ptx = compile_sm90(kernel, sig)
    for p in patterns:
        assert count(ptx, p) >= 1, f"{p} missing from {name} PTX"


def test_wgmma_and_mbarrier_kernels_lower_for_sm90a():
    """The wgmma unit kernel (sm_90a only) and the mbarrier one compile to what they promise."""
    from numba import cuda

    ptx, _ = cuda.compile_ptx(ti._make_wgmma_slice(64).py_func, (u16, u16, f32), cc=(9, 0, "a"))
    for p in (r"wgmma\.fence\.sync\.aligned", r"wgmma\.mma_async\.sync\.aligned\.m64n64k16",
              r"wgmma\.commit_group", r"wgmma\.wait_group\.sync\.aligned 0",
              r"fence\.proxy\.async\.shared::cta"):
        assert count(ptx, p) >= 1, f"{p} missing"
    assert count(ptx, r"wgmma\.mma_async") == 4
    # both operands K-major: the transpose immediates (the last two) are 0
    assert count(ptx, r"wgmma\.mma_async[^;]*, p, 1, 1, 0, 0;") == 4
    # FP8: e4m3 x e4m3 -> f32, k32 steps, no transpose immediates at all
    ptx, _ = cuda.compile_ptx(ti._make_wgmma_slice(64, e4m3=True).py_func, (u16, u16, f32),
                              cc=(9, 0, "a"))
    assert count(ptx, r"wgmma\.mma_async\.sync\.aligned\.m64n64k32\.f32\.e4m3\.e4m3 "
                      r"[^;]*, p, 1, 1;") == 4
    ptx = compile_sm90(ti._mbarrier_phases, (i32,))
    for p in (r"mbarrier\.init\.shared::cta\.b64", r"mbarrier\.arrive\.expect_tx",
              r"mbarrier\.try_wait\.parity\.shared::cta\.b64"):
        assert count(ptx, p) >= 1, f"{p} missing"


def test_tuple_groups_keeps_the_tuple_out_of_local_memory():
    """Every element read at a constant index: no local (stack) copy of the tuple."""
    ptx = compile_sm90(ti._tuple_groups_kernel, (f32, f32, int64))
    assert count(ptx, r"\.local") == 0 and count(ptx, r"st\.global\.f32") == 4


@pytest.mark.parametrize("n", [64, 128])
def test_wgmma_b_transposed_lowers_with_the_transpose_immediate(n):
    """The ``_tb`` wgmmas (B MN-major, dgrad's weights as stored): imm-trans-a 0, imm-trans-b 1
    on each of the 4 k16 steps."""
    from numba import cuda

    ptx, _ = cuda.compile_ptx(ti._make_wgmma_slice_mn(n, False).py_func, (u16, u16, f32),
                              cc=(9, 0, "a"))
    assert count(ptx, rf"wgmma\.mma_async\.sync\.aligned\.m64n{n}k16\.f32\.bf16\.bf16") == 4
    assert count(ptx, r"wgmma\.mma_async[^;]*, p, 1, 1, 0, 1;") == 4


@pytest.mark.parametrize("n", [64, 128])
def test_wgmma_a_and_b_transposed_lower_with_both_transpose_immediates(n):
    """The ``_tatb`` wgmmas (A and B MN-major, the wgrad's operands as stored): imm-trans-a 1,
    imm-trans-b 1 on each of the 4 k16 steps."""
    from numba import cuda

    ptx, _ = cuda.compile_ptx(ti._make_wgmma_slice_mn(n, True).py_func, (u16, u16, f32),
                              cc=(9, 0, "a"))
    assert count(ptx, rf"wgmma\.mma_async\.sync\.aligned\.m64n{n}k16\.f32\.bf16\.bf16") == 4
    assert count(ptx, r"wgmma\.mma_async[^;]*, p, 1, 1, 1, 1;") == 4
