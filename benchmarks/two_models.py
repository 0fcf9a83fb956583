"""Two loaded models generating at once against one model alone (issue 12: "one compute budget
per process").

    .venv/bin/python benchmarks/two_models.py [--model PATH] [--tokens 64] [--streams 2]
                                              [--rounds 3] [--separate]

Two engines are loaded from the same GGUF (two names in a daemon load two copies), each on its
own engine thread, sharing one ThreadGovernor as the model manager's engines do. Each round
times `streams` greedy requests of `tokens` tokens on one engine alone, then the same on both
engines together (streams requests each), and reports aggregate decode tokens per second.
The target is together >= 0.8x alone: the second model must not slow the machine down by
oversubscribing the cores. `--separate` gives each engine its own governor (each believes it
owns every free core), the behaviour before the shared budget, for comparison.
`--process` runs each engine in its own process (edgeinfer.engine.remote, as the daemon
does by default): each process has its own governor, which counts the other as busy cores.

Absolute numbers on a shared machine drift run to run; rounds interleave alone/together so
the ratio is taken under the same conditions.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import model_path, setup_env, table  # noqa: E402

PROMPTS = ["The history of the lighthouse begins", "A short guide to growing tomatoes:",
           "Once upon a time in a small village", "The main causes of ocean tides are"]


def run(engines, streams: int, tokens: int) -> tuple[int, float]:
    """Submit `streams` requests to each engine at once; (tokens generated, seconds)."""
    from edgeinfer.runners.sampling_params import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    lock = threading.Lock()
    left = [len(engines) * streams]
    count = [0]
    done = threading.Event()

    def sink(out):
        with lock:
            count[0] += len(out.token_ids)
            if out.finished:
                left[0] -= 1
                if left[0] == 0:
                    done.set()
    t0 = time.perf_counter()
    for k, e in enumerate(engines):
        for s in range(streams):
            prompt = e.encode_raw(f"{PROMPTS[(k + s) % len(PROMPTS)]} (run {time.time_ns()})")
            e.submit(prompt, params, sink)
    if not done.wait(600):
        raise RuntimeError("requests did not finish in 10 minutes")
    return count[0], time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--streams", type=int, default=1, help="requests per engine")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="NUMBA_NUM_THREADS (0: all cores)")
    ap.add_argument("--separate", action="store_true",
                    help="one governor per engine (no shared budget), for comparison")
    ap.add_argument("--process", action="store_true",
                    help="each engine in its own process, as the daemon runs them")
    args = ap.parse_args()
    import os
    setup_env(args.threads or os.cpu_count() or 1)
    path = model_path(args.model)

    from edgeinfer.backends.threads import ThreadGovernor
    from edgeinfer.engine.core import Engine, EngineConfig

    shared = ThreadGovernor()

    def load():
        if args.process:
            from edgeinfer.engine.remote import RemoteEngine
            return RemoteEngine(path, EngineConfig(kv_budget_bytes=64 << 20,
                                                   max_model_len=1024)).load()
        g = ThreadGovernor() if args.separate else shared
        return Engine(path, EngineConfig(kv_budget_bytes=64 << 20, max_model_len=1024,
                                         governor=g)).start()
    a, b = load(), load()
    try:
        run([a], 1, 4)                    # warm both (kernels, first-step allocations)
        run([b], 1, 4)
        alone, together = [], []
        for _ in range(args.rounds):
            n, s = run([a], args.streams, args.tokens)
            alone.append(n / s)
            n, s = run([a, b], args.streams, args.tokens)
            together.append(n / s)
        rows = [["one model", args.streams, statistics.median(alone), min(alone), max(alone)],
                ["two models", 2 * args.streams, statistics.median(together), min(together),
                 max(together)]]
        print(table(f"Aggregate decode tok/s, {args.tokens} tokens per request, "
                    f"{'engine processes' if args.process else 'separate governors' if args.separate else 'one shared governor'}, "
                    f"{os.cpu_count()} cores",
                    ["", "streams", "tok/s median", "min", "max"], rows))
        ratio = statistics.median(together) / statistics.median(alone)
        per_round = [t / a_ for t, a_ in zip(together, alone)]
        print(f"\ntwo models / one model: {ratio:.2f}x (per round: "
              f"{', '.join(f'{r:.2f}' for r in per_round)}); target >= 0.8x")
    finally:
        a.close()
        b.close()


if __name__ == "__main__":
    main()
