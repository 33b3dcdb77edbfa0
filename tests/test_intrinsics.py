"""Each intrinsic alone: GPU version (compiled) or its Python twin (simulator), vs NumPy.

The same file runs on a GPU (``pytest tests/test_intrinsics.py`` without the simulator).
"""
import math
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
from numba import cuda, float32, int32, int64, uint16, uint64

from helpers import to_dev
from mok_core.bf16 import hi_bf16, lo_bf16
from mok_core.cuda_compat import SIM, kjit, to_host
from mok_core.gemm.epilogue import swiglu
from mok_core.intrinsics import ex2_approx, rcp_approx
from mok_core.intrinsics import (cp_async_16_at, cp_async_4_at, cp_async_commit,
                                 cp_async_mbarrier_arrive, cp_async_wait,
                                 ld_acquire_sys, ld_v4,
                                 ldmatrix_x4_at, ldmatrix_x4_trans_at, mma_bf16_16816,
                                 max_u16x2, pack_bf16x2,
                                 red_add_release_gpu, shared_addr,
                                 match_any, per_iteration, st_release_sys, st_v2_f32, st_v4,
                                 tuple_pick, warp_fsum, warp_read)
from mok_core.intrinsics import (add_shared_v2_f32, bulk_commit, bulk_store, bulk_wait,
                                 bulk_wait_read, st_shared_u32, st_shared_v2_f32, syncwarp,
                                 fence_mbarrier_init, mbarrier_arrive_expect_tx,
                                 tensormap_acquire, tma_load_2d,
                                 tma_store_2d)
from mok_core.intrinsics import (f32_zeros, fence_proxy_async, mbarrier_init,
                                 mbarrier_try_wait, tuple_groups, wgmma_commit,
                                 wgmma_fence, wgmma_m64n64k16_bf16, wgmma_m64n64k16_bf16_tb,
                                 wgmma_m64n128k16_bf16, wgmma_m64n128k16_bf16_tb, wgmma_wait,
                                 wgmma_m64n64k16_bf16_tatb, wgmma_m64n128k16_bf16_tatb,
                                 wgmma_m64n64k32_e4m3, wgmma_m64n128k32_e4m3,
                                 promote_fp8, ffma_rn)


def bf16_bits(a):
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def bits_to_f32(b):
    return (np.asarray(b, np.uint32) << 16).view(np.float32)


# ---- vector copy ---------------------------------------------------------------------------

@kjit
def _copy_rows_v4(src, dst, perm, width):
    """dst row i = src row perm[i], 16 bytes per thread-step."""
    i = cuda.blockIdx.x
    for c in range(cuda.threadIdx.x * 8, width, cuda.blockDim.x * 8):
        a, b, d, e = ld_v4(src, perm[i] * width + c)
        st_v4(dst, i * width + c, a, b, d, e)


def test_ld_st_v4_copy():
    rng = np.random.default_rng(0)
    rows, width = 6, 64
    src = rng.integers(0, 2**16, size=rows * width, dtype=np.uint16)
    perm = rng.permutation(rows).astype(np.int32)
    dst = to_dev(np.zeros(rows * width, np.uint16))
    _copy_rows_v4[rows, 4](to_dev(src), dst, to_dev(perm), width)
    np.testing.assert_array_equal(to_host(dst).reshape(rows, width),
                                  src.reshape(rows, width)[perm])


@kjit
def _swap_pairs_v2(src, dst):
    """dst pair i = (src[2i + 1], src[2i]) by one 8-byte store."""
    i = cuda.grid(1)
    if 2 * i + 1 < src.size:
        st_v2_f32(dst, 2 * i, src[2 * i + 1], src[2 * i])


def test_st_v2_f32_pairs():
    src = np.random.default_rng(3).standard_normal(64).astype(np.float32)
    dst = to_dev(np.zeros(64, np.float32))
    _swap_pairs_v2[1, 32](to_dev(src), dst)
    np.testing.assert_array_equal(to_host(dst), src.reshape(32, 2)[:, ::-1].ravel())


# ---- bf16 conversions ------------------------------------------------------------------------

@kjit
def _convert(x, packed, back):
    i = cuda.grid(1)
    if i % 2 == 0 and i + 1 < x.size:
        w = pack_bf16x2(x[i], x[i + 1])
        packed[i // 2] = w
        back[i] = lo_bf16(w)
        back[i + 1] = hi_bf16(w)


def test_bf16_rounding_matches_ml_dtypes():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(64) * 10 ** rng.uniform(-5, 5, 64)).astype(np.float32)
    x[:4] = [1.00390625, 1.01171875, -2.0, 0.0]       # exact ties: round to even
    packed = to_dev(np.zeros(32, np.uint32))
    back = to_dev(np.zeros(64, np.float32))
    _convert[2, 32](to_dev(x), packed, back)
    want = bf16_bits(x)
    np.testing.assert_array_equal(to_host(packed), want[0::2].astype(np.uint32)
                                  | (want[1::2].astype(np.uint32) << 16))
    np.testing.assert_array_equal(to_host(back), bits_to_f32(want))


@kjit
def _max_halves(a, b, out):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = max_u16x2(a[i], b[i])


def test_simulator_twins_scalar_paths_equal_their_references():
    """The simulator twins' scalar shortcuts (CPU only, no kernel): ``pack_e4m3x4``'s byte is
    ``quantize_reference.e4m3_bits`` on every bf16-grid float32, random float32 bits, the
    e4m3 grid's midpoints (ties to even) and the edges; ``ffma_rn``'s fast path is the exact
    float64 sum rounded once, ties included."""
    from mok_core.intrinsics.twins import _e4m3_byte, ffma_rn
    from mok_core.quantize_reference import e4m3_bits, e4m3_values
    rng = np.random.default_rng(0)
    grid = e4m3_values(np.arange(256, dtype=np.uint8))
    grid = np.sort(np.unique(grid[np.isfinite(grid)]))
    v = np.concatenate([
        (np.arange(1 << 16, dtype=np.uint32) << 16).view(np.float32),
        rng.integers(0, 1 << 32, 1 << 16, dtype=np.uint64).astype(np.uint32).view(np.float32),
        ((grid[1:] + grid[:-1]) / 2).astype(np.float32),
        np.array([448, 464, 465, -464, 2.0 ** -10, -2.0 ** -10, 2.0 ** -9 * 1.5, np.inf,
                  -np.inf, -0.0, 0.0], np.float32)])
    with np.errstate(invalid="ignore"):             # (signalling NaN payloads)
        want = e4m3_bits(v)
    got = np.array([_e4m3_byte(x) for x in v], np.uint8)
    bad = np.nonzero(got != want)[0]
    assert bad.size == 0, (v[bad[:5]], got[bad[:5]], want[bad[:5]])
    a, b, c = (rng.standard_normal(4096).astype(np.float32) for _ in range(3))
    c[:1024] = -(a[:1024].astype(np.float64) * b[:1024]).astype(np.float32)   # cancellation
    for x, y, z in zip(a, b, c):
        exact = Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z))
        lo = np.float32(float(exact))                 # within an ulp; the nearest by exact
        cands = [lo, np.nextafter(lo, np.float32(-np.inf)), np.nextafter(lo, np.float32(np.inf))]
        best = min(cands, key=lambda r: (abs(Fraction(float(r)) - exact),
                                         int(np.array(r).view(np.uint32)) & 1))
        assert ffma_rn(x, y, z) == best or (best == 0 and ffma_rn(x, y, z) == 0)


