"""TTFT of an n = 4 request against n = 1 on a long prompt: the choices share one prefill.

    .venv/bin/python benchmarks/n_choices.py [--model PATH] [--prompt-tokens 1500] [--rounds 3]

Each round runs n = 1 and n = 4 (interleaved, fresh prompt each time so neither finds the
other's prefix cached) through the engine thread, and records the time from submission to
the first token of the *last* choice. Prints the medians, their spread and the ratio.
"""
from __future__ import annotations

import argparse
import queue
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import model_path, setup_env  # noqa: E402


def ttft(engine, prompt: list[int], n: int) -> float:
    from edgeinfer.runners.sampling_params import SamplingParams
    events: queue.Queue = queue.Queue()
    params = SamplingParams(temperature=0.8, max_tokens=4, seed=1)
    t0 = time.perf_counter()
    first = engine.submit(prompt, params, events.put, choice=0)
    for i in range(1, n):
        engine.submit(prompt, params, events.put, choice=i, follows=first)
    seen: set[int] = set()
    done: set[int] = set()
    last = 0.0
    while len(done) < n:
        out = events.get(timeout=120)
        if out.token_ids and out.request_id not in seen:
            seen.add(out.request_id)
            last = time.perf_counter() - t0
        if out.finished:
            done.add(out.request_id)
    return last


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--prompt-tokens", type=int, default=1500)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    setup_env(a.threads)
    import numpy as np

    from edgeinfer.engine.core import Engine, EngineConfig
    engine = Engine(model_path(a.model), EngineConfig(kv_budget_bytes=512 << 20)).start()
    rng = np.random.default_rng(0)
    vocab = min(engine.cfg.vocab_size, 200_000)

    def prompt() -> list[int]:
        return [2] + [int(t) for t in rng.integers(1000, vocab, a.prompt_tokens - 1)]

    ttft(engine, prompt()[:64], 1)          # warm-up (JIT, pages)
    one, four = [], []
    for r in range(a.rounds):
        one.append(ttft(engine, prompt(), 1))
        four.append(ttft(engine, prompt(), 4))
        print(f"round {r + 1}: n=1 {one[-1] * 1e3:.0f} ms, n=4 {four[-1] * 1e3:.0f} ms", flush=True)
    m1, m4 = statistics.median(one), statistics.median(four)
    print(f"\nTTFT, {a.prompt_tokens}-token prompt, medians of {a.rounds} rounds")
    print(f"  n=1: {m1 * 1e3:.0f} ms (range {min(one) * 1e3:.0f}-{max(one) * 1e3:.0f})")
    print(f"  n=4: {m4 * 1e3:.0f} ms (range {min(four) * 1e3:.0f}-{max(four) * 1e3:.0f}), "
          f"last choice's first token")
    print(f"  ratio n=4 / n=1: {m4 / m1:.2f} (target <= 1.3)")
    engine.close()


if __name__ == "__main__":
    main()
