"""Cache stamps for numba kernels that inline code from other modules.

numba keys its disk cache on the content of the file that defines a jitted function only, but
inlined functions (and intrinsics) from other modules are compiled into it. A kernel module
therefore carries `_DEPS_HASH`, the hash of the sources it inlines: editing one of them means
editing that constant too, which changes the module and so invalidates its cache. If the
constant is stale, the module compiles without the disk cache rather than load stale machine
code, and tests/test_matmul.py fails with the value to paste.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

_HERE = Path(__file__).parent


def deps_hash(names: tuple[str, ...]) -> str:
    """sha256 prefix of these sources (files next to this one)."""
    h = hashlib.sha256()
    try:
        for name in names:
            h.update((_HERE / name).read_bytes())
    except OSError:
        return "unavailable"
    return h.hexdigest()[:16]


def current(names: tuple[str, ...], expected: str) -> bool:
    """Whether `expected` (a module's _DEPS_HASH) matches its deps: then it may use the cache."""
    return deps_hash(names) == expected
