"""The Ollama API of a real daemon process, driven by the official `ollama` client, plus the
edgeinfer CLI client (`stream_generate`, `ps`, `stop`) against the same daemon.

Tests taking `ol_backend` / `backend_daemon` run against a daemon on each backend (the native
numba one and llama.cpp): generate and chat, streaming, options with stop strings,
num_predict and the length done reason, token counts, logprobs, bad requests, and a
disconnect freeing its sequence with the prefix reused. The rest run on the native daemon."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import ollama
import pytest

from daemon_fixture import backend_daemon, shared_daemon, wait_idle  # noqa: F401  (module fixtures)

MODEL = "gemma3:270m"
GREEDY = {"temperature": 0, "num_predict": 5}


@pytest.fixture(scope="module")
def ol(shared_daemon):  # noqa: F811
    return ollama.Client(host=shared_daemon.url, timeout=300)


@pytest.fixture(scope="module")
def ol_backend(backend_daemon):  # noqa: F811
    return ollama.Client(host=backend_daemon.url, timeout=300)


def test_generate_non_streaming(ol_backend):
    r = ol_backend.generate(model=MODEL, prompt="Why is the sky blue?", options=GREEDY)
    assert r.done and r.done_reason == "length"
    assert r.response
    assert r.eval_count == 5 and r.prompt_eval_count > 3
    for field in ("total_duration", "prompt_eval_duration", "eval_duration"):
        assert isinstance(getattr(r, field), int) and getattr(r, field) > 0
    assert r.load_duration is not None and r.total_duration >= r.eval_duration


def test_generate_streaming_matches(ol_backend):
    ol = ol_backend
    ref = ol.generate(model=MODEL, prompt="Why is the sky blue?", options=GREEDY).response
    parts = list(ol.generate(model=MODEL, prompt="Why is the sky blue?", options=GREEDY,
                             stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done
    assert "".join(p.response for p in parts) == ref
    assert parts[-1].eval_count == 5


def test_raw_generate_skips_template(ol):
    raw = ol.generate(model=MODEL, prompt="1, 2, 3, 4,", raw=True, options=GREEDY)
    templ = ol.generate(model=MODEL, prompt="1, 2, 3, 4,", options=GREEDY)
    assert raw.prompt_eval_count < templ.prompt_eval_count   # no turn markers
    assert raw.response


def test_chat(ol_backend):
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Name a color."}]
    r = ol_backend.chat(model=MODEL, messages=msgs, options=GREEDY)
    assert r.message.role == "assistant" and r.message.content
    parts = list(ol_backend.chat(model=MODEL, messages=msgs, options=GREEDY, stream=True))
    assert "".join(p.message.content for p in parts) == r.message.content
    assert parts[-1].done and parts[-1].eval_count == r.eval_count


def test_options_and_stop(ol_backend):
    ol = ol_backend
    ref = ol.generate(model=MODEL, prompt="Count: 1, 2, 3,", raw=True,
                      options={"temperature": 0, "num_predict": 8}).response
    stop = ref.strip().split()[1] if len(ref.split()) > 1 else ref[2:4]
    r = ol.generate(model=MODEL, prompt="Count: 1, 2, 3,", raw=True,
                    options={"temperature": 0, "num_predict": 8, "stop": [stop], "top_k": 10,
                             "top_p": 0.5, "min_p": 0.05, "repeat_penalty": 1.0, "seed": 3,
                             "num_ctx": 512})
    assert r.done_reason == "stop" and stop not in r.response
    assert ref.startswith(r.response)


def test_logprobs(ol_backend):
    r = ol_backend.generate(model=MODEL, prompt="Hello", options=GREEDY, logprobs=True,
                            top_logprobs=2)
    assert len(r.logprobs) == 5
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in r.logprobs)


def test_tags_show_ps_version(ol, shared_daemon):  # noqa: F811
    tags = ol.list()
    names = [m.model for m in tags.models]
    assert MODEL in names
    m = tags.models[names.index(MODEL)]
    assert m.details.family == "gemma3" and m.details.quantization_level == "Q4_K_M"
    assert m.size > 200_000_000 and len(m.digest) == 64
    show = ol.show(MODEL)
    assert show.details.family == "gemma3"
    assert show.modelinfo["general.architecture"] == "gemma3"
    assert show.modelinfo["gemma3.context_length"] == 32768
    assert "completion" in show.capabilities and show.template
    ol.generate(model=MODEL, prompt="x", options={"temperature": 0, "num_predict": 1})
    ps = ol.ps()
    assert [p.model for p in ps.models] == [MODEL]
    assert ps.models[0].size > m.size and ps.models[0].expires_at is not None
    assert ps.models[0].context_length == 1024
    raw = shared_daemon.get("/api/ps").json()["models"][0]      # edgeinfer's extra fields
    assert (raw["backend"], raw["device"], raw["size_vram"]) == ("cpu", "cpu", 0)
    # the numba runner's own words ("gguf (quantized)", or its repacked layout's name)
    fmt = raw["weights_format"]
    assert fmt and fmt != "unknown"
    rt = shared_daemon.post("/api/show", {"model": MODEL}).json()["runtime"]
    assert [(c["backend"], c["device"], c["weights_format"]) for c in rt["loaded"]] == \
        [("cpu", "cpu", fmt)]
    assert rt["loaded"][0]["weights"].startswith(fmt)
    # the daemon's default (EDGEINFER_BACKEND), predicted as the loaded copy really is
    assert (rt["default"]["backend"], rt["default"]["weights_format"]) == ("cpu", fmt)
    v = httpx.get(shared_daemon.url + "/api/version").json()
    assert v["version"]


def test_copy_and_delete(ol):
    assert ol.copy(MODEL, "mycopy:v1").status == "success"
    assert "mycopy:v1" in [m.model for m in ol.list().models]
    r = ol.generate(model="mycopy:v1", prompt="Hi", options={"temperature": 0, "num_predict": 1})
    assert r.done
    assert ol.delete("mycopy:v1").status == "success"
    assert "mycopy:v1" not in [m.model for m in ol.list().models]
    assert MODEL in [m.model for m in ol.list().models]         # the shared blob stays
    with pytest.raises(ollama.ResponseError) as e:
        ol.delete("mycopy:v1")
    assert e.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as e:
        ol.copy("no-such:model", "x:y")
    assert e.value.status_code == 404


def test_pull_bundled_streams_progress(ol):
    events = list(ol.pull(MODEL, stream=True))
    assert events[0].status == "pulling manifest"
    assert events[-1].status == "success"
    assert any(e.total and e.completed == e.total for e in events)
    with pytest.raises(ollama.ResponseError) as e:
        ol.pull("no-such-model:7b")
    assert e.value.status_code == 404


# ----- errors ----------------------------------------------------------------------------------

def test_unknown_model_404(ol):
    with pytest.raises(ollama.ResponseError) as e:
        ol.generate(model="nothere:1b", prompt="hi")
    assert e.value.status_code == 404 and "not found" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        ol.chat(model="nothere:1b", messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as e:
        ol.show("nothere:1b")
    assert e.value.status_code == 404


@pytest.mark.parametrize("body,word", [
    ({"options": {"temperature": -1}}, "temperature"),
    ({"options": {"top_p": 2}}, "top_p"),
    ({"options": {"top_k": "many"}}, "top_k"),
    ({"options": {"num_predict": 0}}, "num_predict"),
    ({"options": {"num_ctx": 2}}, "num_ctx"),
    ({"keep_alive": "soon"}, "keep_alive"),
    ({"images": ["aGVsbG8="]}, "images"),
    ({"options": {"backend": "abacus"}}, "backend"),
    ({"options": {"device": "gpu"}}, "device"),
    ({"options": {"backend": "llamacpp", "device": "cpu"}}, "device"),
    ({"options": {"backend": "torch:cpu", "device": "cuda"}}, "device"),
])
def test_bad_input_400(backend_daemon, body, word):  # noqa: F811
    r = backend_daemon.post("/api/generate", {"model": MODEL, "prompt": "hi", "stream": False,
                                              **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert isinstance(err, str) and word in err


def test_prompt_over_context_400_streaming(ol_backend, backend_daemon):  # noqa: F811
    with pytest.raises(ollama.ResponseError) as e:
        list(ol_backend.generate(model=MODEL, prompt="word " * 1100, raw=True, stream=True))
    assert e.value.status_code == 400 and "context" in e.value.error


def test_missing_model_and_bad_json_400(shared_daemon):  # noqa: F811
    r = shared_daemon.post("/api/chat", {"messages": []})
    assert r.status_code == 400 and "model" in r.json()["error"]
    r = httpx.post(shared_daemon.url + "/api/generate", content=b"{not json")
    assert r.status_code == 400 and "JSON" in r.json()["error"]


def test_unknown_route_404_in_shape(shared_daemon):  # noqa: F811
    r = shared_daemon.get("/api/nothing")
    assert r.status_code == 404 and isinstance(r.json()["error"], str)


# ----- the CLI client against the same daemon ---------------------------------------------------

def _cli_env(d) -> dict:
    env = dict(d.env)
    env["EDGEINFER_HOST"] = f"127.0.0.1:{d.port}"
    return env


def test_stream_generate_client(shared_daemon, monkeypatch):  # noqa: F811
    from edgeinfer.cli.client import GenerationStats, stream_generate
    monkeypatch.setenv("EDGEINFER_HOST", f"127.0.0.1:{shared_daemon.port}")
    monkeypatch.setenv("EDGEINFER_HOME", str(shared_daemon.home))
    items = list(stream_generate(MODEL, prompt="Why is the sky blue?", options=GREEDY))
    stats = items[-1]
    assert isinstance(stats, GenerationStats)
    assert stats.completion_tokens == 5 and stats.done_reason == "length"
    text = "".join(items[:-1])
    ref = ollama.Client(host=shared_daemon.url).generate(
        model=MODEL, prompt="Why is the sky blue?", options=GREEDY).response
    assert text == ref
    items = list(stream_generate(MODEL, messages=[{"role": "user", "content": "Hi"}],
                                 options={"temperature": 0, "num_predict": 2}))
    assert isinstance(items[-1], GenerationStats) and items[-1].completion_tokens == 2


def test_cli_ps_and_stop_and_keep_alive_zero(ol, shared_daemon):  # noqa: F811
    env = _cli_env(shared_daemon)
    ol.generate(model=MODEL, prompt="x", options={"temperature": 0, "num_predict": 1})
    out = subprocess.run([sys.executable, "-m", "edgeinfer", "ps"], env=env,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0].split()[:2] == ["NAME", "ID"]
    assert MODEL in out.stdout
    fmt = shared_daemon.get("/api/ps").json()["models"][0]["weights_format"]
    header = out.stdout.splitlines()[0]
    assert "BACKEND" in header and "WEIGHTS" in header and fmt in out.stdout
    out = subprocess.run([sys.executable, "-m", "edgeinfer", "show", MODEL], env=env,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "backend           cpu (loaded in the daemon)" in out.stdout
    assert f"weights           {fmt}" in out.stdout
    out = subprocess.run([sys.executable, "-m", "edgeinfer", "stop", MODEL], env=env,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert ol.ps().models == []
    # keep_alive 0 on a generation: the model is unloaded once the answer is done
    r = ol.generate(model=MODEL, prompt="x", options={"temperature": 0, "num_predict": 1},
                    keep_alive=0)
    assert r.done
    deadline = time.monotonic() + 60
    while ol.ps().models:
        assert time.monotonic() < deadline, ol.ps()
        time.sleep(0.1)
    # an empty prompt loads, keep_alive 0 with an empty prompt unloads at once
    r = ol.generate(model=MODEL, keep_alive="1m")
    assert r.done_reason == "load" and [m.model for m in ol.ps().models] == [MODEL]
    r = ol.generate(model=MODEL, keep_alive=0)
    assert r.done_reason == "unload" and ol.ps().models == []


def test_stats_stream(shared_daemon):  # noqa: F811
    with httpx.stream("GET", shared_daemon.url + "/api/stats/stream?interval=0.1",
                      timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        snaps = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                snaps.append(json.loads(line[6:]))
                if len(snaps) == 3:
                    break
    for s in snaps:
        for key in ("tokens_per_s", "models", "process", "system", "queue_depth", "totals"):
            assert key in s
        assert s["process"]["rss_bytes"] > 0 and s["system"]["memory_total_bytes"] > 0
    assert snaps[0]["time"] < snaps[2]["time"]
    r = httpx.get(shared_daemon.url + "/api/stats/stream?interval=0")
    assert r.status_code == 400


def test_metrics_text(shared_daemon):  # noqa: F811
    shared_daemon.post("/api/generate", {"model": MODEL, "prompt": "hi", "stream": False,
                                         "options": {"temperature": 0, "num_predict": 2}})
    text = shared_daemon.get("/metrics").text
    for name in ("edgeinfer_requests_total", "edgeinfer_prompt_tokens_total",
                 "edgeinfer_generation_tokens_total", "edgeinfer_time_to_first_token_seconds_bucket",
                 "edgeinfer_time_per_output_token_seconds_count", "edgeinfer_queue_depth",
                 "edgeinfer_running_sequences", "edgeinfer_kv_blocks_used",
                 "edgeinfer_kv_blocks_total", "edgeinfer_prefix_cache_hit_rate",
                 "edgeinfer_model_memory_bytes"):
        assert name in text, name
    total = [l for l in text.splitlines() if l.startswith("edgeinfer_kv_blocks_total{")]
    assert total and float(total[0].split()[-1]) > 0


def test_ndjson_disconnect_frees_the_sequence_and_prefix_is_reused(
        ol_backend, backend_daemon):  # noqa: F811
    d = backend_daemon
    body = {"model": MODEL, "prompt": "Tell me a long story about a lighthouse keeper.",
            "options": {"temperature": 0, "num_predict": 500}}
    ref = ol_backend.generate(model=MODEL, prompt=body["prompt"], options=GREEDY)
    base = wait_idle(d)["kv_blocks_used"]
    with httpx.stream("POST", d.url + "/api/generate", json=body, timeout=120) as r:
        lines = r.iter_lines()
        first = json.loads(next(lines))
        assert first["done"] is False
    wait_idle(d, base)
    again = d.post("/api/generate", {**body, "options": GREEDY, "stream": False}).json()
    assert again["response"] == ref.response
    # the same prompt again: its full blocks come from the prefix cache
    assert again["prompt_cached_count"] > 0


def test_backend_option_through_the_daemon(ol, shared_daemon):  # noqa: F811
    """`run --backend llamacpp` keeps its meaning through the daemon: a second engine of the
    same model on that backend, listed separately in ps."""
    r = ol.generate(model=MODEL, prompt="1, 2, 3,", raw=True,
                    options={"temperature": 0, "num_predict": 3, "backend": "llamacpp"})
    assert r.done and r.eval_count == 3 and r.response
    ps = {m["backend"]: m for m in shared_daemon.get("/api/ps").json()["models"]}
    assert ps["llamacpp"]["weights_format"] == "gguf (llama.cpp)"
    show = shared_daemon.post("/api/show", {"model": MODEL}).json()["runtime"]
    assert "llamacpp" in {c["backend"] for c in show["loaded"]}
    ol.generate(model=MODEL, keep_alive=0)        # unloads every copy of the model
    assert ol.ps().models == []


def test_device_option_through_the_daemon(ol, shared_daemon):  # noqa: F811
    """options.device alone: auto places the model on that device; cpu is the native engine,
    the same one a request without options gets (one copy, not two)."""
    r = ol.generate(model=MODEL, prompt="1, 2, 3,", raw=True,
                    options={"temperature": 0, "num_predict": 2, "device": "cpu"})
    assert r.done and r.eval_count == 2
    ol.generate(model=MODEL, prompt="1, 2, 3,", raw=True, options=GREEDY)
    ps = shared_daemon.get("/api/ps").json()["models"]
    assert [(m["backend"], m["device"]) for m in ps] == [("cpu", "cpu")]
    from edgeinfer.runners.choice import device_missing
    if device_missing("cuda") is not None:
        with pytest.raises(ollama.ResponseError) as e:
            ol.generate(model=MODEL, prompt="hi", options={"device": "cuda"})
        assert e.value.status_code == 400 and "'cuda' is not available" in e.value.error


def test_show_reads_a_file_once_and_again_when_it_changes(tmp_path):
    """/api/show's file facts are kept per file (path, size, mtime): a second show parses
    nothing, a file replaced under the same path is read again."""
    from types import SimpleNamespace

    from synth import write_model

    from edgeinfer.server import ollama_api
    path = write_model(tmp_path / "m.gguf", "llama", chat_template="{{ messages }}")
    ref = SimpleNamespace(path=path, full_name="m:latest")
    first = ollama_api._file_facts(ref)
    assert ollama_api._file_facts(ref) is first
    assert first[1]["tokenizer.chat_template"] == "{{ messages }}"
    write_model(path, "qwen2")      # replaced: another mtime (and here another size)
    again = ollama_api._file_facts(ref)
    assert again is not first and "tokenizer.chat_template" not in again[1]
    assert again[2]["general.architecture"] == "qwen2"
