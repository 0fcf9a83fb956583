"""Native engine vs llama.cpp on one model, same run, same threads.

    .venv/bin/python benchmarks/generate.py [--model PATH] [--threads 2] [--repeats 3]

Each engine runs in its own fresh worker process (so peak RSS and cold start are its own):
cold start = process start to first generated token (model load included); prefill tok/s on a
~600-token prompt; decode tok/s over 128 greedy tokens. llama.cpp runs through
llama-cpp-python with the same thread count. Prints a table with native/llama.cpp ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

PROMPT = " ".join(
    f"Section {i}: the {['quick', 'lazy', 'curious'][i % 3]} {['fox', 'dog', 'cat'][i % 3]} "
    f"counted {i * 7 % 31} stones by the river and wrote the number down." for i in range(40))
DECODE_TOKENS = 128


def _since_process_start() -> float:
    import psutil
    return time.time() - psutil.Process().create_time()


def worker_native(model: str) -> dict:
    from edgeinfer.engine.core import Engine, EngineConfig
    from edgeinfer.engine.sampling import SamplingParams
    engine = Engine(model, EngineConfig(max_model_len=2048, kv_budget_bytes=256 << 20,
                                        max_tokens_per_step=1024))
    ids = engine.encode_raw("Hello")
    engine.generate(ids, SamplingParams(temperature=0, max_tokens=1))
    cold = _since_process_start()
    prompt = engine.encode_raw(PROMPT)[:600]
    best_prefill, best_decode = 0.0, 0.0
    for i in range(REPEATS):
        p = [prompt[0], prompt[1] + i + 1] + prompt[2:]  # a new first block: no prefix-cache hit
        t = time.perf_counter()
        engine.generate(p, SamplingParams(temperature=0, max_tokens=1))
        best_prefill = max(best_prefill, len(p) / (time.perf_counter() - t))
        out = engine.generate(ids, SamplingParams(temperature=0, max_tokens=DECODE_TOKENS,
                                                  ignore_eos=True))
        n = out.num_output_tokens - 1
        best_decode = max(best_decode, n / (out.finish_time - out.first_token_time))
    return {"cold_start_s": cold, "prefill_tok_s": best_prefill, "decode_tok_s": best_decode,
            "prompt_tokens": len(prompt)}


def worker_llamacpp(model: str, threads: int) -> dict:
    import llama_cpp
    import numpy as np
    llm = llama_cpp.Llama(model_path=model, n_ctx=2048, n_batch=1024, n_threads=threads,
                          n_threads_batch=threads, verbose=False)
    ids = llm.tokenize(b"Hello", add_bos=True)
    llm.eval(ids)
    cold = _since_process_start()
    prompt = llm.tokenize(PROMPT.encode(), add_bos=True)[:600]
    best_prefill, best_decode = 0.0, 0.0
    for _ in range(REPEATS):
        llm.reset()
        t = time.perf_counter()
        llm.eval(prompt)
        best_prefill = max(best_prefill, len(prompt) / (time.perf_counter() - t))
        llm.reset()
        llm.eval(ids)
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        t = time.perf_counter()
        for _ in range(DECODE_TOKENS - 1):
            llm.eval([tok])
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        best_decode = max(best_decode, (DECODE_TOKENS - 1) / (time.perf_counter() - t))
    return {"cold_start_s": cold, "prefill_tok_s": best_prefill, "decode_tok_s": best_decode,
            "prompt_tokens": len(prompt)}


REPEATS = 3


def run_worker(engine: str, model: str, threads: int, repeats: int) -> dict:
    env = dict(os.environ, NUMBA_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
    r = subprocess.run([sys.executable, __file__, "--worker", engine, "--model", model,
                        "--threads", str(threads), "--repeats", str(repeats)],
                       capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"{engine} worker failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    global REPEATS
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--worker", choices=["native", "llamacpp"])
    args = ap.parse_args()
    REPEATS = args.repeats
    model = args.model
    if model is None:
        from edgeinfer.store.model_store import Store
        model = str(Store().resolve("gemma3:270m").path)
    if args.worker:
        res = worker_native(model) if args.worker == "native" else worker_llamacpp(model, args.threads)
        res["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps(res))
        return
    print(f"model {model}, {args.threads} threads, best of {args.repeats}, load average "
          f"{os.getloadavg()[0]:.1f}")
    native = run_worker("native", model, args.threads, args.repeats)
    ref = run_worker("llamacpp", model, args.threads, args.repeats)
    rows = [("prefill tok/s (~600-token prompt)", "prefill_tok_s", True),
            ("decode tok/s (128 tokens)", "decode_tok_s", True),
            ("peak RSS MB", "peak_rss_mb", False),
            ("cold start s (load + first token)", "cold_start_s", False)]
    print(f"| {'metric':36} | {'native':>9} | {'llama.cpp':>9} | {'ratio':>6} |")
    print(f"|{'-' * 38}|{'-' * 11}|{'-' * 11}|{'-' * 8}|")
    for label, key, _ in rows:
        print(f"| {label:36} | {native[key]:9.1f} | {ref[key]:9.1f} | {native[key] / ref[key]:6.2f} |")


if __name__ == "__main__":
    main()
