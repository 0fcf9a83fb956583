"""Requests whose reader goes away early (issue 12): a client that leaves before the first
chunk of a stream, and a sink that fails inside the engine. Either way the request is aborted,
its KV blocks are freed, and the rest keeps being served."""
from __future__ import annotations

import json
import queue
import socket
import time

import httpx
import pytest

from daemon_fixture import shared_daemon, wait_idle  # noqa: F401  (module fixture)
from edgeinfer.engine.core import Engine, EngineConfig, greedy

MODEL = "gemma3:270m"
LONG = 900          # tokens a request would generate if nobody stopped it


def _aborts(d) -> int:
    for line in httpx.get(d.url + "/metrics").text.splitlines():
        if line.startswith(f'edgeinfer_request_finish_total{{model="{MODEL}",reason="abort"}}'):
            return int(float(line.split()[-1]))
    return 0


def _generated(d) -> int:
    models = d.stats()["models"]
    return models[0]["tokens_generated"] if models else 0


def _send_and_leave(d, path: str, body: dict, when: str) -> None:
    """POST a streaming request on a raw socket and close it without reading a byte."""
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", d.port))
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    if when == "during-load":                     # gone while the handler still loads
        time.sleep(0.05)
    if when == "once-admitted":
        deadline = time.monotonic() + 120         # guard, not a timing assertion
        while not d.stats()["models"][0]["running"]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    s.close()


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"model": MODEL, "stream": True, "max_tokens": LONG,
                              "temperature": 0, "ignore_eos": True, "stop_on_repetition": False,
                              "messages": [{"role": "user", "content": "Tell me a story."}]}),
    ("/api/generate", {"model": MODEL, "stream": True, "prompt": "Tell me a story.",
                       "options": {"temperature": 0, "num_predict": LONG,
                                   "stop_on_repetition": False}}),
], ids=["openai", "ollama"])
@pytest.mark.parametrize("when", ["during-load", "at-once", "once-admitted"])
def test_client_gone_before_first_chunk(shared_daemon, path, body, when):  # noqa: F811
    """The client closes while its model is still loading (the handler has not returned a
    response yet, so the response body never starts), right after sending, or once the
    engine runs the request; never having read a byte."""
    d = shared_daemon
    base = wait_idle(d)["kv_blocks_used"]
    aborts, generated = _aborts(d), _generated(d)
    if when == "during-load":
        r = d.post("/api/generate", {"model": MODEL, "keep_alive": 0})
        assert r.status_code == 200 and r.json()["done_reason"] == "unload", r.text
        deadline = time.monotonic() + 30
        while d.stats()["models"]:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        generated = 0                               # a fresh engine counts from zero
    _send_and_leave(d, path, body, when)
    if when == "during-load":
        deadline = time.monotonic() + 120           # guard: the load finishes without a client
        while not d.stats()["models"]:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    deadline = time.monotonic() + 120               # the server notices the client is gone
    while _aborts(d) == aborts and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _aborts(d) == aborts + 1
    idle = wait_idle(d, base)                       # the sequence is gone, its blocks freed
    assert idle["kv_blocks_used"] == base
    assert idle["tokens_generated"] - generated < LONG // 2     # stopped, not run to the end
    # ...and the daemon keeps serving
    r = d.post("/api/generate", {"model": MODEL, "prompt": "Hi", "stream": False,
                                 "options": {"temperature": 0, "num_predict": 4}})
    assert r.status_code == 200 and r.json()["done"], r.text
    assert wait_idle(d, base)["kv_blocks_used"] == base


# ----- a failing sink inside the engine ------------------------------------------------------

@pytest.fixture(scope="module")
def engine(gemma3_path):
    e = Engine(str(gemma3_path), EngineConfig(kv_budget_bytes=32 << 20, max_model_len=512)).start()
    try:
        yield e
    finally:
        e.close()


def _wait(cond, what: str, limit: float = 60.0) -> None:
    deadline = time.monotonic() + limit               # guard, not a timing assertion
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_failing_sink_aborts_only_its_request(engine):
    e = engine
    _wait(lambda: e.snapshot()["running"] == 0, "idle engine")
    base = e.snapshot()["kv_blocks_used"]
    calls = []

    def broken(out):
        calls.append(out)
        if len(calls) >= 3:
            raise RuntimeError("the client's queue is gone")

    good: queue.Queue = queue.Queue()
    prompt = e.encode_raw("The lighthouse keeper climbed the stairs")
    bad_id = e.submit(prompt, greedy(200, ignore_eos=True), broken)
    good_id = e.submit(e.encode_raw("Rivers run to the sea"), greedy(40, ignore_eos=True),
                       good.put)
    tokens, last = [], None
    while last is None or not last.finished:
        last = good.get(timeout=120)
        assert last.request_id == good_id
        tokens += last.token_ids
    # the healthy request is untouched by its neighbour's failure
    assert last.finish_reason == "length" and len(tokens) == 40
    _wait(lambda: e.snapshot()["running"] == 0 and e.snapshot()["waiting"] == 0,
          "the failed request left the scheduler")
    assert e.snapshot()["kv_blocks_used"] == base      # its blocks are free again
    assert all(c.request_id == bad_id for c in calls)
    produced = sum(len(c.token_ids) for c in calls)
    assert produced < 200, produced                    # aborted, not run to its length
    finals = [c for c in calls if c.finished]
    assert len(finals) <= 1 and all(c.finish_reason == "abort" for c in finals), finals
    # and the engine keeps serving
    again: queue.Queue = queue.Queue()
    e.submit(prompt, greedy(8), again.put)
    out = again.get(timeout=120)
    while not out.finished:
        out = again.get(timeout=120)
    assert out.finish_reason in ("length", "stop")
