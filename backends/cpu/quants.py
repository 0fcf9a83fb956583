"""Quantized weights on the CPU: the `QuantMatrix` view, exact dequantization, embedding rows.

Weights stay in their GGUF bytes (a zero-copy view of the memory map); kernels decode blocks
on the fly. Every decoder is bit-exact against `gguf.quants.dequantize`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgeinfer.formats.ggml_types import GGMLQuantizationType

from . import _decode as D
from . import _kernels as _k

SUPPORTED_TYPES: tuple[GGMLQuantizationType, ...] = tuple(GGMLQuantizationType(c) for c in D.BLOCK)

# byte offsets of the f16 scale fields inside one block (where random test data must be sane)
_F16_FIELDS = {
    D.Q4_0: (0,), D.Q4_1: (0, 2), D.Q5_0: (0,), D.Q5_1: (0, 2), D.Q8_0: (0,),
    D.Q2_K: (80, 82), D.Q3_K: (108,), D.Q4_K: (0, 2), D.Q5_K: (0, 2), D.Q6_K: (208,),
}


def _code(qtype) -> int:
    code = int(qtype)
    if code not in D.BLOCK:
        raise ValueError(f"tensor type {GGMLQuantizationType(code).name} is not supported by the CPU kernels")
    return code


def block_size(qtype) -> int:
    """Elements per quantization block (32 for float types, as the kernels see them)."""
    return D.BLOCK[_code(qtype)][0]


def row_bytes(qtype, k: int) -> int:
    """Bytes of one row of k elements."""
    bs, ts = D.BLOCK[_code(qtype)]
    if k % bs:
        raise ValueError(f"row length {k} is not a multiple of the {GGMLQuantizationType(int(qtype)).name} block size {bs}")
    return k // bs * ts


def _readonly(a: np.ndarray) -> np.ndarray:
    # All kernels are compiled for read-only weight arrays (the mmap case), so writable test
    # arrays get a read-only view instead of a second specialization.
    if a.flags.writeable:
        a = a.view()
        a.flags.writeable = False
    return a


@dataclass(frozen=True)
class QuantMatrix:
    """A GGUF weight of ggml shape (K, N): N output rows of K values, still quantized.

    `data` is uint8[N, row_bytes], read-only, normally a view of the model's memory map.
    """
    data: np.ndarray
    qtype: GGMLQuantizationType
    K: int
    N: int

    def __post_init__(self):
        if self.data.dtype != np.uint8 or self.data.ndim != 2 or not self.data.flags.c_contiguous:
            raise ValueError("QuantMatrix data must be a C-contiguous uint8[N, row_bytes] array")
        if self.data.shape != (self.N, row_bytes(self.qtype, self.K)):
            raise ValueError(f"QuantMatrix data shape {self.data.shape} does not match "
                             f"{self.qtype.name} K={self.K} N={self.N}")
        object.__setattr__(self, "qtype", GGMLQuantizationType(int(self.qtype)))
        object.__setattr__(self, "data", _readonly(self.data))

    @classmethod
    def from_bytes(cls, raw: np.ndarray, qtype, K: int, N: int) -> "QuantMatrix":
        """Wrap flat tensor bytes (ggml shape (K, N)) without copying."""
        qtype = GGMLQuantizationType(int(qtype))
        rb = row_bytes(qtype, K)
        raw = np.asarray(raw)
        if raw.dtype != np.uint8:
            raw = raw.view(np.uint8)
        if raw.size != rb * N:
            raise ValueError(f"{qtype.name} tensor of {K}x{N} needs {rb * N} bytes, got {raw.size}")
        return cls(_readonly(raw.reshape(N, rb)), qtype, K, N)

    @classmethod
    def from_gguf(cls, gguf_file, name: str) -> "QuantMatrix":
        """The named 2-D tensor of an open `edgeinfer.formats.gguf_file.GGUFFile`, zero copy."""
        t = gguf_file.tensors[name]
        if len(t.shape) != 2:
            raise ValueError(f"tensor {name} has shape {t.shape}; a matrix needs two dimensions")
        return cls.from_bytes(gguf_file.raw(name), t.ggml_type, int(t.shape[0]), int(t.shape[1]))

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    @property
    def blocks(self) -> np.ndarray:
        """The same bytes as uint8[N, n_blocks, block_bytes], the layout the kernels take."""
        bs, ts = D.BLOCK[int(self.qtype)]
        return self.data.reshape(self.N, self.K // bs, ts)


def dequantize(raw: np.ndarray, qtype, n_elements: int) -> np.ndarray:
    """float32[n_elements] of a quantized buffer; bit-exact with `gguf.quants.dequantize`."""
    code = _code(qtype)
    raw = np.asarray(raw)
    if raw.dtype != np.uint8:
        raw = raw.view(np.uint8)
    raw = raw.reshape(-1)
    bs, ts = D.BLOCK[code]
    if code == D.F32:
        return raw[: 4 * n_elements].view(np.float32).copy()
    if code in (D.F16, D.BF16) and n_elements % bs:
        # float tensors of odd length (norm weights): numpy's conversion is exact too
        h = raw[: 2 * n_elements].view(np.uint16)
        if code == D.F16:
            return h.view(np.float16).astype(np.float32)
        return (h.astype(np.uint32) << 16).view(np.float32)
    if n_elements % bs:
        raise ValueError(f"{n_elements} elements is not a multiple of the block size {bs}")
    nb = n_elements // bs
    if raw.size < nb * ts:
        raise ValueError(f"buffer of {raw.size} bytes is too small for {n_elements} elements")
    blocks = _readonly(raw[: nb * ts].reshape(nb, 1, ts))
    out = np.empty((nb, bs), np.float32)
    _k.rows(code, blocks, np.arange(nb, dtype=np.int64), out)
    return out.reshape(-1)


def get_rows(w: QuantMatrix, ids) -> np.ndarray:
    """float32[len(ids), K]: the decoded rows `ids` of w (embedding lookup); exact."""
    ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
    if not ids.flags.writeable:         # one compiled signature: ids is always writable
        ids = ids.copy()
    if ids.size and (ids.min() < 0 or ids.max() >= w.N):
        raise IndexError(f"row id out of range [0, {w.N})")
    out = np.empty((ids.size, w.K), np.float32)
    _k.rows(int(w.qtype), w.blocks, ids, out)
    return out


def random_quant_rows(qtype, N: int, K: int, rng: np.random.Generator) -> np.ndarray:
    """uint8[N, row_bytes] of random valid blocks (for tests and benchmarks).

    All bytes are random except the f16 scale fields, which get finite values of a sane size
    so that decoded values stay finite.
    """
    code = _code(qtype)
    rb = row_bytes(qtype, K)
    if code == D.F32:
        return rng.standard_normal((N, K), dtype=np.float32).view(np.uint8).reshape(N, rb)
    if code == D.F16:
        return rng.standard_normal((N, K)).astype(np.float16).view(np.uint8).reshape(N, rb)
    if code == D.BF16:
        f = rng.standard_normal((N, K), dtype=np.float32)
        return (f.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(N, rb)
    bs, ts = D.BLOCK[code]
    data = rng.integers(0, 256, (N * (K // bs), ts), dtype=np.uint8)
    for off in _F16_FIELDS[code]:
        scale = (rng.random(data.shape[0]) * 0.02 + 1e-4).astype(np.float16)
        data[:, off:off + 2] = scale.view(np.uint8).reshape(-1, 2)
    return data.reshape(N, rb)
