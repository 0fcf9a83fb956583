"""Time Sampler.sample() at Gemma 3's vocabulary size (262,144) for B=1 and B=8.

    NUMBA_CACHE_DIR=/tmp/numba-cache .venv/bin/python benchmarks/sampling.py [--reps 50]
        [--baseline GIT_REV] [--only SUBSTRING]

Two synthetic logit shapes: "peaked" (a handful of strong candidates over a N(0, 2) floor,
like a confident LM step) and "flat" (N(0, 3) everywhere, the worst case for top-p since
many tokens share the mass). Each sequence carries 512 tokens of history so penalties do
real work. Prints min, median and p90 milliseconds per call, and median per row (the
machine is shared: min is the least noisy figure).

Configs marked "+mask" give every row a token mask (structured output) allowing a random
10% of the vocabulary.

--baseline REV also loads the sampler (edgeinfer/runners/sampling.py; before the split,
edgeinfer/engine/sampling.py) as it was at git revision REV and
times it on the same unmasked configs, interleaved call by call with the current code (so
drift on a shared machine hits both alike), then prints the ratio current/baseline of the
min and median: the check that rows without a mask did not get slower.
"""
from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from edgeinfer.runners.sampling import Sampler

VOCAB = 262_144
MASK_DENSITY = 0.1

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
MASKED = {
    "greedy +mask": dict(temperature=0.0),
    "t0.8 k40 p0.9 +mask": dict(temperature=0.8, top_k=40, top_p=0.9, repeat_penalty=1.1),
    "t1.0 p0.95 +mask": dict(temperature=1.0, top_p=0.95),
    "greedy+logprobs5 +mask": dict(temperature=0.0, logprobs=5),
}


def make_logits(shape: str, batch: int, rng: np.random.Generator) -> np.ndarray:
    if shape == "flat":
        return (rng.standard_normal((batch, VOCAB)) * 3.0).astype(np.float32)
    x = (rng.standard_normal((batch, VOCAB)) * 2.0).astype(np.float32)
    for b in range(batch):
        hot = rng.choice(VOCAB, 8, replace=False)
        x[b, hot] += np.linspace(14.0, 8.0, 8, dtype=np.float32)
    return x


def make_states(mod, params_kw: dict, batch: int) -> list:
    rng = np.random.default_rng(0)
    states = []
    for _ in range(batch):
        st = mod.SeqSamplingState(mod.SamplingParams(seed=0, **params_kw),
                                  prompt_ids=rng.integers(0, VOCAB, 256))
        for t in rng.integers(0, VOCAB, 256):
            st.append(int(t))
        states.append(st)
    return states


def load_baseline(rev: str):
    src = ""
    for where in ("edgeinfer/runners/sampling.py", "edgeinfer/engine/sampling.py"):
        got = subprocess.run(["git", "show", f"{rev}:{where}"], capture_output=True, text=True)
        if got.returncode == 0:
            src = got.stdout
            break
    if not src:
        raise SystemExit(f"no sampler at revision {rev}")
    path = Path(tempfile.mkdtemp(prefix="sampling-baseline-")) / "sampling_baseline.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("sampling_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["sampling_baseline"] = mod
    spec.loader.exec_module(mod)
    return mod


def bench(calls: list, reps: int) -> list[np.ndarray]:
    """Time each zero-argument call `reps` times, interleaved; ms per call."""
    for c in calls:
        c()  # warm-up
    times = [np.empty(reps) for _ in calls]
    for i in range(reps):
        for c, t in zip(calls, times):
            t0 = time.perf_counter()
            c()
            t[i] = time.perf_counter() - t0
    return [t * 1e3 for t in times]


def fmt(name: str, shape: str, batch: int, t: np.ndarray) -> str:
    med = float(np.median(t))
    return (f"{name:28s} {shape:6s} {batch:2d} {float(t.min()):8.3f} {med:8.3f} "
            f"{float(np.percentile(t, 90)):8.3f} {med / batch:8.3f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--baseline", metavar="GIT_REV", help="compare with sampling.py at REV")
    ap.add_argument("--only", default="", help="only configs whose name contains this")
    args = ap.parse_args()
    cur = sys.modules[Sampler.__module__]
    base = load_baseline(args.baseline) if args.baseline else None
    rng = np.random.default_rng(1)
    print(f"V={VOCAB}, {args.reps} reps; ms per call (min / median / p90), ms per row (median)"
          + (f"; baseline = {args.baseline}, interleaved" if base else ""))
    head = (f"{'config':28s} {'shape':6s} {'B':>2s} {'min':>8s} {'median':>8s} {'p90':>8s} "
            f"{'per row':>8s}")
    print(head + ("   base min base med  min x  med x" if base else ""))
    for shape in ("peaked", "flat"):
        for batch in (1, 8):
            logits = make_logits(shape, batch, rng)
            masks = [rng.random(VOCAB) < MASK_DENSITY for _ in range(batch)]
            for name, kw in {**CONFIGS, **MASKED}.items():
                if args.only not in name:
                    continue
                masked = name in MASKED
                states = make_states(cur, kw, batch)
                sampler = Sampler()
                if masked:
                    calls = [lambda: sampler.sample(logits, states, masks)]
                else:
                    calls = [lambda: sampler.sample(logits, states)]
                if base is not None and not masked:
                    b_states, b_sampler = make_states(base, kw, batch), base.Sampler()
                    calls.append(lambda: b_sampler.sample(logits, b_states))
                ts = bench(calls, args.reps)
                line = fmt(name, shape, batch, ts[0])
                if len(ts) == 2:
                    t, tb = ts
                    line += (f" {float(tb.min()):8.3f} {float(np.median(tb)):8.3f} "
                             f"{t.min() / tb.min():6.2f} {np.median(t) / np.median(tb):6.2f}")
                print(line, flush=True)


if __name__ == "__main__":
    main()
