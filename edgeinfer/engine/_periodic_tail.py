"""The repetition guard's kernel (engine/repetition.py), in a module of its own so that
importing the guard does not import numba."""
from __future__ import annotations

from numba import njit


@njit(nogil=True, cache=True)
def longest_periodic_tail(z, max_period, min_run):
    """The smallest period P (1..max_period) whose run R (tail equals the tokens P earlier,
    R tokens in a row; z = suffix_z of the window) reaches max(P, min_run); 0 if none."""
    n = z.shape[0]
    top = min(max_period, n - 1)
    for k in range(1, top + 1):
        if z[k] >= max(k, min_run):
            return k
    return 0
