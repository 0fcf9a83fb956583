"""Block decoders: one quantized block of a weight row -> float32 values, bit-exact.

Each `dec_*(w, n, b, o, out, oo)` decodes block `b` of row `n` of a uint8[N, n_blocks,
block_bytes] weight array (flat byte offset `o` of that block) into the float32 array `out`
at flat element offset `oo`. Scales are read as scalars; the values are decoded 16 lanes at
a time with the `_simd` vectors. The float32 operations happen in exactly the order that
`gguf.quants.dequantize` uses (e.g. Q4_K: `(d * sc) * q - (dmin * m)`), and these functions
are compiled without fastmath, so results are equal bit for bit to the reference.
Layouts follow ggml (ggml-common.h); float types use 32-element pseudo-blocks so every
type has the same "row of blocks" shape.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ._simd import (bload_bf16, bload_f16, bload_f32, hload, hload_end, iaddk, iand, ibits,
                    iload_i8, iload_u8, ior, ishl, ishr, itof, kq_scales, q3k_scales, u32load,
                    vadd, vlane, vmul, vsplat, vstore, vsub)

# ggml type codes (gguf.GGMLQuantizationType values)
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 0, 1, 2, 3, 6, 7, 8
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, BF16 = 10, 11, 12, 13, 14, 30

# type code -> (elements per block, bytes per block) as the kernels see them
BLOCK = {
    F32: (32, 128), F16: (32, 64), BF16: (32, 64),
    Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22), Q5_1: (32, 24), Q8_0: (32, 34),
    Q2_K: (256, 84), Q3_K: (256, 110), Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210),
}

_f32 = np.float32
_i32 = np.int32


@njit(inline="always", nogil=True)
def dec_f32(w, n, b, o, out, oo):
    vstore(out, oo, bload_f32(w, o))
    vstore(out, oo + 16, bload_f32(w, o + 64))


@njit(inline="always", nogil=True)
def dec_f16(w, n, b, o, out, oo):
    vstore(out, oo, bload_f16(w, o))
    vstore(out, oo + 16, bload_f16(w, o + 32))


@njit(inline="always", nogil=True)
def dec_bf16(w, n, b, o, out, oo):
    vstore(out, oo, bload_bf16(w, o))
    vstore(out, oo + 16, bload_bf16(w, o + 32))


@njit(inline="always", nogil=True)
def dec_q4_0(w, n, b, o, out, oo):
    d = vsplat(hload(w, o))
    v = iload_u8(w, o + 2)
    vstore(out, oo, vmul(d, itof(iaddk(iand(v, 15), -8))))
    vstore(out, oo + 16, vmul(d, itof(iaddk(ishr(v, 4), -8))))


@njit(inline="always", nogil=True)
def dec_q4_1(w, n, b, o, out, oo):
    d = vsplat(hload(w, o))
    m = vsplat(hload(w, o + 2))
    v = iload_u8(w, o + 4)
    vstore(out, oo, vadd(vmul(d, itof(iand(v, 15))), m))
    vstore(out, oo + 16, vadd(vmul(d, itof(ishr(v, 4))), m))


@njit(inline="always", nogil=True)
def q5_lo(w, o, qh, qs):
    """Q5_0/Q5_1 values 0..15 of a block: low nibbles plus bits 0..15 of qh."""
    return ior(iand(iload_u8(w, o + qs), 15), ishl(ibits(qh, 0), 4))


@njit(inline="always", nogil=True)
def q5_hi(w, o, qh, qs):
    """Q5_0/Q5_1 values 16..31: high nibbles plus bits 16..31 of qh."""
    return ior(ishr(iload_u8(w, o + qs), 4), ishl(ibits(qh, 16), 4))


@njit(inline="always", nogil=True)
def dec_q5_0(w, n, b, o, out, oo):
    d = vsplat(hload(w, o))
    qh = u32load(w, o + 2)
    vstore(out, oo, vmul(d, itof(iaddk(q5_lo(w, o, qh, 6), -16))))
    vstore(out, oo + 16, vmul(d, itof(iaddk(q5_hi(w, o, qh, 6), -16))))


@njit(inline="always", nogil=True)
def dec_q5_1(w, n, b, o, out, oo):
    d = vsplat(hload(w, o))
    m = vsplat(hload(w, o + 2))
    qh = u32load(w, o + 4)
    vstore(out, oo, vadd(vmul(d, itof(q5_lo(w, o, qh, 8))), m))
    vstore(out, oo + 16, vadd(vmul(d, itof(q5_hi(w, o, qh, 8))), m))


@njit(inline="always", nogil=True)
def dec_q8_0(w, n, b, o, out, oo):
    d = vsplat(hload(w, o))
    vstore(out, oo, vmul(itof(iload_i8(w, o + 2)), d))
    vstore(out, oo + 16, vmul(itof(iload_i8(w, o + 18)), d))


@njit(inline="always", nogil=True)
def q2k_group(w, o, k):
    """The 16 2-bit values of group k (elements 16k..16k+15) of a Q2_K block."""
    src = 16 + (k >> 3) * 32 + (k & 1) * 16
    return iand(ishr(iload_u8(w, o + src), 2 * ((k >> 1) & 3)), 3)


@njit(inline="always", nogil=True)
def dec_q2_k(w, n, b, o, out, oo):
    sc = iload_u8(w, o)                  # 16 bytes: scale in the low nibble, min in the high
    dl = vmul(vsplat(hload_end(w, o + 80)), itof(iand(sc, 15)))
    ml = vmul(vsplat(hload_end(w, o + 82)), itof(ishr(sc, 4)))
    for k in range(16):
        vstore(out, oo + 16 * k, vsub(vmul(vlane(dl, k), itof(q2k_group(w, o, k))), vlane(ml, k)))


@njit(inline="always", nogil=True)
def q3k_group(w, o, k):
    """The 16 signed 3-bit values of group k; element i = 32s + l."""
    s = k >> 1
    l0 = (k & 1) * 16
    hb = iand(ishr(iload_u8(w, o + l0), s), 1)
    ql = iand(ishr(iload_u8(w, o + 32 + (s >> 2) * 32 + l0), 2 * (s & 3)), 3)
    return iaddk(ior(ql, ishl(hb, 2)), -4)       # the offset 4 applies where the mask bit is 0


@njit(inline="always", nogil=True)
def dec_q3_k(w, n, b, o, out, oo):
    dl = vmul(vsplat(hload_end(w, o + 108)), itof(q3k_scales(w, o + 94)))
    for k in range(16):
        vstore(out, oo + 16 * k, vmul(vlane(dl, k), itof(q3k_group(w, o, k))))


@njit(inline="always", nogil=True)
def q4k_half(w, o, j, h):
    """Lanes 16h..16h+15 of sub-block j of a Q4_K block (4-bit values)."""
    return iand(ishr(iload_u8(w, o + 16 + (j >> 1) * 32 + 16 * h), 4 * (j & 1)), 15)


@njit(inline="always", nogil=True)
def q5k_half(w, o, j, h):
    """Lanes 16h..16h+15 of sub-block j of a Q5_K block (5-bit values)."""
    lo = iand(ishr(iload_u8(w, o + 48 + (j >> 1) * 32 + 16 * h), 4 * (j & 1)), 15)
    return ior(lo, ishl(iand(ishr(iload_u8(w, o + 16 + 16 * h), j), 1), 4))


@njit(inline="always", nogil=True)
def dec_q4_k(w, n, b, o, out, oo):
    sm = itof(kq_scales(w, o + 4))       # lanes 0-7 scales, 8-15 mins
    dsv = vmul(vsplat(hload(w, o)), sm)
    dmv = vmul(vsplat(hload(w, o + 2)), sm)
    for j in range(8):
        ds = vlane(dsv, j)
        dm = vlane(dmv, j + 8)
        vstore(out, oo + 32 * j, vsub(vmul(ds, itof(q4k_half(w, o, j, 0))), dm))
        vstore(out, oo + 32 * j + 16, vsub(vmul(ds, itof(q4k_half(w, o, j, 1))), dm))


@njit(inline="always", nogil=True)
def dec_q5_k(w, n, b, o, out, oo):
    sm = itof(kq_scales(w, o + 4))       # lanes 0-7 scales, 8-15 mins
    dsv = vmul(vsplat(hload(w, o)), sm)
    dmv = vmul(vsplat(hload(w, o + 2)), sm)
    for j in range(8):
        ds = vlane(dsv, j)
        dm = vlane(dmv, j + 8)
        vstore(out, oo + 32 * j, vsub(vmul(ds, itof(q5k_half(w, o, j, 0))), dm))
        vstore(out, oo + 32 * j + 16, vsub(vmul(ds, itof(q5k_half(w, o, j, 1))), dm))


@njit(inline="always", nogil=True)
def q6k_group(w, o, k):
    """The 16 signed 6-bit values of group k = 2c + half, chunk c = 4h + 2s + p."""
    c = k >> 1
    h = c >> 2
    t = c & 3
    l0 = (k & 1) * 16
    lo = iand(ishr(iload_u8(w, o + h * 64 + (t & 1) * 32 + l0), 4 * (t >> 1)), 15)
    hi = iand(ishr(iload_u8(w, o + 128 + h * 32 + l0), 2 * t), 3)
    return iaddk(ior(lo, ishl(hi, 4)), -32)


@njit(inline="always", nogil=True)
def dec_q6_k(w, n, b, o, out, oo):
    dsv = vmul(vsplat(hload_end(w, o + 208)), itof(iload_i8(w, o + 192)))
    for k in range(16):
        vstore(out, oo + 16 * k, vmul(vlane(dsv, k), itof(q6k_group(w, o, k))))
