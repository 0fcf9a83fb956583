"""Deterministic unload (issue 12) of an engine in the daemon's own process
(EDGEINFER_ENGINE_PROCESS=0): unloading a model through the API gives its memory back.

A real daemon process loads the bundled model, generates, and unloads it (keep_alive 0, then
`edgeinfer stop NAME`, then the idle reaper after a 1 s keep_alive);
its RSS (psutil on the daemon's pid) must come back to within 50 MB of the figure read just
before the load. The first load in a daemon's life also brings the compute kernels' machine
code in (numba's cached kernels, linked by LLVM), which stays for the process's lifetime
whatever model runs next, so that cycle gets a separate, documented allowance and the later
cycles, each measured from its own pre-load figure, must meet 50 MB: no copy of the weights,
KV pool, engine or tokenizer may survive an unload, and nothing may grow cycle after cycle.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from daemon_fixture import register_gemma, start_daemon

MB = 1 << 20
TOLERANCE = 50 * MB           # issue 12: "within 50 MB of its pre-load figure"
# First load only: the kernels' machine code (numba's cached kernels, linked by LLVM at their
# first call) stays for the process's lifetime, whatever model runs next. Measured in-process:
# the matmul kernels alone +137 MB, and a daemon's first load/unload of gemma3 +58..89 MB.
# A leaked engine (weights, KV pool, tokenizer) is +250 MB and fails even this bound.
KERNEL_CODE_ALLOWANCE = 150 * MB


# -m slow: engines in the daemon's process (EDGEINFER_ENGINE_PROCESS=0) are not the default;
# the default run checks unloading engine processes (tests/test_engine_process.py)
@pytest.fixture(params=[pytest.param("cpu", marks=pytest.mark.slow),
                        pytest.param("llamacpp", marks=pytest.mark.slow)])
def daemon(request, tmp_path, gemma3_path):
    """A fresh daemon (nothing loaded yet) on the native runner, and on llama.cpp's."""
    home = tmp_path / "home"
    register_gemma(home, gemma3_path)
    # the in-process engine (EDGEINFER_ENGINE_PROCESS=0); engine processes:
    # tests/test_engine_process.py
    d = start_daemon(home, EDGEINFER_BACKEND=request.param, EDGEINFER_ENGINE_PROCESS="0")
    try:
        yield d
    finally:
        d.stop()


def _rss(proc: psutil.Process) -> int:
    """The settled RSS: the smallest of a few readings (a request's buffers may still be
    on their way out when the first one is taken)."""
    readings = []
    for _ in range(5):
        time.sleep(0.2)
        readings.append(proc.memory_info().rss)
    return min(readings)


def _models(d) -> list[str]:
    return [m["name"] for m in d.stats()["models"]]


def _load_generate_unload(d, how: str) -> int:
    """Load and generate, then unload `how`: "api" (keep_alive 0 on an empty request),
    "cli" (`edgeinfer stop NAME`) or "reaper" (a 1 s keep_alive runs out). Returns the RSS
    while loaded."""
    body = {"model": "gemma3:270m", "prompt": "Tell me about the sea.", "stream": False,
            "options": {"temperature": 0, "num_predict": 16}}
    if how == "reaper":
        body["keep_alive"] = "1s"
    r = d.post("/api/generate", body)
    assert r.status_code == 200, r.text
    assert r.json()["eval_count"] > 0
    loaded = psutil.Process(d.proc.pid).memory_info().rss
    if how == "api":
        assert _models(d) == ["gemma3:270m"]
        r = d.post("/api/generate", {"model": "gemma3:270m", "keep_alive": 0})
        assert r.status_code == 200, r.text
        assert r.json()["done_reason"] == "unload"
    elif how == "cli":
        assert _models(d) == ["gemma3:270m"]
        env = {**os.environ, "EDGEINFER_HOST": f"127.0.0.1:{d.port}"}
        r = subprocess.run([sys.executable, "-m", "edgeinfer", "stop", "gemma3:270m"],
                           env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
    deadline = time.monotonic() + 30            # a guard against hanging, not a timing
    while _models(d) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _models(d) == []
    return loaded


def test_unload_returns_memory(daemon):
    proc = psutil.Process(daemon.proc.pid)
    figures = []
    for cycle, how in enumerate(["api", "api", "cli", "reaper"]):
        before = _rss(proc)
        loaded = _load_generate_unload(daemon, how)
        after = _rss(proc)
        figures.append((before, loaded, after))
        print(f"cycle {cycle} ({how}): before {before / MB:.0f} MB, loaded {loaded / MB:.0f} MB, "
              f"after unload {after / MB:.0f} MB ({(after - before) / MB:+.0f} MB)")
    # the model really was in memory: the unload has something to give back
    assert all(loaded - before > 200 * MB for before, loaded, _ in figures), figures
    before, _, after = figures[0]
    assert after - before < TOLERANCE + KERNEL_CODE_ALLOWANCE, figures
    for before, _, after in figures[1:]:
        assert after - before < TOLERANCE, figures
    # and nothing accumulates: the last idle figure is where the first unload left it
    assert figures[-1][2] - figures[0][2] < TOLERANCE, figures
    assert "still referenced" not in daemon.log_text()


def test_failed_load_keeps_nothing(daemon, tmp_path):
    """A model whose file broke after it was registered (truncated blob): the load fails with
    one sentence, nothing stays loaded or allocated, and the daemon loads the next model."""
    from synth import write_model

    from edgeinfer.store.model_store import Store
    src = write_model(tmp_path / "tiny.gguf", "llama")
    ref = Store(daemon.home).register_file(src, "tiny:broken")
    blob = Path(ref.path)
    size = blob.stat().st_size
    with open(blob, "r+b") as f:             # the tensor data runs past the end of the file now
        f.truncate(size // 2)
    proc = psutil.Process(daemon.proc.pid)
    before = _rss(proc)
    r = daemon.post("/api/generate", {"model": "tiny:broken", "prompt": "Hi", "stream": False})
    assert r.status_code == 500, r.text
    msg = r.json()["error"]
    assert msg.startswith("cannot load tiny:broken") and "Traceback" not in msg, msg
    assert _models(daemon) == []
    assert _rss(proc) - before < TOLERANCE
    # the daemon is fine: the real model loads and answers
    r = daemon.post("/api/generate", {"model": "gemma3:270m", "prompt": "Hi", "stream": False,
                                      "options": {"temperature": 0, "num_predict": 4}})
    assert r.status_code == 200 and r.json()["done"], r.text
