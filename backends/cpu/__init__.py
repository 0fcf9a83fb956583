"""The native CPU backend (numba kernels)."""
from ._cachelock import guard_numba_cache

guard_numba_cache()
