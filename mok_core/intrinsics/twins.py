"""Python twins of ``ptx.py`` for the CUDA simulator: same names, same arguments, same results.

Warp-collective instructions (``mma.sync``, ``ldmatrix``) trade per-lane values through
``sim_runtime.warp_exchange``, so a kernel that gets the fragment layouts wrong fails here the
way it would on the GPU. ``cp.async`` is modelled as truly asynchronous: copies are queued per
thread and land only at ``cp_async_wait`` or the thread's ``cp_async_mbarrier_arrive``, so a
read of shared memory before them sees stale data here too. Misaligned 16- or 4-byte accesses
raise (the GPU would fault).
"""
import functools
import math
import threading
import time

import numpy as np

from ..quantize_reference import E4M3_MAX
from ..sim_runtime import warp_barrier, warp_collective, warp_exchange

_lock = threading.Lock()


def _raw(arr):
    """The NumPy array behind a simulator array wrapper."""
    while not isinstance(arr, np.ndarray):
        if hasattr(arr, "_item"):
            arr = arr._item
        elif hasattr(arr, "_ary"):
            arr = arr._ary
        else:
            raise TypeError(f"not an array: {type(arr).__name__}")
    return arr


def _chunk(arr, idx, nbytes=16):
    raw = _raw(arr)
    assert raw.ndim == 1, "intrinsics take 1-D arrays"
    idx = int(idx)
    if (idx * raw.itemsize) % nbytes:
        raise ValueError(f"misaligned {nbytes}-byte access at element {idx}")
    n = nbytes // raw.itemsize
    if idx < 0 or idx + n > raw.size:
        raise IndexError(f"{nbytes}-byte access at element {idx} outside array of {raw.size}")
    return raw, slice(idx, idx + n)


# ---- 16-byte vector memory access ------------------------------------------------------------

def ld_v4(arr, idx):
    raw, sl = _chunk(arr, idx)
    w = np.ascontiguousarray(raw[sl]).view(np.uint32)
    return (w[0], w[1], w[2], w[3])


def st_v4(arr, idx, v0, v1, v2, v3):
    raw, sl = _chunk(arr, idx)
    raw[sl] = np.array([v0, v1, v2, v3], dtype=np.uint32).view(raw.dtype)


def st_v2_f32(arr, idx, v0, v1):
    raw, sl = _chunk(arr, idx, 8)
    raw[sl] = np.array([v0, v1], dtype=np.float32)


# ---- memory ordering -----------------------------------------------------------------------------

def ld_acquire_sys(arr, idx):
    return _raw(arr)[idx]


def st_release_sys(arr, idx, value):
    _raw(arr)[idx] = value


def red_add_release_gpu(arr, idx, value):
    with _lock:
        _raw(arr)[idx] += value


def syncwarp():
    warp_barrier()


def tuple_pick(tup, i):
    if not 0 <= i < len(tup):             # the GPU version gives element 0: a caller's bug
        raise IndexError(f"tuple_pick: index {i} outside a {len(tup)}-tuple")
    return tup[i]


def warp_all(pred):
    return np.int32(all(warp_exchange(bool(pred))))


def _int32s(values):
    """The lanes' ints as int32 (NumPy's conversion: OverflowError outside the range), in one
    check where all are inside (every lane of every call converted 32 values otherwise)."""
    if min(values) >= -2 ** 31 and max(values) < 2 ** 31:
        return values
    return [int(np.int32(v)) for v in values]


def warp_sum(value):
    return np.int32(sum(_int32s(warp_exchange(int(value)))))


def warp_min(value):
    return np.int32(min(_int32s(warp_exchange(int(value)))))


def warp_fsum(value):
    """The GPU's butterfly step for step: at distance d a lane adds lane ``lane ^ d``'s value
    to its own, rounded to float32 (so the bits are the GPU's)."""
    lane = threading.current_thread().thread_id % 32
    s = np.float32(value)
    for d in (16, 8, 4, 2, 1):
        t = warp_exchange(s)[lane ^ d]
        with np.errstate(invalid="ignore", over="ignore"):
            s = np.float32(s + t)
    return s


def warp_read(value, lane):
    return np.int32(warp_exchange(int(np.int32(value)))[int(lane)])


def match_any(value):
    v = int(np.int32(value))
    return np.uint32(sum(1 << j for j, w in enumerate(warp_exchange(v)) if w == v))


def clock64():
    return np.int64(time.perf_counter_ns() * 2)     # ~2 GHz, like an H200 SM clock


def nanosleep(ns):
    time.sleep(0)                                    # let the other simulated threads run


def per_iteration(x):
    return x                                         # (the GPU's only concern: registers)


# ---- bf16 bits <-> f32 -------------------------------------------------------------------------

# (a NumPy scalar of the type at hand is reinterpreted in place: the same bits as through a
# one-element array, without making one)

def u32_as_f32(x):
    if type(x) is np.uint32:
        return x.view(np.float32)
    return np.array([x], dtype=np.uint32).view(np.float32)[0]


