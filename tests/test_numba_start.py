"""numba's import with PyYAML and importlib.metadata deferred (edgeinfer/numba_start.py):
neither loads in a process that compiles and runs a kernel, and each still does its job
when there is one: a .numba_config.yaml in the working directory is read, and a
`numba_extensions` plugin is loaded. (A compile, unlike a cache load, imports numpy.testing,
which imports importlib.metadata itself.)"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

_RUN = textwrap.dedent("""
    import json, sys
    import edgeinfer
    import numba
    from numba.core import config, entrypoints
    import numpy as np
    from edgeinfer.formats._string_heads import string_heads   # a kernel from the cache
    buf = np.array([2, 0, 0, 0, 0, 0, 0, 0, 104, 105], dtype=np.uint8)
    heads = np.zeros(1, dtype=np.int64)
    out = {"end": int(string_heads(buf, 0, 1, 16, heads)), "debuginfo": config.DEBUGINFO_DEFAULT, "initialized": entrypoints._already_initialized,
           "plugin": getattr(sys.modules.get("fake_numba_plugin"), "CALLED", False)}
    for name in ("yaml", "importlib.metadata"):
        m = sys.modules.get(name)
        out[name] = "absent" if m is None else ("lazy" if type(m).__name__ == "_LazyModule"
                                                 else "loaded")
    print(json.dumps(out))
""")


def _run(cwd, env_extra=None):
    import os
    env = dict(os.environ, **(env_extra or {}))
    env.pop("NUMBA_DEBUGINFO", None)
    p = subprocess.run([sys.executable, "-c", _RUN], cwd=cwd, env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_a_cached_kernel_runs_without_loading_yaml_or_importlib_metadata(tmp_path):
    out = _run(tmp_path)
    assert out["end"] == 10 and out["initialized"] is True
    assert out["yaml"] in ("lazy", "absent"), out
    assert out["importlib.metadata"] in ("lazy", "absent"), out


def test_a_numba_config_file_is_still_read(tmp_path):
    (tmp_path / ".numba_config.yaml").write_text("debuginfo: 1\n")
    out = _run(tmp_path)
    assert out["debuginfo"] == 1 and out["yaml"] == "loaded", out


def test_a_numba_extensions_plugin_is_still_loaded(tmp_path):
    site = tmp_path / "site"
    dist = site / "fake_numba_plugin-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-numba-plugin\n"
                                   "Version: 1.0\n")
    (dist / "entry_points.txt").write_text("[numba_extensions]\ninit = fake_numba_plugin:init\n")
    (site / "fake_numba_plugin.py").write_text("CALLED = False\n"
                                               "def init():\n    global CALLED\n    CALLED = True\n")
    out = _run(tmp_path, {"PYTHONPATH": str(site)})
    assert out["plugin"] is True and out["importlib.metadata"] == "loaded", out


def test_numbas_array_math_loads_without_probing_scipys_blas(tmp_path):
    """A compilation imports numba.np.arraymath, which would import scipy's BLAS (0.15-0.4 s
    where scipy is installed) only for np.correlate / np.convolve: masked, and they still
    compute."""
    import pytest
    pytest.importorskip("scipy.linalg")
    code = textwrap.dedent("""
        import json, sys
        import edgeinfer
        import numba
        import numpy as np
        @numba.njit
        def conv(a):
            return np.convolve(a, a).sum()
        print(json.dumps({"conv": conv(np.ones(3)),
                          "arraymath": "numba.np.arraymath" in sys.modules,
                          "blas": "scipy.linalg.cython_blas" in sys.modules}))
    """)
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out == {"conv": 9.0, "arraymath": True, "blas": False}


def test_the_cache_index_lock_is_on_once_numba_caching_loads(tmp_path):
    """numba_setup's directory lock around the cache index is an import hook now (no call
    site has to remember it): on in a process that imported nothing but numba."""
    code = ("import edgeinfer, numba\n"
            "from numba.core import caching\n"
            "print(getattr(caching.IndexDataCacheFile.save, '_edgeinfer_guarded', False))")
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip() == "True"


def test_typing_an_array_does_not_import_numpy_ma(tmp_path):
    """numba's typeof asks every array it types whether it is a np.ma.MaskedArray, which
    imported numpy.ma (~7 ms) at a process's first kernel call; through numba_start's view
    of numpy it does not, and a masked array, once numpy.ma is imported, is still refused
    where numba refuses it (a function's first typing of an array)."""
    code = textwrap.dedent("""
        import json, sys
        import edgeinfer
        import numba
        import numpy as np
        from edgeinfer.formats._string_heads import string_heads   # a kernel from the cache
        buf = np.array([2, 0, 0, 0, 0, 0, 0, 0, 104, 105], dtype=np.uint8)
        end = int(string_heads(buf, 0, 1, 16, np.zeros(1, dtype=np.int64)))
        before = "numpy.ma" in sys.modules
        import numpy.ma
        try:        # a function's first call types its array in Python (later ones in C)
            numba.njit(lambda a: a.sum())(np.ma.masked_array(buf))
            refused = ""
        except Exception as e:
            refused = str(e)
        print(json.dumps({"end": end, "ma_before": before, "refused": refused}))
    """)
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["end"] == 10 and out["ma_before"] is False, out
    assert "MaskedArray" in out["refused"], out
