"""How many threads the CPU kernels use for the next forward pass, from how busy the cores are.

numba's parallel regions end at a barrier: when another program holds one of the cores, the
region waits for the thread that core's scheduler has not run yet, and a 30 us matmul takes
milliseconds (decode measured 3.8 tok/s with one other busy process on a 2-core machine, 77
on one thread). So before each step the governor reads how much CPU time the rest of the
machine used since the last look (/proc/stat minus this process's own time) and runs on the
cores left free, at least one. A fixed count (Settings.threads, EDGEINFER_THREADS=N) replaces
the measurement.

One governor serves the whole process (the model manager owns it): every engine thread asks it
before each step, and the free cores are split between the engines that are stepping, so two
models generating at once run one OpenMP team per core instead of two teams fighting over
every core (the llama.cpp runner asks `share()` for its thread count the same way).
"""
from __future__ import annotations

import os
import sys
import threading
import time

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _machine_busy_seconds() -> float | None:
    """CPU seconds all cores spent busy since boot, or None where /proc/stat is missing."""
    try:
        with open("/proc/stat", "rb") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != b"cpu":
        return None
    ticks = [int(v) for v in fields[1:]]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)      # idle + iowait
    return (sum(ticks[:8]) - idle) / _CLK_TCK                    # guest time is in user already


def _pool_size() -> int:
    """numba's thread pool size (NUMBA_NUM_THREADS, else the CPUs this process may run on),
    read without importing numba where it is not loaded: the daemon's governor splits budgets
    for engine processes, and numba would add ~0.1 s to the daemon's start and ~65 MB to it."""
    numba = sys.modules.get("numba")
    if numba is not None:
        return numba.config.NUMBA_NUM_THREADS
    try:
        return max(1, int(os.environ["NUMBA_NUM_THREADS"]))
    except (KeyError, ValueError):
        pass
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:          # not on Linux
        return max(1, os.cpu_count() or 1)


def _own_seconds() -> float:
    t = os.times()
    return t.user + t.system


class ThreadGovernor:
    """The process's CPU budget, shared by every engine thread.

    `update()` (CPU kernels) and `share()` (other runners) return the calling thread's part of
    the free cores: the budget divided between the threads that called recently. A thread
    counts as stepping until it has been silent for `idle_after` seconds or three times the
    gap between its last two calls, whichever is longer, so a long prefill step is not taken
    for idleness. numba's thread count is per calling thread: update() sets it for the caller.
    """

    def __init__(self, max_threads: int | None = None, interval: float = 0.25,
                 idle_after: float = 1.0, fixed: int | None = None):
        # fixed: Settings.threads (EDGEINFER_THREADS), a set budget instead of a measured one
        self.fixed = fixed if fixed and fixed > 0 else None
        pool = _pool_size()
        self.max_threads = max(1, min(max_threads or pool, pool))
        self.interval = interval
        self.idle_after = idle_after
        self.threads = min(self.fixed or self.max_threads, self.max_threads)   # the budget
        self._last = None            # (wall, machine busy, own cpu)
        self.others = 0.0            # cores other programs kept busy, last window
        self._lock = threading.Lock()
        self._callers: dict[int, tuple[float, float]] = {}   # thread id -> (last call, gap)
        self._local = threading.local()                      # what numba was told, per thread

    def share(self) -> int:
        """The calling thread's thread count for its next step (at least one)."""
        now = time.monotonic()
        me = threading.get_ident()
        with self._lock:
            if self.fixed is None and (self._last is None or now - self._last[0] >= self.interval):
                self._measure(now)
            prev = self._callers.get(me)
            self._callers[me] = (now, now - prev[0] if prev else 0.0)
            active = sorted(t for t, (seen, gap) in self._callers.items()
                            if t == me or now - seen <= max(self.idle_after, 3 * gap))
            for t in [t for t, (seen, _) in self._callers.items() if now - seen > 60]:
                del self._callers[t]          # engines long gone
            base, extra = divmod(self.threads, len(active))
            return max(1, base + (1 if active.index(me) < extra else 0))

    def active_threads(self) -> int:
        """How many threads called within their idle window (for stats and tests)."""
        now = time.monotonic()
        with self._lock:
            return sum(1 for seen, gap in self._callers.values()
                       if now - seen <= max(self.idle_after, 3 * gap))

    def update(self) -> int:
        """Set numba's thread count for this thread; cheap when called every step."""
        n = self.share()
        if getattr(self._local, "applied", None) != n:
            import numba    # loaded by this thread's kernels anyway
            numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
            self._local.applied = n
        return n

    def _measure(self, now: float) -> None:
        busy = _machine_busy_seconds()
        own = _own_seconds()
        if busy is None:
            return
        if self._last is not None:
            wall = now - self._last[0]
            others = (busy - self._last[1]) - (own - self._last[2])
            self.others = max(0.0, others / wall) if wall > 0 else 0.0
            free = (os.cpu_count() or self.max_threads) - self.others
            # a core counts as free when others used under ~0.7 of it
            self.threads = max(1, min(self.max_threads, int(free + 0.3)))
        self._last = (now, busy, own)
