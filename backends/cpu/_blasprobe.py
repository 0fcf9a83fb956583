"""numba without its scipy BLAS probe.

On its first compile or cache load numba imports numba.np.arraymath, which probes for
scipy's BLAS (`import scipy.linalg.cython_blas`) only to choose the inner product that
np.correlate / np.convolve use in jitted code. Where scipy is installed (the dev extras pull
it in) that import is ~0.15-0.4 s of every cold start, and no kernel of ours calls those
functions. Importing arraymath once with the probe's module masked makes it take its plain
loop instead; np.dot and np.linalg are unaffected (they look BLAS up when they are typed).
"""
from __future__ import annotations

import sys

_PROBE = "scipy.linalg.cython_blas"


def skip_scipy_blas_probe() -> None:
    """Import numba.np.arraymath with scipy's BLAS masked, unless it is imported already or
    scipy.linalg is (then the probe costs nothing)."""
    if "numba.np.arraymath" in sys.modules or _PROBE in sys.modules:
        return
    sys.modules[_PROBE] = None          # makes `import scipy.linalg.cython_blas` fail
    try:
        import numba.np.arraymath  # noqa: F401
    finally:
        if sys.modules.get(_PROBE, 0) is None:
            del sys.modules[_PROBE]
