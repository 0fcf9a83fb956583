"""Embedding throughput: N sentences of about 20 tokens in one /api/embed call to a real daemon,
against llama.cpp (llama-cpp-python, embedding=True, mean pooling, the same model, threads and
sentences, batching as many sequences per decode as it allows) in the same run.

    .venv/bin/python benchmarks/embed.py [--model PATH] [--sentences 256] [--threads 2]
                                         [--rounds 3] [--running 16,64]

Each side embeds the list once to warm up, then `rounds` times; the median wall time gives
sentences/s. Peak RSS is each process's high-water mark (VmHWM of the daemon; ru_maxrss of
the llama.cpp child). --running lists the daemon's EDGEINFER_MAX_RUNNING_SEQS values to try
(each a fresh daemon): how many sequences one engine step may batch.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import model_path, start_daemon, table  # noqa: E402

WORDS = ("the a local model server turns text into vectors so that search finds similar "
         "meaning quickly on small machines without network access while people write notes "
         "about cooking travel music weather code history gardens rivers and quiet mornings").split()


def sentences(n: int, seed: int = 0) -> list[str]:
    import random
    rnd = random.Random(seed)
    return [" ".join(rnd.choice(WORDS) for _ in range(rnd.randint(14, 20))).capitalize() + "."
            for _ in range(n)]


def _vmhwm(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def run_daemon(model: str, texts: list[str], threads: int, rounds: int, running: int) -> dict:
    import httpx
    from edgeinfer.store.model_store import Store
    home = Path(tempfile.mkdtemp(prefix="embed-bench-"))
    Store(home).register_file(model, "bench:embed")
    port = 20000 + os.getpid() % 20000
    env = dict(os.environ, EDGEINFER_HOME=str(home), EDGEINFER_THREADS=str(threads),
               EDGEINFER_MAX_RUNNING_SEQS=str(running), EDGEINFER_MAX_QUEUE="512",
               EDGEINFER_KV_BUDGET_MB="256", OMP_WAIT_POLICY="PASSIVE")
    env.pop("EDGEINFER_API_KEY", None)
    proc, url = start_daemon(env, port)
    try:
        body = {"model": "bench:embed", "input": texts}
        r = httpx.post(url + "/api/embed", json=body, timeout=600)      # warm-up, load
        r.raise_for_status()
        times, tokens = [], r.json()["prompt_eval_count"]
        for _ in range(rounds):
            t0 = time.perf_counter()
            r = httpx.post(url + "/api/embed", json=body, timeout=600)
            times.append(time.perf_counter() - t0)
            r.raise_for_status()
        vec0 = r.json()["embeddings"][0]
        return {"seconds": statistics.median(times), "spread": (min(times), max(times)),
                "tokens": tokens, "rss": _vmhwm(proc.pid), "vec0": vec0}
    finally:
        proc.terminate()
        proc.wait(30)


def _llama_child(model: str, texts: list[str], threads: int, rounds: int, q) -> None:
    import resource

    import llama_cpp
    from edgeinfer.formats.gguf_file import read_gguf
    f = read_gguf(model)
    encoder = f.metadata.get("general.architecture") == "bert"
    f.close()
    # an encoder needs the whole batch in one micro-batch (n_ubatch >= n_tokens)
    llm = llama_cpp.Llama(model, embedding=True, n_ctx=8192, n_batch=2048,
                          n_ubatch=2048 if encoder else 512,
                          n_seq_max=64, n_threads=threads, n_threads_batch=threads,
                          pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN, verbose=False)
    llm.embed(texts, normalize=True)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        out = llm.embed(texts, normalize=True)
        times.append(time.perf_counter() - t0)
    q.put({"seconds": statistics.median(times), "spread": (min(times), max(times)),
           "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
           "vec0": list(out[0])})


def run_llamacpp(model: str, texts: list[str], threads: int, rounds: int) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_llama_child, args=(model, texts, threads, rounds, q))
    p.start()
    res = q.get(timeout=1200)
    p.join(60)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--sentences", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--running", default="16,64")
    a = ap.parse_args()
    import numpy as np
    model = model_path(a.model)
    texts = sentences(a.sentences)
    rows, results = [], {}
    ref = run_llamacpp(model, texts, a.threads, a.rounds)
    for running in [int(x) for x in a.running.split(",")]:
        results[running] = run_daemon(model, texts, a.threads, a.rounds, running)
    n = len(texts)
    base = n / ref["seconds"]
    rows.append(["llama.cpp (llama-cpp-python)", "-", f"{ref['seconds']:.2f}", base, 1.0,
                 ref["rss"] / 2**20])
    for running, r in results.items():
        sps = n / r["seconds"]
        cos = float(np.dot(r["vec0"], ref["vec0"]) / np.linalg.norm(r["vec0"]) /
                    np.linalg.norm(ref["vec0"]))
        rows.append([f"edgeinfer /api/embed (cos {cos:.4f})", running, f"{r['seconds']:.2f}",
                     sps, sps / base, r["rss"] / 2**20])
    tokens = next(iter(results.values()))["tokens"]
    print(table(f"{n} sentences ({tokens} tokens) in one call, {a.threads} threads, median of "
                f"{a.rounds}: {Path(model).name}",
                ["engine", "max running seqs", "seconds", "sentences/s", "vs llama.cpp",
                 "peak RSS MiB"], rows))
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "vec0"}
                      for k, v in results.items()}))


if __name__ == "__main__":
    main()
