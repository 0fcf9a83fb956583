"""Lossless speculation on real models: with prompt-lookup drafts on (the default), every
position a verify step computes has exactly the bits plain decoding gives it, so the text is
the same, alone or inside a batch of 8.

Free text, not copy tasks: drafts here are guesses from the prompt and the output's own
n-grams that are often wrong, and near-ties between the top two logits happen in a few
hundred tokens. Token equality alone would only notice a difference at such a tie, so the
test also compares every sampled logits row, bit for bit (a hash per row), with the plain
run's row at the same (prompt, position).

The plain reference runs the prompts batched (speculation off): on the repacked int8 path a
row's bits do not depend on its batch (test_batch_invariance), so that is plain decoding
alone, and any batch dependence fails here too. The speculative runs: each prompt alone, then
batches of 8 arriving in two waves (verify rows share steps with other sequences' verify and
prefill rows); speculation's batch limit is lifted to 8 so the batches verify drafts too.
Matrices left in GGUF blocks (repack=False) are not batch-invariant (matmul.FEW_ROWS), so there
the reference is each prompt alone and only alone runs are compared.
"""
from __future__ import annotations

import hashlib

import pytest

import edgeinfer.engine.core as core
from edgeinfer.engine.core import Engine, EngineConfig, greedy
from edgeinfer.runners.sampling_params import SamplingParams

FREE_TEXT = [
    "The history of the Roman Empire began",
    "Once upon a time, in a small village by the sea,",
    "Photosynthesis is the process by which",
    "Here are five tips for learning a new language:\n1.",
    "The best way to cook rice is",
    "In computer science, a hash table is",
    "Dear John, I am writing to tell you",
    "The weather today is",
    "def quicksort(arr):\n",
    "Q: What is the capital of France?\nA:",
    "My favourite book is",
    "The quick brown fox",
    "To install the package, run",
    "The meeting notes from Tuesday:\n-",
    "Water boils at 100 degrees Celsius because",
    "She opened the door and saw",
]

CHAT = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain the difference between a list and a tuple in Python.",
    "What does HTTP status 404 mean?",
    "Write a SQL query that counts the orders per customer.",
    "Give me three names for a cat.",
    "How do I reverse a linked list in C?",
    "Summarize what a binary search does.",
    "Write a haiku about the sea.",
]


def _engine(path, speculative: bool, **kw) -> Engine:
    return Engine(str(path), EngineConfig(kv_budget_bytes=96 << 20, max_model_len=1024,
                                          speculative=speculative, **kw))


class _Recorder:
    """Hashes every logits row the engine samples from, by (prompt index, position), into
    `rows` (index: request id -> prompt index); counts the rows that verified a draft."""

    def __new__(cls, engine: Engine):
        stage = engine.runner.sampling
        rec = getattr(stage, "recorder", None)
        if rec is not None:                 # one hook per engine (module-scoped engines)
            return rec
        rec = stage.recorder = super().__new__(cls)
        rec.rows, rec.index, rec.draft_rows = {}, {}, 0
        sample = stage.sample

        def recording(spans, logits):
            r = 0
            for s in spans:
                first = s.start + len(s.token_ids) - 1 - s.num_draft
                prompt = rec.index.get(s.req_id)
                for j in range(1 + s.num_draft):
                    if prompt is not None:
                        rec.rows[(prompt, first + j)] = hashlib.blake2b(
                            logits[r + j].tobytes(), digest_size=16).digest()
                r += 1 + s.num_draft
                rec.draft_rows += s.num_draft if prompt is not None else 0
            return sample(spans, logits)
        stage.sample = recording
        return rec

    def reset(self) -> None:
        self.rows, self.index, self.draft_rows = {}, {}, 0


def _run(engine: Engine, prompts, params, batch: int, index: dict) -> list[list[int]]:
    """Token ids per prompt: `batch` at a time, each batch in two waves (the second half
    arrives after two steps of the first)."""
    outs: dict[int, list[int]] = {}
    order = []

    def submit(i):
        rid = engine.submit(prompts[i], params[i],
                            lambda o: outs.setdefault(o.request_id, []).extend(o.token_ids))
        index[rid] = i
        order.append(rid)

    for b0 in range(0, len(prompts), batch):
        group = list(range(b0, min(len(prompts), b0 + batch)))
        half = (len(group) + 1) // 2
        for i in group[:half]:
            submit(i)
        engine._drain_commands()
        for _ in range(2):
            if engine.scheduler.has_work():
                engine.step()
        for i in group[half:]:
            submit(i)
        engine._drain_commands()
        while engine.scheduler.has_work():
            engine.step()
    return [outs.get(rid, []) for rid in order]


