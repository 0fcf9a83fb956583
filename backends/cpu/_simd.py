"""16-lane SIMD values for numba kernels (a tiny intrinsics layer over LLVM vectors).

numba's auto-vectorizer gives up on the block decoders: LLVM fully unrolls the fixed 32-trip
loops first and the SLP vectorizer cannot prove that the output buffer does not alias the
weights, so the code stays scalar. These types make the vector width explicit instead,
the way C intrinsics do: `F16x` is a <16 x float> and `I16x` a <16 x i32> that live in
registers across loop iterations. Loads take an array plus a flat element offset into its
C-contiguous data (no bounds check: the kernels compute offsets from validated shapes).

All float ops here are plain IEEE mul/add/sub (no contraction), so decoders written with
them stay bit-exact; `vfma` is the one fused op, used only in dot products.
"""
from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils, types
from numba.core.datamodel import models
from numba.extending import intrinsic, register_model

_F = ir.FloatType()
_I32 = ir.IntType(32)
_VF = ir.VectorType(_F, 16)
_VI = ir.VectorType(_I32, 16)
_V8 = ir.VectorType(ir.IntType(8), 16)


class F16xType(types.Type):
    def __init__(self):
        super().__init__(name="f32x16")


class I16xType(types.Type):
    def __init__(self):
        super().__init__(name="i32x16")


f16x = F16xType()
i16x = I16xType()


@register_model(F16xType)
class _F16xModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VF)


@register_model(I16xType)
class _I16xModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VI)


def _ptr(context, builder, arrty, arr, off, elem_vec_ty):
    ary = context.make_array(arrty)(context, builder, arr)
    p = builder.gep(ary.data, [off])
    return builder.bitcast(p, elem_vec_ty.as_pointer())


def _splat(builder, scalar, vecty):
    v = builder.insert_element(ir.Constant(vecty, ir.Undefined), scalar, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vecty, ir.Undefined), ir.Constant(_VI, [0] * 16))


def _as_i32(context, builder, ty, val):
    return context.cast(builder, val, ty, types.int32)


def _as_f32(context, builder, ty, val):
    return context.cast(builder, val, ty, types.float32)


# ----------------------------------------------------------------- float vectors

@intrinsic
def vzero(typingctx):
    def codegen(context, builder, sig, args):
        return ir.Constant(_VF, None)
    return f16x(), codegen


@intrinsic
def vsplat(typingctx, x):
    def codegen(context, builder, sig, args):
        return _splat(builder, _as_f32(context, builder, sig.args[0], args[0]), _VF)
    return f16x(x), codegen


@intrinsic
def vload(typingctx, arr, off):
    """16 float32 from a float32 array at flat element offset off."""
    if not isinstance(arr, types.Array) or arr.dtype != types.float32:
        return None

    def codegen(context, builder, sig, args):
        p = _ptr(context, builder, sig.args[0], args[0], args[1], _VF)
        return builder.load(p, align=4)
    return f16x(arr, off), codegen


@intrinsic
def vstore(typingctx, arr, off, v):
    if not isinstance(arr, types.Array) or arr.dtype != types.float32:
        return None

    def codegen(context, builder, sig, args):
        p = _ptr(context, builder, sig.args[0], args[0], args[1], _VF)
        builder.store(args[2], p, align=4)
        return context.get_dummy_value()
    return types.none(arr, off, v), codegen


def _fbin(op):
    @intrinsic
    def f(typingctx, a, b):
        def codegen(context, builder, sig, args):
            return getattr(builder, op)(args[0], args[1])
        return f16x(a, b), codegen
    return f


vadd = _fbin("fadd")
vsub = _fbin("fsub")
vmul = _fbin("fmul")


@intrinsic
def vfma(typingctx, a, b, c):
    """a * b + c with one rounding (llvm.fma): for dot products only, not for exact decoding."""
    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VF, [_VF] * 3), "llvm.fma.v16f32")
        return builder.call(fn, list(args))
    return f16x(a, b, c), codegen


@intrinsic
def vhsum(typingctx, v):
    """Sum of the 16 lanes (pairwise tree), as float32."""
    def codegen(context, builder, sig, args):
        x = args[0]
        u = ir.Constant(_VF, ir.Undefined)
        for width in (8, 4, 2, 1):
            hi = builder.shuffle_vector(x, u, ir.Constant(_VI, list(range(width, 2 * width)) + [0] * (16 - width)))
            x = builder.fadd(x, hi)
        return builder.extract_element(x, ir.Constant(_I32, 0))
    return types.float32(v), codegen


