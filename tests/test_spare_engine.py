"""The spare engine process (edgeinfer/engine/spare.py), on real daemons.

- An idle daemon keeps one warm engine process; the next load is served by it (same pid),
  with the same greedy text as a daemon without spares (EDGEINFER_SPARE_RUNNER=0, which
  never starts one), and once that load is idle a new spare replaces it.
- A spare that dies while waiting is replaced, and the load after it still works.
- Stopping the daemon ends its spare.
"""
from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from daemon_fixture import process_gone, register_gemma, start_daemon

MODEL = "gemma3:270m"


@pytest.fixture(scope="module")
def daemons(tmp_path_factory, gemma3_path):
    homes = [tmp_path_factory.mktemp(f"spare-{k}") / "home" for k in ("on", "off")]
    for h in homes:
        register_gemma(h, gemma3_path)
    on = start_daemon(homes[0], EDGEINFER_SPARE_RUNNER="1")
    off = start_daemon(homes[1], EDGEINFER_SPARE_RUNNER="0")
    try:
        yield on, off
    finally:
        on.stop()
        off.stop()


def _spare(d) -> int | None:
    s = d.stats()["process"]["spare_engine"]
    return None if s is None else s["pid"]


def _wait_spare(d, other_than: int | None = None) -> int:
    deadline = time.monotonic() + 60        # a guard against hanging, not a timing
    while time.monotonic() < deadline:
        pid = _spare(d)
        if pid is not None and pid != other_than:
            return pid
        time.sleep(0.2)
    raise AssertionError(f"no spare engine process appeared:\n{d.log_text()[-3000:]}")


def _generate(d, **extra) -> dict:
    r = d.post("/api/generate", {"model": MODEL, "prompt": "Tell me about the sea.",
                                 "stream": False, **extra,
                                 "options": {"temperature": 0, "num_predict": 24}})
    assert r.status_code == 200, r.text
    return r.json()


def _engine_pid(d) -> int:
    return {m["name"]: m for m in d.stats()["models"]}[MODEL]["engine_pid"]


def _unload(d) -> None:
    r = d.post("/api/generate", {"model": MODEL, "keep_alive": 0})
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 30
    while d.stats()["models"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not d.stats()["models"]


def test_the_next_load_takes_the_spare_and_a_new_one_follows(daemons):
    on, off = daemons
    spare = _wait_spare(on)
    assert psutil.Process(spare).ppid() == on.proc.pid
    text = _generate(on)["response"]
    assert _engine_pid(on) == spare                 # the load ran in the warm process
    assert text == _generate(off)["response"]       # and computes what a fresh one does
    assert _spare(off) is None and _engine_pid(off) != off.proc.pid
    following = _wait_spare(on, other_than=spare)   # once idle, the next spare starts
    assert following != spare
    _unload(on)
    assert _generate(on)["response"] == text
    assert _engine_pid(on) == following
    _unload(on)
    time.sleep(1.5)                     # past the idle second a spare waits for
    assert _spare(off) is None          # off means off


def test_a_spare_that_died_is_replaced(daemons):
    on, _ = daemons
    victim = _wait_spare(on)
    os.kill(victim, signal.SIGKILL)
    replacement = _wait_spare(on, other_than=victim)
    out = _generate(on)
    assert out["done"] and out["eval_count"] > 0
    assert _engine_pid(on) == replacement
    _unload(on)


def test_stopping_the_daemon_ends_its_spare(daemons):
    """Last in the module: it stops the module's daemon with spares."""
    on, _ = daemons
    spare = _wait_spare(on)
    on.stop()
    deadline = time.monotonic() + 30           # a guard against hanging, not a timing
    while not process_gone(spare) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert process_gone(spare), f"spare engine process {spare} outlived its daemon"
