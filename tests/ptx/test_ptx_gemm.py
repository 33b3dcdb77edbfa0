"""Grouped GEMM specialisations compile for sm_90 with no local-memory traffic (the
accumulators and fragments must live in registers)."""
import re

import pytest
from numba import float32, int32, int64, types, uint16, uint32, uint64

from mok_core.grouped_gemm_kernels import make_grouped_gemm
from ptx_util import assemble_sm90a, compile_sm90, count, require_ptxas

SIG = (uint16[::1], int32[::1], uint16[::1], uint16[::1], int32[::1], int32[::1], uint32[::1],
       int64, int64, int64, float32)
# wgmma kernels also take the weights' tensor maps (uint64 [16 per map]) after w1, and the
# push route last (placeholders here: int32 arrays, a 1-tuple of the output).
_ROUTE = (int32[::1], int32[::1], int32[::1])
WG_SIG = SIG[:4] + (uint64[::1],) + SIG[4:] + _ROUTE + (types.UniTuple(uint32[::1], 1), int64)
# down fused with the combine: out is a placeholder, the route is real (2 ranks).
PUSH_SIG = WG_SIG[:7] + (int32[::1],) + WG_SIG[8:12] + _ROUTE + (types.UniTuple(uint32[::1], 2),
                                                                   int64)


@pytest.mark.parametrize("tile", [(128, 128, 32, 2, 4, 4), (128, 128, 64, 2, 4, 3),
                                  (32, 32, 32, 2, 1, 2)])
