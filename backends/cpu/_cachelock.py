"""An inter-process lock for compiling kernels that share one numba cache index file.

numba's disk cache keeps every compiled specialization of a function in one index file and
numbers its data files 1, 2, ... in the order they were saved. Two processes that compile
different specializations of one function at once (the daemon loading a model, `edgeinfer
pull` or install warming another format) can both pick data file 1: one overwrites the
other's machine code and the index then maps a signature to the wrong kernel. Holding this
lock around the compile-or-load of such a function makes those saves one at a time. A lock
file per name under NUMBA_CACHE_DIR; a no-op where there is no fcntl (Windows) or no cache.
"""
from __future__ import annotations

import contextlib
import os

try:
    import fcntl
except ImportError:          # pragma: no cover (Windows)
    fcntl = None


@contextlib.contextmanager
def cache_lock(name: str):
    from numba.core.config import CACHE_DIR
    if fcntl is None or not CACHE_DIR:
        yield
        return
    try:
        os.makedirs(CACHE_DIR, exist_ok=True)
        fd = os.open(os.path.join(CACHE_DIR, f".{name}.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:          # a read-only cache: numba will not save there either
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)         # closing releases the lock
