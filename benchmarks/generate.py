"""Native engine vs llama.cpp on one model, same run, same threads, interleaved rounds.

    .venv/bin/python benchmarks/generate.py [--model NAME|PATH] [--threads 2] [--rounds 3]
        [--depths 0,2048,8192] [--rss-context 32768]

--model takes a store name (gemma3:270m, the default; qwen2.5-coder:0.5b, the bundled chat
model) or a .gguf path (e.g. .cache/test-models/smollm2-135m-instruct-q4_1.gguf).

Each round runs one fresh worker process per engine (their order alternates between rounds,
so drift on a shared machine hits both alike); the table gives the median of the rounds,
the range, and the ratio of the medians. A worker measures, llama-bench style:
- cold start: process start to the first generated token (model load included);
- prefill tok/s of a 512-token chunk (pp512) after `depth` tokens already in the context
  (ours: a prefix-cache hit; llama.cpp: the same tokens evaluated just before);
- decode tok/s of 128 greedy tokens (tg128) at that depth;
- peak RSS of the process after its deepest context;
- the memory's read rate for the same threads just before and after the first depth's decode
  (common.read_rate, in a process of its own), and the decode's weights read per second (the
  file's size times tok/s; at depth the KV cache's reads come on top, uncounted) as a share
  of it: a decode at the memory roof reads ~0.9 of it,
  and on a VM whose memory moves between phases the ratio of two engines at the roof says
  little about their kernels.
Prompts are the same random token ids for both engines (ordinary vocabulary, no specials).
Prompt-lookup speculation is off for the pp/tg rows (plain decoding on both sides); the
"decode, speculation on" row repeats tg128 with our default speculation on (llama.cpp's column
is its plain decode): on these random-token prompts the greedy continuation is the model's own
text, so lookup hits only where the model repeats itself (benchmarks/speculative.py measures the
copy tasks where it pays). --rss-context N adds one more round that only fills an N-token context and reports
each engine's peak RSS (slow: N tokens of prefill on each engine).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import time

PP = 512
TG = 128
SEED = 1234


def _since_process_start() -> float:
    """Seconds since this process started, to the clock tick: its start time and the boot
    clock both count from boot. (psutil's create_time adds the boot time, which Linux gives
    in whole seconds: up to a second too much, here 0.5 s.)"""
    stat = open("/proc/self/stat").read().rsplit(")", 1)[1].split()
    start = int(stat[19]) / os.sysconf("SC_CLK_TCK")       # field 22, starttime
    return time.clock_gettime(time.CLOCK_BOOTTIME) - start


def _tokens(n: int, vocab: int) -> list[int]:
    import numpy as np
    rng = np.random.default_rng(SEED)
    hi = min(vocab, 200_000)
    lo = 1000 if hi > 2000 else 1        # synthetic models (benchmarks/moe.py) have tiny vocabularies
    return [int(t) for t in rng.integers(lo, hi, n)]


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _kv_budget(model: str, ctx: int) -> int:
    """A pool of one context (as llama.cpp's n_ctx): with the prefix cache keeping earlier
    prompts, a larger pool would keep touching fresh pages and inflate our RSS."""
    from edgeinfer.formats.gguf_file import read_gguf
    from edgeinfer.formats.model_config import load_model_config
    cfg = load_model_config(read_gguf(model))
    return ctx * cfg.kv_bytes_per_token(2)


@contextlib.contextmanager
def _read_rate_around(res: dict, measure: bool):
    """res["read_gbs"]: the memory's read rate for this worker's threads just before and
    after the block (common.read_rate, in a process of its own so that this worker's peak
    RSS stays its own), averaged; nothing when not `measure` (the depths after the first)."""
    if not measure:
        yield
        return
    from common import read_rate_apart
    threads = int(os.environ.get("NUMBA_NUM_THREADS", "2"))
    before = read_rate_apart(threads)
    yield
    res["read_gbs"] = (before + read_rate_apart(threads)) / 2


def worker_native(model: str, depths: list[int], ctx: int) -> dict:
    from edgeinfer import startup_gc
    startup_gc.hold()       # as an engine process loads (edgeinfer/engine/remote.py serve)
    from edgeinfer.engine.core import Engine, EngineConfig
    from edgeinfer.runners.sampling_params import SamplingParams
    from edgeinfer.settings import Settings
    user = Settings.from_env()          # the repack cache as a user's load has it
    engine = Engine(model, EngineConfig(max_model_len=ctx, kv_budget_bytes=_kv_budget(model, ctx),
                                        max_tokens_per_step=PP, speculative=False,
                                        repack_cache=user.repack_cache,
                                        repack_cache_bytes=user.repack_cache_bytes))
    startup_gc.release()
    greedy = SamplingParams(temperature=0, max_tokens=1)
    engine.generate(engine.encode_raw("Hello"), greedy)
    res: dict = {"cold_start_s": _since_process_start()}
    engine.runner.ops.release()     # a first load's write to the repack cache, not timed below
    vocab = engine.runner.cfg.vocab_size
    engine.generate(_tokens(PP + 16, vocab)[16:], greedy)      # warm-up, as llama-bench does
    for d in depths:
        ids = _tokens(d + PP, vocab)
        if d:
            engine.generate(ids[:d], greedy)          # the context, then a prefix-cache hit
        t = time.perf_counter()
        engine.generate(ids, greedy)
        res[f"pp{PP}@{d}"] = PP / (time.perf_counter() - t)
        with _read_rate_around(res, d == depths[0]):
            out = engine.generate(ids, SamplingParams(temperature=0, max_tokens=TG,
                                                      ignore_eos=True))
        res[f"tg{TG}@{d}"] = (out.num_output_tokens - 1) / (out.finish_time - out.first_token_time)
        plain = engine.config
        engine.config = dataclasses.replace(plain, speculative=True)   # read at every step
        out = engine.generate(ids, SamplingParams(temperature=0, max_tokens=TG, ignore_eos=True))
        engine.config = plain
        res[f"tgspec@{d}"] = (out.num_output_tokens - 1) / (out.finish_time - out.first_token_time)
    res["peak_rss_mb"] = _rss_mb()
    return res


def worker_llamacpp(model: str, depths: list[int], ctx: int, threads: int, fa: bool) -> dict:
    import llama_cpp
    import numpy as np
    llm = llama_cpp.Llama(model_path=model, n_ctx=ctx, n_batch=PP, n_ubatch=PP,
                          n_threads=threads, n_threads_batch=threads, flash_attn=fa,
                          swa_full=False, verbose=False)
    llm.eval(llm.tokenize(b"Hello", add_bos=True))
    res: dict = {"cold_start_s": _since_process_start()}
    n_vocab = llm.n_vocab()
    llm.reset()
    llm.eval(_tokens(PP, n_vocab))      # warm-up, as llama-bench does

    def last_argmax() -> int:
        # the last position's logits straight from the context (llama-cpp-python keeps
        # `scores` only with logits_all)
        return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))))

    for d in depths:
        ids = _tokens(d + PP, llm.n_vocab())
        llm.reset()
        if d:
            llm.eval(ids[:d])
        t = time.perf_counter()
        llm.eval(ids[d:])
        res[f"pp{PP}@{d}"] = PP / (time.perf_counter() - t)
        tok = last_argmax()
        with _read_rate_around(res, d == depths[0]):
            t = time.perf_counter()
            for _ in range(TG - 1):
                llm.eval([tok])
                tok = last_argmax()
            res[f"tg{TG}@{d}"] = (TG - 1) / (time.perf_counter() - t)
        res[f"tgspec@{d}"] = res[f"tg{TG}@{d}"]       # no prompt-lookup here: plain decode
    res["peak_rss_mb"] = _rss_mb()
    return res


def worker_fill_native(model: str, n: int) -> dict:
    from edgeinfer.engine.core import Engine, EngineConfig
    from edgeinfer.runners.sampling_params import SamplingParams
    engine = Engine(model, EngineConfig(max_model_len=n + 64,
                                        kv_budget_bytes=_kv_budget(model, n + 64),
                                        max_tokens_per_step=PP, speculative=False))
    vocab = engine.runner.cfg.vocab_size
    engine.generate(_tokens(n, vocab), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    return {"peak_rss_mb": _rss_mb(), "kv_mb": engine.runner.kv_bytes / 2**20}


def worker_fill_llamacpp(model: str, n: int, threads: int, fa: bool) -> dict:
    import llama_cpp
    llm = llama_cpp.Llama(model_path=model, n_ctx=n + 64, n_batch=PP, n_ubatch=PP,
                          n_threads=threads, n_threads_batch=threads, flash_attn=fa,
                          swa_full=False, verbose=False)
    llm.eval(_tokens(n, llm.n_vocab()))
    return {"peak_rss_mb": _rss_mb(), "kv_mb": float("nan")}


def add_run_args(ap: argparse.ArgumentParser) -> None:
    """The options a script that benchmarks one file through this one passes on (run_on)."""
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--depths", default="0,2048")
    ap.add_argument("--threads", type=int, default=2)


def run_on(path, args: argparse.Namespace) -> int:
    """This benchmark on a model file, in a process of its own (benchmarks/moe.py, gpt_oss.py)."""
    return subprocess.call([sys.executable, __file__, "--model", str(path),
                            "--rounds", str(args.rounds), "--depths", args.depths,
                            "--threads", str(args.threads)])


def run_worker(args: argparse.Namespace, engine: str, extra: list[str] = ()) -> dict:
    env = dict(os.environ, NUMBA_NUM_THREADS=str(args.threads), OMP_NUM_THREADS=str(args.threads))
    r = subprocess.run([sys.executable, __file__, "--worker", engine, "--model", args.model,
                        "--threads", str(args.threads), "--depths", args.depths,
                        "--flash-attn", args.flash_attn, *extra],
                       capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"{engine} worker failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _fmt(values: list[float], digits: int = 1) -> str:
    m = statistics.median(values)
    if len(values) == 1:
        return f"{m:.{digits}f}"
    return f"{m:.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", "--repeats", type=int, default=3, dest="rounds")
    ap.add_argument("--depths", default="0,2048,8192", help="context depths for pp/tg")
    ap.add_argument("--rss-context", type=int, default=0, help="also fill this context once")
    ap.add_argument("--worker", choices=["native", "llamacpp", "fill-native", "fill-llamacpp"])
    ap.add_argument("--fill", type=int, default=0)
    ap.add_argument("--flash-attn", choices=["on", "off"], default="on",
                    help="llama.cpp's flash attention (on: llama.cpp's own default on CPU; "
                         "llama-cpp-python defaults to off). Its sliding-window layers keep "
                         "only their window (swa_full=False, llama.cpp's CLI default; the "
                         "C API's default keeps the whole context for them)")
    args = ap.parse_args()
    if args.model is None:
        args.model = "gemma3:270m"
    if not args.worker:
        # (imported here: the workers' cold start imports nothing of the parent's)
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from common import fresh_bytecode, model_path
        fresh_bytecode()                          # the workers' cold start, as installed
        args.model = model_path(args.model)       # a file, or a store name's blob
    depths = [int(d) for d in args.depths.split(",") if d.strip()]
    ctx = max(depths) + PP + TG + 64
    fa = args.flash_attn == "on"
    if args.worker:
        res = {"native": lambda: worker_native(args.model, depths, ctx),
               "llamacpp": lambda: worker_llamacpp(args.model, depths, ctx, args.threads, fa),
               "fill-native": lambda: worker_fill_native(args.model, args.fill),
               "fill-llamacpp": lambda: worker_fill_llamacpp(args.model, args.fill, args.threads, fa),
               }[args.worker]()
        print(json.dumps(res))
        return
    print(f"model {args.model}, {args.threads} threads, {args.rounds} interleaved rounds, "
          f"llama.cpp flash attention {args.flash_attn}, load average {os.getloadavg()[0]:.1f}")
    runs: dict[str, list[dict]] = {"native": [], "llamacpp": []}
    for r in range(args.rounds):
        order = ["native", "llamacpp"] if r % 2 == 0 else ["llamacpp", "native"]
        for engine in order:
            runs[engine].append(run_worker(args, engine))
        print(f"round {r + 1}: " + ", ".join(
            f"{e} tg@0 {runs[e][-1][f'tg{TG}@{depths[0]}']:.1f}" for e in runs), flush=True)
    keys = ([f"pp{PP}@{d}" for d in depths] + [f"tg{TG}@{d}" for d in depths]
            + [f"tgspec@{d}" for d in depths] + ["peak_rss_mb", "cold_start_s"])
    labels = {"peak_rss_mb": f"peak RSS MB (context {ctx})", "cold_start_s": "cold start s"}
    for d in depths:
        labels[f"pp{PP}@{d}"] = f"prefill tok/s, pp{PP} at depth {d}"
        labels[f"tg{TG}@{d}"] = f"decode tok/s, tg{TG} at depth {d}"
        labels[f"tgspec@{d}"] = f"decode, speculation on, depth {d}"
    print(f"\n| {'metric':34} | {'edgeinfer':>22} | {'llama.cpp':>22} | {'ratio':>5} |")
    print(f"|{'-' * 36}|{'-' * 24}|{'-' * 24}|{'-' * 7}|")
    for k in keys:
        a = [x[k] for x in runs["native"]]
        b = [x[k] for x in runs["llamacpp"]]
        ratio = statistics.median(a) / statistics.median(b)
        print(f"| {labels[k]:34} | {_fmt(a):>22} | {_fmt(b):>22} | {ratio:5.2f} |")
    # a decode token streams about the whole file (its weights; a tied output matrix is the
    # embedding table): its rate against what the memory gave around it
    size = os.path.getsize(args.model) / 1e9
    d0 = f"tg{TG}@{depths[0]}"
    cells = []
    for e in ("native", "llamacpp"):
        gbs = [x["read_gbs"] for x in runs[e]]
        share = [x[d0] * size / x["read_gbs"] for x in runs[e]]
        cells.append((gbs, share))
    print(f"| {'read GB/s around tg, depth ' + str(depths[0]):34} | {_fmt(cells[0][0]):>22} "
          f"| {_fmt(cells[1][0]):>22} | {'':5} |")
    print(f"| {'decode: weights read / memory rate':34} | {_fmt(cells[0][1], 2):>22} "
          f"| {_fmt(cells[1][1], 2):>22} | {'':5} |")
    if args.rss_context:
        n = args.rss_context
        fill = {e: run_worker(args, f"fill-{e}", ["--fill", str(n)]) for e in ("native", "llamacpp")}
        print(f"\ncontext of {n} tokens: peak RSS MB edgeinfer {fill['native']['peak_rss_mb']:.0f} "
              f"(KV pool {fill['native']['kv_mb']:.0f} MB), llama.cpp "
              f"{fill['llamacpp']['peak_rss_mb']:.0f}, ratio "
              f"{fill['native']['peak_rss_mb'] / fill['llamacpp']['peak_rss_mb']:.2f}")


if __name__ == "__main__":
    main()
