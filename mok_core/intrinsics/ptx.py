"""GPU implementations of MoK-Py's intrinsics: inline PTX through ``@intrinsic``.

Each one is tiny and has a Python twin in ``twins.py`` with the same name and arguments, so a
kernel calling it also runs under the CUDA simulator. Import them from ``mok_core.intrinsics``,
which picks the right set.

Conventions: an array operand is a 1-D array plus a flat *element* index; the element's
address is taken with numba's own ``get_item_pointer`` (so the array may live in global,
shared or peer memory). bf16 values travel as ``uint16`` bits; packed pairs as ``uint32``.
Inline asm never touches state numba does not see, except where marked ``side_effect`` +
``memory`` clobber (ordering-sensitive ops: fences, acquire/release, cp.async, clocks).
"""
from llvmlite import ir
from numba.cuda import cgutils, types
from numba.cuda.extending import intrinsic

_i32 = ir.IntType(32)
_i64 = ir.IntType(64)
_f32 = ir.FloatType()
_u32x4 = types.UniTuple(types.uint32, 4)
_f32x4 = types.UniTuple(types.float32, 4)


def _is_1d(arr):
    return isinstance(arr, types.Array) and arr.ndim == 1


def _elem_ptr(context, builder, arrty, arr, idx):
    ary = context.make_array(arrty)(context, builder, arr)
    return cgutils.get_item_pointer(context, builder, arrty, ary, [idx], wraparound=False)


def _asm(builder, ret, args, text, constraints, side_effect=False):
    fnty = ir.FunctionType(ret, [a.type for a in args])
    return builder.call(ir.InlineAsm(fnty, text, constraints, side_effect=side_effect), args)


def _tuple(context, builder, sig, res, n):
    vals = [builder.extract_value(res, i) for i in range(n)]
    return context.make_tuple(builder, sig.return_type, vals)


def _named(impl, name, doc):
    """The intrinsic an ``impl`` maker built, under its public name and docstring."""
    impl.__name__ = name
    impl.__doc__ = doc
    return intrinsic(impl)


# ---- 16-byte vector memory access ------------------------------------------------------------

