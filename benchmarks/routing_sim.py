"""Routing across replicas, simulated: prefix affinity vs round-robin vs power of two.

32 replicas, each a FIFO server with its own prefix cache (an LRU of full KV blocks, the
size of its pool), under a synthetic trace of multi-turn chats that share a handful of
long system prompts. Each turn's prompt is the system prompt, the whole conversation so
far and a new user message; what a replica has cached of it (the longest run of leading
blocks it still holds) is not prefilled again.

The affinity policy is edgeinfer.scaleout.affinity.AffinityPolicy itself, the one the Ray
router runs, fed the same chained block keys and the replicas' queue lengths at arrival.

Service model (stated, not measured): a request occupies its replica for
prefill (uncached prompt tokens / PREFILL_TPS) + decode (output tokens x DECODE_S_PER_TOKEN);
TTFT = wait in the replica's queue + its prefill. Load imbalance = the busiest replica's
work over the mean. Numbers are for comparing policies on one trace, not for capacity
planning.

    .venv/bin/python benchmarks/routing_sim.py [--replicas 32] [--rate 28] [--seconds 600]
                                               [--plot docs/scale-out-routing.png]
"""
from __future__ import annotations

import argparse
import itertools
import random
import statistics
import sys
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from edgeinfer.scaleout.affinity import AffinityPolicy, power_of_two  # noqa: E402

BLOCK = 16
PREFILL_TPS = 8000.0            # uncached prompt tokens per second, per replica
DECODE_S_PER_TOKEN = 0.002      # a request's share of a batched decode step
CACHE_BLOCKS = 6000             # ~96k tokens of KV per replica


@dataclass
class Request:
    arrival: float
    blocks: list[int]           # chained keys of the prompt's full blocks
    prompt_tokens: int
    output_tokens: int


