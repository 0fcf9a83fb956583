"""Per-type numba kernels: three generic bodies instantiated with each type's decoder.

Weights come in as uint8[N, n_blocks, block_bytes] (a free reshape of the row bytes).
Each body is `inline="always"`: numba inlines it at IR level into a two-line per-type
wrapper, so the decoder becomes a direct call to a global, the wrapper has one concrete
signature and caches on disk (`cache=True`), and only the types a model uses get compiled.

numba's disk cache is keyed on the content of this file only, yet the kernels inline code
from _decode, _dot and _simd. So this file carries a hash of those three (`_DEPS_HASH`): an
edit there changes this file too, which invalidates the cache. If the hash is stale (an edit
without updating it), caching is switched off rather than loading stale machine code, and
tests/test_matmul.py fails with the value to paste here.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from . import _decode as D
from . import _stamp
from . import _dot as P
from ._simd import vfma, vhsum, vload, vzero

_DEPS = ("_decode.py", "_dot.py", "_simd.py")
_DEPS_HASH = "e59820164470a0ef"


_CACHE = _stamp.current(_DEPS, _DEPS_HASH)        # see _stamp.py
_f32 = np.float32
_PAR = dict(nogil=True, cache=_CACHE, parallel=True)
_CHUNK_ROWS = 16        # output rows per matvec work item
# prange splits work items statically. Dynamic scheduling (numba.set_parallel_chunksize)
# was measured 10-22% slower on one thread for these short calls, so it is not used.


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
def _mvm_body(dot, w, x, out):
    """out[m, n] = dot(row n of w, x[m]) for a few x rows (batched decode). Each weight row
    comes from memory once and stays in L1 for the M dots, and a row's result is the
    matvec's, bit for bit, whatever M is."""
    N = w.shape[0]
    M = x.shape[0]
    nch = (N + _CHUNK_ROWS - 1) // _CHUNK_ROWS
    for c in prange(nch):
        for n in range(c * _CHUNK_ROWS, min(N, (c + 1) * _CHUNK_ROWS)):
            for m in range(M):
                out[m, n] = dot(w, n, x[m])


@njit(inline="always", nogil=True)
def _put(out, m, n, M, N, v):
    if m < M and n < N:
        out[m, n] = vhsum(v)


@njit(nogil=True, cache=_CACHE)
def _micro4x4(buf, wo, xp, xo, K, out, m0, n0, M, N):
    """out[m0:m0+4, n0:n0+4] = x rows (from xp at xo) . decoded weight rows (buf at wo).

    16 vector accumulators along k, one horizontal sum each at the end: per 16 values of k
    it is 8 loads and 16 FMAs, so it runs near the FMA ceiling with no transposes.
    """
    a00 = vzero(); a01 = vzero(); a02 = vzero(); a03 = vzero()
    a10 = vzero(); a11 = vzero(); a12 = vzero(); a13 = vzero()
    a20 = vzero(); a21 = vzero(); a22 = vzero(); a23 = vzero()
    a30 = vzero(); a31 = vzero(); a32 = vzero(); a33 = vzero()
    for k in range(0, K, 16):
        w0 = vload(buf, wo + k)
        w1 = vload(buf, wo + K + k)
        w2 = vload(buf, wo + 2 * K + k)
        w3 = vload(buf, wo + 3 * K + k)
        x0 = vload(xp, xo + k)
        a00 = vfma(x0, w0, a00); a01 = vfma(x0, w1, a01); a02 = vfma(x0, w2, a02); a03 = vfma(x0, w3, a03)
        x1 = vload(xp, xo + K + k)
        a10 = vfma(x1, w0, a10); a11 = vfma(x1, w1, a11); a12 = vfma(x1, w2, a12); a13 = vfma(x1, w3, a13)
        x2 = vload(xp, xo + 2 * K + k)
        a20 = vfma(x2, w0, a20); a21 = vfma(x2, w1, a21); a22 = vfma(x2, w2, a22); a23 = vfma(x2, w3, a23)
        x3 = vload(xp, xo + 3 * K + k)
        a30 = vfma(x3, w0, a30); a31 = vfma(x3, w1, a31); a32 = vfma(x3, w2, a32); a33 = vfma(x3, w3, a33)
    _put(out, m0, n0, M, N, a00); _put(out, m0, n0 + 1, M, N, a01)
    _put(out, m0, n0 + 2, M, N, a02); _put(out, m0, n0 + 3, M, N, a03)
    _put(out, m0 + 1, n0, M, N, a10); _put(out, m0 + 1, n0 + 1, M, N, a11)
    _put(out, m0 + 1, n0 + 2, M, N, a12); _put(out, m0 + 1, n0 + 3, M, N, a13)
    _put(out, m0 + 2, n0, M, N, a20); _put(out, m0 + 2, n0 + 1, M, N, a21)
    _put(out, m0 + 2, n0 + 2, M, N, a22); _put(out, m0 + 2, n0 + 3, M, N, a23)
    _put(out, m0 + 3, n0, M, N, a30); _put(out, m0 + 3, n0 + 1, M, N, a31)
    _put(out, m0 + 3, n0 + 2, M, N, a32); _put(out, m0 + 3, n0 + 3, M, N, a33)


