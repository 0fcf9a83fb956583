"""A real daemon for tests: `python -m edgeinfer serve --port <free>` in a subprocess with a
temporary EDGEINFER_HOME where gemma3:270m is registered (hard link to the cached file).

`shared_daemon` is module-scoped: each test module that imports it gets a daemon on the
native (numba) backend for all its tests. `backend_daemon` is the same daemon parametrized
over the default backend (EDGEINFER_BACKEND): `cpu` reuses `shared_daemon`, `llamacpp` a
second one, so those tests run against both backends. Both come from the session's
`daemon_pool` (tests/conftest.py): one daemon per backend serves every module in turn, as a
start and model load costs seconds each. At the end of each module the pool puts the daemon
back as it found it (only gemma3:270m in the store, loaded on the daemon's backend, nothing
running) or, where it cannot, stops it so that the next module gets a fresh one.
`start_daemon()` starts extra ones with other settings (tests that change a daemon's
settings, kill its processes or need a store of their own take one of those).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import importlib.util

import httpx
import pytest

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Daemon:
    proc: subprocess.Popen
    port: int
    home: Path
    log: Path
    api_key: str | None = None
    env: dict = field(default_factory=dict)

    @property
    def backend(self) -> str:
        """The daemon's default backend (what models load on without a backend option)."""
        return self.env.get("EDGEINFER_BACKEND", "cpu")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def get(self, path: str, **kw) -> httpx.Response:
        return httpx.get(self.url + path, headers=self.headers(), timeout=120, **kw)

    def post(self, path: str, json=None, **kw) -> httpx.Response:
        return httpx.post(self.url + path, json=json, headers=self.headers(), timeout=120, **kw)

    def stats(self) -> dict:
        r = self.get("/api/stats")
        r.raise_for_status()
        return r.json()

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def process_gone(pid: int) -> bool:
    """The process has exited (a zombie its parent has not reaped yet counts)."""
    import psutil
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def register_gemma(home: Path, gemma3_path: Path) -> None:
    """A store holding gemma3:270m and nothing else: the marker says the bundled models were
    offered already, so listing it does not assemble the bundled chat model (491 MB) too
    (test_first_run checks that a fresh store lists them)."""
    from edgeinfer.store.bundled_listing import MARKER
    from edgeinfer.store.model_store import Store
    Store(home).register_file(gemma3_path, "gemma3:270m")
    (home / MARKER).touch()


def daemon_env(home: Path, **extra: str) -> dict:
    env = dict(os.environ)
    env.pop("EDGEINFER_API_KEY", None)
    env.pop("EDGEINFER_HOST", None)
    env.update(EDGEINFER_HOME=str(home),
               NUMBA_CACHE_DIR=os.environ.get("NUMBA_CACHE_DIR", str(REPO / ".cache" / "numba")),
               EDGEINFER_KV_BUDGET_MB="64",       # small pool: quick to allocate, plenty here
               PYTHONUNBUFFERED="1")
    # 2 shared cores: spinning OpenMP workers starve each other (10x slower steps here)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # no spare engine process (its start-up after every load is CPU the other tests want);
    # test_spare_engine and test_engine_process run daemons with it, as shipped
    env.setdefault("EDGEINFER_SPARE_RUNNER", "0")
    env.update(extra)
    return env


