"""A decoder layer's small ops fused around its repacked matmuls, for steps of a few tokens.

A decode step of a small model is mostly calls: per layer a residual add, an RMS norm, the
q/k/v matmuls (quantize, tiles), QK-norm and rope for q and k, the output projection, another
add and norm, each its own trip through Python and numba's dispatcher. Two kernels here do
the work of those eight calls in two (and a third the four at the end of a step):

- `norm_qkv`: x += y (the previous layer's FFN output, when given), h = rms_norm(x) * wn,
  q/k/v = h @ W^T (h quantized once per activation format, the tiles run as packed_matmuls
  runs them), then rms_norm * qn and rope on each head of q, and with kn on each head of k;
- `out_add_norm`: o = a @ Wo^T, x += o, h = rms_norm(x) * wn; `out_add_norm_ffn` that and
  the SwiGLU FFN of h (gate/up, swiglu, down): decode's two FFN calls join it;
- `add_norm_matmul` (the step's end): x += y, logits = rms_norm(x) * wn @ W^T.

Each step is the code the separate ops run (the same inlined functions: _norm's row norms,
_actquant's quantizer, _int8's tile kernels by address, kernels' rope), in the same order, so
every output is the same bits as the ops it replaces; tests/test_layer_fused.py compares them.
Everything but the tiles runs on the calling thread: callers use these only for steps too
small for the ops' parallel norms and quantization (CpuOps.fusable_rows).

A matrix is described by a row of P int64[n, N_FIELDS] and its row of Wt int64[n, W_FIELDS]
(_int8.weight_fields), n the 1 to 3 matrices of a call.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from . import _stamp
from ._actquant import _quantize_block_vec, block_zb
from ._int8 import _call_tiles, _fetch_add
from ._norm import _rms_group, _rms_row
from ._swiglu import swiglu_row_to
from .kernels import _rope_head

# inlined here (see _stamp.py): the quantizer, the norms, rope, the tile-call intrinsics
_DEPS = ("_actquant.py", "_norm.py", "kernels.py", "_simd.py", "_moe.py", "_swiglu.py",
         "_int8.py")
_DEPS_HASH = "02c13269f10df3d5"

_CACHE = _stamp.current(_DEPS, _DEPS_HASH)
_JIT = dict(nogil=True, cache=_CACHE, fastmath=False)
_PJIT = dict(nogil=True, cache=_CACHE, parallel=True, fastmath=False)

# P[m] fields: tile kernel address, activation block, weight block, zero point, output rows
FN, ACT_BLOCK, W_BLOCK, ZP, N_ROWS = range(5)
N_FIELDS = 5
LANES = 16
# as _int8.SMALL_M_CHUNK_BYTES: with few rows a thread's chunk of tiles is one long stream
SMALL_M_CHUNK_BYTES = 1 << 17


@njit(inline="always", nogil=True)
def _quantize_for(h, P, m, qa, da, bsf, zb):
    """h's codes for matrix m's format into qa[m], da[m], bsf[m]: copied from an earlier
    matrix of the same format when there is one (the codes depend only on A and B); zb[m]
    from bsf (the exact integer sums) times m's zero point, as packed.ActCodes.zb_for."""
    T, K = h.shape
    A, B, zp = P[m, ACT_BLOCK], P[m, W_BLOCK], P[m, ZP]
    nb = K // B
    src = -1
    for j in range(m):
        if P[j, ACT_BLOCK] == A and P[j, W_BLOCK] == B:
            src = j
            break
    if src < 0:
        q2 = qa[m]
        d2 = da[m, :nb]
        b2 = bsf[m, :nb]
        z2 = zb[m, :nb]
        for r in range(T):
            for ab in range(K // A):
                _quantize_block_vec(h, r, r, ab, A, B, zp, q2, d2, b2, z2)
    else:
        qa[m] = qa[src]
        da[m, :nb] = da[src, :nb]
        bsf[m, :nb] = bsf[src, :nb]
    for b in range(nb):
        for r in range(T):
            zb[m, b, r] = block_zb(bsf[m, b, r], zp)


@njit(inline="always", nogil=True)
def _tiles(P, Wt, m, qa, da, bsf, zb, out, t0, t1):
    K = qa.shape[2]
    nb = K // P[m, W_BLOCK]
    _call_tiles(P[m, FN], t0, t1, Wt[m].ctypes.data, qa[m].ctypes.data,
                da[m, :nb].ctypes.data, bsf[m, :nb].ctypes.data, zb[m, :nb].ctypes.data,
                out.ctypes.data, qa.shape[1], K, out.shape[1], qa.shape[1])


@njit(**_PJIT)
def _tiles_parallel(P, Wt, qa, da, bsf, zb, o0, o1, o2, nw, counter):
    """_matmuls' tiles on nw threads: the tiles of all the matrices of Wt in chunks dealt
    from one counter, as _int8's driver. A kernel of its own (one compiled signature for
    all callers), so the callers compile no parallel region themselves."""
    n = Wt.shape[0]
    T0 = Wt[0, 6]
    T1 = Wt[1, 6] if n > 1 else 0
    T2 = Wt[2, 6] if n > 2 else 0
    per = max(1, (T0 + T1 + T2) // (nw * 16))
    if qa.shape[1] < 8:
        per = max(per, SMALL_M_CHUNK_BYTES // (Wt[0, 7] * Wt[0, 8] * 64))
    c0 = (T0 + per - 1) // per
    c1 = (T1 + per - 1) // per
    c2 = (T2 + per - 1) // per
    counter[0] = 0          # a caller may hand the same counter to every call
    addr = counter.ctypes.data
    for _w in prange(nw):
        while True:
            c = _fetch_add(addr, np.int64(1))
            if c >= c0 + c1 + c2:
                break
            if c < c0:
                _tiles(P, Wt, 0, qa, da, bsf, zb, o0, c * per, min(T0, (c + 1) * per))
            elif c < c0 + c1:
                c -= c0
                _tiles(P, Wt, 1, qa, da, bsf, zb, o1, c * per, min(T1, (c + 1) * per))
            else:
                c -= c0 + c1
                _tiles(P, Wt, 2, qa, da, bsf, zb, o2, c * per, min(T2, (c + 1) * per))


@njit(inline="always", nogil=True)
def _matmuls(P, Wt, qa, da, bsf, zb, o0, o1, o2, nw, counter):
    """o_m = the product of matrix m's codes and tiles for the n = 1 to 3 matrices of Wt:
    on this thread, or with nw > 1 by _tiles_parallel."""
    if nw > 1:
        _tiles_parallel(P, Wt, qa, da, bsf, zb, o0, o1, o2, nw, counter)
        return
    n = Wt.shape[0]
    _tiles(P, Wt, 0, qa, da, bsf, zb, o0, 0, Wt[0, 6])
    if n > 1:
        _tiles(P, Wt, 1, qa, da, bsf, zb, o1, 0, Wt[1, 6])
    if n > 2:
        _tiles(P, Wt, 2, qa, da, bsf, zb, o2, 0, Wt[2, 6])


@njit(inline="always", nogil=True)
def _norm_rope_heads(x, H, w, eps, cos, sin, neox):
    """_norm.norm_rope's serial loop on x[T, H*D] seen as [T, H, D]."""
    T = x.shape[0]
    D = x.shape[1] // H
    x3 = x.reshape((T, H, D))
    x2 = x.reshape((T * H, D))
    for th in range(T * H):
        _rms_row(x2, w, eps, x2, th)
        _rope_head(x3, cos, sin, neox, th // H, th % H)


@njit(inline="always", nogil=True)
def _add_norm_codes(x, y, add, wn, eps, P, n):
    """x += y in place when add, h = rms_norm(x) * wn, and h's codes (_codes)."""
    T, X = x.shape
    if add:
        for r in range(T):
            for i in range(X):
                x[r, i] += y[r, i]
    h = np.empty((T, X), np.float32)
    for g in range((T + 7) // 8):
        _rms_group(x, wn, eps, h, g)
    return _codes(h, P, n)


@njit(inline="always", nogil=True)
def _codes(h, P, n):
    """h's activation codes for the first n matrices of P (each in its own format's blocks):
    (qa, da, bsf, zb) as _matmuls takes them."""
    T, X = h.shape
    nbmax = X // 16
    qa = np.empty((n, T, X), np.int8)
    da = np.empty((n, nbmax, T), np.float32)
    bsf = np.empty((n, nbmax, T), np.float32)
    zb = np.empty((n, nbmax, T), np.int32)
    for m in range(n):
        _quantize_for(h, P, m, qa, da, bsf, zb)
    return qa, da, bsf, zb


@njit(**_JIT)
def norm_qkv(x, y, add, wn, eps, P, Wt, q, k, v, H, KVH, qn, kn, cos, sin, neox, nw, counter):
    """x float32[T, X] (updated in place: x += y when add), then h = rms_norm(x) * wn; q, k, v
    float32[T, N_m] = h @ W_m^T for the three matrices of P, Wt; then each head of q
    (H heads) RMS-normed by qn and roped, each head of k (KVH heads) by kn. nw threads for
    the tiles; counter int64[1], owned by the caller (zeroed here)."""
    qa, da, bsf, zb = _add_norm_codes(x, y, add, wn, eps, P, 3)
    _matmuls(P, Wt, qa, da, bsf, zb, q, k, v, nw, counter)
    _norm_rope_heads(q, H, qn, eps, cos, sin, neox)
    _norm_rope_heads(k, KVH, kn, eps, cos, sin, neox)


@njit(inline="always", nogil=True)
def _rope_heads(x, H, cos, sin, neox):
    """kernels.rope_inplace's serial loop on x[T, H*D] seen as [T, H, D]."""
    T = x.shape[0]
    x3 = x.reshape((T, H, x.shape[1] // H))
    for th in range(T * H):
        _rope_head(x3, cos, sin, neox, th // H, th % H)


@njit(inline="always", nogil=True)
def _add_bias(x, b):
    """x[T, N] += b[N], as numpy's broadcast add (one rounding per element)."""
    for r in range(x.shape[0]):
        for i in range(x.shape[1]):
            x[r, i] += b[i]


@njit(**_JIT)
def norm_qkv_rope(x, y, add, wn, eps, P, Wt, q, k, v, H, KVH, bq, bk, bv, bias, cos, sin,
                  neox, nw, counter):
    """norm_qkv for a block without QK-norm (llama, qwen2): x += y when add, h = rms_norm(x)
    * wn, q/k/v = h @ W_m^T, plus bq/bk/bv when bias (qwen2), then rope on each head of q (H)
    and k (KVH): the bits of ops.add, rms_norm, matmuls, add_bias and rope."""
    qa, da, bsf, zb = _add_norm_codes(x, y, add, wn, eps, P, 3)
    _matmuls(P, Wt, qa, da, bsf, zb, q, k, v, nw, counter)
    if bias:
        _add_bias(q, bq)
        _add_bias(k, bk)
        _add_bias(v, bv)
    _rope_heads(q, H, cos, sin, neox)
    _rope_heads(k, KVH, cos, sin, neox)


@njit(inline="always", nogil=True)
def _out_add_norm(a, P, Wt, x, wn, eps, h, nw, counter):
    T = a.shape[0]
    X = x.shape[1]
    qa, da, bsf, zb = _codes(a, P, 1)
    o = np.empty((T, X), np.float32)
    _matmuls(P, Wt, qa, da, bsf, zb, o, o, o, nw, counter)
    for r in range(T):
        for i in range(X):
            x[r, i] += o[r, i]
    for g in range((T + 7) // 8):
        _rms_group(x, wn, eps, h, g)


@njit(**_JIT)
def out_add_norm(a, P, Wt, x, wn, eps, h, nw, counter):
    """o = a @ W^T (the one matrix of P, Wt), x += o in place, h = rms_norm(x) * wn."""
    _out_add_norm(a, P, Wt, x, wn, eps, h, nw, counter)
    return h


@njit(**_JIT)
def out_add_norm_ffn(a, P, Wt, x, wn, eps, Pgu, Wtgu, Pd, Wtd, nw, nw_gu, nw_d, counter):
    """out_add_norm, then the SwiGLU FFN of its h: f = swiglu(h @ Wg^T, h @ Wu^T) @ Wd^T,
    returned (Pgu, Wtgu: gate and up; Pd, Wtd: down; nw, nw_gu, nw_d: each product's
    threads). The bits of ops.out_add_norm, ops.matmuls and ops.swiglu_matmul: the same
    quantizer on the same SwiGLU rows (_swiglu.swiglu_row_to), the same tiles."""
    T, X = x.shape
    h = np.empty((T, X), np.float32)
    _out_add_norm(a, P, Wt, x, wn, eps, h, nw, counter)
    qa, da, bsf, zb = _codes(h, Pgu, 2)
    g = np.empty((T, Pgu[0, N_ROWS]), np.float32)
    u = np.empty((T, Pgu[1, N_ROWS]), np.float32)
    _matmuls(Pgu, Wtgu, qa, da, bsf, zb, g, u, u, nw_gu, counter)
    for r in range(T):
        swiglu_row_to(g, u, r, g, r)        # in place, row by row: as quantize_swiglu_rows
    qa, da, bsf, zb = _codes(g, Pd, 1)
    f = np.empty((T, Pd[0, N_ROWS]), np.float32)
    _matmuls(Pd, Wtd, qa, da, bsf, zb, f, f, f, nw_d, counter)
    return f


@njit(**_JIT)
def add_norm_matmul(x, y, add, wn, eps, P, Wt, out, nw, counter):
    """x += y in place when add, then out = rms_norm(x) * wn @ W^T (the one matrix of P,
    Wt): the last residual add, the final norm and the output head of a decode step."""
    qa, da, bsf, zb = _add_norm_codes(x, y, add, wn, eps, P, 1)
    _matmuls(P, Wt, qa, da, bsf, zb, out, out, out, nw, counter)
    return out
