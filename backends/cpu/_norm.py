"""RMS norm over rows, several rows at a time (same bits as kernels.rms_norm), and the norms
fused with what follows them in a decoder layer (one call where there were two to four).

kernels.rms_norm sums each row's squares in float64, in column order, as ggml does: one
dependent chain of float64 adds per row, so a row costs about n times the add latency and
the CPU's adders sit idle most of the time. Here eight rows go through the columns together:
eight independent chains, each still summing its own row's squares in column order (so every
row's sum, scale and output are the bits of the one-row loop), and the adds overlap.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from . import _stamp
from .kernels import _rope_head

_DEPS = ("kernels.py", "_simd.py")     # inlined here (_rope_head, with kernels.py's own deps)
_DEPS_HASH = "7afdbf157da21fb7"

_CACHE = _stamp.current(_DEPS, _DEPS_HASH)
_PJIT = dict(nogil=True, cache=_CACHE, parallel=True, fastmath=False)

ROWS = 8


@njit(inline="always", nogil=True)
def _scale_rows(x, w, out, r, n, scale):
    for i in range(n):
        out[r, i] = x[r, i] * scale * w[i]


@njit(inline="always", nogil=True)
def _rms_row(x, w, eps, out, r):
    """One row: kernels._rms_row's operations."""
    n = x.shape[1]
    acc = 0.0
    for i in range(n):
        v = x[r, i]
        acc += v * v
    _scale_rows(x, w, out, r, n, np.float32(1.0 / math.sqrt(acc / n + eps)))


@njit(inline="always", nogil=True)
def _rms_rows8(x, w, eps, out, r):
    """Rows r .. r+7, each with _rms_row's operations in its order."""
    n = x.shape[1]
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = 0.0
    for i in range(n):
        v0 = x[r, i]
        v1 = x[r + 1, i]
        v2 = x[r + 2, i]
        v3 = x[r + 3, i]
        v4 = x[r + 4, i]
        v5 = x[r + 5, i]
        v6 = x[r + 6, i]
        v7 = x[r + 7, i]
        a0 += v0 * v0
        a1 += v1 * v1
        a2 += v2 * v2
        a3 += v3 * v3
        a4 += v4 * v4
        a5 += v5 * v5
        a6 += v6 * v6
        a7 += v7 * v7
    _scale_rows(x, w, out, r, n, np.float32(1.0 / math.sqrt(a0 / n + eps)))
    _scale_rows(x, w, out, r + 1, n, np.float32(1.0 / math.sqrt(a1 / n + eps)))
    _scale_rows(x, w, out, r + 2, n, np.float32(1.0 / math.sqrt(a2 / n + eps)))
    _scale_rows(x, w, out, r + 3, n, np.float32(1.0 / math.sqrt(a3 / n + eps)))
    _scale_rows(x, w, out, r + 4, n, np.float32(1.0 / math.sqrt(a4 / n + eps)))
    _scale_rows(x, w, out, r + 5, n, np.float32(1.0 / math.sqrt(a5 / n + eps)))
    _scale_rows(x, w, out, r + 6, n, np.float32(1.0 / math.sqrt(a6 / n + eps)))
    _scale_rows(x, w, out, r + 7, n, np.float32(1.0 / math.sqrt(a7 / n + eps)))


@njit(inline="always", nogil=True)
def _rms_group(x, w, eps, out, g):
    """Group g: rows 8g .. 8g+7 (fewer in the last group)."""
    M = x.shape[0]
    r = g * ROWS
    if r + ROWS <= M:
        _rms_rows8(x, w, eps, out, r)
    else:
        for rr in range(r, M):
            _rms_row(x, w, eps, out, rr)


@njit(**_PJIT)
def rms_norm(x, w, eps, out, par):
    """out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w for each row r of a 2-D array: the bits of
    kernels.rms_norm."""
    groups = (x.shape[0] + ROWS - 1) // ROWS
    if par:
        for g in prange(groups):
            _rms_group(x, w, eps, out, g)
    else:
        for g in range(groups):
            _rms_group(x, w, eps, out, g)
    return out


@njit(inline="always", nogil=True)
def _add_group(x, a, g):
    """x[r] += a[r] for the rows of group g (float32 adds, as numpy's x += a)."""
    for r in range(g * ROWS, min(x.shape[0], (g + 1) * ROWS)):
        for i in range(x.shape[1]):
            x[r, i] += a[r, i]


@njit(**_PJIT)
def add_rms_norm(x, a, wa, wx, eps, h, par):
    """x += rms_norm(a) * wa (in place; a is overwritten with its norm), then
    h = rms_norm(x) * wx: the bits of rms_norm, numpy's x += and rms_norm in turn, in one
    call (Gemma's post-norm residual and the next pre-norm; decode made ~70 of these calls
    a step)."""
    groups = (x.shape[0] + ROWS - 1) // ROWS
    if par:
        for g in prange(groups):
            _rms_group(a, wa, eps, a, g)
            _add_group(x, a, g)
            _rms_group(x, wx, eps, h, g)
    else:
        for g in range(groups):
            _rms_group(a, wa, eps, a, g)
            _add_group(x, a, g)
            _rms_group(x, wx, eps, h, g)
    return h


@njit(**_PJIT)
def norm_rope(x, w, eps, cos, sin, neox, par):
    """In place on x[T, H, D]: each head's RMS norm (times w[D]), then the rotary embedding
    with per-token tables cos/sin[T, D/2]: the bits of rms_norm then kernels.rope_inplace
    (QK-norm and rope in one call)."""
    T, H, D = x.shape
    x2 = x.reshape(T * H, D)
    if par:
        for th in prange(T * H):
            _rms_row(x2, w, eps, x2, th)
            _rope_head(x, cos, sin, neox, th // H, th % H)
    else:
        for th in range(T * H):
            _rms_row(x2, w, eps, x2, th)
            _rope_head(x, cos, sin, neox, th // H, th % H)
    return x
