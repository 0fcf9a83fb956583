"""Inter-process locks around numba's disk cache. `guard_numba_cache` is applied by
edgeinfer/numba_hooks.py as soon as numba's caching module loads, in every process, before
its first compile or cache load; `cache_lock` is taken by the kernels that need it.

numba's disk cache keeps every compiled specialization of a function in one index file and
numbers its data files 1, 2, ... in the order they were saved. Two processes that compile
different specializations of one function at once (the daemon loading a model, `edgeinfer
pull` or install warming another format) can both pick data file 1: one overwrites the
other's machine code and the index then maps a signature to the wrong kernel.
`guard_numba_cache()` closes that hole for every cached function: numba's save (read the
index, add the entry, write the index, then the data file) runs under an exclusive lock on
the cache directory and its load (index, then data) under a shared one, so a save never
interleaves with another save, and a load never reads an index entry before its data file
is written (after a source edit the data file of that number can be the old code's).

`cache_lock(name)` is held around the compile-or-load of one kernel (name it by the kernel,
not by the function it specializes): a second process that wants the same kernel waits
and then loads it rather than compiling it again, while other kernels compile and load
beside it. A lock file per name under NUMBA_CACHE_DIR; a no-op where there is no fcntl
(Windows) or no cache.
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


@contextlib.contextmanager
def _dir_lock(directory: str, exclusive: bool):
    try:
        fd = os.open(os.path.join(directory, ".edgeinfer-cache.lock"), os.O_RDWR | os.O_CREAT,
                     0o644)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


def guard_numba_cache(caching) -> None:
    """Put the saves and loads of numba.core.caching's index under the directory lock (see
    the module doc); once per process, a no-op without fcntl."""
    if fcntl is None:
        return
    cls = caching.IndexDataCacheFile
    if getattr(cls.save, "_edgeinfer_guarded", False):
        return
    save, load = cls.save, cls.load

    def guarded_save(self, key, data):
        with _dir_lock(self._cache_path, True):
            return save(self, key, data)

    def guarded_load(self, key):
        with _dir_lock(self._cache_path, False):
            return load(self, key)
    guarded_save._edgeinfer_guarded = True
    cls.save, cls.load = guarded_save, guarded_load
