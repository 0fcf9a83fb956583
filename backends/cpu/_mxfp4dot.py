"""16-lane pieces of the MXFP4 x Q8_0 dot (mxfp4.py): ggml's AVX2 ggml_vec_dot_mxfp4_q8_0
written as portable LLVM vector IR, so a row's sum is formed exactly as llama.cpp forms it.

ggml takes two blocks per step. A block's 32 codes (LUT of the low nibbles, then of the
high nibbles) times its 32 activation codes give 8 int32 lanes, lane i the exact sum of
products 4i..4i+3; each lane goes to float32 and into an 8-lane accumulator with one FMA by
d = act_scale * e8m0_half (even blocks into one accumulator, odd into another). At the end
the two accumulators are added lane by lane and hsum_float_8 adds lanes (i, i + 4), then
(0, 2) and (1, 3), then those two. Here the two accumulators are lanes 0-7 and 8-15 of one
16-lane vector. An odd last block is added in scalar, d * sum, as ggml's tail loop.
"""
from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from ._int8 import HAVE_SIMD
from ._simd import f16x, i16x

# x86 with AVX2 (so SSSE3): the nibble -> code table is one pshufb per 16 nibbles and the
# products go through vpmaddubsw / vpmaddwd as in ggml; else the same values by portable
# vector arithmetic (_codes, _quads), which any LLVM target compiles
_PSHUFB = HAVE_SIMD
_KVALUES = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12]

_I8, _I16, _I32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
_F = ir.FloatType()
_VF = ir.VectorType(_F, 16)
_VI = ir.VectorType(_I32, 16)


def _const(ty, n, x):
    return ir.Constant(ir.VectorType(ty, n), [x] * n)


def _shuf(builder, a, b, idx):
    return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_I32, len(idx)), idx))


def _load(context, builder, arrty, arr, off, n):
    ary = context.make_array(arrty)(context, builder, arr)
    p = builder.gep(builder.bitcast(ary.data, _I8.as_pointer()), [off])
    return builder.load(builder.bitcast(p, ir.VectorType(_I8, n).as_pointer()), align=1)


def _codes(builder, n):
    """<32 x i8> nibbles -> the doubled e2m1 values (0 1 2 3 4 6 8 12, negated when bit 3 is
    set): m < 4 is m itself, else (2 | m & 1) << ((m >> 1) - 1)."""
    c = lambda x: _const(_I8, 32, x)       # noqa: E731
    m = builder.and_(n, c(7))
    shift = builder.and_(builder.sub(builder.lshr(m, c(1)), c(1)), c(3))
    big = builder.shl(builder.or_(builder.and_(m, c(1)), c(2)), shift)
    mag = builder.select(builder.icmp_unsigned("<", m, c(4)), m, big)
    return builder.select(builder.icmp_unsigned(">=", n, c(8)), builder.sub(c(0), mag), mag)


def _x86(builder, name, ret, args):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]),
                                        name)
    return builder.call(fn, args)


def _block_codes(context, builder, arrty, arr, off):
    """<32 x i8> codes of the block whose nibble bytes start at byte offset off: the low
    nibbles' values, then the high nibbles'."""
    nib = _load(context, builder, arrty, arr, off, 16)
    lo = builder.and_(nib, _const(_I8, 16, 15))
    hi = builder.lshr(nib, _const(_I8, 16, 4))
    if _PSHUFB:
        table = ir.Constant(ir.VectorType(_I8, 16), _KVALUES)
        look = lambda idx: _x86(builder, "llvm.x86.ssse3.pshuf.b.128", ir.VectorType(_I8, 16),  # noqa: E731
                                [table, idx])
        return _shuf(builder, look(lo), look(hi), list(range(32)))
    return _codes(builder, _shuf(builder, lo, hi, list(range(32))))


