"""MXFP4 weights (GGML type 39, gpt-oss's expert matrices) on the CPU, read in place.

A block of 32 values is 17 bytes: one e8m0 exponent byte e, then 16 bytes of e2m1 nibbles;
byte j holds value j in its low nibble and value j + 16 in its high one. A nibble indexes
KVALUES, the e2m1 values doubled so they are integers, and the block scale is half of
2^(e - 127) (ggml's GGML_E8M0_TO_FP32_HALF), so value = KVALUES[nibble] * E8M0_HALF[e].

The matmul does what ggml's CPU backend does for MXFP4 (vec_dot_type Q8_0): the activations
are quantized to Q8_0 blocks (int8 codes, an f16 scale d, as for any Q8_0 weight), products
of int8 codes x int8 KVALUES are summed exactly in int32 lanes, and the lanes are scaled by
d * E8M0_HALF[e] and added in float32 in the order of ggml's AVX2 ggml_vec_dot_mxfp4_q8_0
(_mxfp4dot.py), so a row gets llama.cpp's bits for the same activations. Every (row, output)
pair is computed that way whatever the batch, so a token's result does not depend on what
it is batched with. The weight bytes stay in the GGUF's memory map and are decoded in
registers.
"""
from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
from numba import njit, prange

from . import _stamp
from ._actquant import quantize_rows
from ._mxfp4dot import dsplat2, hsum_ggml, quad_sums2, quad_sums2_codes, store_codes2
from ._simd import itof, vfma, vzero

_DEPS = ("_mxfp4dot.py", "_simd.py")      # inlined here: see _stamp.py
_DEPS_HASH = "7c6140d195b50d21"
_CACHE = _stamp.current(_DEPS, _DEPS_HASH)

MXFP4 = 39
BLOCK = 32              # values per block
BLOCK_BYTES = 17        # 1 exponent byte + 16 bytes of nibbles
KVALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)


def _e8m0_half() -> np.ndarray:
    """float32[256]: 2^(e - 128) for every e8m0 byte, subnormal below e = 2 (ggml's bits)."""
    e = np.arange(256, dtype=np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)


E8M0_HALF = _e8m0_half()


def row_bytes(k: int) -> int:
    if k % BLOCK:
        raise ValueError(f"row length {k} is not a multiple of the MXFP4 block size {BLOCK}")
    return k // BLOCK * BLOCK_BYTES


def _freeze_data(w) -> None:
    """w.data read-only, as the map gives it: one compiled signature for every kernel."""
    if w.data.flags.writeable:
        d = w.data.view()
        d.flags.writeable = False
        object.__setattr__(w, "data", d)


@dataclass(frozen=True)
class Mxfp4Matrix:
    """A GGUF MXFP4 weight of ggml shape (K, N): N rows of K values as uint8[N, row_bytes],
    read-only, normally a view of the model's memory map."""
    data: np.ndarray
    K: int
    N: int

    def __post_init__(self):
        if self.data.dtype != np.uint8 or self.data.shape != (self.N, row_bytes(self.K)):
            raise ValueError(f"MXFP4 data of shape {self.data.shape} does not match "
                             f"K={self.K} N={self.N}")
        _freeze_data(self)

    @classmethod
    def from_gguf(cls, gguf_file, name: str) -> "Mxfp4Matrix":
        """The named 2-D MXFP4 tensor of a GGUF file (or an expert view of one), zero copy."""
        t = gguf_file.tensors[name]
        if len(t.shape) != 2 or int(t.ggml_type) != MXFP4:
            raise ValueError(f"tensor {name} is not a 2-D MXFP4 matrix")
        K, N = int(t.shape[0]), int(t.shape[1])
        raw = np.asarray(gguf_file.raw(name)).view(np.uint8).reshape(-1)
        if raw.size != N * row_bytes(K):
            raise ValueError(f"MXFP4 tensor {name} of {K}x{N} needs {N * row_bytes(K)} bytes, "
                             f"got {raw.size}")
        return cls(raw.reshape(N, row_bytes(K)), K, N)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def rows(self, ids) -> np.ndarray:
        """float32[len(ids), K]: the decoded rows (an MXFP4 embedding table); exact."""
        ids = np.asarray(ids, np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.N):
            raise IndexError(f"row id out of range [0, {self.N})")
        return dequantize(self.data[ids], self.K)


def dequantize(data: np.ndarray, k: int) -> np.ndarray:
    """float32[rows, k] of uint8[rows, row_bytes] MXFP4 rows (bit-exact with gguf.quants)."""
    blocks = np.asarray(data, np.uint8).reshape(-1, BLOCK_BYTES)
    scale = E8M0_HALF[blocks[:, 0]][:, None]
    qs = blocks[:, 1:]
    codes = np.concatenate([KVALUES[qs & 0x0F], KVALUES[qs >> 4]], axis=1)
    return (scale * codes.astype(np.float32)).reshape(-1, k)


