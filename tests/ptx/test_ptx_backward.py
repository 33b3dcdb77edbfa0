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
    sig = (u32, f32, f32, u32, u32, i32, i32, i32, i32, i32, peers, peers, int64, int64,
           float32)
    ptx = compile_sm90(_make_kernel(routed), sig)
    assert count(ptx, r"ld\.local|st\.local") == 0
    assert count(ptx, r"ex2\.approx") >= 1 and count(ptx, r"rcp\.approx") >= 1
    assert count(ptx, r"bar\.sync|barrier\.sync") >= (1 if routed else 0)


def test_router_grads_lowers():
    compile_sm90(router_grads_kernel, (i32, f32, f32))


def test_project_f32_lowers():
    """The backward's recompute of gate / up (``launch_project``: the plain gathered mma.sync
    GEMM with a float32 output) at the GPU tile: no local memory, float32 stores."""
    from numba import uint16

    from mok_core.gemm import MMA_SYNC_GEMM as g
    from mok_core.gemm.sm80 import make_grouped_gemm
    kern = make_grouped_gemm(g.bm, g.bn, g.bk, g.wm, g.wn, g.stages, False, True, f32_out=True)
    u16 = uint16[::1]
    sig = (u16, i32, u16, u16, i32, i32, f32, int64, int64, int64, float32, i32, int32, int32)
    ptx = compile_sm90(kern, sig)
    assert count(ptx, r"ld\.local|st\.local") == 0
    assert count(ptx, r"st\.global\.f32") >= 4
