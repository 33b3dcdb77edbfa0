"""Communication kernels type-check for sm_90, peer views as tuples of arrays (R = 2 and 8)."""
import pytest
from numba import boolean, float32, int32, int64, types, uint16

from mok_comm import barrier, combine, dispatch, routing
from ptx_util import compile_sm90, count

u16, i32, f32 = uint16[::1], int32[::1], float32[::1]


def cases(R):
    peers16 = types.UniTuple(u16, R)
    peers32 = types.UniTuple(i32, R)
    return {
        "push_ids": (routing.push_ids_kernel, (int64, i32, peers32), []),
        "barrier": (barrier.barrier_kernel, (int64, i32, i32, peers32, int64, i32),
                    [r"st\.release\.sys", r"ld\.acquire\.sys", r"%clock64", r"nanosleep"]),
        "dispatch": (dispatch.pull_dispatch_kernel,
                     (int64, peers16, i32, u16, i32, int64, int64, int64, int64, int64),
                     [r"ld(\.global)?\.v4\.u32", r"red\.release\.gpu\.add",
                      r"membar\.gl|fence\.sc\.gpu"]),
        "count_copied": (dispatch.count_copied_kernel, (i32, i32, int64, int64, int64, int64),
                         [r"atom\.shared\.add|red\.shared\.add", r"red\.release\.gpu\.add"]),
        "combine": (combine.push_combine_kernel, (u16, i32, i32, i32, i32, peers16, int64,
                                                  int64), [r"st(\.global)?\.v4\.u32"]),
        "epilogue": (combine.combine_epilogue_kernel,
                     (u16, boolean, u16, i32, f32, u16, int64, int64, int64),
                     [r"mul\.rn\.f32", r"add\.rn\.f32"]),
        "gather_index": (dispatch.gather_index_kernel, (i32, i32, int64, i32), []),
        "publish_x": (dispatch.publish_x_kernel, (int64, u16, u16, f32, int64, int64, i32,
                                                   int32),
                      [r"ld(\.global)?\.v4\.u32", r"st(\.global)?\.v4\.u32"]),
        "push_fingerprint": (routing.push_fingerprint_kernel, (int64, i32, peers32), []),
        "compare_fingerprints": (routing.compare_fingerprints_kernel,
                                 (int64, int32[:, ::1], i32), []),
        "check_push_ids_int64": (routing.check_push_ids_kernel,
                                 (int64, types.int64[::1], int64, i32, int64, int64, peers32,
                                  i32),
                                 [r"atom\.global\.add", r"bar\.sync|barrier\.sync"]),
        "check_push_ids_int32": (routing.check_push_ids_kernel,
                                 (int64, i32, int64, i32, int64, int64, peers32, i32),
                                 [r"atom\.global\.add"]),
    }


@pytest.mark.parametrize("R", [2, 8])
@pytest.mark.parametrize("name", sorted(cases(2)))
def test_comm_kernel_lowers(name, R):
    kernel, sig, patterns = cases(R)[name]
    ptx = compile_sm90(kernel, sig)
    for p in patterns:
        assert count(ptx, p) >= 1, f"{p} missing in {name}"
    if name == "epilogue":       # the fixed-order sum must not be contracted into FMAs
        assert count(ptx, r"\bfma\.rn\.f32") == 0
