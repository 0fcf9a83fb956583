"""Each loaded model's engine in its own process (edgeinfer.engine.remote), on a real daemon.

- Unload ends the engine process, and the daemon's RSS comes back to within 20 MB of its
  figure before the first load (the weights, KV pool and kernels never were in it).
- A runner killed with SIGKILL mid-stream: its OpenAI and Ollama streams end with an error in
  each API's shape, the other model keeps serving, and the next request loads it again.
"""
from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest

from daemon_fixture import process_gone, register_gemma, start_daemon

MB = 1 << 20
MODEL, OTHER = "gemma3:270m", "smollm2:135m"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, gemma3_path, smollm2_path):
    from edgeinfer.store.model_store import Store
    home = tmp_path_factory.mktemp("engine-process") / "home"
    register_gemma(home, gemma3_path)
    Store(home).register_file(smollm2_path, OTHER)
    d = start_daemon(home, EDGEINFER_SPARE_RUNNER="1")      # as shipped
    try:
        yield d
    finally:
        d.stop()


def _rss(pid: int) -> int:
    """The settled RSS: the smallest of a few readings."""
    proc = psutil.Process(pid)
    readings = []
    for _ in range(5):
        time.sleep(0.2)
        readings.append(proc.memory_info().rss)
    return min(readings)


def _loaded(d) -> dict[str, dict]:
    return {m["name"]: m for m in d.stats()["models"]}


def _wait_unloaded(d, name: str) -> None:
    deadline = time.monotonic() + 30            # a guard against hanging, not a timing
    while name in _loaded(d) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert name not in _loaded(d)


def _generate(d, model: str, **opts) -> dict:
    r = d.post("/api/generate", {"model": model, "prompt": "Tell me about the sea.",
                                 "stream": False,
                                 "options": {"temperature": 0, "num_predict": 16, **opts}})
    assert r.status_code == 200, r.text
    return r.json()


