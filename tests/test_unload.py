"""Deterministic unload (issue 12): unloading a model through the API gives its memory back.

A real daemon process loads the bundled model, generates, and unloads it with keep_alive 0;
its RSS (psutil on the daemon's pid) must come back to within 50 MB of the figure read just
before the load. The first load in a daemon's life also brings the compute kernels' machine
code in (numba's cached kernels, linked by LLVM), which stays for the process's lifetime
whatever model runs next, so that cycle gets a separate, documented allowance and the later
cycles, each measured from its own pre-load figure, must meet 50 MB: no copy of the weights,
KV pool, engine or tokenizer may survive an unload, and nothing may grow cycle after cycle.
"""
from __future__ import annotations

import time

import psutil
import pytest

from daemon_fixture import register_gemma, start_daemon

MB = 1 << 20
TOLERANCE = 50 * MB           # issue 12: "within 50 MB of its pre-load figure"
KERNEL_CODE_ALLOWANCE = 100 * MB   # first load only: kernel machine code, kept process-wide


@pytest.fixture()
def daemon(tmp_path, gemma3_path):
    home = tmp_path / "home"
    register_gemma(home, gemma3_path)
    d = start_daemon(home)
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


def _load_generate_unload(d) -> int:
    """Returns the RSS while loaded (after generating)."""
    r = d.post("/api/generate", {"model": "gemma3:270m", "prompt": "Tell me about the sea.",
                                 "stream": False,
                                 "options": {"temperature": 0, "num_predict": 16}})
    assert r.status_code == 200, r.text
    assert r.json()["eval_count"] > 0
    assert _models(d) == ["gemma3:270m"]
    loaded = psutil.Process(d.proc.pid).memory_info().rss
    r = d.post("/api/generate", {"model": "gemma3:270m", "keep_alive": 0})
    assert r.status_code == 200, r.text
    assert r.json()["done_reason"] == "unload"
    deadline = time.monotonic() + 30            # a guard against hanging, not a timing
    while _models(d) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _models(d) == []
    return loaded


def test_unload_returns_memory(daemon):
    proc = psutil.Process(daemon.proc.pid)
    figures = []
    for cycle in range(3):
        before = _rss(proc)
        loaded = _load_generate_unload(daemon)
        after = _rss(proc)
        figures.append((before, loaded, after))
        print(f"cycle {cycle}: before {before / MB:.0f} MB, loaded {loaded / MB:.0f} MB, "
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