# ----------------------------------------------------------------- int vectors

@intrinsic
def iload_u8(typingctx, arr, off):
    """16 bytes at flat byte offset off of a uint8 array, zero-extended to int32 lanes."""
    def codegen(context, builder, sig, args):
        p = _ptr(context, builder, sig.args[0], args[0], args[1], _V8)
        return builder.zext(builder.load(p, align=1), _VI)
    return i16x(arr, off), codegen


@intrinsic
def iload_i8(typingctx, arr, off):
    """16 bytes at flat byte offset off, as signed int8 sign-extended to int32 lanes."""
    def codegen(context, builder, sig, args):
        p = _ptr(context, builder, sig.args[0], args[0], args[1], _V8)
        return builder.sext(builder.load(p, align=1), _VI)
    return i16x(arr, off), codegen


def _ibin_scalar(op):
    @intrinsic
    def f(typingctx, a, k):
        def codegen(context, builder, sig, args):
            s = _splat(builder, _as_i32(context, builder, sig.args[1], args[1]), _VI)
            return getattr(builder, op)(args[0], s)
        return i16x(a, k), codegen
    return f


iand = _ibin_scalar("and_")       # lanes & k
ishr = _ibin_scalar("lshr")       # lanes >> k (logical)
ishl = _ibin_scalar("shl")        # lanes << k
iaddk = _ibin_scalar("add")       # lanes + k


@intrinsic
def ior(typingctx, a, b):
    def codegen(context, builder, sig, args):
        return builder.or_(args[0], args[1])
    return i16x(a, b), codegen


@intrinsic
def ibits(typingctx, word, first):
    """Lane j = bit (first + j) of the 32-bit scalar word (Q5_0/Q5_1 high bits)."""
    def codegen(context, builder, sig, args):
        w = _splat(builder, _as_i32(context, builder, sig.args[0], args[0]), _VI)
        f = _splat(builder, _as_i32(context, builder, sig.args[1], args[1]), _VI)
        sh = builder.add(f, ir.Constant(_VI, list(range(16))))
        return builder.and_(builder.lshr(w, sh), ir.Constant(_VI, [1] * 16))
    return i16x(word, first), codegen


@intrinsic
def itof(typingctx, a):
    """int32 lanes -> float32 lanes (exact for the small integers of quantized weights)."""
    def codegen(context, builder, sig, args):
        return builder.sitofp(args[0], _VF)
    return f16x(a), codegen


# ----------------------------------------------------------------- raw float loads from bytes

def _byte_ptr(context, builder, arrty, arr, off, vecty):
    ary = context.make_array(arrty)(context, builder, arr)
    p = builder.gep(builder.bitcast(ary.data, ir.IntType(8).as_pointer()), [off])
    return builder.bitcast(p, vecty.as_pointer())


@intrinsic
def bload_f32(typingctx, arr, off):
    """16 little-endian float32 at byte offset off of a byte array."""
    def codegen(context, builder, sig, args):
        return builder.load(_byte_ptr(context, builder, sig.args[0], args[0], args[1], _VF), align=1)
    return f16x(arr, off), codegen


@intrinsic
def bload_f16(typingctx, arr, off):
    """16 IEEE halves at byte offset off, widened exactly to float32 (vcvtph2ps)."""
    def codegen(context, builder, sig, args):
        h = builder.load(_byte_ptr(context, builder, sig.args[0], args[0], args[1],
                                   ir.VectorType(ir.HalfType(), 16)), align=1)
        return builder.fpext(h, _VF)
    return f16x(arr, off), codegen


@intrinsic
def bload_bf16(typingctx, arr, off):
    """16 bfloat16 at byte offset off, widened exactly to float32 (shift into the high half)."""
    def codegen(context, builder, sig, args):
        h = builder.load(_byte_ptr(context, builder, sig.args[0], args[0], args[1],
                                   ir.VectorType(ir.IntType(16), 16)), align=1)
        wide = builder.shl(builder.zext(h, _VI), ir.Constant(_VI, [16] * 16))
        return builder.bitcast(wide, _VF)
    return f16x(arr, off), codegen


