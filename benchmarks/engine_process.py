"""Streaming through the API with the engine in its own process vs in the daemon's process.

    .venv/bin/python benchmarks/engine_process.py [--model PATH] [--tokens 128] [--rounds 3]

Two real daemons on loopback ports with the same model: one with engine processes (the
default), one with EDGEINFER_ENGINE_PROCESS=0. Each round streams one greedy chat request
(the official openai client) to each in turn, then the same prompt through llama.cpp
(llama-cpp-python, streamed) for reference, and reads TTFT (request to first content chunk)
and decode tokens/s (chunks after the first over the time they took). A daemon idles while
the others run. Also: each daemon's RSS with the model loaded and after unloading it, and
the first request's load time. Medians of the rounds with their range; the goal is decode
within 3% and TTFT within 10 ms of in-process.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from common import REPO, setup_env, table  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper and a storm."


def _stream(client, model: str, tokens: int) -> tuple[float, float, int]:
    """(TTFT s, decode tok/s, chunks) of one streamed greedy chat request."""
    t0 = time.perf_counter()
    first = last = None
    n = 0
    for ev in client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=tokens,
            temperature=0, stream=True, extra_body={"ignore_eos": True,
                                                    "stop_on_repetition": False}):
        if ev.choices and ev.choices[0].delta.content:
            last = time.perf_counter()
            if first is None:
                first = last
            n += 1
    return first - t0, (n - 1) / (last - first), n


def _llama_stream(llm, tokens: int) -> tuple[float, float, int]:
    t0 = time.perf_counter()
    first = last = None
    n = 0
    for ev in llm.create_chat_completion([{"role": "user", "content": PROMPT}],
                                         max_tokens=tokens, temperature=0, stream=True):
        if ev["choices"][0]["delta"].get("content"):
            last = time.perf_counter()
            if first is None:
                first = last
            n += 1
    return first - t0, (n - 1) / (last - first), n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(REPO / ".cache" / "test-models" /
                                           "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"))
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    setup_env(args.threads or os.cpu_count() or 2)
    import openai
    import psutil
    from llama_cpp import Llama

    from daemon_fixture import start_daemon
    from edgeinfer.store.model_store import Store
    name = "bench:model"
    modes = {"engine process": {}, "in process": {"EDGEINFER_ENGINE_PROCESS": "0"}}
    daemons, clients, figures = {}, {}, {}
    tmp = Path(tempfile.mkdtemp(prefix="edgeinfer-engine-process-"))
    try:
        for mode, env in modes.items():
            home = tmp / mode.replace(" ", "-")
            Store(home).register_file(args.model, name)
            d = daemons[mode] = start_daemon(home, EDGEINFER_KV_BUDGET_MB="256", **env)
            clients[mode] = openai.OpenAI(base_url=d.url + "/v1", api_key="x", timeout=600)
            rss0 = psutil.Process(d.proc.pid).memory_info().rss
            t = time.perf_counter()
            _stream(clients[mode], name, 4)
            figures[mode] = {"load": time.perf_counter() - t, "rss0": rss0}
        llm = Llama(args.model, n_ctx=2048, n_threads=args.threads or os.cpu_count() or 2,
                    verbose=False)
        _llama_stream(llm, 4)
        res: dict[str, list] = {m: [] for m in [*modes, "llama.cpp"]}
        for r in range(args.rounds):
            for mode in modes:
                res[mode].append(_stream(clients[mode], name, args.tokens))
            res["llama.cpp"].append(_llama_stream(llm, args.tokens))
            print(f"round {r + 1}: " + ", ".join(
                f"{m} {v[-1][0] * 1000:.0f} ms / {v[-1][1]:.1f} tok/s" for m, v in res.items()),
                flush=True)
        for mode, d in daemons.items():
            proc = psutil.Process(d.proc.pid)
            figures[mode]["rss_loaded"] = proc.memory_info().rss
            d.post("/api/generate", {"model": name, "keep_alive": 0})
            time.sleep(2)
            figures[mode]["rss_after"] = proc.memory_info().rss
    finally:
        for d in daemons.values():
            d.stop()
    rows = []
    for m, v in res.items():
        ttft = [x[0] * 1000 for x in v]
        tps = [x[1] for x in v]
        rows.append([m, statistics.median(ttft), min(ttft), max(ttft), statistics.median(tps),
                     min(tps), max(tps)])
    print(table(f"Streaming one greedy chat request, {args.tokens} tokens, "
                f"{Path(args.model).name}, medians of {args.rounds} interleaved rounds",
                ["", "TTFT ms", "min", "max", "decode tok/s", "min", "max"], rows))
    ep, ip, lc = (statistics.median(x[1] for x in res[m]) for m in
                  ("engine process", "in process", "llama.cpp"))
    dt = (statistics.median(x[0] for x in res["engine process"])
          - statistics.median(x[0] for x in res["in process"])) * 1000
    print(f"\nengine process / in process decode: {ep / ip:.3f}x (goal >= 0.97); "
          f"TTFT {dt:+.1f} ms (goal <= 10); engine process / llama.cpp decode: {ep / lc:.2f}x")
    MB = 1 << 20
    print(table("The daemon's RSS (MB): before the first load, loaded, after unload",
                ["", "first load s", "before", "loaded", "after unload"],
                [[m, f["load"], f["rss0"] / MB, f["rss_loaded"] / MB, f["rss_after"] / MB]
                 for m, f in figures.items()]))


if __name__ == "__main__":
    main()