def make_trace(seconds: float, rate: float, seed: int = 0, system_prompts: int = 8,
               turns_mean: float = 4.0, think_s: float = 20.0) -> list[Request]:
    """Conversations arrive (Poisson) so that requests come at about `rate` per second."""
    rng = random.Random(seed)
    uid = itertools.count(1)
    sys_lens = [rng.randint(800, 2400) for _ in range(system_prompts)]
    sys_blocks = [[next(uid) for _ in range(n // BLOCK)] for n in sys_lens]
    weights = [1 / (i + 1) for i in range(system_prompts)]          # Zipf-like popularity
    conv_rate = rate / turns_mean
    reqs: list[Request] = []
    t = 0.0
    while True:
        t += rng.expovariate(conv_rate)
        if t > seconds:
            break
        s = rng.choices(range(system_prompts), weights)[0]
        blocks = list(sys_blocks[s])
        tokens = sys_lens[s]
        at = t
        turns = 1 + int(rng.expovariate(1 / (turns_mean - 1)))
        for _ in range(turns):
            user = rng.randint(30, 300)
            tokens += user
            # the conversation's own blocks: unique to it, chained after the system prompt
            while len(blocks) < tokens // BLOCK:
                blocks.append(next(uid))
            out = rng.randint(50, 400)
            reqs.append(Request(at, list(blocks), tokens, out))
            tokens += out                  # the reply becomes part of the next prompt
            at += rng.expovariate(1 / think_s) + 2.0
    reqs.sort(key=lambda r: r.arrival)
    return reqs


@dataclass
class Replica:
    cache: OrderedDict = field(default_factory=OrderedDict)
    free_at: float = 0.0
    finishes: deque = field(default_factory=deque)
    work: float = 0.0

    def outstanding(self, now: float) -> int:
        while self.finishes and self.finishes[0] <= now:
            self.finishes.popleft()
        return len(self.finishes)

    def cached_blocks(self, blocks: list[int]) -> int:
        n = 0
        for b in blocks:
            if b not in self.cache:
                break
            n += 1
        return n

    def touch(self, blocks: list[int]) -> None:
        for b in blocks:
            self.cache[b] = None
            self.cache.move_to_end(b)
        while len(self.cache) > CACHE_BLOCKS:
            self.cache.popitem(last=False)


def simulate(trace: list[Request], n: int, policy: str, seed: int = 0,
             imbalance: int = 0) -> dict:
    rng = random.Random(seed)
    reps = [Replica() for _ in range(n)]
    ids = list(range(n))
    aff = AffinityPolicy(imbalance=imbalance, capacity_blocks=CACHE_BLOCKS, rng=rng)
    rr = itertools.cycle(ids)
    ttfts, hit_tokens, prompt_tokens = [], 0, 0
    for req in trace:
        now = req.arrival
        load = {i: reps[i].outstanding(now) for i in ids}
        if policy == "round-robin":
            i = next(rr)
        elif policy == "power-of-two":
            i = power_of_two(ids, load, rng)[0]
        else:
            i = aff.choose(req.blocks, ids, load)[0]
            aff.record(req.blocks, i)
        r = reps[i]
        # the last token is always recomputed (as the engine does)
        hit = min(r.cached_blocks(req.blocks) * BLOCK, req.prompt_tokens - 1)
        prefill = (req.prompt_tokens - hit) / PREFILL_TPS
        service = prefill + req.output_tokens * DECODE_S_PER_TOKEN
        start = max(now, r.free_at)
        r.free_at = start + service
        r.finishes.append(r.free_at)
        r.work += service
        r.touch(req.blocks)
        ttfts.append(start - now + prefill)
        hit_tokens += hit
        prompt_tokens += req.prompt_tokens
    work = [r.work for r in reps]
    q = statistics.quantiles(ttfts, n=100)
    name = policy if policy != "affinity" else f"affinity (gap {imbalance})"
    out = {"policy": name, "requests": len(trace),
           "prefix_hit_rate": hit_tokens / prompt_tokens,
           "imbalance": max(work) / statistics.mean(work),
           "ttft_mean": statistics.mean(ttfts), "ttft_p50": q[49], "ttft_p99": q[98]}
    if policy == "affinity":
        out["routing"] = aff.counts.as_dict()
        out["imbalance_setting"] = imbalance
    return out


def table(results: list[dict]) -> str:
    lines = ["| policy | prefix hit rate | load imbalance (max/mean) | TTFT mean | TTFT p50 | "
             "TTFT p99 |", "|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['policy']} | {r['prefix_hit_rate']:.1%} | {r['imbalance']:.2f} | "
                     f"{r['ttft_mean'] * 1000:.0f} ms | {r['ttft_p50'] * 1000:.0f} ms | "
                     f"{r['ttft_p99'] * 1000:.0f} ms |")
    return "\n".join(lines)


def plot(results: list[dict], path: Path, replicas: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = [r["policy"].replace(" (", "\n(") for r in results]
    colors = ["#888888", "#4c72b0", "#dd8452", "#55a868", "#c44e52"][:len(names)]
    fig, ax = plt.subplots(1, 3, figsize=(12, 3.6))
    ax[0].bar(names, [r["prefix_hit_rate"] * 100 for r in results], color=colors)
    ax[0].set_title("prefix hit rate (% of prompt tokens)")
    ax[1].bar(names, [r["imbalance"] for r in results], color=colors)
    ax[1].set_title("load imbalance (max / mean work)")
    x = range(len(names))
    ax[2].bar([i - 0.2 for i in x], [r["ttft_p50"] * 1000 for r in results], 0.4,
              label="p50", color=colors)
    ax[2].bar([i + 0.2 for i in x], [r["ttft_p99"] * 1000 for r in results], 0.4,
              label="p99", color=colors, alpha=0.5)
    ax[2].set_xticks(list(x), names)
    ax[2].set_yscale("log")
    ax[2].set_title("TTFT ms (p50 solid, p99 light)")
    for a in ax:
        a.tick_params(axis="x", labelsize=8)
    fig.suptitle(f"{results[0]['requests']} requests, {replicas} replicas, shared system prompts + "
                 "multi-turn chats (simulated)", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=32)
    ap.add_argument("--rate", type=float, default=28.0, help="requests per second")
    ap.add_argument("--seconds", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gaps", type=int, nargs="+", default=[0, 4],
                    help="affinity's overload gap(s): queue length over the least loaded "
                         "replica beyond which it falls back to power of two (default: 0 4; "
                         "the server's default is 0)")
    ap.add_argument("--plot", type=Path)
    args = ap.parse_args(argv)
    trace = make_trace(args.seconds, args.rate, args.seed)
    results = [simulate(trace, args.replicas, p, args.seed)
               for p in ("round-robin", "power-of-two")]
    results += [simulate(trace, args.replicas, "affinity", args.seed, gap)
                for gap in args.gaps]
    print(f"{len(trace)} requests over {args.seconds:.0f} s, {args.replicas} replicas\n")
    print(table(results))
    for r in results:
        if "routing" in r:
            print(f"{r['policy']} decisions: {r['routing']}")
    if args.plot:
        plot(results, args.plot, args.replicas)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
