"""The integer-dot matmul on a repacked weight: quantize the activations, run the tile kernel.

`packed_matmuls` multiplies one input by several matrices (q/k/v, gate/up) and quantizes the
input once per activation format (block size A, weight block B) instead of once per matrix:
the codes, scales and code sums depend only on (A, B); a matrix with another zero point only
needs its own zb = zero_point * sum. The matrices then run in one parallel region
(_int8.int8_matmul_many), each on the same codes and with the same per-tile arithmetic as it
would alone, so every result is the same bits as packed_matmul's.
"""
from __future__ import annotations

from typing import Sequence

import numba
import numpy as np

from . import _actquant, _int8
from .repack import PackedMatrix

# Below this many multiply-adds a product runs on the calling thread: waking the other
# threads costs more than it saves (and far more when other programs hold the cores).
SERIAL_MACS = 1 << 18
# Below this many activation values the quantization runs on the calling thread.
SERIAL_QUANT = 1 << 16


class ActCodes:
    """One input's activation codes for weights of block sizes (A, B): qa int8[M, K], da and
    bsf float32[K/B, S], and zb int32[K/B, S] per zero point (made on first use), with
    S = _actquant.entry_stride(M) >= M: row m's entries are in column m."""
    __slots__ = ("qa", "da", "bsf", "zb")

    def __init__(self, x2: np.ndarray, A: int, B: int, zp: int, par: bool,
                 up: np.ndarray | None = None):
        """The codes of x2, or with `up` of swiglu(x2, up) (the same bits, without the float
        input in between: _actquant.quantize_swiglu_rows)."""
        M, K = x2.shape
        nb = K // B
        S = _actquant.entry_stride(M)
        self.qa = np.empty((M, K), np.int8)
        self.da = np.empty((nb, S), np.float32)
        self.bsf = np.empty((nb, S), np.float32)
        zb = np.empty((nb, S), np.int32)
        if up is None:
            _actquant.quantize_rows(x2, A, B, zp, self.qa, self.da, self.bsf, zb, par)
        else:
            _actquant.quantize_swiglu_rows(x2, up, A, B, zp, self.qa, self.da, self.bsf, zb, par)
        self.zb = {zp: zb}

    def zb_for(self, zp: int) -> np.ndarray:
        zb = self.zb.get(zp)
        if zb is None:          # bsf holds the exact integer sums (|sum| <= 127 * 32);
            # _actquant.block_zb's rule: zp * sum, or the sum itself where zp = 0. Only the
            # first M columns: the padding past them is not written (entry_stride)
            M = self.qa.shape[0]
            zb = self.zb[zp] = np.empty(self.bsf.shape, np.int32)
            np.multiply(self.bsf[:, :M], zp or 1, out=zb[:, :M], casting="unsafe")
        return zb

    def arrays(self, zp: int) -> tuple:
        """(qa, da, bsf, zb) for weights of zero point zp: the tile kernels' activations."""
        return self.qa, self.da, self.bsf, self.zb_for(zp)


def _as_rows(x: np.ndarray) -> np.ndarray:
    if x.ndim == 2 and x.dtype == np.float32 and x.flags.c_contiguous:
        return x
    return np.ascontiguousarray(x.reshape(-1, x.shape[-1]), dtype=np.float32)


def _threads(M: int, K: int, N: int, threads: int) -> int:
    """Threads for an [M, K] x [K, N] product (numba.get_num_threads() costs a microsecond or
    two per call: callers ask once)."""
    return 1 if M * K * N < SERIAL_MACS else threads


def _run(codes: ActCodes, w: PackedMatrix, out: np.ndarray | None, vnni, nw: int):
    M = codes.qa.shape[0]
    if out is None:
        out = np.empty((M, w.N), np.float32)
    elif out.dtype != np.float32 or out.shape != (M, w.N) or not out.flags.c_contiguous:
        raise ValueError(f"matmul: out must be a C-contiguous float32 array of {M}x{w.N}")
    _run_jobs([(w.fmt, w.W, *codes.arrays(w.zero_point), out)], _isa(vnni), nw)
    return out


