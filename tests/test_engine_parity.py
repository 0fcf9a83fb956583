"""The native engine against llama.cpp, the numerical oracle.

Logits are compared with teacher forcing (both engines see the same token ids). llama.cpp
quantizes activations to 8 bits, keeps K/V in f16 and tabulates GELU in f16, while we compute
in f32; so logits differ by a small relative amount, and the argmax must agree wherever
llama.cpp's own top-1/top-2 margin is larger than that difference (elsewhere it is a tie that
rounding decides). Greedy text is compared on the real model.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgeinfer.engine.core import Engine, EngineConfig
from edgeinfer.formats.gguf_file import read_gguf
from edgeinfer.runners.base import ScheduledSpan
from edgeinfer.runners.native import ModelRunner
from edgeinfer.formats.tokenizer import Tokenizer
from greedy_parity import assert_greedy_matches
from synth import synthetic_model

llama_cpp = pytest.importorskip("llama_cpp")

SYNTH = Path(__file__).resolve().parent.parent / ".cache" / "test-models" / "synth"


def _Chunk(start, token_ids, block_table, needs_logits=True, window_table=()) -> ScheduledSpan:
    return ScheduledSpan(0, start, tuple(token_ids), tuple(int(b) for b in block_table),
                         needs_logits, window_table=tuple(int(b) for b in window_table))


def llama_logits(path: Path, tokens: list[int], n_ctx: int = 1024) -> np.ndarray:
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, logits_all=True, n_threads=2,
                          verbose=False)
    llm.eval(tokens)
    out = np.array(llm.scores[:len(tokens)], dtype=np.float32)
    llm.close()
    return out


def our_logits(path: Path, tokens: list[int], prefill: int) -> np.ndarray:
    """Prefill `prefill` tokens as one chunk, then decode the rest one by one, through a
    shuffled block table (block order must not matter)."""
    r = ModelRunner.load(str(path), kv_budget_bytes=32 << 20)
    n = len(tokens) // 16 + 2
    rng = np.random.default_rng(0)
    table = list(rng.permutation(r.kv_plan.num_blocks)[:n])
    # sliding-window layers (gemma3) keep K/V in a pool of their own: a table into that pool
    window = list(rng.permutation(r.kv_plan.window_blocks)[:n]) if r.kv_plan.window_blocks else []
    rows = [r.forward([_Chunk(0, tokens[:prefill], table, window_table=window)])]
    rows += [r.forward([_Chunk(i, [tokens[i]], table, window_table=window)])
             for i in range(prefill, len(tokens))]
    return np.concatenate(rows)


def check_agreement(ours: np.ndarray, ref: np.ndarray, rel_tol: float) -> dict:
    scale = np.abs(ref).max()
    diff = np.abs(ours - ref).max(axis=1)
    assert diff.max() <= rel_tol * scale, f"max |diff| {diff.max():.4f} over {rel_tol} x {scale:.2f}"
    top2 = np.sort(ref, axis=1)[:, -2:]
    margin = top2[:, 1] - top2[:, 0]
    decisive = margin > 2 * diff
    agree = ours.argmax(1) == ref.argmax(1)
    assert agree[decisive].all(), f"argmax differs at decisive positions {np.where(decisive & ~agree)[0]}"
    top5 = np.mean([len(set(np.argsort(-a)[:5]) & set(np.argsort(-b)[:5])) / 5 for a, b in zip(ours, ref)])
    return {"max_abs_diff": float(diff.max()), "top1": float(agree.mean()), "top5": float(top5)}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
@pytest.mark.parametrize("ftype", ["Q4_K_M", "Q6_K", "Q8_0", "Q5_0"])
def test_synthetic_parity(arch, ftype):
    path = synthetic_model(SYNTH, arch, ftype)
    tokens = [int(t) for t in np.random.default_rng(1).integers(3, 250, 72)]
    ref = llama_logits(path, tokens)
    # 40 > the synthetic gemma3's 32-token sliding window: local layers must drop old keys.
    ours = our_logits(path, tokens, 40)
    stats = check_agreement(ours, ref[39:], rel_tol=0.05)
    assert stats["top1"] >= 0.85 and stats["top5"] >= 0.85, stats


def test_gemma3_logits_long_prompt(gemma3_path):
    """A 700-token prompt: past the 512-token sliding window of the local layers."""
    tk = Tokenizer.from_gguf(read_gguf(gemma3_path).metadata)
    text = " ".join(f"Item {i}: the {['red', 'green', 'blue'][i % 3]} box holds {i * 7 % 13} stones."
                    for i in range(60))
    tokens = tk.encode(text)[:700]
    assert len(tokens) == 700
    ref = llama_logits(gemma3_path, tokens)
    ours = our_logits(gemma3_path, tokens, 690)
    stats = check_agreement(ours, ref[689:], rel_tol=0.12)
    assert stats["top5"] >= 0.8, stats


def test_gemma3_first_positions_bit_exact(gemma3_path):
    """With llama.cpp's numerics emulated (8-bit activations, f16 K/V, softmax weights and GELU),
    the first two positions equal llama.cpp's token-by-token logits to float rounding."""
    llm = llama_cpp.Llama(model_path=str(gemma3_path), n_ctx=64, logits_all=True, n_threads=2,
                          verbose=False)
    tokens = llm.tokenize(b"def fibonacci(n):", add_bos=True)[:2]
    ref = []
    for t in tokens:
        llm.eval([t])
        ref.append(np.array(llm.scores[llm.n_tokens - 1]))
    llm.close()
    ours = our_logits(gemma3_path, tokens, 1)
    assert np.abs(ours - np.stack(ref)).max() < 2e-3


PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Les trois couleurs du drapeau français sont",
    "東京は日本の首都で、",
    "My favourite emoji are 🍕 and",
]


@pytest.fixture(scope="module")
def gemma3_engine(gemma3_path):
    return Engine(str(gemma3_path), EngineConfig(max_model_len=2048))


# one prompt in the default run; the others (French, CJK, emoji) under -m slow (~12 s each)
@pytest.mark.parametrize("prompt", [p if p == PROMPTS[0] else
                                    pytest.param(p, marks=pytest.mark.slow) for p in PROMPTS])
def test_gemma3_greedy_text(gemma3_path, gemma3_engine, prompt):
    """Greedy text equals llama.cpp's up to its own near-ties (greedy_parity.assert_greedy_matches)."""
    llm = llama_cpp.Llama(model_path=str(gemma3_path), n_ctx=512, logits_all=True, n_threads=2,
                          verbose=False)
    assert_greedy_matches(gemma3_engine, llm, prompt, 32)
