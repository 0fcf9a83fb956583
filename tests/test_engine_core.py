"""The engine's own contracts, on a tiny synthetic model: a step that fails fails its
requests and the engine keeps serving; a sink that raises aborts only its request; n > 1
choices wait for choice 0's prefill and share it; the plan that crosses to the runner is
plain data; close() releases the runner."""
from __future__ import annotations

import queue
import threading

import pytest
from conftest import CACHE
from synth import synthetic_model

from edgeinfer.engine.core import Engine, EngineConfig, greedy
from edgeinfer.runners.sampling_params import SamplingParams
from edgeinfer.runners.base import ScheduledSpan, StepPlan


@pytest.fixture(scope="module")
def model_path():
    return str(synthetic_model(CACHE / "synth", "llama", "Q8_0"))


@pytest.fixture()
def engine(model_path):
    e = Engine(model_path, EngineConfig(kv_budget_bytes=8 << 20, max_model_len=256))
    yield e
    e.close()


def _run(engine: Engine) -> None:
    engine._drain_commands()
    while engine.scheduler.has_work():
        engine.step()


def test_a_failing_step_fails_its_requests_and_the_engine_serves_on(engine):
    real = engine.runner.execute
    calls = {"n": 0}

    def flaky(plan):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("kernel exploded")
        return real(plan)

    engine.runner.execute = flaky
    engine.start()
    events: queue.Queue = queue.Queue()
    engine.submit([1, 5, 6, 7], greedy(8), events.put)
    finals = []
    while not finals:
        out = events.get(timeout=60)
        if out.finished:
            finals.append(out)
    assert finals[0].finish_reason == "error"
    assert "internal error: RuntimeError: kernel exploded" in finals[0].error
    # the engine thread is alive and serves the next request normally
    done = threading.Event()
    got = []
    engine.submit([1, 5, 6, 7], greedy(4), lambda o: (got.append(o), o.finished and done.set()))
    assert done.wait(60)
    assert got[-1].finish_reason == "length" and sum(len(o.token_ids) for o in got) == 4
    assert engine.scheduler.stats().kv.blocks_used == 0


def test_a_sink_that_raises_aborts_only_its_request(engine):
    def bad_sink(out):
        raise ValueError("client went away")

    good = []
    engine.submit([1, 5, 6, 7], greedy(6), bad_sink)
    engine.submit([1, 8, 9, 10], greedy(6), good.append)
    _run(engine)
    assert good[-1].finished and good[-1].finish_reason == "length"
    assert sum(len(o.token_ids) for o in good) == 6
    assert engine.scheduler.stats().kv.blocks_used == 0
    assert not engine._states and not engine._followers


def test_choices_after_the_first_share_its_prefill(engine):
    prompt = [1] + [20 + i % 90 for i in range(99)]      # 100 tokens: six full blocks
    plans: list[StepPlan] = []
    real = engine.runner.execute
    engine.runner.execute = lambda plan: (plans.append(plan), real(plan))[1]
    params = SamplingParams(temperature=0.9, seed=3, max_tokens=3)
    outs: dict[int, list] = {}
    first = engine.submit(prompt, params, lambda o: outs.setdefault(o.request_id, []).append(o))
    rest = [engine.submit(prompt, params, lambda o: outs.setdefault(o.request_id, []).append(o),
                          choice=i, follows=first) for i in (1, 2, 3)]
    _run(engine)
    computed = sum(len(s.token_ids) for p in plans for s in p.spans if not s.is_decode)
    # choice 0 computes the prompt; each follower only the partial last block (100 = 6*16 + 4)
    assert computed <= len(prompt) + 3 * 16
    for rid in rest:
        assert outs[rid][-1].num_cached_tokens == 96
    texts = {tuple(t for o in outs[rid] for t in o.token_ids) for rid in [first, *rest]}
    assert len(texts) > 1          # each choice draws from its own stream of the seed


def test_an_aborted_follower_that_never_started_ends_cleanly(engine):
    ends = []
    first = engine.submit([1, 2, 3, 4, 5], greedy(3), lambda o: None)
    second = engine.submit([1, 2, 3, 4, 5], greedy(3), ends.append, choice=1, follows=first)
    engine.abort(second)
    _run(engine)
    assert [o.finish_reason for o in ends if o.finished] == ["abort"]


def test_the_plan_is_plain_data(engine):
    plans: list[StepPlan] = []
    real = engine.runner.execute
    engine.runner.execute = lambda plan: (plans.append(plan), real(plan))[1]
    engine.submit([1, 5, 6], greedy(2), lambda o: None)
    _run(engine)
    first = plans[0]
    assert [r.prompt_token_ids for r in first.new_requests] == [(1, 5, 6)]
    for plan in plans:
        for span in plan.spans:
            assert isinstance(span, ScheduledSpan)
            assert isinstance(span.token_ids, tuple) and isinstance(span.block_table, tuple)
    # the request is announced once, and its end reaches the runner in a later plan
    rid = first.new_requests[0].req_id
    engine.submit([1, 7], greedy(1), lambda o: None)
    _run(engine)
    assert sum(rid in p.finished for p in plans) == 1
    assert sum(rid == r.req_id for p in plans for r in p.new_requests) == 1


def test_snapshot_is_published_by_the_engine_thread(engine):
    before = engine.snapshot()
    engine.generate([1, 5, 6, 7], greedy(3))
    after = engine.snapshot()
    assert after is not before and after["tokens_generated"] == before["tokens_generated"] + 3


def test_close_releases_the_runner(model_path):
    e = Engine(model_path, EngineConfig(kv_budget_bytes=8 << 20, max_model_len=256)).start()
    done = threading.Event()
    e.submit([1, 2, 3], greedy(200), lambda o: o.finished and done.set())
    e.close()                       # a live request ends with "abort", the runner is closed
    assert done.is_set()
    assert e.runner.kv is None and e.runner.model is None
