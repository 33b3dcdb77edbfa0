"""The backward's element-wise kernels compile for sm_90 (typing, no local memory): the SwiGLU
backward (routed, with the router weights read from and d_w pushed to 2 or 8 ranks; shared)
and the router-gradient epilogue."""
import pytest
from numba import float32, int32, int64, types, uint32

from mok_comm.combine import router_grads_kernel
from mok_core.swiglu_backward import _make_kernel
from ptx_util import compile_sm90, count

u32, i32, f32 = uint32[::1], int32[::1], float32[::1]


@pytest.mark.parametrize("routed,R", [(True, 2), (True, 8), (False, 1)])
def test_swiglu_backward_lowers(routed, R):
    peers = types.UniTuple(f32, R)
    sig = (u32, u32, u32, u32, u32, i32, i32, i32, i32, i32, peers, peers, int64, int64,
           float32)
    ptx = compile_sm90(_make_kernel(routed), sig)
    assert count(ptx, r"ld\.local|st\.local") == 0
    assert count(ptx, r"ex2\.approx") >= 1 and count(ptx, r"rcp\.approx") >= 1
    assert count(ptx, r"bar\.sync|barrier\.sync") >= (1 if routed else 0)


def test_router_grads_lowers():
    compile_sm90(router_grads_kernel, (i32, f32, f32))
