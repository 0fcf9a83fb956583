"""Kernels loaded from numba's cache without parsing their bitcode (edgeinfer/numba_cache.py):
the symbols the object file defines are the ones numba's own load lists, a kernel loaded
that way runs and links into a new compilation, and the patch is active on the installed
numba (a numba upgrade fails here until the patch is checked against it)."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

_SYMBOLS = r"""
import json
import edgeinfer
import numpy as np
import llvmlite.binding as ll
from edgeinfer import numba_cache
objects = []                           # each load's object file, as the patched load reads it
_symbols = numba_cache.elf_defined_symbols
def recorded(obj):
    objects.append(obj)
    return _symbols(obj)
numba_cache.elf_defined_symbols = recorded
from edgeinfer.backends.cpu import warmup
warmup.run("attention:f16")           # loads attention kernels from the cache
from edgeinfer.backends.cpu import attention
out = {"active": numba_cache.active(), "libraries": []}
for cres in attention._run.overloads.values():
    lib = cres.library
    bitcode = lib.__dict__.get("_lazy_bitcode")
    if bitcode is None:
        continue
    mod = ll.parse_bitcode(bitcode)
    ir = {g.name for gs in (mod.functions, mod.global_variables) for g in gs
          if not g.is_declaration}
    private = {g.name for gs in (mod.functions, mod.global_variables) for g in gs
               if not g.is_declaration and g.linkage == ll.Linkage.private}
    entry = cres.fndesc.llvm_func_name
    elf = next(n for n in map(_symbols, objects) if entry in n)
    out["libraries"].append({"ir_not_elf": sorted(ir - private - elf),
                             "elf_not_ir": sorted(elf - ir), "entry": entry in elf,
                             "n": len(elf)})
print(json.dumps(out))
"""


def test_the_object_files_symbols_are_the_ones_numbas_load_lists():
    p = subprocess.run([sys.executable, "-c", _SYMBOLS], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["active"], "the patch is off: is the installed numba one numba_cache.KNOWN lists?"
    assert out["libraries"], "no kernel came from the cache"
    for lib in out["libraries"]:
        assert lib["entry"] and lib["n"] > 1
        assert lib["ir_not_elf"] == [] and lib["elf_not_ir"] == [], lib


_KERNEL = """
import numba
import numpy as np
@numba.njit(cache=True, nogil=True)
def scaled_sum(x, k):
    s = 0.0
    for v in x:
        s += v * k
    return s

@numba.njit(cache=True, nogil=True)
def doubled(x):             # allocates and returns an array: the runtime (NRT) at work
    out = np.empty_like(x)
    for i in range(x.shape[0]):
        out[i] = 2.0 * x[i]
    return out
"""

_USE = r"""
import json, sys
import edgeinfer
import numba
import numpy as np
sys.path.insert(0, sys.argv[1])
import kern
from edgeinfer import numba_cache
x = np.arange(10, dtype=np.float64)
first = kern.scaled_sum(x, 2.0)
made = float(kern.doubled(x).sum())
# a load from the cache does not refresh numba's registries (numba_cache.patch_cache_load)
registries = "numba.np.arraymath" in sys.modules
lib = next(iter(kern.scaled_sum.overloads.values())).library

@numba.njit
def twice(x):           # compiled here: links the cached kernel's library in
    return kern.scaled_sum(x, 2.0) + kern.scaled_sum(x, 1.0)

print(json.dumps({"active": numba_cache.active(), "first": first, "twice": twice(x),
                  "made": made, "registries": registries,
                  "hits": sum(kern.scaled_sum.stats.cache_hits.values()),
                  "lazy_left": "_lazy_bitcode" in lib.__dict__}))
