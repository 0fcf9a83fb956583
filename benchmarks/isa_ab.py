"""Repacked tiles with a chosen tile kernel vs the GGUF-block path: should a CPU without
AVX-512 VNNI repack by default?

    .venv/bin/python benchmarks/isa_ab.py [--model PATH] [--rounds 3] [--isas avx2,avxvnni]

Each round runs one fresh engine process per variant, in turn: `gguf` (EngineConfig
repack=False, as EDGEINFER_REPACK=0: the GGUF blocks decoded inside each matmul) and, per
name in --isas, the repacked tiles with that kernel forced (`_int8.BEST_ISA`, as on a CPU whose best is that one). Each measures a
512-token prefill and 128 greedy decode tokens (benchmarks/generate.py's pp512/tg128 at depth
0). Prints medians of the rounds (range) and each ISA's ratio to `gguf`.

On an AVX-512 host this is a conservative proxy for an AVX2-only CPU: numba compiles the GGUF
path for the host, so it gets AVX-512 here, while the forced tile kernel is AVX2 only.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import model_path, setup_env  # noqa: E402

PP, TG = 512, 128


def worker(model: str, isa: str) -> dict:
    from edgeinfer.backends.cpu import _int8
    if isa != "gguf":
        _int8.BEST_ISA = _int8.ISA_NAMES[isa]
        if _int8.BEST_ISA not in _int8.HOST_ISAS:
            raise SystemExit(f"this CPU cannot run the {isa} tile kernel")
    import numpy as np

    from edgeinfer.engine.core import Engine, EngineConfig
    from edgeinfer.runners.sampling_params import SamplingParams
    engine = Engine(model, EngineConfig(max_model_len=2048, kv_budget_bytes=1 << 28,
                                        max_tokens_per_step=PP, speculative=False,
                                        repack=isa != "gguf"))
    fmt = engine.runner.ops.weights_format
    rng = np.random.default_rng(0)
    ids = [2] + [int(t) for t in rng.integers(1000, 100_000, PP - 1)]
    engine.generate(ids[:64], SamplingParams(temperature=0, max_tokens=2))       # warm-up
    t = time.perf_counter()
    engine.generate(ids, SamplingParams(temperature=0, max_tokens=1))
    pp = PP / (time.perf_counter() - t)
    out = engine.generate(ids, SamplingParams(temperature=0, max_tokens=TG, ignore_eos=True))
    tg = (out.num_output_tokens - 1) / (out.finish_time - out.first_token_time)
    return {"pp": pp, "tg": tg, "format": fmt, "tokens": out.token_ids[:16]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--isas", default="avx2,avxvnni")
    ap.add_argument("--worker")
    a = ap.parse_args()
    setup_env(a.threads)
    model = model_path(a.model)
    if a.worker:
        print(json.dumps(worker(model, a.worker)))
        return
    variants = ["gguf"] + a.isas.split(",")
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for r in range(a.rounds):
        order = variants if r % 2 == 0 else variants[::-1]
        for v in order:
            p = subprocess.run([sys.executable, __file__, "--worker", v, "--model", model,
                                "--threads", str(a.threads)], capture_output=True, text=True)
            if p.returncode:
                raise SystemExit(f"{v} failed:\n{p.stderr[-3000:]}")
            runs[v].append(json.loads(p.stdout.strip().splitlines()[-1]))
        print(f"round {r + 1}: " + ", ".join(f"{v} tg {runs[v][-1]['tg']:.1f}" for v in variants),
              flush=True)
    same = all(x["tokens"] == runs["gguf"][0]["tokens"] for v in variants for x in runs[v])
    print(f"\nsame first 16 greedy tokens in every run: {same}")
    base = {k: statistics.median(x[k] for x in runs["gguf"]) for k in ("pp", "tg")}
    print("| variant | weights | prefill tok/s (pp512) | ratio | decode tok/s (tg128) | ratio |")
    print("|---|---|---:|---:|---:|---:|")
    for v in variants:
        cells = []
        for k in ("pp", "tg"):
            vals = [x[k] for x in runs[v]]
            med = statistics.median(vals)
            cells += [f"{med:.1f} ({min(vals):.1f}-{max(vals):.1f})", f"{med / base[k]:.2f}"]
        print(f"| {v} | {runs[v][0]['format']} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
