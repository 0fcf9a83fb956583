"""A mixture-of-experts router on the CPU: F32 logits, softmax, top k, renormalized weights.

One numba call for all the tokens of a step (parallel over tokens when there are many).
Every row is computed by the same operations in the same order whatever the number of rows
(16-lane fused multiply-adds over the columns in order, the lanes summed by a fixed tree), so
a token is routed identically alone or in a prefill. Routing as llama.cpp's build_moe_ffn
with softmax gating and normalized weights (qwen3moe): p = softmax(logits) over every expert,
the k largest p (ties: the lower expert index, as a stable sort), each divided by their sum
(at least 2^-14, ggml's clamp).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from . import _stamp
from ._simd import vfma, vhsum, vload, vzero

_DEPS = ("_simd.py",)        # inlined here: see _stamp.py
_DEPS_HASH = "87956b1a768fad6f"

_CACHE = _stamp.current(_DEPS, _DEPS_HASH)
_PJIT = dict(nogil=True, cache=_CACHE, parallel=True, fastmath=False)
_JIT = dict(nogil=True, cache=_CACHE, fastmath=False)

MIN_WEIGHT_SUM = np.float32(6.103515625e-5)     # ggml_clamp of the weights' sum (2^-14)


@njit(inline="always", nogil=True)
def _dot(x, r, w, e, K):
    """x[r] . w[e], 16 lanes in order then a fixed tree, the tail after."""
    acc = vzero()
    nv = K // 16 * 16
    xo, wo = r * K, e * K
    for i in range(0, nv, 16):
        acc = vfma(vload(x, xo + i), vload(w, wo + i), acc)
    s = vhsum(acc)
    for i in range(nv, K):
        s += x[r, i] * w[e, i]
    return s


@njit(inline="always", nogil=True)
def _tail(s, x, r, w, e, K):
    for i in range(K // 16 * 16, K):
        s += x[r, i] * w[e, i]
    return s


@njit(inline="always", nogil=True)
def _logits(x, r, w, out, e0, e1):
    """out[r, e] = _dot(x, r, w, e) for e0 <= e < e1, four experts at a time (four
    independent chains sharing the loads of x: each logit the same operations as _dot's)."""
    K = x.shape[1]
    nv = K // 16 * 16
    xo = r * K
    e = e0
    while e + 4 <= e1:
        a0, a1, a2, a3 = vzero(), vzero(), vzero(), vzero()
        for i in range(0, nv, 16):
            xv = vload(x, xo + i)
            a0 = vfma(xv, vload(w, e * K + i), a0)
            a1 = vfma(xv, vload(w, (e + 1) * K + i), a1)
            a2 = vfma(xv, vload(w, (e + 2) * K + i), a2)
            a3 = vfma(xv, vload(w, (e + 3) * K + i), a3)
        out[r, e] = _tail(vhsum(a0), x, r, w, e, K)
        out[r, e + 1] = _tail(vhsum(a1), x, r, w, e + 1, K)
        out[r, e + 2] = _tail(vhsum(a2), x, r, w, e + 2, K)
        out[r, e + 3] = _tail(vhsum(a3), x, r, w, e + 3, K)
        e += 4
    while e < e1:
        out[r, e] = _dot(x, r, w, e, K)
        e += 1


@njit(inline="always", nogil=True)
def route_rows(x, w, k, logits, ids, wts, nw, par):
    """route()'s body, to inline in a bigger kernel: with nw > 1 threads and few rows the
    experts are split between the threads (decode: one token's 128 logits), with par and
    many rows the rows are; the bits are the same either way."""
    T = x.shape[0]
    E = w.shape[0]
    if nw > 1 and T < 4 * nw:
        nc = 4 * nw
        for c in prange(nc):
            e0 = (c * E // nc) // 4 * 4
            e1 = E if c == nc - 1 else ((c + 1) * E // nc) // 4 * 4
            for t in range(T):
                _logits(x, t, w, logits, e0, e1)
        for t in range(T):
            _route_row(logits, t, k, ids, wts)
    elif par:
        for t in prange(T):
            _logits(x, t, w, logits, 0, E)
            _route_row(logits, t, k, ids, wts)
    else:
        for t in range(T):
            _logits(x, t, w, logits, 0, E)
            _route_row(logits, t, k, ids, wts)


@njit(inline="always", nogil=True)
def _route_row(logits, t, k, ids, wts):
    """Softmax over row t of logits, top k (ties: lower index), weights renormalized."""
    E = logits.shape[1]
    mx = logits[t, 0]
    for e in range(1, E):
        if logits[t, e] > mx:
            mx = logits[t, e]
    p = np.empty(E, np.float32)
    s = np.float32(0.0)
    for e in range(E):
        p[e] = np.exp(logits[t, e] - mx)
        s += p[e]
    for e in range(E):
        p[e] = p[e] / s
    taken = np.zeros(E, np.bool_)
    ws = np.float32(0.0)
    for j in range(k):
        best = -1
        for e in range(E):
            if not taken[e] and (best < 0 or p[e] > p[best]):
                best = e
        taken[best] = True
        ids[t, j] = best
        wts[t, j] = p[best]
        ws += p[best]
    ws = max(ws, MIN_WEIGHT_SUM)
    for j in range(k):
        wts[t, j] = wts[t, j] / ws


@njit(**_PJIT)
def route(x, w, k, logits, ids, wts, nw, par):
    """x float32[T, X], w float32[E, X] (C-contiguous) -> logits float32[T, E], ids
    int64[T, k], wts float32[T, k]; nw threads, par: in parallel over tokens (see
    route_rows)."""
    route_rows(x, w, k, logits, ids, wts, nw, par)


@njit(**_JIT)
def route_logits(logits, k, ids, wts):
    """The routing of given logits float32[T, E] (a router of another type; the tests)."""
    for t in range(logits.shape[0]):
        _route_row(logits, t, k, ids, wts)
