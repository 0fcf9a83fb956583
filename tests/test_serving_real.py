"""Serving core on the real model (Gemma 3 270M): continuous batching, chunked prefill,
prefix reuse, preemption and cancellation, driven step by step on the calling thread.

Scenarios compare greedy token ids with the same request run alone and run the scheduler's
pool invariant check (no leaked or double-owned block) after every step or scenario.

Numerics: on a CPU with AVX-512 VNNI the engine's default CPU path multiplies repacked int8
weights by 8-bit activation codes (backends/cpu/repack.py); a row's result is bit-identical
whatever it is batched with, so these tests run the default configuration and any difference
in output is a serving bug (a wrong block table, position, cached block or chunk): equality
must be exact. Without VNNI the float kernels sum one row and several rows in different
orders, and the tests opt in to batch_invariant=True (every row through one kernel).
"""
from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest

from edgeinfer.backends.cpu._int8 import HAVE_SIMD
from edgeinfer.engine.core import Engine, EngineConfig, RequestOutput, greedy

# Filler text for long prompts, shared with benchmarks/serving.py.
SENTENCES = tuple((Path(__file__).parent / "data" / "sentences.txt").read_text().splitlines())


def text_of(n_sentences: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(SENTENCES) for _ in range(n_sentences))


def tokens(engine: Engine, n: int, seed: int) -> list[int]:
    """Exactly n prompt tokens (BOS included) of seeded pseudo-text."""
    ids = engine.encode_raw(text_of(n // 8 + 1, seed))
    assert len(ids) >= n
    return ids[:n]


class Collector:
    """A sink that accumulates one request's events."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.last: RequestOutput | None = None

    def __call__(self, out: RequestOutput) -> None:
        self.token_ids += out.token_ids
        self.last = out

    @property
    def finished(self) -> bool:
        return self.last is not None and self.last.finished


def submit(engine: Engine, prompt: list[int], max_tokens: int) -> Collector:
    sink = Collector()
    engine.submit(prompt, greedy(max_tokens, ignore_eos=True), sink)
    engine._drain_commands()          # what the engine thread does before each step
    return sink


def run_to_end(engine: Engine) -> int:
    steps = 0
    while engine.scheduler.has_work():
        engine.step()
        engine.scheduler.check_invariants()
        steps += 1
    return steps


def alone(engine: Engine, prompt: list[int], max_tokens: int) -> list[int]:
    out = engine.generate(prompt, greedy(max_tokens, ignore_eos=True))
    assert out.finish_reason == "length"
    return out.token_ids


@pytest.fixture(scope="module")
def path(gemma3_path) -> str:
    return str(gemma3_path)


def make(path: str, **kw) -> Engine:
    kw.setdefault("kv_budget_bytes", 128 << 20)
    kw.setdefault("batch_invariant", not HAVE_SIMD)
    return Engine(path, EngineConfig(**kw))


def test_batch_invariance_random_arrivals(path):
    ref_engine = make(path)
    prompts = [tokens(ref_engine, n, seed) for seed, n in enumerate((3, 17, 40, 75, 130, 210))]
    expected = [alone(ref_engine, p, 32) for p in prompts]
    assert len({tuple(e) for e in expected}) == len(prompts)   # distinct prompts, distinct text

    for trial in range(2):
        rng = random.Random(100 + trial)
        engine = make(path)
        order = list(range(len(prompts)))
        rng.shuffle(order)
        sinks: dict[int, Collector] = {}
        pending = list(order)
        while pending or engine.scheduler.has_work():
            # submit a random handful, then run a random number of steps
            for _ in range(rng.randint(1, 3) if pending else 0):
                if pending:
                    i = pending.pop(0)
                    sinks[i] = submit(engine, prompts[i], 32)
            for _ in range(rng.randint(1, 6)):
                if engine.scheduler.has_work():
                    engine.step()
            engine.scheduler.check_invariants()
        for i in order:
            assert sinks[i].finished and sinks[i].last.finish_reason == "length"
            assert sinks[i].token_ids == expected[i], f"trial {trial}, order {order}, prompt {i}"
        assert engine.stats()["kv_blocks_used"] == 0


def test_prefix_reuse(path):
    engine = make(path)
    prefix = tokens(engine, 1000, seed=7)
    suffix_a = engine.encode_raw(" Question one: what is the river?")[1:]
    suffix_b = engine.encode_raw(" Question two: which falcon flew over the canyon?")[1:]

    first = engine.generate(prefix + suffix_a, greedy(12, ignore_eos=True))
    assert first.num_cached_tokens == 0
    second = engine.generate(prefix + suffix_b, greedy(12, ignore_eos=True))
    assert second.num_cached_tokens >= 992
    stats = engine.stats()
    assert stats["prefix_hits"] >= 1 and stats["prefix_cached_tokens"] >= 992
    engine.scheduler.check_invariants()

    cold = make(path)
    assert second.token_ids == alone(cold, prefix + suffix_b, 12)
    cold.scheduler.check_invariants()


def test_multi_turn_reuses_previous_turn(path):
    engine, cold = make(path), make(path)
    # turn 2 = turn 1's prompt + its reply + a new message
    turn1 = tokens(engine, 90, seed=8)
    reply = engine.generate(turn1, greedy(20, ignore_eos=True))
    turn2 = turn1 + reply.token_ids + engine.encode_raw(" And then what happened?")[1:]
    out2 = engine.generate(turn2, greedy(12, ignore_eos=True))
    # every full block of turn 1 + reply that had K/V computed (the last reply token had none)
    assert out2.num_cached_tokens >= (len(turn1) + len(reply.token_ids) - 1) // 16 * 16
    assert out2.num_cached_tokens > len(turn1)
    assert out2.token_ids == alone(cold, turn2, 12)
    engine.scheduler.check_invariants()
    cold.scheduler.check_invariants()


def test_preemption_under_tiny_pool(path):
    ref = make(path)
    prompts = [tokens(ref, n, seed=20 + n) for n in (20, 26, 31, 37)]
    expected = [alone(ref, p, 32) for p in prompts]

    block = 16
    plan = ref.runner.kv_plan
    # a pool this small holds as many window blocks as full ones (plan_kv)
    per_token = plan.bytes_per_token + plan.window_bytes_per_token
    # 10 blocks: each request needs 4 at its end (prompt + 32 outputs), all four need 16
    engine = make(path, kv_budget_bytes=10 * block * per_token)
    assert engine.runner.kv_plan.num_blocks == 10
    # admit on the prompt alone, so decode growth has to preempt (recompute) to make room
    engine.scheduler.config = replace(engine.scheduler.config, output_reserve=0)
    sinks = [submit(engine, p, 32) for p in prompts]
    run_to_end(engine)
    assert engine.stats()["preemptions"] > 0
    for s, e in zip(sinks, expected):
        assert s.finished and s.last.finish_reason == "length"
        assert s.token_ids == e
    assert engine.stats()["kv_blocks_used"] == 0


def test_cancel_mid_decode_frees_blocks(path):
    engine = make(path)
    assert engine.stats()["kv_blocks_used"] == 0
    keep = submit(engine, tokens(engine, 50, seed=30), 24)
    gone = submit(engine, tokens(engine, 70, seed=31), 200)
    while len(gone.token_ids) < 5:
        engine.step()
    both = engine.stats()["kv_blocks_used"]
    gone_id = gone.last.request_id
    gone_blocks = len(engine.scheduler.get(gone_id).block_table)
    assert gone_blocks >= 5
    engine.abort(gone_id)
    engine._drain_commands()
    out = engine.step()
    assert [s.seq_id for s in out.aborted] == [gone_id]
    assert all(c.seq.seq_id != gone_id for c in out.chunks)
    assert gone.finished and gone.last.finish_reason == "abort"
    engine.scheduler.check_invariants()
    after = engine.stats()
    assert after["kv_blocks_used"] <= both - gone_blocks + 1   # + keep's next block at most
    assert engine.scheduler.get(gone_id) is None
    run_to_end(engine)
    assert keep.finished and len(keep.token_ids) == 24
    final = engine.stats()
    assert final["kv_blocks_used"] == 0
    assert final["kv_blocks_free"] + final["kv_blocks_cached"] == final["kv_blocks_total"]


def test_chunked_prefill_does_not_stall_decodes(path):
    engine = make(path, max_tokens_per_step=256)
    streams = [submit(engine, tokens(engine, n, seed=40 + n), 16) for n in (12, 25)]
    while any(len(s.token_ids) == 0 for s in streams):
        engine.step()
    ids = [s.last.request_id for s in streams]
    before = [len(s.token_ids) for s in streams]

    long_prompt = tokens(engine, 1500, seed=41)
    long = submit(engine, long_prompt, 4)
    chunks = []                                   # (start, length) of the long prompt's chunks
    while not long.token_ids:
        out = engine.step()
        engine.scheduler.check_invariants()
        decodes = {c.seq.seq_id for c in out.chunks if c.is_decode}
        assert set(ids) <= decodes, "a decode stream was left out of a prefill step"
        assert out.num_tokens <= 256
        prefills = [c for c in out.chunks if not c.is_decode]
        assert len(prefills) == 1 and prefills[0].seq.seq_id not in ids
        chunks.append((prefills[0].start, prefills[0].num_tokens))
    # the prompt went in budget-sized chunks, each continuing the previous one
    assert len(chunks) >= 1500 // 256 + 1
    assert [s for s, _ in chunks] == [sum(n for _, n in chunks[:i]) for i in range(len(chunks))]
    assert sum(n for _, n in chunks) == 1500
    after = [len(s.token_ids) for s in streams]
    assert all(a - b >= len(chunks) for a, b in zip(after, before))
    run_to_end(engine)
    assert all(s.finished for s in streams + [long])
    assert engine.stats()["kv_blocks_used"] == 0