def _check(engines, prompts, params, *, alone: int, batches: bool = True):
    """Plain reference (batched where rows are batch-invariant, else alone) against the
    speculative engine on the first `alone` prompts one at a time, then (batches) on all of
    them in batches of 8. Returns the number of verified draft rows that were compared."""
    plain, spec = engines
    ref_rec, rec = _Recorder(plain), _Recorder(spec)
    ref_rec.reset()
    invariant = plain.runner.ops.rows_exact
    n_ref = len(prompts) if batches else alone
    ref = _run(plain, prompts[:n_ref], params[:n_ref], 8 if invariant else 1, ref_rec.index)
    runs = [("alone", alone, 1)] + ([("batches of 8", len(prompts), 8)] if batches else [])
    drafts = 0
    for name, n, batch in runs:
        rec.reset()
        got = _run(spec, prompts[:n], params[:n], batch, rec.index)
        common = rec.rows.keys() & ref_rec.rows.keys()
        differ = sorted(k for k in common if rec.rows[k] != ref_rec.rows[k])
        assert not differ, (f"{name}: {len(differ)} of {len(common)} logits rows differ from "
                            f"plain decoding's, first at (prompt, position) {differ[0]}")
        assert len(common) >= 0.9 * len(rec.rows)
        for i, (a, b) in enumerate(zip(ref, got)):
            assert b == a, f"{name}: prompt {i} differs from plain decoding"
        drafts += rec.draft_rows
    return drafts


def _pair(path, **kw):
    return _engine(path, False, **kw), _engine(path, True, **kw)


def _close(engines):
    for e in engines:
        e.close()


@pytest.fixture()
def batch_speculation(monkeypatch):
    """Drafts also for batches of up to 8 decoding sequences (the default stops at 2)."""
    monkeypatch.setattr(core, "MAX_BATCH", 8)


@pytest.fixture(scope="module")
def gemma(gemma3_path):
    engines = _pair(gemma3_path)
    yield engines
    _close(engines)


def test_gemma3_free_text_greedy_and_seeded(gemma, batch_speculation):
    prompts = [gemma[0].encode_raw(p) for p in FREE_TEXT[:12]]
    params = [greedy(32) if i % 3 else
              SamplingParams(temperature=0.7, seed=100 + i, top_k=40, repeat_penalty=1.05,
                             max_tokens=32) for i in range(len(prompts))]
    assert _check(gemma, prompts, params, alone=6) >= 50


def test_gemma3_q8_0_cache(gemma3_path, batch_speculation):
    engines = _pair(gemma3_path, kv_cache_type="q8_0")
    try:
        prompts = [engines[0].encode_raw(p) for p in FREE_TEXT[10:16]]
        assert _check(engines, prompts, [greedy(20)] * len(prompts), alone=2) >= 20
    finally:
        _close(engines)


def test_gemma3_gguf_block_kernels(gemma3_path):
    """repack=False: a matmul of more than FEW_ROWS rows takes the register-blocked kernel,
    which rounds differently from the one-row matvec; the runner verifies drafts in a forward
    of their own with per-row dots."""
    engines = _pair(gemma3_path, repack=False)
    try:
        assert not engines[0].runner.ops.rows_exact
        prompts = [engines[0].encode_raw(FREE_TEXT[i]) for i in (9, 13, 14)]
        assert _check(engines, prompts, [greedy(20)] * 3, alone=3, batches=False) >= 15
    finally:
        _close(engines)


def test_qwen_coder_chat_greedy_and_seeded(qwen_coder_path, batch_speculation):
    engines = _pair(qwen_coder_path)
    try:
        prompts = [engines[0].encode_chat([{"role": "user", "content": c}]) for c in CHAT]
        params = [greedy(20) if i % 2 == 0 else
                  SamplingParams(temperature=0.8, seed=7 + i, top_p=0.9, max_tokens=20)
                  for i in range(len(prompts))]
        assert _check(engines, prompts, params, alone=3) >= 30
    finally:
        _close(engines)


def test_repetition_stop_cuts_at_the_same_token(gemma):
    """A base model looping: the repetition stop ends the request at the same token whether
    a step brought one token or a verified draft of several."""
    plain, spec = gemma
    ids = plain.encode_raw("1 2 3 4 5 6 7 8 9 10\n" * 6 + "1 2 3")
    params = greedy(300, stop_on_repetition=True)
    a = plain.generate(ids, params)
    steps = spec.steps
    b = spec.generate(ids, params)
    assert spec.steps - steps < 0.5 * len(b.token_ids)
    assert a.finish_reason == "repetition" and len(a.token_ids) < 300
    assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)
