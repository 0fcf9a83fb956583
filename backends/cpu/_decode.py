"""Block decoders: one quantized block of a weight row -> float32 values, bit-exact.

Each `dec_*` decodes block `b` of row `n` of a uint8[N, n_blocks, block_bytes] weight array
into `out[:block_size]`. Indexing through the 3-D view keeps every inner index provably
non-negative with unit stride, so LLVM vectorizes the loops (no wraparound selects, no
gathers). The float32 operations happen in exactly the order that
`gguf.quants.dequantize` uses (e.g. Q4_K: `(d * sc) * q - (dmin * m)`), and these functions
are compiled without fastmath, so results are equal bit for bit to the reference.
Layouts follow ggml (ggml-common.h); float types use 32-element pseudo-blocks so every
type has the same "row of blocks" shape.

"""
from __future__ import annotations

import numpy as np
from numba import njit

from ._bits import load_bf16, load_f16, load_f32, load_u32

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
def dec_f32(w, n, b, out):
    for i in range(32):
        out[i] = load_f32(w, n, b, 4 * i)


@njit(inline="always", nogil=True)
def dec_f16(w, n, b, out):
    for i in range(32):
        out[i] = load_f16(w, n, b, 2 * i)


@njit(inline="always", nogil=True)
def dec_bf16(w, n, b, out):
    for i in range(32):
        out[i] = load_bf16(w, n, b, 2 * i)


@njit(inline="always", nogil=True)
def dec_q4_0(w, n, b, out):
    d = load_f16(w, n, b, 0)
    for j in range(16):
        v = _i32(w[n, b, 2 + j])
        out[j] = d * _f32((v & 15) - 8)
        out[j + 16] = d * _f32((v >> 4) - 8)


@njit(inline="always", nogil=True)
def dec_q4_1(w, n, b, out):
    d = load_f16(w, n, b, 0)
    m = load_f16(w, n, b, 2)
    for j in range(16):
        v = _i32(w[n, b, 4 + j])
        out[j] = d * _f32(v & 15) + m
        out[j + 16] = d * _f32(v >> 4) + m


