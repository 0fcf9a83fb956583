"""Nothing heavy on the event loop (issue 12): while one client streams, another posts a
~100 KB prompt; rendering and tokenizing it (over a second of tokenizer work for this text)
runs on a worker thread, so the first stream's chunks keep coming."""
from __future__ import annotations

import json
import random
import threading
import time

import httpx

from daemon_fixture import shared_daemon  # noqa: F401  (module fixture)

MAX_GAP_S = 1.0


def _big_prompt() -> str:
    # one long "word" of random letters: the tokenizer's slowest kind of input (BPE merges
    # over a single pre-token), ~100 KB, far longer than the daemon's context
    rnd = random.Random(7)
    return "".join(rnd.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(100_000))


def test_big_prompt_does_not_stall_other_streams(shared_daemon):  # noqa: F811
    d = shared_daemon
    chunk_times: list[float] = []
    state = {}

    def stream() -> None:
        # long enough to outlast the big request's rendering on a loaded machine (400 tokens
        # did not always: the test was then inconclusive)
        body = {"model": "gemma3:270m", "stream": True, "max_tokens": 1200, "temperature": 0,
                "ignore_eos": True, "stop_on_repetition": False,
                "prompt": "Here is a long story about a lighthouse keeper and the sea. Chapter 1."}
        with httpx.stream("POST", d.url + "/v1/completions", json=body, timeout=300) as r:
            state["status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk_times.append(time.monotonic())
                    obj = json.loads(line[6:])
                    if obj["choices"] and obj["choices"][0].get("finish_reason"):
                        state["finish"] = obj["choices"][0]["finish_reason"]

    t = threading.Thread(target=stream)
    t.start()
    deadline = time.monotonic() + 120         # guard, not a timing assertion
    while len(chunk_times) < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(chunk_times) >= 5, state

    big = _big_prompt()
    t0 = time.monotonic()
    r = httpx.post(d.url + "/v1/chat/completions", timeout=120,
                   json={"model": "gemma3:270m", "max_tokens": 4,
                         "messages": [{"role": "user", "content": big}]})
    t1 = time.monotonic()
    t.join()

    # the big prompt was rendered and tokenized (the engine then refuses it: too long)
    assert r.status_code == 400, r.text
    assert "tokens" in r.json()["error"]["message"], r.text
    assert state.get("status") == 200 and state.get("finish") == "length", state
    assert chunk_times[-1] > t1, "the stream ended before the big request did: inconclusive"
    window = [x for x in chunk_times if t0 - MAX_GAP_S <= x <= t1 + MAX_GAP_S]
    gaps = [b - a for a, b in zip(window, window[1:])]
    print(f"big request took {t1 - t0:.2f}s; stream chunks in that window: {len(window)}, "
          f"largest gap {max(gaps):.3f}s")
    assert max(gaps) < MAX_GAP_S, (t1 - t0, sorted(gaps)[-5:])
