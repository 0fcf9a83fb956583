"""GGUF tensors -> dense torch tensors, dequantized once at load.

The ground truth for every quant type is `gguf.quants.dequantize`; we call it per tensor so
peak host memory is one tensor in float32, not the whole model.
"""
from __future__ import annotations

import numpy as np
import torch

from edgeinfer.formats.ggml_types import GGMLQuantizationType, dequantize

_DIRECT = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
}


def tensor_numpy(gf, name: str) -> np.ndarray:
    """The tensor as a float array in row-major order: ggml shape (ne0, ne1) -> (ne1, ne0)."""
    t = gf.tensors[name]
    raw = gf.raw(name)
    if t.ggml_type in _DIRECT:
        a = raw.view(_DIRECT[t.ggml_type])
    else:
        a = dequantize(raw, t.ggml_type)
    return a.reshape(tuple(reversed(t.shape)))


def load_tensor(gf, name: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    a = tensor_numpy(gf, name)
    if not a.flags.writeable:  # a view of the read-only memory map: torch wants its own copy
        a = a.copy()
    t = torch.from_numpy(a)
    return t.to(device=device, dtype=dtype).contiguous()


def dense_bytes(gf, dtype: torch.dtype) -> int:
    """Memory the whole model takes once dequantized to `dtype`."""
    size = torch.empty((), dtype=dtype).element_size()
    return sum(t.n_elements for t in gf.tensors.values()) * size