def f32_as_u32(x):
    if type(x) is np.float32:
        return x.view(np.uint32)
    return np.array([x], dtype=np.float32).view(np.uint32)[0]


def _bf16_bits(x):
    """Round-to-nearest-even float32 -> bf16 bits, as ``cvt.rn.bf16x2.f32`` does per half."""
    u = int(x.view(np.uint32) if type(x) is np.float32 else
            np.array([x], dtype=np.float32).view(np.uint32)[0])
    if (u & 0x7F800000) == 0x7F800000 and (u & 0x007FFFFF):
        return 0x7FFF                                      # canonical NaN, as cvt.rn does
    u += 0x7FFF + ((u >> 16) & 1)                          # round to nearest, ties to even
    return (u >> 16) & 0xFFFF


def pack_bf16x2(lo, hi):
    return np.uint32((_bf16_bits(hi) << 16) | _bf16_bits(lo))


def max_u16x2(a, b):
    a, b = int(a) & 0xFFFFFFFF, int(b) & 0xFFFFFFFF
    return np.uint32(max(a & 0xFFFF, b & 0xFFFF) | max(a >> 16, b >> 16) << 16)


def fold_nonfinite_bf16x2(z, w):
    z, w = int(z), int(w)
    out = 0
    for sh in (0, 16):
        zh, wh = (z >> sh) & 0xFFFF, (w >> sh) & 0xFFFF
        nan = (zh & 0x7F80) == 0x7F80 and (zh & 0x7F) != 0
        if nan or (wh & 0x7F80) == 0x7F80:
            out |= 0x7FFF << sh                  # w * 0 + z is NaN
        else:
            out |= zh << sh                      # + (+-0): z unchanged (it is +0 here)
    return np.uint32(out)


def fmul_rn(a, b):
    return np.float32(np.float32(a) * np.float32(b))


def fadd_rn(a, b):
    return np.float32(np.float32(a) + np.float32(b))


_F32_EDGE = 2.0 ** 128 - 2.0 ** 103       # FLT_MAX + half an ulp: from here on, inf
_F32_MAX = np.finfo(np.float32).max
_F32_MAX_FLOAT = float(_F32_MAX)


def ffma_rn(a, b, c):
    """``fma.rn.f32``: a x b + c rounded once to float32 (ties to even; inf from FLT_MAX +
    half an ulp on, as IEEE rounds), elementwise over arrays, or on scalars (what the
    quantizer's device functions pass: a fast path, the same rule). The product of two float32
    is exact in float64; TwoSum gives the float64 sum s and its error exactly; s rounds to
    float32 as the exact value does unless s lies exactly halfway between two float32 -- or
    exactly on the overflow edge --, where the error's sign picks the side."""
    if type(a) is type(b) is type(c) is np.float32:          # (the common case, quickly)
        return _ffma_rn_scalar(float(a), float(b), float(c))
    if np.ndim(a) == np.ndim(b) == np.ndim(c) == 0:
        return _ffma_rn_scalar(float(np.float32(a)), float(np.float32(b)),
                               float(np.float32(c)))
    with np.errstate(all="ignore"):
        a, b, c = (np.asarray(v, np.float32).astype(np.float64) for v in (a, b, c))
        p = a * b
        s = p + c
        v = s - p
        err = (p - (s - v)) + (c - v)
        r = s.astype(np.float32)
        d = s - r.astype(np.float64)
        other = np.nextafter(r, np.where(d > 0, np.float32(np.inf), np.float32(-np.inf)))
        half = np.abs(other.astype(np.float64) - r.astype(np.float64)) / 2
        beyond = (np.isfinite(r) & (d != 0) & (np.abs(d) == half)
                  & (np.sign(err) == np.sign(d)))
        inside = (np.abs(s) == _F32_EDGE) & (np.sign(err) == -np.sign(s))
        top = np.where(s > 0, _F32_MAX, -_F32_MAX).astype(np.float32)
        return np.where(beyond, other, np.where(inside, top, r)).astype(np.float32)


def _ffma_rn_scalar(a, b, c):
    """``ffma_rn`` on three float32 values as Python floats. Where |s| <= FLT_MAX (the
    float32 rounding cannot overflow: no errstate needed) and s is not exactly halfway
    between two float32 -- d = s - r, when not 0, is then no power of two, as half the gap
    between neighbouring float32 always is --, RN(s) is the answer; the rest as below."""
    p = a * b
    s = p + c
    if abs(s) <= _F32_MAX_FLOAT:
        r = np.float32(s)
        d = s - float(r)
        if d == 0 or abs(math.frexp(d)[0]) != 0.5:
            return r
    return _ffma_rn_scalar_edges(c, p, s)