def start_daemon(home: Path, api_key: str | None = None, args: tuple[str, ...] = (),
                 wait: bool = True, **env_extra: str) -> Daemon:
    home.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log = home / "test-daemon.log"
    env = daemon_env(home, **env_extra)
    if api_key:
        env["EDGEINFER_API_KEY"] = api_key
    with open(log, "ab") as lf:
        proc = subprocess.Popen([sys.executable, "-m", "edgeinfer", "serve", "--port", str(port),
                                 *args], stdout=lf, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    d = Daemon(proc, port, home, log, api_key, env)
    if wait:
        wait_healthy(d)
    return d


def wait_healthy(d: Daemon, limit_s: float = 120) -> None:
    deadline = time.monotonic() + limit_s      # a start-up guard, not a timed assertion
    while time.monotonic() < deadline:
        if d.proc.poll() is not None:
            raise RuntimeError(f"daemon exited with {d.proc.returncode}:\n{d.log_text()}")
        try:
            if httpx.get(d.url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    d.stop()
    raise RuntimeError(f"daemon did not become healthy:\n{d.log_text()}")


def wait_idle(d, baseline_used: int = 0) -> dict:
    """Poll /api/stats until no sequence runs and KV use is back to the baseline (a guard
    against hanging, not a timing assertion)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        m = d.stats()["models"]
        if m and m[0]["running"] == 0 and m[0]["waiting"] == 0 and \
                m[0]["kv_blocks_used"] == baseline_used and m[0]["active_requests"] == 0:
            return m[0]
        time.sleep(0.1)
    raise AssertionError(f"the engine did not go idle: {d.stats()}")


def warm(d: Daemon) -> None:
    """Load the model and compile (or load from cache) every kernel once."""
    r = d.post("/api/generate", {"model": "gemma3:270m", "prompt": "Hi", "stream": False,
                                 "options": {"temperature": 0, "num_predict": 2}})
    assert r.status_code == 200, r.text


def _start_shared(tmp_path_factory, gemma3_path, **env_extra: str) -> Daemon:
    home = tmp_path_factory.mktemp("daemon-home")
    register_gemma(home, gemma3_path)
    d = start_daemon(home, EDGEINFER_MAX_QUEUE="4", EDGEINFER_MAX_MODEL_LEN="1024", **env_extra)
    try:
        warm(d)
    except BaseException:
        d.stop()
        raise
    return d


class DaemonPool:
    """One daemon per backend (started on first use, store: gemma3:270m only), lent to one
    module at a time and restored between modules."""

    MODEL = "gemma3:270m"

    def __init__(self, tmp_path_factory, gemma3_path):
        self._tmp = tmp_path_factory
        self._gemma3 = gemma3_path
        self._daemons: dict[str, Daemon] = {}

    def acquire(self, backend: str) -> Daemon:
        d = self._daemons.get(backend)
        if d is not None and not self._ready(d):
            d.stop()
            d = None
        if d is None:
            env = {} if backend == "cpu" else {"EDGEINFER_BACKEND": backend}
            d = self._daemons[backend] = _start_shared(self._tmp, self._gemma3, **env)
        return d

    def release(self, d: Daemon) -> None:
        """Put the daemon back as a fresh one is (see _ready), or stop it."""
        if not self._ready(d):
            d.stop()
            self._daemons = {k: v for k, v in self._daemons.items() if v is not d}

    def _loaded(self, d: Daemon) -> list[tuple[str, str]]:
        return [(m["name"], m["backend"]) for m in d.get("/api/ps").json()["models"]]

    def _ready(self, d: Daemon) -> bool:
        """Alive, idle, the store holding gemma3:270m only, which is loaded (once, on the
        daemon's own backend) and nothing else: unloads other models and loads it where
        needed. False where that cannot be had."""
        try:
            if d.proc.poll() is not None:
                return False
            deadline = time.monotonic() + 60
            while any(m["running"] or m["waiting"] or m["active_requests"]
                      for m in d.stats()["models"]) or \
                    any(m["state"] != "loaded" for m in d.get("/api/ps").json()["models"]):
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.1)
            if [m["name"] for m in d.get("/api/tags").json()["models"]] != [self.MODEL]:
                return False
            want = [(self.MODEL, d.backend)]
            if self._loaded(d) != want:
                for name in {n for n, _ in self._loaded(d)}:       # every copy of each
                    r = d.post("/api/generate", {"model": name, "keep_alive": 0})
                    if r.status_code != 200:
                        return False
                warm(d)
            return self._loaded(d) == want
        except (httpx.HTTPError, AssertionError, KeyError, ValueError):
            return False

    def close(self) -> None:
        for d in self._daemons.values():
            d.stop()
        self._daemons.clear()


@pytest.fixture(scope="module")
def shared_daemon(daemon_pool):
    d = daemon_pool.acquire("cpu")
    try:
        yield d
    finally:
        daemon_pool.release(d)


# The API tests that must hold on every backend take `backend_daemon` (issue 8: "the
# llama.cpp backend passes the same API tests as the native one").
API_BACKENDS = [
    "cpu",
    pytest.param("llamacpp", marks=pytest.mark.skipif(
        importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python not installed")),
]


@pytest.fixture(scope="module", params=API_BACKENDS)
def backend_daemon(request, daemon_pool):
    if request.param == "cpu":       # the native daemon the module's other tests use too
        yield request.getfixturevalue("shared_daemon")
        return
    d = daemon_pool.acquire(request.param)
    try:
        yield d
    finally:
        daemon_pool.release(d)