@njit(inline="always", nogil=True)
def _decode_codes(w, n, codes):
    """Row n's nibbles -> int8 KVALUES codes in value order (codes[K])."""
    nb = w.shape[1] // 17
    for b in range(nb):
        o = b * 17 + 1
        c = b * 32
        for j in range(16):
            q = w[n, o + j]
            codes[c + j] = KVALUES[q & 0x0F]
            codes[c + j + 16] = KVALUES[q >> 4]


@njit(nogil=True, cache=_CACHE, parallel=True, fastmath=False)
def _matmul_q8(w, qa, da, e_half, out, par):
    """out[m, n] = the dot of weight row n with activation row m, as _mxfp4dot.py sums it.
    qa int8[M, K] / da float32[K/32, M]: the Q8_0 activation codes and scales
    (_actquant.quantize_rows)."""
    M, K = qa.shape
    N, rb = w.shape
    wf = w.reshape(-1)
    rows = np.arange(M)
    if par:
        for n in prange(N):
            _rows_q8(wf, n * rb, n, qa, da, e_half, out, rows, rows, 0, M)
    else:
        for n in range(N):
            _rows_q8(wf, n * rb, n, qa, da, e_half, out, rows, rows, 0, M)
    return out


@njit(nogil=True, cache=_CACHE, parallel=True, fastmath=False)
def _grouped_q8(w3, qa, da, e_half, out, src, order, starts, experts, par):
    """Experts' rows: out[r, n] = row n of expert experts[g] dotted with activation row
    src[r], for the output rows r = order[starts[g]:starts[g + 1]] of group g; each (group,
    weight row) item decodes the row once for its rows. w3 uint8[X, N, row_bytes]."""
    G = experts.shape[0]
    N, rb = w3.shape[1], w3.shape[2]
    wf = w3.reshape(-1)
    if par:
        for it in prange(G * N):
            g = it // N
            n = it % N
            _rows_q8(wf, (experts[g] * N + n) * rb, n, qa, da, e_half, out, order, src,
                     starts[g], starts[g + 1])
    else:
        for it in range(G * N):
            g = it // N
            n = it % N
            _rows_q8(wf, (experts[g] * N + n) * rb, n, qa, da, e_half, out, order, src,
                     starts[g], starts[g + 1])
    return out


@njit(inline="always", nogil=True)
def _rows_q8(w, r, n, qa, da, e_half, out, rows, src, lo, hi):
    """out[rows[i], n] for i in lo..hi-1: the weight row at flat byte offset r of w (1-D)
    dotted with activation row src[rows[i]]. The same operations for a row whatever the
    others (a weight row decoded once for several rows gives the same codes, so the same
    exact integer sums)."""
    K = qa.shape[1]
    nb = K // 32
    pairs = nb // 2 * 2
    many = hi - lo > 1
    codes = np.empty(K if many else 0, np.int8)
    if many:                        # several activation rows: decode the weight row once
        for b in range(0, pairs, 2):
            store_codes2(w, r + b * 17, codes, b * 32)
    for i in range(lo, hi):
        o = rows[i]
        m = src[o]
        acc = vzero()
        for b in range(0, pairs, 2):    # two blocks a step: accumulator lanes 0-7 and 8-15
            d0 = da[b, m] * e_half[w[r + b * 17]]
            d1 = da[b + 1, m] * e_half[w[r + b * 17 + 17]]
            if many:
                q = quad_sums2_codes(codes, b * 32, qa, m * K + b * 32)
            else:
                q = quad_sums2(w, r + b * 17, qa, m * K + b * 32)
            acc = vfma(dsplat2(d0, d1), itof(q), acc)
        b = pairs
        total = hsum_ggml(acc)
        if b < nb:                  # an odd last block: ggml's scalar tail
            s = np.int32(0)
            for j in range(16):
                q = w[r + b * 17 + 1 + j]
                s += np.int32(qa[m, b * 32 + j]) * np.int32(KVALUES[q & 0x0F])
                s += np.int32(qa[m, b * 32 + j + 16]) * np.int32(KVALUES[q >> 4])
            total += (da[b, m] * e_half[w[r + b * 17]]) * np.float32(s)
        out[o, n] = total


@njit(nogil=True, cache=_CACHE, parallel=True, fastmath=False)
def _matmul_f32(w, x, e_half, out, par):
    """out[m, n] with float32 activations (numerics="f32"): per block, the float sum of
    x * code, times the block scale, added in block order."""
    M, K = x.shape
    N = w.shape[0]
    nb = K // 32
    if par:
        for n in prange(N):
            _row_f32(w, n, x, e_half, out, M, nb)
    else:
        for n in range(N):
            _row_f32(w, n, x, e_half, out, M, nb)
    return out


