"""FP8 (e4m3) block quantization of bf16 tensors, as DeepSeek-V3's recipe scales them on Hopper.

    data, scales = quantize_fp8(x, block=(1, 128), scale="fp32", transpose=False)
    data, scales = quantize_expert_weights(w, scale="fp32", transpose=False)   # [E, R, C]

x [R, C] bf16 (uint16 bits) -> ``data`` uint8 e4m3 bytes in the *output layout* [R, C], or
[C, R] with ``transpose`` (the operand a GEMM wants with the other dimension contiguous: the
weight gradients' activations, K = tokens), and one scale per block of that layout:
``block=(1, 128)``: per output row and 128 columns (activations), scales [rows, cols / 128];
``(128, 128)``: per 128 x 128 block (weights), scales [rows / 128, cols / 128]. ``scale="fp32"``
stores the float32 scale; ``"ue8m0"`` rounds it up to a power of two and stores its biased
exponent byte (the MX convention). The rounding is exactly ``mok_core.quantize_reference``'s
(its docstring states it): s = amax / 448 (IEEE), q = e4m3(v / s) (IEEE quotient, then
``cvt.rn.satfinite``), so the GPU, the simulator and the reference agree to the bit.

Kernel contracts. ``quantize_rows_kernel`` -- ``block=(1, 128)`` without ``transpose``: the
activations, optionally gathered (``index``) -- streams: no shared memory, nothing staged, no
barrier. Its items are (output row, 128-column group) pairs, item i = row G + group with G =
C / 128, so item i's scale is scales[i] and its bytes are output words 32 i .. 32 i + 31.
Grid: ``_ROW_BLOCKS_PER_SM`` blocks per SM (fewer when the work is small), 256 threads = 8
warps; each warp walks the items by a grid stride, ``_ROW_ITEMS`` per pass, and issues a pass's
loads before it quantizes the previous pass (software pipelining: a streaming kernel runs at
the bytes it has in flight, and a warp that waited for its loads before every pass would idle
the memory system while it computes). A warp owns an item: lane l reads the 8 bytes of bf16
columns 4l .. 4l + 3 of the source row (two words in one load; 256 contiguous bytes per warp),
the item's amax is a warp reduction (``redux.sync`` on the bits: exact and order-free, so
deterministic), every lane forms the same scale, divides its four values by it and stores
their e4m3 bytes as one word; lane 0 stores the scale. The divisions are the IEEE quotients
without a divide instruction (``_fast_quotient``: the product with 1 / s corrected by an fma,
three instructions where a division takes a dozen; ``fdiv_rn`` for NaN/Inf and tiny scales).
The source row is the output row, or index[row] (< 0: no read, a zero row, scale 1). NaN/Inf
cost the data path one vote per pass; a warp that saw one reports each item's count once
(``warp_sum``) with the item's output row as its first row. An item's quantisation and report
are device functions (``quantize_row_item``, ``row_words_finite``, ``report_row_item``) that
``mok_core.swiglu_backward`` calls too: its warp step is such an item of [d_g | d_u], which
it quantises as it writes it.

``quantize_kernel`` -- (128, 128) blocks, not transposed (the weights): grid (C / 128,
ceil(R / 128), E), 256 threads = 8 warps; a block owns the 128 x 128 input tile at (row 128 by,
column 128 bx) of matrix bz (E matrices [R, C] back to back: the experts of a weight). It
stages the tile in shared memory as bf16 (rows past R read as zero), two bf16 loads per thread
per step (coalesced). A 128 x 128 block's amax is the maximum over the CTA (a warp reduction,
then one shared word per warp; max is exact and order-free, so deterministic). Then warp w
quantizes tile rows 16w .. 16w + 15, lane l taking elements 4l .. 4l + 3 and storing their
four e4m3 bytes as one word (128 contiguous bytes per warp and row); thread 0 stores the scale.

``quantize_cols_kernel`` -- transposed outputs, either block: the weight gradients' operands
(rows gathered through ``index``, zeros from ``num_rows`` to the end of its 128-row block, the
blocks past it not written) and the weights' transposed
copies (E matrices, each its own output [C, pitch] from column ``col_off`` on: how the two
halves of [W_gate; W_up]^T land in one array). Grid (C / 128, R / 128, E), 256 threads; a
block owns output columns (input rows) r0 .. r0 + 127 and output lines (input columns) c0 ..
c0 + 127. Thread t loads 16 bytes -- bf16 columns 8 (t % 16) .. + 7 -- of tile rows t / 16 +
16 i, i < 8, all eight loads issued before any is staged, into a 128 x 64-word shared tile
whose word w of row r sits at w XOR (r / 4) (``_tile_word``): the transposed reads then hit 32
banks. Then warp w takes lines 16w .. 16w + 15 two at a time (one tile word holds both), lane
l rows 4l .. 4l + 3: one e4m3 word of each line, stored at once (128 contiguous bytes per
warp and line). The kernel is bound by its instructions, so a staged word costs three: its
store, and its |bits| folded into the thread's four column maxima (``max_u16x2``, two
columns an instruction; NaN/Inf's |bits| >= 0x7F80 are above every finite value's, so the
maxima also say whether the thread saw one). Scales: a (1, 128) line's is formed once, by
thread t < 128 for line t from the 16 row groups' maxima (shared ``colmax``), and handed to
every warp with its reciprocal through shared memory (``line_s``, ``line_r``); a (128, 128)
block's from the CTA's (one shared word per warp), its reciprocal taken once. The quotients
are the rows kernel's (``_fast_quotient``). The rare path: a thread whose maxima show NaN/Inf
recounts its own staged words exactly (count, smallest row, finite max), a line holding one
takes its finite max from the staged column, and a block holding any (``syncthreads_or``)
divides every line by ``fdiv_rn``.

All three: NaN/Inf values are left out of a block's amax (a (1, 128) line's other values keep their
scale; a NaN quantises to the NaN byte, an Inf saturates to +-448) and are counted into the
error word (``record_non_finite``: count, smallest row) as tensor ``tensor``. No atomics on
the data path, nothing waits, no host sync. With the caller's ``out`` and ``scales`` a launch
allocates nothing (the scale argument a mode leaves unused is a view of one of them), so it
can be captured in a CUDA graph.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int32, int64, uint16, uint32, uint64

from . import errors as err
from .cuda_compat import (as_device_array, device_address, device_empty, flat_view, kjit, launch,
                          multiprocessor_count)
from .errors_record import record_non_finite
from .intrinsics import (f32_as_u32, fdiv_rn, ffma_rn, fmul_rn, ld_v4, max_u16x2, pack_e4m3x4,
                         u32_as_f32, warp_all, warp_min, warp_sum)
from .quantize_reference import E4M3_MAX

THREADS = 256
_ROW_ITEMS = 4        # items a warp of quantize_rows_kernel has in flight per pass
_ROW_BLOCKS_PER_SM = 8  # more than are resident at once (the grid stride does not need them
                        # resident): the fastest of 2 .. 8 per SM on an H200
_BF16_ABS = 0x7FFF
_BF16_INF = 0x7F80    # |bits| >= this: Inf or NaN
_FAST_SCALE = 2.0 ** -60   # scales from here up: _fast_quotient (see there) ...
_FAST_AMAX = 2.0 ** -50    # ... and amax from here up for the scale itself
_INV_E4M3_MAX = float(np.float32(1.0) / np.float32(E4M3_MAX))    # RN(1 / 448)


@kjit(device=True, inline="always")
def _bf16(word_bits):
    return u32_as_f32(uint32(word_bits) << 16)


@kjit(device=True, inline="always")
def _warp_max(v):
    """The warp's largest of float32 values >= 0: their bit patterns order as int32 do, so one
    ``redux.sync`` min of the negated bits (exact, order-free)."""
    return u32_as_f32(uint32(-warp_min(-int32(f32_as_u32(v)))))


@kjit(device=True, inline="always")
def _scale(amax, ue8m0):
    """(float32 divisor, stored float32 value, stored exponent byte) of a block's amax."""
    s = float32(1.0)
    if amax > float32(0.0):
        s = fdiv_rn(amax, float32(E4M3_MAX))
    return _stored_scale(s, ue8m0)