@njit(nogil=True, cache=_CACHE)
def _micro1x4(buf, wo, xp, xo, K, out, m, n0, N):
    """out[m, n0:n0+4] for one x row: per output the very same FMA chain and lane sum as
    _micro4x4, so a row's result does not depend on how many rows share the call (batch
    invariance: a request decodes the same alone or batched, chunked or not)."""
    a0 = vzero(); a1 = vzero(); a2 = vzero(); a3 = vzero()
    for k in range(0, K, 16):
        x0 = vload(xp, xo + k)
        a0 = vfma(x0, vload(buf, wo + k), a0)
        a1 = vfma(x0, vload(buf, wo + K + k), a1)
        a2 = vfma(x0, vload(buf, wo + 2 * K + k), a2)
        a3 = vfma(x0, vload(buf, wo + 3 * K + k), a3)
    M = out.shape[0]
    _put(out, m, n0, M, N, a0); _put(out, m, n0 + 1, M, N, a1)
    _put(out, m, n0 + 2, M, N, a2); _put(out, m, n0 + 3, M, N, a3)


_GEMM_ROWS = 16         # weight rows decoded per step (4 micro-kernel columns)
_GEMM_MT = 64           # x rows per pass over a decoded chunk (64 x K floats stay in L2)
_GEMM_SPLIT = 64        # work items for prange; each owns one decode buffer


@njit(inline="always")
def _mm_body(dec, bs, w, xp, out):
    """out[m, n] = dot(x[m], row n of w) for M = out.shape[0] >= 1 rows.

    Rows go four at a time through the 4x4 micro-kernel and the remainder one at a time through
    the 1x4 one; both give a row bit-identical results. Each work item decodes 16 weight rows
    at a time (exactly, into an L2-sized float buffer) and runs the 4x4 register-blocked
    micro-kernel over all x rows, so each weight byte is decoded once per call. The
    micro-kernel is type-independent and compiled once, not inlined into every type.
    """
    N = w.shape[0]
    nb = w.shape[1]
    ts = w.shape[2]
    M = out.shape[0]
    M4 = M // 4 * 4
    K = xp.shape[1]
    nch = (N + _GEMM_ROWS - 1) // _GEMM_ROWS
    nsplit = min(nch, _GEMM_SPLIT)
    per = (nch + nsplit - 1) // nsplit
    for sp in prange(nsplit):
        buf = np.zeros(_GEMM_ROWS * K, _f32)
        for c in range(sp * per, min(nch, (sp + 1) * per)):
            n0 = c * _GEMM_ROWS
            for r in range(_GEMM_ROWS):
                n = n0 + r
                if n < N:
                    for b in range(nb):
                        dec(w, n, b, (n * nb + b) * ts, buf, r * K + b * bs)
            for mt in range(0, M4, _GEMM_MT):
                for j in range(0, _GEMM_ROWS, 4):
                    for m0 in range(mt, min(M4, mt + _GEMM_MT), 4):
                        _micro4x4(buf, j * K, xp, m0 * K, K, out, m0, n0 + j, M, N)
            for m in range(M4, M):
                for j in range(0, _GEMM_ROWS, 4):
                    _micro1x4(buf, j * K, xp, m * K, K, out, m, n0 + j, N)


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


# Few-row matvecs (batched decode), one per type; see _mvm_body.
@njit(**_PAR)
def mvm_f32(w, x, out): _mvm_body(P.dot_f32, w, x, out)
@njit(**_PAR)
def mvm_f16(w, x, out): _mvm_body(P.dot_f16, w, x, out)
@njit(**_PAR)
def mvm_bf16(w, x, out): _mvm_body(P.dot_bf16, w, x, out)
@njit(**_PAR)
def mvm_q4_0(w, x, out): _mvm_body(P.dot_q4_0, w, x, out)
@njit(**_PAR)
def mvm_q4_1(w, x, out): _mvm_body(P.dot_q4_1, w, x, out)
@njit(**_PAR)
def mvm_q5_0(w, x, out): _mvm_body(P.dot_q5_0, w, x, out)
@njit(**_PAR)
def mvm_q5_1(w, x, out): _mvm_body(P.dot_q5_1, w, x, out)
@njit(**_PAR)
def mvm_q8_0(w, x, out): _mvm_body(P.dot_q8_0, w, x, out)
@njit(**_PAR)
def mvm_q2_k(w, x, out): _mvm_body(P.dot_q2_k, w, x, out)
@njit(**_PAR)
def mvm_q3_k(w, x, out): _mvm_body(P.dot_q3_k, w, x, out)
@njit(**_PAR)
def mvm_q4_k(w, x, out): _mvm_body(P.dot_q4_k, w, x, out)
@njit(**_PAR)
def mvm_q5_k(w, x, out): _mvm_body(P.dot_q5_k, w, x, out)
@njit(**_PAR)
def mvm_q6_k(w, x, out): _mvm_body(P.dot_q6_k, w, x, out)


FEW_ROW_KERNELS = {
    D.F32: mvm_f32, D.F16: mvm_f16, D.BF16: mvm_bf16, D.Q4_0: mvm_q4_0, D.Q4_1: mvm_q4_1,
    D.Q5_0: mvm_q5_0, D.Q5_1: mvm_q5_1, D.Q8_0: mvm_q8_0, D.Q2_K: mvm_q2_k, D.Q3_K: mvm_q3_k,
    D.Q4_K: mvm_q4_k, D.Q5_K: mvm_q5_k, D.Q6_K: mvm_q6_k,
}

# type code -> (order within each 256-value super-block in which that type's matvec reads x,
# function (x, gather index) -> the x array that matvec takes)
X_LAYOUT = {D.Q4_K: (P.q4k_x_order(), P.q4k_x), D.Q6_K: (P.q6k_x_order(), P.q6k_x)}

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
