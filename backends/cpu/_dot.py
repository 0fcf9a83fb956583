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
from ._simd import (bload_bf16, bload_f16, bload_f32, hload, hload_end, iaddk, iand, iload_i8, iload_u8, ishr,
                    itof, kq_scales, q3k_scales, u32load, vadd, vfma, vhsum, vlane, vload, vmul, vsplat, vzero)

_f32 = np.float32


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
        d = vsplat(hload(w, o))
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
        d = vsplat(hload(w, o))
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
        d = vsplat(hload(w, o))
        m = vsplat(hload(w, o + 2))
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
        d = vsplat(hload(w, o))
        qh = u32load(w, o + 2)
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
        d = vsplat(hload(w, o))
        m = vsplat(hload(w, o + 2))
        qh = u32load(w, o + 4)
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
        sc = iload_u8(w, o)
        dl = vmul(vsplat(hload_end(w, o + 80)), itof(iand(sc, 15)))
        nml = vmul(vsplat(-hload_end(w, o + 82)), itof(ishr(sc, 4)))
        for k in range(0, 16, 2):
            w0 = vfma(vlane(dl, k), itof(D.q2k_group(w, o, k)), vlane(nml, k))
            w1 = vfma(vlane(dl, k + 1), itof(D.q2k_group(w, o, k + 1)), vlane(nml, k + 1))
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
        dl = vmul(vsplat(hload_end(w, o + 108)), itof(q3k_scales(w, o + 94)))
        for k in range(0, 16, 2):
            a0 = vfma(vmul(vlane(dl, k), itof(D.q3k_group(w, o, k))), vload(x, b * 256 + 16 * k), a0)
            a1 = vfma(vmul(vlane(dl, k + 1), itof(D.q3k_group(w, o, k + 1))), vload(x, b * 256 + 16 * k + 16), a1)
    return vhsum(vadd(a0, a1))


@njit(inline="always", nogil=True)
def dot_q4_k(w, n, x):
    a0 = vzero()
    a1 = vzero()
    r = _row0(w, n)
    for b in range(w.shape[1]):
        o = r + b * 144
        sm = itof(kq_scales(w, o + 4))   # lanes 0-7 scales, 8-15 mins
        dsv = vmul(vsplat(hload(w, o)), sm)
        ndmv = vmul(vsplat(-hload(w, o + 2)), sm)
        for j in range(8):
            ds = vlane(dsv, j)
            ndm = vlane(ndmv, j + 8)
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
        sm = itof(kq_scales(w, o + 4))   # lanes 0-7 scales, 8-15 mins
        dsv = vmul(vsplat(hload(w, o)), sm)
        ndmv = vmul(vsplat(-hload(w, o + 2)), sm)
        for j in range(8):
            ds = vlane(dsv, j)
            ndm = vlane(ndmv, j + 8)
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
        dsv = vmul(vsplat(hload_end(w, o + 208)), itof(iload_i8(w, o + 192)))
        for k in range(0, 16, 2):
            a0 = vfma(vmul(vlane(dsv, k), itof(D.q6k_group(w, o, k))), vload(x, b * 256 + 16 * k), a0)
            a1 = vfma(vmul(vlane(dsv, k + 1), itof(D.q6k_group(w, o, k + 1))), vload(x, b * 256 + 16 * k + 16), a1)
    return vhsum(vadd(a0, a1))
