"""edgeinfer: a local LLM inference daemon for GGUF models."""
import os as _os

__version__ = "0.1.0"


def _runtime_defaults() -> None:
    """Environment defaults that must be in place before numba loads its OpenMP runtime."""
    if "NUMBA_CACHE_DIR" not in _os.environ:
        # One JIT cache per user, whatever the install location (site-packages may be
        # read-only): install.sh warms it, and the CLI, daemon and tests reuse it.
        from platformdirs import user_cache_dir
        _os.environ["NUMBA_CACHE_DIR"] = _os.path.join(user_cache_dir("edgeinfer"), "numba")
    if "OMP_WAIT_POLICY" not in _os.environ and "GOMP_SPINCOUNT" not in _os.environ:
        # Idle OpenMP workers spin by default; on a laptop's few cores, shared with the HTTP
        # thread and other programs, long spins starve them (steps ran ~10x slower under
        # load). A short spin still catches the back-to-back kernels of one forward pass.
        _os.environ["GOMP_SPINCOUNT"] = "20000"


_runtime_defaults()


def _numba_hooks() -> None:
    # kernels load from numba's cache without parsing their bitcode (numba_cache.py), and
    # numba's import skips what we do not use (numba_start.py); the hooks wait for numba's
    # own modules, which the daemon never imports
    from edgeinfer import numba_hooks
    numba_hooks.install()


_numba_hooks()