@kjit(device=True, inline="always")
def _stored_scale(s, ue8m0):
    """``_scale`` of the IEEE quotient s = amax / 448 (1 for amax = 0)."""
    if not ue8m0:
        return s, s, int32(0)
    bits = f32_as_u32(s)
    e = int32((bits >> 23) & 0xFF)
    if bits & 0x7FFFFF:
        e += 1                                   # round up: 2**(e - 127) >= s
    e = min(max(e, int32(1)), int32(254))
    p = u32_as_f32(uint32(e) << 23)
    return p, p, e


@kjit
def quantize_kernel(x, R, C, out32, scales_f32, scales_u8, ue8m0, errors, tensor, rank):
    """Launch: grid (C / 128, ceil(R / 128), E), THREADS threads (module docstring).

    x           uint16 [E*R*C]    bf16 bits, E row-major [R, C] matrices
    out32       uint32 [E*R*C/4]  e4m3 bytes [R, C] per matrix, four per word
    scales_f32  float32 [n]       float32 scales (``ue8m0`` False), else unused; per matrix
                                  [R / 128, C / 128]
    scales_u8   uint8 [n]         exponent bytes (``ue8m0``), else unused
    A NaN/Inf's row in the error word is the flat input row (matrix e's row r: e R + r).
    """
    tile = cuda.shared.array((128, 128), uint16)
    red = cuda.shared.array(8, float32)
    t = cuda.threadIdx.x
    lane = t % 32
    warp = t // 32
    r0 = cuda.blockIdx.y * 128
    c0 = cuda.blockIdx.x * 128
    mat = int64(cuda.blockIdx.z)
    x0 = mat * R * C                            # this matrix's first input element
    amax = float32(0.0)
    bad = int32(0)
    first = int32(0)
    for i in range(t, 128 * 64, THREADS):       # 128 rows x 64 words of two bf16
        r = i // 64
        w = i % 64
        lo = uint16(0)
        hi = uint16(0)
        if r0 + r < R:
            base = x0 + (r0 + r) * C + c0 + 2 * w
            lo = x[base]
            hi = x[base + 1]
        tile[r, 2 * w] = lo
        tile[r, 2 * w + 1] = hi
        for h in (lo, hi):
            v = abs(_bf16(h))
            if not math.isfinite(v):
                if bad == 0:
                    first = mat * R + r0 + r
                bad += 1
            else:
                amax = max(amax, v)
    if bad:
        record_non_finite(errors, tensor, rank, bad, first)
    amax = _warp_max(amax)
    if lane == 0:
        red[warp] = amax
    cuda.syncthreads()
    amax = red[0]
    for w in range(1, 8):
        amax = max(amax, red[w])
    n_blk = C // 128
    s, s_f32, s_u8 = _scale(amax, ue8m0)
    if t == 0:
        k = mat * (-(-R // 128)) * n_blk + (r0 // 128) * n_blk + c0 // 128
        if ue8m0:
            scales_u8[k] = s_u8
        else:
            scales_f32[k] = s_f32
    for j in range(16):
        line = warp * 16 + j
        if r0 + line >= R:
            break
        e = 4 * lane
        out32[(mat * R * C + (r0 + line) * C + c0) // 4 + lane] = pack_e4m3x4(
            fdiv_rn(_bf16(tile[line, e]), s), fdiv_rn(_bf16(tile[line, e + 1]), s),
            fdiv_rn(_bf16(tile[line, e + 2]), s), fdiv_rn(_bf16(tile[line, e + 3]), s))


@kjit(device=True, inline="always")
def _fast_quotient(v, s, r):
    """RN(v / s) in float32, as ``fdiv_rn``, for r = RN(1 / s), v finite and s >=
    ``_FAST_SCALE``, in three instructions instead of a division's dozen: q = RN(v r) is within
    an ulp of v / s, the remainder t = q s - v is exact under an fma, and RN(q - t r) is then
    RN(v / s) (Markstein's theorem); where v / s is too small for t to be exact, both round to
    an e4m3 zero of v's sign. t is q s - v, not v - q s, so that v = -0 gives -0."""
    q = fmul_rn(v, r)
    return ffma_rn(-ffma_rn(q, s, -v), r, q)


@kjit(device=True, inline="always")
def _row_scale(amax, ue8m0):
    """``_scale`` with amax / 448 as ``_fast_quotient`` (448 and 1 / 448 are constants) where
    the quotient is far from float32's subnormals, by division below."""
    s = float32(1.0)
    if amax >= float32(_FAST_AMAX):
        s = _fast_quotient(amax, float32(E4M3_MAX), float32(_INV_E4M3_MAX))
    elif amax > float32(0.0):
        s = fdiv_rn(amax, float32(E4M3_MAX))
    return _stored_scale(s, ue8m0)


@kjit(device=True, inline="always")
def _row_magic(groups):
    """M = 2**40 // groups + 1: (n M) >> 40 = n // groups exactly for an item n < 2**24 groups
    (``_launch_rows`` checks it: fewer than 2**24 rows): n M / 2**40 = n / groups + n e / 2**40
    with 0 < e <= 1, n / 2**40 < 1 / groups keeps that under the next multiple, and n M <
    2**64 does not wrap."""
    return (uint64(1) << uint64(40)) // uint64(groups) + uint64(1)


@kjit(device=True, inline="always")
def _row_load(x64, index, gather, item, items, groups, magic, lane):
    """Lane ``lane``'s 8 bytes (bf16 columns 4 lane .. 4 lane + 3) of item ``item`` as two
    words; zeros past the items or for a padding row (index < 0), which are never read.
    Unsigned indices: numba wraps signed ones around (an add and a select per access)."""
    w = uint64(0)
    if item < items:
        k = item * 32 + lane                     # the row's own: no division
        read = True
        if gather:
            # item // groups by a multiply (``_row_magic``): the division was a third of the
            # gathering kernel's instructions
            row = int64((uint64(item) * magic) >> uint64(40))
            src = int64(index[uint64(row)])
            k += (src - row) * (groups * 32)
            read = src >= 0
        if read:
            w = x64[uint64(k)]
    return uint32(w), uint32(w >> uint64(32))


@kjit(device=True, inline="always")
def _umax(x, y):
    return x if x > y else y


@kjit(device=True, inline="always")
def _halves(a, b):
    """A lane's four |bf16| bit patterns, uint32 (numba widens integer arithmetic to 64 bits;
    the casts keep it 32)."""
    m = uint32(_BF16_ABS)
    return (uint32(a & m), uint32(uint32(a >> uint32(16)) & m), uint32(b & m),
            uint32(uint32(b >> uint32(16)) & m))


@kjit(device=True, inline="always")
def _non_finite(a, b):
    """How many of a lane's four bf16 values are NaN/Inf."""
    h0, h1, h2, h3 = _halves(a, b)
    inf = uint32(_BF16_INF)
    return int32(h0 >= inf) + int32(h1 >= inf) + int32(h2 >= inf) + int32(h3 >= inf)


@kjit(device=True, inline="always")
def _lane_bits_max(a, b):
    """The largest |bf16| bit pattern of a lane's four values (>= _BF16_INF: one is NaN/Inf)."""
    h0, h1, h2, h3 = _halves(a, b)
    return _umax(_umax(h0, h1), _umax(h2, h3))


@kjit(device=True, inline="always")
def _finite_max(h0, h1, h2, h3):
    """The largest finite of four |bf16| bit patterns, 0 if none."""
    inf = uint32(_BF16_INF)
    zero = uint32(0)
    return _umax(_umax(h0 if h0 < inf else zero, h1 if h1 < inf else zero),
                 _umax(h2 if h2 < inf else zero, h3 if h3 < inf else zero))


@kjit(device=True, inline="always")
def _quantize4(a0, a1, a2, a3, s, r, fast):
    """Four values -> their e4m3 bytes in one word: with ``fast`` (the values finite, s >=
    ``_FAST_SCALE``) by ``_fast_quotient`` with r = RN(1 / s); else -- NaN/Inf (an Inf's
    remainder would be NaN) and tiny scales (inexact remainders) -- by division."""
    if fast:
        return pack_e4m3x4(_fast_quotient(a0, s, r), _fast_quotient(a1, s, r),
                           _fast_quotient(a2, s, r), _fast_quotient(a3, s, r))
    return pack_e4m3x4(fdiv_rn(a0, s), fdiv_rn(a1, s), fdiv_rn(a2, s), fdiv_rn(a3, s))


@kjit(device=True, inline="always")
def _lane_max(a, b):
    """(the largest finite |bf16| bit pattern of a lane's four values, 0 if none; whether all
    four are finite). |bf16| bit patterns order as the values do."""
    m = _lane_bits_max(a, b)
    finite = m < uint32(_BF16_INF)
    if not finite:                               # the rare path: leave NaN/Inf out
        h0, h1, h2, h3 = _halves(a, b)
        m = _finite_max(h0, h1, h2, h3)
    return m, finite


@kjit(device=True, inline="always")
def quantize_row_item(a, b, item, out32, scales_f32, scales_u8, ue8m0, lane):
    """Quantize item ``item`` -- 1 x 128: lane l's two words ``a``, ``b`` are its bf16
    columns 4l .. 4l + 3 -- and store its 32 e4m3 words (out32[32 item + l]) and its scale
    (scales[item], lane 0). The whole warp calls it: ``quantize_rows_kernel``'s items, and
    ``mok_core.swiglu_backward``'s fused quantisation of the words it just packed."""
    m, finite = _lane_max(a, b)
    s, s_f32, s_u8 = _row_scale(_warp_max(u32_as_f32(uint32(m << uint32(16)))), ue8m0)
    if lane == 0:
        if ue8m0:
            scales_u8[uint64(item)] = s_u8
        else:
            scales_f32[uint64(item)] = s_f32
    # a lane divides by s with the fma-corrected product (module docstring)
    hi = uint32(0xFFFF0000)
    out32[uint64(item * 32 + lane)] = _quantize4(
        u32_as_f32(uint32(a << uint32(16))), u32_as_f32(uint32(a & hi)),
        u32_as_f32(uint32(b << uint32(16))), u32_as_f32(uint32(b & hi)), s,
        fdiv_rn(float32(1.0), s), finite and s >= float32(_FAST_SCALE))


@kjit(device=True, inline="always")
def _row_store(a, b, item, items, out32, scales_f32, scales_u8, ue8m0, lane):
    """Quantize item ``item`` from every lane's two words (the whole warp calls it)."""
    if item < items:
        quantize_row_item(a, b, item, out32, scales_f32, scales_u8, ue8m0, lane)


@kjit(device=True, inline="always")
def row_words_finite(a, b):
    """Whether a lane's four bf16 values (two words) are all finite: the vote's operand that
    gates ``report_row_item`` (NaN/Inf are the rare path)."""
    return _lane_bits_max(a, b) < uint32(_BF16_INF)


@kjit(device=True, inline="always")
def report_row_item(a, b, item, groups, errors, tensor, rank, lane):
    """Item ``item``'s NaN/Inf (``groups`` items a row), once per warp: counted into the
    error word with the item's row as its first row (the whole warp calls it)."""
    n = warp_sum(_non_finite(a, b))
    if n != 0 and lane == 0:
        record_non_finite(errors, tensor, rank, n, int32(item // groups))


@kjit(device=True, inline="always")
def row_pass(a0, b0, a1, b1, a2, b2, a3, b3, i, warps, items, groups, out32, scales_f32,
             scales_u8, ue8m0, errors, tensor, rank, lane):
    """One pass of ``quantize_rows_kernel`` (the whole warp calls it): items i + j warps,
    j < 4, quantized from their loaded words (a_j, b_j) and stored; their NaN/Inf reported
    (the rare path: one vote a pass)."""
    _row_store(a0, b0, i, items, out32, scales_f32, scales_u8, ue8m0, lane)
    _row_store(a1, b1, i + warps, items, out32, scales_f32, scales_u8, ue8m0, lane)
    _row_store(a2, b2, i + 2 * warps, items, out32, scales_f32, scales_u8, ue8m0, lane)
    _row_store(a3, b3, i + 3 * warps, items, out32, scales_f32, scales_u8, ue8m0, lane)
    m = _umax(_umax(_lane_bits_max(a0, b0), _lane_bits_max(a1, b1)),
              _umax(_lane_bits_max(a2, b2), _lane_bits_max(a3, b3)))
    if not warp_all(m < uint32(_BF16_INF)):
        report_row_item(a0, b0, i, groups, errors, tensor, rank, lane)
        report_row_item(a1, b1, i + warps, groups, errors, tensor, rank, lane)
        report_row_item(a2, b2, i + 2 * warps, groups, errors, tensor, rank, lane)
        report_row_item(a3, b3, i + 3 * warps, groups, errors, tensor, rank, lane)


@kjit
def quantize_rows_kernel(x64, index, gather, items, groups, row_cap, capped, out32, scales_f32,
                         scales_u8, ue8m0, errors, tensor, rank):
    """Launch: any grid of THREADS-thread blocks (module docstring; ``quantize_fp8`` picks a few
    per SM). Items: (output row, 128-column group), item = row * groups + group.

    x64         uint64 [R*C/4]    bf16 quads, row-major (C = 128 groups)
    index       int32 [rows]      the source row of each output row (``gather``; < 0: a zero
                                  row), else unused
    items       rows * groups     output rows times groups
    row_cap     int32 [1]         with ``capped``: only output rows < row_cap[0] are written
                                  (the rows a schedule filled this step), else unused
    out32       uint32 [items*32] e4m3 bytes [rows, C], four per word
    scales_f32  float32 [items]   float32 scales (``ue8m0`` False), else unused
    scales_u8   uint8 [items]     exponent bytes (``ue8m0``), else unused
    """
    lane = int64(cuda.threadIdx.x % 32)
    magic = _row_magic(groups)
    if capped:
        items = min(items, max(int64(row_cap[0]), int64(0)) * groups)
    warps = int64(cuda.gridDim.x) * (THREADS // 32)
    i = int64(cuda.blockIdx.x) * (THREADS // 32) + cuda.threadIdx.x // 32
    # a pass's loads are issued before the previous pass is quantized, so a warp always has
    # _ROW_ITEMS x 256 bytes in flight while it computes (a streaming kernel runs at the bytes
    # in flight)
    a0, b0 = _row_load(x64, index, gather, i, items, groups, magic, lane)
    a1, b1 = _row_load(x64, index, gather, i + warps, items, groups, magic, lane)
    a2, b2 = _row_load(x64, index, gather, i + 2 * warps, items, groups, magic, lane)
    a3, b3 = _row_load(x64, index, gather, i + 3 * warps, items, groups, magic, lane)
    while i < items:
        n = i + _ROW_ITEMS * warps
        c0, d0 = _row_load(x64, index, gather, n, items, groups, magic, lane)
        c1, d1 = _row_load(x64, index, gather, n + warps, items, groups, magic, lane)
        c2, d2 = _row_load(x64, index, gather, n + 2 * warps, items, groups, magic, lane)
        c3, d3 = _row_load(x64, index, gather, n + 3 * warps, items, groups, magic, lane)
        row_pass(a0, b0, a1, b1, a2, b2, a3, b3, i, warps, items, groups, out32, scales_f32,
                 scales_u8, ue8m0, errors, tensor, rank, lane)
        a0, b0, a1, b1, a2, b2, a3, b3 = c0, d0, c1, d1, c2, d2, c3, d3
        i = n


@kjit(device=True, inline="always")
def _col_chunk(x32, index, gather, cap, x0, r, src_col, words):
    """16 bytes of output column (sorted row) ``r``'s source row -- itself, or index[r] with
    ``gather`` -- at its word ``src_col`` (``words`` a row), as 4 uint32; zeros for r at or past
    ``cap`` or a padding row (index < 0), which are never read."""
    src = int64(r)
    if gather:
        src = int64(index[uint64(r)])
    z = uint32(0)
    if r < cap and src >= 0:
        return ld_v4(x32, uint64(x0 + src * words + src_col))
    return z, z, z, z


@kjit(device=True, inline="always")
def _tile_word(r, w):
    """The shared word of tile row r's word w (64 words a row): w XOR r / 4, so that the
    transposed reads -- lane l reading rows 4l .. 4l + 3 at one word -- hit 32 banks.
    Unsigned, as every shared index here: numba wraps signed ones around (a compare and a
    select per access)."""
    return uint64(r * 64 + (w ^ ((r >> 2) & 31)))


@kjit(device=True, inline="always")
def _stage_chunk(tile, r, q, v0, v1, v2, v3, m0, m1, m2, m3):
    """A loaded chunk into the tile (words 4q .. 4q + 3 of row r), each word's |bf16| bits
    folded into the thread's column maxima m_k (``max_u16x2``: two columns a word, NaN/Inf
    included -- their |bits| are >= 0x7F80, above every finite value's). Three instructions
    a word: this kernel is bound by its instructions, and NaN/Inf are the rare path
    (``_stage_recount``, ``_line_bits``)."""
    a = uint32(0x7FFF7FFF)
    tile[_tile_word(r, 4 * q)] = v0
    tile[_tile_word(r, 4 * q + 1)] = v1
    tile[_tile_word(r, 4 * q + 2)] = v2
    tile[_tile_word(r, 4 * q + 3)] = v3
    return (max_u16x2(m0, v0 & a), max_u16x2(m1, v1 & a), max_u16x2(m2, v2 & a),
            max_u16x2(m3, v3 & a))


@kjit(device=True, inline="always")
def _line_bits(colmax, tile, t):
    """The largest finite |bf16| bit pattern of tile column t (output line t; 0 if none): from
    the 16 row groups' column maxima, or -- the rare path, a NaN/Inf among them -- from the
    staged column itself."""
    w = t >> 1
    sh = uint32(16 * (t & 1))
    lo = uint32(0xFFFF)
    m = uint32(0)
    for g in range(16):
        m = _umax(m, uint32((colmax[uint64(g * 64 + w)] >> sh) & lo))
    inf = uint32(_BF16_INF)
    if m >= inf:
        m = uint32(0)
        for r in range(128):
            h = uint32((tile[_tile_word(r, w)] >> sh) & uint32(_BF16_ABS))
            if h < inf:
                m = _umax(m, h)
    return m


@kjit(device=True, inline="always")
def _stage_recount(tile, rb, q, row_id):
    """The rare path of a thread whose chunks held NaN/Inf: from its own staged words (rows rb
    + 16 i, words 4q ..), (the largest finite |bf16| bit pattern, how many NaN/Inf, the
    smallest ``row_id`` + row among them)."""
    inf = uint32(_BF16_INF)
    m = uint32(0)
    bad = int32(0)
    first = int64(0)
    for i in range(8):
        for k in range(4):
            v = tile[_tile_word(rb + 16 * i, 4 * q + k)]
            for h in (uint32(v & uint32(_BF16_ABS)),
                      uint32((v >> uint32(16)) & uint32(_BF16_ABS))):
                if h >= inf:
                    if bad == 0:
                        first = row_id + rb + 16 * i
                    bad += 1
                else:
                    m = _umax(m, h)
    return m, bad, first


@kjit
def quantize_cols_kernel(x32, index, gather, row_cap, capped, R_in, R, C, out32, scales_f32,
                         scales_u8, ue8m0, whole_block, pitch, col_off, errors, tensor, rank):
    """Launch: grid (C / 128, R / 128, E), THREADS threads (module docstring).

    x32         uint32 [E*R_in*C/2]  bf16 pairs, E row-major [R_in, C] matrices (16-byte
                                     aligned)
    index       int32 [R]         the source row of output column r (``gather``, E = 1; < 0:
                                  zeros), else unused (R_in = R)
    row_cap     int32 [1]         with ``capped``: output columns r >= row_cap[0] quantise
                                  zeros (nothing read) -- a block whose columns all are
                                  writes nothing --, else unused
    out32       uint32 [E*C*pitch/4]  e4m3 bytes, per matrix C lines of ``pitch`` bytes, its
                                  columns from ``col_off`` on
    scales_f32 / scales_u8        as ``quantize_kernel``'s (transposed: lines are columns)
    A NaN/Inf's row in the error word is the output column (gather) or the flat input row.
    """
    tile = cuda.shared.array(8192, uint32)      # 128 rows x 64 words, swizzled (_tile_word)
    colmax = cuda.shared.array(1024, uint32)    # [16 row groups][64 words]: column maxima
    line_s = cuda.shared.array(128, float32)    # (1, 128): each line's scale ...
    line_r = cuda.shared.array(128, float32)    # ... and its reciprocal
    red = cuda.shared.array(8, float32)
    t = cuda.threadIdx.x
    lane = t % 32
    warp = t // 32
    r0 = int64(cuda.blockIdx.y) * 128
    c0 = int64(cuda.blockIdx.x) * 128
    mat = int64(cuda.blockIdx.z)
    words = C // 2
    x0 = mat * R_in * words
    cap = int64(row_cap[0]) if capped else R
    if r0 >= cap:                               # (block-uniform) nothing here is read
        return
    q = t % 16                                  # the thread's 16-byte chunk of a row ...
    rb = t // 16                                # ... of rows rb + 16 i
    col = c0 // 2 + 4 * q
    row_id = r0 if gather else mat * R + r0     # the error word's row of tile row 0
    # eight chunks in flight before any is staged (a streaming kernel runs at its bytes in
    # flight; a load after a shared store could not be moved above it)
    a0, a1, a2, a3 = _col_chunk(x32, index, gather, cap, x0, r0 + rb, col, words)
    b0, b1, b2, b3 = _col_chunk(x32, index, gather, cap, x0, r0 + rb + 16, col, words)
    c0_, c1, c2, c3 = _col_chunk(x32, index, gather, cap, x0, r0 + rb + 32, col, words)
    d0, d1, d2, d3 = _col_chunk(x32, index, gather, cap, x0, r0 + rb + 48, col, words)
    e0, e1, e2, e3 = _col_chunk(x32, index, gather, cap, x0, r0 + rb + 64, col, words)
    f0, f1, f2, f3 = _col_chunk(x32, index, gather, cap, x0, r0 + rb + 80, col, words)
    g0, g1, g2, g3 = _col_chunk(x32, index, gather, cap, x0, r0 + rb + 96, col, words)
    h0, h1, h2, h3 = _col_chunk(x32, index, gather, cap, x0, r0 + rb + 112, col, words)
    z = uint32(0)
    m0, m1, m2, m3 = _stage_chunk(tile, rb, q, a0, a1, a2, a3, z, z, z, z)
    m0, m1, m2, m3 = _stage_chunk(tile, rb + 16, q, b0, b1, b2, b3, m0, m1, m2, m3)
    m0, m1, m2, m3 = _stage_chunk(tile, rb + 32, q, c0_, c1, c2, c3, m0, m1, m2, m3)
    m0, m1, m2, m3 = _stage_chunk(tile, rb + 48, q, d0, d1, d2, d3, m0, m1, m2, m3)
    m0, m1, m2, m3 = _stage_chunk(tile, rb + 64, q, e0, e1, e2, e3, m0, m1, m2, m3)
    m0, m1, m2, m3 = _stage_chunk(tile, rb + 80, q, f0, f1, f2, f3, m0, m1, m2, m3)
    m0, m1, m2, m3 = _stage_chunk(tile, rb + 96, q, g0, g1, g2, g3, m0, m1, m2, m3)
    m0, m1, m2, m3 = _stage_chunk(tile, rb + 112, q, h0, h1, h2, h3, m0, m1, m2, m3)
    if not whole_block:
        cm = uint64(rb * 64 + 4 * q)
        colmax[cm] = m0
        colmax[cm + uint64(1)] = m1
        colmax[cm + uint64(2)] = m2
        colmax[cm + uint64(3)] = m3
    mm = max_u16x2(max_u16x2(m0, m1), max_u16x2(m2, m3))
    m = _umax(uint32(mm & uint32(0xFFFF)), uint32(mm >> uint32(16)))
    dirty = m >= uint32(_BF16_INF)
    bad = int32(0)
    first = int64(0)
    if dirty:                                   # NaN/Inf: the exact count and finite max
        m, bad, first = _stage_recount(tile, rb, q, row_id)
    # one vote; a warp that saw NaN/Inf reports its count and smallest row once
    if not warp_all(bad == 0):
        n = warp_sum(bad)
        low = warp_min(int32(first) if bad else int32(err.INT32_MAX))
        if lane == 0:
            record_non_finite(errors, tensor, rank, n, low)
    if whole_block:
        amax = _warp_max(u32_as_f32(uint32(m << uint32(16))))
        if lane == 0:
            red[warp] = amax
    # the tile staged; whether any value of the block is NaN/Inf (then every line divides)
    clean = cuda.syncthreads_or(int32(dirty)) == 0
    n_blk = pitch // 128                        # scales per output line (or block row)
    col0 = col_off + r0                         # the tile's first output column
    o0 = mat * C * pitch
    s0 = mat * (C // 128 if whole_block else C) * n_blk
    s = float32(1.0)
    rcp = float32(1.0)
    if whole_block:
        amax = red[0]
        for w in range(1, 8):
            amax = max(amax, red[w])
        s, s_f32, s_u8 = _row_scale(amax, ue8m0)
        rcp = fdiv_rn(float32(1.0), s)
        if t == 0:
            k = s0 + (c0 // 128) * n_blk + col0 // 128
            if ue8m0:
                scales_u8[k] = s_u8
            else:
                scales_f32[k] = s_f32
    else:
        # (1, 128): thread t < 128 forms line t's scale once, for every warp that stores it
        if t < 128:
            mx = _line_bits(colmax, tile, t)
            ls, ls_f32, ls_u8 = _row_scale(u32_as_f32(uint32(mx << uint32(16))), ue8m0)
            line_s[uint64(t)] = ls
            line_r[uint64(t)] = fdiv_rn(float32(1.0), ls)
            k = s0 + (c0 + t) * n_blk + col0 // 128
            if ue8m0:
                scales_u8[k] = ls_u8
            else:
                scales_f32[k] = ls_f32
        cuda.syncthreads()
    # warp w: output lines (input columns) 16 w .. 16 w + 15, two a step (one tile word);
    # lane l: rows 4 l .. 4 l + 3 -- one output word of each line, at out32[o] (o steps a
    # line: pitch is a multiple of 128 bytes, so every term is whole words and no signed
    # division is left in the loop)
    pw = pitch // 4
    o = (o0 + col0) // 4 + (c0 + 16 * warp) * pw + lane
    tb = 256 * lane                             # tile rows 4 l ..: _tile_word's swizzle is l
    lo = uint32(0xFFFF)
    for p in range(8):
        sw = uint64(tb + ((8 * warp + p) ^ lane))
        w0 = tile[sw]
        w1 = tile[sw + uint64(64)]
        w2 = tile[sw + uint64(128)]
        w3 = tile[sw + uint64(192)]
        for half in range(2):                   # line 2 wc (low halves), then 2 wc + 1
            sh = uint32(16 * half)
            if not whole_block:
                s = line_s[uint64(16 * warp + 2 * p + half)]
                rcp = line_r[uint64(16 * warp + 2 * p + half)]
            out32[uint64(o)] = _quantize4(
                _bf16((w0 >> sh) & lo), _bf16((w1 >> sh) & lo), _bf16((w2 >> sh) & lo),
                _bf16((w3 >> sh) & lo), s, rcp, clean and s >= float32(_FAST_SCALE))
            o += pw


def quantize_fp8(x, block=(1, 128), scale: str = "fp32", transpose: bool = False, *, out=None,
                 scales=None, stream=0, errors=None, tensor: int = err.NF_X, rank: int = 0,
                 index=None, num_rows=None):
    """x uint16 (bf16 bits) [R, C] -> (data uint8 [R, C] or [C, R], scales) (module
    docstring); ``out`` / ``scales`` are the caller's buffers or allocated here. C must be a
    multiple of 128, and R too unless ``block=(1, 128)`` without ``transpose``. ``errors``
    (int32 [ERROR_WORDS]) gets NaN/Inf counted as tensor ``tensor`` seen on ``rank``.

    ``index`` (int32 [R_out]; ``block=(1, 128)`` without ``transpose``, or ``transpose``):
    gather on the way -- output row r (transposed: output column r) is x row index[r] (rows
    may repeat; index[r] < R is the caller's to keep: the device does not check it), and
    index[r] < 0 gives zeros without a read (a zero row: scale 1.0, exponent byte 127 with
    ``"ue8m0"``: what an all-zero line quantises to). data is then [R_out, C] (transposed:
    [C, R_out], R_out a multiple of 128), for any R_out; a NaN/Inf's row in the error word is
    the output row (column). Tokens go into expert-sorted order (padding rows -1) this way in
    one pass. ``num_rows`` (int32 [1] on the device, the same cases): rows at or past
    num_rows[0] -- past the rows a schedule filled this step -- are not written (rows
    kernel: they keep what they held; transposed: the 128-column blocks entirely past it)
    or quantised as zeros (transposed, the rest of the block holding num_rows[0]: nothing
    read; the weight gradient's last slice reads them)."""
    from .gemm import _check_errors, _error_word
    x = as_device_array(x, "x", dtype=np.uint16, ndim=2)
    R, C = x.shape
    block = tuple(block)
    if block not in ((1, 128), (128, 128)):
        raise ValueError(f"block={block}: must be (1, 128) or (128, 128)")
    if scale not in ("fp32", "ue8m0"):
        raise ValueError(f"scale={scale!r}: must be 'fp32' or 'ue8m0'")
    rows_path = block == (1, 128) and not transpose
    R_out = R
    for name, v in (("index", index), ("num_rows", num_rows)):
        if v is not None and not (rows_path or transpose):
            raise ValueError(f"{name}: only with block=(1, 128) or transpose (got "
                             f"block={block}, transpose={bool(transpose)})")
    if index is not None:
        index = as_device_array(index, "index", dtype=np.int32, ndim=1)
        R_out = index.shape[0]
    if num_rows is not None:
        num_rows = as_device_array(num_rows, "num_rows", dtype=np.int32, shape=(1,))
    if C % 128 or ((transpose or block[0] == 128) and R_out % 128):
        what = "index's rows" if index is not None else "rows"
        raise ValueError(f"x: shape [{R}, {C}] -- columns must be a multiple of 128, and {what} "
                         f"({R_out}) too for (128, 128) blocks or a transposed output")
    rows, cols = (C, R_out) if transpose else (R_out, C)
    n_scales = (rows // block[0], cols // 128)
    dtype = np.float32 if scale == "fp32" else np.uint8
    out = device_empty((rows, cols), np.uint8, stream) if out is None else \
        as_device_array(out, "out", dtype=np.uint8, shape=(rows, cols))
    scales = device_empty(n_scales, dtype, stream) if scales is None else \
        as_device_array(scales, "scales", dtype=dtype, shape=n_scales)
    errors, tensor = _check_errors(errors, tensor)
    if not (rows and cols):
        return out, scales
    ue8m0 = scale == "ue8m0"
    word = _error_word(errors)
    out32, scales_f32, scales_u8 = _kernel_views(out, scales, ue8m0)
    if rows_path:
        if device_address(x) % 8:
            raise ValueError("x: the row kernel reads 8-byte words: x must start 8-byte aligned")
        _launch_rows(x, index, num_rows, out32, scales_f32, scales_u8, ue8m0, rows, C, stream,
                     word, tensor, rank)
    elif transpose:
        _launch_cols(x, 1, R, R_out, C, index, num_rows, out32, scales_f32, scales_u8, ue8m0,
                     block[0] == 128, cols, 0, stream, word, tensor, rank)
    else:
        _launch_blocks(x, 1, R, C, out32, scales_f32, scales_u8, ue8m0, stream, word, tensor,
                       rank)
    return out, scales


def _kernel_views(out, scales, ue8m0):
    """(out32, scales_f32, scales_u8): the flat views the kernels take. They take both scale
    types; the unused one is a view of memory at hand, never written (an allocation here
    would break CUDA-graph capture)."""
    return (flat_view(out, np.uint32),
            flat_view(out, np.float32) if ue8m0 else flat_view(scales),
            flat_view(scales) if ue8m0 else flat_view(scales, np.uint8))


def _launch_blocks(x, E, R, C, out32, scales_f32, scales_u8, ue8m0, stream, word, tensor,
                   rank):
    """``quantize_kernel`` over E [R, C] matrices, (128, 128) blocks (its docstring)."""
    launch(quantize_kernel, (C // 128, -(-R // 128), E), THREADS, stream, 0,
           flat_view(x), np.int64(R), np.int64(C), out32, scales_f32, scales_u8, ue8m0, word,
           np.int32(tensor), np.int32(rank))


def _launch_cols(x, E, R_in, R, C, index, num_rows, out32, scales_f32, scales_u8, ue8m0,
                 whole_block, pitch, col_off, stream, word, tensor, rank):
    """``quantize_cols_kernel`` over E [R_in, C] matrices, transposed (its docstring)."""
    if device_address(x) % 16:
        raise ValueError("x: the transposing kernel reads 16-byte chunks: x must start 16-byte "
                         "aligned")
    launch(quantize_cols_kernel, (C // 128, R // 128, E), THREADS, stream, 0,
           flat_view(x, np.uint32), word if index is None else index, index is not None,
           word if num_rows is None else num_rows, num_rows is not None, np.int64(R_in),
           np.int64(R), np.int64(C), out32, scales_f32, scales_u8, ue8m0, bool(whole_block),
           np.int64(pitch), np.int64(col_off), word, np.int32(tensor), np.int32(rank))


def _launch_rows(x, index, num_rows, out32, scales_f32, scales_u8, ue8m0, rows, C, stream,
                 word, tensor, rank):
    groups = C // 128
    items = rows * groups
    if rows >= 1 << 24:
        raise ValueError(f"x: {rows} output rows -- the row kernel's index arithmetic "
                         "(``_row_magic``) needs fewer than 2**24")
    grid = min(multiprocessor_count() * _ROW_BLOCKS_PER_SM,
               -(-items // (THREADS // 32 * _ROW_ITEMS)))
    launch(quantize_rows_kernel, grid, THREADS, stream, 0,
           flat_view(x, np.uint64), word if index is None else index, index is not None,
           np.int64(items), np.int64(groups), word if num_rows is None else num_rows,
           num_rows is not None, out32, scales_f32, scales_u8, ue8m0, word, np.int32(tensor),
           np.int32(rank))


def launch_quantize_rows(x, out, scales, *, index=None, num_rows=None, stream=0, errors,
                         tensor: int = err.NF_X, rank: int = 0):
    """``quantize_fp8(x, (1, 128), out=out, scales=scales, index=index, num_rows=num_rows)``
    with float32 scales, on trusted device views (the layer's buffers: no checks, nothing
    allocated, no host work beyond the launch). ``errors``: the error word (int32
    [ERROR_WORDS])."""
    rows, C = out.shape
    if rows and C:
        _launch_rows(x, index, num_rows, flat_view(out, np.uint32), flat_view(scales),
                     flat_view(scales, np.uint8), False, rows, C, stream, errors, tensor, rank)


def launch_quantize_cols(x, out, scales, *, whole_block, index=None, num_rows=None, stream=0,
                         errors, tensor: int = err.NF_X, rank: int = 0):
    """``quantize_fp8(x, (128, 128) if whole_block else (1, 128), transpose=True, out=out,
    scales=scales, index=index, num_rows=num_rows)`` with float32 scales, on trusted device
    views (``launch_quantize_rows``' terms): out [C, R_out], x [R_in, C]."""
    C, R = out.shape
    if R and C:
        _launch_cols(x, 1, x.shape[0], R, C, index, num_rows, flat_view(out, np.uint32),
                     flat_view(scales), flat_view(scales, np.uint8), False, whole_block, R, 0,
                     stream, errors, tensor, rank)


@kjit(device=True, inline="always")
def _e4m3_value(b):
    """An e4m3 byte's value as float32, exactly (0x7F / 0xFF: NaN)."""
    e = (b >> 3) & 0xF
    m = float32(b & 7)
    v = m * float32(2.0 ** -9)
    if e:
        v = (float32(8.0) + m) * u32_as_f32(uint32(e + 117) << 23)   # (8 + m) 2**(e - 10)
    if (b & 0x7F) == 0x7F:
        v = u32_as_f32(uint32(0x7FC00000))
    return -v if b & 0x80 else v


@kjit
def dequantize_mx_kernel(data32, scales, cols, out32):
    """Launch: any grid. data32 uint32 [R*C/4] e4m3 bytes, scales uint8 [R*C/32] (one E8M0
    exponent per 32 consecutive values of a row), out32 uint32 [R*C/2]: bf16 pairs, exact
    (a value has 4 significant bits, bf16 keeps 8) down to bf16's normal range."""
    i = cuda.grid(1)
    while i < data32.shape[0]:
        w = data32[i]
        e = uint32(scales[(4 * i) // 32])
        s = u32_as_f32(e << 23)
        if e == 0:
            s = u32_as_f32(uint32(0x00400000))           # 2**-127 (subnormal in float32)
        elif e == 255:
            s = u32_as_f32(uint32(0x7FC00000))           # E8M0's NaN
        v0 = _e4m3_value(w & 0xFF) * s
        v1 = _e4m3_value((w >> 8) & 0xFF) * s
        v2 = _e4m3_value((w >> 16) & 0xFF) * s
        v3 = _e4m3_value(w >> 24) * s
        out32[2 * i] = (f32_as_u32(v1) & 0xFFFF0000) | (f32_as_u32(v0) >> 16)
        out32[2 * i + 1] = (f32_as_u32(v3) & 0xFFFF0000) | (f32_as_u32(v2) >> 16)
        i += cuda.gridsize(1)


def mxfp8_to_blockwise(data, scales, block=(128, 128), scale: str = "fp32", *,
                       transpose: bool = False, stream=0):
    """MXFP8 (e4m3 ``data`` [R, C] with an E8M0 exponent byte per 32 consecutive values of a
    row, ``scales`` uint8 [R, C / 32] -- Blackwell's format) -> ``quantize_fp8``'s layout, once
    (e.g. at checkpoint load). Through bf16, which holds every MX value exactly, then
    ``quantize_fp8``. With ``scale="ue8m0"`` the values are kept exactly where a block's
    32-groups share one exponent (the new power-of-two scale only shifts them); otherwise, and
    with float32 scales, each value moves by at most half an e4m3 step of its new block scale
    (groups with smaller exponents lose low bits)."""
    data = as_device_array(data, "data", dtype=np.uint8, ndim=2)
    R, C = data.shape
    if C % 128:
        raise ValueError(f"data: {C} columns, must be a multiple of 128")
    scales = as_device_array(scales, "scales", dtype=np.uint8, shape=(R, C // 32))
    bf16 = device_empty((R, C), np.uint16, stream)
    if R:
        launch(dequantize_mx_kernel, min(1024, -(-R * C // 4 // THREADS)), THREADS, stream, 0,
               flat_view(data, np.uint32), scales.reshape(scales.size), np.int64(C),
               flat_view(bf16, np.uint32))
    return quantize_fp8(bf16, block, scale, transpose, stream=stream)


def quantize_expert_weights(w, scale: str = "fp32", transpose: bool = False, *, out=None,
                            scales=None, column: int = 0, stream=0, errors=None,
                            tensor: int = err.NF_X, rank: int = 0):
    """Expert weights bf16 (uint16 bits) [E, R, C] -> e4m3 [E, R, C] (``transpose``: each
    expert's transpose, [E, C, R]) with one scale per 128 x 128 block of that layout ([E, R /
    128, C / 128] or [E, C / 128, R / 128]) -- what ``mok_core.gemm.fp8_gemm`` takes, made once
    per optimizer step: the forward reads the weights as stored, the dgrads reduce over their
    other side and take the transposed copies (docs/design.md, FP8). R and C multiples of 128;
    one launch over all experts. ``out`` / ``scales``: the caller's buffers, else allocated
    here. ``column`` (with ``transpose`` and ``out``): ``out`` is [E, C, P] with P >= column +
    R and scales [E, C / 128, P / 128], and each expert's transpose fills its columns [column,
    column + R) -- a multiple of 128 --, so [W_gate; W_up]^T ([E, H, 2I]) is made from the two
    weights as they are. A block's quantisation does not depend on its orientation: the
    transposed copy holds the forward copy's bytes and scales, transposed."""
    from .gemm import _check_errors, _error_word
    w = as_device_array(w, "w", dtype=np.uint16, ndim=3)
    E, R, C = w.shape
    if R % 128 or C % 128:
        raise ValueError(f"w: shape [{E}, {R}, {C}] -- each expert's rows and columns must be "
                         "multiples of 128 (128 x 128 blocks)")
    if scale not in ("fp32", "ue8m0"):
        raise ValueError(f"scale={scale!r}: must be 'fp32' or 'ue8m0'")
    rows, cols = (C, R) if transpose else (R, C)
    pitch = cols
    if column and (not transpose or out is None):
        raise ValueError(f"column={column}: only with transpose=True and the caller's out")
    if transpose and out is not None:
        pitch = getattr(out, "shape", (0,))[-1]
        if column < 0 or column % 128 or column + cols > pitch:
            raise ValueError(f"column={column}: must be a multiple of 128 with column + {cols} "
                             f"<= out's {pitch} columns")
    dtype = np.float32 if scale == "fp32" else np.uint8
    out = device_empty((E, rows, cols), np.uint8, stream) if out is None else \
        as_device_array(out, "out", dtype=np.uint8, shape=(E, rows, pitch))
    scales = device_empty((E, rows // 128, cols // 128), dtype, stream) if scales is None \
        else as_device_array(scales, "scales", dtype=dtype, shape=(E, rows // 128, pitch // 128))
    errors, tensor = _check_errors(errors, tensor)
    if E and R and C:
        ue8m0 = scale == "ue8m0"
        views = _kernel_views(out, scales, ue8m0)
        if transpose:
            _launch_cols(w, E, R, R, C, None, None, *views, ue8m0, True, pitch, column, stream,
                         _error_word(errors), tensor, rank)
        else:
            _launch_blocks(w, E, R, C, *views, ue8m0, stream, _error_word(errors), tensor, rank)
    return out, scales


__all__ = ["dequantize_mx_kernel", "launch_quantize_rows", "mxfp8_to_blockwise",
           "quantize_expert_weights", "quantize_fp8", "quantize_kernel", "quantize_rows_kernel"]