def test_max_u16x2_is_the_larger_of_each_half():
    rng = np.random.default_rng(2)
    a = rng.integers(0, 2 ** 32, 64, dtype=np.uint64).astype(np.uint32)
    b = rng.integers(0, 2 ** 32, 64, dtype=np.uint64).astype(np.uint32)
    a[:4] = [0xFFFF0000, 0x0000FFFF, 0x7F807FC0, 0x80000001]   # halves compare unsigned
    b[:4] = [0x0001FFFF, 0xFFFF0001, 0x7FC07F80, 0x7FFFFFFF]
    out = to_dev(np.zeros(64, np.uint32))
    _max_halves[2, 32](to_dev(a), to_dev(b), out)
    want = np.maximum(a & 0xFFFF, b & 0xFFFF) | (np.maximum(a >> 16, b >> 16) << 16)
    np.testing.assert_array_equal(to_host(out), want.astype(np.uint32))


@kjit
def _sfu(x, out):
    i = cuda.grid(1)
    if i < x.size:
        out[i] = ex2_approx(x[i])
        out[x.size + i] = rcp_approx(x[i])
        out[2 * x.size + i] = swiglu(x[i], float32(0.75), float32(np.inf))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")      # the twins on +-inf (as on the GPU)
def test_sfu_approximations_and_the_swiglu_built_on_them():
    """ex2 / rcp within a few float32 ulp (exact specials: 2^-inf = 0, 1/inf = 0, 1/0 = inf),
    and the SwiGLU from them within float32 rounding of float64 (large |g|: 0 and g*u)."""
    x = np.array([-200, -88.5, -20, -3.3, -1, -0.25, 0, 0.5, 1, 2.75, 17, 100, np.inf, -np.inf],
                 np.float32)
    out = to_dev(np.zeros(3 * x.size, np.float32))
    _sfu[1, 32](to_dev(x), out)
    ex2, rcp, act = to_host(out).reshape(3, x.size).astype(np.float64)
    xd = x.astype(np.float64)
    with np.errstate(over="ignore", divide="ignore"):
        np.testing.assert_allclose(ex2, np.exp2(xd), rtol=2e-6, atol=1e-37)
        np.testing.assert_allclose(rcp[x != 0], 1 / xd[x != 0], rtol=2e-7)
        fin = np.isfinite(xd)
        want = xd[fin] / (1 + np.exp(-xd[fin])) * 0.75
    assert rcp[x == 0][0] == np.inf
    np.testing.assert_allclose(act[fin], want, rtol=2e-6, atol=1e-30)


# ---- flags -----------------------------------------------------------------------------------

@kjit
def _flags(flags, out):
    i = cuda.threadIdx.x
    red_add_release_gpu(flags, 0, 1)
    cuda.syncthreads()
    if i == 0:
        out[0] = ld_acquire_sys(flags, 0)
        st_release_sys(flags, 1, 41 + out[0])


def test_acquire_release_and_counter():
    flags = to_dev(np.zeros(2, np.int32))
    out = to_dev(np.zeros(1, np.int32))
    _flags[1, 64](flags, out)
    np.testing.assert_array_equal(to_host(flags), [64, 105])
    assert to_host(out)[0] == 64


@kjit
def _pick_write(a, b, c, which):
    """Thread i writes i + 1 into slot i of array ``(a, b, c)[which[i]]`` (picked by selects)."""
    i = cuda.threadIdx.x
    dst = tuple_pick((a, b, c), which[i])
    dst[i] = i + 1


def test_tuple_pick_selects_by_runtime_index():
    which = np.array([0, 1, 2, 2, 1, 0, 2, 1], np.int32)
    arrs = [to_dev(np.zeros(8, np.int32)) for _ in range(3)]
    _pick_write[1, 8](*arrs, to_dev(which))
    got = np.stack([to_host(x) for x in arrs])
    want = np.zeros((3, 8), np.int32)
    want[which, np.arange(8)] = np.arange(1, 9)
    np.testing.assert_array_equal(got, want)
    if SIM:                                 # out of range: a caller's bug, raised here
        with pytest.raises(IndexError, match="index 3 outside a 3-tuple"):
            _pick_write[1, 8](*arrs, to_dev(np.full(8, 3, np.int32)))


@kjit
def _per_iteration_rows(out32, out64, n):
    """Row i of thread t: t * 1000 + i from a 32-bit base, and the same plus 2^40 from a
    64-bit one, each made per iteration (``per_iteration``) -- the value must pass unchanged."""
    t = cuda.threadIdx.x
    for i in range(n):
        out32[t * n + i] = per_iteration(int32(t * 1000)) + i
        out64[t * n + i] = per_iteration(int64(t * 1000) + (int64(1) << 40)) + i


def test_per_iteration_passes_the_value():
    n = 5
    out32, out64 = to_dev(np.zeros(4 * n, np.int32)), to_dev(np.zeros(4 * n, np.int64))
    _per_iteration_rows[1, 4](out32, out64, n)
    want = (np.arange(4)[:, None] * 1000 + np.arange(n)).ravel()
    np.testing.assert_array_equal(to_host(out32), want)
    np.testing.assert_array_equal(to_host(out64), want + (1 << 40))


@kjit
def _match_masks(keys, masks):
    """Two warps: each lane's mask of the lanes of its warp holding its key."""
    i = cuda.threadIdx.x
    masks[i] = match_any(keys[i])


@kjit
def _warp_reads(values, lanes, out):
    """Two warps: each lane reads its warp's lane ``lanes[i]``'s value."""
    i = cuda.threadIdx.x
    out[i] = warp_read(values[i], lanes[i])