def test_unload_ends_the_engine_process_and_returns_the_daemons_memory(daemon):
    d = daemon
    assert _loaded(d) == {}
    first = _rss(d.proc.pid)
    ref = _generate(d, MODEL)["response"]
    figures = []
    for cycle in range(2):
        out = _generate(d, MODEL)
        assert out["response"] == ref           # the same greedy text from each new process
        m = _loaded(d)[MODEL]
        pid = m["engine_pid"]
        assert pid != d.proc.pid and psutil.Process(pid).ppid() == d.proc.pid
        engine_rss = _rss(pid)
        daemon_rss = _rss(d.proc.pid)
        r = d.post("/api/generate", {"model": MODEL, "keep_alive": 0})
        assert r.status_code == 200 and r.json()["done_reason"] == "unload", r.text
        _wait_unloaded(d, MODEL)
        deadline = time.monotonic() + 30
        while not process_gone(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert process_gone(pid), f"engine process {pid} outlived its unload"
        after = _rss(d.proc.pid)
        figures.append((engine_rss, daemon_rss, after))
        print(f"cycle {cycle}: engine process {engine_rss / MB:.0f} MB, daemon "
              f"{first / MB:.0f} MB before the first load, {daemon_rss / MB:.0f} MB loaded, "
              f"{after / MB:.0f} MB after unload ({(after - first) / MB:+.1f} MB)")
        # the model lives in the engine process: weights, KV pool and kernels
        assert engine_rss > 200 * MB, figures
        assert after - first < 20 * MB, figures
    assert "still referenced" not in d.log_text()


def _long_openai_stream(d, model: str, max_tokens: int = 1000):
    import openai
    oc = openai.OpenAI(base_url=d.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    return oc.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Count from one to a thousand."}],
        max_tokens=max_tokens, temperature=0, stream=True,
        extra_body={"ignore_eos": True, "stop_on_repetition": False})


def test_killed_runner_ends_its_streams_and_the_daemon_keeps_serving(daemon):
    import ollama
    import openai
    d = daemon
    _generate(d, MODEL)
    _generate(d, OTHER)
    victim = _loaded(d)[MODEL]["engine_pid"]
    bystander = _loaded(d)[OTHER]["engine_pid"]

    # a stream on the other model runs across the kill and finishes
    other: dict = {}

    def read_other():
        try:
            # long enough to run across the kill (a second or two in), not to a thousand
            chunks = list(_long_openai_stream(d, OTHER, 400))
            other["finish"] = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        except Exception as e:          # noqa: BLE001 - reported by the assertion below
            other["error"] = repr(e)
    reader = threading.Thread(target=read_other)
    reader.start()

    # OpenAI: an SSE error event, which the official client raises
    olc = ollama.Client(host=d.url, timeout=60)
    ollama_parts: list = []
    ollama_err: dict = {}

    def read_ollama():
        try:
            for part in olc.generate(model=MODEL, prompt="Count from one to a thousand.",
                                     stream=True, options={"num_predict": 1000, "temperature": 0,
                                                           "stop_on_repetition": False}):
                ollama_parts.append(part)
        except ollama.ResponseError as e:
            ollama_err["e"] = e
    stream = _long_openai_stream(d, MODEL)
    got = 0
    t = threading.Thread(target=read_ollama)
    with pytest.raises(openai.APIError) as err:
        for chunk in stream:
            got += 1
            if got == 3:
                t.start()
                deadline = time.monotonic() + 30
                while len(ollama_parts) < 2 and time.monotonic() < deadline:
                    time.sleep(0.02)
                crossing = reader.is_alive()      # the other stream runs across the kill
                os.kill(victim, signal.SIGKILL)
    assert got >= 3 and crossing
    assert "engine process" in str(err.value.message) and "died" in str(err.value.message)
    # Ollama: an NDJSON error line, which the official client raises
    t.join(60)
    assert not t.is_alive()
    assert len(ollama_parts) >= 2 and not any(p.done for p in ollama_parts), ollama_parts
    assert "died" in str(ollama_err.get("e")), (ollama_err, ollama_parts[-1:])

    reader.join(120)
    assert other.get("finish") == "length", other
    assert _loaded(d)[OTHER]["engine_pid"] == bystander     # untouched
    _wait_unloaded(d, MODEL)                                 # the dead copy left the set
    out = _generate(d, MODEL)                                # the next request reloads it
    assert out["done"] and out["eval_count"] > 0
    assert _loaded(d)[MODEL]["engine_pid"] not in (victim, bystander)
    assert "died" in d.log_text()


def test_a_load_that_fails_in_the_engine_process_leaves_nothing(daemon, tmp_path):
    """A model whose file broke after it was stored: the engine process reports the load's
    sentence and exits; nothing stays loaded, no process is left, the daemon serves on."""
    from synth import write_model

    from edgeinfer.store.model_store import Store
    src = write_model(tmp_path / "tiny.gguf", "llama")
    ref = Store(daemon.home).register_file(src, "tiny:broken")
    blob = ref.path
    size = blob.stat().st_size
    with open(blob, "r+b") as f:             # the tensor data runs past the end of the file now
        f.truncate(size // 2)
    children = {p.pid for p in psutil.Process(daemon.proc.pid).children()}
    r = daemon.post("/api/generate", {"model": "tiny:broken", "prompt": "Hi", "stream": False})
    assert r.status_code == 500, r.text
    msg = r.json()["error"]
    assert msg.startswith("cannot load tiny:broken") and "Traceback" not in msg, msg
    assert "tiny:broken" not in _loaded(daemon)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        # the next spare, which the daemon starts once idle a second, is not a leftover
        spare = daemon.stats()["process"]["spare_engine"]
        left = {p.pid for p in psutil.Process(daemon.proc.pid).children()
                if p.status() != psutil.STATUS_ZOMBIE       # multiprocessing's own helper:
                and "resource_tracker" not in " ".join(p.cmdline())} - children \
            - {spare["pid"] if spare else None}
        if not left:
            break
        time.sleep(0.1)
    assert not left, f"processes left after the failed load: {left}"
    assert _generate(daemon, MODEL)["done"]
