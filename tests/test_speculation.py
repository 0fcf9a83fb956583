"""Prompt-lookup speculative decoding: drafts from the sequence itself, checked in one pass,
and output identical to plain decoding (greedy and seeded)."""
from __future__ import annotations

import numpy as np
import pytest

from edgeinfer.engine.core import Engine, EngineConfig, greedy
from edgeinfer.runners.sampling_params import SamplingParams
from edgeinfer.engine.speculation import SpeculationStats, propose

CODE = '''def fib(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a

def main():
    for i in range(10):
        print(i, fib(i))
'''


def test_propose_continues_the_latest_earlier_occurrence():
    t = np.array([9, 1, 2, 3, 4, 5, 9, 9, 9, 9, 9, 9, 7, 1, 2, 3, 8, 8, 1, 2, 3], np.int64)
    assert propose(t, 3) == [8, 8, 1]           # the latest 3-gram match wins
    assert propose(t[:16], 4) == [4, 5, 9, 9]   # [1, 2, 3] first seen at 1
    assert propose(np.arange(40, dtype=np.int64)) == []    # nothing repeats
    assert propose(t[:5]) == []                            # too short to bother


def test_a_request_whose_guesses_fail_stops_getting_drafts():
    s = SpeculationStats()
    s.record(12, 2)
    assert not s.worth_it()
    s = SpeculationStats()
    s.record(12, 6)
    assert s.worth_it()


def test_draft_length_follows_what_is_kept():
    s = SpeculationStats()
    assert s.next_k == 3
    s.record(3, 3)
    assert s.next_k == 6
    s.record(6, 6)
    assert s.next_k == 7          # at most MAX_DRAFT
    s.record(7, 2)
    assert s.next_k == 3          # what was kept, plus one


@pytest.fixture(scope="module")
def engines(gemma3_path):
    made = [Engine(str(gemma3_path), EngineConfig(kv_budget_bytes=64 << 20, max_model_len=1024,
                                                 speculative=spec)) for spec in (False, True)]
    yield made
    for e in made:
        e.close()


@pytest.mark.parametrize("params", [
    greedy(80),
    SamplingParams(temperature=0.8, seed=5, max_tokens=60, repeat_penalty=1.1, top_k=40),
    greedy(40, stop=("main",)),
], ids=["greedy", "seeded-penalty", "stop-string"])
def test_output_is_identical_to_plain_decoding(engines, params):
    plain, spec = engines
    ids = plain.encode_raw("Copy this code exactly:\n" + CODE + "\nCopy:\n" + CODE[:40])
    a = plain.generate(ids, params)
    steps = spec.steps
    b = spec.generate(ids, params)
    assert b.token_ids == a.token_ids and b.text == a.text
    assert b.finish_reason == a.finish_reason
    assert b.num_output_tokens == a.num_output_tokens
    if params.max_tokens == 80:           # the listing repeats: far fewer steps than tokens
        assert spec.steps - steps < 0.7 * len(b.token_ids)


def test_logprobs_come_per_token_with_drafts(engines):
    plain, spec = engines
    ids = plain.encode_raw("Copy this code exactly:\n" + CODE + "\nCopy:\n" + CODE[:40])
    params = greedy(30, logprobs=2)
    a, b = plain.generate(ids, params), spec.generate(ids, params)
    assert len(b.logprobs) == len(b.token_ids) == len(a.token_ids)
    # verified positions compute plain decoding's bits (test_speculation_lossless.py)
    assert b.logprobs == a.logprobs and b.top_logprobs == a.top_logprobs


def test_a_prediction_is_a_draft_source_and_changes_nothing_else(engines):
    """Predicted Outputs: the expected text feeds the drafts even where the prompt does not
    contain it; the output is the plain output, in fewer steps."""
    plain, spec = engines
    ids = plain.encode_raw("def fib(n):\n")
    ref = plain.generate(ids, greedy(60))
    steps = spec.steps
    out = _generate(spec, ids, greedy(60), ref.token_ids)
    assert out.token_ids == ref.token_ids
    assert spec.steps - steps < 0.5 * len(ref.token_ids)


def _generate(engine, ids, params, prediction):
    events = []
    engine.submit(ids, params, events.append, prediction=prediction)
    engine._drain_commands()
    while engine.scheduler.has_work():
        engine.step()
    out = events[-1]
    out.token_ids = [t for e in events for t in e.token_ids]
    return out
