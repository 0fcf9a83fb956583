"""Fused dequantize-and-dot of one weight row with x (the matvec inner loop), per type.

`dot_*(w, n, x) -> float32` walks row n of a uint8[N, n_blocks, block_bytes] array, decodes
16 lanes at a time into registers and accumulates `w_i * x_i` into vector accumulators that
are reduced once per row. Two accumulators (one per 16-lane half) keep two independent FMA
chains in flight. Mins (Q4_1, Q5_1, K-quants) are folded in with `fma(scale, q, -min)`, so
no separate sum of x is needed.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from . import _decode as D
from ._bits import load_f16, load_u32
from ._simd import (bload_bf16, bload_f16, bload_f32, iaddk, iand, iload_i8, iload_u8, ishr,
                    itof, vadd, vfma, vhsum, vload, vmul, vsplat, vzero)

_f32 = np.float32
_i32 = np.int32


@njit(inline="always", nogil=True)
def _row0(w, n):
    return n * (w.shape[1] * w.shape[2])


@njit(inline="always", nogil=True)
def dot_f32(w, n, x):
    a0 = vzero()
    a1 = vzero()
    o = _row0(w, n)
    for b in range(w.shape[1]):
        a0 = vfma(bload_f32(w, o + b * 128), vload(x, b * 32), a0)
        a1 = vfma(bload_f32(w, o + b * 128 + 64), vload(x, b * 32 + 16), a1)
    return vhsum(vadd(a0, a1))


@njit(inline="always", nogil=True)
def dot_f16(w, n, x):
    a0 = vzero()
    a1 = vzero()
    o = _row0(w, n)
    for b in range(w.shape[1]):
        a0 = vfma(bload_f16(w, o + b * 64), vload(x, b * 32), a0)
        a1 = vfma(bload_f16(w, o + b * 64 + 32), vload(x, b * 32 + 16), a1)
    return vhsum(vadd(a0, a1))


@njit(inline="always", nogil=True)
def dot_bf16(w, n, x):
    a0 = vzero()
    a1 = vzero()
    o = _row0(w, n)
    for b in range(w.shape[1]):
        a0 = vfma(bload_bf16(w, o + b * 64), vload(x, b * 32), a0)
        a1 = vfma(bload_bf16(w, o + b * 64 + 32), vload(x, b * 32 + 16), a1)
    return vhsum(vadd(a0, a1))


@njit(inline="always", nogil=True)
def dot_q8_0(w, n, x):
    a0 = vzero()
    a1 = vzero()
    r = _row0(w, n)
    for b in range(w.shape[1]):
        o = r + b * 34
        d = vsplat(load_f16(w, n, b, 0))
        a0 = vfma(vmul(itof(iload_i8(w, o + 2)), d), vload(x, b * 32), a0)
        a1 = vfma(vmul(itof(iload_i8(w, o + 18)), d), vload(x, b * 32 + 16), a1)
    return vhsum(vadd(a0, a1))


@njit(inline="always", nogil=True)
def dot_q4_0(w, n, x):
    a0 = vzero()
    a1 = vzero()
    r = _row0(w, n)
    m8 = vsplat(_f32(-8.0))
    for b in range(w.shape[1]):
        o = r + b * 18
        d = vsplat(load_f16(w, n, b, 0))
        v = iload_u8(w, o + 2)
        nd = vmul(d, m8)
        a0 = vfma(vfma(d, itof(iand(v, 15)), nd), vload(x, b * 32), a0)
        a1 = vfma(vfma(d, itof(ishr(v, 4)), nd), vload(x, b * 32 + 16), a1)
    return vhsum(vadd(a0, a1))


@njit(inline="always", nogil=True)
def dot_q4_1(w, n, x):
    a0 = vzero()
    a1 = vzero()
    r = _row0(w, n)
    for b in range(w.shape[1]):
        o = r + b * 20
        d = vsplat(load_f16(w, n, b, 0))
        m = vsplat(load_f16(w, n, b, 2))
        v = iload_u8(w, o + 4)
        a0 = vfma(vfma(d, itof(iand(v, 15)), m), vload(x, b * 32), a0)
        a1 = vfma(vfma(d, itof(ishr(v, 4)), m), vload(x, b * 32 + 16), a1)
    return vhsum(vadd(a0, a1))


@njit(inline="always", nogil=True)
def dot_q5_0(w, n, x):
    a0 = vzero()
    a1 = vzero()
    r = _row0(w, n)
    for b in range(w.shape[1]):
        o = r + b * 22
        d = vsplat(load_f16(w, n, b, 0))
        qh = load_u32(w, n, b, 2)
        a0 = vfma(vmul(itof(iaddk(D.q5_lo(w, o, qh, 6), -16)), d), vload(x, b * 32), a0)
        a1 = vfma(vmul(itof(iaddk(D.q5_hi(w, o, qh, 6), -16)), d), vload(x, b * 32 + 16), a1)
    return vhsum(vadd(a0, a1))


@njit(inline="always", nogil=True)
def dot_q5_1(w, n, x):
    a0 = vzero()
    a1 = vzero()
    r = _row0(w, n)
    for b in range(w.shape[1]):
        o = r + b * 24
        d = vsplat(load_f16(w, n, b, 0))
        m = vsplat(load_f16(w, n, b, 2))
        qh = load_u32(w, n, b, 4)
        a0 = vfma(vfma(d, itof(D.q5_lo(w, o, qh, 8)), m), vload(x, b * 32), a0)
        a1 = vfma(vfma(d, itof(D.q5_hi(w, o, qh, 8)), m), vload(x, b * 32 + 16), a1)
    return vhsum(vadd(a0, a1))


@njit(inline="always", nogil=True)
def dot_q2_k(w, n, x):
    a0 = vzero()
    a1 = vzero()
    r = _row0(w, n)
    for b in range(w.shape[1]):
        o = r + b * 84
        d = load_f16(w, n, b, 80)
        dmin = load_f16(w, n, b, 82)
        for k in range(0, 16, 2):
            s0 = _i32(w[n, b, k])
            s1 = _i32(w[n, b, k + 1])
            w0 = vfma(vsplat(d * _f32(s0 & 15)), itof(D.q2k_group(w, o, k)), vsplat(-(dmin * _f32(s0 >> 4))))
            w1 = vfma(vsplat(d * _f32(s1 & 15)), itof(D.q2k_group(w, o, k + 1)), vsplat(-(dmin * _f32(s1 >> 4))))
            a0 = vfma(w0, vload(x, b * 256 + 16 * k), a0)
            a1 = vfma(w1, vload(x, b * 256 + 16 * k + 16), a1)
    return vhsum(vadd(a0, a1))


@njit(inline="always", nogil=True)
def dot_q3_k(w, n, x):
    a0 = vzero()
    a1 = vzero()
    r = _row0(w, n)
    for b in range(w.shape[1]):
        o = r + b * 110
        d = load_f16(w, n, b, 108)
        for k in range(0, 16, 2):
            d0 = vsplat(d * _f32(D.q3k_scale(w, n, b, k)))
            d1 = vsplat(d * _f32(D.q3k_scale(w, n, b, k + 1)))
            a0 = vfma(vmul(d0, itof(D.q3k_group(w, o, k))), vload(x, b * 256 + 16 * k), a0)
            a1 = vfma(vmul(d1, itof(D.q3k_group(w, o, k + 1))), vload(x, b * 256 + 16 * k + 16), a1)
    return vhsum(vadd(a0, a1))


@njit(inline="always", nogil=True)
def dot_q4_k(w, n, x):
    a0 = vzero()
    a1 = vzero()
    r = _row0(w, n)
    for b in range(w.shape[1]):
        o = r + b * 144
        d = load_f16(w, n, b, 0)
        dmin = load_f16(w, n, b, 2)
        for j in range(8):
            sc, mn = D.kq_scale_min(w, n, b, j)
            ds = vsplat(d * _f32(sc))
            ndm = vsplat(-(dmin * _f32(mn)))
            xo = b * 256 + 32 * j
            a0 = vfma(vfma(ds, itof(D.q4k_half(w, o, j, 0)), ndm), vload(x, xo), a0)
            a1 = vfma(vfma(ds, itof(D.q4k_half(w, o, j, 1)), ndm), vload(x, xo + 16), a1)
    return vhsum(vadd(a0, a1))


@njit(inline="always", nogil=True)
def dot_q5_k(w, n, x):
    a0 = vzero()
    a1 = vzero()
    r = _row0(w, n)
    for b in range(w.shape[1]):
        o = r + b * 176
        d = load_f16(w, n, b, 0)
        dmin = load_f16(w, n, b, 2)
        for j in range(8):
            sc, mn = D.kq_scale_min(w, n, b, j)
            ds = vsplat(d * _f32(sc))
            ndm = vsplat(-(dmin * _f32(mn)))
            xo = b * 256 + 32 * j
            a0 = vfma(vfma(ds, itof(D.q5k_half(w, o, j, 0)), ndm), vload(x, xo), a0)
            a1 = vfma(vfma(ds, itof(D.q5k_half(w, o, j, 1)), ndm), vload(x, xo + 16), a1)
    return vhsum(vadd(a0, a1))


@njit(inline="always", nogil=True)
def dot_q6_k(w, n, x):
    a0 = vzero()
    a1 = vzero()
    r = _row0(w, n)
    for b in range(w.shape[1]):
        o = r + b * 210
        d = load_f16(w, n, b, 208)
        for k in range(0, 16, 2):
            d0 = vsplat(d * _f32(np.int8(w[n, b, 192 + k])))
            d1 = vsplat(d * _f32(np.int8(w[n, b, 193 + k])))
            a0 = vfma(vmul(d0, itof(D.q6k_group(w, o, k))), vload(x, b * 256 + 16 * k), a0)
            a1 = vfma(vmul(d1, itof(D.q6k_group(w, o, k + 1))), vload(x, b * 256 + 16 * k + 16), a1)
    return vhsum(vadd(a0, a1))
