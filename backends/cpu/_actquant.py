"""Activation quantization for the integer-dot matmul (_int8.py).

The activation codes ggml's CPU backend feeds each weight type's dot product: Q8_0 blocks of
32 for the legacy quants, Q8_K blocks of 256 for the k-quants (kernels.quantize_act_block,
which the float path's act_round_q8_0/_k use too). The same pass writes, per weight block of
B columns, what the tile loop needs: da (the activation scale), bsf (sum of the codes) and zb
(zero_point * that sum; the sum itself for formats without a zero point, see block_zb), as
[nb, M].

`quantize_rows` does it with 16-lane vectors (LLVM IR below: numba leaves the scalar loops of
quantize_act_block unvectorized, the amax search because of its branch and signed maximum).
It gives the same bits as the scalar reference `quantize_rows_ref`:
- the block's maximum |x| is a max reduction of |x| (Q8_0) or a max and a min reduction (Q8_K),
  exact in any order;
- Q8_K's signed maximum (the first value of largest magnitude) is the maximum or the minimum,
  whichever is larger in magnitude; when they tie (+a and -a both present) a scalar scan finds
  the first, as the reference does;
- codes are rint(x * scale) (round half to even, IEEE float32 multiply), Q8_K's clamped at 127,
  exactly the reference's operations; the scales come from the same scalar expressions.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from . import _stamp
from ._swiglu import swiglu_row_to
from .kernels import quantize_act_block, round_f16

_DEPS = ("kernels.py", "_simd.py", "_swiglu.py")   # inlined here (quantize_act_block,
                                                   # swiglu_row_to and their deps)
_DEPS_HASH = "a0bded79483dbd94"

_CACHE = _stamp.current(_DEPS, _DEPS_HASH)
_PJIT = dict(nogil=True, cache=_CACHE, parallel=True, fastmath=False)
_JIT = dict(nogil=True, cache=_CACHE, fastmath=False)

# -- 16-lane IR for one activation block --------------------------------------------------

_F32 = ir.FloatType()
_I8 = ir.IntType(8)
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_VF = ir.VectorType(_F32, 16)
_VI = ir.VectorType(_I32, 16)
_VB = ir.VectorType(_I8, 16)


def _decl(builder, name, ret, args):
    mod = builder.module
    fn = mod.globals.get(name)
    if fn is None:
        fn = ir.Function(mod, ir.FunctionType(ret, args), name=name)
    return fn


def _vptr(builder, addr, offset, ty):
    if offset:
        addr = builder.add(addr, ir.Constant(_I64, offset))
    return builder.inttoptr(addr, ty.as_pointer())


def _splat(builder, x, vty):
    undef = ir.Constant(vty, ir.Undefined)
    v = builder.insert_element(undef, x, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, undef, ir.Constant(_VI, [0] * 16))


def _make_minmax(A: int):
    """(max, min) of the A float32 at address xp (maxnum/minnum: a NaN is passed over, as the
    reference's `abs(v) > amax` passes over it)."""
    n = A // 16

    def codegen(context, builder, sig, args):
        xp = args[0]
        vmax = _decl(builder, "llvm.maxnum.v16f32", _VF, [_VF, _VF])
        vmin = _decl(builder, "llvm.minnum.v16f32", _VF, [_VF, _VF])
        rmax = _decl(builder, "llvm.vector.reduce.fmax.v16f32", _F32, [_VF])
        rmin = _decl(builder, "llvm.vector.reduce.fmin.v16f32", _F32, [_VF])
        v = [builder.load(_vptr(builder, xp, 64 * i, _VF), align=4) for i in range(n)]
        hi, lo = v[0], v[0]
        for i in range(1, n):
            hi = builder.call(vmax, [hi, v[i]])
            lo = builder.call(vmin, [lo, v[i]])
        hs, ls = builder.call(rmax, [hi]), builder.call(rmin, [lo])
        return context.make_tuple(builder, sig.return_type, [hs, ls])

    @intrinsic
    def minmax(typingctx, xp):
        return types.UniTuple(types.float32, 2)(types.intp), codegen
    return minmax


def _make_absmax(A: int):
    """max |x| of the A float32 at address xp (Q8_0 needs no sign: one reduction)."""
    n = A // 16

    def codegen(context, builder, sig, args):
        xp = args[0]
        vmax = _decl(builder, "llvm.maxnum.v16f32", _VF, [_VF, _VF])
        fabs = _decl(builder, "llvm.fabs.v16f32", _VF, [_VF])
        rmax = _decl(builder, "llvm.vector.reduce.fmax.v16f32", _F32, [_VF])
        m = None
        for i in range(n):
            v = builder.call(fabs, [builder.load(_vptr(builder, xp, 64 * i, _VF), align=4)])
            m = v if m is None else builder.call(vmax, [m, v])
        return builder.call(rmax, [m])

    @intrinsic
    def absmax(typingctx, xp):
        return types.float32(types.intp), codegen
    return absmax


def _make_codes(A: int, B: int):
    """Codes of the A float32 at xp: int8(rint(x * scale)) (clamped at 127 when clamp != 0)
    stored at qp; per B-column group g, at byte offset g * sstride: zb (block_zb of the
    codes' sum, int32) at sp, the sum as float32 at bp, and d at dp. Stored, never read back:
    with M = 512 the groups are 2 KB apart, and loads of what was just stored 4 KB away
    stalled (Q6_K's 16-column groups quantized at a third of the rate with M = 512 than with
    M = 520)."""
    n = A // 16
    per = B // 16

    def codegen(context, builder, sig, args):
        xp, qp, scale, clamp, sp, sstride, dp, bp, d, zp = args
        rint = _decl(builder, "llvm.rint.v16f32", _VF, [_VF])
        vmin = _decl(builder, "llvm.minnum.v16f32", _VF, [_VF, _VF])
        radd = _decl(builder, "llvm.vector.reduce.add.v16i32", _I32, [_VI])
        vs = _splat(builder, scale, _VF)
        c127 = ir.Constant(_VF, [127.0] * 16)
        do_clamp = builder.icmp_signed("!=", clamp, ir.Constant(_I64, 0))
        zp32 = builder.trunc(zp, _I32)
        no_zp = builder.icmp_signed("==", zp32, ir.Constant(_I32, 0))
        group = None
        for i in range(n):
            x = builder.load(_vptr(builder, xp, 64 * i, _VF), align=4)
            y = builder.call(rint, [builder.fmul(x, vs)])
            y = builder.select(do_clamp, builder.call(vmin, [y, c127]), y)
            q = builder.trunc(builder.fptosi(y, _VI), _VB)
            builder.store(q, _vptr(builder, qp, 16 * i, _VB), align=1)
            c = builder.sext(q, _VI)          # the sums are of the codes as stored
            group = c if group is None else builder.add(group, c)
            if (i + 1) % per == 0:
                g = (i + 1) // per - 1
                off = builder.mul(sstride, ir.Constant(_I64, g))
                sm = builder.call(radd, [group])
                zb = builder.select(no_zp, sm, builder.mul(zp32, sm))          # block_zb
                builder.store(zb, builder.inttoptr(builder.add(sp, off), _I32.as_pointer()),
                              align=4)
                builder.store(builder.sitofp(sm, _F32),
                              builder.inttoptr(builder.add(bp, off), _F32.as_pointer()), align=4)
                builder.store(d, builder.inttoptr(builder.add(dp, off), _F32.as_pointer()),
                              align=4)
                group = None
        return context.get_dummy_value()

    @intrinsic
    def codes(typingctx, xp, qp, scale, clamp, sp, sstride, dp, bp, d, zp):
        return types.void(types.intp, types.intp, types.float32, types.intp, types.intp,
                          types.intp, types.intp, types.intp, types.float32, types.intp), codegen
    return codes


_absmax32, _minmax256 = _make_absmax(32), _make_minmax(256)
_codes_32_32, _codes_256_32, _codes_256_16 = (_make_codes(32, 32), _make_codes(256, 32),
                                              _make_codes(256, 16))


@njit(inline="always", nogil=True)
def _codes(A, B, xp, qp, scale, clamp, sp, sstride, dp, bp, d, zp):
    if A == 32:
        _codes_32_32(xp, qp, scale, clamp, sp, sstride, dp, bp, d, zp)
    elif B == 32:
        _codes_256_32(xp, qp, scale, clamp, sp, sstride, dp, bp, d, zp)
    else:
        _codes_256_16(xp, qp, scale, clamp, sp, sstride, dp, bp, d, zp)


@njit(inline="always", nogil=True)
def block_zb(sm, zp):
    """zb of a block whose codes sum to sm: zero_point * sm, and for the formats without a
    zero point (zp = 0: those with minimums) sm itself, the block sum the k-quant tile
    kernels take as an integer (see _int8's module doc)."""
    return np.int32(sm) if zp == 0 else np.int32(np.int32(zp) * np.int32(sm))


@njit(inline="always", nogil=True)
def _quantize_block_vec(x, xr, r, ab, A, B, zp, qa, da, bsf, zb):
    """x[xr, ab*A : (ab+1)*A] -> row r's qa codes and, per B-column weight block, da, bsf,
    zb (xr = r but for a source of a few rows: quantize_swiglu_rows)."""
    K = qa.shape[1]
    S = da.shape[1]                     # the [nb, S] arrays' row stride (entry_stride)
    b0 = ab * A
    xp = x.ctypes.data + (xr * K + b0) * 4
    if A == 32:
        amax = _absmax32(xp)
        hi, lo = amax, -amax          # (Q8_0 uses amax only)
    else:
        hi, lo = _minmax256(xp)
        amax = max(hi, -lo)
    wb0 = b0 // B
    nwb = A // B
    if not amax > 0.0:            # all zeros (or no number at all): codes 0, scale 0
        for j in range(A):
            qa[r, b0 + j] = 0
        for wb in range(wb0, wb0 + nwb):
            da[wb, r] = 0.0
            bsf[wb, r] = 0.0
            zb[wb, r] = 0
        return
    if A == 32:
        scale = np.float32(127.0) / amax
        d = round_f16(amax / np.float32(127.0))
        clamp = 0
    else:
        if hi > -lo:
            mx = hi
        elif -lo > hi:
            mx = lo
        else:                     # +amax and -amax both present: the first one counts
            mx = hi
            for j in range(A):
                if abs(x[xr, b0 + j]) == amax:
                    mx = x[xr, b0 + j]
                    break
        scale = np.float32(-127.0) / mx
        d = np.float32(1.0) / scale
        clamp = 1
    e = (wb0 * S + r) * 4               # [wb0, r] of the [nb, S] arrays
    _codes(A, B, xp, qa.ctypes.data + r * K + b0, scale, clamp, zb.ctypes.data + e, S * 4,
           da.ctypes.data + e, bsf.ctypes.data + e, d, zp)


ROW_GROUP = 16     # rows quantized together, block by block (see _quantize_rows_of)


def entry_stride(M: int) -> int:
    """Row stride (entries) of the [nb, S] arrays da, bsf, zb for M activation rows: M itself
    up to 16 rows (decode: a block's entries share a line anyway), else M rounded up to whole
    64-byte lines, an odd number of them. With M = 512 (a prefill chunk) consecutive blocks'
    entries were 2 KB apart and fell into two L1 sets, for the quantization writing them and
    the tile loop reading them: 16-column blocks quantized at half the rate of M = 496, and
    Q6_K products ran 7% slower."""
    if M <= 16:
        return M
    return 16 * (((M + 15) // 16) | 1)


@njit(**_PJIT)
def quantize_rows(x, A, B, zp, qa, da, bsf, zb, par):
    """x float32[M, K] (C-contiguous) -> int8 codes qa[M, K] and the per-weight-block da, bsf,
    zb [K/B, S] (S >= M, entry_stride(M) for speed; columns M.. are not written);
    par=False: on the calling thread (small inputs: no parallel region to wake)."""
    M, K = x.shape
    na = K // A
    nc = (M + ROW_GROUP - 1) // ROW_GROUP
    if par:
        for c in prange(nc):
            _quantize_rows_of(x, c, A, B, zp, qa, da, bsf, zb)
    else:
        for c in range(nc):
            _quantize_rows_of(x, c, A, B, zp, qa, da, bsf, zb)


@njit(inline="always", nogil=True)
def _quantize_rows_of(x, c, A, B, zp, qa, da, bsf, zb):
    """Rows ROW_GROUP c .. of x, block by block: a block's da, bsf, zb of the group's rows
    are adjacent ([nb, M]), so each cache line of them is written ROW_GROUP times in a row.
    Row by row, every block's entries were M * 4 bytes apart: with M = 512 (a 2 KB stride)
    they fell into a few L1 sets, and Q6_K's 16-column blocks (16 lines a block and array)
    quantized at a third of the 32-column rate."""
    M, K = x.shape
    r1 = min(M, (c + 1) * ROW_GROUP)
    for ab in range(K // A):
        for r in range(c * ROW_GROUP, r1):
            _quantize_block_vec(x, r, r, ab, A, B, zp, qa, da, bsf, zb)


@njit(**_PJIT)
def quantize_swiglu_rows(gate, up, A, B, zp, qa, da, bsf, zb, par):
    """quantize_rows(swiglu(gate, up)) without the float32 [M, K] in between: each group of
    rows goes through SwiGLU (_swiglu.swiglu_row_to, the same bits) into a scratch of
    ROW_GROUP rows, which is quantized while it is in L2. The down projection's input in a
    512-token prefill of a 1.5B model is 18 MB written and read back otherwise."""
    M, K = gate.shape
    nc = (M + ROW_GROUP - 1) // ROW_GROUP
    if par:
        for c in prange(nc):
            _quantize_swiglu_rows_of(gate, up, c, A, B, zp, qa, da, bsf, zb)
    else:
        for c in range(nc):
            _quantize_swiglu_rows_of(gate, up, c, A, B, zp, qa, da, bsf, zb)


@njit(inline="always", nogil=True)
def _quantize_swiglu_rows_of(gate, up, c, A, B, zp, qa, da, bsf, zb):
    M, K = gate.shape
    r0 = c * ROW_GROUP
    r1 = min(M, r0 + ROW_GROUP)
    h = np.empty((r1 - r0, K), np.float32)
    for r in range(r0, r1):
        swiglu_row_to(gate, up, r, h, r - r0)
    for ab in range(K // A):
        for r in range(r0, r1):
            _quantize_block_vec(h, r - r0, r, ab, A, B, zp, qa, da, bsf, zb)


# -- the scalar reference -----------------------------------------------------------------

@njit(inline="always", nogil=True)
def _quantize_block(x, r, ab, A, B, zp, qa, da, bsf, zb):
    b0 = ab * A
    d = quantize_act_block(x, r, b0, A, qa)
    for wb in range(b0 // B, (b0 + A) // B):
        sm = np.int32(0)
        for j in range(B):
            sm += np.int32(qa[r, wb * B + j])
        da[wb, r] = d
        bsf[wb, r] = np.float32(sm)
        zb[wb, r] = block_zb(sm, zp)


@njit(**_PJIT)
def quantize_rows_ref(x, A, B, zp, qa, da, bsf, zb, par):
    """quantize_rows through kernels.quantize_act_block, one scalar at a time: the reference
    the tests hold quantize_rows to, and the 'before' of benchmarks/profile.py --baseline."""
    M, K = x.shape
    na = K // A
    if par:
        for i in prange(M * na):
            _quantize_block(x, i // na, i % na, A, B, zp, qa, da, bsf, zb)
    else:
        for i in range(M * na):
            _quantize_block(x, i // na, i % na, A, B, zp, qa, da, bsf, zb)
