"""Sliding-window release on the real model (Gemma 3 270M: 15 of 18 layers see the last 512
positions): the same greedy tokens and logprob bits as with every layer in one pool, for
prompts shorter and longer than the window, through chunked prefill, decode, speculation,
prefix-cache hits past the window, n > 1 choices and preemption; and the pools the
planner makes (window pool of one window per running sequence, the rest for the context).

The baseline is the same engine with the window group turned off (CpuOps.kv_window_group
False: every layer keeps every position, as before), so any difference is a window-table,
release or prefix-cache bug, and equality must be exact (see test_serving_real for why
the repacked CPU path is bit-exact whatever the batch).
"""
from __future__ import annotations

import pytest

from edgeinfer.backends.cpu.ops import CpuOps
from edgeinfer.engine.core import Engine, EngineConfig
from edgeinfer.runners.sampling_params import SamplingParams
from test_serving_real import alone, make, run_to_end, submit, tokens  # noqa: F401

MODEL_WINDOW = 512


@pytest.fixture(scope="module")
def path(gemma3_path) -> str:
    return str(gemma3_path)


def _pair(path, **kw):
    """(windowed engine, baseline engine with one pool for every layer)."""
    kw.setdefault("max_running_seqs", 2)
    kw.setdefault("max_tokens_per_step", 128)
    win = make(path, **kw)
    CpuOps.kv_window_group = False
    try:
        base = make(path, **kw)
    finally:
        CpuOps.kv_window_group = True
    return win, base


def _greedy(n):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def engines(path):
    return _pair(path)


def test_plan_keeps_one_window_per_sequence(engines):
    win, base = engines
    wp, bp = win.runner.kv_plan, base.runner.kv_plan
    assert wp.window == MODEL_WINDOW and len(wp.window_layers) == 15
    assert not bp.window_layers and bp.window_blocks == 0
    # 2 running x (33 + 1) + 128 / 16: the scheduler can never need more
    assert wp.window_blocks == 2 * 34 + 8
    # the same budget holds about 6x the context
    assert wp.capacity_tokens > 5 * bp.capacity_tokens     # 6x less one window pool
    assert wp.nbytes <= 128 << 20 and win.runner.kv_bytes == wp.nbytes
    # a 32K context: full layers for every token, the window layers for one window
    per_token = bp.bytes_per_token
    assert wp.bytes_per_token * 6 == per_token
    assert wp.context_bytes(32768) == 32768 * per_token // 6 + 33 * 16 * per_token * 5 // 6
    kv = win.runner.kv
    assert kv.k[0].shape[0] == wp.window_blocks and kv.k[5].shape[0] == wp.num_blocks


@pytest.mark.parametrize("n_prompt", [300, 700])
def test_same_tokens_and_logprobs_as_one_pool(engines, n_prompt):
    win, base = engines
    prompt = tokens(win, n_prompt, seed=n_prompt)
    a = win.generate(prompt, _greedy(24))
    b = base.generate(prompt, _greedy(24))
    assert a.token_ids == b.token_ids
    assert a.logprobs == b.logprobs            # float equality: the same logits bits
    win.scheduler.check_invariants()
    st = win.stats()
    assert st["kv_blocks_used"] == 0 and st["kv_window_blocks_used"] == 0


def test_prefix_hit_past_the_window_equals_a_cold_run(engines):
    win, base = engines
    prefix = tokens(win, 900, seed=31)
    q1 = win.encode_raw(" Question one: what is the river?")[1:]
    q2 = win.encode_raw(" Question two: which falcon flew over the canyon?")[1:]
    first = win.generate(prefix + q1, _greedy(12))
    second = win.generate(prefix + q2, _greedy(12))
    assert second.num_cached_tokens >= 896 > MODEL_WINDOW
    cold = base.generate(prefix + q2, _greedy(12))
    assert second.token_ids == cold.token_ids and second.logprobs == cold.logprobs
    assert first.token_ids == base.generate(prefix + q1, _greedy(12)).token_ids
    # a multi-turn follow-up: the previous turn and its reply come from the cache
    turn2 = prefix + q2 + second.token_ids + q1
    third = win.generate(turn2, _greedy(8))
    assert third.num_cached_tokens > len(prefix)
    assert third.token_ids == base.generate(turn2, _greedy(8)).token_ids
    win.scheduler.check_invariants()


def test_concurrent_long_prompts_with_speculation(engines):
    win, base = engines
    # a repeated passage: prompt lookup proposes drafts and the runner verifies k + 1
    # positions per step, across block and window boundaries
    body = tokens(win, 300, seed=5)
    p1 = body + body[1:]
    p2 = tokens(win, 620, seed=6)
    expected = [alone(base, p, 40) for p in (p1, p2)]
    sinks = [submit(win, p, 40) for p in (p1, p2)]
    run_to_end(win)
    assert [s.token_ids for s in sinks] == expected
    assert win.stats()["kv_window_blocks_used"] == 0


def test_n_choices_share_a_long_prefill(engines):
    win, base = engines
    prompt = tokens(win, 650, seed=9)
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=10, ignore_eos=True)
    outs = {}
    for eng in (win, base):
        got = {}
        leader = eng.submit(prompt, params, lambda o, g=got: g.setdefault(0, []).extend(o.token_ids),
                            choice=0)
        eng.submit(prompt, params, lambda o, g=got: g.setdefault(1, []).extend(o.token_ids),
                   choice=1, follows=leader)
        eng._drain_commands()
        run_to_end(eng)
        outs[eng is win] = got
    assert outs[True] == outs[False]


@pytest.mark.slow          # ~30 s; test_serving_real covers preemption by recompute by default
def test_preemption_with_a_small_pool_recomputes_the_same(path):
    # 78 blocks in each pool (a small budget: the planner makes them equal): the first two
    # prompts (38 + 39 blocks) are admitted in one step, their 48 outputs need 83: preemption
    win, base = _pair(path, kv_budget_bytes=78 * 16 * (3072 + 15360), max_running_seqs=4,
                      max_tokens_per_step=1024)
    assert win.runner.kv_plan.num_blocks == win.runner.kv_plan.window_blocks == 78
    prompts = [tokens(base, n, seed=40 + n) for n in (600, 616, 632, 648)]
    expected = [alone(base, p, 48) for p in prompts]
    win.scheduler.config = win.scheduler.config.__class__(
        **{**win.scheduler.config.__dict__, "output_reserve": 0})
    sinks = [submit(win, p, 48) for p in prompts]
    run_to_end(win)
    assert [s.token_ids for s in sinks] == expected
    assert win.stats()["preemptions"] > 0
    assert win.stats()["kv_blocks_used"] == 0 and win.stats()["kv_window_blocks_used"] == 0
