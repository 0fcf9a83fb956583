"""The Hadamard rotation llama.cpp applies around a quantized KV cache (its PR 21038).

With a quantized K/V cache (q8_0 here) llama.cpp rotates Q, K and V by an orthonormal
Hadamard matrix before K and V are stored, attends with the rotated vectors (q.k is unchanged
by an orthonormal rotation, and the output is the same combination of rotated V rows), and
rotates the output back. The rotation spreads outliers over each 64-value chunk, so the 8-bit
blocks lose less. The matrix is Sylvester's H_64 / 8 (symmetric and its own inverse), applied
to every 64-value chunk of a head's row.

Here it is a fast Walsh-Hadamard transform per chunk: a fixed butterfly order per row, so a
row's result is the same bits whatever else is in the batch (llama.cpp multiplies by the
matrix, so the last bits of a rotated value may differ from its).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

ROT = 64                    # chunk the rotation works on (llama.cpp's for head dims % 64 == 0)

_JIT = dict(nogil=True, cache=True, parallel=True, fastmath=False)


@njit(inline="always", nogil=True)
def _fwht_chunk(x, out, r, c0):
    for j in range(ROT):
        out[r, c0 + j] = x[r, c0 + j]
    h = 1
    while h < ROT:
        for i in range(0, ROT, 2 * h):
            for j in range(i, i + h):
                a = out[r, c0 + j]
                b = out[r, c0 + j + h]
                out[r, c0 + j] = a + b
                out[r, c0 + j + h] = a - b
        h *= 2
    for j in range(ROT):
        out[r, c0 + j] *= np.float32(0.125)         # 1 / sqrt(64): exact


@njit(**_JIT)
def hadamard_rows(x, out, par):
    """out[r] = each 64-value chunk of x[r] times H_64 / 8 (Sylvester order). x, out: float32
    [rows, n] with n % 64 == 0; out may be x."""
    rows, n = x.shape
    nc = n // ROT
    if par:
        for rc in prange(rows * nc):
            _fwht_chunk(x, out, rc // nc, (rc % nc) * ROT)
    else:
        for rc in range(rows * nc):
            _fwht_chunk(x, out, rc // nc, (rc % nc) * ROT)
    return out


def rotate(x: np.ndarray, par: bool) -> np.ndarray:
    """A new array: x [..., D] with every 64-value chunk of its last axis rotated."""
    flat = np.ascontiguousarray(x).reshape(-1, x.shape[-1])
    return hadamard_rows(flat, np.empty_like(flat), par).reshape(x.shape)
