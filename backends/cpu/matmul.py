"""Quantized matmul on the CPU: y = x @ W^T with W kept quantized.

Two numba paths, chosen by the number of activation rows M (see benchmarks/kernels.py):
- M == 1 (decode): a fused dequantize-and-dot matvec, parallel over output rows; memory-bound.
- M > 1 (batched decode, prefill): each work item decodes 16 weight rows into an L2-sized
  float32 buffer and runs a 4x4 register-blocked micro-kernel over all rows of x, so every
  weight block is decoded once per call and only that small buffer is ever float. Measured
  (one core, CPU time) at 110-170 GFLOP/s for M=512, on par with OpenBLAS sgemm, without
  handing work to a second thread pool (numba's OpenMP threads and OpenBLAS's threads spin
  against each other when alternated on a 2-core machine: measured 10x slower).
F32 weights take the same paths (their "decode" is a copy), to stay on one thread pool.
"""
from __future__ import annotations

import numba
import numpy as np

from . import _kernels as _k
from ._kernels import X_LAYOUT
from .quants import QuantMatrix

__all__ = ["QuantMatrix", "matmul", "numba_threads", "warm_kernels"]


# Up to this many rows (batched decode of a few streams) each row is a matvec of its own,
# reading every weight row from memory once for all of them; beyond it the register-blocked
# kernel's reuse wins (benchmarks/kernels.py, benchmarks/serving.py).
FEW_ROWS = 4


def numba_threads() -> int:
    """Threads the kernels run on (NUMBA_NUM_THREADS, default: all cores)."""
    return numba.get_num_threads()


def matmul(x: np.ndarray, w: QuantMatrix, out: np.ndarray | None = None,
           batch_invariant: bool = False, per_row: bool = False) -> np.ndarray:
    """float32[M, N] = x @ W^T for x float32[M, K] (a 1-D x gives a 1-D result).

    Paths: M == 1 the fused matvec; M <= FEW_ROWS the same dot per row (bit-identical to
    M == 1); larger M the register-blocked multi-row kernel, which rounds differently.
    batch_invariant: every M, M == 1 included, through the multi-row kernel, whose per-row
    result is bit-identical for any M (slower for small M).
    per_row: every M through the per-row dot, so each row is the M == 1 matvec's bits (a
    speculative verify's few rows: each weight row is still read once for all of them).
    """
    x = np.asarray(x)
    vec = x.ndim == 1
    x2 = np.ascontiguousarray(x.reshape(1, -1) if vec else x, dtype=np.float32)
    if not x2.flags.writeable:          # one compiled signature: x is always a writable array
        x2 = x2.copy()
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
    if M == 0:
        pass
    elif M == 1 and not batch_invariant:
        xv = x2[0]
        if code in X_LAYOUT:
            xv = X_LAYOUT[code][1](xv, _x_index(code, K))
        _k.matvec(code, w.blocks, xv.reshape(1, -1), out2[:1])
    elif (M <= FEW_ROWS or per_row) and not batch_invariant:
        if code in X_LAYOUT:
            idx = _x_index(code, K)
            x2 = np.stack([X_LAYOUT[code][1](x2[m], idx) for m in range(M)])
        _k.matvec(code, w.blocks, x2, out2)
    else:
        _k.matmul_rows(code, w.blocks, x2, out2)
    if vec and out.ndim == 2:
        return out.reshape(w.N)
    return out


def warm_kernels(qtypes=None) -> None:
    """Compile (or load from numba's disk cache) every kernel for these types, on tiny inputs
    of exactly the array types real calls use, so the first real call does not JIT."""
    from .quants import SUPPORTED_TYPES, get_rows, random_quant_rows

    rng = np.random.default_rng(0)
    for qt in (SUPPORTED_TYPES if qtypes is None else qtypes):
        K = 256
        w = QuantMatrix.from_bytes(random_quant_rows(qt, 4, K, rng), qt, K, 4)
        x = np.zeros((FEW_ROWS + 1, K), np.float32)
        matmul(x[0], w)                 # matvec
        matmul(x[:2], w)                # few-row matvec
        matmul(x, w)                    # register-blocked multi-row
        get_rows(w, [0])
    from .packed import packed_matmul
    from .repack import REPACKABLE, PackedMatrix
    for qt in (SUPPORTED_TYPES if qtypes is None else qtypes):
        if int(qt) in REPACKABLE:       # one specialization serves every type; run each path
            w = QuantMatrix.from_bytes(random_quant_rows(qt, 40, 256, rng), qt, 256, 40)
            p = PackedMatrix.from_quant(w)
            packed_matmul(np.zeros((1, 256), np.float32), p)       # serial quantize + matmul
            packed_matmul(np.zeros((260, 256), np.float32), p)     # parallel quantize + matmul


_X_INDEX: dict[tuple[int, int], np.ndarray] = {}


def _x_index(code: int, K: int) -> np.ndarray:
    """Gather index putting x in the order the type's matvec reads it (see X_LAYOUT)."""
    idx = _X_INDEX.get((code, K))
    if idx is None:
        order = X_LAYOUT[code][0]
        idx = (np.arange(K // order.size)[:, None] * order.size + order).reshape(-1)
        _X_INDEX[(code, K)] = idx
    return idx