"""


def test_a_kernel_loaded_lazily_runs_and_links_into_a_new_compilation(tmp_path):
    """Loaded without its bitcode and without a registry refresh, a kernel runs (one that
    allocates too), and a compilation after it links it in."""
    (tmp_path / "kern.py").write_text(textwrap.dedent(_KERNEL))
    env_cmd = [sys.executable, "-c", _USE, str(tmp_path)]
    import os
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    runs = []
    for _ in range(2):      # the first compiles and saves; the second loads from the cache
        p = subprocess.run(env_cmd, capture_output=True, text=True, timeout=600, env=env)
        assert p.returncode == 0, p.stderr[-3000:]
        runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
    compiled, loaded = runs
    assert compiled["hits"] == 0 and loaded["hits"] == 1 and loaded["active"]
    assert compiled["registries"] and not loaded["registries"]
    assert loaded["made"] == compiled["made"] == 90.0
    assert loaded["first"] == compiled["first"] == 90.0
    assert loaded["twice"] == compiled["twice"] == 135.0
    assert loaded["lazy_left"] is False        # linking parsed it, once asked


_NRT = r"""
import json
import edgeinfer
import numba
import numpy as np
from numba.core.runtime import rtsys
from edgeinfer import numba_cache

@numba.njit
def churn(n):            # arrays made and dropped: the runtime's reference counts at work
    total = 0.0
    for i in range(n):
        a = np.arange(i + 1.0)
        b = a * 2.0
        total += b.sum()
    return total

value = churn(50)
stats = rtsys.get_allocation_stats()
print(json.dumps({"from_cache": numba_cache.nrt_from_cache, "value": value,
                  "alloc": stats.alloc, "free": stats.free}))
"""


def test_the_runtime_module_is_compiled_once_then_loaded(tmp_path):
    """numba's NRT module: compiled and kept by the first process, loaded by the next; its
    allocations and frees balance either way (NUMBA_NRT_STATS)."""
    import os
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"), NUMBA_NRT_STATS="1")
    runs = []
    for _ in range(2):
        p = subprocess.run([sys.executable, "-c", _NRT], capture_output=True, text=True,
                           timeout=600, env=env)
        assert p.returncode == 0, p.stderr[-3000:]
        runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
    compiled, loaded = runs
    assert compiled["from_cache"] is False and loaded["from_cache"] is True
    assert list((tmp_path / "cache" / "edgeinfer-nrt").iterdir())
    want = sum(2.0 * i * (i + 1) / 2 for i in range(50))
    for run in runs:
        assert run["value"] == want
        assert run["alloc"] == run["free"] > 0, run


_ENV_KERNEL = """
import numba
import numpy as np

@numba.njit(cache=True, nogil=True)
def ramp(n):                # np.empty's implementation comes from numba.np.arrayobj
    if n < 0:
        raise ValueError("ramp: n must be >= 0")
    out = np.empty(n, np.float64)
    for i in range(n):
        out[i] = 0.5 * i
    return out
"""

_ENV_USE = r"""
import json, sys
if sys.argv[2] == "ours":
    import edgeinfer
import numba
import numpy as np
sys.path.insert(0, sys.argv[1])
import env_kern
total = float(env_kern.ramp(8).sum())
try:
    env_kern.ramp(-1)
    raised = None
except ValueError as e:
    raised = str(e)
print(json.dumps({"total": total, "raised": raised,
                  "hits": sum(env_kern.ramp.stats.cache_hits.values()),
                  "arrayobj": "numba.np.arrayobj" in sys.modules}))
"""


def test_a_loaded_kernels_environment_does_not_import_numbas_array_module(tmp_path):
    """Unpickling a cached kernel's environments imported each one's defining module for its
    globals (numba.np.arrayobj for np.empty's, ~25 ms with what it imports); with
    numba_cache.patch_env_rebuild a load leaves it unimported, and the kernel still computes
    and raises its own error. Stock numba, loading the same cache, does import it."""
    (tmp_path / "env_kern.py").write_text(textwrap.dedent(_ENV_KERNEL))
    import os
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"))

    def run(who: str) -> dict:
        p = subprocess.run([sys.executable, "-c", _ENV_USE, str(tmp_path), who],
                           capture_output=True, text=True, timeout=600, env=env)
        assert p.returncode == 0, p.stderr[-3000:]
        return json.loads(p.stdout.strip().splitlines()[-1])
    compiled, loaded, stock = run("ours"), run("ours"), run("stock")
    assert compiled["hits"] == 0 and loaded["hits"] == 1 and stock["hits"] == 1
    for out in (compiled, loaded, stock):
        assert out["total"] == 14.0 and out["raised"] == "ramp: n must be >= 0", out
    assert loaded["arrayobj"] is False
    assert stock["arrayobj"] is True          # what the patch saves
