"""Communication kernels type-check for sm_90, peer views as tuples of arrays (R = 2 and 8)."""
import pytest
from numba import boolean, float32, int32, int64, types, uint16

from mok_comm.kernels import (agreement, allgather, barrier, cast, combine, dispatch, epilogue,
                              index, publish, push_dispatch)
from ptx_util import compile_sm90, count

u16, i32, f32 = uint16[::1], int32[::1], float32[::1]


def cases(R):
    peers16 = types.UniTuple(u16, R)
    peers32 = types.UniTuple(i32, R)
    return {
        "push_ids": (allgather.push_ids_kernel, (int64, i32, peers32), []),
        "barrier": (barrier.barrier_kernel, (int64, i32, i32, peers32, int64, i32),
                    [r"st\.release\.sys", r"ld\.acquire\.sys", r"%clock64", r"nanosleep"]),
        "dispatch": (dispatch.pull_dispatch_kernel,
                     (int64, peers16, i32, u16, i32, int64, int64, int64, int64, int64),
                     [r"ld(\.global)?\.v4\.u32", r"red\.release\.gpu\.add"]),
        "dispatch_bulk": (dispatch.pull_dispatch_bulk_kernel,
                          (int64, peers16, i32, u16, i32, int64, int64, int64, int64, int64,
                           int64, int64, i32),
                          [r"cp\.async\.bulk\.shared::cluster\.global\.mbarrier::complete_tx",
                           r"cp\.async\.bulk\.global\.shared::cta\.bulk_group",
                           r"mbarrier\.arrive\.expect_tx", r"cp\.async\.bulk\.wait_group 0",
                           r"red\.release\.gpu\.add", r"%clock64"]),
        "push_dispatch": (push_dispatch.push_dispatch_kernel,
                          (int64, u16, peers16, i32, i32, peers32, int64, int64, int64, int64,
                           int64),
                          [r"st(\.global)?\.v4\.u32", r"red\.release\.sys(\.global)?\.add",
                           r"membar\.sys|fence\.sc\.sys"]),
        "wait_arrivals": (push_dispatch.wait_arrivals_kernel,
                          (int64, i32, i32, i32, int64, i32),
                          [r"ld\.acquire\.sys", r"atom(\.global)?\.add|red(\.global)?\.add",
                           r"red\.release\.gpu\.add", r"%clock64"]),
        "publish_all": (dispatch.publish_all_kernel, (i32, i32), [r"red\.release\.gpu\.add"]),
        "publish_tokens": (dispatch.publish_tokens_kernel, (i32, i32, int64, int64, int64, int64),
                           [r"atom\.shared\.add|red\.shared\.add", r"red\.release\.gpu\.add"]),
        "combine_bulk": (combine.push_combine_bulk_kernel,
                         (int64, u16, i32, i32, i32, i32, peers16, int64, int64, int64, int64,
                          i32),
                         [r"cp\.async\.bulk\.shared::cluster\.global\.mbarrier::complete_tx",
                          r"cp\.async\.bulk\.global\.shared::cta\.bulk_group"]),
        "combine": (combine.push_combine_kernel, (u16, i32, i32, i32, i32, peers16, int64,
                                                  int64), [r"st(\.global)?\.v4\.u32"]),
        "epilogue": (epilogue.combine_epilogue_kernel,
                     (u16, boolean, u16, i32, f32, u16, int64, int64, int64),
                     [r"mul\.rn\.f32", r"add\.rn\.f32"]),
        "gather_index": (index.gather_index_kernel, (i32, i32, int64, i32), []),
        "publish_x": (publish.publish_x_kernel, (u16, u16, f32, i32),
                      [r"ld(\.global)?\.v4\.u32", r"st(\.global)?\.v4\.u32"]),
        "push_fingerprint": (agreement.push_fingerprint_kernel, (int64, i32, peers32), []),
        "compare_fingerprints": (agreement.compare_fingerprints_kernel,
                                 (int64, int32[:, ::1], i32), []),
        "ids_to_int32": (cast.ids_to_int32_kernel, (types.int64[::1], i32), []),
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
