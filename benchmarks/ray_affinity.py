"""Prefix affinity on a running `edgeinfer serve --ray`: do repeated prefixes come back to the
replica that caches them?

Sends P long system prompts (different from the first word on) once each, then each again
with another question, and counts the second sends whose prompt came from the cache
(cached_tokens at least 90% of the first send's prompt). Run it against a daemon started with
`--routing affinity` (the default) and one with `--routing pow2` to compare:

    edgeinfer serve --ray --replicas 2 --port 18200 [--routing pow2] &
    .venv/bin/python benchmarks/ray_affinity.py --url http://127.0.0.1:18200 --model NAME

Measured here: see docs/scale-out.md.
"""
from __future__ import annotations

import argparse
import random

import httpx

WORDS = "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod".split()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:11435")
    ap.add_argument("--model", required=True)
    ap.add_argument("--prefixes", type=int, default=10)
    ap.add_argument("--words", type=int, default=260, help="words per system prompt")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--api-key")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

    def send(system: str, question: str) -> tuple[str, int, int]:
        r = httpx.post(args.url + "/v1/chat/completions", headers=headers, timeout=300, json={
            "model": args.model, "max_tokens": 2, "messages": [
                {"role": "system", "content": system}, {"role": "user", "content": question}]})
        r.raise_for_status()
        u = r.json()["usage"]
        return (r.headers.get("x-edgeinfer-replica", "?"), u["prompt_tokens"],
                u["prompt_tokens_details"]["cached_tokens"])

    for i in range(8):                  # load the model on the replicas first
        send(f"{rng.random()} warm-up", "x")
    prompts = [f"{rng.random()} " + " ".join(rng.choice(WORDS) for _ in range(args.words))
               for _ in range(args.prefixes)]
    first = [send(p, "first question") for p in prompts]
    second = [send(p, "second question") for p in prompts]
    hits = sum(1 for (_, n, _), (_, _, c) in zip(first, second) if c >= 0.9 * n)
    same = sum(1 for (a, _, _), (b, _, _) in zip(first, second) if a == b)
    print(f"{args.prefixes} prefixes of ~{sum(n for _, n, _ in first) // len(first)} tokens: "
          f"second sends with the prefix cached {hits}/{args.prefixes}, "
          f"on the first send's replica {same}/{args.prefixes}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
