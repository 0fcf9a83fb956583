"""Daemon lifecycle and access: serve refuses public addresses without a key, the key is
enforced, `daemon start|status|logs|stop`, client autostart, pull through the daemon, a load
that does not fit in memory is refused with the numbers, the OpenAPI document is current.
None of these generate text, so no test here waits for the model's kernels."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import ollama
import openai
import pytest

from daemon_fixture import REPO, daemon_env, free_port, register_gemma, start_daemon

KEY = "s3cret-test-key"


def _cli(env: dict, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgeinfer", *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def keyed(tmp_path_factory, gemma3_path):
    """A daemon with an API key and a KV budget no machine has (loads must be refused)."""
    home = tmp_path_factory.mktemp("keyed-home")
    register_gemma(home, gemma3_path)
    d = start_daemon(home, api_key=KEY, EDGEINFER_KV_BUDGET_MB=str(64 << 20),  # 64 TiB
                     EDGEINFER_MEMORY_BUDGET_MB=str(128 << 20))    # past the budget check
    yield d
    d.stop()


def test_non_loopback_without_key_is_refused(tmp_path):
    env = daemon_env(tmp_path / "home")
    out = _cli(env, "serve", "--host", "0.0.0.0", "--port", str(free_port()))
    assert out.returncode == 1
    assert "API key" in out.stderr and "0.0.0.0" in out.stderr
    env["EDGEINFER_HOST"] = f"0.0.0.0:{free_port()}"
    out = _cli(env, "daemon", "start")
    assert out.returncode == 1 and "API key" in out.stderr


def test_port_in_use_is_one_sentence(keyed, tmp_path):
    out = _cli(daemon_env(tmp_path / "home"), "serve", "--port", str(keyed.port))
    assert out.returncode == 1
    assert "cannot listen" in out.stderr and "Traceback" not in out.stderr


def test_api_key_enforced(keyed):
    url = keyed.url
    assert httpx.get(url + "/health").status_code == 200          # liveness stays open
    r = httpx.get(url + "/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(url + "/api/tags", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and isinstance(r.json()["error"], str)
    with openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0) as c:
        with pytest.raises(openai.AuthenticationError):
            c.models.list()
    with openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0) as c:
        assert [m.id for m in c.models.list()] == ["gemma3:270m"]
    with pytest.raises(ollama.ResponseError) as e:
        ollama.Client(host=url).list()
    assert e.value.status_code == 401
    ok = ollama.Client(host=url, headers={"Authorization": f"Bearer {KEY}"})
    assert [m.model for m in ok.list().models] == ["gemma3:270m"]


def test_load_that_does_not_fit_is_refused_with_numbers(keyed):
    r = keyed.post("/api/generate", {"model": "gemma3:270m", "prompt": "hi", "stream": False})
    assert r.status_code == 503, r.text
    msg = r.json()["error"]
    assert "needs" in msg and "KV cache" in msg and "of memory is free" in msg
    assert "65536." in msg                                          # the KV budget, in GiB
    r = keyed.post("/v1/chat/completions", {"model": "gemma3:270m",
                                            "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 503 and r.json()["error"]["code"] == "insufficient_memory"
    assert keyed.get("/api/ps").json() == {"models": []}
    assert keyed.get("/health").status_code == 200                 # still serving


def test_daemon_start_status_logs_stop(tmp_path, gemma3_path):
    home = tmp_path / "home"
    register_gemma(home, gemma3_path)
    env = daemon_env(home, EDGEINFER_HOST=f"127.0.0.1:{free_port()}")
    out = _cli(env, "daemon", "start")
    try:
        assert out.returncode == 0, out.stderr
        assert "started" in out.stdout
        pid_file = home / "state" / "daemon.json"
        info = json.loads(pid_file.read_text())
        assert info["port"] == int(env["EDGEINFER_HOST"].split(":")[1])
        out = _cli(env, "daemon", "start")                        # idempotent
        assert out.returncode == 0 and "already running" in out.stdout
        out = _cli(env, "daemon", "status")
        assert out.returncode == 0 and f"pid {info['pid']}" in out.stdout
        assert "no models loaded" in out.stdout
        out = _cli(env, "ps")
        assert out.returncode == 0 and out.stdout.startswith("NAME")
        out = _cli(env, "daemon", "logs", "-n", "20")
        assert "listening on" in out.stdout
    finally:
        out = _cli(env, "daemon", "stop")
    assert out.returncode == 0 and "stopped" in out.stdout
    assert not (home / "state" / "daemon.json").exists()
    import psutil
    assert not psutil.pid_exists(info["pid"]) or \
        psutil.Process(info["pid"]).status() == psutil.STATUS_ZOMBIE
    out = _cli(env, "daemon", "status")
    assert out.returncode == 1 and "not running" in out.stdout
    out = _cli(env, "ps")
    assert out.returncode == 1 and "no edgeinfer daemon" in out.stderr


def test_client_autostarts_daemon_and_pulls_through_it(tmp_path, gemma3_path, monkeypatch):
    from edgeinfer.cli import client
    from edgeinfer.server import daemon
    home = tmp_path / "home"
    register_gemma(home, gemma3_path)
    for k, v in daemon_env(home, EDGEINFER_HOST=f"127.0.0.1:{free_port()}").items():
        monkeypatch.setenv(k, v)
    assert client.daemon_pull("gemma3:270m", None, None, lambda ev: None) is False  # none yet
    try:
        with client.connect() as c:                     # starts one, same home and address
            assert c.health()["status"] == "ok"
            info = daemon.read_pid_file()
            assert info is not None and info.url == c.base_url
            events = []
            assert client.daemon_pull("gemma3:270m", "again:v2", None, events.append) is True
            assert events[-1].status == "success"
            tags = c.request("GET", "/api/tags")["models"]
            assert {"gemma3:270m", "again:v2"} <= {m["name"] for m in tags}
            from edgeinfer.store.model_store import StoreError
            with pytest.raises(StoreError, match="unknown model"):
                client.daemon_pull("not-a-model:1b", None, None, events.append)
    finally:
        assert daemon.stop_background() is not None


def test_an_autostarted_daemon_warms_the_model_asked_for(tmp_path, gemma3_path, monkeypatch):
    """`edgeinfer run MODEL` that starts the daemon: the daemon's first spare engine process
    (started before the server's own imports) warms MODEL, not the bundled default (which
    this store lacks: no hint at all without --warm)."""
    import psutil

    from edgeinfer.cli import client
    from edgeinfer.server import daemon
    from edgeinfer.store.model_store import Store
    home = tmp_path / "home"
    register_gemma(home, gemma3_path)
    for k, v in daemon_env(home, EDGEINFER_HOST=f"127.0.0.1:{free_port()}",
                           EDGEINFER_SPARE_RUNNER="1").items():
        monkeypatch.setenv(k, v)
    try:
        with client.connect(warm="gemma3:270m") as c:
            spare = c.request("GET", "/api/stats")["process"]["spare_engine"]
            assert spare is not None, "no spare engine process right after the start"
            assert spare["warming"] == str(Store(home).resolve("gemma3:270m").path)
            info = daemon.read_pid_file()
            assert "--warm" in psutil.Process(info.pid).cmdline()
    finally:
        assert daemon.stop_background() is not None


def test_openapi_document_is_current():
    from edgeinfer.server.openapi import build
    doc = json.loads((REPO / "docs" / "openapi.json").read_text())
    assert doc == build(), "run: python -m edgeinfer.server.openapi docs/openapi.json"
    paths = set(doc["paths"])
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/api/generate",
            "/api/chat", "/api/tags", "/api/ps", "/api/show", "/api/pull", "/api/delete",
            "/api/copy", "/api/version"} <= paths


# ----- the model manager in-process (loads only; no text is generated) -------------------------

@pytest.mark.parametrize("value,seconds", [
    (None, 300.0), ("", 300.0), (0, 0.0), ("0", 0.0), (30, 30.0), ("30s", 30.0), ("5m", 300.0),
    ("1h30m", 5400.0), ("250ms", 0.25), (-1, float("inf")), ("-1m", float("inf")),
])
def test_parse_keep_alive(value, seconds):
    from edgeinfer.server.model_manager import parse_keep_alive
    assert parse_keep_alive(value, 300.0) == seconds


@pytest.mark.parametrize("value", ["soon", "5 minutes", "1x", True])
def test_parse_keep_alive_rejects(value):
    from edgeinfer.server.errors import APIError
    from edgeinfer.server.model_manager import parse_keep_alive
    with pytest.raises(APIError) as e:
        parse_keep_alive(value, 300.0)
    assert e.value.status == 400 and e.value.param == "keep_alive"


@pytest.mark.asyncio
async def test_manager_lru_budget_and_keep_alive(tmp_path, gemma3_path):
    from edgeinfer.server.errors import APIError
    from edgeinfer.server.model_manager import ModelManager, ServerConfig
    from edgeinfer.store.model_store import Store
    home = tmp_path / "home"
    register_gemma(home, gemma3_path)
    store = Store(home)
    store.copy("gemma3:270m", "second:v1")
    kv = 16 << 20
    one = store.resolve("gemma3:270m").size + kv
    # room for one model, not two: loading the second unloads the idle first (LRU)
    mm = ModelManager(ServerConfig(kv_budget_bytes=kv, memory_budget_bytes=one + (one >> 1)),
                      store)
    mm.start()
    try:
        a, load_a = await mm.acquire("gemma3:270m")
        assert load_a > 0 and a.active == 1 and a.size >= one - kv
        again, load_again = await mm.acquire("gemma3:270m")
        assert again is a and load_again == 0 and a.active == 2
        mm.release(a)
        # the first is still busy: the second cannot be loaded, and says why
        with pytest.raises(APIError) as e:
            await mm.acquire("second:v1")
        assert e.value.status == 503 and "busy" in e.value.message
        mm.release(a)
        b, _ = await mm.acquire("second:v1")
        assert [lm.name for lm in mm.models.values()] == ["second:v1"]
        # keep_alive 0: unloaded as soon as its last request ends
        b.keep_alive = 0
        mm.release(b)
        await mm.reap()
        assert mm.models == {}
        with pytest.raises(APIError) as e:
            await mm.acquire("missing:v1")
        assert e.value.status == 404
    finally:
        await mm.close()


def test_run_asks_the_daemon_to_load_the_model_before_its_first_request(tmp_path, gemma3_path,
                                                                        monkeypatch):
    """`edgeinfer run MODEL` through the daemon loads MODEL as soon as it connects (Ollama's
    empty /api/generate, as `ollama run` does), with the run's placement: the load overlaps
    /api/show and the user's typing. No generation request is made here."""
    from edgeinfer.cli.run import DaemonSession
    from edgeinfer.runners.sampling_params import SamplingParams
    home = tmp_path / "home"
    register_gemma(home, gemma3_path)
    d = start_daemon(home)
    try:
        monkeypatch.setenv("EDGEINFER_HOST", f"127.0.0.1:{d.port}")
        from edgeinfer.settings import Settings, install
        install(Settings.from_env())
        session = DaemonSession("gemma3:270m", "auto", None, SamplingParams(),
                                kv_cache_type="q8_0")
        deadline = time.monotonic() + 120      # a guard for the load, not a timed assertion
        models: list = []
        while time.monotonic() < deadline and not models:
            models = [m for m in d.get("/api/ps").json()["models"] if m["state"] == "loaded"]
            time.sleep(0.1)
        assert [m["name"] for m in models] == ["gemma3:270m"], d.log_text()[-2000:]
        assert models[0]["kv_cache_type"] == "q8_0"      # the run's placement came with it
        session.close()
    finally:
        d.stop()
