"""Activation quantization for the integer-dot matmul (_int8.py).

The activation codes ggml's CPU backend feeds each weight type's dot product: Q8_0 blocks of
32 for the legacy quants, Q8_K blocks of 256 for the k-quants (kernels.quantize_act_block,
which the float path's act_round_q8_0/_k use too). The same pass writes, per weight block of
B columns, what the tile loop needs: da (the activation scale), bsf (sum of the codes) and zb
(zero_point * that sum), as [nb, M].
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from . import _stamp
from .kernels import quantize_act_block

_DEPS = ("kernels.py", "_simd.py")     # inlined here (quantize_act_block and its deps)
_DEPS_HASH = "dcf4aec5825284f4"

_CACHE = _stamp.current(_DEPS, _DEPS_HASH)
_PJIT = dict(nogil=True, cache=_CACHE, parallel=True, fastmath=False)


@njit(inline="always", nogil=True)
def _quantize_block(x, r, ab, A, B, zp, qa, da, bsf, zb):
    b0 = ab * A
    d = quantize_act_block(x, r, b0, A, qa)
    for wb in range(b0 // B, (b0 + A) // B):
        sm = np.int32(0)
        for j in range(B):
            sm += np.int32(qa[r, wb * B + j])
        da[wb, r] = d
        bsf[wb, r] = np.float32(sm)
        zb[wb, r] = np.int32(zp) * sm


@njit(**_PJIT)
def quantize_rows(x, A, B, zp, qa, da, bsf, zb, par):
    """x float32[M, K] -> int8 codes qa[M, K] and the per-weight-block da, bsf, zb [K/B, M];
    par=False: on the calling thread (small inputs: no parallel region to wake)."""
    M, K = x.shape
    na = K // A
    if par:
        for i in prange(M * na):
            _quantize_block(x, i // na, i % na, A, B, zp, qa, da, bsf, zb)
    else:
        for i in range(M * na):
            _quantize_block(x, i // na, i % na, A, B, zp, qa, da, bsf, zb)
