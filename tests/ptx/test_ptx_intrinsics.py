"""The intrinsics lower to the instructions they promise (sm_90 PTX, no GPU needed)."""
import pytest
from numba import float32, int32, uint16, uint32

import test_intrinsics as ti
from ptx_util import compile_sm90, count

u16, u32, f32, i32 = uint16[::1], uint32[::1], float32[::1], int32[::1]

CASES = {
    "ld_st_v4": (ti._copy_rows_v4, (u16, u16, i32, int32),
                 [r"ld(\.global)?\.v4\.u32", r"st(\.global)?\.v4\.u32"]),
    "bf16": (ti._convert, (f32, u16, u32, f32), [r"cvt\.rn\.bf16\.f32", r"cvt\.rn\.bf16x2\.f32"]),
    "flags": (ti._flags, (i32, i32), [r"ld\.acquire\.sys", r"st\.release\.sys",
                                      r"red\.release\.gpu\.add"]),
    "mma": (ti._mma_tile, (u16, u16, f32, f32),
            [r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32",
             r"ldmatrix\.sync\.aligned\.m8n8\.x4", r"ldmatrix\.sync\.aligned\.m8n8\.x2"]),
    "shared_addr": (ti._mma_tile_at, (u16, u16, f32, f32),
                    [r"cvta\.to\.shared\.u64", r"ldmatrix\.sync\.aligned\.m8n8\.x4\.shared\.b16",
                     r"cp\.async\.cg\.shared\.global"]),
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
