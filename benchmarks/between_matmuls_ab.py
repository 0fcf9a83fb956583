"""In-process A/B of the work between the matmuls (issue 15): the same engine, steps
alternating between the new path and the old one (per-matrix scalar quantization, one-row RMS
norm, scalar GeGLU, one region per matrix), wall and process CPU time per step: robust on a
loaded machine, as both paths share one process, one engine and the same moments.

    .venv/bin/python benchmarks/between_matmuls_ab.py THREADS ROUNDS
"""
import sys, time, statistics
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import model_path, setup_env
T = int(sys.argv[1]); R = int(sys.argv[2])
setup_env(T)
import numpy as np
from edgeinfer.engine.core import Engine, EngineConfig
from edgeinfer.runners.sampling_params import SamplingParams
import edgeinfer.backends.cpu._actquant as aq, edgeinfer.backends.cpu._norm as nm, edgeinfer.backends.cpu._geglu as gg
import edgeinfer.backends.cpu.kernels as K
engine = Engine(model_path(None), EngineConfig(kv_budget_bytes=1 << 30, max_model_len=4096, max_tokens_per_step=2048, threads=T, speculative=False))
ops = engine.runner.ops
NEW = (aq.quantize_rows, nm.rms_norm, gg.gelu_tanh_mul_f16)
def variant(old):
    if old:
        one = ops.matmul
        ops.matmuls = lambda x, ws: tuple(one(x, w) for w in ws)
        aq.quantize_rows, nm.rms_norm, gg.gelu_tanh_mul_f16 = aq.quantize_rows_ref, K.rms_norm, K.gelu_tanh_mul_f16
    else:
        ops.__dict__.pop("matmuls", None)
        aq.quantize_rows, nm.rms_norm, gg.gelu_tanh_mul_f16 = NEW
def prompt(n, salt):
    rng = np.random.default_rng(salt)
    return [2] + [int(x) for x in rng.integers(1000, 100_000, n - 1)]
def timed_step():
    w0, c0 = time.perf_counter(), time.process_time()
    engine.step()
    return time.perf_counter() - w0, time.process_time() - c0
for old in (False, True):     # warm both paths
    variant(old); engine.generate(prompt(64, 1), SamplingParams(temperature=0, max_tokens=4))
res = {(k, v): [] for k in ("prefill512", "decode") for v in ("new", "old")}
for r in range(R):
    for old in ((False, True) if r % 2 == 0 else (True, False)):
        variant(old); name = "old" if old else "new"
        rid = engine.submit(prompt(512, 100 + r * 2 + old), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), lambda o: None)
        engine._drain_commands()
        res[("prefill512", name)].append(timed_step())
        steps = [timed_step() for _ in range(10)]
        res[("decode", name)].append((statistics.median(s[0] for s in steps[1:]), statistics.median(s[1] for s in steps[1:])))
        while engine.scheduler.has_work():
            engine.step()
variant(False)
for k in ("prefill512", "decode"):
    for i, what in ((0, "wall"), (1, "cpu")):
        n = [x[i] * 1e3 for x in res[(k, "new")]]; o = [x[i] * 1e3 for x in res[(k, "old")]]
        print(f"{k:10s} {what:4s} threads={T}: new {statistics.median(n):8.2f} ms ({min(n):.2f}-{max(n):.2f})  old {statistics.median(o):8.2f} ms ({min(o):.2f}-{max(o):.2f})  old/new {statistics.median(o)/statistics.median(n):.3f}")
engine.close()
