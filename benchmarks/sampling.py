"""Time Sampler.sample() at Gemma 3's vocabulary size (262,144) for B=1 and B=8.

    NUMBA_CACHE_DIR=/tmp/numba-cache .venv/bin/python benchmarks/sampling.py [--reps 50]

Two synthetic logit shapes: "peaked" (a handful of strong candidates over a N(0, 2) floor,
like a confident LM step) and "flat" (N(0, 3) everywhere, the worst case for top-p since
many tokens share the mass). Each sequence carries 512 tokens of history so penalties do
real work. Prints min, median and p90 milliseconds per call, and median per row (the
machine is shared: min is the least noisy figure).
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from edgeinfer.engine.sampling import SamplingParams, Sampler, SeqSamplingState

VOCAB = 262_144

CONFIGS = {
    "greedy": dict(temperature=0.0),
    "greedy+repeat1.1": dict(temperature=0.0, repeat_penalty=1.1, repeat_last_n=64),
    "greedy+logprobs5": dict(temperature=0.0, logprobs=5),
    "t0.8 k40 p0.9 (ollama)": dict(temperature=0.8, top_k=40, top_p=0.9, repeat_penalty=1.1),
    "t1.0 p0.95 (no top-k)": dict(temperature=1.0, top_p=0.95),
    "t0.8 min_p0.05": dict(temperature=0.8, min_p=0.05),
    "t1.0 untruncated": dict(temperature=1.0),
    "t0.7 k40 p0.9 freq/pres": dict(temperature=0.7, top_k=40, top_p=0.9,
                                    frequency_penalty=0.3, presence_penalty=0.3),
}


def make_logits(shape: str, batch: int, rng: np.random.Generator) -> np.ndarray:
    if shape == "flat":
        return (rng.standard_normal((batch, VOCAB)) * 3.0).astype(np.float32)
    x = (rng.standard_normal((batch, VOCAB)) * 2.0).astype(np.float32)
    for b in range(batch):
        hot = rng.choice(VOCAB, 8, replace=False)
        x[b, hot] += np.linspace(14.0, 8.0, 8, dtype=np.float32)
    return x


def bench(params: SamplingParams, logits: np.ndarray, reps: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    states = []
    for _ in range(logits.shape[0]):
        st = SeqSamplingState(params, prompt_ids=rng.integers(0, VOCAB, 256))
        for t in rng.integers(0, VOCAB, 256):
            st.append(int(t))
        states.append(st)
    sampler = Sampler()
    sampler.sample(logits, states)  # warm-up
    times = np.empty(reps)
    for i in range(reps):
        t0 = time.perf_counter()
        sampler.sample(logits, states)
        times[i] = time.perf_counter() - t0
    return times * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    rng = np.random.default_rng(1)
    print(f"V={VOCAB}, {args.reps} reps; ms per call (min / median / p90), ms per row (median)")
    print(f"{'config':28s} {'shape':6s} {'B':>2s} {'min':>8s} {'median':>8s} {'p90':>8s} "
          f"{'per row':>8s}")
    for shape in ("peaked", "flat"):
        for batch in (1, 8):
            logits = make_logits(shape, batch, rng)
            for name, kw in CONFIGS.items():
                t = bench(SamplingParams(seed=0, **kw), logits, args.reps)
                med = float(np.median(t))
                print(f"{name:28s} {shape:6s} {batch:2d} {float(t.min()):8.3f} {med:8.3f} "
                      f"{float(np.percentile(t, 90)):8.3f} {med / batch:8.3f}")


if __name__ == "__main__":
    main()