def _ffma_rn_scalar_edges(c, p, s):
    """``_ffma_rn_scalar``'s general rule (every case; it needs it for NaN/Inf, the overflow
    edge and the halfway points)."""
    with np.errstate(all="ignore"):
        r = np.float32(s)
        if not math.isfinite(s):
            return r
        v = s - p
        err = (p - (s - v)) + (c - v)
        if err == 0:
            return r
        if abs(s) == _F32_EDGE:
            return np.float32(math.copysign(_F32_MAX, s)) if (err > 0) != (s > 0) else r
        d = s - float(r)
        if d == 0 or not math.isfinite(r):
            return r
        other = np.nextafter(r, np.float32(math.copysign(math.inf, d)))
        if abs(d) * 2 == abs(float(other) - float(r)) and (err > 0) == (d > 0):
            return other
        return r


def fdiv_rn(a, b):
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        return np.float32(np.float32(a) / np.float32(b))


def pack_e4m3x4(a, b, c, d):
    return np.uint32(_e4m3_byte(a) | _e4m3_byte(b) << 8 | _e4m3_byte(c) << 16
                     | _e4m3_byte(d) << 24)


def _e4m3_byte(x):
    """``quantize_reference.e4m3_bits`` of one value (rounded to float32 first, as it does),
    step for step on a Python float: exact, as there (float32 values and the e4m3 steps are
    float64s; ``round`` is to nearest even, as ``np.rint``)."""
    v = float(x) if type(x) is np.float32 else float(np.float32(x))
    if v != v:
        return 0x7F
    sign = 0x80 if math.copysign(1.0, v) < 0 else 0
    a = min(abs(v), E4M3_MAX)
    e = max(math.frexp(a)[1] - 1, -6)               # below 2**-6: the subnormal step
    step = math.ldexp(1.0, e - 3)
    val = min(round(a / step) * step, E4M3_MAX)
    if val >= 2.0 ** -6:
        ev = math.frexp(val)[1] - 1
        return (ev + 7) * 8 + int((math.ldexp(val, -ev) - 1) * 8) | sign
    return int(val * 2 ** 9) | sign



def _ftz(x):
    """float32 with denormals flushed to (signed) zero, as the .ftz instructions do."""
    x = np.float32(x)
    return np.float32(np.copysign(0.0, x)) if 0 < abs(x) < _F32_TINY else x


_F32_TINY = np.finfo(np.float32).tiny


def ex2_approx(x):
    with np.errstate(over="ignore"):
        return _ftz(np.exp2(_ftz(x)))


def rcp_approx(x):
    with np.errstate(divide="ignore", over="ignore"):
        return _ftz(np.float32(1.0) / _ftz(x))


# ---- tensor cores ------------------------------------------------------------------------------

