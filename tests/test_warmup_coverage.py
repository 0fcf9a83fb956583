"""A model's warm-up steps reach every kernel its requests do (edgeinfer/engine/warmup.py).

A spare engine process runs the steps of the model it expects, and install and pull compile
them, so that the first request neither compiles nor loads a kernel from numba's cache. A
kernel that only a real request reaches (a prompt length whose path no step takes: the
tiny model's thresholds are not the real model's) costs the first request ~10 ms to load,
and on a fresh install a compile of seconds. Here the steps run in a fresh process (what they
compiled comes from the test JIT cache), then the real model serves requests of every prompt
length band, greedy with prompt-lookup drafts and sampled; no dispatcher may gain a
signature it did not have after the steps and the load.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

_CHILD = r"""
import gc, json, sys
import edgeinfer     # numba's cache directory before numba loads
from numba.core.registry import CPUDispatcher
from edgeinfer.engine import warmup
from edgeinfer.engine.core import Engine, EngineConfig
from edgeinfer.runners.sampling_params import SamplingParams, with_vocabulary

path = sys.argv[1]
for key in warmup.keys_for_model(path):
    warmup.run_step(key)
engine = Engine(path, EngineConfig(max_model_len=2048))

def signatures():
    return {(d.py_func.__module__, d.py_func.__qualname__, sig)
            for d in gc.get_objects() if isinstance(d, CPUDispatcher)
            for sig in d.overloads}

before = signatures()
words = "the cat sat on a mat and the dog ran to the park by the old tree ".split()
for n in (1, 3, 8, 14, 20, 30, 45, 60, 90, 130, 300):
    prompt = engine.encode_raw(" ".join(words[i % len(words)] for i in range(n)))
    engine.generate(prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
chat = engine.prompts.encode_chat([{"role": "user", "content": "Hello"}])
engine.generate(chat, with_vocabulary(SamplingParams(
    temperature=0.8, top_k=40, top_p=0.9, repeat_penalty=1.1, seed=1, max_tokens=4,
    ignore_eos=True), engine.tokenizer))
engine.close()
new = sorted(f"{m}.{q}{tuple(str(t) for t in s)}" for m, q, s in signatures() - before)
print(json.dumps(new))
"""


@pytest.mark.parametrize("model", ["qwen_coder_path", "smollm2_path", "gemma3_path"])
def test_requests_reach_no_kernel_the_warm_up_steps_did_not(model, request):
    from edgeinfer.backends.cpu._int8 import HAVE_SIMD
    if not HAVE_SIMD:
        pytest.skip("without a vector tile kernel the default keeps weights in GGUF blocks")
    path = request.getfixturevalue(model)
    p = subprocess.run([sys.executable, "-c", _CHILD, str(path)], capture_output=True,
                       text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    new = json.loads(p.stdout.strip().splitlines()[-1])
    assert new == [], "kernels only requests reach:\n" + "\n".join(new)
