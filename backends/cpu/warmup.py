"""Compile every CPU kernel once into numba's on-disk cache (install.sh runs this), so the first
request after installation does not wait for JIT compilation."""
from __future__ import annotations

import time


def run(model_path: str | None = None) -> None:
    from edgeinfer.backends.cpu.matmul import warm_kernels
    t = time.monotonic()
    warm_kernels()
    print(f"    quantized matmul kernels: {time.monotonic() - t:.1f} s")
    if model_path is None:
        try:
            from edgeinfer.store.model_store import Store
            model_path = str(Store().resolve("gemma3:270m").path)
        except Exception:  # no bundled model: the model kernels compile on first use
            return
    from edgeinfer.engine.core import Engine, EngineConfig
    from edgeinfer.engine.sampling import SamplingParams
    t = time.monotonic()
    engine = Engine(model_path, EngineConfig(kv_budget_bytes=64 << 20, max_model_len=512))
    prompt = engine.encode_raw("warm up " * 12)          # prefill path (many rows)
    engine.generate(prompt, SamplingParams(temperature=0, max_tokens=3))
    for temperature in (0.8, 0.0):                        # sampling kernels, batched decode
        engine.submit(engine.encode_raw("a b"), SamplingParams(temperature=temperature, top_p=0.9,
                                                               top_k=40, max_tokens=3), lambda o: None)
    engine._drain_commands()
    while engine.scheduler.has_work():
        engine.step()
    _warm_masked_sampling()
    print(f"    model kernels (attention, norms, sampling): {time.monotonic() - t:.1f} s")


def _warm_masked_sampling() -> None:
    """Structured output samples masked rows through their own kernels (0.7 s to compile)."""
    import numpy as np

    from edgeinfer.engine.sampling import Sampler, SamplingParams, SeqSamplingState
    logits = np.random.default_rng(0).standard_normal((1, 4096)).astype(np.float32)
    mask = np.zeros(4096, bool)
    mask[::7] = True
    for temperature in (0.0, 0.8):
        state = SeqSamplingState(SamplingParams(temperature=temperature, top_k=40, top_p=0.9))
        Sampler().sample(logits, [state], [mask])
