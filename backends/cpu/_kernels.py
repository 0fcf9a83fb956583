"""Per-type numba kernels: three generic bodies instantiated with each type's decoder.

Weights come in as uint8[N, n_blocks, block_bytes] (a free reshape of the row bytes).
Each body is `inline="always"`: numba inlines it at IR level into a two-line per-type
wrapper, so the decoder becomes a direct call to a global, the wrapper has one concrete
signature and caches on disk (`cache=True`), and only the types a model uses get compiled.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from . import _decode as D
from . import _dot as P
from ._simd import vfma, vhsum, vload, vstore, vzero

_f32 = np.float32
_PAR = dict(nogil=True, cache=True, parallel=True)
_CHUNK_ROWS = 16        # output rows per work item (prange schedules these statically)


@njit(inline="always")
def _rows_body(dec, bs, w, ids, out):
    """out[r, :] = decoded row ids[r] of w, exact. out is float32[len(ids), K]."""
    nr = ids.shape[0]
    nb = w.shape[1]
    ts = w.shape[2]
    K = nb * bs
    for r in prange(nr):
        n = ids[r]
        for b in range(nb):
            dec(w, n, b, (n * nb + b) * ts, out, r * K + b * bs)


@njit(inline="always")
def _mv_body(dot, w, x, out):
    """out[n] = dot(row n of w, x)."""
    N = w.shape[0]
    nch = (N + _CHUNK_ROWS - 1) // _CHUNK_ROWS
    for c in prange(nch):
        for n in range(c * _CHUNK_ROWS, min(N, (c + 1) * _CHUNK_ROWS)):
            out[n] = dot(w, n, x)


@njit(inline="always")
def _mm_body(dec, bs, w, x, out):
    """out[m, n] = dot(row n of w, x[m]) for all m; each block is decoded once for all m."""
    N = w.shape[0]
    nb = w.shape[1]
    ts = w.shape[2]
    M = x.shape[0]
    K = x.shape[1]
    nsub = bs // 16
    nch = (N + _CHUNK_ROWS - 1) // _CHUNK_ROWS
    for c in prange(nch):
        buf = np.empty(bs, _f32)
        acc = np.empty(16 * M, _f32)
        for n in range(c * _CHUNK_ROWS, min(N, (c + 1) * _CHUNK_ROWS)):
            for m in range(M):
                vstore(acc, 16 * m, vzero())
            for b in range(nb):
                dec(w, n, b, (n * nb + b) * ts, buf, 0)
                for m in range(M):
                    a = vload(acc, 16 * m)
                    xo = m * K + b * bs
                    for s in range(nsub):
                        a = vfma(vload(buf, 16 * s), vload(x, xo + 16 * s), a)
                    vstore(acc, 16 * m, a)
            for m in range(M):
                out[m, n] = vhsum(vload(acc, 16 * m))


# Three two-line wrappers per type, written out rather than made by a factory: numba's disk
# cache keys on the function's qualified name, so closures would overwrite each other.

@njit(**_PAR)
def rows_f32(w, ids, out): _rows_body(D.dec_f32, 32, w, ids, out)
@njit(**_PAR)
def mv_f32(w, x, out): _mv_body(P.dot_f32, w, x, out)
@njit(**_PAR)
def mm_f32(w, x, out): _mm_body(D.dec_f32, 32, w, x, out)


@njit(**_PAR)
def rows_f16(w, ids, out): _rows_body(D.dec_f16, 32, w, ids, out)
@njit(**_PAR)
def mv_f16(w, x, out): _mv_body(P.dot_f16, w, x, out)
@njit(**_PAR)
def mm_f16(w, x, out): _mm_body(D.dec_f16, 32, w, x, out)


@njit(**_PAR)
def rows_bf16(w, ids, out): _rows_body(D.dec_bf16, 32, w, ids, out)
@njit(**_PAR)
def mv_bf16(w, x, out): _mv_body(P.dot_bf16, w, x, out)
@njit(**_PAR)
def mm_bf16(w, x, out): _mm_body(D.dec_bf16, 32, w, x, out)


@njit(**_PAR)
def rows_q4_0(w, ids, out): _rows_body(D.dec_q4_0, 32, w, ids, out)
@njit(**_PAR)
def mv_q4_0(w, x, out): _mv_body(P.dot_q4_0, w, x, out)
@njit(**_PAR)
def mm_q4_0(w, x, out): _mm_body(D.dec_q4_0, 32, w, x, out)


@njit(**_PAR)
def rows_q4_1(w, ids, out): _rows_body(D.dec_q4_1, 32, w, ids, out)
@njit(**_PAR)
def mv_q4_1(w, x, out): _mv_body(P.dot_q4_1, w, x, out)
@njit(**_PAR)
def mm_q4_1(w, x, out): _mm_body(D.dec_q4_1, 32, w, x, out)


@njit(**_PAR)
def rows_q5_0(w, ids, out): _rows_body(D.dec_q5_0, 32, w, ids, out)
@njit(**_PAR)
def mv_q5_0(w, x, out): _mv_body(P.dot_q5_0, w, x, out)
@njit(**_PAR)
def mm_q5_0(w, x, out): _mm_body(D.dec_q5_0, 32, w, x, out)


@njit(**_PAR)
def rows_q5_1(w, ids, out): _rows_body(D.dec_q5_1, 32, w, ids, out)
@njit(**_PAR)
def mv_q5_1(w, x, out): _mv_body(P.dot_q5_1, w, x, out)
@njit(**_PAR)
def mm_q5_1(w, x, out): _mm_body(D.dec_q5_1, 32, w, x, out)


@njit(**_PAR)
def rows_q8_0(w, ids, out): _rows_body(D.dec_q8_0, 32, w, ids, out)
@njit(**_PAR)
def mv_q8_0(w, x, out): _mv_body(P.dot_q8_0, w, x, out)
@njit(**_PAR)
def mm_q8_0(w, x, out): _mm_body(D.dec_q8_0, 32, w, x, out)


@njit(**_PAR)
def rows_q2_k(w, ids, out): _rows_body(D.dec_q2_k, 256, w, ids, out)
@njit(**_PAR)
def mv_q2_k(w, x, out): _mv_body(P.dot_q2_k, w, x, out)
@njit(**_PAR)
def mm_q2_k(w, x, out): _mm_body(D.dec_q2_k, 256, w, x, out)


@njit(**_PAR)
def rows_q3_k(w, ids, out): _rows_body(D.dec_q3_k, 256, w, ids, out)
@njit(**_PAR)
def mv_q3_k(w, x, out): _mv_body(P.dot_q3_k, w, x, out)
@njit(**_PAR)
def mm_q3_k(w, x, out): _mm_body(D.dec_q3_k, 256, w, x, out)


@njit(**_PAR)
def rows_q4_k(w, ids, out): _rows_body(D.dec_q4_k, 256, w, ids, out)
@njit(**_PAR)
def mv_q4_k(w, x, out): _mv_body(P.dot_q4_k, w, x, out)
@njit(**_PAR)
def mm_q4_k(w, x, out): _mm_body(D.dec_q4_k, 256, w, x, out)


@njit(**_PAR)
def rows_q5_k(w, ids, out): _rows_body(D.dec_q5_k, 256, w, ids, out)
@njit(**_PAR)
def mv_q5_k(w, x, out): _mv_body(P.dot_q5_k, w, x, out)
@njit(**_PAR)
def mm_q5_k(w, x, out): _mm_body(D.dec_q5_k, 256, w, x, out)


@njit(**_PAR)
def rows_q6_k(w, ids, out): _rows_body(D.dec_q6_k, 256, w, ids, out)
@njit(**_PAR)
def mv_q6_k(w, x, out): _mv_body(P.dot_q6_k, w, x, out)
@njit(**_PAR)
def mm_q6_k(w, x, out): _mm_body(D.dec_q6_k, 256, w, x, out)


# type code -> (rows kernel, matvec kernel, multi-row kernel)
KERNELS = {
    D.F32: (rows_f32, mv_f32, mm_f32),
    D.F16: (rows_f16, mv_f16, mm_f16),
    D.BF16: (rows_bf16, mv_bf16, mm_bf16),
    D.Q4_0: (rows_q4_0, mv_q4_0, mm_q4_0),
    D.Q4_1: (rows_q4_1, mv_q4_1, mm_q4_1),
    D.Q5_0: (rows_q5_0, mv_q5_0, mm_q5_0),
    D.Q5_1: (rows_q5_1, mv_q5_1, mm_q5_1),
    D.Q8_0: (rows_q8_0, mv_q8_0, mm_q8_0),
    D.Q2_K: (rows_q2_k, mv_q2_k, mm_q2_k),
    D.Q3_K: (rows_q3_k, mv_q3_k, mm_q3_k),
    D.Q4_K: (rows_q4_k, mv_q4_k, mm_q4_k),
    D.Q5_K: (rows_q5_k, mv_q5_k, mm_q5_k),
    D.Q6_K: (rows_q6_k, mv_q6_k, mm_q6_k),
}
