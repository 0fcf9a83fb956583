"""Code run around numba's modules as each is imported: numba_cache's patches (kernels and
the runtime module loaded from the cache without LLVM work or a registry refresh),
numba_setup's lock around the cache's index, and numba_start's deferrals (modules numba
imports and we do not use). `install()` is called
from edgeinfer/__init__ in every process; it imports nothing of numba's, and the hooks wait
for numba's own import (the daemon never makes one)."""
from __future__ import annotations

import sys

from edgeinfer import numba_cache, numba_start
from edgeinfer.formats import numba_setup


def _after(patch):
    """A hook that runs the module, then patches it."""
    def hook(module, run):
        run()
        patch(module)
    hook.patch = patch
    return hook


def _caching(caching) -> None:
    numba_cache.patch_cache_load(caching)       # a hit without the registry refresh
    numba_setup.guard_numba_cache(caching)      # index saves and loads under a file lock


# module -> hook(module, run): `run()` executes the module's code
HOOKS = {
    "numba.core.config": numba_start.yaml_on_first_use,
    "numba.core.entrypoints": numba_start.metadata_on_first_use,
    "numba.core.codegen": _after(numba_cache.patch_codegen),
    "numba.core.runtime.nrtdynmod": _after(numba_cache.patch_nrt),
    "numba.core.caching": _after(_caching),
    "numba.core.environment": _after(numba_cache.patch_env_rebuild),
    "numba.np.arraymath": numba_start.without_scipy_blas_probe,
    "numba.core.typing.typeof": _after(numba_start.masked_arrays_on_first_use),
}


class _Hooks:
    """A sys.meta_path finder that wraps the loading of each module in HOOKS, then leaves
    sys.meta_path once all of them have loaded."""

    def __init__(self, waiting: set[str]):
        self.waiting = waiting

    def find_spec(self, name, path, target=None):
        if name not in self.waiting:
            return None
        import importlib.util
        self.waiting.discard(name)
        sys.meta_path.remove(self)      # the module's own spec, from the finders after this
        try:
            spec = importlib.util.find_spec(name)
        finally:
            if self.waiting:
                sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader_exec, hook = spec.loader.exec_module, HOOKS[name]

        def exec_module(module):
            hook(module, lambda: loader_exec(module))
        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    """Patch numba's modules that are loaded now (where a hook is a patch after the module's
    code; the others are too late), and wrap the others' loads."""
    waiting = set()
    for name, hook in HOOKS.items():
        module = sys.modules.get(name)
        if module is None:
            waiting.add(name)
        elif hasattr(hook, "patch"):
            hook.patch(module)
    if waiting and not any(isinstance(f, _Hooks) for f in sys.meta_path):
        sys.meta_path.insert(0, _Hooks(waiting))
