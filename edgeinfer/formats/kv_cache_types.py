"""The KV cache's element types a user may choose (--kv-cache-type, EDGEINFER_KV_CACHE_TYPE,
the APIs' kv_cache_type load option), as llama.cpp names them, and their bytes per value:
f16 halves, q8_0 ggml's block of 32 int8 codes and one f16 scale (34 bytes); f32 is only
the pool of the CPU backend's f32 numerics."""
from __future__ import annotations

KV_CACHE_TYPES = ("f16", "q8_0")
KV_BYTES_PER_VALUE = {"f32": 4, "f16": 2, "q8_0": 34 / 32}


def check_kv_cache_type(value, name: str = "kv_cache_type") -> str:
    """The KV cache type, or ValueError naming `name` and the allowed values."""
    if value not in KV_CACHE_TYPES:
        raise ValueError(f"{name} {value!r} is not a KV cache type: use "
                         + " or ".join(KV_CACHE_TYPES))
    return value