def _bf16_words_to_f64(words):
    """uint32 [..., n] of packed bf16 pairs -> float64 [..., 2n] (low half first)."""
    halves = np.ascontiguousarray(words, dtype=np.uint32).view(np.uint16)
    return (halves.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


# Fragment layout of m16n8k16 (PTX ISA): for lane L (g = L // 4, t = L % 4) the 8 bf16 of
# A are rows (g, g, g+8, g+8, g, g, g+8, g+8) x cols (2t, 2t+1, 2t, 2t+1, 2t+8, 2t+9, ...),
# the 4 of B are k (2t, 2t+1, 2t+8, 2t+9) x n g, and C/D rows (g, g, g+8, g+8) x (2t, 2t+1).
_L = np.arange(32)
_G, _T = _L // 4, _L % 4
_A_ROWS = np.stack([_G, _G, _G + 8, _G + 8, _G, _G, _G + 8, _G + 8], 1)
_A_COLS = np.stack([2 * _T, 2 * _T + 1, 2 * _T, 2 * _T + 1,
                    2 * _T + 8, 2 * _T + 9, 2 * _T + 8, 2 * _T + 9], 1)
_B_ROWS = np.stack([2 * _T, 2 * _T + 1, 2 * _T + 8, 2 * _T + 9], 1)
_B_COLS = np.stack([_G] * 4, 1)
_C_ROWS = np.stack([_G, _G, _G + 8, _G + 8], 1)
_C_COLS = np.stack([2 * _T, 2 * _T + 1, 2 * _T, 2 * _T + 1], 1)


def _mma_warp(lanes):
    v = np.array([[int(x) for x in lane[:6]] for lane in lanes], dtype=np.uint32)
    c = np.array([[float(x) for x in lane[6:]] for lane in lanes], dtype=np.float64)
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    C = np.zeros((16, 8))
    A[_A_ROWS, _A_COLS] = _bf16_words_to_f64(v[:, :4])
    B[_B_ROWS, _B_COLS] = _bf16_words_to_f64(v[:, 4:6])
    C[_C_ROWS, _C_COLS] = c
    return (A @ B + C).astype(np.float32)[_C_ROWS, _C_COLS]      # [32 lanes, 4]


def mma_bf16_16816(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    d = warp_collective((a0, a1, a2, a3, b0, b1, c0, c1, c2, c3), _mma_warp)
    lane = threading.current_thread().thread_id % 32
    return (d[lane, 0], d[lane, 1], d[lane, 2], d[lane, 3])


def _ldmatrix(smem, idx, nmat):
    raw, sl = _chunk(smem, idx)
    rows = warp_exchange(np.ascontiguousarray(raw[sl]).view(np.uint32).copy())
    lane = threading.current_thread().thread_id % 32
    # Matrix j's row r was addressed by lane 8j + r; this lane holds row lane/4, word lane%4.
    return tuple(rows[8 * j + lane // 4][lane % 4] for j in range(nmat))


def _ldmatrix_trans(smem, idx, nmat):
    raw, sl = _chunk(smem, idx)
    rows = warp_exchange(np.ascontiguousarray(raw[sl]).view(np.uint16).copy())
    lane = threading.current_thread().thread_id % 32
    # Transposed: this lane holds column lane/4 of rows 2*(lane%4) and 2*(lane%4)+1.
    r, c = 2 * (lane % 4), lane // 4
    return tuple(np.uint32(int(rows[8 * j + r][c]) | (int(rows[8 * j + r + 1][c]) << 16))
                 for j in range(nmat))


def shared_addr(smem):
    return 0                              # byte offsets from the array start stand in


def ldmatrix_x4_at(smem, addr):
    return _ldmatrix(smem, int(addr) // _raw(smem).itemsize, 4)


def ldmatrix_x4_trans_at(smem, addr):
    return _ldmatrix_trans(smem, int(addr) // _raw(smem).itemsize, 4)


def cp_async_16_at(smem, saddr, gmem, gidx, src_bytes):
    assert src_bytes in (0, 16), src_bytes
    _cp_async(smem, int(saddr) // _raw(smem).itemsize, gmem, gidx, src_bytes, 16)


def cp_async_4_at(smem, saddr, gmem, gidx, src_bytes):
    assert src_bytes in (0, 4), src_bytes
    _cp_async(smem, int(saddr) // _raw(smem).itemsize, gmem, gidx, src_bytes, 4)


def _groups(kind):
    """This thread's async copies of one kind ("cp_async" or "bulk") as a list of groups, the
    last one open; an entry (dst, slice, data) lands only when a wait covers its group."""
    t = threading.current_thread()
    attr = f"mok_{kind}"
    if not hasattr(t, attr):
        setattr(t, attr, [[]])
    return getattr(t, attr)


def _land(groups, pending):
    """Land the oldest closed groups until at most ``pending`` stay in flight (an entry starts
    with dst, slice, data)."""
    closed = groups[:-1]
    while len(closed) > pending:
        for entry in closed.pop(0):
            entry[0][entry[1]] = entry[2]
    groups[:-1] = closed


def _cp_async(smem, sidx, gmem, gidx, src_bytes, nbytes):
    dst, dsl = _chunk(smem, sidx, nbytes)
    data = np.zeros(nbytes, np.uint8)
    if src_bytes:
        src, ssl = _chunk(gmem, gidx, nbytes)
        data[:src_bytes] = np.ascontiguousarray(src[ssl]).view(np.uint8)[:src_bytes]
    _groups("cp_async")[-1].append((dst, dsl, data.view(dst.dtype)))


def cp_async_commit():
    _groups("cp_async").append([])


def cp_async_wait(pending):
    _land(_groups("cp_async"), pending)


# ---- Hopper warpgroup MMA (wgmma) --------------------------------------------------------------
#
# Each thread computes its own accumulator fragment straight from shared memory, decoding the
# descriptors the way the hardware does (so a wrong descriptor, swizzle or fragment index fails
# here too): K-major (A of all but the ``_tatb`` twins, B of the ``wgmma_*`` twins) and
# MN-major (B of the ``_tb`` twins, A and B of the ``_tatb`` twins: the PTX ISA's canonical 128B
# layout, leading byte offset between 64-column blocks, stride byte offset between 8-row groups
# of k; A is read the same way, m in place of n). The simulator runs the MMA at issue time;
# the kernel's fence/commit/wait discipline keeps the operands unchanged until the wait, as on
# the GPU.

_SWIZZLE_128B = 1


def _desc_fields(desc):
    """(start, leading byte offset, stride byte offset) in bytes of a 128-byte-swizzled
    descriptor with base offset 0 -- the only kind the kernels build (anything else raises)."""
    desc = int(desc)
    if desc >> 62 != _SWIZZLE_128B:
        raise ValueError(f"wgmma twin: descriptor swizzle mode {desc >> 62}, only 128B is used")
    if (desc >> 49) & 7:
        raise ValueError("wgmma twin: descriptor base offset must be 0 (1024-byte aligned tiles)")
    return ((desc & 0x3FFF) << 4, ((desc >> 16) & 0x3FFF) << 4, ((desc >> 32) & 0x3FFF) << 4)


def _swizzle_addresses(logical):
    """Physical byte addresses of ``logical`` ones under the 128-byte swizzle, the way the
    hardware applies it: by address, 16-byte chunk bits [6:4] XOR row bits [9:7] (so a tile
    laid out from a 1024-byte boundary is swizzled from its first row)."""
    return logical ^ (((logical >> 7) & 7) << 4)


def _bf16_at(raw, phys):
    """bf16 (as float64) at the physical byte addresses ``phys`` of the bytes ``raw``."""
    bits = raw[phys].astype(np.uint32) | (raw[phys + 1].astype(np.uint32) << 8)
    return (bits << 16).view(np.float32).astype(np.float64)


def _swizzled_bf16(smem, logical):
    """bf16 (as float64) at the logical byte addresses ``logical``, read through the 128-byte
    swizzle (``_swizzle_addresses``)."""
    raw = _raw(smem).view(np.uint8)
    if logical.min() < 0 or logical.max() + 2 > raw.size:
        raise ValueError("wgmma twin: operand outside shared memory")
    return _bf16_at(raw, _swizzle_addresses(logical))


def _k_major_logical(desc, rows):
    """Logical byte addresses [rows, 16] of a K-major, 128-byte-swizzled descriptor's operand:
    row i, k at start + (i // 8) SBO + (i % 8) 128 + 2k (the leading byte offset is unused)."""
    start, _, sbo = _desc_fields(desc)
    if (start % 1024) >= 128:
        raise ValueError(f"wgmma twin: operand at byte {start} outside its 1024-byte atom's "
                         "first row")
    i = np.arange(rows)[:, None]
    k = np.arange(16)[None, :]
    return start + (i // 8) * sbo + (i % 8) * 128 + 2 * k


def _mn_major_logical(desc, cols):
    """Logical byte addresses [cols, 16] (n, k) of an MN-major, 128-byte-swizzled descriptor's
    operand (PTX ISA, "Canonical Layouts", MN-major 128B: ((T,8,m),(8,k)) :
    ((1,T,LBO),(8T,SBO)), T = 8 bf16): column n, row k at
    start + (n // 64) LBO + 2 (n % 64) + (k // 8) SBO + (k % 8) 128 -- each 64-column block a
    stack of 128-byte rows of k, blocks LBO apart, groups of 8 k-rows SBO apart. The start must
    lie on a 1024-byte boundary (base offset 0 and what the kernels' k16 steps of 2048 bytes
    keep); a descriptor stepped like a K-major one (+32 bytes) is refused."""
    start, lbo, sbo = _desc_fields(desc)
    if start % 1024:
        raise ValueError(f"wgmma twin: MN-major operand at byte {start}: not on a 1024-byte "
                         "boundary")
    n = np.arange(cols)[:, None]
    k = np.arange(16)[None, :]
    return start + (n // 64) * lbo + 2 * (n % 64) + (k // 8) * sbo + (k % 8) * 128


def _desc_operand_mn(smem, desc, cols):
    """bf16 [cols, 16] (n, k; as float64) that an MN-major, 128-byte-swizzled descriptor
    points at (``_mn_major_logical``)."""
    return _swizzled_bf16(smem, _mn_major_logical(desc, cols))


@functools.lru_cache(maxsize=4096)
def _operand_table(mn_major, desc, rows):
    """(physical byte addresses [rows, 16], lowest, highest logical address) of a descriptor's
    operand: the same for every thread of a warpgroup and every k step that reuses a stage, so
    worked out once (the descriptor alone fixes them; the bytes are read at each wgmma)."""
    logical = (_mn_major_logical if mn_major else _k_major_logical)(desc, rows)
    return _swizzle_addresses(logical), int(logical.min()), int(logical.max())


def _operand_rows(smem, mn_major, desc, rows, pick):
    """bf16 (as float64) rows ``pick`` of the [rows, 16] operand a descriptor points at; the
    whole operand must lie in shared memory."""
    phys, lo, hi = _operand_table(mn_major, int(desc), rows)
    raw = _raw(smem).view(np.uint8)
    if lo < 0 or hi + 2 > raw.size:
        raise ValueError("wgmma twin: operand outside shared memory")
    return _bf16_at(raw, phys[pick])


@functools.lru_cache(maxsize=64)
def _fragment_columns(n, quad):
    """The accumulator columns a thread holds (lane % 4 = ``quad``), in its fragment's order:
    8-column group j, then column pair c -> [n / 4]."""
    return (2 * quad + np.arange(n // 8)[:, None] * 8 + np.arange(2)[None, :]).reshape(-1)


def _wgmma(n, trans_b=False, trans_a=False):
    def twin(acc, smem, desc_a, desc_b):
        # Each thread multiplies only what its fragment holds: rows row and row + 8 of the
        # warpgroup's 64 (A), its n / 4 columns (B).
        t = threading.current_thread().thread_id % 128
        row = 16 * (t // 32) + (t % 32) // 4
        cols = _fragment_columns(n, t % 4)
        a = _operand_rows(smem, trans_a, desc_a, 64, [row, row + 8])       # [2, 16]
        b = _operand_rows(smem, trans_b, desc_b, n, cols)                  # [n / 4, 16]
        d = a @ b.T                                                        # [2, n / 4]
        frag = d.reshape(2, n // 8, 2).transpose(1, 0, 2).reshape(-1)      # j, h, c order
        return tuple(np.asarray(acc, np.float32) + frag.astype(np.float32))
    twin.__name__ = f"wgmma_m64n{n}k16_bf16" + ("_tatb" if trans_a else
                                                 "_tb" if trans_b else "")
    return twin


wgmma_m64n64k16_bf16 = _wgmma(64)
wgmma_m64n128k16_bf16 = _wgmma(128)
wgmma_m64n256k16_bf16 = _wgmma(256)
wgmma_m64n64k16_bf16_tb = _wgmma(64, trans_b=True)
wgmma_m64n128k16_bf16_tb = _wgmma(128, trans_b=True)
wgmma_m64n256k16_bf16_tb = _wgmma(256, trans_b=True)
wgmma_m64n64k16_bf16_tatb = _wgmma(64, trans_b=True, trans_a=True)
wgmma_m64n128k16_bf16_tatb = _wgmma(128, trans_b=True, trans_a=True)
wgmma_m64n256k16_bf16_tatb = _wgmma(256, trans_b=True, trans_a=True)


@functools.lru_cache(maxsize=1)
def _e4m3_values():
    """The 256 e4m3 values (float64; 0x7F / 0xFF NaN)."""
    from ..quantize_reference import e4m3_values
    return e4m3_values(np.arange(256, dtype=np.uint8))


@functools.lru_cache(maxsize=4096)
def _e4m3_table(desc, rows):
    """(physical byte addresses [rows, 32], lowest, highest logical address) of a K-major,
    128-byte-swizzled e4m3 operand: row i, k at start + (i // 8) SBO + (i % 8) 128 + k --
    ``_k_major_logical``'s rows, one byte a value (32 of k a step)."""
    start, _, sbo = _desc_fields(desc)
    if (start % 1024) >= 128:
        raise ValueError(f"wgmma twin: operand at byte {start} outside its 1024-byte atom's "
                         "first row")
    i = np.arange(rows)[:, None]
    logical = start + (i // 8) * sbo + (i % 8) * 128 + np.arange(32)[None, :]
    return _swizzle_addresses(logical), int(logical.min()), int(logical.max())


def _e4m3_rows(smem, desc, rows, pick):
    """e4m3 values (float64) of rows ``pick`` of the [rows, 32] operand a descriptor points at;
    the whole operand must lie in shared memory."""
    phys, lo, hi = _e4m3_table(int(desc), rows)
    raw = _raw(smem).view(np.uint8)
    if lo < 0 or hi + 1 > raw.size:
        raise ValueError("wgmma twin: operand outside shared memory")
    return _e4m3_values()[raw[phys[pick]]]


def _wgmma_e4m3(n, fresh=False):
    def twin(acc, smem, desc_a, desc_b):
        t = threading.current_thread().thread_id % 128
        row = 16 * (t // 32) + (t % 32) // 4
        cols = _fragment_columns(n, t % 4)
        a = _e4m3_rows(smem, desc_a, 64, [row, row + 8])                  # [2, 32]
        b = _e4m3_rows(smem, desc_b, n, cols)                              # [n / 4, 32]
        d = a @ b.T                                                        # exact products
        frag = d.reshape(2, n // 8, 2).transpose(1, 0, 2).reshape(-1)      # j, h, c order
        if fresh:                                                          # scale-d 0
            return tuple(frag.astype(np.float32))
        return tuple(np.asarray(acc, np.float32) + frag.astype(np.float32))
    twin.__name__ = f"wgmma_m64n{n}k32_e4m3" + ("_fresh" if fresh else "")
    return twin


def promote_fp8(acc, part, s_lo, s_hi, s_lo2, s_hi2):
    f = np.float32([s_lo, s_hi, s_lo2, s_hi2])
    n = len(acc)
    i = np.arange(n)
    return tuple(ffma_rn(part, f[2 * (i >= n // 2) + (i // 2) % 2], acc))


wgmma_m64n128k32_e4m3_fresh = _wgmma_e4m3(128, fresh=True)
wgmma_m64n64k32_e4m3 = _wgmma_e4m3(64)
wgmma_m64n128k32_e4m3 = _wgmma_e4m3(128)
wgmma_m64n256k32_e4m3 = _wgmma_e4m3(256)


def wgmma_fence(acc):
    return acc


def wgmma_commit():
    pass


def wgmma_wait(acc, pending):
    return acc


def fence_proxy_async():
    pass


def f32_zeros(n):
    return (np.float32(0.0),) * n


def tuple_groups(fn, layout):
    def apply(acc, extra):
        for j, idx in enumerate(layout(len(acc))):
            fn(j, *extra, *[acc[i] for i in idx])
    return apply


def tuple_fold(fn, layout):
    def apply(acc, carry, extra):
        for j, idx in enumerate(layout(len(acc))):
            carry = fn(j, carry, *extra, *[acc[i] for i in idx])
        return carry
    return apply


# ---- mbarriers ---------------------------------------------------------------------------------

_mbarriers = {}


def _mbar_key(smem, addr):
    return (_raw(smem).__array_interface__["data"][0], int(addr))   # the block's shared memory


def _mbar(smem, addr):
    b = _mbarriers.get(_mbar_key(smem, addr))
    if b is None:
        raise RuntimeError(f"mbarrier at byte {addr} used before mbarrier_init")
    return b


# A thread whose phase is pending sleeps on its mbarrier's condition (on ``_lock``, which every
# mbarrier update holds) until the phase completes, instead of spinning: with a block's other
# threads polling, the one thread that arrives (the TMA producer) would get a sliver of the GIL.
_TRY_WAIT_S = 0.05        # a try_wait's suspend time: it returns 0 after this at the latest


def _settle(b):
    """A phase completes when all arrivals are in and no announced bytes are outstanding."""
    if b["left"] == 0 and b["tx"] == 0:
        b["phase"] += 1
        b["left"] = b["count"]
        b["done"].notify_all()


def mbarrier_init(smem, addr, count):
    if int(addr) % 8:
        raise ValueError(f"mbarrier at byte {addr}: must be 8-byte aligned")
    with _lock:
        _mbarriers[_mbar_key(smem, addr)] = {"count": int(count), "left": int(count),
                                             "phase": 0, "tx": 0,
                                             "done": threading.Condition(_lock)}


def mbarrier_arrive_expect_tx(smem, addr, tx_bytes):
    with _lock:
        b = _mbar(smem, addr)
        b["tx"] += int(tx_bytes)
        b["left"] -= 1
        _settle(b)


def setmaxnreg_inc(regs):
    pass


def setmaxnreg_dec(regs):
    pass


def mbarrier_arrive(smem, addr):
    with _lock:
        b = _mbar(smem, addr)
        b["left"] -= 1
        _settle(b)


def cp_async_mbarrier_arrive(smem, addr):
    """The copies land when the arrival is made (the hardware makes it once they have):
    every group of this thread's, the open one too."""
    groups = _groups("cp_async")
    groups.append([])
    _land(groups, 0)
    mbarrier_arrive(smem, addr)


def mbarrier_try_wait(smem, addr, parity):
    """Whether the phase of parity ``parity`` of the mbarrier at ``addr`` has completed; like
    the hardware's try_wait, a thread whose phase is pending is suspended a while first (until
    a phase of this mbarrier completes, or ``_TRY_WAIT_S``)."""
    parity = int(parity) & 1
    with _lock:
        b = _mbar(smem, addr)
        if (b["phase"] & 1) == parity:
            b["done"].wait(_TRY_WAIT_S)
        return np.uint32((b["phase"] & 1) != parity)


def _bulk_bytes(arr, idx, nbytes):
    raw = _raw(arr)
    start = int(idx) * raw.itemsize
    if nbytes % 16 or start % 16 or nbytes <= 0:
        raise ValueError(f"bulk copy of {nbytes} bytes at byte {start}: sizes and addresses "
                         "must be positive multiples of 16")
    flat = raw.view(np.uint8)
    if start + nbytes > flat.size:
        raise IndexError(f"bulk copy of {nbytes} bytes at byte {start} outside {flat.size}")
    return flat, slice(start, start + nbytes)


def bulk_store(gmem, gidx, smem, saddr, nbytes):
    # The source is read as late as the GPU may read it -- at the bulk_wait_read (or
    # bulk_wait) that covers the group -- so staging overwritten before that wait shows up as
    # wrong data here too; the destination is written at bulk_wait.
    src, ssl = _bulk_bytes(smem, int(saddr) // _raw(smem).itemsize, int(nbytes))
    dst, dsl = _bulk_bytes(gmem, gidx, int(nbytes))
    _groups("bulk")[-1].append([dst, dsl, None, src, ssl])


def bulk_commit():
    _groups("bulk").append([])


def _bulk_read(groups, pending):
    """Read the sources of the oldest closed groups, all but ``pending`` of them."""
    closed = groups[:-1]
    for group in closed[:max(len(closed) - pending, 0)]:
        for entry in group:                 # [dst, slice, data (None: unread), src, slice]
            if entry[2] is None:
                entry[2] = entry[3][entry[4]].copy()


def bulk_wait(pending):
    groups = _groups("bulk")
    _bulk_read(groups, pending)
    _land(groups, pending)


def bulk_wait_read(pending):
    _bulk_read(_groups("bulk"), pending)


def st_shared_u32(smem, saddr, value):
    raw = _raw(smem)
    raw.view(np.uint32)[(int(saddr) // 4)] = np.uint32(value)


def _f32_pair(smem, saddr, op):
    """(shared memory as float32, the index of the pair at byte ``saddr``: 8-byte aligned)."""
    saddr = int(saddr)
    if saddr % 8:
        raise ValueError(f"{op}: byte {saddr} is not 8-byte aligned")
    return _raw(smem).view(np.float32), saddr // 4


def st_shared_v2_f32(smem, saddr, v0, v1):
    f, i = _f32_pair(smem, saddr, "st_shared_v2_f32")
    f[i] = np.float32(v0)
    f[i + 1] = np.float32(v1)


def add_shared_v2_f32(smem, saddr, v0, v1):
    f, i = _f32_pair(smem, saddr, "add_shared_v2_f32")
    f[i] = f[i] + np.float32(v0)                 # float32 + float32: IEEE, subnormals kept
    f[i + 1] = f[i + 1] + np.float32(v1)


# ---- TMA (tensor-map box loads and stores) -----------------------------------------------------
#
# On the simulator a "tensor map" is a handle into this registry (``mok_core.tensor_map``
# registers the 2-D array and box); the load twin cuts the box out, zero-fills what lies outside
# the tensor and writes it with the 128-byte swizzle the real TMA unit uses; the store twin
# reads the swizzled box back and writes what lies inside the tensor.

_tensor_maps = {}
TMAP_MAGIC = 0x4D4F4B544D4150          # "MOKTMAP": element 0 of a simulator tensor map


def register_tensor_map(array2d, box_rows, box_cols):
    """Handle of a simulator tensor map over ``array2d`` (uint16 [rows, cols]: bf16 bits, or
    float32) and a [box_rows, box_cols] box."""
    with _lock:
        handle = len(_tensor_maps) + 1
        _tensor_maps[handle] = (array2d, int(box_rows), int(box_cols))
    return handle


def tensormap_acquire(tmaps, elem):
    pass


def fence_mbarrier_init():
    pass


def _tensor_map(tmaps, elem, op):
    """(array, box rows, box columns) of the simulator tensor map at ``tmaps[elem:]``."""
    raw_maps = _raw(tmaps)
    elem = int(elem)
    if elem % 16 or int(raw_maps[elem]) != TMAP_MAGIC:
        raise ValueError(f"{op}: no tensor map at element {elem}")
    arr, rows, cols = _tensor_maps[int(raw_maps[elem + 1])]
    arr = _raw(arr)
    if cols * arr.itemsize != 128:
        raise ValueError(f"{op} twin: only 128-byte box rows (the 128-byte swizzle)")
    return arr, rows, cols


def tma_load_2d(smem, saddr, tmaps, elem, x, y, bar):
    src, rows, cols = _tensor_map(tmaps, elem, "tma_load_2d")
    saddr, x, y = int(saddr), int(x), int(y)
    if saddr % 1024:
        raise ValueError(f"tma_load_2d: destination byte {saddr} is not 1024-byte aligned")
    box = np.zeros((rows, cols), src.dtype)
    r0, r1 = max(y, 0), min(y + rows, src.shape[0])
    c0, c1 = max(x, 0), min(x + cols, src.shape[1])
    if r0 < r1 and c0 < c1:
        box[r0 - y:r1 - y, c0 - x:c1 - x] = src[r0:r1, c0:c1]
    dst = _raw(smem).view(np.uint8)
    chunks = box.view(np.uint8).reshape(rows, 8, 16)
    for r in range(rows):
        base = saddr + r * 128
        order = np.arange(8) ^ (r % 8)                 # chunk c lands at chunk c ^ (r % 8)
        dst[base:base + 128].reshape(8, 16)[order] = chunks[r]
    with _lock:
        b = _mbar(smem, bar)
        b["tx"] -= rows * 128
        _settle(b)


def tma_store_2d(tmaps, elem, smem, saddr, x, y):
    # A bulk store (``bulk_store``'s groups): the box's in-bounds elements, un-swizzled, are
    # read from shared memory at the covering bulk_wait_read / bulk_wait and land at
    # bulk_wait.
    op = "tma_store_2d"
    dst, rows, cols = _tensor_map(tmaps, elem, op)
    saddr, x, y = int(saddr), int(x), int(y)
    if saddr % 1024:
        raise ValueError(f"{op}: source byte {saddr} is not 1024-byte aligned")
    if x < 0 or y < 0:                  # the H200 faults (illegal instruction) on these
        raise ValueError(f"{op}: box origin ({x}, {y}) before the tensor's start")
    size = dst.itemsize
    r = np.arange(rows)[:, None]
    c = np.arange(cols)[None, :]
    ok = (y + r < dst.shape[0]) & (x + c < dst.shape[1])          # (x, y >= 0: above)
    rr, cc = np.broadcast_to(r, ok.shape)[ok], np.broadcast_to(c, ok.shape)[ok]
    s_idx = _swizzle_addresses(saddr + rr * 128 + cc * size) // size   # (saddr 1024-aligned)
    g_idx = (y + rr) * dst.shape[1] + (x + cc)
    src = _raw(smem).reshape(-1).view(dst.dtype)
    _groups("bulk")[-1].append([dst.reshape(-1), g_idx, None, src, s_idx])


def trap():
    raise RuntimeError("trap: a bounded wait inside a kernel timed out")
