"""The native CPU backend (numba kernels)."""
from edgeinfer.formats.numba_setup import prepare_numba

prepare_numba()
