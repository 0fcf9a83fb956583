"""The native CPU backend (numba kernels)."""
