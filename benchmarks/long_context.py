"""KV memory and decode speed at long context: sliding-window release vs one pool, and
llama.cpp with the same n_ctx.

    .venv/bin/python benchmarks/long_context.py [--ctx 8192 32000] [--rounds 3] [--threads 2]
    .venv/bin/python benchmarks/long_context.py --ab-decode --ctx 8192 --rounds 6

Each configuration runs in its own fresh worker process (peak RSS is its own): it fills a
context of `ctx` prompt tokens (prefill), then decodes DECODE greedy tokens and reports
decode tok/s at that depth, the KV pool's bytes (what `ps` shows: the planner's pools
for a budget that just holds the context) and the process's peak RSS.

- native window: Gemma 3's 15 sliding-window layers in a pool of their own that holds one
  window per running sequence (`--running`, the scheduler's max_running_seqs), the 3
  full-attention layers for every position (edgeinfer.runners.base.plan_kv);
- native full: the window group turned off (CpuOps.kv_window_group = False): every layer
  keeps every position, as before;
- llama.cpp: llama-cpp-python with n_ctx = the same context, same threads (its default
  cache for Gemma 3 also keeps only a window for the SWA layers).
Rounds interleave the configurations (this machine drifts); the table gives medians and
ranges.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

DECODE = 64
PAD = 256               # context headroom past the prompt: decode + a block
SENTENCES = (Path(__file__).resolve().parent.parent / "tests" / "data" / "sentences.txt"
             ).read_text().splitlines()


def _text(n_sentences: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(SENTENCES) for _ in range(n_sentences))


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def native_budget(cfg, ctx: int, windowed: bool, running: int, step: int, bs: int = 16) -> int:
    """The KV budget whose plan holds one context of ctx + PAD tokens."""
    per_layer = 2 * cfg.n_kv_head * cfg.head_dim * 2          # f16 pool
    blocks = -(-(ctx + PAD) // bs)
    if not windowed:
        return blocks * bs * per_layer * cfg.n_layers
    n_win = sum(cfg.is_sliding(i) for i in range(cfg.n_layers))
    span = -(-(cfg.sliding_window - 1) // bs) + 1
    cap = min(blocks, running * (span + 1) + -(-step // bs))
    return bs * (blocks * (cfg.n_layers - n_win) * per_layer + cap * n_win * per_layer)


def worker_native(model: str, ctx: int, windowed: bool, running: int) -> dict:
    from edgeinfer.backends.cpu.ops import CpuOps
    from edgeinfer.engine.core import Engine, EngineConfig
    from edgeinfer.runners.sampling_params import SamplingParams
    from edgeinfer.formats.gguf_file import read_gguf
    from edgeinfer.formats.model_config import load_model_config
    CpuOps.kv_window_group = windowed
    gf = read_gguf(model)
    cfg = load_model_config(gf)
    gf.close()
    step = 512
    budget = native_budget(cfg, ctx, windowed, running, step)
    engine = Engine(model, EngineConfig(max_model_len=ctx + PAD, kv_budget_bytes=budget,
                                        max_running_seqs=running, max_tokens_per_step=step,
                                        speculative=False))
    plan = engine.runner.kv_plan
    assert plan.capacity_tokens >= ctx + DECODE, plan
    ids = engine.encode_raw(_text(ctx // 8 + 50))[:ctx]
    assert len(ids) == ctx
    t = time.perf_counter()
    out = engine.generate(ids, SamplingParams(temperature=0, max_tokens=DECODE + 1,
                                              ignore_eos=True))
    total = time.perf_counter() - t
    ttft = out.first_token_time - out.arrival_time
    decode = DECODE / (out.finish_time - out.first_token_time)
    return {"prefill_tok_s": ctx / ttft, "decode_tok_s": decode, "kv_mb": plan.nbytes / 2**20,
            "context_kv_mb": plan.context_bytes(ctx + DECODE) / 2**20,
            "capacity_tokens": plan.capacity_tokens, "window_blocks": plan.window_blocks,
            "total_s": total, "peak_rss_mb": _rss_mb()}


def worker_llamacpp(model: str, ctx: int, threads: int) -> dict:
    import llama_cpp
    import numpy as np
    import re
    import tempfile
    # its KV buffer sizes are in its load log: catch what the C library writes to fd 2
    with tempfile.TemporaryFile() as log:
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)
        try:
            llm = llama_cpp.Llama(model_path=model, n_ctx=ctx + PAD, n_batch=512,
                                  n_threads=threads, n_threads_batch=threads, verbose=True)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        log.seek(0)
        text = log.read().decode(errors="replace")
    kv = sum(float(m) for m in re.findall(r"KV buffer size\s*=\s*([0-9.]+) MiB", text))
    ids = llm.tokenize(_text(ctx // 8 + 50).encode(), add_bos=True)[:ctx]
    n_vocab = llm.n_vocab()

    def last_token() -> int:      # llm.scores holds nothing without logits_all
        return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), (n_vocab,))))
    t = time.perf_counter()
    llm.eval(ids)
    tok = last_token()
    ttft = time.perf_counter() - t
    # past 8K its decode crawls on a loaded 2-core machine: fewer tokens keep a run short
    n_decode = DECODE if ctx <= 8192 else DECODE // 4
    t = time.perf_counter()
    for _ in range(n_decode):
        llm.eval([tok])
        tok = last_token()
    decode = n_decode / (time.perf_counter() - t)
    return {"prefill_tok_s": ctx / ttft, "decode_tok_s": decode, "kv_mb": kv,
            "context_kv_mb": kv, "peak_rss_mb": _rss_mb()}


def ab_decode(model: str, ctx: int, rounds: int, running: int, n_decode: int = 32) -> None:
    """Decode tok/s at `ctx` tokens of context, window vs one pool, in one process: both
    engines hold the same context (a prefix-cache hit re-admits it each round), and their
    decode runs alternate, so machine drift hits both alike. Also checks equal tokens."""
    from edgeinfer.backends.cpu.ops import CpuOps
    from edgeinfer.engine.core import Engine, EngineConfig
    from edgeinfer.runners.sampling_params import SamplingParams
    from edgeinfer.formats.gguf_file import read_gguf
    from edgeinfer.formats.model_config import load_model_config
    gf = read_gguf(model)
    cfg = load_model_config(gf)
    gf.close()
    engines = {}
    for name, windowed in (("window", True), ("full", False)):
        CpuOps.kv_window_group = windowed
        engines[name] = Engine(model, EngineConfig(
            max_model_len=ctx + PAD, max_running_seqs=running, speculative=False,
            kv_budget_bytes=native_budget(cfg, ctx, windowed, running, 512)))
    CpuOps.kv_window_group = True
    ids = engines["window"].encode_raw(_text(ctx // 8 + 50))[:ctx]
    params = SamplingParams(temperature=0, max_tokens=n_decode + 1, ignore_eos=True)
    rates: dict[str, list[float]] = {n: [] for n in engines}
    outs = {}
    for name, eng in engines.items():        # fill the context once (prefill, cached)
        outs[name] = eng.generate(ids, params).token_ids
    assert outs["window"] == outs["full"], "window and full pools disagree"
    for r in range(rounds):
        for name in (("window", "full") if r % 2 == 0 else ("full", "window")):
            out = engines[name].generate(ids, params)
            assert out.num_cached_tokens >= ctx - 16 and out.token_ids == outs[name]
            rates[name].append(n_decode / (out.finish_time - out.first_token_time))
        print(f"  round {r + 1}: " + ", ".join(f"{n} {v[-1]:.1f}" for n, v in rates.items()),
              flush=True)
    w, f = rates["window"], rates["full"]
    ratio = [a / b for a, b in zip(w, f)]
    print(f"decode tok/s at {ctx} context, {n_decode} tokens, {rounds} alternating rounds: "
          f"window {statistics.median(w):.1f} ({min(w):.1f}-{max(w):.1f}), full "
          f"{statistics.median(f):.1f} ({min(f):.1f}-{max(f):.1f}), ratio median "
          f"{statistics.median(ratio):.2f} ({min(ratio):.2f}-{max(ratio):.2f})")


CONFIGS = ("native window", "native full", "llama.cpp")


def _launcher() -> list[str]:
    """The interpreter arguments before this script's path (a wrapper that maps the package
    to another checkout, say), so workers import what this process imports."""
    argv = sys.orig_argv[1:]
    for i, a in enumerate(argv):
        if a.endswith(os.path.basename(__file__)):
            return argv[:i]
    return []


def run_worker(config: str, model: str, ctx: int, threads: int, running: int) -> dict:
    env = dict(os.environ, NUMBA_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads),
               EDGEINFER_THREADS=str(threads))
    r = subprocess.run([sys.executable, *_launcher(), __file__, "--worker", config, "--model", model,
                        "--ctx", str(ctx), "--threads", str(threads), "--running", str(running)],
                       capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"{config} worker failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--ctx", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--running", type=int, default=4, help="native max_running_seqs")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    ap.add_argument("--worker", choices=CONFIGS)
    ap.add_argument("--ab-decode", action="store_true",
                    help="decode tok/s window vs one pool, alternating in one process")
    args = ap.parse_args()
    model = args.model
    if model is None:
        from edgeinfer.store.model_store import Store
        model = str(Store().resolve("gemma3:270m").path)
    if args.ab_decode:
        os.environ.setdefault("EDGEINFER_THREADS", str(args.threads))
        for ctx in args.ctx:
            ab_decode(model, ctx, args.rounds, args.running)
        return
    if args.worker:
        ctx = args.ctx[0]
        if args.worker == "llama.cpp":
            res = worker_llamacpp(model, ctx, args.threads)
        else:
            res = worker_native(model, ctx, args.worker == "native window", args.running)
        print(json.dumps(res))
        return
    print(f"model {model}, {args.threads} threads, native max_running_seqs {args.running}, "
          f"{args.rounds} interleaved rounds, load average {os.getloadavg()[0]:.1f}")
    for ctx in args.ctx:
        results: dict[str, list[dict]] = {c: [] for c in args.configs}
        for r in range(args.rounds):
            for c in args.configs:
                res = run_worker(c, model, ctx, args.threads, args.running)
                results[c].append(res)
                print(f"  ctx {ctx} round {r + 1} {c}: " + json.dumps(
                    {k: round(v, 1) for k, v in res.items()}), flush=True)
        print(f"\ncontext {ctx} tokens (+{DECODE} decoded)")
        print(f"| {'config':14} | {'KV pool MB':>10} | {'ctx KV MB':>9} | {'peak RSS MB':>17} "
              f"| {'decode tok/s':>18} | {'prefill tok/s':>18} |")
        print(f"|{'-' * 16}|{'-' * 12}|{'-' * 11}|{'-' * 19}|{'-' * 20}|{'-' * 20}|")

        def cell(rs, key):
            v = [x[key] for x in rs]
            return f"{statistics.median(v):6.1f} ({min(v):.0f}-{max(v):.0f})"
        for c in args.configs:
            rs = results[c]
            print(f"| {c:14} | {statistics.median(x['kv_mb'] for x in rs):10.1f} "
                  f"| {statistics.median(x['context_kv_mb'] for x in rs):9.1f} "
                  f"| {cell(rs, 'peak_rss_mb'):>17} | {cell(rs, 'decode_tok_s'):>18} "
                  f"| {cell(rs, 'prefill_tok_s'):>18} |")


if __name__ == "__main__":
    main()
