"""phi3, smollm3 and mistral3 on the native engine against libllama, the oracle.

Each architecture is a small random GGUF in llama.cpp's own layout (tests/synth_archs.py),
quantized by llama.cpp's quantizer. Next-token logits with teacher forcing meet the tolerance
of our dense synthetic models (test_engine_parity.test_synthetic_parity: 5% of the largest
logit, argmax equal wherever llama.cpp's margin is decisive), and greedy text equals
libllama's over 32 tokens (greedy_parity.assert_greedy_matches). A few checks show the
comparison is sensitive to what each architecture adds (a wrong choice is caught).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from edgeinfer.formats.model_config import NATIVE_ARCHS
from edgeinfer.runners.choice import auto_backend, resolve
from greedy_parity import assert_greedy_matches
from synth_archs import VARIANTS, variant_model
from test_engine_parity import _Chunk, check_agreement, llama_logits

llama_cpp = pytest.importorskip("llama_cpp")

CACHE = Path(__file__).resolve().parent.parent / ".cache" / "test-models" / "synth-archs"
DENSE = ["phi3", "phi3-mini4", "smollm3", "mistral3", "mistral3-logmul"]
TOKENS = [int(t) for t in np.random.default_rng(1).integers(3, 250, 72)]


def our_logits(path: Path, tokens: list[int], prefill: int, patch=None) -> np.ndarray:
    """Prefill `prefill` tokens in one chunk, decode the rest one by one (a shuffled block
    table); `patch(runner)` may change the loaded model first."""
    from edgeinfer.runners.native import ModelRunner
    r = ModelRunner.load(str(path), kv_budget_bytes=32 << 20)
    if patch is not None:
        patch(r)
    table = list(np.random.default_rng(0).permutation(r.kv_plan.num_blocks)[:len(tokens) // 16 + 2])
    rows = [r.forward([_Chunk(0, tokens[:prefill], table)])]
    rows += [r.forward([_Chunk(i, [tokens[i]], table)]) for i in range(prefill, len(tokens))]
    return np.concatenate(rows)


@pytest.mark.parametrize("arch", ["phi3", "smollm3", "mistral3"])
def test_auto_picks_native(arch):
    assert arch in NATIVE_ARCHS
    assert resolve("auto", None, arch) == auto_backend()
    assert resolve("auto", "cpu", arch) == "cpu"


@pytest.mark.parametrize("name", DENSE)
@pytest.mark.parametrize("ftype", ["Q4_K_M", "Q8_0"])
def test_logits_match_libllama(name, ftype):
    path = variant_model(CACHE, name, ftype)
    ref = llama_logits(path, TOKENS)          # libllama loads the file: it is the oracle
    # the prefill chunk crosses mistral3's original context (64): temperature scaling starts
    ours = our_logits(path, TOKENS, 40)
    stats = check_agreement(ours, ref[39:], rel_tol=0.05)
    assert stats["top1"] >= 0.85 and stats["top5"] >= 0.85, stats


@pytest.mark.parametrize("name", DENSE)
def test_f32_logits_close(name):
    """Unquantized, the two engines agree to float rounding (~1e-4 of the largest logit):
    every structural choice (fused rows, partial rotary, factors, mscale, NoPE layers,
    temperature) is right, not merely inside the quantized tolerance."""
    path = variant_model(CACHE, name, "F32")
    ref = llama_logits(path, TOKENS)
    ours = our_logits(path, TOKENS, 40)
    err = np.abs(ours - ref[39:]).max() / np.abs(ref).max()
    assert err < 1e-3, err


@pytest.mark.parametrize("name,wrong", [
    ("smollm3", lambda r: setattr(r.model, "cfg", dataclasses.replace(r.model.cfg, no_rope_step=0))),
    ("phi3", lambda r: setattr(r.model, "mscale", 1.0)),
    ("phi3-mini4", lambda r: setattr(r.model, "rope_freqs",       # the long factors
                                     r.ops.vector(r.gf, "rope_factors_long.weight"))),
    ("mistral3", lambda r: setattr(r.model, "temperature", lambda q, b: None)),
])
def test_a_wrong_choice_is_caught(name, wrong):
    path = variant_model(CACHE, name, "F32")
    ref = llama_logits(path, TOKENS)
    ours = our_logits(path, TOKENS, 40, patch=wrong)
    err = np.abs(ours - ref[39:]).max() / np.abs(ref).max()
    assert err > 5e-3, err


@pytest.mark.parametrize("name", DENSE[:4])
def test_greedy_text_matches(name):
    from edgeinfer.engine.core import Engine, EngineConfig
    path = variant_model(CACHE, name, "Q8_0")
    engine = Engine(str(path), EngineConfig(max_model_len=512))
    try:
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=512, logits_all=True, n_threads=2,
                              verbose=False)
        assert_greedy_matches(engine, llm, " the a of and in the is to", 32)
    finally:
        engine.close()


def test_variants_cover_the_architectures():
    assert {v.arch for v in VARIANTS.values()} >= {"phi3", "smollm3", "mistral3"}
