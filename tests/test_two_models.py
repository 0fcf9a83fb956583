"""Two models loaded and generating at once through the API (issue 12: one compute budget per
process). The daemon holds two names for the bundled GGUF, so it loads two engines; both
stream at the same time, both finish with the text each gives alone (greedy), and the
process's thread governor sees the two engines stepping together and splits the cores."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from daemon_fixture import register_gemma, start_daemon

MODELS = ("gemma3:270m", "gemma3-twin:270m")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, gemma3_path):
    from edgeinfer.store.model_store import Store
    home = tmp_path_factory.mktemp("two-models")
    register_gemma(home, gemma3_path)
    Store(home).register_file(gemma3_path, MODELS[1])
    d = start_daemon(home, EDGEINFER_MAX_MODEL_LEN="1024")
    try:
        yield d
    finally:
        d.stop()


def _body(model: str, stream: bool) -> dict:
    return {"model": model, "prompt": "Write a few sentences about rivers and the sea.",
            "stream": stream, "options": {"temperature": 0, "num_predict": 48}}


def _stream(d, model: str, out: dict) -> None:
    text, chunks = [], 0
    with httpx.stream("POST", d.url + "/api/generate", json=_body(model, True),
                      timeout=300) as r:
        out["status"] = r.status_code
        for line in r.iter_lines():
            if not line:
                continue
            obj = json.loads(line)
            if obj.get("error"):
                out["error"] = obj["error"]
            text.append(obj.get("response", ""))
            chunks += 1
            if obj.get("done"):
                out["eval_count"] = obj.get("eval_count")
    out["text"], out["chunks"] = "".join(text), chunks


def test_two_models_generate_at_once(daemon):
    d = daemon
    alone, alone_count = {}, {}
    for m in MODELS:                       # loads both; the text each gives alone
        r = d.post("/api/generate", _body(m, False))
        assert r.status_code == 200, r.text
        alone[m], alone_count[m] = r.json()["response"], r.json()["eval_count"]
        assert 0 < alone_count[m] <= 48
    assert sorted(x["name"] for x in d.stats()["models"]) == sorted(MODELS)

    results = {m: {} for m in MODELS}
    threads = [threading.Thread(target=_stream, args=(d, m, results[m])) for m in MODELS]
    both_running, stepping = 0, 0
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        s = d.stats()
        running = {x["name"]: x["running"] for x in s["models"]}
        if all(running.get(m, 0) > 0 for m in MODELS):
            both_running += 1
        stepping = max(stepping, s["compute"]["engines_stepping"])
        time.sleep(0.02)
    for t in threads:
        t.join()

    for m in MODELS:
        res = results[m]
        assert res["status"] == 200 and "error" not in res, res
        assert res["eval_count"] == alone_count[m], (res, alone_count[m])
        assert res["text"] == alone[m], (m, res["text"], alone[m])
    assert both_running > 0, "the two models never generated at the same time"
    # each engine (its own process) reported stepping while the other did too
    assert stepping == 2, d.stats()["compute"]
    s = d.stats()
    assert s["compute"]["cpu_threads"] >= 1
    assert all(x["active_requests"] == 0 for x in s["models"])