@njit(inline="always", nogil=True)
def _row_f32(w, n, x, e_half, out, M, nb):
    codes = np.empty(nb * 32, np.int8)
    _decode_codes(w, n, codes)
    for m in range(M):
        acc = np.float32(0.0)
        for b in range(nb):
            s = np.float32(0.0)
            for j in range(32):
                s += x[m, b * 32 + j] * np.float32(codes[b * 32 + j])
            acc += e_half[w[n, b * 17]] * s
        out[m, n] = acc


def _quantize(x2: np.ndarray):
    """Q8_0 codes int8[M, K] and scales float32[K/32, M] of activation rows x2 float32[M, K]."""
    M, K = x2.shape
    nb = K // BLOCK
    qa = np.empty((M, K), np.int8)
    da = np.empty((nb, M), np.float32)
    if not x2.flags.writeable:
        x2 = x2.copy()
    quantize_rows(x2, BLOCK, BLOCK, 0, qa, da, np.empty((nb, M), np.float32),
                  np.empty((nb, M), np.int32), M * K >= (1 << 15))
    return qa, da


@dataclass(frozen=True)
class Mxfp4Experts:
    """A 3-D MXFP4 expert tensor of ggml shape (K, N, X) as one read-only uint8[X, N,
    row_bytes] view of the file: expert e's matrix is data[e]."""
    data: np.ndarray
    K: int
    N: int
    X: int

    def __post_init__(self):
        if self.data.dtype != np.uint8 or self.data.shape != (self.X, self.N, row_bytes(self.K)):
            raise ValueError(f"MXFP4 expert data of shape {self.data.shape} does not match "
                             f"K={self.K} N={self.N} X={self.X}")
        _freeze_data(self)

    @classmethod
    def from_gguf(cls, gguf_file, name: str) -> "Mxfp4Experts":
        t = gguf_file.tensors[name]
        if len(t.shape) != 3 or int(t.ggml_type) != MXFP4:
            raise ValueError(f"tensor {name} is not a 3-D MXFP4 expert tensor")
        K, N, X = (int(d) for d in t.shape)
        raw = np.asarray(gguf_file.raw(name)).view(np.uint8).reshape(-1)
        if raw.size != X * N * row_bytes(K):
            raise ValueError(f"MXFP4 tensor {name} of {K}x{N}x{X} needs "
                             f"{X * N * row_bytes(K)} bytes, got {raw.size}")
        return cls(raw.reshape(X, N, row_bytes(K)), K, N, X)


def grouped_matmuls(x: np.ndarray, banks, starts: np.ndarray, experts: np.ndarray) -> list:
    """For each bank: float32[R, N] whose rows starts[g]..starts[g + 1]-1 are those rows of x
    times expert experts[g]'s matrix (x's rows already grouped by expert, as a per-expert
    matmul has them: each chosen expert row is decoded once for its group, an expert no row
    chose is never read). The activations are quantized once for all banks; every row gets
    the bits a matmul of its own gives."""
    x2 = np.ascontiguousarray(x.reshape(-1, x.shape[-1]), dtype=np.float32)
    qa, da = _quantize(x2)
    ident = np.arange(len(x2), dtype=np.int64)
    starts = np.ascontiguousarray(starts, dtype=np.int64)
    experts = np.ascontiguousarray(experts, dtype=np.int64)
    if starts[-1] != len(x2) or len(starts) != len(experts) + 1:
        raise ValueError("grouped matmul: the groups do not cover the rows")
    outs = []
    for bank in banks:
        if bank.K != x2.shape[1]:
            raise ValueError(f"grouped matmul: x has {x2.shape[1]} columns, the experts {bank.K}")
        if len(experts) and (experts.min() < 0 or experts.max() >= bank.X):
            raise IndexError(f"expert id out of range [0, {bank.X})")
        out = np.empty((len(x2), bank.N), np.float32)
        par = len(x2) * bank.N * bank.K >= (1 << 16) and numba.get_num_threads() > 1
        _grouped_q8(bank.data, qa, da, E8M0_HALF, out, ident, ident, starts, experts, par)
        outs.append(out)
    return outs


def matmul(x: np.ndarray, w: Mxfp4Matrix, q8: bool = True) -> np.ndarray:
    """float32[M, N] = x @ W^T for x float32[M, K] (a 1-D x gives a 1-D result); q8: the
    activations in Q8_0 blocks as ggml's CPU backend multiplies them (else float32)."""
    vec = x.ndim == 1
    x2 = np.ascontiguousarray(x.reshape(1, -1) if vec else x, dtype=np.float32)
    M, K = x2.shape
    if K != w.K:
        raise ValueError(f"matmul: x has {K} columns but the MXFP4 rows have {w.K}")
    out = np.empty((M, w.N), np.float32)
    par = M * w.N * K >= (1 << 16) and numba.get_num_threads() > 1
    if q8:
        qa, da = _quantize(x2)
        _matmul_q8(w.data, qa, da, E8M0_HALF, out, par)
    else:
        _matmul_f32(w.data, x2, E8M0_HALF, out, par)
    return out.reshape(w.N) if vec else out