def _run_jobs(jobs: list, isa: int, nw: int) -> None:
    """_int8.run_matmuls on one to three jobs of one input (same M and K). No row chunks:
    the tile loop keeps a group of rows in L1 across a chunk of tiles (_int8._make_tiles),
    and splitting the rows only re-read the weights (a Qwen2.5 1.5B prefill step, 512
    rows: 1 MB chunks of codes 0.91x the speed of one pass)."""
    _int8.run_matmuls(jobs, isa, nw, np.zeros(1, np.int64))


def _isa(vnni) -> int:
    return _int8.BEST_ISA if vnni is True else _int8.isa_of(vnni)


def packed_matmul(x: np.ndarray, w: PackedMatrix, out: np.ndarray | None = None,
                  use_vnni: bool | None = None) -> np.ndarray:
    """float32[M, N] = x @ W^T with x rounded to ggml's 8-bit activation format for W's type."""
    x2 = _as_rows(x)
    M, K = x2.shape
    if K != w.K:
        raise ValueError(f"matmul: x has {K} columns but the weight rows have {w.K}")
    vnni = _int8.HAVE_SIMD if use_vnni is None else use_vnni
    nw = _threads(M, K, w.N, numba.get_num_threads())
    codes = ActCodes(x2, w.A, w.B, w.zero_point, nw > 1 and M * K >= SERIAL_QUANT)
    return _run(codes, w, out, vnni, nw)


def packed_swiglu_matmul(gate: np.ndarray, up: np.ndarray, w: PackedMatrix,
                         use_vnni: bool | None = None) -> np.ndarray:
    """packed_matmul(swiglu(gate, up), w), the same bits: the activation codes come straight
    from gate and up, a few rows at a time, so the float32 SwiGLU output (a 512-token
    prefill of a 1.5B model: 18 MB a layer) is never written to memory and read back."""
    g, u = _as_rows(gate), _as_rows(up)
    M, K = g.shape
    if u.shape != g.shape:
        raise ValueError(f"swiglu: gate {g.shape} and up {u.shape} differ")
    if K != w.K:
        raise ValueError(f"matmul: x has {K} columns but the weight rows have {w.K}")
    vnni = _int8.HAVE_SIMD if use_vnni is None else use_vnni
    nw = _threads(M, K, w.N, numba.get_num_threads())
    codes = ActCodes(g, w.A, w.B, w.zero_point, nw > 1 and M * K >= SERIAL_QUANT, up=u)
    return _run(codes, w, None, vnni, nw)


def packed_matmuls(x: np.ndarray, ws: Sequence[PackedMatrix],
                   use_vnni: bool | None = None) -> list[np.ndarray]:
    """[x @ W^T for W in ws], x quantized once per activation format among ws."""
    x2 = _as_rows(x)
    M, K = x2.shape
    for w in ws:
        if K != w.K:
            raise ValueError(f"matmul: x has {K} columns but the weight rows have {w.K}")
    vnni = _int8.HAVE_SIMD if use_vnni is None else use_vnni
    # one parallel region for up to three matrices (int8_matmul_many): one wake-up of the
    # threads, and matrices too small to be worth a region alone (k, v at decode) share it
    nw = _threads(M, K, sum(w.N for w in ws), numba.get_num_threads())
    par_quant = nw > 1 and M * K >= SERIAL_QUANT
    formats: dict[tuple[int, int], ActCodes] = {}
    jobs = []
    for w in ws:
        codes = formats.get((w.A, w.B))
        if codes is None:
            codes = formats[(w.A, w.B)] = ActCodes(x2, w.A, w.B, w.zero_point, par_quant)
        jobs.append((w.fmt, w.W, *codes.arrays(w.zero_point), np.empty((M, w.N), np.float32)))
    isa = _isa(vnni)
    for i in range(0, len(jobs), 3):
        _run_jobs(jobs[i:i + 3], isa, nw)
    return [j[-1] for j in jobs]
