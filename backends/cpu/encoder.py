"""Kernels for encoder models (BERT): layer norm with bias, and non-causal attention in which
every token attends to every token of its own sequence (numba, GIL released, parallel over
rows / (token, head) pairs; one call per layer for the whole batch)."""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

_PJIT = dict(nogil=True, cache=True, parallel=True, fastmath=False)


@njit(inline="always", nogil=True)
def _ln_row(x, w, b, eps, out, r):
    n = x.shape[1]
    mean = 0.0                       # float64 sums, as ggml_norm does
    for i in range(n):
        mean += x[r, i]
    mean /= n
    var = 0.0
    for i in range(n):
        d = x[r, i] - mean
        var += d * d
    scale = 1.0 / math.sqrt(var / n + eps)
    for i in range(n):
        out[r, i] = np.float32((x[r, i] - mean) * scale) * w[i] + b[i]


@njit(**_PJIT)
def layer_norm(x, w, b, eps, out, par):
    """out[r] = (x[r] - mean) / sqrt(var + eps) * w + b for each row r of a 2-D array."""
    if par:
        for r in prange(x.shape[0]):
            _ln_row(x, w, b, eps, out, r)
    else:
        for r in range(x.shape[0]):
            _ln_row(x, w, b, eps, out, r)
    return out


@njit(inline="always", nogil=True)
def _attend(q, k, v, lo, hi, pos, half, scale, out, t, h, group):
    kh = h // group
    a, n = lo[t], hi[t] - lo[t]
    D = q.shape[2]
    scores = np.empty(n, np.float32)
    m = -np.inf
    for j in range(n):
        if half > 0 and abs(pos[a + j] - pos[t]) > half:
            scores[j] = -np.inf          # outside the symmetric sliding window
            continue
        s = np.float32(0.0)
        for d in range(D):
            s += q[t, h, d] * k[a + j, kh, d]
        s *= scale
        scores[j] = s
        if s > m:
            m = s
    total = 0.0
    for j in range(n):
        e = np.float32(math.exp(scores[j] - m)) if scores[j] > -np.inf else np.float32(0.0)
        scores[j] = e
        total += e
    inv = np.float32(1.0 / total)
    for d in range(D):
        out[t, h, d] = 0.0
    for j in range(n):
        w = scores[j] * inv
        for d in range(D):
            out[t, h, d] += w * v[a + j, kh, d]


@njit(**_PJIT)
def encoder_attention(q, k, v, lo, hi, pos, half, scale, out, par):
    """Non-causal attention: token t attends to tokens lo[t]..hi[t]-1 of the flat batch (its
    sequence), and when half > 0 only to those with |pos[j] - pos[t]| <= half (a symmetric
    sliding window). q [T, H, D], k/v [T, KVH, D]; softmax(q k^T * scale) v into out."""
    T, H = q.shape[0], q.shape[1]
    group = H // k.shape[1]
    if par:
        for th in prange(T * H):
            _attend(q, k, v, lo, hi, pos, half, scale, out, th // H, th % H, group)
    else:
        for th in range(T * H):
            _attend(q, k, v, lo, hi, pos, half, scale, out, th // H, th % H, group)
    return out


def sequence_bounds(token_seq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each token, the [lo, hi) rows of its sequence (spans are contiguous, in order)."""
    ts = np.asarray(token_seq)
    return (np.searchsorted(ts, ts, "left").astype(np.int64),
            np.searchsorted(ts, ts, "right").astype(np.int64))