@pytest.mark.parametrize("swiglu", [True, False])
def test_gemm_lowers_without_local_memory(tile, swiglu):
    kern = make_grouped_gemm(*tile, swiglu, swiglu)
    ptx = compile_sm90(kern, SIG)
    bm, bn, bk, wm, wn, _ = tile
    mma_per_kslice = (bm // wm // 16) * (bn // wn // 8) * (bk // 16)
    n_mma = count(ptx, r"mma\.sync\.aligned\.m16n8k16")
    assert n_mma >= mma_per_kslice and n_mma % mma_per_kslice == 0   # (NVVM may unroll K)
    assert count(ptx, r"cp\.async\.cg\.shared\.global") >= 2
    assert count(ptx, r"ld\.local|st\.local") == 0, "accumulators spilled to local memory"


@pytest.mark.parametrize("bn,stages", [(256, 4), (128, 5), (64, 3)])
@pytest.mark.parametrize("swiglu", [True, False])
def test_wgmma_gemm_lowers_for_sm90a(bn, stages, swiglu):
    """The wgmma kernel needs the arch-specific target (numba picks sm_90a on an H100/H200);
    4 wgmmas per K slice, the async-proxy fence, the accumulator never in local memory in the
    main loop (only the SwiGLU epilogue may stage it there)."""
    from numba import cuda

    from mok_core.grouped_gemm_wgmma_kernels import make_wgmma_grouped_gemm
    kern = make_wgmma_grouped_gemm(bn, stages, swiglu, swiglu, True)
    ptx, _ = cuda.compile_ptx(kern.py_func, WG_SIG, cc=(9, 0, "a"))
    assert ".target sm_90a" in ptx
    assert count(ptx, rf"wgmma\.mma_async\.sync\.aligned\.m64n{bn}k16\.f32\.bf16\.bf16") == 4
    assert count(ptx, r"wgmma\.wait_group\.sync\.aligned 1;") == 1
    assert count(ptx, r"fence\.proxy\.async\.shared::cta") == 1
    loop = ptx[ptx.index("wgmma.fence"):ptx.index("wgmma.wait_group.sync.aligned 0;")]
    assert count(loop, r"ld\.local|st\.local") == 0, "accumulator in local memory in the K loop"


@pytest.mark.parametrize("bn,stages", [(256, 4), (128, 6)])
@pytest.mark.parametrize("swiglu", [True, False])
def test_wgmma_ws_gemm_lowers_for_sm90a(bn, stages, swiglu):
    """Warp-specialised wgmma kernel: launch bounds (384 threads) reach the PTX, the register
    hand-over and the mbarrier protocol are there, the MMAs are the same 4 per slice."""
    from numba import cuda

    from mok_core.grouped_gemm_wgmma_ws_kernels import (CONSUMER_REGISTERS, PRODUCER_REGISTERS,
                                                        THREADS, make_wgmma_ws_grouped_gemm)
    kern = make_wgmma_ws_grouped_gemm(bn, stages, swiglu, swiglu, True)
    ptx, _ = cuda.compile_ptx(kern.py_func, WG_SIG, cc=(9, 0, "a"), launch_bounds=(THREADS, 1))
    assert f".maxntid {THREADS}, 1, 1" in ptx
    assert count(ptx, rf"wgmma\.mma_async\.sync\.aligned\.m64n{bn}k16\.f32\.bf16\.bf16") == 4
    assert count(ptx, rf"setmaxnreg\.dec\.sync\.aligned\.u32 {PRODUCER_REGISTERS};") == 1
    assert count(ptx, rf"setmaxnreg\.inc\.sync\.aligned\.u32 {CONSUMER_REGISTERS};") == 1
    assert count(ptx, r"cp\.async\.mbarrier\.arrive\.noinc") == 1
    assert count(ptx, r"mbarrier\.try_wait\.parity") >= 2


@pytest.mark.parametrize("ws", [False, True], ids=["wgmma", "wgmma_ws"])
@pytest.mark.parametrize("swiglu", [True, False])
def test_wgmma_tma_gemm_lowers_for_sm90a(ws, swiglu):
    """TMA weight tiles: one thread acquires the maps (gate/up: two), arms full[s] with the
    slice's bytes and issues the boxes (two for gate/up); no cp.async is left for B, and it
    assembles (ptxas, when the toolkit is installed)."""
    from numba import cuda

    from mok_core import grouped_gemm_wgmma_kernels as wk
    from mok_core import grouped_gemm_wgmma_ws_kernels as wsk
    if ws:
        kern = wsk.make_wgmma_ws_grouped_gemm(256, 4, swiglu, swiglu, True, tma_b=True)
        opts = {"launch_bounds": (wsk.THREADS, 1)}
    else:
        kern = wk.make_wgmma_grouped_gemm(256, 4, swiglu, swiglu, True, tma_b=True)
        opts = {}
    ptx, _ = cuda.compile_ptx(kern.py_func, WG_SIG, cc=(9, 0, "a"), **opts)
    boxes = 2 if swiglu else 1
    tma = r"cp\.async\.bulk\.tensor\.2d\.shared::cluster\.global\.tile\.mbarrier"
    assert count(ptx, r"fence\.proxy\.tensormap::generic\.acquire") == boxes
    assert count(ptx, r"mbarrier\.arrive\.expect_tx") >= 1
    assert count(ptx, tma) >= boxes and count(ptx, tma) % boxes == 0
    assert count(ptx, r"wgmma\.mma_async\.sync\.aligned\.m64n256k16") == 4
    assemble_sm90a(ptx)


@pytest.mark.parametrize("bm,swiglu,push,async_ring,packed", [
    (192, True, False, False, False), (192, False, True, False, False),
    (192, False, False, False, False), (128, True, False, False, False),
    (192, True, False, True, False), (192, False, True, True, False),
    (192, True, False, False, True), (192, False, True, True, True),
    (256, True, False, False, False), (256, False, True, False, True),
    (128, False, True, False, False)])
def test_wgmma_mainloop_is_not_serialised(bm, swiglu, push, async_ring, packed):
    """ptxas must keep a slice's 4 wgmmas back to back with one group in flight. A wgmma in a
    path ptxas thinks divergent (``if active`` on a per-thread value) makes it serialise every
    wgmma of the kernel (warning C7518: a wait after each) -- the shipped 192-row kernel ran so
    for a session at about half its MMA rate. The padding skip now branches on a warp vote."""
    from numba import cuda

    from mok_core import grouped_gemm_wgmma_kernels as wk
    kern = wk.make_wgmma_grouped_gemm(128 if bm == 256 else 256, 4, swiglu, swiglu, True,
                                      tma_b=True, bm=bm, push=push, async_ring=async_ring,
                                      packed_b=packed)
    opts = {"launch_bounds": (2 * bm, 1)} if bm > 128 else {}
    # push with 2 peers: a 1-tuple hid the switch that ``peers[src]`` lowered to (C7518)
    ptx, _ = cuda.compile_ptx(kern.py_func, PUSH_SIG if push else WG_SIG, cc=(9, 0, "a"),
                              **opts)
    assert count(ptx, r"vote\.sync\.all\.pred") >= 1
    if async_ring:       # every thread's copies arrive on full[s]; no block barrier in the loop
        assert count(ptx, r"cp\.async\.mbarrier\.arrive\.noinc") >= 1
        assert count(ptx, r"bar\.sync|barrier\.sync") == 1      # the one after set-up
    tma_boxes = count(ptx, r"cp\.async\.bulk\.tensor\.2d")
    bulk_boxes = count(ptx, r"cp\.async\.bulk\.shared::cluster\.global\.mbarrier")
    assert (bulk_boxes >= 1 and tma_boxes == 0) if packed else (tma_boxes >= 1 and not bulk_boxes)
    report = assemble_sm90a(ptx)
    assert "C7518" not in report and "serialized" not in report, report[-600:]


@pytest.mark.parametrize("bm,swiglu,push", [(192, True, False), (128, False, True),
                                             (192, False, True)])
def test_smem_epilogue_lowers_unserialised(bm, swiglu, push):
    """The staged epilogue (shared memory + one bulk store per row; with ``push`` to the
    source ranks' combine rows): st.shared pairs, bulk stores, the read-wait before the next
    tile and the final wait; its warp barrier sits on a vote-uniform path, so no wgmma is
    serialised (C7518)."""
    from numba import cuda

    from mok_core import grouped_gemm_wgmma_kernels as wk
    kern = wk.make_wgmma_grouped_gemm(256, 4, swiglu, swiglu, True, tma_b=True, bm=bm,
                                      push=push, smem_epilogue=True)
    opts = {"launch_bounds": (2 * bm, 1)} if bm > 128 else {}
    ptx, _ = cuda.compile_ptx(kern.py_func, PUSH_SIG if push else WG_SIG, cc=(9, 0, "a"),
                              **opts)
    for p in (r"st\.shared\.u32", r"cp\.async\.bulk\.global\.shared::cta\.bulk_group",
              r"cp\.async\.bulk\.wait_group\.read 0", r"cp\.async\.bulk\.wait_group 0"):
        assert count(ptx, p) >= 1, p
    report = assemble_sm90a(ptx)
    assert "C7518" not in report and "serialized" not in report, report[-600:]


@pytest.mark.parametrize("probe", ["rows16", "stage_only", "stage_local", "loads_first",
                                   "exact_act"])
def test_staged_epilogue_probe_builds_lower_unserialised(probe):
    """The staged epilogue's measurement builds (``benchmarks/probe_gemm.py``): lanes 0..15
    sending a row each, staging with no bulk store at all, staging through the local-array
    copy, staging after the next tile's prologue loads, the exact SwiGLU -- still no wgmma
    serialised."""
    from numba import cuda

    from mok_core import grouped_gemm_wgmma_kernels as wk
    kern = wk.make_wgmma_grouped_gemm(256, 4, False, False, True, tma_b=True, bm=128,
                                      smem_epilogue=True, probe=probe)
    ptx, _ = cuda.compile_ptx(kern.py_func, WG_SIG, cc=(9, 0, "a"))
    stores = count(ptx, r"cp\.async\.bulk\.global\.shared::cta\.bulk_group")
    assert (stores == 0) == (probe == "stage_only")
    assert count(ptx, r"st\.shared\.u32") >= 1
    report = assemble_sm90a(ptx)
    assert "C7518" not in report and "serialized" not in report, report[-600:]


@pytest.mark.parametrize("swiglu", [True, False])
def test_wgmma_l2_prefetch_lowers_for_sm90a(swiglu):
    """``l2_prefetch``: the weight boxes some slices ahead go to L2 through the TMA unit (one
    prefetch per box, in the K loop and at a tile's start); the 192-row kernel still
    assembles."""
    from numba import cuda

    from mok_core import grouped_gemm_wgmma_kernels as wk
    kern = wk.make_wgmma_grouped_gemm(256, 4, swiglu, swiglu, True, tma_b=True, bm=192,
                                      l2_prefetch=4)
    ptx, _ = cuda.compile_ptx(kern.py_func, WG_SIG, cc=(9, 0, "a"), launch_bounds=(384, 1))
    boxes = 2 if swiglu else 1
    pf = count(ptx, r"cp\.async\.bulk\.prefetch\.tensor\.2d\.L2\.global\.tile")
    assert pf >= 2 * boxes and pf % boxes == 0
    assemble_sm90a(ptx)



@pytest.mark.parametrize("ws", [False, True], ids=["wgmma", "wgmma_ws"])
def test_down_push_lowers_for_sm90a(ws):
    """The combine fused into the down GEMM's epilogue: same MMAs, stores through the peer
    tuple, no local-memory traffic in the K loop; assembles."""
    from numba import cuda

    from mok_core import grouped_gemm_wgmma_kernels as wk
    from mok_core import grouped_gemm_wgmma_ws_kernels as wsk
    if ws:
        kern = wsk.make_wgmma_ws_grouped_gemm(256, 4, False, False, True, tma_b=True, push=True)
        opts = {"launch_bounds": (wsk.THREADS, 1)}
    else:
        kern = wk.make_wgmma_grouped_gemm(256, 4, False, False, True, tma_b=True, push=True)
        opts = {}
    ptx, _ = cuda.compile_ptx(kern.py_func, PUSH_SIG, cc=(9, 0, "a"), **opts)
    assert count(ptx, r"wgmma\.mma_async\.sync\.aligned\.m64n256k16") == 4
    loop = ptx[ptx.index("wgmma.fence"):ptx.index("wgmma.wait_group.sync.aligned 0;")]
    assert count(loop, r"ld\.local|st\.local") == 0
    assemble_sm90a(ptx)


@pytest.mark.parametrize("push", [False, True])
def test_wgmma_192_rows_lowers_for_sm90a(push):
    """3 warpgroups (384 threads, launch bounds): 4 wgmmas per slice, the accumulator and the
    loop state in registers in the K loop (ptxas: <= 168 registers), TMA for B; assembles."""
    from numba import cuda

    from mok_core import grouped_gemm_wgmma_kernels as wk
    kern = wk.make_wgmma_grouped_gemm(256, 4, not push, not push, True, tma_b=True, push=push,
                                      bm=192)
    ptx, _ = cuda.compile_ptx(kern.py_func, PUSH_SIG if push else WG_SIG, cc=(9, 0, "a"),
                              launch_bounds=(384, 1))
    assert ".maxntid 384, 1, 1" in ptx
    assert count(ptx, r"wgmma\.mma_async\.sync\.aligned\.m64n256k16") == 4
    loop = ptx[ptx.index("wgmma.fence"):ptx.index("wgmma.wait_group.sync.aligned 0;")]
    assert count(loop, r"ld\.local|st\.local") == 0
    assemble_sm90a(ptx)


@pytest.mark.parametrize("swiglu", [True, False])
def test_two_blocks_per_sm_bound_the_registers(swiglu):
    """``blocks_per_sm=2`` must reach ptxas as launch bounds: unbounded, the 128 x 128 down
    kernel takes 140 registers and a second 256-thread block never fits on the SM (the
    session-5 sweep timed such a config at one block per SM)."""
    from numba import cuda

    from mok_core import grouped_gemm_wgmma_kernels as wk
    kern = wk.make_wgmma_grouped_gemm(128, 3, swiglu, swiglu, True, tma_b=True, bm=128,
                                      blocks_per_sm=2)
    assert kern.targetoptions.get("launch_bounds") == (256, 2)
    require_ptxas()                         # the rest is ptxas's register count
    ptx, _ = cuda.compile_ptx(kern.py_func, WG_SIG, cc=(9, 0, "a"), launch_bounds=(256, 2))
    report = assemble_sm90a(ptx)
    regs = [int(m) for m in re.findall(r"Used (\d+) registers", report)]
    assert regs and max(regs) <= 128, report[-400:]


@pytest.mark.parametrize("bm,swiglu,packed,push", [
    (128, True, False, False), (128, False, False, True), (192, True, True, False),
    (192, False, True, False)])
def test_wgmma_multicast_lowers_for_sm90a(bm, swiglu, packed, push):
    """Clusters of 2 sharing each weight slice: each block's thread 0 issues one multicast
    share (TMA box or bulk copy) to both blocks once its own empty barrier shows the stage
    free everywhere (a blocking wait and a poll, acquire at cluster scope); every warp
    releases stages on every block's empty barrier through ``mapa`` (release, cluster
    scope); cluster barriers after set-up and before exit. The wgmmas stay 4 per slice
    and unserialised."""
    from numba import cuda

    from mok_core import grouped_gemm_wgmma_kernels as wk
    kern = wk.make_wgmma_grouped_gemm(256, 4, swiglu, swiglu, True, tma_b=True, bm=bm,
                                      push=push, packed_b=packed, multicast=2)
    opts = {"launch_bounds": (2 * bm, 1)} if bm > 128 else {}
    ptx, _ = cuda.compile_ptx(kern.py_func, PUSH_SIG if push else WG_SIG, cc=(9, 0, "a"),
                              **opts)
    share = (r"cp\.async\.bulk\.shared::cluster\.global\.mbarrier::complete_tx::bytes"
             r"\.multicast::cluster" if packed else
             r"cp\.async\.bulk\.tensor\.2d\.shared::cluster\.global\.tile\.mbarrier::"
             r"complete_tx::bytes\.multicast::cluster")
    assert count(ptx, share) >= 1
    assert count(ptx, r"cp\.async\.bulk\.tensor\.2d\.shared::cluster\.global\.tile\.mbarrier::"
                      r"complete_tx::bytes \[") == 0, "a plain (unicast) box left"
    assert count(ptx, r"mapa\.shared::cluster\.u32") >= 1
    assert count(ptx, r"mbarrier\.arrive\.release\.cluster\.shared::cluster\.b64") >= 1
    assert count(ptx, r"mbarrier\.try_wait\.parity\.acquire\.cluster") >= 1
    assert count(ptx, r"mbarrier\.test_wait\.parity\.acquire\.cluster") >= 1
    assert count(ptx, r"barrier\.cluster\.arrive") == 2
    assert count(ptx, r"%cluster_ctarank") >= 1
    assert count(ptx, r"wgmma\.mma_async\.sync\.aligned\.m64n256k16") == 4
    report = assemble_sm90a(ptx)
    assert "C7518" not in report and "serialized" not in report, report[-600:]
