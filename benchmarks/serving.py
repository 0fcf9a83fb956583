"""Serving numbers on Gemma 3 270M Q4_K_M: edgeinfer's engine vs llama.cpp, same run.

    .venv/bin/python benchmarks/serving.py [--model PATH] [--threads 2] [--sections abcd]
        [--tokens 128] [--streams 1,2,4,8,16] [--rates 0.5,1,2,4] [--requests 16]
        [--plot docs/serving-throughput.png]

(a) aggregate decode throughput with 1..16 concurrent greedy streams (short distinct prompts,
    --tokens each), TPOT p50/p99 and ITL p99; how many 8-stream outputs equal their
    single-stream run; llama.cpp (llama-cpp-python, one request at a time, as its server
    runs) for reference: its aggregate is its single-stream rate at every concurrency.
(b) TTFT of a prompt whose 1,500-token prefix is cached vs cold (fresh prefix each round).
(c) Poisson arrivals at --rates: TTFT/TPOT p50/p95/p99 and goodput under the SLO
    TTFT < 1 s and TPOT < 100 ms (requests meeting both, per second of the run).
(d) the same arrival schedule and prompts against llama.cpp one request at a time.
The engine runs on its own thread, driven through submit() like the HTTP server drives it.
OpenMP waits as the package sets it (edgeinfer/__init__.py); absolute numbers on the shared
2-core machine drift run to run, the ratios within one run are the figures to read.
"""
from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, model_path, pctl, setup_env, table  # noqa: E402

# Filler text for long prompts, shared with tests/test_serving_real.py.
SENTENCES = tuple((REPO / "tests" / "data" / "sentences.txt").read_text().splitlines())
TOPICS = ("a dragon", "the moon", "a lost key", "the ocean", "a robot", "winter", "a city",
          "a violin", "the desert", "a train", "a garden", "a storm", "a library", "a comet",
          "a fox", "a bridge")


def short_prompts(engine, n: int) -> list[list[int]]:
    return [engine.encode_raw(f"Write a short story about {TOPICS[i % len(TOPICS)]}"
                              f"{'' if i < len(TOPICS) else f' (part {i})'}:") for i in range(n)]