def test_warp_read_gives_the_asked_lanes_value_per_warp():
    rng = np.random.default_rng(4)
    values = rng.integers(-2 ** 31, 2 ** 31, 64, dtype=np.int64).astype(np.int32)
    lanes = rng.integers(0, 32, 64).astype(np.int32)
    lanes[:32] = np.arange(32)[::-1]                 # every lane asked once, in reverse
    out = to_dev(np.zeros(64, np.int32))
    _warp_reads[1, 64](to_dev(values), to_dev(lanes), out)
    want = values[(np.arange(64) // 32) * 32 + lanes]
    np.testing.assert_array_equal(to_host(out), want)


def test_match_any_masks_equal_keys_per_warp():
    rng = np.random.default_rng(3)
    keys = rng.integers(-1, 6, 64).astype(np.int32)
    keys[40:] = 7                                   # a run of one key (several whole bytes)
    masks = to_dev(np.zeros(64, np.uint32))
    _match_masks[1, 64](to_dev(keys), masks)
    want = np.array([sum(1 << j for j in range(32) if keys[w * 32 + j] == keys[i])
                     for i in range(64) for w in [i // 32]], np.uint32)
    np.testing.assert_array_equal(to_host(masks), want)


@kjit
def _warp_fsums(x, out):
    """Two warps: each lane's warp_fsum of its warp's values."""
    i = cuda.threadIdx.x
    out[i] = warp_fsum(x[i])


def test_warp_fsum_is_the_fixed_butterfly():
    """Every lane gets the butterfly's bits (distance 16, 8, 4, 2, 1, each add rounded to
    float32) -- values over 40 binades, so another order would round differently."""
    rng = np.random.default_rng(4)
    x = (rng.standard_normal(64) * np.exp2(rng.integers(-20, 20, 64))).astype(np.float32)
    out = to_dev(np.zeros(64, np.float32))
    _warp_fsums[1, 64](to_dev(x), out)
    v = x.reshape(2, 32)
    for d in (16, 8, 4, 2, 1):
        v = (v + v[:, np.arange(32) ^ d]).astype(np.float32)
    assert (v == v[:, :1]).all()                              # every lane the same bits
    np.testing.assert_array_equal(to_host(out).view(np.uint32), v.ravel().view(np.uint32))
    seq = x.reshape(2, 32).astype(np.float32).cumsum(1, dtype=np.float32)[:, -1]
    assert (seq != v[:, 0]).any()                 # the order shows in the bits


# ---- tensor cores: one warp, m16n8k16 through ldmatrix ----------------------------------------

@kjit(device=True)
def _mma_into(a0, a1, a2, a3, b0, b1, c, d, lane):
    """d[16x8] = A . B + c[16x8] from this lane's fragments (layout: ``mma_bf16_16816``)."""
    g = lane // 4
    t = lane % 4
    d0, d1, d2, d3 = mma_bf16_16816(a0, a1, a2, a3, b0, b1, c[g * 8 + 2 * t],
                                    c[g * 8 + 2 * t + 1], c[(g + 8) * 8 + 2 * t],
                                    c[(g + 8) * 8 + 2 * t + 1])
    d[g * 8 + 2 * t] = d0
    d[g * 8 + 2 * t + 1] = d1
    d[(g + 8) * 8 + 2 * t] = d2
    d[(g + 8) * 8 + 2 * t + 1] = d3


def _check_mma_tile(kernel, seed):
    """Run a one-warp m16n8k16 test kernel on random operands; compare with float64."""
    rng = np.random.default_rng(seed)
    A = bf16_bits(rng.standard_normal((16, 16)))
    B = bf16_bits(rng.standard_normal((8, 16)))          # [n, k]
    C = rng.standard_normal((16, 8)).astype(np.float32)
    D = to_dev(np.full(128, np.nan, np.float32))
    kernel[1, 32](to_dev(A.ravel()), to_dev(B.ravel()), to_dev(C.ravel()), D)
    want = bits_to_f32(A).astype(np.float64) @ bits_to_f32(B).astype(np.float64).T + C
    np.testing.assert_allclose(to_host(D).reshape(16, 8), want, rtol=1e-5, atol=1e-5)


@kjit
def _mma_tile_at(a, b, c, d):
    """One warp: D[16x8] = A[16x16] @ B[8x16]^T + C, the operands staged by cp_async_16_at
    and read by ldmatrix_x4_at."""
    sa = cuda.shared.array(256, uint16)
    sb = cuda.shared.array(128, uint16)
    lane = cuda.threadIdx.x
    base_a = shared_addr(sa)
    base_b = shared_addr(sb)
    if lane < 32:
        cp_async_16_at(sa, base_a + lane * 16, a, lane * 8, 16)     # 32 x 16 bytes = A
    if lane < 16:
        cp_async_16_at(sb, base_b + lane * 16, b, lane * 8, 16)     # 16 x 16 bytes = B
    cp_async_commit()
    cp_async_wait(0)
    cuda.syncthreads()
    row = lane % 16
    col = (lane // 16) * 8
    a0, a1, a2, a3 = ldmatrix_x4_at(sa, base_a + (row * 16 + col) * 2)
    # B^T [n, k] as (n 0-7, k 0-7), (n 0-7, k 8-15) -- x4 with the second pair repeated
    n = lane % 8
    kh = (lane // 8) % 2
    b0, b1, b2, b3 = ldmatrix_x4_at(sb, base_b + (n * 16 + kh * 8) * 2)
    _mma_into(a0, a1, a2, a3, b0, b1, c, d, lane)


def test_shared_address_variants():
    _check_mma_tile(_mma_tile_at, 8)


@kjit
def _mma_tile_trans(a, b, c, d):
    """As ``_mma_tile_at`` with both operands stored the other way round in shared memory --
    A^T [k, m] and B^T [k, n] (as the backward's GEMMs hold them) -- and read by
    ldmatrix_x4_trans_at."""
    sa = cuda.shared.array(256, uint16)
    sb = cuda.shared.array(128, uint16)
    lane = cuda.threadIdx.x
    # transpose while staging: sa[k * 16 + m] = A[m, k], sb[k * 8 + n] = B[n, k]
    for i in range(lane, 256, 32):
        sa[(i % 16) * 16 + i // 16] = a[i]
    for i in range(lane, 128, 32):
        sb[(i % 16) * 8 + i // 16] = b[i]
    cuda.syncthreads()
    base_a = shared_addr(sa)
    base_b = shared_addr(sb)
    j = lane // 8                    # matrix j: m half j % 2, k half j // 2
    a0, a1, a2, a3 = ldmatrix_x4_trans_at(sa, base_a + (((j // 2) * 8 + lane % 8) * 16
                                                        + (j % 2) * 8) * 2)
    b0, b1, b2, b3 = ldmatrix_x4_trans_at(sb, base_b + ((((lane // 8) % 2) * 8 + lane % 8)
                                                        * 8) * 2)
    _mma_into(a0, a1, a2, a3, b0, b1, c, d, lane)


def test_ldmatrix_trans():
    _check_mma_tile(_mma_tile_trans, 9)


# ---- cp.async with zero fill -------------------------------------------------------------------

@kjit
def _cp_async_rows(src, rows, out, width):
    """Stage rows[i] of src (or zeros for -1) into shared memory, then write them out."""
    sm = cuda.shared.array(512, uint16)
    tid = cuda.threadIdx.x
    n = rows.size
    for chunk in range(tid, n * width // 8, cuda.blockDim.x):
        i = chunk // (width // 8)
        c = (chunk % (width // 8)) * 8
        r = rows[i]
        nbytes = 16
        if r < 0:
            nbytes = 0
            r = 0
        cp_async_16_at(sm, shared_addr(sm) + (i * width + c) * 2, src, r * width + c, nbytes)
    cp_async_commit()
    cp_async_wait(0)
    cuda.syncthreads()
    for j in range(tid, n * width, cuda.blockDim.x):
        out[j] = sm[j]


def test_cp_async_gather_zero_fill():
    rng = np.random.default_rng(3)
    width = 32
    src = rng.integers(1, 2**16, size=(8, width), dtype=np.uint16)
    rows = np.array([5, -1, 0, 7, -1, 2], np.int32)
    out = to_dev(np.full(rows.size * width, 0xFFFF, np.uint16))
    _cp_async_rows[1, 32](to_dev(src.ravel()), to_dev(rows), out, width)
    want = np.where(rows[:, None] >= 0, src[np.maximum(rows, 0)], 0)
    np.testing.assert_array_equal(to_host(out).reshape(-1, width), want)


@kjit
def _cp_async_no_wait(src, out):
    sm = cuda.shared.array(8, uint16)
    if cuda.threadIdx.x == 0:
        sm[0] = 7
        cp_async_16_at(sm, shared_addr(sm), src, 0, 16)
        cp_async_commit()
        out[0] = sm[0]          # read before the wait: the copy must not have landed
        cp_async_wait(0)
        out[1] = sm[0]


def test_cp_async_twin_is_asynchronous():
    if not SIM:
        pytest.skip("ordering model of the simulator twin")
    out = np.zeros(2, np.uint16)
    _cp_async_no_wait[1, 32](np.full(8, 9, np.uint16), out)
    assert list(out) == [7, 9]


# ---- wgmma from swizzled shared memory -----------------------------------------------------------

_WGMMA_N = {64: wgmma_m64n64k16_bf16, 128: wgmma_m64n128k16_bf16}
_WGMMA_E4M3_N = {64: wgmma_m64n64k32_e4m3, 128: wgmma_m64n128k32_e4m3}


def _make_wgmma_slice(n, e4m3=False):
    """One warpgroup: A [64, 64] and B [n, 64] (bf16, K-major) staged with plain stores in the
    128-byte-swizzled layout, then one K slice = 4 wgmma k16 steps through descriptors whose
    start address advances 32 bytes per step -- exactly what the GEMM kernels do. ``e4m3``:
    the same bytes as e4m3 [64, 128] and [n, 128] (two per uint16), 4 k32 steps."""
    from mok_core.gemm.sm90 import _DESC_HIGH
    mma = (_WGMMA_E4M3_N if e4m3 else _WGMMA_N)[n]
    elems = (64 + n) * 64 + 512                  # tiles + 1 KiB to align them
    nacc = n // 2

    @kjit
    def kernel(a, b, d):
        sm = cuda.shared.array(elems, uint16)
        t = cuda.threadIdx.x
        base = shared_addr(sm)
        pad = (1024 - base % 1024) % 1024
        for idx in range(t, (64 + n) * 8, 128):
            r = idx // 8
            ch = idx % 8
            dst = pad // 2 + r * 64 + (ch ^ (r % 8)) * 8
            for e in range(8):
                if r < 64:
                    sm[dst + e] = a[r * 64 + ch * 8 + e]
                else:
                    sm[dst + e] = b[(r - 64) * 64 + ch * 8 + e]
        fence_proxy_async()
        cuda.syncthreads()
        da = int64(_DESC_HIGH) + int64((base + pad) >> 4)
        db = int64(_DESC_HIGH) + int64((base + pad + 64 * 128) >> 4)
        acc = wgmma_fence(f32_zeros(nacc))
        acc = mma(acc, sm, da, db)
        acc = mma(acc, sm, da + 2, db + 2)
        acc = mma(acc, sm, da + 4, db + 4)
        acc = mma(acc, sm, da + 6, db + 6)
        wgmma_commit()
        acc = wgmma_wait(acc, 0)
        _store_acc(acc, (d, 16 * (t // 32) + (t % 32) // 4, 2 * (t % 4), int64(n)))
    return kernel


def _store_frag(j, d, row, col, n, x0, x1, x2, x3):
    """Group j of a wgmma fragment: rows row and row + 8, columns 8j + col (+1)."""
    d[row * n + 8 * j + col] = x0
    d[row * n + 8 * j + col + 1] = x1
    d[(row + 8) * n + 8 * j + col] = x2
    d[(row + 8) * n + 8 * j + col + 1] = x3


_store_acc = tuple_groups(_store_frag, lambda count: [[4 * j + i for i in range(4)]
                                                      for j in range(count // 4)])


@pytest.mark.parametrize("n", [64, 128])
def test_wgmma_descriptors_swizzle_and_fragments(n):
    from mok_core.cuda_compat import SIM
    if not SIM and cuda.get_current_device().compute_capability < (9, 0):
        pytest.skip("wgmma needs sm_90")
    rng = np.random.default_rng(n)
    A = bf16_bits(rng.standard_normal((64, 64)))
    B = bf16_bits(rng.standard_normal((n, 64)))
    D = to_dev(np.full(64 * n, np.nan, np.float32))
    _make_wgmma_slice(n)[1, 128](to_dev(A.ravel()), to_dev(B.ravel()), D)
    want = bits_to_f32(A).astype(np.float64) @ bits_to_f32(B).astype(np.float64).T
    np.testing.assert_allclose(to_host(D).reshape(64, n), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("n", [64, 128])
def test_wgmma_e4m3_descriptors_swizzle_and_fragments(n):
    """The FP8 wgmma: e4m3 A [64, 128] . B [n, 128]^T (K-major, swizzled) vs float64 of the
    e4m3 values. The tensor cores' FP8 running sum keeps fewer bits than FP32 (on an H200 it
    misses float64 in the low bits -- the reason for the promotion every 128 of K): within
    2**-11 of sum |a b| per element; a misplaced operand element is off by ~|a b| itself."""
    from mok_core.cuda_compat import SIM
    from mok_core.quantize_reference import e4m3_bits, e4m3_values
    if not SIM and cuda.get_current_device().compute_capability < (9, 0):
        pytest.skip("wgmma needs sm_90")
    rng = np.random.default_rng(n + 1)
    A = e4m3_bits(rng.standard_normal((64, 128)) * 4)
    B = e4m3_bits(rng.standard_normal((n, 128)))
    D = to_dev(np.full(64 * n, np.nan, np.float32))
    _make_wgmma_slice(n, e4m3=True)[1, 128](to_dev(A.view(np.uint16).ravel()),
                                            to_dev(B.view(np.uint16).ravel()), D)
    want = e4m3_values(A) @ e4m3_values(B).T
    bound = 2.0 ** -11 * (np.abs(e4m3_values(A)) @ np.abs(e4m3_values(B)).T)
    assert (np.abs(to_host(D).reshape(64, n) - want) <= bound).all()


def _make_promote32():
    """One thread per case: ``promote_fp8`` of a 32-element fragment (acc, part: rows of [.., 32]
    float32) with that case's four factors (s: [.., 4]) into out [.., 32]."""
    src = "\n".join([
        "def kernel(acc_in, part_in, s, out):",
        "    t = cuda.threadIdx.x",
        "    acc = (" + ", ".join(f"acc_in[t, {i}]" for i in range(32)) + ")",
        "    part = (" + ", ".join(f"part_in[t, {i}]" for i in range(32)) + ")",
        "    r = promote_fp8(acc, part, s[t, 0], s[t, 1], s[t, 2], s[t, 3])",
        *[f"    out[t, {i}] = r[{i}]" for i in range(32)]])
    scope = {"cuda": cuda, "promote_fp8": promote_fp8}
    exec(src, scope)
    return kjit(scope["kernel"])


def _f32_round(q):
    """The float32 nearest the Fraction q, ties to even (infinite from FLT_MAX + half an ulp
    on, as IEEE rounds): exact, unlike float(q) then float32."""
    if abs(q) >= Fraction(2) ** 128 - Fraction(2) ** 103:
        return np.float32(np.inf if q > 0 else -np.inf)
    with np.errstate(over="ignore"):
        r = np.float32(float(q))
    if np.isinf(r):                          # float(q) rounded onto the edge: FLT_MAX's side
        r = np.finfo(np.float32).max * np.float32(1 if q > 0 else -1)
    with np.errstate(over="ignore"):
        cands = [c for c in (r, np.nextafter(r, np.float32(np.inf)),
                             np.nextafter(r, np.float32(-np.inf))) if np.isfinite(c)]
    dist = [abs(Fraction(float(c)) - q) for c in cands]
    best = min(dist)
    near = [c for c, d in zip(cands, dist) if d == best]
    return min(near, key=lambda c: int(np.float32(c).view(np.uint32)) & 1)


@kjit
def _ffma(a, b, c, out):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = ffma_rn(a[i], b[i], c[i])


def test_ffma_rn_rounds_once():
    """``ffma_rn``: a b + c rounded once (exact arithmetic as the judge) -- on random values,
    on cancellations, where the float64 sum lands on a float32 midpoint (double rounding: a b
    = 2**-24 (1 +- 2**-36) exactly, as 2**36 + 1 = 4097 * 16773121 and 2**36 - 1 = 262143 *
    262145, a hair off the midpoint), and past the largest float32 (inf), also a hair inside
    FLT_MAX + half an ulp (FLT_MAX)."""
    rng = np.random.default_rng(5)
    n = 400
    a = (rng.standard_normal(n) * 2.0 ** rng.integers(-20, 20, n)).astype(np.float32)
    b = (rng.standard_normal(n) * 2.0 ** rng.integers(-20, 20, n)).astype(np.float32)
    c = (-(a.astype(np.float64) * b) * (1 + rng.standard_normal(n) * 2.0 ** -rng.integers(
        1, 30, n))).astype(np.float32)                       # cancellation: remainders
    edge = 18631 * 2.0 ** 103               # x 1801 = 2**128 - 2**103 = FLT_MAX + half an ulp
    crafted = [(1 + 2.0 ** -12, 16773121 * 2.0 ** -48, 1),
               (-1 - 2.0 ** -12, 16773121 * 2.0 ** -48, -1),
               (1 - 2.0 ** -18, 262145 * 2.0 ** -42, 1 + 2.0 ** -23),
               (1e20, 1e20, -1), (-1e20, 1e20, 1),          # past FLT_MAX: +-inf
               (2.0 ** 64, 2.0 ** 64 - 2.0 ** 40, -2.0 ** 20),   # FLT_MAX - 2**20
               (edge, 1801, -1), (-edge, 1801, 1),          # a hair inside the edge: FLT_MAX
               (edge, 1801, 0), (edge, 1801, 1)]            # on it (ties to even) / past: inf
    a = np.append(a, np.float32([x for x, _, _ in crafted]))
    b = np.append(b, np.float32([y for _, y, _ in crafted]))
    c = np.append(c, np.float32([z for _, _, z in crafted]))
    out = to_dev(np.zeros(a.size, np.float32))
    _ffma[(a.size + 127) // 128, 128](to_dev(a), to_dev(b), to_dev(c), out)
    got = to_host(out)
    for i, (x, y, z) in enumerate(zip(a, b, c)):
        want = _f32_round(Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z)))
        assert got[i].view(np.uint32) == want.view(np.uint32), (x, y, z, got[i], want)
    top = np.finfo(np.float32).max
    assert list(got[n + 3:]) == [np.inf, -np.inf, top, top, -top,
                                 np.inf, np.inf]


def test_promote_fp8_rounds_once_like_fma():
    """``promote_fp8``: acc + part x s rounded once (``fma.rn.f32``) with the fragment's factor
    per element -- s_lo for its upper row (elements 4j, 4j + 1), s_hi for the row below (4j +
    2, 4j + 3), s_lo2 / s_hi2 in the second half -- bit for bit against the exact value
    rounded to float32, on random values and on sums whose float64 lands exactly halfway
    between two float32 (where rounding the product, or the float64 sum, first goes wrong)."""
    rng = np.random.default_rng(7)
    cases = 8
    acc = (rng.standard_normal((cases, 32)) * 2.0 ** rng.integers(-30, 30, (cases, 32)))
    part = rng.standard_normal((cases, 32)) * 2.0 ** rng.integers(-30, 30, (cases, 32))
    s = rng.standard_normal((cases, 4)) * 2.0 ** rng.integers(-20, 20, (cases, 4))
    acc, part, s = (np.asarray(v, np.float32) for v in (acc, part, s))
    # halfway cases: part x s = 2**-24 - 2**-70 onto acc = 1 + 2**-23 (exact sum just below
    # the float32 midpoint 1 + 3 * 2**-24; float64 and mul-then-add both round it up)
    a1, b1 = np.float32(1 + 2.0 ** -23), np.float32(2.0 ** -24 * (1 - 2.0 ** -23))
    acc[0, :4], part[0, :4], s[0, 0] = a1, a1, b1
    acc[1, 2:4], part[1, 2:4], s[1, 1] = -a1, -a1, b1
    out = to_dev(np.zeros((cases, 32), np.float32))
    _make_promote32()[1, cases](to_dev(acc), to_dev(part), to_dev(s), out)
    got = to_host(out)
    for t in range(cases):
        for i in range(32):
            f = s[t, 2 * (i >= 16) + (i // 2) % 2]
            q = Fraction(float(part[t, i])) * Fraction(float(f)) + Fraction(float(acc[t, i]))
            assert got[t, i].view(np.uint32) == _f32_round(q).view(np.uint32), (t, i)
    assert got[0, 0] == a1 and got[1, 2] == -a1                  # the halfway cases: once


_WGMMA_TB_N = {64: wgmma_m64n64k16_bf16_tb, 128: wgmma_m64n128k16_bf16_tb}


_WGMMA_TATB_N = {64: wgmma_m64n64k16_bf16_tatb, 128: wgmma_m64n128k16_bf16_tatb}


def _make_wgmma_slice_mn(n, a_mn):
    """One warpgroup, B MN-major (the dgrad kernel's layout): B [64 rows of k, n columns]
    row-major, staged as n/64 blocks of [64 k][64 n] (8 KiB apart), row k of a block 128 bytes
    with 16-byte chunk c at c ^ (k % 8) -- what a TMA box with the 128-byte swizzle writes;
    descriptor ``sm90._DESC_HIGH_MN`` (leading byte offset 8 KiB, stride 1024 B), a k16 step
    +2048 bytes. A [64, 64] is K-major as above (the ``_tb`` wgmma, imm-trans-b = 1) or, with
    ``a_mn``, A^T [64 rows of k, 64 columns of m] staged like B (the wgrad kernel's layout,
    ``sm90_wgrad``: the ``_tatb`` wgmma, imm-trans-a = imm-trans-b = 1). Both A layouts stage
    the same way: 64 rows of 8 swizzled chunks."""
    from mok_core.gemm.sm90 import _DESC_HIGH, _DESC_HIGH_MN, _K16, _K16_MN
    mma = (_WGMMA_TATB_N if a_mn else _WGMMA_TB_N)[n]
    desc_a = _DESC_HIGH_MN if a_mn else _DESC_HIGH
    ka = _K16_MN if a_mn else _K16
    elems = (64 + n) * 64 + 512                  # tiles + 1 KiB to align them
    nacc = n // 2

    @kjit
    def kernel(a, b, d):
        sm = cuda.shared.array(elems, uint16)
        t = cuda.threadIdx.x
        base = shared_addr(sm)
        pad = (1024 - base % 1024) % 1024
        for idx in range(t, 64 * 8, 128):        # A: 64 rows x 8 chunks
            r = idx // 8
            ch = idx % 8
            dst = pad // 2 + r * 64 + (ch ^ (r % 8)) * 8
            for e in range(8):
                sm[dst + e] = a[r * 64 + ch * 8 + e]
        for idx in range(t, 64 * (n // 8), 128):  # B: 64 rows of k x n/8 chunks of n
            k = idx // (n // 8)
            c = idx % (n // 8)
            blk = c // 8
            dst = pad // 2 + 64 * 64 + blk * 64 * 64 + k * 64 + ((c % 8) ^ (k % 8)) * 8
            for e in range(8):
                sm[dst + e] = b[k * n + c * 8 + e]
        fence_proxy_async()
        cuda.syncthreads()
        da = int64(desc_a) + int64((base + pad) >> 4)
        db = int64(_DESC_HIGH_MN) + int64((base + pad + 64 * 128) >> 4)
        acc = wgmma_fence(f32_zeros(nacc))
        acc = mma(acc, sm, da, db)
        acc = mma(acc, sm, da + ka, db + _K16_MN)
        acc = mma(acc, sm, da + 2 * ka, db + 2 * _K16_MN)
        acc = mma(acc, sm, da + 3 * ka, db + 3 * _K16_MN)
        wgmma_commit()
        acc = wgmma_wait(acc, 0)
        _store_acc(acc, (d, 16 * (t // 32) + (t % 32) // 4, 2 * (t % 4), int64(n)))
    return kernel


@pytest.mark.parametrize("n", [64, 128])
def test_wgmma_b_mn_major_descriptor_swizzle_and_fragments(n):
    """D = A B with B [K, N] as stored (N contiguous): n = 128 spans two 64-column blocks, so
    the leading byte offset is exercised, not only the stride and the k16 step."""
    from mok_core.cuda_compat import SIM
    if not SIM and cuda.get_current_device().compute_capability < (9, 0):
        pytest.skip("wgmma needs sm_90")
    rng = np.random.default_rng(n + 1)
    A = bf16_bits(rng.standard_normal((64, 64)))
    B = bf16_bits(rng.standard_normal((64, n)))
    D = to_dev(np.full(64 * n, np.nan, np.float32))
    _make_wgmma_slice_mn(n, False)[1, 128](to_dev(A.ravel()), to_dev(B.ravel()), D)
    want = bits_to_f32(A).astype(np.float64) @ bits_to_f32(B).astype(np.float64)
    np.testing.assert_allclose(to_host(D).reshape(64, n), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("n", [64, 128])
def test_wgmma_a_and_b_mn_major_descriptor_swizzle_and_fragments(n):
    """D = A^T B with A^T [K, M] and B [K, N] as stored (rows of k, m / n contiguous): the
    weight gradient's product; n = 128 spans two 64-column blocks of B."""
    from mok_core.cuda_compat import SIM
    if not SIM and cuda.get_current_device().compute_capability < (9, 0):
        pytest.skip("wgmma needs sm_90")
    rng = np.random.default_rng(n + 2)
    At = bf16_bits(rng.standard_normal((64, 64)))
    B = bf16_bits(rng.standard_normal((64, n)))
    D = to_dev(np.full(64 * n, np.nan, np.float32))
    _make_wgmma_slice_mn(n, True)[1, 128](to_dev(At.ravel()), to_dev(B.ravel()), D)
    want = bits_to_f32(At).astype(np.float64).T @ bits_to_f32(B).astype(np.float64)
    np.testing.assert_allclose(to_host(D).reshape(64, n), want, rtol=1e-4, atol=1e-4)


def test_wgmma_b_mn_major_twin_refuses_k_major_steps():
    """The twin decodes an MN-major descriptor as the hardware does: a start stepped like a
    K-major one (+32 bytes, off the 1024-byte boundary) is refused, and a wrong leading byte
    offset reads the wrong columns."""
    from mok_core.cuda_compat import SIM
    if not SIM:
        pytest.skip("simulator twin")
    from mok_core.gemm.sm90 import _DESC_HIGH_MN
    from mok_core.intrinsics import twins
    rng = np.random.default_rng(3)
    smem = np.zeros(2 * 8192 // 2, np.uint16)
    B = bf16_bits(rng.standard_normal((16, 128)))
    for k in range(16):                           # two blocks [k][64 n], swizzled
        for c in range(16):
            dst = (c // 8) * 4096 + k * 64 + ((c % 8) ^ (k % 8)) * 8
            smem[dst:dst + 8] = B[k, 8 * c:8 * c + 8]
    got = twins._desc_operand_mn(smem, _DESC_HIGH_MN, 128)
    np.testing.assert_array_equal(got, bits_to_f32(B).astype(np.float64).T)
    with pytest.raises(ValueError, match="1024-byte boundary"):
        twins._desc_operand_mn(smem, _DESC_HIGH_MN + 2, 128)
    wrong_lbo = (_DESC_HIGH_MN & ~(0x3FFF << 16)) | (1 << 16)     # K-major's "unused" 1
    assert not np.array_equal(twins._desc_operand_mn(smem, wrong_lbo, 128), got)


# ---- per-group function over an accumulator tuple ------------------------------------------------

def _pair_group(j, out, r, col, scale, x, y):
    out[r * 6 + col + j] = x * scale + y


def _mirror_pairs(count):       # group j: elements j and count - 1 - j
    return [[j, count - 1 - j] for j in range(count // 2)]


_apply_mirror = tuple_groups(_pair_group, _mirror_pairs)


@kjit
def _tuple_groups_kernel(src, out, col):
    """Thread t: an 8-element tuple from src row t, then _pair_group over its mirrored pairs."""
    t = cuda.threadIdx.x
    b = 8 * t
    acc = (src[b], src[b + 1], src[b + 2], src[b + 3], src[b + 4], src[b + 5], src[b + 6],
           src[b + 7])
    _apply_mirror(acc, (out, t, col, float32(10.0)))


def test_tuple_groups_calls_the_function_per_group_with_its_elements():
    src = np.arange(4 * 8, dtype=np.float32).reshape(4, 8) + 1
    out = to_dev(np.full(4 * 6, -1, np.float32))
    _tuple_groups_kernel[1, 4](to_dev(src.ravel()), out, 1)
    want = np.full((4, 6), -1, np.float32)
    want[:, 1:5] = src[:, :4] * 10 + src[:, ::-1][:, :4]     # group j: src[j]*10 + src[7-j]
    np.testing.assert_array_equal(to_host(out).reshape(4, 6), want)


# ---- mbarrier phases -----------------------------------------------------------------------------

@kjit
def _mbarrier_phases(out):
    bar = cuda.shared.array(1, uint64)
    data = cuda.shared.array(2, int32)
    t = cuda.threadIdx.x
    addr = shared_addr(bar)
    if t == 0:
        mbarrier_init(bar, addr, 2)
    cuda.syncthreads()
    if t < 2:
        data[t] = 10 + t
        mbarrier_arrive_expect_tx(bar, addr, 0)   # release: the write above is seen by waiters
    if t == 2:
        while mbarrier_try_wait(bar, addr, 0) == 0:
            pass
        out[0] = data[0] + data[1]
        out[1] = mbarrier_try_wait(bar, addr, 1)     # phase 1 has not completed


def test_mbarrier_phase_completes_after_count_arrivals():
    out = to_dev(np.full(2, -1, np.int32))
    _mbarrier_phases[1, 32](out)
    assert list(to_host(out)) == [21, 0]


@kjit
def _cp_async_arrivals(src, idx, out):
    """Warp 1's lanes each copy src[idx[lane]] (zeros for -1) into shared memory with a
    4-byte cp.async and arrive on the mbarrier as it lands (the FP8 GEMM's scales); warp 0
    fills the slots with NaN first (zeros must be written, not found), waits for the phase
    -- a bounded number of tries: a wrong count leaves NaN, not a hang --, then writes out
    what shared memory holds."""
    bar = cuda.shared.array(1, uint64)
    vals = cuda.shared.array(32, float32)
    t = cuda.threadIdx.x
    addr = shared_addr(bar)
    if t == 0:
        mbarrier_init(bar, addr, 32)
        fence_mbarrier_init()
    if t < 32:
        vals[t] = math.nan
    cuda.syncthreads()
    if t >= 32:
        lane = t - 32
        i = idx[lane]
        cp_async_4_at(vals, shared_addr(vals) + 4 * lane, src, max(i, 0), 4 if i >= 0 else 0)
        cp_async_mbarrier_arrive(bar, addr)
    else:
        tries = 0
        while mbarrier_try_wait(bar, addr, 0) == 0 and tries < 2000:
            tries += 1
        out[t] = vals[t]


def test_cp_async_4_arrives_on_mbarrier_once_landed():
    rng = np.random.default_rng(5)
    src = rng.standard_normal(64).astype(np.float32)
    idx = rng.integers(0, 64, size=32).astype(np.int32)
    idx[[3, 17, 30]] = -1
    out = to_dev(np.full(32, np.nan, np.float32))
    _cp_async_arrivals[1, 64](to_dev(src), to_dev(idx), out)
    np.testing.assert_array_equal(to_host(out), np.where(idx >= 0, src[np.maximum(idx, 0)], 0))


# ---- bulk async copies ---------------------------------------------------------------------------

def _make_staged_stores(read_wait):
    @kjit
    def staged_stores(dst, rounds):
        """One warp, ``rounds`` times: lane l stages the word 1000 r + l at byte 4 l, then
        lane 0 bulk-stores the 128 bytes to dst[r * 32:] and (``read_wait``) waits only until
        the buffer was read before the next round overwrites it -- without that wait the
        next round may overwrite it while the copy still reads (a bug the twin must expose)."""
        buf = cuda.shared.array(64, uint16)
        s = shared_addr(buf)
        lane = cuda.threadIdx.x
        for r in range(rounds):
            st_shared_u32(buf, s + 4 * lane, 1000 * r + lane)
            fence_proxy_async()             # generic-proxy writes -> the bulk copy's reads
            syncwarp()
            if lane == 0:
                bulk_store(dst, r * 32, buf, s, 128)
                bulk_commit()
                if read_wait:
                    bulk_wait_read(0)
            syncwarp()
        if lane == 0:
            bulk_wait(0)
    return staged_stores


_staged_stores = _make_staged_stores(True)
_staged_stores_no_read_wait = _make_staged_stores(False)


def test_staged_words_go_out_by_bulk_stores_and_the_buffer_is_reused():
    dst = to_dev(np.zeros(3 * 32, np.uint32))
    _staged_stores[1, 32](dst, 3)
    want = (1000 * np.arange(3)[:, None] + np.arange(32)[None, :]).ravel().astype(np.uint32)
    np.testing.assert_array_equal(to_host(dst), want)
    if SIM:     # the twin reads a bulk store's source as late as the GPU may: at the wait
        dst = to_dev(np.zeros(3 * 32, np.uint32))
        _staged_stores_no_read_wait[1, 32](dst, 3)
        assert not np.array_equal(to_host(dst), want)
        np.testing.assert_array_equal(to_host(dst), np.tile(want[-32:], 3))


# ---- TMA box loads and stores --------------------------------------------------------------------

@kjit
def _tma_box(tmaps, out, x, y, rows):
    """Thread 0: one TMA box (rows x 64 bf16) at (x, y) -> shared (swizzled, 1024-byte aligned),
    then every thread reads it back un-swizzled into out [rows, 64]."""
    buf = cuda.shared.array(4096 + 512 + 8, uint16)   # 8 KB box + alignment slack + mbarrier
    s = shared_addr(buf)
    ring = s + (1024 - s % 1024) % 1024
    bar = ring + 8192
    if cuda.threadIdx.x == 0:
        mbarrier_init(buf, bar, 1)
        fence_mbarrier_init()
        tensormap_acquire(tmaps, 0)
        mbarrier_arrive_expect_tx(buf, bar, rows * 128)
        tma_load_2d(buf, ring, tmaps, 0, x, y, bar)
    cuda.syncthreads()
    while mbarrier_try_wait(buf, bar, 0) == 0:
        pass
    base = (ring - s) // 2                             # element offset of the box
    for i in range(cuda.threadIdx.x, rows * 64, cuda.blockDim.x):
        r = i // 64
        c = i % 64
        out[i] = buf[base + r * 64 + ((c // 8) ^ (r % 8)) * 8 + c % 8]


def test_tma_box_is_swizzled_and_zero_filled_past_the_tensor():
    from mok_core.gemm.tensor_map import tensor_maps
    rows, cols, box = 20, 128, 16
    src = (np.arange(rows * cols) % 65521).astype(np.uint16).reshape(rows, cols)
    dsrc = to_dev(src)
    maps = tensor_maps([dsrc], box)
    out = to_dev(np.full(box * 64, 0xFFFF, np.uint16))
    _tma_box[1, 128](maps, out, 64, 10, box)          # rows 10..25: the last 6 are past the end
    want = np.zeros((box, 64), np.uint16)
    want[:10] = src[10:20, 64:128]
    np.testing.assert_array_equal(to_host(out).reshape(box, 64), want)


@kjit
def _tma_store_box(tmaps, box, x, y, rows):
    """Every thread writes box [rows, 64] into shared memory with the 128-byte swizzle
    (1024-byte aligned); thread 0 stores it by TMA at (x, y) of the map and waits."""
    buf = cuda.shared.array(4096 + 512, uint16)       # 8 KB box + alignment slack
    s = shared_addr(buf)
    ring = s + (1024 - s % 1024) % 1024
    base = (ring - s) // 2
    for i in range(cuda.threadIdx.x, rows * 64, cuda.blockDim.x):
        r = i // 64
        c = i % 64
        buf[base + r * 64 + ((c // 8) ^ (r % 8)) * 8 + c % 8] = box[i]
    fence_proxy_async()
    cuda.syncthreads()
    if cuda.threadIdx.x == 0:
        tensormap_acquire(tmaps, 0)
        tma_store_2d(tmaps, 0, buf, ring, x, y)
        bulk_commit()
        bulk_wait(0)


@pytest.mark.parametrize("x,y", [(64, 10), (0, 0)])
def test_tma_store_unswizzles_and_clips_at_the_tensor(x, y):
    """The box lands un-swizzled at (x, y); rows past the tensor's end are not written (the
    twin agrees with the GPU: session 22, device run 2)."""
    from mok_core.gemm.tensor_map import tensor_maps
    rows, cols, box = 20, 128, 16
    dst = to_dev(np.full((rows, cols), 0x7FC1, np.uint16))
    maps = tensor_maps([dst], box)
    data = (np.arange(box * 64) * 7 % 65521).astype(np.uint16).reshape(box, 64)
    _tma_store_box[1, 128](maps, to_dev(data.reshape(-1)), x, y, box)
    want = np.full((rows, cols), 0x7FC1, np.uint16)
    r1 = min(y + box, rows)
    want[y:r1, x:x + 64] = data[:r1 - y]
    np.testing.assert_array_equal(to_host(dst), want)


@kjit
def _tma_f32_box(tmaps, box, x, y, rows, mode):
    """The float32 box [rows, 32] through shared memory (the 128-byte swizzle) to (x, y) of the
    map: mode 0 -- every thread stores its pairs (``st_shared_v2_f32``), thread 0 stores the
    box by TMA; 1 -- thread 0 loads the map's box at (x, y) by TMA (an mbarrier), every
    thread adds its pairs to it (``add_shared_v2_f32``), thread 0 stores the box; thread 0
    waits."""
    buf = cuda.shared.array(2048 + 256 + 4, float32)  # 8 KB box + alignment slack + mbarrier
    s = shared_addr(buf)
    ring = s + (1024 - s % 1024) % 1024
    bar = ring + 8192
    if mode == 1 and cuda.threadIdx.x == 0:
        mbarrier_init(buf, bar, 1)
        fence_mbarrier_init()
        tensormap_acquire(tmaps, 0)
        mbarrier_arrive_expect_tx(buf, bar, 16 * 128)
        tma_load_2d(buf, ring, tmaps, 0, x, y, bar)
        while mbarrier_try_wait(buf, bar, 0) == 0:
            pass
    cuda.syncthreads()
    for i in range(cuda.threadIdx.x, rows * 16, cuda.blockDim.x):
        r = i // 16
        c = 2 * (i % 16)                               # the pair's first column
        chunk = (c * 4) // 16
        at = ring + r * 128 + ((chunk ^ (r % 8)) * 16) + (c * 4) % 16
        if mode == 1:
            add_shared_v2_f32(buf, at, box[r * 32 + c], box[r * 32 + c + 1])
        else:
            st_shared_v2_f32(buf, at, box[r * 32 + c], box[r * 32 + c + 1])
    fence_proxy_async()
    cuda.syncthreads()
    if cuda.threadIdx.x == 0:
        tensormap_acquire(tmaps, 0)
        tma_store_2d(tmaps, 0, buf, ring, x, y)
        bulk_commit()
        bulk_wait(0)


@pytest.mark.parametrize("mode", [0, 1], ids=["store", "load_add"])
def test_tma_f32_box_stores_or_adds_and_clips(mode):
    """A float32 map ([16, 32] boxes: 128-byte rows): the box lands un-swizzled at (x, y) --
    or is added to what is there, one IEEE float32 add an element, subnormal inputs and sums
    kept (an H100 keeps them: the twin does the same), loaded by TMA and added to in shared
    memory (``add_shared_v2_f32``) --, rows past the tensor's end untouched (a load
    zero-fills them; the store clips)."""
    from mok_core.gemm.tensor_map import tensor_maps
    rows, cols, box, x, y = 20, 64, 16, 32, 10
    rng = np.random.default_rng(3)
    init = rng.standard_normal((rows, cols)).astype(np.float32)
    data = rng.standard_normal((box, 32)).astype(np.float32)
    tiny = np.float32(2.0 ** -126)
    init[y, x:x + 4] = [1.5 * tiny, 1e-40, 3.0, -0.0]      # a sum falling below the normals,
    data[0, :4] = [-tiny, 1e-41, 1e-41, 0.0]                # subnormal inputs, signed zeros
    dst = to_dev(init.copy())
    _tma_f32_box[1, 128](tensor_maps([dst], box), to_dev(data.reshape(-1)), x, y, box, mode)
    want = init.copy()
    r1 = min(y + box, rows)
    new = data[:r1 - y]
    if mode:
        new = init[y:r1, x:x + 32] + new
    want[y:r1, x:x + 32] = new
    np.testing.assert_array_equal(to_host(dst).view(np.uint32), want.view(np.uint32))


@pytest.mark.skipif(not SIM, reason="the twin's check: the GPU faults instead")
def test_tma_store_twin_refuses_a_negative_origin():
    """A store box starting before the tensor faults on the H200 (illegal instruction, where a
    load zero-fills): the twin says so instead of clipping."""
    from mok_core.gemm.tensor_map import tensor_maps
    dst = to_dev(np.zeros((20, 128), np.uint16))
    with pytest.raises(ValueError, match="before the tensor's start"):
        _tma_store_box[1, 128](tensor_maps([dst], 16), to_dev(np.zeros(16 * 64, np.uint16)),
                               0, -4, 16)


def test_tensor_map_upload_failure_says_what_to_do(monkeypatch):
    """A cache miss whose upload fails (inside a CUDA-graph capture, on a GPU) names the fix
    instead of surfacing a bare driver error."""
    from mok_core.gemm import tensor_map
    from mok_core.cuda_compat import device_address

    def refuse(*_):
        raise RuntimeError("operation not permitted when stream is capturing")
    monkeypatch.setattr(tensor_map, "upload", refuse)
    fresh = to_dev(np.zeros((8, 64), np.uint16))
    with pytest.raises(RuntimeError, match="outside a CUDA-graph capture"):
        tensor_map.tensor_maps([fresh], 8)
    assert not any(k[0][0] == device_address(fresh) for k in tensor_map._cache)

