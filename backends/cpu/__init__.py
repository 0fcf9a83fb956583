"""The native CPU backend (numba kernels)."""
from ._blasprobe import skip_scipy_blas_probe
from ._cachelock import guard_numba_cache

guard_numba_cache()
skip_scipy_blas_probe()
