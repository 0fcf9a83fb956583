"""Tiny synthetic GGUF models (random weights) for llama, qwen2, qwen3 and gemma3.

Written in F32 with `gguf.GGUFWriter`, then quantized with llama.cpp's own quantizer, so each
architecture and quant type is covered in seconds and llama.cpp can run the very same file.
Dimensions are multiples of 256 so k-quants apply to every matrix.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from build_once import build_once
from edgeinfer.formats.synthetic import TinyShape, random_f32_tensors, write_tiny_gguf

# MXFP4_MOE (llama.cpp's LLAMA_FTYPE_MOSTLY_MXFP4_MOE): expert tensors MXFP4, the rest Q8_0;
# IQ4_NL: a type the native kernels lack (tests of the fallback)
FTYPES = {"F32": 0, "Q8_0": 7, "Q5_0": 8, "Q4_K_M": 15, "Q6_K": 18, "IQ4_NL": 25,
          "MXFP4_MOE": 38}

N_EMBD, N_FF, N_HEAD, N_KV, HEAD_DIM, N_LAYERS = 256, 512, 4, 2, 64, 7
SLIDING_WINDOW = 32


def write_model(path: Path, arch: str, seed: int = 0, chat_template: str | None = None) -> Path:
    """A random-weight F32 model of the given architecture (with `chat_template` in its
    metadata when given)."""
    tensor = random_f32_tensors(np.random.default_rng(seed))   # well conditioned: see there

    shape = TinyShape(N_EMBD, N_FF, N_HEAD, N_KV, HEAD_DIM, N_LAYERS, 2048, SLIDING_WINDOW)
    return write_tiny_gguf(path, arch, shape, tensor, file_type=0,
                           rope_base=10000.0 if arch != "qwen2" else 1000000.0,
                           name=f"synthetic-{arch}", space_prefix=arch == "llama",
                           chat_template=chat_template)


def quantize(src: Path, dst: Path, ftype: str) -> Path:
    """Quantize with llama.cpp's own quantizer (llama_model_quantize)."""
    import llama_cpp
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[ftype]
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({ftype}) failed with {rc}")
    return dst


def synthetic_model(cache: Path, arch: str, ftype: str) -> Path:
    """Build (once per cache dir) a synthetic model of arch quantized to ftype."""
    cache.mkdir(parents=True, exist_ok=True)
    f32 = build_once(cache / f"synth-{arch}-F32.gguf", lambda tmp: write_model(tmp, arch))
    if ftype == "F32":
        return f32
    return build_once(cache / f"synth-{arch}-{ftype}.gguf",
                      lambda tmp: quantize(f32, tmp, ftype))
