"""Engine prefill and decode with the working tree's tile kernels vs a git revision's.

    .venv/bin/python benchmarks/repack_decode_ab.py --base 7c317cb [--model M] [--rounds 5]

One engine (--model: a store name or a GGUF path; the bundled Gemma 3 270M by default), the
same repacked weights (repack.py must be the base's), two sets of tile kernels: ours, and
--base's _int8.py (benchmarks/repack_ab.py loads it; a shim in front of packed.py's kernel
call sends every product to one or the other, and the fused decode kernels' tables of
kernel addresses, backends/cpu/_layer.py's, are rewritten to point at one set or the other).
Rounds alternate the two on the same engine; each measures a 512-token prefill step and
64 greedy decode steps (tokens/s from the median step), and checks both generate the same
tokens. Prints the median and range of each and the ratio of medians.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO as ROOT, model_path, setup_env  # noqa: E402

def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True)
    ap.add_argument("--model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    a = ap.parse_args()
    setup_env(a.threads)
    import numpy as np

    from edgeinfer.backends.cpu import _int8, packed
    from edgeinfer.engine.core import Engine, EngineConfig
    from edgeinfer.runners.sampling_params import SamplingParams
    from repack_ab import load_base

    same_layout = subprocess.run(["git", "diff", "--quiet", a.base, "--", "backends/cpu/repack.py"],
                                 cwd=ROOT).returncode == 0
    if not same_layout:
        sys.exit(f"repack.py changed since {a.base}: the two kernels need the same weights")
    old8, _ = load_base(a.base)

    class Shim:
        """packed.py's view of _int8: its products go to the base's tile kernels or ours."""
        HAVE_VNNI = _int8.HAVE_VNNI
        HAVE_SIMD = _int8.HAVE_SIMD
        BEST_ISA = _int8.BEST_ISA
        isa_of = staticmethod(_int8.isa_of)
        which = _int8

        @classmethod
        def run_matmuls(cls, jobs, isa, nw, counter):
            cls.which.run_matmuls(jobs, isa, nw, counter)
    packed._int8 = Shim

    path = model_path(a.model)
    engine = Engine(path, EngineConfig(kv_budget_bytes=256 << 20, max_model_len=4096,
                                       max_tokens_per_step=2048, threads=a.threads,
                                       speculative=False))
    kernels = {"base": old8, "ours": _int8}
    ops = engine.runner.ops
    isa = _int8.BEST_ISA

    def use(name: str) -> None:
        """Every product on `name`'s tile kernels: packed.py's through the shim, the fused
        decode kernels' through their tables (ops._fused: P[m, 0] is matrix m's kernel)."""
        Shim.which = kernels[name]
        for P, _, mats in ops._fused.values():
            for m, w in enumerate(mats):
                P[m, 0] = kernels[name].kernel_address(w.fmt, isa)

    rng = np.random.default_rng(3)
    prompt = [2] + [int(x) for x in rng.integers(1000, 100_000, 511)]

    def run() -> tuple[float, float]:
        rid = engine.submit(prompt, SamplingParams(temperature=0, max_tokens=a.tokens + 1,
                                                   ignore_eos=True), lambda o: None)
        engine._drain_commands()
        t0 = time.perf_counter()
        engine.step()                                       # the 512-token prefill
        pre = time.perf_counter() - t0
        steps = []
        while engine.scheduler.get(rid) is not None:
            t0 = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t0)
        return pre, statistics.median(steps)

    engine.generate(prompt[:8], SamplingParams(temperature=0, max_tokens=2))   # the tables
    outs = {}
    for name in ("base", "ours"):
        use(name)
        r = engine.generate(prompt, SamplingParams(temperature=0, max_tokens=a.tokens,
                                                   ignore_eos=True))
        outs[name] = r.token_ids
    same = outs["base"] == outs["ours"]
    res = {"base": ([], []), "ours": ([], [])}
    for r in range(a.rounds):
        for name in ("base", "ours") if r % 2 == 0 else ("ours", "base"):
            use(name)
            prompt[1] = 1000 + 7 * r + (name == "ours")       # no prefix-cache hit
            pre, step = run()
            res[name][0].append(512 / pre)
            res[name][1].append(1 / step)
    print(f"same {a.tokens} greedy tokens: {same}")
    for i, label in enumerate(("prefill tok/s (512)", "decode tok/s")):
        b, o = res["base"][i], res["ours"][i]
        print(f"{label:20} base {statistics.median(b):7.1f} [{min(b):.1f}-{max(b):.1f}]   ours "
              f"{statistics.median(o):7.1f} [{min(o):.1f}-{max(o):.1f}]   ours/base "
              f"{statistics.median(o) / statistics.median(b):.3f}   ({a.threads} threads, "
              f"{a.rounds} rounds)")
    engine.close()


if __name__ == "__main__":
    main()
