"""The integer-dot matmul on a repacked weight: quantize the activations, run the tile kernel."""
from __future__ import annotations

import numba
import numpy as np

from . import _actquant, _int8
from .repack import PackedMatrix

# Below this many multiply-adds a product runs on the calling thread: waking the other
# threads costs more than it saves (and far more when other programs hold the cores).
SERIAL_MACS = 1 << 18


def packed_matmul(x: np.ndarray, w: PackedMatrix, out: np.ndarray | None = None,
                  use_vnni: bool | None = None) -> np.ndarray:
    """float32[M, N] = x @ W^T with x rounded to ggml's 8-bit activation format for W's type."""
    x2 = np.ascontiguousarray(x.reshape(-1, x.shape[-1]), dtype=np.float32)
    M, K = x2.shape
    if K != w.K:
        raise ValueError(f"matmul: x has {K} columns but the weight rows have {w.K}")
    nb = K // w.B
    qa = np.empty((M, K), np.int8)
    da = np.empty((nb, M), np.float32)
    bsf = np.empty((nb, M), np.float32)
    zb = np.empty((nb, M), np.int32)
    if out is None:
        out = np.empty((M, w.N), np.float32)
    vnni = _int8.HAVE_VNNI if use_vnni is None else use_vnni
    nw = numba.get_num_threads()
    if M * K * w.N < SERIAL_MACS:
        nw = 1
    _actquant.quantize_rows(x2, w.A, w.B, w.zero_point, qa, da, bsf, zb, nw > 1 and M * K >= 1 << 16)
    _int8.int8_matmul(w.q, w.s, w.o, w.has_o, qa, da, bsf, zb, out, vnni, nw,
                      np.zeros(1, np.int64))
    return out