@intrinsic
def ld_v4(typingctx, arr, idx):
    """16 bytes at element ``idx`` of ``arr`` (16-byte aligned) as 4 uint32."""
    if not (_is_1d(arr) and isinstance(idx, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        ptr = _elem_ptr(context, builder, sig.args[0], args[0], args[1])
        vptr = builder.bitcast(ptr, ir.VectorType(_i32, 4).as_pointer())
        vec = builder.load(vptr, align=16)
        vals = [builder.extract_element(vec, ir.Constant(_i32, i)) for i in range(4)]
        return context.make_tuple(builder, sig.return_type, vals)
    return _u32x4(arr, idx), codegen


@intrinsic
def st_v4(typingctx, arr, idx, v0, v1, v2, v3):
    """Store 4 uint32 as 16 bytes at element ``idx`` of ``arr`` (16-byte aligned)."""
    if not (_is_1d(arr) and isinstance(idx, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        ptr = _elem_ptr(context, builder, sig.args[0], args[0], args[1])
        vec = ir.Constant(ir.VectorType(_i32, 4), ir.Undefined)
        for i in range(4):
            val = context.cast(builder, args[2 + i], sig.args[2 + i], types.uint32)
            vec = builder.insert_element(vec, val, ir.Constant(_i32, i))
        builder.store(vec, builder.bitcast(ptr, ir.VectorType(_i32, 4).as_pointer()), align=16)
        return context.get_dummy_value()
    return types.void(arr, idx, types.uint32, types.uint32, types.uint32, types.uint32), codegen


@intrinsic
def st_v2_f32(typingctx, arr, idx, v0, v1):
    """Store 2 float32 as 8 bytes at element ``idx`` of the float32 ``arr`` (8-byte aligned):
    one vector store, where two element stores would be two instructions."""
    if not (_is_1d(arr) and arr.dtype == types.float32 and isinstance(idx, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        ptr = _elem_ptr(context, builder, sig.args[0], args[0], args[1])
        vec = ir.Constant(ir.VectorType(_f32, 2), ir.Undefined)
        for i in range(2):
            val = context.cast(builder, args[2 + i], sig.args[2 + i], types.float32)
            vec = builder.insert_element(vec, val, ir.Constant(_i32, i))
        builder.store(vec, builder.bitcast(ptr, ir.VectorType(_f32, 2).as_pointer()), align=8)
        return context.get_dummy_value()
    return types.void(arr, idx, types.float32, types.float32), codegen


# ---- memory ordering (flags and counters) -----------------------------------------------------

def _int32_array(arr):
    return _is_1d(arr) and arr.dtype in (types.int32, types.uint32)


def _acquire_load(scope, doc):
    """An int32 acquire load at ``scope`` (never hoisted out of a spin loop)."""
    def impl(typingctx, arr, idx):
        if not (_int32_array(arr) and isinstance(idx, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            ptr = _elem_ptr(context, builder, sig.args[0], args[0], args[1])
            return _asm(builder, _i32, [ptr], f"ld.acquire.{scope}.b32 $0, [$1];",
                        "=r,l,~{memory}", True)
        return arr.dtype(arr, idx), codegen
    return _named(impl, f"ld_acquire_{scope}", doc)


ld_acquire_sys = _acquire_load("sys", "Acquire load (system scope) of an int32 flag: sees "
                                      "peers' release stores.")


def _release_update(name, ptx, doc):
    """An int32 store-like update with release semantics: ``ptx`` takes [$0] and $1."""
    def impl(typingctx, arr, idx, value):
        if not (_int32_array(arr) and isinstance(idx, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            ptr = _elem_ptr(context, builder, sig.args[0], args[0], args[1])
            val = context.cast(builder, args[2], sig.args[2], types.int32)
            _asm(builder, ir.VoidType(), [ptr, val], ptx, "l,r,~{memory}", True)
            return context.get_dummy_value()
        return types.void(arr, idx, value), codegen
    return _named(impl, name, doc)


st_release_sys = _release_update(
    "st_release_sys", "st.release.sys.b32 [$0], $1;",
    "Release store (system scope): earlier writes of this thread are visible to a peer that "
    "acquires the flag.")
red_add_release_gpu = _release_update(
    "red_add_release_gpu", "red.release.gpu.add.s32 [$0], $1;",
    "Atomic add with release semantics (GPU scope): publish 'my rows are written'.")


def _statement(name, text, doc):
    """An asm statement with no operands, ordered against memory (side effect + clobber)."""
    def impl(typingctx):
        def codegen(context, builder, sig, args):
            _asm(builder, ir.VoidType(), [], text, "~{memory}", True)
            return context.get_dummy_value()
        return types.void(), codegen
    return _named(impl, name, doc)


syncwarp = _statement(
    "syncwarp", "bar.warp.sync -1;",
    "Barrier of the 32 lanes of a warp, which also orders their shared/global memory accesses "
    "(``bar.warp.sync``): lanes exchange values through shared memory around it.")


@intrinsic
def warp_all(typingctx, pred):
    """1 if ``pred`` (an integer or boolean) is non-zero on all 32 lanes of the warp, else 0
    (``vote.sync.all``; every lane must call it). Why it exists: the result is warp-uniform
    *to ptxas*, so a ``wgmma`` under ``if warp_all(p)`` is not in a divergent path -- under a
    plain ``if p`` ptxas serialises every wgmma of the kernel (C7518, a wait after each)."""
    if not isinstance(pred, (types.Integer, types.Boolean)):
        return None

    def codegen(context, builder, sig, args):
        p = context.cast(builder, args[0], sig.args[0], types.int32)
        return _asm(builder, ir.IntType(32), [p],
                    "{ .reg .pred p, q; setp.ne.s32 p, $1, 0; vote.sync.all.pred q, p, -1; "
                    "selp.s32 $0, 1, 0, q; }", "=r,r", True)
    return types.int32(pred), codegen


def _warp_reduce(name, op, doc):
    def impl(typingctx, value):
        if not isinstance(value, types.Integer):
            return None

        def codegen(context, builder, sig, args):
            v = context.cast(builder, args[0], sig.args[0], types.int32)
            return _asm(builder, _i32, [v], f"redux.sync.{op}.s32 $0, $1, -1;", "=r,r", True)
        return types.int32(value), codegen
    return _named(impl, name, doc)


warp_sum = _warp_reduce(
    "warp_sum", "add",
    "The sum (int32) of ``value`` over the warp's 32 lanes (``redux.sync.add``; every lane "
    "must call it): the GEMM epilogue's non-finite count, one atomic per warp.")
warp_min = _warp_reduce(
    "warp_min", "min",
    "The minimum (int32) of ``value`` over the warp's 32 lanes (``redux.sync.min``; every "
    "lane must call it).")


@intrinsic
def warp_fsum(typingctx, value):
    """The float32 sum of ``value`` over the warp's 32 lanes, every lane getting the same
    bits, by a fixed butterfly: five ``shfl.sync.bfly`` steps (lane distance 16, 8, 4, 2, 1),
    each adding the partner's value with ``add.rn.f32`` (never contracted); every lane must
    call it. Why it exists: ``redux.sync`` has no float add, and a fixed order of rounded adds
    is what a deterministic reduction needs -- no shared memory, no barrier (the two partners
    of a step add the same two values, and an IEEE add is commutative)."""
    if value != types.float32:
        return None

    def codegen(context, builder, sig, args):
        steps = " ".join(f"shfl.sync.bfly.b32 t, s, {d}, 31, -1; add.rn.f32 s, s, t;"
                         for d in (16, 8, 4, 2, 1))
        return _asm(builder, _f32, [args[0]],
                    f"{{ .reg .f32 s, t; mov.f32 s, $1; {steps} mov.f32 $0, s; }}", "=f,f",
                    True)
    return types.float32(value), codegen


@intrinsic
def warp_read(typingctx, value, lane):
    """Lane ``lane``'s ``value`` (int32; ``lane`` in 0..31, per lane) to every lane that asks
    (``shfl.sync.idx.b32``; every lane must call it). Why it exists: the push epilogues look
    a row's route up once, in the lane of that row, ahead of the staging; the lanes storing
    the row's chunks read it from there instead of loading it again behind their stores."""
    if not (isinstance(value, types.Integer) and isinstance(lane, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        v = context.cast(builder, args[0], sig.args[0], types.int32)
        src = context.cast(builder, args[1], sig.args[1], types.int32)
        return _asm(builder, _i32, [v, src], "shfl.sync.idx.b32 $0, $1, $2, 31, -1;",
                    "=r,r,r", True)
    return types.int32(value, lane), codegen


@intrinsic
def match_any(typingctx, value):
    """The mask (uint32) of the warp's lanes whose ``value`` (an integer, as int32) equals this
    lane's (``match.any.sync.b32``; every lane must call it). Why it exists: it ranks equal
    keys within a warp in one instruction -- the schedule's placement did it by a 32-step
    compare loop over shared memory."""
    if not isinstance(value, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        v = context.cast(builder, args[0], sig.args[0], types.int32)
        return _asm(builder, ir.IntType(32), [v], "match.any.sync.b32 $0, $1, -1;", "=r,r",
                    True)
    return types.uint32(value), codegen


@intrinsic
def tuple_pick(typingctx, tup, i):
    """``tup[i]`` for a run-time ``i`` (a UniTuple, e.g. of peer arrays) by a chain of selects,
    no branch. Why it exists: numba lowers ``tup[i]`` to a switch, and a switch in the
    epilogue is a divergent path to ptxas -- it then serialises every wgmma of the kernel
    (C7518), as it did in the fused combine's push. ``i`` must be in range (out of range:
    element 0 here, an IndexError from the simulator twin)."""
    if not (isinstance(tup, types.UniTuple) and isinstance(i, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        t, idx = args
        idx = context.cast(builder, idx, sig.args[1], types.int64)
        res = builder.extract_value(t, 0)
        for j in range(1, sig.args[0].count):
            hit = builder.icmp_signed("==", idx, ir.Constant(ir.IntType(64), j))
            res = builder.select(hit, builder.extract_value(t, j), res)
        return res
    return tup.dtype(tup, i), codegen


@intrinsic
def clock64(typingctx):
    """SM cycle counter (for bounded spin-waits); volatile so loops re-read it."""
    def codegen(context, builder, sig, args):
        return _asm(builder, _i64, [], "mov.u64 $0, %clock64;", "=l", True)
    return types.int64(), codegen


@intrinsic
def nanosleep(typingctx, ns):
    """Back off for about ``ns`` nanoseconds inside a spin-wait (frees issue slots)."""
    if not isinstance(ns, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        v = context.cast(builder, args[0], sig.args[0], types.uint32)
        _asm(builder, ir.VoidType(), [v], "nanosleep.u32 $0;", "r,~{memory}", True)
        return context.get_dummy_value()
    return types.void(ns), codegen


@intrinsic
def per_iteration(typingctx, x):
    """``x`` (a 32- or 64-bit integer) itself, through a volatile ``mov`` that LLVM / NVVM
    can neither hoist out of the loop it sits in nor fold: what is computed from it is
    recomputed there (a few integer adds) instead of held in registers across the loop --
    e.g. a staging tile's 32 shared addresses, which ptxas spilled where the accumulators
    fill the registers (ptxas sees a plain ``mov``; the spill-free kernels show it leaves it
    in place)."""
    if not isinstance(x, types.Integer) or x.bitwidth not in (32, 64):
        return None
    bits, reg = (32, "r") if x.bitwidth == 32 else (64, "l")

    def codegen(context, builder, sig, args):
        return _asm(builder, ir.IntType(bits), [args[0]], f"mov.b{bits} $0, $1;",
                    f"={reg},{reg}", True)
    return x(x), codegen


# ---- bf16 bits <-> f32 -------------------------------------------------------------------------

@intrinsic
def u32_as_f32(typingctx, x):
    if not isinstance(x, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        v = context.cast(builder, args[0], sig.args[0], types.uint32)
        return builder.bitcast(v, _f32)
    return types.float32(x), codegen


@intrinsic
def f32_as_u32(typingctx, x):
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], _i32)
    return types.uint32(x), codegen


@intrinsic
def pack_bf16x2(typingctx, lo, hi):
    """Two float32 -> one uint32 of two RNE bf16 (``lo`` in the low half)."""
    if lo != types.float32 or hi != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return _asm(builder, _i32, [args[1], args[0]], "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f")
    return types.uint32(lo, hi), codegen


@intrinsic
def max_u16x2(typingctx, a, b):
    """The larger of each 16-bit half of two uint32, as unsigned (``max.u16x2``, sm_90+, one
    instruction): a running maximum of packed |bf16| bit patterns, two columns at once."""
    if not (isinstance(a, types.Integer) and isinstance(b, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        aa = context.cast(builder, args[0], sig.args[0], types.uint32)
        bb = context.cast(builder, args[1], sig.args[1], types.uint32)
        return _asm(builder, _i32, [aa, bb], "max.u16x2 $0, $1, $2;", "=r,r,r")
    return types.uint32(a, b), codegen


@intrinsic
def fold_nonfinite_bf16x2(typingctx, z, w):
    """``w * 0 + z`` on two packed bf16 (``fma.rn.bf16x2``, one instruction): a half of the
    result is NaN once a NaN/Inf went through it, else stays +0. Folded over a tile's output
    words from z = 0, ``z & 0x7FFF7FFF != 0`` says whether any was non-finite."""
    if not (isinstance(z, types.Integer) and isinstance(w, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        zz = context.cast(builder, args[0], sig.args[0], types.uint32)
        ww = context.cast(builder, args[1], sig.args[1], types.uint32)
        return _asm(builder, _i32, [ww, ir.Constant(_i32, 0), zz],
                    "fma.rn.bf16x2 $0, $1, $2, $3;", "=r,r,r,r")
    return types.uint32(z, w), codegen


@intrinsic
def fmul_rn(typingctx, a, b):
    """float32 a*b rounded once; an explicit-rounding mul is never fused into an FMA, so
    ``fadd_rn(acc, fmul_rn(w, y))`` rounds exactly like NumPy float32 (bitwise reference)."""
    if a != types.float32 or b != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return _asm(builder, _f32, list(args), "mul.rn.f32 $0, $1, $2;", "=f,f,f")
    return types.float32(a, b), codegen


@intrinsic
def fadd_rn(typingctx, a, b):
    """float32 a+b rounded once (never contracted)."""
    if a != types.float32 or b != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return _asm(builder, _f32, list(args), "add.rn.f32 $0, $1, $2;", "=f,f,f")
    return types.float32(a, b), codegen


def _fma_rn(builder, a, b, c):
    """a * b + c rounded once: one ``fma.rn.f32`` whatever the compiler's contraction flags."""
    return _asm(builder, _f32, [a, b, c], "fma.rn.f32 $0, $1, $2, $3;", "=f,f,f,f")


@intrinsic
def ffma_rn(typingctx, a, b, c):
    """float32 a*b+c rounded once (``fma.rn.f32``)."""
    if a != types.float32 or b != types.float32 or c != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return _fma_rn(builder, *args)
    return types.float32(a, b, c), codegen


@intrinsic
def fdiv_rn(typingctx, a, b):
    """float32 a/b, IEEE round-to-nearest (``div.rn.f32``): what the FP8 quantizer's float64
    reference computes, whatever the compiler's division flags."""
    if a != types.float32 or b != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return _asm(builder, _f32, list(args), "div.rn.f32 $0, $1, $2;", "=f,f,f")
    return types.float32(a, b), codegen


@intrinsic
def pack_e4m3x4(typingctx, a, b, c, d):
    """Four float32 -> one uint32 of four e4m3 bytes (``a`` lowest), each rounded to nearest
    even and saturated to +-448 (``cvt.rn.satfinite.e4m3x2.f32``, sm_89+; NaN -> 0x7F)."""
    if any(v != types.float32 for v in (a, b, c, d)):
        return None

    def codegen(context, builder, sig, args):
        # cvt puts its first source in the upper byte
        return _asm(builder, _i32, [args[1], args[0], args[3], args[2]],
                    "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $1, $2; "
                    "cvt.rn.satfinite.e4m3x2.f32 hi, $3, $4; mov.b32 $0, {lo, hi}; }",
                    "=r,f,f,f,f")
    return types.uint32(a, b, c, d), codegen


def _f32_unary(name, text, doc):
    """A float32 -> float32 asm statement ($0 result, $1 operand)."""
    def impl(typingctx, x):
        if x != types.float32:
            return None

        def codegen(context, builder, sig, args):
            return _asm(builder, _f32, list(args), text, "=f,f")
        return types.float32(x), codegen
    impl.__name__ = name
    impl.__doc__ = doc
    return intrinsic(impl)


ex2_approx = _f32_unary(
    "ex2_approx", "ex2.approx.ftz.f32 $0, $1;",
    "2**x, float32, the SFU's approximation (max relative error ~2**-22; denormals flushed): "
    "one instruction where ``math.exp`` is a range reduction around it.")
rcp_approx = _f32_unary(
    "rcp_approx", "rcp.approx.ftz.f32 $0, $1;",
    "1/x, float32, the SFU's approximation (within 1 ulp; denormals flushed): one "
    "instruction where ``/`` is an IEEE division with a slow-path call and its branch.")


# ---- tensor cores ------------------------------------------------------------------------------

@intrinsic
def mma_bf16_16816(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """D = A(16x16, bf16, row) * B(16x8, bf16, col) + C(16x8, f32), one warp.

    Lane fragments follow the PTX ISA m16n8k16 layout (group g = lane/4, t = lane%4):
    a0 = A[g, 2t:2t+2], a1 = A[g+8, 2t:2t+2], a2 = A[g, 2t+8:2t+10], a3 = A[g+8, 2t+8:2t+10];
    b0 = B[2t:2t+2, g], b1 = B[2t+8:2t+10, g]; c/d: [g, 2t], [g, 2t+1], [g+8, 2t], [g+8, 2t+1].
    """
    sig = _f32x4(*([types.uint32] * 6 + [types.float32] * 4))

    def codegen(context, builder, sig, args):
        ins = [context.cast(builder, v, t, types.uint32) for v, t in zip(args[:6], sig.args[:6])]
        res = _asm(builder, ir.LiteralStructType([_f32] * 4), ins + list(args[6:]),
                   "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                   "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};",
                   "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")
        return _tuple(context, builder, sig, res, 4)
    return sig, codegen



@intrinsic
def shared_addr(typingctx, smem):
    """32-bit shared-space byte address of ``smem[0]`` (hot loops add byte offsets to it
    instead of recomputing 64-bit generic pointers)."""
    if not _is_1d(smem):
        return None

    def codegen(context, builder, sig, args):
        ptr = _elem_ptr(context, builder, sig.args[0], args[0], ir.Constant(_i64, 0))
        return _asm(builder, _i32, [ptr], "{ .reg .u64 g; cvta.to.shared.u64 g, $1; "
                    "cvt.u32.u64 $0, g; }", "=r,l")
    return types.uint32(smem), codegen


def _ldmatrix_x4(name, qualifier, doc):
    def impl(typingctx, smem, addr):
        if not (_is_1d(smem) and isinstance(addr, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            a = context.cast(builder, args[1], sig.args[1], types.uint32)
            res = _asm(builder, ir.LiteralStructType([_i32] * 4), [a],
                       f"ldmatrix.sync.aligned.m8n8.x4{qualifier}.shared.b16 "
                       "{$0,$1,$2,$3}, [$4];", "=r,=r,=r,=r,r,~{memory}", True)
            return _tuple(context, builder, sig, res, 4)
        return _u32x4(smem, addr), codegen
    return _named(impl, name, doc)


ldmatrix_x4_at = _ldmatrix_x4(
    "ldmatrix_x4_at", "",
    "``ldmatrix_x4`` at a shared byte address from ``shared_addr`` (+ offset); ``smem`` is "
    "the array it points into (the simulator twin reads through it).")
ldmatrix_x4_trans_at = _ldmatrix_x4(
    "ldmatrix_x4_trans_at", ".trans",
    "``ldmatrix_x4_at`` with ``.trans``: each 8x8 matrix arrives transposed (lane L holds "
    "elements (2 (L % 4), L / 4) and (2 (L % 4) + 1, L / 4) of matrix j, row = the lane that "
    "addressed it): the fragment of an operand stored the other way round in shared memory.")


def _cp_async_at(name, nbytes, cache, doc):
    """``nbytes`` from ``gmem[gidx:]`` to a shared byte address from ``shared_addr`` (+
    offset), asynchronously, as ``name(smem, saddr, gmem, gidx, src_bytes)``: ``src_bytes``
    ``nbytes``, or 0: zeros and no read. The zero case is cp.async's ignore-src predicate,
    not a source size: ptxas turns a run-time source size into address arithmetic around
    every copy."""
    def impl(typingctx, smem, saddr, gmem, gidx, src_bytes):
        if not (_is_1d(smem) and _is_1d(gmem) and isinstance(saddr, types.Integer)
                and isinstance(gidx, types.Integer) and isinstance(src_bytes, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            s32 = context.cast(builder, args[1], sig.args[1], types.uint32)
            gptr = _elem_ptr(context, builder, sig.args[2], args[2], args[3])
            n = context.cast(builder, args[4], sig.args[4], types.uint32)
            text = ("{ .reg .u64 g; .reg .pred z; cvta.to.global.u64 g, $1; setp.eq.u32 z, $2, "
                    f"0; cp.async.{cache}.shared.global [$0], [g], {nbytes}, z; }}")
            _asm(builder, ir.VoidType(), [s32, gptr, n], text, "r,l,r,~{memory}", True)
            return context.get_dummy_value()
        return types.void(smem, saddr, gmem, gidx, src_bytes), codegen
    return _named(impl, name, doc)


cp_async_16_at = _cp_async_at(
    "cp_async_16_at", 16, "cg",
    "16 bytes from ``gmem[gidx:]`` to a shared byte address, asynchronously "
    "(``cp_async_commit`` / ``cp_async_wait`` groups, or ``cp_async_mbarrier_arrive``); "
    "``src_bytes`` 16, or 0: 16 zeros and no read (L2 only: ``.cg``).")
cp_async_4_at = _cp_async_at(
    "cp_async_4_at", 4, "ca",
    "4 bytes (e.g. a float32 scale) from ``gmem[gidx:]`` to a shared byte address (4-byte "
    "aligned), asynchronously, as ``cp_async_16_at``; ``src_bytes`` 4, or 0: zeros and no read "
    "(``.ca``: the only cache mode of a copy under 16 bytes).")


def _shared_u32_statement(name, text, doc):
    """An asm statement ``text`` on a shared byte address ($0) and a 32-bit operand ($1), as
    ``name(smem, addr, value)``, ordered against memory."""
    def impl(typingctx, smem, addr, value):
        if not (_is_1d(smem) and isinstance(addr, types.Integer)
                and isinstance(value, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            a = context.cast(builder, args[1], sig.args[1], types.uint32)
            v = context.cast(builder, args[2], sig.args[2], types.uint32)
            _asm(builder, ir.VoidType(), [a, v], text, "r,r,~{memory}", True)
            return context.get_dummy_value()
        return types.void(smem, addr, value), codegen
    return _named(impl, name, doc)


st_shared_u32 = _shared_u32_statement(
    "st_shared_u32", "st.shared.u32 [$0], $1;",
    "Store the 32-bit value at the shared byte address (4-byte aligned; ``shared_addr`` + "
    "offset) -- e.g. a bf16 pair staged for a bulk store.")


def _shared_v2_f32_statement(name, text, doc):
    """An asm statement ``text`` on a shared byte address ($0, 8-byte aligned) and two float32
    ($1, $2), as ``name(smem, addr, v0, v1)``, ordered against memory."""
    def impl(typingctx, smem, addr, v0, v1):
        if not (_is_1d(smem) and isinstance(addr, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            a = context.cast(builder, args[1], sig.args[1], types.uint32)
            v = [context.cast(builder, args[2 + i], sig.args[2 + i], types.float32)
                 for i in range(2)]
            _asm(builder, ir.VoidType(), [a, *v], text, "r,f,f,~{memory}", True)
            return context.get_dummy_value()
        return types.void(smem, addr, types.float32, types.float32), codegen
    return _named(impl, name, doc)


st_shared_v2_f32 = _shared_v2_f32_statement(
    "st_shared_v2_f32", "st.shared.v2.f32 [$0], {$1, $2};",
    "Store two float32 as 8 bytes at the shared byte address (8-byte aligned; ``shared_addr`` "
    "+ offset): one vector store -- e.g. an FP32 pair staged for a TMA store.")


add_shared_v2_f32 = _shared_v2_f32_statement(
    "add_shared_v2_f32",
    "{ .reg .f32 o0, o1; ld.shared.v2.f32 {o0, o1}, [$0]; add.rn.f32 o0, o0, $1; "
    "add.rn.f32 o1, o1, $2; st.shared.v2.f32 [$0], {o0, o1}; }",
    "Add two float32 to the 8 bytes at the shared byte address (8-byte aligned): one vector "
    "load, two ``add.rn.f32`` (IEEE, subnormals kept: no flush, no contraction -- the bits of "
    "``out + acc`` whatever the compiler's flags), one vector store. E.g. a prefetched FP32 "
    "output pair plus this tile's (main-grad).")


cp_async_commit = _statement(
    "cp_async_commit", "cp.async.commit_group;",
    "Close this thread's cp.async copies issued so far into one group.")


@intrinsic
def cp_async_wait(typingctx, pending):
    """Wait until at most ``pending`` (a compile-time constant) copy groups are in flight."""
    if not isinstance(pending, types.IntegerLiteral):
        return None
    n = int(pending.literal_value)

    def codegen(context, builder, sig, args):
        _asm(builder, ir.VoidType(), [], f"cp.async.wait_group {n};", "~{memory}", True)
        return context.get_dummy_value()
    return types.void(pending), codegen


# ---- Hopper warpgroup MMA (wgmma) --------------------------------------------------------------
#
# A warpgroup (4 consecutive warps, 128 threads) multiplies a 64 x 16 A tile by a 16 x N B tile,
# both read from shared memory through 64-bit matrix descriptors (A K-major; B K-major, or
# MN-major in the ``_tb`` variants: the instruction's imm-trans-b), into a 64 x N fp32
# accumulator spread over its threads: N/2 floats each, carried as a UniTuple. (``_tatb``: A
# MN-major as well, the instruction's imm-trans-a.) Only the tuple
# travels between the asm statements below, so the accumulator never leaves registers while a
# wgmma is in flight (fence -> mma_async ... -> commit -> wait).

def _acc_constraints(n):
    return ",".join(["=f"] * n), ",".join(str(i) for i in range(n))


def _f32_tuple(acc):
    return (isinstance(acc, types.UniTuple) and acc.dtype == types.float32
            and acc.count in (32, 64, 128))


def _acc_passthrough(name, text, doc):
    """An asm statement that 'reads and writes' the accumulator: orders it against wgmmas."""
    def impl(typingctx, acc):
        if not _f32_tuple(acc):
            return None
        n = acc.count

        def codegen(context, builder, sig, args):
            vals = [builder.extract_value(args[0], i) for i in range(n)]
            outs, ties = _acc_constraints(n)
            res = _asm(builder, ir.LiteralStructType([_f32] * n), vals, text,
                       f"{outs},{ties},~{{memory}}", True)
            return _tuple(context, builder, sig, res, n)
        return acc(acc), codegen
    return _named(impl, name, doc)


wgmma_fence = _acc_passthrough(
    "wgmma_fence", "wgmma.fence.sync.aligned;",
    "Before a warpgroup's first wgmma of a batch: orders earlier register/shared writes.")


wgmma_commit = _statement(
    "wgmma_commit", "wgmma.commit_group.sync.aligned;",
    "Close the batch of wgmmas issued so far into one group (per warpgroup).")


@intrinsic
def wgmma_wait(typingctx, acc, pending):
    """Wait until at most ``pending`` (compile-time) wgmma groups are in flight; returns the
    accumulator, which may be read only after a wait that covers every group writing it."""
    if not (_f32_tuple(acc) and isinstance(pending, types.IntegerLiteral)):
        return None
    n = acc.count
    k = int(pending.literal_value)

    def codegen(context, builder, sig, args):
        vals = [builder.extract_value(args[0], i) for i in range(n)]
        outs, ties = _acc_constraints(n)
        res = _asm(builder, ir.LiteralStructType([_f32] * n), vals,
                   f"wgmma.wait_group.sync.aligned {k};", f"{outs},{ties},~{{memory}}", True)
        return _tuple(context, builder, sig, res, n)
    return acc(acc, pending), codegen


fence_proxy_async = _statement(
    "fence_proxy_async", "fence.proxy.async.shared::cta;",
    "Make this thread's generic-proxy shared-memory writes (st.shared, cp.async) visible to the "
    "async proxy that wgmma reads its operands through.")


@intrinsic
def f32_zeros(typingctx, n):
    """A UniTuple of ``n`` (compile-time) float32 zeros: a fresh wgmma accumulator."""
    if not isinstance(n, types.IntegerLiteral):
        return None
    count = int(n.literal_value)
    ret = types.UniTuple(types.float32, count)

    def codegen(context, builder, sig, args):
        zero = ir.Constant(_f32, 0.0)
        return context.make_tuple(builder, ret, [zero] * count)
    return ret(n), codegen


def _wgmma_impl(n, shape_types, immediates, scale_d=1):
    """The intrinsic maker of one wgmma: ``acc`` (n/2 float32) += A . B from two shared-memory
    descriptors, ``wgmma.mma_async.sync.aligned.m64n{n}{shape_types}`` with scale-d 1
    (accumulate: fresh tiles start at 0) -- or with ``scale_d`` 0, acc = A . B (its input
    ignored: no instruction but the wgmma writes the registers) -- and the instruction's
    trailing ``immediates``."""
    nacc = n // 2

    def impl(typingctx, acc, smem, desc_a, desc_b):
        if not (_f32_tuple(acc) and acc.count == nacc and _is_1d(smem)
                and isinstance(desc_a, types.Integer) and isinstance(desc_b, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            vals = [builder.extract_value(args[0], i) for i in range(nacc)]
            da = context.cast(builder, args[2], sig.args[2], types.int64)
            db = context.cast(builder, args[3], sig.args[3], types.int64)
            regs = ",".join(f"${i}" for i in range(nacc))
            one = ir.Constant(_i32, scale_d)
            text = (f"{{ .reg .pred p; setp.ne.b32 p, ${2 * nacc + 2}, 0; "
                    f"wgmma.mma_async.sync.aligned.m64n{n}{shape_types} "
                    f"{{{regs}}}, ${2 * nacc}, ${2 * nacc + 1}, p, {immediates}; }}")
            outs, ties = _acc_constraints(nacc)
            res = _asm(builder, ir.LiteralStructType([_f32] * nacc), vals + [da, db, one], text,
                       f"{outs},{ties},l,l,r,~{{memory}}", True)
            return _tuple(context, builder, sig, res, nacc)
        return acc(acc, smem, desc_a, desc_b), codegen
    return impl


def _wgmma_bf16(n, trans_b=False, trans_a=False):
    """wgmma m64nNk16, bf16 x bf16 -> f32 from shared memory; B K-major (``trans_b`` False:
    the ``imm-trans-b`` immediate 0) or MN-major (True: immediate 1, B stored as [k][n] rows
    with n contiguous -- the weights as stored, read by ``dgrad``); A K-major, or with
    ``trans_a`` MN-major too (``imm-trans-a`` = 1, A stored as [k][m] rows with m contiguous:
    both operands of the weight gradient, whose reduction runs over the rows they are stored
    in)."""
    # immediates: scale-a, scale-b (1: no negation), trans-a, trans-b
    impl = _wgmma_impl(n, "k16.f32.bf16.bf16", f"1, 1, {int(trans_a)}, {int(trans_b)}")
    if trans_a:
        return _named(impl, f"wgmma_m64n{n}k16_bf16_tatb",
                      f"``wgmma_m64n{n}k16_bf16_tb`` with A MN-major too (``imm-trans-a`` = 1): "
                      "A(64x16) stored as rows of k, m contiguous, 128-byte swizzle, its "
                      "descriptor built like the MN-major B's (``mok_core.gemm.sm90_wgrad``). "
                      "Same accumulator fragment.")
    if trans_b:
        return _named(impl, f"wgmma_m64n{n}k16_bf16_tb",
                      f"``wgmma_m64n{n}k16_bf16`` with B MN-major (transposed, ``imm-trans-b`` "
                      f"= 1): B(16x{n}) stored as rows of k, n contiguous, 128-byte swizzle; "
                      "its descriptor's leading byte offset steps 64 columns of n, its stride "
                      "byte offset 8 rows of k (``mok_core.gemm.sm90``). Same accumulator "
                      "fragment.")
    return _named(impl, f"wgmma_m64n{n}k16_bf16",
                  f"acc += A(64x16) . B(16x{n}), one warpgroup; A, B from shared memory "
                  "descriptors (see ``mok_core.gemm.sm90``), K-major, 128-byte "
                  "swizzle. Thread t of the warpgroup holds rows 16*(t/32) + (t%32)/4 (+8) "
                  "and columns 8j + 2*(t%4) (+1): acc[4j + 2h + c] = D[row + 8h, "
                  "8j + 2*(t%4) + c].")


wgmma_m64n64k16_bf16 = _wgmma_bf16(64)
wgmma_m64n128k16_bf16 = _wgmma_bf16(128)
wgmma_m64n256k16_bf16 = _wgmma_bf16(256)
wgmma_m64n64k16_bf16_tb = _wgmma_bf16(64, trans_b=True)
wgmma_m64n128k16_bf16_tb = _wgmma_bf16(128, trans_b=True)
wgmma_m64n256k16_bf16_tb = _wgmma_bf16(256, trans_b=True)
wgmma_m64n64k16_bf16_tatb = _wgmma_bf16(64, trans_b=True, trans_a=True)
wgmma_m64n128k16_bf16_tatb = _wgmma_bf16(128, trans_b=True, trans_a=True)
wgmma_m64n256k16_bf16_tatb = _wgmma_bf16(256, trans_b=True, trans_a=True)


def _wgmma_e4m3(n):
    """wgmma m64nNk32, e4m3 x e4m3 -> f32 from shared memory, both operands K-major (8-bit
    types have no transpose immediates): 32 bytes of k a step."""
    impl = _wgmma_impl(n, "k32.f32.e4m3.e4m3", "1, 1")     # scale-a, scale-b
    return _named(impl, f"wgmma_m64n{n}k32_e4m3",
                  f"acc += A(64x32) . B(32x{n}), e4m3 (FP8) operands, FP32 accumulator, one "
                  "warpgroup; both K-major, 128-byte swizzle (a 128-byte row holds 128 of k: "
                  "a k32 step is +32 bytes in both descriptors, as bf16's k16). The "
                  "accumulator fragment is ``wgmma_m64n{n}k16_bf16``'s. The tensor cores "
                  "keep fewer bits than FP32 while they accumulate: FP8 GEMMs promote into "
                  "their own FP32 sum every 128 of K (docs/design.md, FP8).")


@intrinsic
def promote_fp8(typingctx, acc, part, s_lo, s_hi, s_lo2, s_hi2):
    """The FP8 promotion of one K slice: ``acc[i] + part[i] * s`` for every element of two
    equal float32 UniTuples (wgmma fragments), ``s`` = ``s_lo`` for the fragment's upper row
    (elements 4j, 4j + 1) and ``s_hi`` for the row 8 below (4j + 2, 4j + 3) in the first half
    of the columns (the first n/2 elements), ``s_lo2`` / ``s_hi2`` in the second half (SwiGLU
    tiles: gate columns, then up columns, each with its weight's scale); each a ``fma.rn.f32``
    (part x s + acc rounded once: one instruction where a rounded multiply and add would take
    two -- ptxas contracted those into it anyway --, and the bits fixed whatever the compiler's
    contraction flags; the twin rounds the exact value the same way)."""
    if not (_f32_tuple(acc) and acc == part
            and all(isinstance(f, types.Float) for f in (s_lo, s_hi, s_lo2, s_hi2))):
        return None
    n = acc.count

    def codegen(context, builder, sig, args):
        f = [context.cast(builder, args[2 + j], sig.args[2 + j], types.float32)
             for j in range(4)]
        out = []
        for i in range(n):
            out.append(_fma_rn(builder, builder.extract_value(args[1], i),
                               f[2 * (i >= n // 2) + (i // 2) % 2],
                               builder.extract_value(args[0], i)))
        return context.make_tuple(builder, sig.return_type, out)
    return acc(acc, part, s_lo, s_hi, s_lo2, s_hi2), codegen

def _wgmma_e4m3_fresh(n):
    impl = _wgmma_impl(n, "k32.f32.e4m3.e4m3", "1, 1", scale_d=0)
    return _named(impl, f"wgmma_m64n{n}k32_e4m3_fresh",
                  f"``wgmma_m64n{n}k32_e4m3`` with scale-d 0: acc = A . B, the accumulator's "
                  "input ignored -- a K slice's first step in the FP8 GEMM, whose fragment "
                  "starts fresh each slice, so no instruction but a wgmma ever writes it.")


wgmma_m64n128k32_e4m3_fresh = _wgmma_e4m3_fresh(128)
wgmma_m64n64k32_e4m3 = _wgmma_e4m3(64)
wgmma_m64n128k32_e4m3 = _wgmma_e4m3(128)
wgmma_m64n256k32_e4m3 = _wgmma_e4m3(256)

def tuple_groups(fn, layout):
    """An intrinsic ``apply(acc, extra)`` over a float32 UniTuple ``acc``, unrolled at compile
    time: for each group j of ``layout(len(acc))`` (a list of index lists) it calls
    ``fn(j, *extra, acc[i0], acc[i1], ...)`` with every element read at a constant index, so
    the tuple stays in registers -- a loop over a ``store_f32_tuple`` copy stays in local
    memory when the compiler keeps it rolled (the SwiGLU epilogue's 512 bytes per thread, and
    with ~200 KB of shared memory taken, L1 holds little of it). ``extra``: a tuple of the
    other arguments. ``fn``: a plain Python function, compiled for the device as a subroutine
    that NVVM inlines (the PTX test checks that no local copy is left)."""
    @intrinsic
    def apply(typingctx, acc, extra):
        if not (isinstance(acc, types.UniTuple) and acc.dtype == types.float32
                and isinstance(extra, types.BaseTuple)):
            return None
        groups = layout(acc.count)

        def codegen(context, builder, sig, args):
            ex_types = list(sig.args[1].types)
            ex_vals = [builder.extract_value(args[1], i) for i in range(len(ex_types))]
            for j, idx in enumerate(groups):
                vals = [builder.extract_value(args[0], i) for i in idx]
                fsig = types.void(types.int64, *ex_types, *([types.float32] * len(idx)))
                context.compile_internal(builder, fn, fsig,
                                         [ir.Constant(_i64, j), *ex_vals, *vals])
            return context.get_dummy_value()
        return types.void(acc, extra), codegen
    return apply


def tuple_fold(fn, layout):
    """``tuple_groups`` with a carried value: ``apply(acc, carry, extra)`` calls
    ``carry = fn(j, carry, *extra, acc[i0], acc[i1], ...)`` group by group (unrolled, constant
    indices) and returns the last carry (``fn`` must return the carry's type)."""
    @intrinsic
    def apply(typingctx, acc, carry, extra):
        if not (isinstance(acc, types.UniTuple) and acc.dtype == types.float32
                and isinstance(extra, types.BaseTuple)):
            return None
        groups = layout(acc.count)

        def codegen(context, builder, sig, args):
            ex_types = list(sig.args[2].types)
            ex_vals = [builder.extract_value(args[2], i) for i in range(len(ex_types))]
            c = args[1]
            for j, idx in enumerate(groups):
                vals = [builder.extract_value(args[0], i) for i in idx]
                fsig = sig.args[1](types.int64, sig.args[1], *ex_types,
                                   *([types.float32] * len(idx)))
                c = context.compile_internal(builder, fn, fsig,
                                             [ir.Constant(_i64, j), c, *ex_vals, *vals])
            return c
        return carry(acc, carry, extra), codegen
    return apply


# ---- mbarriers (shared-memory arrive/wait barriers with phases) -------------------------------
# Addresses are 32-bit shared byte addresses (``shared_addr`` + offset), 8-byte aligned; the
# ``smem`` argument is the array they point into (the simulator twin keys its state on it).

mbarrier_init = _shared_u32_statement(
    "mbarrier_init", "mbarrier.init.shared::cta.b64 [$0], $1;",
    "Initialise the mbarrier at ``addr``: phase 0, ``count`` arrivals complete a phase.")


def _mbarrier_wait(name, op, doc):
    """A phase test of the mbarrier at ``addr`` (``op``: the instruction and its qualifiers):
    1 once the phase of parity ``parity`` has completed, else 0."""
    def impl(typingctx, smem, addr, parity):
        if not (_is_1d(smem) and isinstance(addr, types.Integer)
                and isinstance(parity, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            a = context.cast(builder, args[1], sig.args[1], types.uint32)
            p = context.cast(builder, args[2], sig.args[2], types.uint32)
            return _asm(builder, _i32, [a, p],
                        f"{{ .reg .pred d; {op}.shared::cta.b64 d, [$1], $2; "
                        "selp.u32 $0, 1, 0, d; }", "=r,r,r,~{memory}", True)
        return types.uint32(smem, addr, parity), codegen
    return _named(impl, name, doc)


def _mbarrier_arrival(name, text, doc):
    """An arrival on the mbarrier at the shared byte address ``addr`` ($0), as ``name(smem,
    addr)``, ordered against memory."""
    def impl(typingctx, smem, addr):
        if not (_is_1d(smem) and isinstance(addr, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            a = context.cast(builder, args[1], sig.args[1], types.uint32)
            _asm(builder, ir.VoidType(), [a], text, "r,~{memory}", True)
            return context.get_dummy_value()
        return types.void(smem, addr), codegen
    return _named(impl, name, doc)


mbarrier_arrive = _mbarrier_arrival(
    "mbarrier_arrive", "{ .reg .b64 st; mbarrier.arrive.shared::cta.b64 st, [$0]; }",
    "One arrival on the mbarrier at ``addr`` (release: this thread's prior shared-memory "
    "reads -- e.g. a retired wgmma's operands -- are done before the phase can complete).")
cp_async_mbarrier_arrive = _mbarrier_arrival(
    "cp_async_mbarrier_arrive", "cp.async.mbarrier.arrive.noinc.shared::cta.b64 [$0];",
    "One arrival on the mbarrier at ``addr`` made when all of this thread's earlier cp.async "
    "copies have landed (``.noinc``: it is one of the arrivals the mbarrier was initialised "
    "to count); the thread goes on at once. A thread waiting on the phase then sees the "
    "copies' bytes.")


mbarrier_try_wait = _mbarrier_wait(
    "mbarrier_try_wait", "mbarrier.try_wait.parity",
    "1 once the phase of parity ``parity`` has completed (acquire), else 0 after a bounded "
    "hardware wait; callers loop (with their own bound).")


trap = _statement(
    "trap", "trap;",
    "Abort the kernel (the host sees a launch failure): for waits that can only time out through "
    "a bug in the kernel itself.")


# ---- bulk async copies (the copy engine inside the SM: no per-lane requests) -----------------

@intrinsic
def mbarrier_arrive_expect_tx(typingctx, smem, addr, tx_bytes):
    """One arrival that also announces ``tx_bytes`` of bulk copies the phase must wait for."""
    if not (_is_1d(smem) and isinstance(addr, types.Integer)
            and isinstance(tx_bytes, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        a = context.cast(builder, args[1], sig.args[1], types.uint32)
        n = context.cast(builder, args[2], sig.args[2], types.uint32)
        _asm(builder, ir.VoidType(), [a, n],
             "{ .reg .b64 st; mbarrier.arrive.expect_tx.shared::cta.b64 st, [$0], $1; }",
             "r,r,~{memory}", True)
        return context.get_dummy_value()
    return types.void(smem, addr, tx_bytes), codegen


@intrinsic
def bulk_store(typingctx, gmem, gidx, smem, saddr, nbytes):
    """Copy ``nbytes`` (multiple of 16) from the shared byte address ``saddr`` to
    ``gmem[gidx:]``; tracked by ``bulk_commit`` / ``bulk_wait`` groups."""
    if not (_is_1d(smem) and _is_1d(gmem) and isinstance(saddr, types.Integer)
            and isinstance(gidx, types.Integer) and isinstance(nbytes, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        gptr = _elem_ptr(context, builder, sig.args[0], args[0], args[1])
        s32 = context.cast(builder, args[3], sig.args[3], types.uint32)
        n = context.cast(builder, args[4], sig.args[4], types.uint32)
        _asm(builder, ir.VoidType(), [gptr, s32, n],
             "{ .reg .u64 g; cvta.to.global.u64 g, $0; "
             "cp.async.bulk.global.shared::cta.bulk_group [g], [$1], $2; }", "l,r,r,~{memory}",
             True)
        return context.get_dummy_value()
    return types.void(gmem, gidx, smem, saddr, nbytes), codegen


bulk_commit = _statement(
    "bulk_commit", "cp.async.bulk.commit_group;",
    "Close this thread's bulk stores issued so far into one group.")


def _setmaxnreg(op):
    def impl(typingctx, regs):
        if not isinstance(regs, types.IntegerLiteral):
            return None
        n = int(regs.literal_value)
        if not (24 <= n <= 256 and n % 8 == 0):
            raise ValueError(f"setmaxnreg: {n} registers, must be a multiple of 8 in 24..256")

        def codegen(context, builder, sig, args):
            _asm(builder, ir.VoidType(), [], f"setmaxnreg.{op}.sync.aligned.u32 {n};",
                 "~{memory}", True)
            return context.get_dummy_value()
        return types.void(regs), codegen
    return impl


setmaxnreg_inc = _named(_setmaxnreg("inc"), "setmaxnreg_inc",
                        "Raise this warpgroup's registers per thread to ``regs`` (a literal; "
                        "every thread of the warpgroup, converged): a warp-specialised "
                        "kernel's compute warpgroups take what its producer gives back.")
setmaxnreg_dec = _named(_setmaxnreg("dec"), "setmaxnreg_dec",
                        "Lower this warpgroup's registers per thread to ``regs`` (a literal; "
                        "every thread of the warpgroup, converged): a producer warpgroup "
                        "that only issues copies gives its registers to the compute ones.")


@intrinsic
def bulk_wait(typingctx, pending):
    """Wait until at most ``pending`` (compile-time) bulk store groups are incomplete (their
    writes done; a fence then publishes them to other threads)."""
    if not isinstance(pending, types.IntegerLiteral):
        return None
    n = int(pending.literal_value)

    def codegen(context, builder, sig, args):
        _asm(builder, ir.VoidType(), [], f"cp.async.bulk.wait_group {n};", "~{memory}", True)
        return context.get_dummy_value()
    return types.void(pending), codegen


@intrinsic
def bulk_wait_read(typingctx, pending):
    """Wait until at most ``pending`` (compile-time) bulk store groups still *read* their
    shared memory: the source may then be overwritten (the global writes may still be in
    flight -- ``bulk_wait`` waits for those)."""
    if not isinstance(pending, types.IntegerLiteral):
        return None
    n = int(pending.literal_value)

    def codegen(context, builder, sig, args):
        _asm(builder, ir.VoidType(), [], f"cp.async.bulk.wait_group.read {n};", "~{memory}",
             True)
        return context.get_dummy_value()
    return types.void(pending), codegen


# ---- TMA: tensor-map box loads and stores (one instruction moves a swizzled tile) -------------
# A tensor map (128 bytes, built on the host by ``mok_core.gemm.tensor_map``) lives in global memory
# in a uint64 array, map i at element 16 i; the instructions take its generic address.

@intrinsic
def tensormap_acquire(typingctx, tmaps, elem):
    """Make the tensor map at ``tmaps[elem:elem + 16]`` (written by the host, generic proxy)
    visible to this thread's TMA loads: the tensormap proxy is not acquired at kernel start
    (PTX memory model), so every thread that issues TMA runs this once before its first use."""
    if not (_is_1d(tmaps) and isinstance(elem, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        p = _elem_ptr(context, builder, sig.args[0], args[0], args[1])
        _asm(builder, ir.VoidType(), [p],
             "fence.proxy.tensormap::generic.acquire.sys [$0], 128;", "l,~{memory}", True)
        return context.get_dummy_value()
    return types.void(tmaps, elem), codegen


def _tma_load_2d_codegen(context, builder, sig, args):
    """Codegen of ``tma_load_2d`` (args: smem, saddr, tmaps, elem, x, y, bar)."""
    s32 = context.cast(builder, args[1], sig.args[1], types.uint32)
    p = _elem_ptr(context, builder, sig.args[2], args[2], args[3])
    cx = context.cast(builder, args[4], sig.args[4], types.int32)
    cy = context.cast(builder, args[5], sig.args[5], types.int32)
    b = context.cast(builder, args[6], sig.args[6], types.uint32)
    _asm(builder, ir.VoidType(), [s32, p, cx, cy, b],
         "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::"
         "bytes [$0], [$1, {$2, $3}], [$4];", "r,l,r,r,r,~{memory}", True)
    return context.get_dummy_value()


def _integers(*values):
    return all(isinstance(v, types.Integer) for v in values)


@intrinsic
def tma_load_2d(typingctx, smem, saddr, tmaps, elem, x, y, bar):
    """Load one box of the 2-D tensor map at ``tmaps[elem:]`` whose origin is (x = column,
    the contiguous dimension; y = row) into the shared byte address ``saddr`` (1024-byte
    aligned: the map's 128-byte swizzle is laid out from there); the box's bytes complete on
    the mbarrier at ``bar``. Parts of the box outside the tensor are zero-filled (and still
    counted in the bytes)."""
    if not (_is_1d(smem) and _is_1d(tmaps) and _integers(saddr, elem, x, y, bar)):
        return None
    return types.void(smem, saddr, tmaps, elem, x, y, bar), _tma_load_2d_codegen


def _tma_store_2d_codegen(context, builder, sig, args):
    # args: tmaps, elem, smem, saddr, x, y
    p = _elem_ptr(context, builder, sig.args[0], args[0], args[1])
    s32 = context.cast(builder, args[3], sig.args[3], types.uint32)
    cx = context.cast(builder, args[4], sig.args[4], types.int32)
    cy = context.cast(builder, args[5], sig.args[5], types.int32)
    _asm(builder, ir.VoidType(), [p, s32, cx, cy],
         "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [$0, {$2, $3}], [$1];",
         "l,r,r,r,~{memory}", True)
    return context.get_dummy_value()


@intrinsic
def tma_store_2d(typingctx, tmaps, elem, smem, saddr, x, y):
    """Store one box from the shared byte address ``saddr`` (1024-byte aligned, laid out with
    the map's 128-byte swizzle) into the 2-D tensor map at ``tmaps[elem:]`` at origin (x =
    column, y = row; both >= 0: a negative origin faults on the H200, unlike a load's); parts
    of the box past the tensor's end are not written. A bulk store:
    grouped by ``bulk_commit``, waited by ``bulk_wait_read`` (the source may be reused) and
    ``bulk_wait``; the generic-proxy writes of the source need ``fence_proxy_async`` first."""
    if not (_is_1d(smem) and _is_1d(tmaps) and _integers(elem, saddr, x, y)):
        return None
    return types.void(tmaps, elem, smem, saddr, x, y), _tma_store_2d_codegen


fence_mbarrier_init = _statement(
    "fence_mbarrier_init", "fence.mbarrier_init.release.cluster;",
    "Make this thread's mbarrier.init visible to the async proxy (the TMA unit completes bytes "
    "on those barriers); a block barrier follows.")
