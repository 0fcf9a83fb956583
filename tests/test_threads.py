"""The CPU thread governor: fewer threads when other programs keep the cores busy."""
from __future__ import annotations

import subprocess
import sys
import time

import numba
import pytest

from edgeinfer.backends import threads as T


def fake_clock(monkeypatch, samples):
    """samples: (wall, machine busy seconds, own cpu seconds) returned in turn."""
    it = iter(samples)
    state = {}

    def advance():
        state["now"] = next(it)
    monkeypatch.setattr(T.time, "monotonic", lambda: state["now"][0])
    monkeypatch.setattr(T, "_machine_busy_seconds", lambda: state["now"][1])
    monkeypatch.setattr(T, "_own_seconds", lambda: state["now"][2])
    monkeypatch.setattr(T.os, "cpu_count", lambda: 4)
    return advance


def test_threads_follow_the_free_cores(monkeypatch):
    monkeypatch.setattr(numba.config, "NUMBA_NUM_THREADS", 4)
    monkeypatch.setattr(numba, "set_num_threads", lambda n: None)
    advance = fake_clock(monkeypatch, [
        (0.0, 100.0, 10.0),     # baseline
        (1.0, 102.0, 12.0),     # 2 busy core-seconds, all ours -> others 0 -> 4 threads
        (2.0, 105.0, 13.0),     # 3 busy, 1 ours -> others 2 -> 2 threads
        (2.1, 105.0, 13.0),     # within the interval: no new reading
        (3.0, 108.9, 13.0),     # others 3.9 -> still at least one thread
    ])
    g = T.ThreadGovernor(interval=0.25)
    advance()
    assert g.update() == 4
    advance()
    assert g.update() == 4 and g.others == 0.0
    advance()
    assert g.update() == 2 and g.others == pytest.approx(2.0)
    advance()
    assert g.update() == 2
    advance()
    assert g.update() == 1


def test_fixed_thread_count(monkeypatch):
    g = T.ThreadGovernor(fixed=1)
    assert g.update() == 1
    assert numba.get_num_threads() == 1
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)


def test_sees_a_real_busy_process(monkeypatch):
    if T._machine_busy_seconds() is None:
        pytest.skip("no /proc/stat on this platform")
    burner = subprocess.Popen([sys.executable, "-c", "import time\nt=time.time()\nwhile time.time()-t<3: pass"])
    try:
        time.sleep(0.3)
        monkeypatch.setattr(numba.config, "NUMBA_NUM_THREADS", 2)
        monkeypatch.setattr(T.os, "cpu_count", lambda: 2)      # a 2-core machine
        g = T.ThreadGovernor(interval=0.0)
        g.update()
        time.sleep(1.0)
        g.update()
        assert g.others >= 0.5          # the burner alone keeps one core busy
        assert g.threads == 1           # so one of the two cores is left
    finally:
        burner.kill()
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)


def test_engines_split_the_budget(monkeypatch):
    """One governor per process: two engine threads stepping at once get half the cores
    each; when one goes quiet the other gets them all back."""
    monkeypatch.setattr(numba.config, "NUMBA_NUM_THREADS", 4)
    told = {}
    monkeypatch.setattr(numba, "set_num_threads",
                        lambda n: told.__setitem__(T.threading.get_ident(), n))
    clock = {"now": 0.0}
    monkeypatch.setattr(T.time, "monotonic", lambda: clock["now"])
    g = T.ThreadGovernor(idle_after=1.0, fixed=4)

    def call_from_thread() -> int:
        out = []
        t = T.threading.Thread(target=lambda: out.append(g.update()))
        t.start()
        t.join()
        return out[0], t.ident

    assert g.update() == 4                       # alone: the whole budget
    clock["now"] = 0.05
    other, other_ident = call_from_thread()      # a second engine steps
    assert other == 2 and told[other_ident] == 2
    clock["now"] = 0.1
    assert g.update() == 2                       # ...and this one now gets half
    assert g.active_threads() == 2
    clock["now"] = 1.5                           # the other has been silent > idle_after
    assert g.update() == 4
    assert told[T.threading.get_ident()] == 4
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)


def test_uneven_budget_gives_the_remainder_away(monkeypatch):
    """Budget 3, two engines: one gets 2 and the other 1, never 1 + 1 (a core idle) or
    2 + 2 (oversubscribed)."""
    monkeypatch.setattr(numba.config, "NUMBA_NUM_THREADS", 4)
    clock = {"now": 0.0}
    monkeypatch.setattr(T.time, "monotonic", lambda: clock["now"])
    g = T.ThreadGovernor(fixed=3)
    stepped, again, theirs = T.threading.Event(), T.threading.Event(), []

    def other_engine() -> None:
        g.share()                        # another engine stepped just now (alone: 3)
        stepped.set()
        again.wait()
        theirs.append(g.share())         # and steps again, beside this one
    t = T.threading.Thread(target=other_engine)
    t.start()
    stepped.wait()
    clock["now"] = 0.1
    mine = g.share()
    again.set()
    t.join()
    assert sorted((mine, theirs[0])) == [1, 2]