# ----------------------------------------------------------------- scalars and lanes

def _half_lane(context, builder, arrty, arr, off, lane):
    # Widen a whole 16-byte vector of halves (vcvtph2ps with a memory operand) and keep one
    # lane. A scalar 16-bit load is lowered to vpinsrw, which merges into whatever register
    # LLVM picks: in Q8_0 that was the accumulator, a false dependency chaining every block
    # to the previous block's FMA.
    p = _byte_ptr(context, builder, arrty, arr, off, ir.VectorType(ir.HalfType(), 8))
    f = builder.fpext(builder.load(p, align=1), ir.VectorType(_F, 8))
    return builder.extract_element(f, ir.Constant(_I32, lane))


@intrinsic
def hload(typingctx, arr, off):
    """The IEEE half at byte offset off of a byte array, as float32 (exact hardware widening;
    a signaling NaN comes back quiet). Reads 16 bytes from off: they must exist."""
    def codegen(context, builder, sig, args):
        return _half_lane(context, builder, sig.args[0], args[0], args[1], 0)
    return types.float32(arr, off), codegen


@intrinsic
def hload_end(typingctx, arr, off):
    """Like hload for a half near the end of a block: reads the 16 bytes ending with it."""
    def codegen(context, builder, sig, args):
        start = builder.sub(args[1], ir.Constant(args[1].type, 14))
        return _half_lane(context, builder, sig.args[0], args[0], start, 7)
    return types.float32(arr, off), codegen


@intrinsic
def vlane(typingctx, v, j):
    """All 16 lanes set to lane j of v (j a small constant after unrolling)."""
    def codegen(context, builder, sig, args):
        x = builder.extract_element(args[0], _as_i32(context, builder, sig.args[1], args[1]))
        return _splat(builder, x, _VF)
    return f16x(v, j), codegen


@intrinsic
def kq_scales(typingctx, arr, off):
    """The 8 scales and 8 mins of a Q4_K/Q5_K block as int32 lanes [sc0..sc7, m0..m7].

    `off` is the byte offset of the 12 packed scale bytes; 16 bytes are read (the block
    continues after them). Layout (ggml get_scale_min_k4): for j < 4, sc = b[j] & 63 and
    m = b[j+4] & 63; for j >= 4, sc = (b[j+4] & 15) | ((b[j-4] >> 2) & 48) and
    m = (b[j+4] >> 4) | ((b[j] >> 2) & 48).
    """
    def codegen(context, builder, sig, args):
        p = _byte_ptr(context, builder, sig.args[0], args[0], args[1], _V8)
        v = builder.zext(builder.load(p, align=1), _VI)
        u = ir.Constant(_VI, ir.Undefined)
        a = builder.shuffle_vector(v, u, ir.Constant(_VI, [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11]))
        b = builder.shuffle_vector(v, u, ir.Constant(_VI, [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 4, 5, 6, 7]))
        sh_a = ir.Constant(_VI, [0] * 12 + [4] * 4)
        mask_a = ir.Constant(_VI, [63] * 4 + [15] * 4 + [63] * 4 + [15] * 4)
        mask_b = ir.Constant(_VI, [0] * 4 + [48] * 4 + [0] * 4 + [48] * 4)
        lo = builder.and_(builder.lshr(a, sh_a), mask_a)
        hi = builder.and_(builder.lshr(b, ir.Constant(_VI, [2] * 16)), mask_b)
        return builder.or_(lo, hi)
    return i16x(arr, off), codegen


@intrinsic
def u32load(typingctx, arr, off):
    """The little-endian uint32 at byte offset off of a byte array (unaligned)."""
    def codegen(context, builder, sig, args):
        return builder.load(_byte_ptr(context, builder, sig.args[0], args[0], args[1], _I32), align=1)
    return types.uint32(arr, off), codegen