def _quads(builder, code, act):
    """<8 x i32>: lane i the exact sum of code[j] * act[j] for j = 4i..4i+3. With AVX2 ggml's
    own sequence (|code| x act with code's sign by vpmaddubsw, pairs by vpmaddwd: no
    saturation, |pair| <= 2 * 12 * 127); else widened products and two pairwise adds."""
    if _PSHUFB:
        v32 = ir.VectorType(_I8, 32)
        mag = _x86(builder, "llvm.x86.avx2.psign.b", v32, [code, code])
        sact = _x86(builder, "llvm.x86.avx2.psign.b", v32, [act, code])
        p16 = _x86(builder, "llvm.x86.avx2.pmadd.ub.sw", ir.VectorType(_I16, 16), [mag, sact])
        return _x86(builder, "llvm.x86.avx2.pmadd.wd", ir.VectorType(_I32, 8),
                    [p16, _const(_I16, 16, 1)])
    prod = builder.mul(builder.sext(code, ir.VectorType(_I16, 32)),
                       builder.sext(act, ir.VectorType(_I16, 32)))
    p = builder.sext(prod, ir.VectorType(_I32, 32))
    pairs = builder.add(_shuf(builder, p, p, list(range(0, 32, 2))),
                        _shuf(builder, p, p, list(range(1, 32, 2))))
    return builder.add(_shuf(builder, pairs, pairs, list(range(0, 16, 2))),
                       _shuf(builder, pairs, pairs, list(range(1, 16, 2))))


def _at(builder, off, k):
    return builder.add(off, ir.Constant(off.type, k))


@intrinsic
def quad_sums2(typingctx, w, wo, qa, qo):
    """int32 lanes: 0-7 the sums of products 4i..4i+3 of the MXFP4 block at byte offset wo of
    w (its nibbles from wo + 1) with the 32 int8 activation codes at qa[qo:], 8-15 the same
    for the next block (wo + 17, qo + 32). Exact: |product| <= 12 * 127."""
    def codegen(context, builder, sig, args):
        quads = []
        for b in range(2):
            code = _block_codes(context, builder, sig.args[0], args[0], _at(builder, args[1], 1 + 17 * b))
            act = _load(context, builder, sig.args[2], args[2], _at(builder, args[3], 32 * b), 32)
            quads.append(_quads(builder, code, act))
        return _shuf(builder, quads[0], quads[1], list(range(16)))
    return i16x(w, wo, qa, qo), codegen


@intrinsic
def store_codes2(typingctx, w, wo, codes, co):
    """The codes of the blocks at byte offsets wo and wo + 17 of w into the int8 array codes
    at co..co+63 (a row decoded once for many activation rows)."""
    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[2])(context, builder, args[2])
        base = builder.bitcast(ary.data, _I8.as_pointer())
        for b in range(2):
            code = _block_codes(context, builder, sig.args[0], args[0], _at(builder, args[1], 1 + 17 * b))
            p = builder.gep(base, [_at(builder, args[3], 32 * b)])
            builder.store(code, builder.bitcast(p, ir.VectorType(_I8, 32).as_pointer()), align=1)
        return context.get_dummy_value()
    return types.none(w, wo, codes, co), codegen


@intrinsic
def quad_sums2_codes(typingctx, codes, co, qa, qo):
    """quad_sums2 from codes already decoded (store_codes2) at codes[co:co + 64]."""
    def codegen(context, builder, sig, args):
        quads = []
        for b in range(2):
            code = _load(context, builder, sig.args[0], args[0], _at(builder, args[1], 32 * b), 32)
            act = _load(context, builder, sig.args[2], args[2], _at(builder, args[3], 32 * b), 32)
            quads.append(_quads(builder, code, act))
        return _shuf(builder, quads[0], quads[1], list(range(16)))
    return i16x(codes, co, qa, qo), codegen


@intrinsic
def dsplat2(typingctx, a, b):
    """float32 lanes 0-7 = a, 8-15 = b."""
    def codegen(context, builder, sig, args):
        v = ir.Constant(_VF, ir.Undefined)
        for lane in range(16):
            x = context.cast(builder, args[lane // 8], sig.args[lane // 8], types.float32)
            v = builder.insert_element(v, x, ir.Constant(_I32, lane))
        return v
    return f16x(a, b), codegen


@intrinsic
def hsum_ggml(typingctx, v):
    """(lanes 0-7 + lanes 8-15), then hsum_float_8's order: s[i + 4] + s[i], then lanes
    (0 + 2) + (1 + 3). float32."""
    def codegen(context, builder, sig, args):
        x = args[0]
        s = builder.fadd(_shuf(builder, x, x, list(range(8))), _shuf(builder, x, x, list(range(8, 16))))
        r = builder.fadd(_shuf(builder, s, s, [4, 5, 6, 7]), _shuf(builder, s, s, [0, 1, 2, 3]))
        e = lambda i: builder.extract_element(r, ir.Constant(_I32, i))   # noqa: E731
        return builder.fadd(builder.fadd(e(0), e(2)), builder.fadd(e(1), e(3)))
    return types.float32(v), codegen
