"""Fused dequantize-and-dot of one weight row with x (the matvec inner loop), per type.

`dot_*(w, n, x) -> float32` walks row n of a uint8[N, n_blocks, block_bytes] array, decodes
16 lanes at a time into registers and accumulates `w_i * x_i` into vector accumulators that
are reduced once per row. Four accumulators (alternate blocks or sub-blocks, one per 16-lane
half) keep four independent FMA chains in flight for the 32-value types, where two left the
4-cycle FMA latency as the limit (Q8_0: 34 -> 39 GB/s per core). The k-quants are bound by
instruction throughput instead; Q2_K and Q3_K keep two chains (four measured slower).
Mins (Q4_1, Q5_1, K-quants) are folded in with `fma(scale, q, -min)`, so no separate sum of
x is needed.

Each type is a block step `_b_*(w, o, x, xo, accumulators...)` (o: byte offset of the
block, xo: its first x index) driven by `_row32` or `_row256`, except Q4_K and Q6_K: their
dots read the quant bytes as uint32 lanes and take them apart with shifts, with x permuted
to match once per call (`q4k_x`, `q6k_x`; Q4_K also gets its sub-block sums appended for
the mins). That removes the per-block zero-extending shuffles: Q4_K 12 -> 16.7, Q6_K
15.7 -> 19 GB/s per core.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from . import _decode as D
from ._simd import (bload_bf16, bload_f16, bload_f32, hload, hload_end, iand, iload_i8, iload_u8,
                    iload_w32, iload_w32_dup, ior, ishl, ishr, ishr2, itof, iaddk, kq_scales,
                    q3k_scales, u32load, vadd, vfma, vhsum, vlane, vload, vmul, vpair, vquad,
                    vsplat, vzero)

_f32 = np.float32


@njit(inline="always", nogil=True)
def _row32(blk, w, n, x):
    """Row n of a 32-value-block type: blocks alternate between two accumulator pairs."""
    a0 = vzero()
    a1 = vzero()
    a2 = vzero()
    a3 = vzero()
    nb = w.shape[1]
    ts = w.shape[2]
    r = n * (nb * ts)
    for b in range(0, nb - 1, 2):
        a0, a1 = blk(w, r + b * ts, x, b * 32, a0, a1)
        a2, a3 = blk(w, r + (b + 1) * ts, x, b * 32 + 32, a2, a3)
    if nb & 1:
        a0, a1 = blk(w, r + (nb - 1) * ts, x, (nb - 1) * 32, a0, a1)
    return vhsum(vadd(vadd(a0, a1), vadd(a2, a3)))


@njit(inline="always", nogil=True)
def _row256(blk, w, n, x):
    """Row n of a k-quant: each super-block step spreads its sub-blocks over 4 accumulators."""
    a0 = vzero()
    a1 = vzero()
    a2 = vzero()
    a3 = vzero()
    nb = w.shape[1]
    ts = w.shape[2]
    r = n * (nb * ts)
    for b in range(nb):
        a0, a1, a2, a3 = blk(w, r + b * ts, x, b * 256, a0, a1, a2, a3)
    return vhsum(vadd(vadd(a0, a1), vadd(a2, a3)))


# ----------------------------------------------------------------- 32-value blocks

@njit(inline="always", nogil=True)
def _b_f32(w, o, x, xo, a0, a1):
    return (vfma(bload_f32(w, o), vload(x, xo), a0),
            vfma(bload_f32(w, o + 64), vload(x, xo + 16), a1))


@njit(inline="always", nogil=True)
def _b_f16(w, o, x, xo, a0, a1):
    return (vfma(bload_f16(w, o), vload(x, xo), a0),
            vfma(bload_f16(w, o + 32), vload(x, xo + 16), a1))


@njit(inline="always", nogil=True)
def _b_bf16(w, o, x, xo, a0, a1):
    return (vfma(bload_bf16(w, o), vload(x, xo), a0),
            vfma(bload_bf16(w, o + 32), vload(x, xo + 16), a1))


@njit(inline="always", nogil=True)
def _b_q8_0(w, o, x, xo, a0, a1):
    d = vsplat(hload(w, o))
    return (vfma(vmul(itof(iload_i8(w, o + 2)), d), vload(x, xo), a0),
            vfma(vmul(itof(iload_i8(w, o + 18)), d), vload(x, xo + 16), a1))


@njit(inline="always", nogil=True)
def _b_q4_0(w, o, x, xo, a0, a1):
    d = vsplat(hload(w, o))
    nd = vmul(d, vsplat(_f32(-8.0)))
    v = iload_u8(w, o + 2)
    return (vfma(vfma(d, itof(iand(v, 15)), nd), vload(x, xo), a0),
            vfma(vfma(d, itof(ishr(v, 4)), nd), vload(x, xo + 16), a1))


@njit(inline="always", nogil=True)
def _b_q4_1(w, o, x, xo, a0, a1):
    d = vsplat(hload(w, o))
    m = vsplat(hload(w, o + 2))
    v = iload_u8(w, o + 4)
    return (vfma(vfma(d, itof(iand(v, 15)), m), vload(x, xo), a0),
            vfma(vfma(d, itof(ishr(v, 4)), m), vload(x, xo + 16), a1))


@njit(inline="always", nogil=True)
def _b_q5_0(w, o, x, xo, a0, a1):
    d = vsplat(hload(w, o))
    nd = vmul(d, vsplat(_f32(-16.0)))
    qh = u32load(w, o + 2)
    return (vfma(vfma(d, itof(D.q5_lo(w, o, qh, 6)), nd), vload(x, xo), a0),
            vfma(vfma(d, itof(D.q5_hi(w, o, qh, 6)), nd), vload(x, xo + 16), a1))


@njit(inline="always", nogil=True)
def _b_q5_1(w, o, x, xo, a0, a1):
    d = vsplat(hload(w, o))
    m = vsplat(hload(w, o + 2))
    qh = u32load(w, o + 4)
    return (vfma(vfma(d, itof(D.q5_lo(w, o, qh, 8)), m), vload(x, xo), a0),
            vfma(vfma(d, itof(D.q5_hi(w, o, qh, 8)), m), vload(x, xo + 16), a1))


# ----------------------------------------------------------------- 256-value super-blocks

@njit(inline="always", nogil=True)
def _b_q2_k(w, o, x, xo, a0, a1, a2, a3):
    sc = iload_u8(w, o)
    dl = vmul(vsplat(hload_end(w, o + 80)), itof(iand(sc, 15)))
    nml = vmul(vsplat(-hload_end(w, o + 82)), itof(ishr(sc, 4)))
    for k in range(0, 16, 2):            # 16-value groups k, k + 1
        a0 = vfma(vfma(vlane(dl, k), itof(D.q2k_group(w, o, k)), vlane(nml, k)), vload(x, xo + 16 * k), a0)
        a1 = vfma(vfma(vlane(dl, k + 1), itof(D.q2k_group(w, o, k + 1)), vlane(nml, k + 1)),
                  vload(x, xo + 16 * k + 16), a1)
    return a0, a1, a2, a3


@njit(inline="always", nogil=True)
def _b_q3_k(w, o, x, xo, a0, a1, a2, a3):
    dl = vmul(vsplat(hload_end(w, o + 108)), itof(q3k_scales(w, o + 94)))
    for k in range(0, 16, 2):
        a0 = vfma(vmul(vlane(dl, k), itof(D.q3k_group(w, o, k))), vload(x, xo + 16 * k), a0)
        a1 = vfma(vmul(vlane(dl, k + 1), itof(D.q3k_group(w, o, k + 1))), vload(x, xo + 16 * k + 16), a1)
    return a0, a1, a2, a3


def q4k_x_order() -> np.ndarray:
    """Order of the 256 x values of a super-block as the Q4_K dot reads them.

    The dot loads the 128 nibble bytes as 2 x 16 uint32 lanes (4 bytes per lane) and takes
    them apart with shifts: vector (g, k, h) holds nibble h of byte k of each lane, i.e.
    elements 32 * (2 * (2g + i // 8) + h) + 4 * (i % 8) + k for lanes i. matmul passes x
    permuted to match (once per call), so no zero-extending shuffles are needed per block.
    """
    order = np.empty(256, np.int64)
    for g in range(2):
        for k in range(4):
            for h in range(2):
                for i in range(16):
                    order[g * 128 + k * 32 + h * 16 + i] = 32 * (2 * (2 * g + i // 8) + h) + 4 * (i % 8) + k
    return order


@njit(nogil=True, cache=True)
def q4k_x(x, index):
    """The x vector the Q4_K matvec takes: x in q4k_x_order, then per super-block 16 floats,
    zeros then the sums of x over its 8 sub-blocks (the mins' term, one FMA per block)."""
    K = x.shape[0]
    nsb = K // 256
    out = np.empty(K + 16 * nsb, np.float32)
    for i in range(K):
        out[i] = x[index[i]]
    for b in range(nsb):
        for j in range(8):
            out[K + 16 * b + j] = 0.0
            acc = _f32(0.0)
            for i in range(32):
                acc += x[256 * b + 32 * j + i]
            out[K + 16 * b + 8 + j] = acc
    return out


@njit(inline="always", nogil=True)
def dot_q4_k(w, n, x):
    """x from q4k_x: values in q4k_x_order, then the sub-block sums at offset K."""
    a0 = vzero()
    a1 = vzero()
    am = vzero()
    nb = w.shape[1]
    K = nb * 256
    r = n * (nb * 144)
    for b in range(nb):
        o = r + b * 144
        xo = b * 256
        sm = itof(kq_scales(w, o + 4))           # lanes 0-7 scales, 8-15 mins
        dsv = vmul(vsplat(hload(w, o)), sm)
        am = vfma(vmul(vsplat(-hload(w, o + 2)), sm), vload(x, K + 16 * b), am)   # - sum dmin*m*sum(x)
        for g in range(2):
            v = iload_w32(w, o + 16 + 64 * g)
            # lanes 0-7 belong to sub-block 4g + h, lanes 8-15 to sub-block 4g + 2 + h
            xb = xo + g * 128
            t = vmul(itof(iand(v, 15)), vload(x, xb))
            t = vfma(itof(iand(ishr(v, 8), 15)), vload(x, xb + 32), t)
            t = vfma(itof(iand(ishr(v, 16), 15)), vload(x, xb + 64), t)
            t = vfma(itof(iand(ishr(v, 24), 15)), vload(x, xb + 96), t)
            a0 = vfma(vpair(dsv, 4 * g, 4 * g + 2), t, a0)
            u = vmul(itof(iand(ishr(v, 4), 15)), vload(x, xb + 16))
            u = vfma(itof(iand(ishr(v, 12), 15)), vload(x, xb + 48), u)
            u = vfma(itof(iand(ishr(v, 20), 15)), vload(x, xb + 80), u)
            u = vfma(itof(ishr(v, 28)), vload(x, xb + 112), u)
            a1 = vfma(vpair(dsv, 4 * g + 1, 4 * g + 3), u, a1)
    return vhsum(vadd(vadd(a0, a1), am))


@njit(inline="always", nogil=True)
def _b_q5_k(w, o, x, xo, a0, a1, a2, a3):
    sm = itof(kq_scales(w, o + 4))
    dsv = vmul(vsplat(hload(w, o)), sm)
    ndmv = vmul(vsplat(-hload(w, o + 2)), sm)
    for j in range(0, 8, 2):
        ds = vlane(dsv, j)
        ndm = vlane(ndmv, j + 8)
        a0 = vfma(vfma(ds, itof(D.q5k_half(w, o, j, 0)), ndm), vload(x, xo + 32 * j), a0)
        a1 = vfma(vfma(ds, itof(D.q5k_half(w, o, j, 1)), ndm), vload(x, xo + 32 * j + 16), a1)
        ds = vlane(dsv, j + 1)
        ndm = vlane(ndmv, j + 9)
        a2 = vfma(vfma(ds, itof(D.q5k_half(w, o, j + 1, 0)), ndm), vload(x, xo + 32 * j + 32), a2)
        a3 = vfma(vfma(ds, itof(D.q5k_half(w, o, j + 1, 1)), ndm), vload(x, xo + 32 * j + 48), a3)
    return a0, a1, a2, a3


def q6k_x_order() -> np.ndarray:
    """Order of the 256 x values of a super-block as the Q6_K dot reads them.

    Vector (h, s, k), lane i: nibble s of byte k of uint32 lane i of ql[64h : 64h + 64], i.e.
    chunk c = 4h + 2s + i // 8 (ggml's 32-value chunks), position l = 4 * (i % 8) + k.
    """
    order = np.empty(256, np.int64)
    for h in range(2):
        for s in range(2):
            for k in range(4):
                for i in range(16):
                    c = 4 * h + 2 * s + i // 8
                    order[((h * 2 + s) * 4 + k) * 16 + i] = 32 * c + 4 * (i % 8) + k
    return order


@njit(nogil=True, cache=True)
def q6k_x(x, index):
    """The x vector the Q6_K matvec takes: x in q6k_x_order."""
    out = np.empty(x.shape[0], np.float32)
    for i in range(x.shape[0]):
        out[i] = x[index[i]]
    return out


@njit(inline="always", nogil=True)
def dot_q6_k(w, n, x):
    """x from q6k_x. Bytes are taken apart as uint32 lanes (no vpmovzx shuffles); the scale
    of each lane comes from one permute per (h, s)."""
    a0 = vzero()
    a1 = vzero()
    nb = w.shape[1]
    r = n * (nb * 210)
    for b in range(nb):
        o = r + b * 210
        dsv = vmul(vsplat(hload_end(w, o + 208)), itof(iload_i8(w, o + 192)))
        for h in range(2):
            ql = iload_w32(w, o + 64 * h)
            qh = iload_w32_dup(w, o + 128 + 32 * h)
            for s in range(2):
                c0 = 4 * h + 2 * s                   # lanes 0-7 in chunk c0, lanes 8-15 in c0 + 1
                sc = vquad(dsv, 2 * c0, 2 * c0 + 1, 2 * c0 + 2, 2 * c0 + 3)
                xb = b * 256 + (h * 2 + s) * 64
                t = vzero()
                for k in range(4):
                    lo = iand(ishr(ql, 8 * k + 4 * s), 15)
                    hi = iand(ishr2(qh, 8 * k + 4 * s, 8 * k + 4 * s + 2), 3)
                    t = vfma(itof(iaddk(ior(lo, ishl(hi, 4)), -32)), vload(x, xb + 16 * k), t)
                if s == 0:
                    a0 = vfma(sc, t, a0)
                else:
                    a1 = vfma(sc, t, a1)
    return vhsum(vadd(a0, a1))


# ----------------------------------------------------------------- row dots (kernel entry points)

@njit(inline="always", nogil=True)
def dot_f32(w, n, x):
    return _row32(_b_f32, w, n, x)


@njit(inline="always", nogil=True)
def dot_f16(w, n, x):
    return _row32(_b_f16, w, n, x)


@njit(inline="always", nogil=True)
def dot_bf16(w, n, x):
    return _row32(_b_bf16, w, n, x)


@njit(inline="always", nogil=True)
def dot_q8_0(w, n, x):
    return _row32(_b_q8_0, w, n, x)


@njit(inline="always", nogil=True)
def dot_q4_0(w, n, x):
    return _row32(_b_q4_0, w, n, x)


@njit(inline="always", nogil=True)
def dot_q4_1(w, n, x):
    return _row32(_b_q4_1, w, n, x)


@njit(inline="always", nogil=True)
def dot_q5_0(w, n, x):
    return _row32(_b_q5_0, w, n, x)


@njit(inline="always", nogil=True)
def dot_q5_1(w, n, x):
    return _row32(_b_q5_1, w, n, x)


@njit(inline="always", nogil=True)
def dot_q2_k(w, n, x):
    return _row256(_b_q2_k, w, n, x)


@njit(inline="always", nogil=True)
def dot_q3_k(w, n, x):
    return _row256(_b_q3_k, w, n, x)


@njit(inline="always", nogil=True)
def dot_q5_k(w, n, x):
    return _row256(_b_q5_k, w, n, x)


