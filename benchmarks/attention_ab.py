"""The prefill attention kernel of the working tree against a git revision's, in one process.

    .venv/bin/python benchmarks/attention_ab.py --base REV [--heads 12] [--kv-heads 2]
        [--dim 128] [--depth 2048] [--tokens 512] [--rounds 9] [--threads 2]

One layer's causal attention of --tokens new tokens after --depth tokens of context (an f16
pool in random block order, ggml rounding, as the CPU backend calls it), run by both kernels
alternately for --rounds paired rounds: whether the outputs are bit-identical, the median
time of each, the cycles per (row, key) pair at 4.27 GHz with all threads counted, and the
median and quartiles of the per-round speed ratios. Defaults: Qwen2.5 1.5B's attention;
Gemma 3 270M's is --heads 4 --kv-heads 1 --dim 256, Qwen2.5 0.5B's --heads 14 --dim 64.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_modules_at, setup_env  # noqa: E402

GHZ = 4.27


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True, help="git revision of the old kernel")
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--depth", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    setup_env(a.threads)
    from edgeinfer.backends.cpu import attention as ours
    kernels = {"base": cpu_modules_at(a.base, "attention")[0], "ours": ours}
    rng = np.random.default_rng(0)
    H, KVH, D, bs, T = a.heads, a.kv_heads, a.dim, 16, a.tokens
    nblk = (a.depth + T + bs - 1) // bs
    k, v = (rng.standard_normal((nblk, bs, KVH, D)).astype(np.float16).view(np.uint16)
            for _ in range(2))
    tables = rng.permutation(nblk).astype(np.int32).reshape(1, -1)
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    seq = np.zeros(T, np.int32)
    pos = np.arange(a.depth, a.depth + T, dtype=np.int32)
    scale = float(D) ** -0.5

    def run(kern) -> np.ndarray:
        out = np.empty_like(q)
        # heads_per_item None: the plan the CPU backend's ops take
        kern.paged_attention(q, k, v, tables, seq, pos, 0, scale, True, out, True,
                             heads_per_item=None)
        return out

    outs = {name: run(kern) for name, kern in kernels.items()}
    same = np.array_equal(outs["base"].view(np.uint32), outs["ours"].view(np.uint32))
    times = {name: [] for name in kernels}
    ratios = []
    for r in range(a.rounds):
        t = {}
        for name in (("base", "ours") if r % 2 == 0 else ("ours", "base")):
            t0 = time.perf_counter()
            run(kernels[name])
            t[name] = time.perf_counter() - t0
            times[name].append(t[name])
        ratios.append(t["base"] / t["ours"])
    pairs = T * H * (a.depth + (T + 1) / 2)
    print(f"H={H} KVH={KVH} D={D}, {T} tokens after {a.depth}, {a.threads} threads, "
          f"{a.rounds} paired rounds: {'bit-identical' if same else 'DIFFERENT BITS'}")
    for name in kernels:
        m = statistics.median(times[name])
        print(f"{name:5} {m * 1e3:7.2f} ms  {m * a.threads * GHZ * 1e9 / pairs:5.2f} cycles a pair")
    rr = sorted(ratios)
    print(f"speed {statistics.median(rr):.3f} (quartiles {rr[len(rr) // 4]:.3f}-"
          f"{rr[3 * len(rr) // 4]:.3f})")


if __name__ == "__main__":
    main()
