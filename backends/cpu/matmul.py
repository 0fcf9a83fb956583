"""Quantized matmul on the CPU: y = x @ W^T with W kept quantized.

Three paths, chosen by the number of activation rows M (see benchmarks/kernels.py):
- M == 1 (decode): a fused dequantize-and-dot matvec, parallel over output rows.
- 1 < M < BLAS_MIN_ROWS (batched decode): the multi-row kernel decodes each weight block
  once and uses it for all M rows while it is in L1.
- M >= BLAS_MIN_ROWS (prefill): decode a tile of output rows (about L2-sized) into a small
  float32 scratch and hand x @ tile^T to numpy's BLAS; only the tile is ever float.
F32 weights go straight to BLAS on the zero-copy float view.
"""
from __future__ import annotations

import numba
import numpy as np

from . import _decode as D
from ._kernels import KERNELS
from .quants import QuantMatrix

BLAS_MIN_ROWS = 16            # from benchmarks/kernels.py: below this the fused kernel wins
_TILE_BYTES = 1 << 20         # float scratch per tile, about half of one core's L2

__all__ = ["QuantMatrix", "matmul", "numba_threads", "BLAS_MIN_ROWS"]


def numba_threads() -> int:
    """Threads the kernels run on (NUMBA_NUM_THREADS, default: all cores)."""
    return numba.get_num_threads()


def _tile_rows(K: int) -> int:
    return max(16, (_TILE_BYTES // (4 * K)) // 16 * 16)


def matmul(x: np.ndarray, w: QuantMatrix, out: np.ndarray | None = None) -> np.ndarray:
    """float32[M, N] = x @ W^T for x float32[M, K] (a 1-D x gives a 1-D result)."""
    x = np.asarray(x)
    vec = x.ndim == 1
    x2 = np.ascontiguousarray(x.reshape(1, -1) if vec else x, dtype=np.float32)
    M, K = x2.shape
    if K != w.K:
        raise ValueError(f"matmul: x has {K} columns but the weight rows have {w.K}")
    if out is None:
        out = np.empty((M, w.N), np.float32)
    else:
        if out.dtype != np.float32 or out.size != M * w.N or not out.flags.c_contiguous:
            raise ValueError(f"matmul: out must be a C-contiguous float32 array of {M}x{w.N}")
    out2 = out.reshape(M, w.N)
    code = int(w.qtype)
    if code == D.F32:
        np.matmul(x2, w.data.view(np.float32).T, out=out2)
    elif M == 1:
        KERNELS[code][1](w.blocks, x2[0], out2[0])
    elif M < BLAS_MIN_ROWS:
        KERNELS[code][2](w.blocks, x2, out2)
    else:
        _tiled_blas(x2, w, out2)
    if vec and out.ndim == 2:
        return out.reshape(w.N)
    return out


def _tiled_blas(x: np.ndarray, w: QuantMatrix, out: np.ndarray) -> None:
    rows = KERNELS[int(w.qtype)][0]
    blocks = w.blocks
    T = min(_tile_rows(w.K), w.N)
    tile = np.empty((T, w.K), np.float32)
    ids = np.arange(w.N, dtype=np.int64)
    for n0 in range(0, w.N, T):
        n1 = min(w.N, n0 + T)
        t = tile[: n1 - n0]
        rows(blocks, ids[n0:n1], t)
        np.matmul(x, t.T, out=out[:, n0:n1])
