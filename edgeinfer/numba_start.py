"""What numba's import does that our processes do not need, deferred until something does.

`import numba` is ~0.15 s of every cold start, and two parts of it serve nothing we use:
- numba.core.config imports PyYAML (~11 ms), only to read a `.numba_config.yaml` in the
  working directory if there is one;
- numba.core.entrypoints imports importlib.metadata (~16 ms, with the email package) and, on
  the first compile or cache load, scans every installed distribution's entry points for
  `numba_extensions` plugins (~7 ms with the dev extras installed).

`yaml_on_first_use` and `metadata_on_first_use` run numba's two modules with an
_OnFirstUse in place of each (a stand-in that imports the real module when an attribute is
first read), so numba reads the YAML file, or loads its plugins, exactly as before when
there is one. `import yaml` is made to fail while numba.core.config runs (where no
.numba_config.yaml is in the working directory at that moment; with one, numba imports
PyYAML as always), and numba.core.entrypoints' `from importlib import metadata` finds the
stand-in as importlib's attribute while it runs; nothing outside numba's two modules sees
either. The wrapped init_all skips the scan where no distribution on sys.path declares a
`numba_extensions` entry point (one read of each entry_points.txt, ~3 ms), so there is
nothing to load; otherwise, or where distributions could come from elsewhere (a zip on
sys.path, a meta-path finder with its own distributions), numba's own init_all runs.

And numba.np.arraymath, which a compilation's registry refresh imports, probes for scipy's
BLAS (`import scipy.linalg.cython_blas`) only to choose the inner product that np.correlate
and np.convolve use in jitted code. Where scipy is installed (the dev extras pull it in)
that import is ~0.15-0.4 s, and no kernel of ours calls those functions:
`without_scipy_blas_probe` runs arraymath with the probe's module masked, so it takes its
plain loop (np.dot and np.linalg are unaffected: they look BLAS up when typed).

And numba.core.typing.typeof checks every array it types for `np.ma.MaskedArray`, and
numpy imports numpy.ma (~7 ms) on that first attribute access, at a process's first call of a
kernel. `masked_arrays_on_first_use` gives the module a view of numpy whose `ma` is the real
one once numpy.ma is imported, and before that a stand-in whose MaskedArray nothing is an
instance of: no masked array can exist before its module is imported.

edgeinfer/numba_hooks.py runs these as numba's modules load; numba is never imported here.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
import types


class _OnFirstUse:
    """A module's stand-in: the module is imported when an attribute is first read."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr):
        return getattr(importlib.import_module(self._name), attr)


@contextlib.contextmanager
def _masked(name: str):
    """`import name` raises ImportError inside the block (sys.modules[name] = None); the
    mask goes after it, unless the block put the real module there."""
    sys.modules[name] = None
    try:
        yield
    finally:
        if name in sys.modules and sys.modules[name] is None:
            del sys.modules[name]


def yaml_on_first_use(config, run) -> None:
    """numba.core.config, run without importing PyYAML (see the module doc)."""
    defer = ("yaml" not in sys.modules and not os.path.isfile(".numba_config.yaml")
             and importlib.util.find_spec("yaml") is not None)
    if not defer:
        run()
        return
    # the mask is process-wide: keep its window to config's own code, which imports
    # llvmlite's binding (its shared library: the slow part) first
    import llvmlite.binding  # noqa: F401
    with _masked("yaml"):               # numba's `import yaml` raises ImportError
        run()
    if getattr(config, "_HAVE_YAML", None) is False:
        config.yaml, config._HAVE_YAML = _OnFirstUse("yaml"), True


def metadata_on_first_use(entrypoints, run) -> None:
    """numba.core.entrypoints, run with importlib.metadata's stand-in, and its init_all
    wrapped (see the module doc)."""
    import importlib as package
    stand_in = None
    if "importlib.metadata" not in sys.modules and not hasattr(package, "metadata"):
        stand_in = package.metadata = _OnFirstUse("importlib.metadata")
    try:
        run()
    finally:
        if stand_in is not None and getattr(package, "metadata", None) is stand_in:
            del package.metadata
    _wrap_init_all(entrypoints)


def _may_have_plugins() -> bool:
    """Whether any distribution importlib.metadata would find could declare a
    `numba_extensions` entry point (True where this cannot tell)."""
    from importlib.machinery import PathFinder
    for finder in sys.meta_path:
        if finder is not PathFinder and hasattr(finder, "find_distributions"):
            return True
    for entry in sys.path:
        entry = entry or "."
        if os.path.isfile(entry):       # a zip or egg: its metadata is not a plain file
            return True
        try:
            it = os.scandir(entry)
        except OSError:
            continue
        with it:
            for e in it:
                if not e.name.endswith((".dist-info", ".egg-info")):
                    continue
                try:
                    with open(os.path.join(e.path, "entry_points.txt"), "rb") as f:
                        if b"numba_extensions" in f.read():
                            return True
                except OSError:
                    continue
    return False


def _wrap_init_all(entrypoints) -> None:
    """numba's init_all, preceded by the check for plugins (see the module doc)."""
    own = getattr(entrypoints, "init_all", None)
    if own is None or getattr(own, "_edgeinfer", False) \
            or not isinstance(getattr(entrypoints, "_already_initialized", None), bool):
        return      # not the numba this was written against: its own init_all stays

    def init_all():
        if not entrypoints._already_initialized and not _may_have_plugins():
            entrypoints._already_initialized = True
        return own()
    init_all._edgeinfer = True
    entrypoints.init_all = init_all


_BLAS_PROBE = "scipy.linalg.cython_blas"


def without_scipy_blas_probe(_arraymath, run) -> None:
    """numba.np.arraymath, run with scipy's BLAS module masked (see the module doc); where
    scipy.linalg is imported already the probe costs nothing and is left alone."""
    if _BLAS_PROBE in sys.modules:
        run()
        return
    with _masked(_BLAS_PROBE):              # `import scipy.linalg.cython_blas` fails
        run()


class _NoMaskedArrays:
    """numpy.ma as numba's typeof sees it before numpy.ma is imported."""

    class MaskedArray:
        """Of which nothing is an instance: a masked array needs numpy.ma imported."""


class _NumpyView(types.ModuleType):
    """numpy, except that `ma` is _NoMaskedArrays until numpy.ma is imported."""

    def __getattr__(self, name: str):
        import numpy
        if name == "ma" and "numpy.ma" not in sys.modules:
            return _NoMaskedArrays
        return getattr(numpy, name)


def masked_arrays_on_first_use(typeof) -> None:
    """numba.core.typing.typeof's functions see numpy through _NumpyView (see the module doc);
    their registrations, made as the module ran, hold numpy's own types."""
    if not isinstance(typeof.np, _NumpyView):
        typeof.np = _NumpyView("numpy")