@intrinsic
def q3k_scales(typingctx, arr, off):
    """The 16 signed 6-bit scales of a Q3_K block as int32 lanes.

    `off` is the byte offset of the block's scale bytes minus 2 (16 bytes are read and must
    stay inside the block, which ends 2 bytes after the scales). Scale k is
    ((b[k % 8] >> 4 * (k // 8)) & 15) | (((b[8 + k % 4] >> 2 * (k // 4)) & 3) << 4), minus 32.
    """
    def codegen(context, builder, sig, args):
        p = _byte_ptr(context, builder, sig.args[0], args[0], args[1], _V8)
        v = builder.zext(builder.load(p, align=1), _VI)
        u = ir.Constant(_VI, ir.Undefined)
        a = builder.shuffle_vector(v, u, ir.Constant(_VI, [2 + (k & 7) for k in range(16)]))
        b = builder.shuffle_vector(v, u, ir.Constant(_VI, [10 + (k & 3) for k in range(16)]))
        lo = builder.and_(builder.lshr(a, ir.Constant(_VI, [4 * (k >> 3) for k in range(16)])),
                          ir.Constant(_VI, [15] * 16))
        hi = builder.and_(builder.lshr(b, ir.Constant(_VI, [2 * (k >> 2) for k in range(16)])),
                          ir.Constant(_VI, [3] * 16))
        sc = builder.or_(lo, builder.shl(hi, ir.Constant(_VI, [4] * 16)))
        return builder.sub(sc, ir.Constant(_VI, [32] * 16))
    return i16x(arr, off), codegen


@intrinsic
def iload_w32(typingctx, arr, off):
    """64 bytes at byte offset off as 16 little-endian uint32 lanes (4 consecutive bytes per
    lane): bytes are then taken apart with shifts, without the vpmovzx shuffles."""
    def codegen(context, builder, sig, args):
        return builder.load(_byte_ptr(context, builder, sig.args[0], args[0], args[1], _VI), align=1)
    return i16x(arr, off), codegen


@intrinsic
def vpair(typingctx, v, a, b):
    """Lanes 0-7 set to lane a of v, lanes 8-15 to lane b (constants after unrolling)."""
    def codegen(context, builder, sig, args):
        xa = _splat(builder, builder.extract_element(args[0], _as_i32(context, builder, sig.args[1], args[1])), _VF)
        xb = _splat(builder, builder.extract_element(args[0], _as_i32(context, builder, sig.args[2], args[2])), _VF)
        return builder.shuffle_vector(xa, xb, ir.Constant(_VI, list(range(8)) + list(range(24, 32))))
    return f16x(v, a, b), codegen


@intrinsic
def iload_w32_dup(typingctx, arr, off):
    """32 bytes at byte offset off as 8 uint32 lanes, repeated in lanes 8-15."""
    def codegen(context, builder, sig, args):
        v8 = builder.load(_byte_ptr(context, builder, sig.args[0], args[0], args[1],
                                    ir.VectorType(_I32, 8)), align=1)
        return builder.shuffle_vector(v8, ir.Constant(ir.VectorType(_I32, 8), ir.Undefined),
                                      ir.Constant(_VI, list(range(8)) * 2))
    return i16x(arr, off), codegen


@intrinsic
def ishr2(typingctx, v, a, b):
    """Lanes 0-7 shifted right by a, lanes 8-15 by b (logical)."""
    def codegen(context, builder, sig, args):
        sa = _splat(builder, _as_i32(context, builder, sig.args[1], args[1]), _VI)
        sb = _splat(builder, _as_i32(context, builder, sig.args[2], args[2]), _VI)
        sh = builder.shuffle_vector(sa, sb, ir.Constant(_VI, list(range(8)) + list(range(24, 32))))
        return builder.lshr(args[0], sh)
    return i16x(v, a, b), codegen


@intrinsic
def vquad(typingctx, v, a, b, c, d):
    """Lanes 0-3, 4-7, 8-11, 12-15 set to lanes a, b, c, d of v."""
    def codegen(context, builder, sig, args):
        parts = [_splat(builder, builder.extract_element(args[0], _as_i32(context, builder, t, x)), _VF)
                 for t, x in zip(sig.args[1:], args[1:])]
        lo = builder.shuffle_vector(parts[0], parts[1], ir.Constant(_VI, [0, 1, 2, 3, 16, 17, 18, 19] + [0] * 8))
        hi = builder.shuffle_vector(parts[2], parts[3], ir.Constant(_VI, [0, 1, 2, 3, 16, 17, 18, 19] + [0] * 8))
        return builder.shuffle_vector(lo, hi, ir.Constant(_VI, list(range(8)) + list(range(16, 24))))
    return f16x(v, a, b, c, d), codegen
