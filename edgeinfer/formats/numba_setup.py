"""numba's process-wide set-up, done before its first compile or cache load
(`prepare_numba`): inter-process locks around its disk cache, and its scipy BLAS probe
skipped. Here, at the bottom of the layers, because the GGUF reader's compiled string walk
(_string_heads.py) can be the first numba call of a process, before any backend loads.

Locks around the disk cache.

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
import sys

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


def guard_numba_cache() -> None:
    """Put numba's cache index saves and loads under the directory lock (see the module
    doc); once per process, a no-op without fcntl."""
    if fcntl is None:
        return
    from numba.core import caching
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


_PROBE = "scipy.linalg.cython_blas"


def skip_scipy_blas_probe() -> None:
    """On its first compile or cache load numba imports numba.np.arraymath, which probes for
    scipy's BLAS (`import scipy.linalg.cython_blas`) only to choose the inner product that
    np.correlate / np.convolve use in jitted code. Where scipy is installed (the dev extras
    pull it in) that import is ~0.15-0.4 s of every cold start, and no kernel of ours calls
    those functions. Importing arraymath with the probe's module masked makes it take its
    plain loop; np.dot and np.linalg are unaffected (they look BLAS up when typed). A no-op
    once arraymath or scipy.linalg is imported (then the probe costs nothing)."""
    if "numba.np.arraymath" in sys.modules or _PROBE in sys.modules:
        return
    sys.modules[_PROBE] = None          # makes `import scipy.linalg.cython_blas` fail
    try:
        import numba.np.arraymath  # noqa: F401
    finally:
        if sys.modules.get(_PROBE, 0) is None:
            del sys.modules[_PROBE]


def prepare_numba() -> None:
    """Both, once per process (each is a no-op the second time)."""
    guard_numba_cache()
    skip_scipy_blas_probe()