@njit(inline="always", nogil=True)
def dec_q5_0(w, n, b, out):
    d = load_f16(w, n, b, 0)
    qh = _i32(load_u32(w, n, b, 2))
    for j in range(16):
        v = _i32(w[n, b, 6 + j])
        out[j] = d * _f32(((v & 15) | (((qh >> j) & 1) << 4)) - 16)
        out[j + 16] = d * _f32(((v >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16)


@njit(inline="always", nogil=True)
def dec_q5_1(w, n, b, out):
    d = load_f16(w, n, b, 0)
    m = load_f16(w, n, b, 2)
    qh = _i32(load_u32(w, n, b, 4))
    for j in range(16):
        v = _i32(w[n, b, 8 + j])
        out[j] = d * _f32((v & 15) | (((qh >> j) & 1) << 4)) + m
        out[j + 16] = d * _f32((v >> 4) | (((qh >> (j + 16)) & 1) << 4)) + m


@njit(inline="always", nogil=True)
def dec_q8_0(w, n, b, out):
    d = load_f16(w, n, b, 0)
    for j in range(32):
        out[j] = _f32(np.int8(w[n, b, 2 + j])) * d


@njit(inline="always", nogil=True)
def dec_q2_k(w, n, b, out):
    d = load_f16(w, n, b, 80)
    dmin = load_f16(w, n, b, 82)
    for k in range(16):                  # 16-value group k: element i = 16k + l
        sc = _i32(w[n, b, k])
        dl = d * _f32(sc & 15)
        ml = dmin * _f32(sc >> 4)
        src = 16 + (k >> 3) * 32 + (k & 1) * 16      # i = 128h + 32s + (i & 31)
        sh = 2 * ((k >> 1) & 3)
        for l in range(16):
            q = (_i32(w[n, b, src + l]) >> sh) & 3
            out[16 * k + l] = dl * _f32(q) - ml


@njit(inline="always", nogil=True)
def _q3k_scale(w, n, b, k):
    lo = (_i32(w[n, b, 96 + (k & 7)]) >> (4 * (k >> 3))) & 15
    hi = (_i32(w[n, b, 104 + (k & 3)]) >> (2 * (k >> 2))) & 3
    return (lo | (hi << 4)) - 32


@njit(inline="always", nogil=True)
def dec_q3_k(w, n, b, out):
    d = load_f16(w, n, b, 108)
    for k in range(16):                  # 16-value group k; element i = 32s + l
        dl = d * _f32(_q3k_scale(w, n, b, k))
        s = k >> 1
        l0 = (k & 1) * 16
        src = 32 + (s >> 2) * 32 + l0
        sh = 2 * (s & 3)
        for l in range(16):
            hbit = (_i32(w[n, b, l0 + l]) >> s) & 1
            ql = (_i32(w[n, b, src + l]) >> sh) & 3
            out[16 * k + l] = dl * _f32(ql - 4 + 4 * hbit)


@njit(inline="always", nogil=True)
def kq_scale_min(w, n, b, j):
    """6-bit scale and min of sub-block j (0..7) of a Q4_K/Q5_K block (scales at byte 4)."""
    if j < 4:
        sc = _i32(w[n, b, 4 + j]) & 63
        mn = _i32(w[n, b, 8 + j]) & 63
    else:
        sc = (_i32(w[n, b, 8 + j]) & 15) | ((_i32(w[n, b, j]) >> 2) & 48)
        mn = (_i32(w[n, b, 8 + j]) >> 4) | ((_i32(w[n, b, 4 + j]) >> 2) & 48)
    return sc, mn


@njit(inline="always", nogil=True)
def dec_q4_k(w, n, b, out):
    d = load_f16(w, n, b, 0)
    dmin = load_f16(w, n, b, 2)
    for j in range(8):
        sc, mn = kq_scale_min(w, n, b, j)
        ds = d * _f32(sc)
        dm = dmin * _f32(mn)
        qb = 16 + (j >> 1) * 32
        sh = 4 * (j & 1)
        for l in range(32):
            q = (_i32(w[n, b, qb + l]) >> sh) & 15
            out[j * 32 + l] = ds * _f32(q) - dm


@njit(inline="always", nogil=True)
def dec_q5_k(w, n, b, out):
    d = load_f16(w, n, b, 0)
    dmin = load_f16(w, n, b, 2)
    for j in range(8):
        sc, mn = kq_scale_min(w, n, b, j)
        ds = d * _f32(sc)
        dm = dmin * _f32(mn)
        qb = 48 + (j >> 1) * 32
        sh = 4 * (j & 1)
        for l in range(32):
            q = ((_i32(w[n, b, qb + l]) >> sh) & 15) | (((_i32(w[n, b, 16 + l]) >> j) & 1) << 4)
            out[j * 32 + l] = ds * _f32(q) - dm


@njit(inline="always", nogil=True)
def dec_q6_k(w, n, b, out):
    d = load_f16(w, n, b, 208)
    for k in range(16):                  # 16-value group k = 2c + half; chunk c = 4h + 2s + p
        c = k >> 1
        h = c >> 2
        t = c & 3
        l0 = (k & 1) * 16
        lo_src = h * 64 + (t & 1) * 32 + l0
        hi_src = 128 + h * 32 + l0
        lsh = 4 * (t >> 1)
        hsh = 2 * t
        ds = d * _f32(np.int8(w[n, b, 192 + k]))
        for l in range(16):
            lo = (_i32(w[n, b, lo_src + l]) >> lsh) & 15
            hi = (_i32(w[n, b, hi_src + l]) >> hsh) & 3
            out[16 * k + l] = ds * _f32((lo | (hi << 4)) - 32)
