"""GeGLU through ggml's f16 GELU table, 16 lanes at a time (same bits as
kernels.gelu_tanh_mul_f16).

Per value the scalar kernel rounds the gate to f16, looks its GELU up in a 65,536-entry table
(taking ggml's shortcuts beyond +-10) and multiplies by up. numba leaves that loop scalar
(the table load is a gather); here one vector step converts 16 gates to f16 (vcvtps2ph), gathers
their table entries, selects the shortcuts and multiplies, with the same operations per lane.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from . import _stamp
from .kernels import gelu_f16_at

_DEPS = ("kernels.py", "_simd.py")     # inlined here (gelu_f16_at, with kernels.py's own deps)
_DEPS_HASH = "7afdbf157da21fb7"

_CACHE = _stamp.current(_DEPS, _DEPS_HASH)
_PJIT = dict(nogil=True, cache=_CACHE, parallel=True, fastmath=False)

_F32 = ir.FloatType()
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_VF = ir.VectorType(_F32, 16)
_VH = ir.VectorType(ir.HalfType(), 16)
_V16 = ir.VectorType(ir.IntType(16), 16)
_VI64 = ir.VectorType(_I64, 16)
_VP = ir.VectorType(_F32.as_pointer(), 16)
_VB = ir.VectorType(ir.IntType(1), 16)


@intrinsic
def _geglu16(typingctx, gp, up, op, tp):
    """16 lanes: out = (g <= -10 ? 0 : g >= 10 ? g : table[f16 bits of g]) * up, at the
    float32 addresses gp, up, op; tp the table's address."""
    def codegen(context, builder, sig, args):
        gp_, up_, op_, tp_ = args
        mod = builder.module
        name = "llvm.masked.gather.v16f32.v16p0"
        gather = mod.globals.get(name)
        if gather is None:
            gather = ir.Function(mod, ir.FunctionType(_VF, [_VP, _I32, _VB, _VF]), name=name)
        g = builder.load(builder.inttoptr(gp_, _VF.as_pointer()), align=4)
        u = builder.load(builder.inttoptr(up_, _VF.as_pointer()), align=4)
        bits = builder.zext(builder.bitcast(builder.fptrunc(g, _VH), _V16), _VI64)
        undef = ir.Constant(_VI64, ir.Undefined)
        base = builder.shuffle_vector(builder.insert_element(undef, tp_, ir.Constant(_I32, 0)),
                                      undef, ir.Constant(ir.VectorType(_I32, 16), [0] * 16))
        addrs = builder.add(base, builder.shl(bits, ir.Constant(_VI64, [2] * 16)))
        t = builder.call(gather, [builder.inttoptr(addrs, _VP), ir.Constant(_I32, 4),
                                  ir.Constant(_VB, [1] * 16), ir.Constant(_VF, None)])
        lo = builder.fcmp_ordered("<=", g, ir.Constant(_VF, [-10.0] * 16))
        hi = builder.fcmp_ordered(">=", g, ir.Constant(_VF, [10.0] * 16))
        y = builder.select(lo, ir.Constant(_VF, None), builder.select(hi, g, t))
        builder.store(builder.fmul(y, u), builder.inttoptr(op_, _VF.as_pointer()), align=4)
        return context.get_dummy_value()
    return types.void(types.intp, types.intp, types.intp, types.intp), codegen


@njit(inline="always", nogil=True)
def _row(gate, up, out, table, r):
    n = gate.shape[1]
    gp = gate.ctypes.data + r * n * 4
    upp = up.ctypes.data + r * n * 4
    op = out.ctypes.data + r * n * 4
    tp = table.ctypes.data
    nv = n // 16 * 16
    for i in range(0, nv, 16):
        _geglu16(gp + i * 4, upp + i * 4, op + i * 4, tp)
    for i in range(nv, n):          # the tail: the scalar kernel's steps
        out[r, i] = gelu_f16_at(gate[r, i], table) * up[r, i]


@njit(**_PJIT)
def gelu_tanh_mul_f16(gate, up, out, table, par):
    """kernels.gelu_tanh_mul_f16 for C-contiguous float32 [rows, n] gate, up and out (out may
    be gate)."""
    if par:
        for r in prange(gate.shape[0]):
            _row(gate, up, out, table, r)
    else:
        for r in range(gate.shape[0]):
            _row(gate, up, out, table, r)
    return out
