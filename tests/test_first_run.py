"""The first run: the bundled base model gives a bounded answer (an output cap, DRY, a stop on
degenerate repetition reported as done_reason "repetition"), llama.cpp's samplers are
accepted under their names in both APIs, and a fresh store lists the bundled model
everywhere models are listed. Real daemons (tests/daemon_fixture.py)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import httpx
import numpy as np
import openai
import pytest

from daemon_fixture import REPO, shared_daemon, start_daemon  # noqa: F401
from edgeinfer.engine.repetition import RepetitionGuard, repeats
from edgeinfer.runners.sampling_params import BASE_MAX_TOKENS

MODEL = "gemma3:270m"


# ----- the repetition guard ---------------------------------------------------------------

def test_guard_fires_on_a_paragraph_written_twice():
    rng = np.random.default_rng(0)
    para = rng.integers(0, 1000, 120).tolist()
    g = RepetitionGuard()
    assert not any(g.feed([t]) for t in rng.integers(0, 1000, 50).tolist() + para)
    fired = [g.feed([t]) for t in para + para[:4]]
    # only once the second copy is complete (checked every 4 tokens)
    assert not any(fired[:119]) and fired[-1]
    assert g.period == 120


def test_guard_short_loops_need_min_run_and_normal_text_passes():
    assert repeats([7] * 49) == 1 and repeats([7] * 40) == 0
    phrase = [1, 2, 3, 4, 5, 6]
    assert repeats(phrase * 9) == 6               # 54 tokens: 48 repeated after the first
    assert repeats(phrase * 5) == 0
    rng = np.random.default_rng(1)
    assert repeats(rng.integers(0, 50, 2000).tolist()) == 0
    g = RepetitionGuard(every=4)
    for t in rng.integers(0, 50, 3000).tolist():  # long output: the window slides
        assert not g.feed([t])


# ----- through the daemon -----------------------------------------------------------------

def gen(d, prompt, **options):
    r = d.post("/api/generate", {"model": MODEL, "prompt": prompt, "raw": True,
                                 "stream": False, "options": options})
    assert r.status_code == 200, r.text
    return r.json()


LOOP = "1 2 3 4 5 6 7 8 9 10\n" * 6 + "1 2 3"


def test_base_model_stops_on_repetition_with_its_own_done_reason(shared_daemon):  # noqa: F811
    # greedy, DRY off: the base model continues the counting loop verbatim
    r = gen(shared_daemon, LOOP, temperature=0, dry_multiplier=0)
    assert r["done_reason"] == "repetition"
    assert r["eval_count"] < BASE_MAX_TOKENS
    off = gen(shared_daemon, LOOP, temperature=0, dry_multiplier=0, stop_on_repetition=False,
              num_predict=120)
    assert off["done_reason"] == "length" and off["eval_count"] == 120
    assert off["response"].startswith(r["response"][:20])


def test_base_model_output_cap_and_dry_default(shared_daemon):  # noqa: F811
    r = gen(shared_daemon, LOOP, temperature=0, stop_on_repetition=False)
    assert r["eval_count"] <= BASE_MAX_TOKENS
    # DRY on by default when sampling (greedy keeps the model's argmax): the loop is
    # broken, unlike with dry_multiplier 0 (near-greedy: temperature 0.05, one seed)
    near = dict(temperature=0.05, seed=1, stop_on_repetition=False, num_predict=60)
    plain = gen(shared_daemon, LOOP, dry_multiplier=0, **near)
    dry = gen(shared_daemon, LOOP, **near)
    greedy = gen(shared_daemon, LOOP, temperature=0, stop_on_repetition=False, num_predict=60)
    assert greedy["response"] == gen(shared_daemon, LOOP, temperature=0, dry_multiplier=0,
                                     stop_on_repetition=False, num_predict=60)["response"]
    assert plain["response"] != dry["response"]
    line = "1 2 3 4 5 6 7 8 9 10"
    assert line in plain["response"] and line not in dry["response"]
    # (DRY's default breakers include "\n": it cannot see a loop of short lines; the
    # repetition stop is what ends those)
    explicit = gen(shared_daemon, "Once upon a time", temperature=0, num_predict=300,
                   stop_on_repetition=False, dry_multiplier=0.8)
    assert explicit["eval_count"] > BASE_MAX_TOKENS or explicit["done_reason"] == "stop"


@pytest.mark.parametrize("opts", [{"mirostat": 2, "mirostat_tau": 3.0, "mirostat_eta": 0.2},
                                  {"mirostat": 1}, {"typical_p": 0.5},
                                  {"xtc_probability": 0.5, "xtc_threshold": 0.1},
                                  {"dry_multiplier": 1.0, "dry_base": 2.0,
                                   "dry_allowed_length": 3, "dry_penalty_last_n": 64,
                                   "dry_sequence_breakers": ["\n", "."]},
                                  {"repeat_last_n": 16, "repeat_penalty": 1.3}])
def test_llamacpp_samplers_in_both_apis(shared_daemon, opts):  # noqa: F811
    r = gen(shared_daemon, "The weather today is", num_predict=8, seed=3, **opts)
    assert r["eval_count"] == 8
    again = gen(shared_daemon, "The weather today is", num_predict=8, seed=3, **opts)
    assert again["response"] == r["response"]            # seeded: reproducible
    with openai.OpenAI(base_url=shared_daemon.url + "/v1", api_key="x", max_retries=0,
                       timeout=300) as oa:
        c = oa.completions.create(model=MODEL, prompt="The weather today is", max_tokens=8,
                                  seed=3, extra_body=opts)
        assert c.usage.completion_tokens == 8


@pytest.mark.parametrize("opts,field", [({"mirostat": 3}, "mirostat"),
                                        ({"typical_p": 2}, "typical_p"),
                                        ({"dry_multiplier": -1}, "dry_multiplier"),
                                        ({"dry_sequence_breakers": [""]},
                                         "dry_sequence_breakers"),
                                        ({"xtc_threshold": 5}, "xtc_threshold")])
def test_bad_sampler_values_are_400(shared_daemon, opts, field):  # noqa: F811
    r = shared_daemon.post("/api/generate", {"model": MODEL, "prompt": "x", "stream": False,
                                             "options": opts})
    assert r.status_code == 400 and field in r.json()["error"]
    r = shared_daemon.post("/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], **opts})
    assert r.status_code == 400 and r.json()["error"]["param"] == field


# ----- a fresh store lists the bundled model ------------------------------------------------

def test_fresh_store_lists_the_bundled_models(tmp_path):
    from edgeinfer.store.bundled import BUNDLED
    bundled = sorted(n for n, b in BUNDLED.items() if b.available())
    if MODEL not in bundled:
        pytest.skip("the bundled model packages are not installed")
    home = tmp_path / "fresh"
    d = start_daemon(home)
    try:
        tags = httpx.get(d.url + "/api/tags", timeout=300).json()["models"]
        assert sorted(m["name"] for m in tags) == bundled
        models = httpx.get(d.url + "/v1/models", timeout=60).json()["data"]
        assert sorted(m["id"] for m in models) == bundled
        env = {**os.environ, "EDGEINFER_HOME": str(home)}
        out = subprocess.run([sys.executable, "-m", "edgeinfer", "list"], env=env, cwd=REPO,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0 and all(n in out.stdout for n in bundled)
        # removed by the user: it stays removed
        assert httpx.request("DELETE", d.url + "/api/delete", json={"model": MODEL},
                             timeout=60).status_code == 200
        assert sorted(m["name"] for m in httpx.get(d.url + "/api/tags", timeout=60)
                      .json()["models"]) == [n for n in bundled if n != MODEL]
        show = httpx.post(d.url + "/api/show", json={"model": MODEL}, timeout=300).json()
        assert show["base_model"] is True             # resolving by name brings it back
    finally:
        d.stop()