def text_tokens(engine, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    ids: list[int] = []
    while len(ids) < n:
        ids = engine.encode_raw(" ".join(rng.choice(SENTENCES) for _ in range(n // 8 + 4)))
    return ids[:n]


@dataclass
class Trace:
    """One request's timeline (monotonic seconds)."""
    arrival: float
    first: float | None = None
    finish: float | None = None
    token_times: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)

    @property
    def ttft(self) -> float:
        return self.first - self.arrival

    @property
    def tpot(self) -> float:
        n = len(self.token_ids)
        return (self.finish - self.first) / (n - 1) if n > 1 else float("nan")

    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


# -- edgeinfer ---------------------------------------------------------------------------------
def submit_on_schedule(prompts: list[list[int]], arrivals: list[float] | None,
                       submit) -> list[Trace]:
    """Call submit(trace, prompt) for each prompt at its arrival offset (default: all now)."""
    arrivals = arrivals or [0.0] * len(prompts)
    traces: list[Trace] = []
    t0 = time.monotonic()
    for p, a in zip(prompts, arrivals):
        delay = t0 + a - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        tr = Trace(time.monotonic())
        traces.append(tr)
        submit(tr, p)
    return traces


class EngineClient:
    def __init__(self, path: str, speculative: bool = True):
        from edgeinfer.engine.core import Engine, EngineConfig
        self.engine = Engine(path, EngineConfig(kv_budget_bytes=512 << 20, max_running_seqs=16,
                                                max_tokens_per_step=512,
                                                speculative=speculative)).start()

    def run(self, prompts: list[list[int]], max_tokens: int,
            arrivals: list[float] | None = None) -> list[Trace]:
        """Submit each prompt at its arrival offset (default: all now); wait for all."""
        from edgeinfer.engine.core import greedy
        done = threading.Semaphore(0)

        def sink_for(tr: Trace):
            def sink(o):
                now = time.monotonic()
                if o.token_ids:
                    if tr.first is None:
                        tr.first = now
                    tr.token_times += [now] * len(o.token_ids)
                    tr.token_ids += o.token_ids
                if o.finished:
                    tr.finish = now
                    done.release()
            return sink
        traces = submit_on_schedule(prompts, arrivals, lambda tr, p: self.engine.submit(
            p, greedy(max_tokens, ignore_eos=True), sink_for(tr)))
        for _ in prompts:
            done.acquire()
        return traces

    def close(self):
        self.engine.shutdown()


# -- llama.cpp, one request at a time ------------------------------------------------------------
class LlamaClient:
    def __init__(self, path: str, threads: int):
        import llama_cpp
        self.llm = llama_cpp.Llama(model_path=path, n_ctx=4096, n_threads=threads,
                                   n_threads_batch=threads, n_batch=512, verbose=False)

    def one(self, tr: Trace, prompt: list[int], max_tokens: int) -> None:
        for tok in self.llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0,
                                     repeat_penalty=1.0):
            now = time.monotonic()
            if tr.first is None:
                tr.first = now
            tr.token_times.append(now)
            tr.token_ids.append(int(tok))
            if len(tr.token_ids) >= max_tokens:
                break
        tr.finish = time.monotonic()

    def run(self, prompts: list[list[int]], max_tokens: int,
            arrivals: list[float] | None = None) -> list[Trace]:
        """Arrivals on their schedule; a single worker serves them FIFO (queueing counts)."""
        import queue
        q: queue.SimpleQueue = queue.SimpleQueue()

        def worker():
            for _ in prompts:
                tr, p = q.get()
                self.one(tr, p, max_tokens)
        w = threading.Thread(target=worker)
        w.start()
        traces = submit_on_schedule(prompts, arrivals, lambda tr, p: q.put((tr, p)))
        w.join()
        return traces


def aggregate(traces: list[Trace]) -> float:
    start = min(t.arrival for t in traces)
    end = max(t.finish for t in traces)
    return sum(len(t.token_ids) for t in traces) / (end - start)


# -- sections ------------------------------------------------------------------------------------
def section_a(eng: EngineClient, llm: LlamaClient | None, streams: list[int], tokens: int,
              results: dict) -> None:
    prompts = short_prompts(eng.engine, max(streams))
    for c in (1, 2, 4):                                             # warm-up (JIT cache loads)
        eng.run(prompts[:c], 8)
    rows = []
    single = None
    for c in streams:
        trs = eng.run(prompts[:c], tokens)
        agg = aggregate(trs)
        single = single or agg
        itl = [x for t in trs for x in t.itls()]
        rows.append([c, agg, agg / single, 1000 * pctl([t.tpot for t in trs], 50),
                     1000 * pctl([t.tpot for t in trs], 99), 1000 * pctl(itl, 99)])
        results.setdefault("a", {})[c] = dict(agg=agg, tpot_p99=pctl([t.tpot for t in trs], 99),
                                              traces=trs)
    n_match = min(8, max(streams))
    batched = results["a"].get(8, results["a"][max(streams)])["traces"]
    alone = [eng.run([p], tokens)[0].token_ids for p in prompts[:n_match]]
    same = sum(a == b.token_ids for a, b in zip(alone, batched))
    agree = [next((i for i, (x, y) in enumerate(zip(a, b.token_ids)) if x != y), len(a))
             for a, b in zip(alone, batched)]
    results["match"] = (same, n_match)
    lrow = None
    if llm is not None:
        llm.run(prompts[:1], 8)
        ltr = llm.run(prompts[:4], tokens)                          # one at a time
        lagg = aggregate(ltr)
        ltpot = [t.tpot for t in ltr]
        results["llama_a"] = dict(agg=lagg, tpot_p99=pctl(ltpot, 99))
        lrow = ["llama.cpp 1-at-a-time", lagg, 1.0, 1000 * pctl(ltpot, 50),
                1000 * pctl(ltpot, 99), 1000 * pctl([x for t in ltr for x in t.itls()], 99)]
        rows.append(lrow)
    print(table(f"(a) aggregate decode throughput, {tokens} greedy tokens per stream "
                f"(edgeinfer; llama.cpp serves one request at a time, so its aggregate is the "
                f"same at every concurrency)",
                ["streams", "tok/s", "x single", "TPOT p50 ms", "TPOT p99 ms", "ITL p99 ms"],
                rows))
    print(f"\n{same} of {n_match} outputs in the {n_match}-stream batch equal the same prompt "
          f"run alone ({tokens} greedy tokens); tokens before the first difference: {agree}")
    if 8 in results["a"]:
        print(f"8 streams / 1 stream: {results['a'][8]['agg'] / single:.2f}x (target >= 2.5x)")


def section_b(eng: EngineClient, llm: LlamaClient | None, rounds: int, results: dict) -> None:
    from edgeinfer.engine.core import greedy
    e = eng.engine
    suffix_a = e.encode_raw(" Summarize the text above in one sentence.")[1:]
    suffix_b = e.encode_raw(" What is the second sentence about?")[1:]
    rows = []
    cold, warm, lcold, lwarm, cached = [], [], [], [], []
    for r in range(rounds):
        prefix = text_tokens(e, 1500, seed=1000 + r)
        t = eng.run([prefix + suffix_a], 1)[0]
        cold.append(t.ttft)
        t = eng.run([prefix + suffix_b], 1)[0]
        warm.append(t.ttft)
        if llm is not None:
            lt = Trace(time.monotonic())
            llm.one(lt, prefix + suffix_a, 1)
            lcold.append(lt.ttft)
            lt = Trace(time.monotonic())
            llm.one(lt, prefix + suffix_b, 1)
            lwarm.append(lt.ttft)
    cached.append(e.stats()["prefix_cached_tokens"])
    med = lambda v: pctl(v, 50)  # noqa: E731
    rows.append(["edgeinfer", 1000 * med(cold), 1000 * med(warm), med(warm) / med(cold)])
    if llm is not None:
        rows.append(["llama.cpp (own prompt cache)", 1000 * med(lcold), 1000 * med(lwarm),
                     med(lwarm) / med(lcold)])
    results["b"] = dict(cold=med(cold), warm=med(warm))
    print(table(f"(b) TTFT, 1,500-token prefix cached vs cold (median of {rounds} rounds, "
                f"~{len(suffix_a)}-token suffix)",
                ["engine", "cold ms", "prefix hit ms", "hit / cold"], rows))
    print(f"prefix-cache tokens served so far: {cached[-1]} (target hit/cold <= 0.1)")


def poisson(rate: float, n: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def load_prompts(engine, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [text_tokens(engine, rng.randint(20, 200), seed=seed * 1000 + i) for i in range(n)]


def slo_row(name: str, rate: float, trs: list[Trace]) -> tuple[list, dict]:
    ttft = [t.ttft for t in trs]
    tpot = [t.tpot for t in trs]
    ok = sum(1 for a, b in zip(ttft, tpot) if a < 1.0 and b < 0.1)
    span = max(t.finish for t in trs) - min(t.arrival for t in trs)
    d = dict(ttft=ttft, tpot=tpot, ok=ok, goodput=ok / span, tok_s=aggregate(trs))
    return ([name, rate, 1000 * pctl(ttft, 50), 1000 * pctl(ttft, 95), 1000 * pctl(ttft, 99),
             1000 * pctl(tpot, 50), 1000 * pctl(tpot, 95), 1000 * pctl(tpot, 99),
             d["tok_s"], f"{ok}/{len(trs)}", ok / span], d)


def section_cd(eng: EngineClient, llm: LlamaClient | None, rates: list[float], n: int,
               tokens: int, results: dict) -> None:
    rows = []
    for i, rate in enumerate(rates):
        arr = poisson(rate, n, seed=7 + i)
        prompts = load_prompts(eng.engine, n, seed=50 + i)
        row, d = slo_row("edgeinfer", rate, eng.run(prompts, tokens, arr))
        rows.append(row)
        results.setdefault("c", {})[rate] = d
        if llm is not None:
            row, d = slo_row("llama.cpp 1-at-a-time", rate, llm.run(prompts, tokens, arr))
            rows.append(row)
            results.setdefault("d", {})[rate] = d
    print(table(f"(c, d) Poisson arrivals, {n} requests per rate, 20-200-token prompts, "
                f"{tokens} greedy tokens each; goodput = requests meeting TTFT < 1 s and "
                f"TPOT < 100 ms, per second",
                ["engine", "req/s", "TTFT p50", "p95", "p99 ms", "TPOT p50", "p95", "p99 ms",
                 "tok/s", "in SLO", "goodput/s"], rows))


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = 3 if "c" in results else 2
    fig, ax = plt.subplots(1, panels, figsize=(5 * panels, 4))
    a = results["a"]
    cs = sorted(a)
    ax[0].plot(cs, [a[c]["agg"] for c in cs], "o-", label="edgeinfer (continuous batching)")
    ax[1].plot(cs, [1000 * a[c]["tpot_p99"] for c in cs], "o-", label="edgeinfer")
    if "llama_a" in results:
        la = results["llama_a"]
        ax[0].plot(cs, [la["agg"]] * len(cs), "s--", label="llama.cpp, one request at a time")
        ax[1].plot(cs, [1000 * la["tpot_p99"]] * len(cs), "s--", label="llama.cpp (per request)")
    ax[0].set(xlabel="concurrent streams", ylabel="aggregate decode tok/s", xscale="log",
              title="Throughput vs concurrency")
    ax[1].axhline(100, color="grey", lw=0.8, ls=":", label="SLO 100 ms")
    ax[1].set(xlabel="concurrent streams", ylabel="p99 TPOT (ms)", xscale="log",
              title="p99 time per output token")
    for x in ax[:2]:
        x.set_xticks(cs, [str(c) for c in cs])
    if "c" in results:
        rs = sorted(results["c"])
        ax[2].plot(rs, [results["c"][r]["goodput"] for r in rs], "o-", label="edgeinfer")
        if "d" in results:
            ax[2].plot(rs, [results["d"][r]["goodput"] for r in rs], "s--",
                       label="llama.cpp, one at a time")
        ax[2].plot(rs, rs, color="grey", lw=0.8, ls=":", label="offered load")
        ax[2].set(xlabel="Poisson arrival rate (req/s)", ylabel="goodput (req/s in SLO)",
                  title="Goodput (TTFT < 1 s, TPOT < 100 ms)")
    for x in ax:
        x.grid(alpha=0.3)
        x.legend(fontsize=8)
    fig.suptitle("Gemma 3 270M Q4_K_M, 2 CPU threads")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"\nplot: {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sections", default="abcd")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--streams", default="1,2,4,8,16")
    ap.add_argument("--rates", default="0.5,1,2,4")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--load-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument("--plot", default=str(REPO / "docs" / "serving-throughput.png"),
                    help="where section (a)'s plot goes ('' for none)")
    ap.add_argument("--speculative", choices=["on", "off"], default="on",
                    help="prompt-lookup speculation (the engine's default: on, for batches of "
                         "1-2, so it lifts the 1- and 2-stream rows; off: plain decoding)")
    args = ap.parse_args()
    setup_env(args.threads)
    import os
    path = model_path(args.model)
    print(f"model {path}; threads {args.threads}; OMP_WAIT_POLICY="
          f"{os.environ.get('OMP_WAIT_POLICY', 'unset')}, GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT')}")
    eng = EngineClient(path, speculative=args.speculative == "on")
    print(f"speculation {args.speculative}")
    llm = None if args.no_llama else LlamaClient(path, args.threads)
    results: dict = {}
    try:
        if "a" in args.sections:
            section_a(eng, llm, [int(s) for s in args.streams.split(",")], args.tokens, results)
        if "b" in args.sections:
            section_b(eng, llm, args.rounds, results)
        if "c" in args.sections:
            section_cd(eng, llm if "d" in args.sections else None,
                       [float(r) for r in args.rates.split(",")], args.requests,
                       args.load_tokens, results)
    finally:
        eng.close()
    if "a" in results and args.plot:
        plot(results, Path(args.plot))


if __name__ == "__main__":
    main()
