"""The int8 tile kernels of the working tree against a git revision's, per weight format, on
a model's real layer products, in one process.

    .venv/bin/python benchmarks/tile_ab.py --base REV [--model PATH] [--rows 512]
        [--layers 8] [--rounds 15] [--threads 2]

One activation quantization per matrix, shared (only the tile kernels differ): each format's
products of the first --layers layers (q, k, v, o, gate, up, down) are run by both kernel
sets, alternating which goes first, for --rounds rounds; per format it prints whether the
outputs are bit-identical, the median time of each, and the median and quartiles of the
per-round speed ratios. Paired rounds, because this machine's phases move whole-model
numbers by 20-30% within minutes. `repack_ab.py` times a whole-model pass instead.
"""
from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import model_path, setup_env  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True, help="git revision of the old kernels")
    ap.add_argument("--model", default="qwen2.5-coder:0.5b", help="a GGUF path or a store name")
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    setup_env(a.threads)
    from edgeinfer.backends.cpu import _int8, packed
    from edgeinfer.engine.core import Engine, EngineConfig
    from repack_ab import load_base
    base, _ = load_base(a.base)
    eng = Engine(model_path(a.model), EngineConfig(kv_budget_bytes=1 << 26, max_model_len=1024,
                                                   threads=a.threads, speculative=False))
    rng = np.random.default_rng(0)
    groups = collections.defaultdict(list)       # format -> [(job, matrix)]
    for layer in eng.runner.model.layers[:a.layers]:
        for w in (layer.wq, layer.wk, layer.wv, layer.wo, layer.w_gate, layer.w_up, layer.w_down):
            x = rng.standard_normal((a.rows, w.K)).astype(np.float32)
            codes = packed.ActCodes(x, w.A, w.B, w.zero_point, True)
            job = (w.fmt, w.W, *codes.arrays(w.zero_point), np.empty((a.rows, w.N), np.float32))
            groups[w.qtype.name].append((job, w))
    kernels = {"base": base, "ours": _int8}

    def run(k, jobs) -> None:
        for job, _ in jobs:
            k.run_matmuls([job], k.BEST_ISA, a.threads, np.zeros(1, np.int64))

    for fmt, jobs in groups.items():
        outs = {}
        for name, k in kernels.items():
            run(k, jobs)
            outs[name] = [job[-1].copy() for job, _ in jobs]
        same = all(np.array_equal(x.view(np.uint32), y.view(np.uint32))
                   for x, y in zip(outs["base"], outs["ours"]))
        print(f"{fmt}: {len(jobs)} products, {'bit-identical' if same else 'DIFFERENT BITS'}")
    times = {name: collections.defaultdict(list) for name in kernels}
    ratios = collections.defaultdict(list)
    for r in range(a.rounds):
        for fmt, jobs in groups.items():
            t = {}
            for name in (("base", "ours") if r % 2 == 0 else ("ours", "base")):
                t0 = time.perf_counter()
                run(kernels[name], jobs)
                t[name] = time.perf_counter() - t0
                times[name][fmt].append(t[name])
            ratios[fmt].append(t["base"] / t["ours"])
    print(f"\n{a.rows} rows, {a.threads} threads, {a.rounds} paired rounds")
    for fmt, jobs in groups.items():
        macs = sum(a.rows * w.N * w.K for _, w in jobs)
        b, o = statistics.median(times["base"][fmt]), statistics.median(times["ours"][fmt])
        rr = sorted(ratios[fmt])
        print(f"{fmt:6} base {b * 1e3:7.1f} ms  ours {o * 1e3:7.1f} ms "
              f"({macs / o / 1e9 / a.threads:4.0f} GMAC/s a thread)  speed "
              f"{statistics.median(rr):.3f} (quartiles {rr[len(rr) // 4]:.3f}-{rr[3 * len(rr) // 4]:.3f})")


if __name__ == "__main__":
    main()
