"""SwiGLU, silu(gate) * up, 16 lanes at a time with ggml's vector expf.

numba leaves `g / (1 + exp(-g)) * u` scalar (a libm expf call per value): 5 % of a Qwen2.5
prefill step. llama.cpp's CPU backend computes SwiGLU on AVX-512 with `ggml_v_silu`: exp by
the Arm optimized-routines polynomial (x = n ln2 + b, a degree-5 polynomial in b, times 2^n),
then x / (1 + exp(-x)), times up; the last n % 16 values of a row with libm's expf. Here the
same float32 operations in the same order (FMAs where ggml fuses), so a row's bits are
ggml's; 2^n is applied as two exact power-of-two factors, which rounds once, as its scalef.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange
from numba.core import cgutils
from numba.extending import intrinsic

from . import _stamp
from ._simd import f16x, vload, vstore

_DEPS = ("_simd.py",)             # inlined here: see _stamp.py
_DEPS_HASH = "87956b1a768fad6f"

_CACHE = _stamp.current(_DEPS, _DEPS_HASH)
_PJIT = dict(nogil=True, cache=_CACHE, parallel=True, fastmath=False)

_F = ir.FloatType()
_VF = ir.VectorType(_F, 16)
_VI = ir.VectorType(ir.IntType(32), 16)


def _c(x: float):
    return ir.Constant(_VF, [float(x)] * 16)


def _ci(x: int):
    return ir.Constant(_VI, [x] * 16)


def _call(builder, name: str, args):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VF, [_VF] * len(args)),
                                        name)
    return builder.call(fn, args)


def _fma(builder, a, b, c):
    return _call(builder, "llvm.fma.v16f32", [a, b, c])


def _pow2(builder, e):
    """2^e for int32 lanes e in [-126, 127], exactly."""
    return builder.bitcast(builder.shl(builder.add(e, _ci(127)), _ci(23)), _VF)


def _expf_ggml(builder, x):
    """ggml_v_expf: max error ~1.5 ulp; beyond |n| > 192, 0 (n <= 0) or inf."""
    r = _c(float.fromhex("0x1.8p23"))
    z = _fma(builder, x, _c(float.fromhex("0x1.715476p+0")), r)
    n = builder.fsub(z, r)
    neg_n = builder.fsub(_c(-0.0), n)
    b = _fma(builder, neg_n, _c(float.fromhex("0x1.62e4p-1")), x)
    b = _fma(builder, neg_n, _c(float.fromhex("0x1.7f7d1cp-20")), b)
    u = builder.fmul(b, b)
    j = _fma(builder,
             _fma(builder, _fma(builder, _c(float.fromhex("0x1.0e4020p-7")), b,
                                _c(float.fromhex("0x1.573e2ep-5"))),
                  u,
                  _fma(builder, _c(float.fromhex("0x1.555e66p-3")), b,
                       _c(float.fromhex("0x1.fffdb6p-2")))),
             u,
             _fma(builder, _c(float.fromhex("0x1.ffffecp-1")), b, _c(1.0)))
    # scalef(j, n): j * 2^n1 is exact (|n1| <= 96, j near 1), the second factor rounds once
    clamped = _call(builder, "llvm.maxnum.v16f32",
                    [_call(builder, "llvm.minnum.v16f32", [n, _c(192.0)]), _c(-192.0)])
    ni = builder.fptosi(clamped, _VI)
    n1 = builder.ashr(ni, _ci(1))
    res = builder.fmul(builder.fmul(j, _pow2(builder, n1)),
                       _pow2(builder, builder.sub(ni, n1)))
    big = builder.fcmp_ordered(">", _call(builder, "llvm.fabs.v16f32", [n]), _c(192.0))
    alt = builder.select(builder.fcmp_ordered("<=", n, _c(0.0)), _c(0.0), _c(float("inf")))
    return builder.select(big, alt, res)


@intrinsic
def swiglu16(typingctx, g, u):
    """16 lanes of silu(g) * u as ggml_vec_swiglu_f32's vector loop: g / (1 + expf(0 - g))
    (ggml_v_silu), times u."""
    def codegen(context, builder, sig, args):
        x, up = args
        e = _expf_ggml(builder, builder.fsub(_c(0.0), x))
        return builder.fmul(builder.fdiv(x, builder.fadd(_c(1.0), e)), up)
    return f16x(g, u), codegen


@njit(inline="always", nogil=True)
def swiglu_row(gate, up, out, r):
    """out[r] = silu(gate[r]) * up[r] (out may be gate); C-contiguous rows of one width."""
    swiglu_row_to(gate, up, r, out, r)


@njit(inline="always", nogil=True)
def swiglu_row_to(gate, up, r, out, ro):
    """out[ro] = silu(gate[r]) * up[r]; C-contiguous rows of one width."""
    n = gate.shape[1]
    o = r * n
    d = ro * n
    i = 0
    while i + 16 <= n:
        vstore(out, d + i, swiglu16(vload(gate, o + i), vload(up, o + i)))
        i += 16
    for c in range(i, n):           # ggml's scalar tail: libm expf
        x = gate[r, c]
        out[ro, c] = x / (np.float32(1.0) + np.exp(-x)) * up[r, c]


@njit(**_PJIT)
def swiglu(gate, up, out, par):
    """SwiGLU over the rows of C-contiguous float32 [T, n] arrays (llama / qwen FFNs)."""
    if par:
        for r in prange(gate.shape[0]):
            swiglu_row(gate, up, out, r)
    else:
        for r in range(gate.shape[0]):
            swiglu_row(gate, up, out, r)
    return out
