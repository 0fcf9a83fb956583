"""Where a step's time goes: prefill of 512 and 2,048 tokens, decode at 0, 2K and 8K context.

    .venv/bin/python benchmarks/profile.py [--model PATH] [--threads 2] [--repeats 3]
        [--scenarios prefill512,prefill2048,prefill512@2048,decode0,decode2k,decode8k]
        [--markdown FILE]
        [--baseline per-matrix] [--by-op]

Each op of the CPU backend is timed on its own (a wrapper on the ops object; the int8 path's
activation quantization and tile matmul are timed apart), and so is sampling. "Python between
kernels" is the step's wall time minus all of them: batch building, the scheduler, the
engine's bookkeeping and the interpreter between calls. Shares are of the median step of
`--repeats` measured steps; the machine drifts, so read the shares, not the milliseconds.

`--baseline per-matrix` runs the activation path as it was before shared quantization (one
scalar quantization per matrix: ops.matmuls as a loop of ops.matmul, _actquant's scalar
reference), kernels.rms_norm (one row at a time, not _norm's eight) and kernels' scalar GeGLU
(not _geglu's 16 lanes): alternate runs with and without it for an A/B comparison in one
session.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import model_path, setup_env, table  # noqa: E402

GROUPS = {
    "matmul": ("matmul", "matmuls", "swiglu_matmul"),
    "attention": ("attention",),
    "norms / rope / activations": ("rms_norm", "rope", "geglu", "swiglu", "add", "scale",
                                   "embed", "take_rows", "add_bias", "add_rms_norm",
                                   "norm_rope"),
}
# A decode step of the llama family runs its layers through fused calls (backends/cpu/fused.py:
# norm, q/k/v and rope in one; the output projection, norm and FFN in another; the head), not
# through the ops above; those calls are timed as one column, their attention apart.
FUSED_CALLS = {"FusedLayer": ("attn_in", "attn_out", "attn_out_ffn"),
               "FusedHead": ("__call__",)}
COLUMNS = ["matmul (int8 tiles)", "activation quantization", "attention",
           "norms / rope / activations", "fused layer calls", "sampling",
           "Python between kernels"]


class Timers:
    def __init__(self):
        self.t: dict[str, float] = defaultdict(float)       # by group (COLUMNS)
        self.op: dict[str, float] = defaultdict(float)      # by op name (--by-op)

    def wrap(self, name: str, fn, op: str | None = None):
        op = op or name

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                dt = time.perf_counter() - t0
                self.t[name] += dt
                self.op[op] += dt
        return timed


def instrument(engine, timers: Timers) -> None:
    import edgeinfer.backends.cpu._actquant as aq
    ops = engine.runner.ops
    for group, names in GROUPS.items():
        for n in names:
            if hasattr(ops, n):
                setattr(ops, n, timers.wrap(group, getattr(ops, n), n))
    # inside ops.matmul on the int8 path: quantizing activations (the rest is the tile kernel)
    aq.quantize_rows = timers.wrap("quantize", aq.quantize_rows, "quantize_rows")
    if hasattr(aq, "quantize_swiglu_rows"):         # (not in older trees: A/B runs)
        aq.quantize_swiglu_rows = timers.wrap("quantize", aq.quantize_swiglu_rows,
                                              "quantize_swiglu_rows")
    stage = engine.runner.sampling
    stage.sample = timers.wrap("sampling", stage.sample)
    try:
        from edgeinfer.backends.cpu import fused
    except ImportError:                 # (older trees: A/B runs)
        return
    for cls, names in FUSED_CALLS.items():
        klass = getattr(fused, cls, None)
        for n in names:
            if klass is not None and hasattr(klass, n):
                setattr(klass, n, timers.wrap("fused", getattr(klass, n), f"{cls}.{n}"))
    # a fused step's attention (its fallback, ops.attention, is timed above too: steps with
    # a sliding window, image rows or a q8_0 cache would count it twice)
    if hasattr(fused, "LayerStep"):
        fused.LayerStep.attend = timers.wrap("attention", fused.LayerStep.attend,
                                             "LayerStep.attend")


def per_matrix_baseline(engine) -> None:
    """One scalar quantization per matrix, as before ops.matmuls and the vector quantizer;
    the one-row-at-a-time RMS norm and the scalar GeGLU."""
    import edgeinfer.backends.cpu._actquant as aq
    import edgeinfer.backends.cpu._geglu as geglu
    import edgeinfer.backends.cpu._norm as norm
    import edgeinfer.backends.cpu.kernels as K
    norm.rms_norm = K.rms_norm
    geglu.gelu_tanh_mul_f16 = K.gelu_tanh_mul_f16
    ops = engine.runner.ops
    one = ops.matmul        # not the timed wrapper: the matmuls wrapper counts these
    ops.matmuls = lambda x, ws: tuple(one(x, w) for w in ws)
    aq.quantize_rows = aq.quantize_rows_ref


def one_step(engine, timers: Timers) -> dict[str, float]:
    timers.t.clear()
    timers.op.clear()
    t0 = time.perf_counter()
    engine.step()
    wall = time.perf_counter() - t0
    t = dict(timers.t)
    matmul_total = t.get("matmul", 0.0)
    quant = t.get("quantize", 0.0)
    row = {"wall": wall,
           "matmul (int8 tiles)": matmul_total - quant,
           "activation quantization": quant,
           "attention": t.get("attention", 0.0),
           "norms / rope / activations": t.get("norms / rope / activations", 0.0),
           "fused layer calls": t.get("fused", 0.0),
           "sampling": t.get("sampling", 0.0)}
    row["Python between kernels"] = wall - sum(row[c] for c in COLUMNS[:-1])
    row["by_op"] = dict(timers.op)      # ops' times include the quantization inside them
    return row


def prompt_of(engine, n: int, salt: int) -> list[int]:
    import numpy as np
    rng = np.random.default_rng(salt)
    return [2] + [int(x) for x in rng.integers(1000, 100_000, n - 1)]


def scenario(engine, timers: Timers, name: str, repeats: int) -> dict[str, float]:
    from edgeinfer.runners.sampling_params import SamplingParams
    rows = []
    for r in range(repeats):
        if name.startswith("prefill"):
            # prefillN, or prefillN@D: N new tokens after D already in the context (the
            # context's blocks come from the prefix cache, as in generate.py's pp512@2048)
            n, _, depth = name[len("prefill"):].partition("@")
            n, depth = int(n), int(depth or 0)
            prompt = prompt_of(engine, depth + n, 100 + r)
            if depth:
                engine.generate(prompt[:depth], SamplingParams(temperature=0, max_tokens=1))
            engine.submit(prompt, SamplingParams(temperature=0, max_tokens=1), lambda o: None)
            engine._drain_commands()
            rows.append(one_step(engine, timers))       # one step: the budget covers n tokens
            while engine.scheduler.has_work():
                engine.step()
        else:
            ctx = {"decode0": 1, "decode2k": 2048, "decode8k": 8192}[name]
            rid = engine.submit(prompt_of(engine, ctx, 200 + r),
                                SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                                lambda o: None)
            engine._drain_commands()
            while engine.scheduler.get(rid) is not None and \
                    engine.scheduler.get(rid).is_prefilling:
                engine.step()
            engine.step()                                 # the first sampled token
            rows.append(one_step(engine, timers))
            engine.abort(rid)
            engine._drain_commands()
            while engine.scheduler.has_work():
                engine.step()
    walls = sorted(rows, key=lambda r: r["wall"])
    return walls[len(walls) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--scenarios", default="prefill512,prefill2048,decode0,decode2k,decode8k")
    ap.add_argument("--markdown")
    ap.add_argument("--baseline", choices=["per-matrix"])
    ap.add_argument("--by-op", action="store_true",
                    help="also list each op's time in the median step (ops.matmuls, "
                    "ops.swiglu_matmul, ...; the quantizers inside them listed apart too)")
    a = ap.parse_args()
    setup_env(a.threads)
    from edgeinfer.engine.core import Engine, EngineConfig
    engine = Engine(model_path(a.model), EngineConfig(
        kv_budget_bytes=1 << 30, max_model_len=8192 + 64, max_tokens_per_step=2048,
        threads=a.threads, speculative=False))
    timers = Timers()
    if a.baseline == "per-matrix":
        per_matrix_baseline(engine)
    instrument(engine, timers)
    engine.generate(prompt_of(engine, 64, 1), __import__(
        "edgeinfer.runners.sampling_params", fromlist=["SamplingParams"]).SamplingParams(
        temperature=0, max_tokens=2))                     # warm-up
    results = {}
    for name in a.scenarios.split(","):
        results[name] = scenario(engine, timers, name, a.repeats)
        print(f"{name}: {results[name]['wall'] * 1e3:.1f} ms", flush=True)
    header = ["step", "ms"] + [f"{c} %" for c in COLUMNS]
    rows = [[name, r["wall"] * 1e3] + [100 * r[c] / r["wall"] for c in COLUMNS]
            for name, r in results.items()]
    text = table(f"Share of the median step ({a.threads} threads, median of {a.repeats})",
                 header, rows)
    print(text)
    if a.by_op:
        for name, r in results.items():
            print(f"\n{name}, by op (ms, % of the step):")
            for op, t in sorted(r["by_op"].items(), key=lambda kv: -kv[1]):
                print(f"  {op:24} {t * 1e3:9.2f}  {100 * t / r['wall']:5.1f}%")
    if a.markdown:
        Path(a.markdown).write_text(text + "\n")
    engine.close()


if __name__ == "__main__":
    main()
