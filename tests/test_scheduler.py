"""Scheduler scenarios driven by a fake runner that keeps a fake KV cache.

The fake runner stores, per (block, slot), the token id it "wrote" there, then reads every
scheduled sequence's positions 0..n back through its block table, as attention would, and
derives the next token from what it read. Any prefix-cache, copy-on-write or block-table
bug therefore shows up as an assertion or as a token stream that differs from the
reference computed without any scheduler at all.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgeinfer.engine.kv_manager import KVCacheManager
from edgeinfer.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from edgeinfer.engine.sequence import Sequence, SequenceStatus
from edgeinfer.engine.stops import length_reason

VOCAB = 997


def next_token(history: list[int]) -> int:
    """The fake model: a deterministic function of the whole token history (FNV-1a)."""
    h = 1469598103934665603
    for t in history:
        h = ((h ^ t) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h % VOCAB


@dataclass
class Params:
    max_tokens: int


def reference(tokens, n_out, max_tokens, stops=frozenset(), max_model_len=10**9):
    """Token stream and finish reason of an unconstrained run continuing from `tokens`."""
    tokens = list(tokens)
    while True:
        t = next_token(tokens)
        tokens.append(t)
        n_out += 1
        if t in stops:
            return tokens, "stop"
        if n_out >= max_tokens or len(tokens) >= max_model_len:
            return tokens, "length"


class FakeKVRunner:
    """With a window group (kv.window > 0) it also keeps a window store, written through
    each sequence's window table, and checks that every chunk's positions see their last
    `window` positions there, as the sliding-window layers would read them."""

    def __init__(self, kv: KVCacheManager):
        self.kv = kv
        self.bs = kv.block_size
        self.store = [[None] * kv.block_size for _ in range(kv.num_blocks)]
        self.wstore = ([[None] * kv.block_size for _ in range(kv.window_pool.num_blocks)]
                       if kv.window else None)

    def execute(self, out: SchedulerOutput) -> dict[int, int]:
        pool, bs = self.kv.pool, self.bs
        # the whole batch writes before anyone reads, as in a layer of a real forward
        for ch in out.chunks:
            seq = ch.seq
            assert ch.start == seq.num_computed_tokens
            assert ch.token_ids == seq.token_ids[ch.start : ch.start + len(ch.token_ids)]
            for j, t in enumerate(ch.token_ids):
                p = ch.start + j
                b = seq.block_table[p // bs]
                # only a private, unpublished block may be written
                assert pool.ref_count(b) == 1, (seq, p, b)
                assert not pool.is_cached(b), (seq, p, b)
                self.store[b][p % bs] = t
                if self.wstore is not None:
                    w = seq.window_table[p // bs]
                    wpool = self.kv.window_pool
                    assert w >= 0 and wpool.ref_count(w) == 1 and not wpool.is_cached(w)
                    self.wstore[w][p % bs] = t
        sampled = {}
        for ch in out.chunks:
            seq = ch.seq
            end = ch.start + len(ch.token_ids)
            view = [self.store[seq.block_table[p // bs]][p % bs] for p in range(end)]
            assert view == seq.token_ids[:end], f"attention view of {seq!r} is corrupt"
            if self.wstore is not None:
                lo = max(0, ch.start - self.kv.window + 1)
                wview = [self.wstore[seq.window_table[p // bs]][p % bs] for p in range(lo, end)]
                assert wview == seq.token_ids[lo:end], f"window view of {seq!r} is corrupt"
            assert ch.needs_logits == (end == seq.num_tokens)
            if ch.needs_logits:
                sampled[seq.seq_id] = next_token(view)
        return sampled


class Harness:
    """A minimal engine loop: schedule, run, update, stop tokens, invariants."""

    def __init__(self, config: SchedulerConfig, prefix_cache=True, stops=frozenset(),
                 window=0, window_blocks=0):
        self.config = config
        self.kv = KVCacheManager(config.num_blocks, config.block_size, prefix_cache,
                                 window=window, window_blocks=window_blocks)
        self.sched = Scheduler(config, self.kv)
        self.runner = FakeKVRunner(self.kv)
        self.stops = frozenset(stops)
        self.seqs: dict[int, Sequence] = {}
        self.expected: dict[int, tuple[list[int], str]] = {}
        self.outputs: list[SchedulerOutput] = []
        self.first_step: dict[int, int] = {}
        self.steps = 0

    def add(self, seq_id, prompt, max_tokens):
        seq = Sequence(seq_id, prompt, Params(max_tokens))
        self.seqs[seq_id] = seq
        if len(prompt) < self.config.max_model_len:
            self.expected[seq_id] = reference(
                prompt, 0, max_tokens, self.stops, self.config.max_model_len
            )
        self.sched.add(seq)
        return seq

    def step(self) -> SchedulerOutput:
        sched = self.sched
        decode_ready = {s.seq_id for s in sched.running if not s.is_prefilling}
        out = sched.schedule()
        self.outputs.append(out)
        # token budget, decodes first, every decode-ready sequence served or removed
        assert out.num_tokens <= self.config.max_tokens_per_step
        kinds = [c.seq.seq_id in decode_ready for c in out.chunks]
        assert kinds == sorted(kinds, reverse=True), "a prefill chunk came before a decode"
        served = {c.seq.seq_id for c in out.chunks}
        assert len(served) == len(out.chunks), "a sequence got two chunks in one step"
        gone = {s.seq_id for s in out.preempted + out.aborted + out.finished}
        assert decode_ready <= served | gone
        for c in out.chunks:
            self.first_step.setdefault(c.seq.seq_id, self.steps)
        sampled = self.runner.execute(out)
        sched.update(out, sampled)
        self.finish_sampled(sampled)
        sched.check_invariants()
        self.steps += 1
        return out

    def finish_sampled(self, sampled):
        """The engine's decision after each token: a stop token, else length."""
        for seq_id, token in sampled.items():
            seq = self.seqs[seq_id]
            if seq.is_finished:
                continue
            reason = "stop" if token in self.stops else length_reason(
                seq.num_output_tokens, seq.max_tokens, seq.num_tokens,
                self.config.max_model_len)
            if reason:
                self.sched.finish(seq_id, reason)

    def run(self, max_steps=5000, arrivals=None):
        arrivals = dict(arrivals or {})
        while self.sched.has_work() or arrivals:
            for args in arrivals.pop(self.steps, []):
                self.add(*args)
            self.step()
            assert self.steps < max_steps, "the scheduler stopped making progress"
        self.kv.check_invariants([])

    def assert_matches_reference(self, seq_id):
        seq = self.seqs[seq_id]
        tokens, reason = self.expected[seq_id]
        assert seq.token_ids == tokens, f"{seq!r} diverged from the unconstrained run"
        assert seq.finish_reason == reason


def _prompt(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def _config(**kw):
    base = dict(num_blocks=64, block_size=4, max_running_seqs=4, max_tokens_per_step=64,
                max_model_len=4096, output_reserve=8)
    base.update(kw)
    return SchedulerConfig(**base)


# -- batching ---------------------------------------------------------------------------
def test_continuous_batching_sequences_join_and_leave():
    h = Harness(_config())
    arrivals = {
        0: [(0, _prompt(0, 5), 3), (1, _prompt(1, 9), 12)],
        2: [(2, _prompt(2, 3), 5)],
        5: [(3, _prompt(3, 7), 4), (4, _prompt(4, 2), 9), (5, _prompt(5, 11), 2)],
    }
    h.run(arrivals=arrivals)
    for i in range(6):
        h.assert_matches_reference(i)
    batches = [{c.seq.seq_id for c in out.chunks} for out in h.outputs]
    # someone joined a batch while another was decoding, and someone left mid-flight
    assert any(2 in b and 1 in b for b in batches[2:3])
    assert any(b and 0 not in b and 1 in b for b in batches[1:])
    assert max(len(b) for b in batches) <= 4


def test_chunked_prefill_respects_budget_and_keeps_decodes_going():
    h = Harness(_config(max_tokens_per_step=16, output_reserve=0))
    for i in range(3):
        h.add(i, _prompt(i, 4), 40)
    h.step()
    long = h.add(9, _prompt(9, 100), 3)
    prefill_steps = 0
    while long.status is not SequenceStatus.RUNNING or long.is_prefilling or long.num_computed_tokens == 0:
        out = h.step()
        ids = [c.seq.seq_id for c in out.chunks]
        if 9 in ids:
            prefill_steps += 1
            assert ids[:3] == [0, 1, 2], "decodes must continue while the long prompt prefills"
            if not out.chunks[-1].needs_logits:
                assert out.num_tokens == 16  # the budget is used up, never exceeded
    assert prefill_steps >= 100 // 13
    h.run()
    for i in (0, 1, 2, 9):
        h.assert_matches_reference(i)


def test_fifo_admission_under_a_small_pool():
    # 12 blocks of 4: each request promises ceil((10 + 8) / 4) = 5 blocks -> two at a time
    h = Harness(_config(num_blocks=12, output_reserve=8))
    h.add(0, _prompt(0, 10), 8)
    h.add(1, _prompt(1, 10), 8)
    h.add(2, _prompt(2, 30), 8)  # the big one: 10 blocks with its reserve
    h.add(3, _prompt(3, 2), 8)  # small, but must not overtake the big one
    h.add(4, _prompt(4, 10), 8)
    running_max = 0
    while h.sched.has_work():
        h.step()
        running_max = max(running_max, len(h.sched.running))
    order = sorted(h.first_step, key=lambda s: (h.first_step[s], s))
    assert order == [0, 1, 2, 3, 4]
    assert h.first_step[0] == h.first_step[1] == 0
    assert h.first_step[2] > h.first_step[1]
    assert running_max <= 2
    assert h.sched.stats().num_preemptions == 0
    for i in range(5):
        h.assert_matches_reference(i)


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_preemption_and_resume_reproduce_the_unconstrained_streams(prefix_cache):
    # no output reserve: four requests get in, then their decodes outgrow 14 blocks
    h = Harness(_config(num_blocks=14, output_reserve=0), prefix_cache=prefix_cache)
    for i in range(4):
        h.add(i, _prompt(i, 6), 20)
    preempted = []
    while h.sched.has_work():
        out = h.step()
        preempted += [s.seq_id for s in out.preempted]
        for s in out.preempted:
            assert s.status is SequenceStatus.PREEMPTED and s.block_table == []
            assert h.sched.waiting[0] is out.preempted[-1]
    assert preempted, "the scenario must preempt"
    assert 0 not in preempted  # the oldest is never the victim while newer ones run
    assert h.sched.stats().num_preemptions == len(preempted)
    for i in range(4):
        h.assert_matches_reference(i)


def test_a_preempted_sequence_gets_its_prefix_back_on_resume():
    h = Harness(_config(num_blocks=6, output_reserve=0))
    old = h.add(0, _prompt(0, 6), 9)  # grows to 4 blocks
    new = h.add(1, _prompt(1, 8), 12)
    h.run()
    # new needed its 4th block first and was the newest: it preempted itself, then old
    # took one of its released blocks (the LRU leaf); the other two came back as hits
    assert new.num_preemptions == 1 and old.num_preemptions == 0
    assert new.num_cached_tokens == 8
    h.assert_matches_reference(0)
    h.assert_matches_reference(1)


def test_a_lone_sequence_that_fills_the_pool_finishes_by_length():
    h = Harness(_config(num_blocks=3, output_reserve=0))
    seq = h.add(0, _prompt(0, 5), 100)
    h.run()
    assert seq.finish_reason == "length"
    assert seq.num_tokens == 3 * 4 + 1  # all 12 slots computed, one sampled token more
    assert seq.token_ids == h.expected[0][0][: seq.num_tokens]


def test_max_model_len_ends_generation():
    h = Harness(_config(max_model_len=12))
    seq = h.add(0, _prompt(0, 5), 100)
    h.run()
    assert seq.num_tokens == 12 and seq.finish_reason == "length"
    h.assert_matches_reference(0)


def test_prompts_that_can_never_fit_are_finished_with_an_error():
    h = Harness(_config(num_blocks=4, max_model_len=64))
    big = h.add(0, _prompt(0, 17), 4)  # 5 blocks > the whole pool
    ok = h.add(1, _prompt(1, 3), 4)
    huge = h.add(2, _prompt(2, 64), 4)  # no room for output in max_model_len
    out = h.step()
    assert set(out.finished) == {big, huge}
    assert big.finish_reason == "error" and "too long for the KV pool" in big.error
    assert huge.finish_reason == "error" and "max_model_len" in huge.error
    h.run()
    h.assert_matches_reference(1)
    assert ok.finish_reason == "length"


# -- cancellation -----------------------------------------------------------------------
def test_abort_mid_prefill_and_mid_decode():
    h = Harness(_config(max_tokens_per_step=8, output_reserve=0))
    a = h.add(0, _prompt(0, 30), 10)  # prefills over several steps
    b = h.add(1, _prompt(1, 3), 50)
    c = h.add(2, _prompt(2, 3), 10)
    h.step()
    assert a.is_prefilling and a.num_computed_tokens > 0
    assert h.sched.abort(0)
    out = h.step()
    assert out.aborted == [a] and a.status is SequenceStatus.FINISHED_ABORTED
    assert a.finish_reason == "abort" and a.block_table == []
    while b.num_output_tokens < 5:
        h.step()
    # an abort that lands between schedule() and update(): the token is not appended
    out = h.sched.schedule()
    sampled = h.runner.execute(out)
    n_before = b.num_output_tokens
    h.sched.abort(1)
    h.sched.update(out, sampled)
    h.finish_sampled({k: v for k, v in sampled.items() if k != 1})
    assert b.num_output_tokens == n_before
    out = h.step()
    assert out.aborted == [b] and b.block_table == []
    assert not h.sched.abort(1)  # already gone
    h.run()
    h.assert_matches_reference(2)
    assert c.finish_reason == "length" and c.num_output_tokens == 10
    assert h.kv.stats().blocks_used == 0


def test_abort_of_a_waiting_sequence():
    h = Harness(_config(max_running_seqs=1, max_tokens_per_step=8))
    h.add(0, _prompt(0, 3), 5)
    w = h.add(1, _prompt(1, 3), 5)
    h.step()
    h.sched.abort(1)
    out = h.step()
    assert out.aborted == [w] and not h.sched.waiting
    h.run()
    h.assert_matches_reference(0)


# -- prefix reuse -----------------------------------------------------------------------
def test_shared_system_prompt_hits_the_prefix_cache():
    h = Harness(_config())
    system = _prompt(100, 32)  # 8 full blocks
    a = h.add(0, system + _prompt(1, 5), 6)
    h.run()
    b = h.add(1, system + _prompt(2, 3), 6)
    h.step()
    assert b.num_cached_tokens == 32
    # a request arriving while b decodes shares the same blocks
    c = h.add(2, system + _prompt(3, 9), 6)
    h.step()
    assert c.num_cached_tokens == 32
    assert c.block_table[:8] == b.block_table[:8]
    h.run()
    for i in range(3):
        h.assert_matches_reference(i)
    st = h.sched.stats()
    assert (st.prefix_hits, st.prefix_misses) == (2, 1)
    assert st.cached_tokens == 64
    assert a.num_cached_tokens == 0


def test_multi_turn_chat_reuses_the_previous_turn():
    h = Harness(_config())
    turn1 = _prompt(7, 10)
    s1 = h.add(0, turn1, 9)
    h.run()
    reply = s1.output_token_ids
    turn2 = turn1 + reply + _prompt(8, 5)
    s2 = h.add(1, turn2, 4)
    h.run()
    # turn 1 computed prompt + reply except the last sampled token: 18 tokens -> 4 blocks
    assert s2.num_cached_tokens == (10 + 9 - 1) // 4 * 4 == 16
    h.assert_matches_reference(0)
    h.assert_matches_reference(1)


def test_cache_evicts_old_prefixes_when_the_pool_needs_room():
    h = Harness(_config(num_blocks=10, output_reserve=0))
    for i in range(6):  # each leaves 2-3 full blocks in the cache
        h.add(i, _prompt(i, 11), 2)
        h.run()
    st = h.kv.stats()
    assert st.prefix.evicted_blocks > 0
    assert st.blocks_used == 0 and st.blocks_cached + st.blocks_free == 10
    # the most recent prefix is still there, the oldest is gone
    latest = h.add(10, h.seqs[5].token_ids[:12] + [1], 2)
    oldest = h.add(11, h.seqs[0].token_ids[:12] + [1], 2)
    h.run()
    assert latest.num_cached_tokens == 12
    assert oldest.num_cached_tokens == 0


# -- randomized ---------------------------------------------------------------------------
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_workloads_keep_invariants_and_finish_everything(data):
    # hypothesis picks the seed and the edge switches; the sizes come from the seeded RNG
    # so that most runs are busy, realistic workloads rather than shrunk minimal ones
    rng = random.Random(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    bs = rng.randint(1, 6)
    max_running = rng.randint(1, 6)
    config = SchedulerConfig(
        num_blocks=rng.randint(max(3, 24 // bs), 48),
        block_size=bs,
        max_running_seqs=max_running,
        max_tokens_per_step=rng.randint(max_running, 48),
        max_model_len=rng.randint(8, 160),
        output_reserve=data.draw(st.sampled_from([0, 4, 16]), label="reserve"),
    )
    num_blocks = config.num_blocks
    stops = frozenset(rng.sample(range(VOCAB), rng.choice([0, 0, 5, 30])))
    window = data.draw(st.sampled_from([0, 0, 1, 3, 8, 17]), label="window")
    # the window pool: as small as one sequence's window and a step's chunk, up to the full
    # pool's size (the planner's range)
    span = -(-(window - 1) // bs) + 1
    window_blocks = rng.randint(min(num_blocks, span + -(-config.max_tokens_per_step // bs) + 1),
                                num_blocks) if window else 0
    h = Harness(config, prefix_cache=data.draw(st.booleans(), label="prefix"), stops=stops,
                window=window, window_blocks=window_blocks)
    n_req = rng.randint(1, 12)
    shared = [rng.randrange(VOCAB) for _ in range(40)]
    arrivals: dict[int, list] = {}
    for i in range(n_req):
        n = rng.randint(1, 30)
        keep = rng.randint(0, n)  # shared prefixes so the cache gets hits
        prompt = shared[:keep] + [rng.randrange(VOCAB) for _ in range(n - keep)]
        arrivals.setdefault(rng.randint(0, 10), []).append((i, prompt, rng.randint(1, 24)))
    aborted: set[int] = set()
    while h.sched.has_work() or arrivals:
        for args in arrivals.pop(h.steps, []):
            h.add(*args)
        if h.sched.running and rng.random() < 0.05:
            victim = rng.choice(h.sched.live_sequences())
            if h.sched.abort(victim.seq_id):
                aborted.add(victim.seq_id)
        h.step()
        assert h.steps < 5000, "no progress"
    h.kv.check_invariants([])
    assert h.kv.stats().blocks_used == 0
    assert h.kv.stats().window_blocks_used == 0
    pool_tokens = num_blocks * bs
    for seq_id, seq in h.seqs.items():
        assert seq.is_finished
        assert seq.block_table == []
        if seq_id in aborted and seq.finish_reason == "abort":
            continue
        if seq.finish_reason == "error":
            assert (seq.num_prompt_tokens > pool_tokens
                    or seq.num_prompt_tokens >= config.max_model_len)
            continue
        tokens, reason = h.expected[seq_id]
        if seq.finish_reason == "length" and reason != "length" or seq.num_tokens < len(tokens):
            # cut short only because the whole pool could not hold its context
            assert seq.finish_reason == "length" and seq.num_tokens > pool_tokens
            assert seq.token_ids == tokens[: seq.num_tokens]
        else:
            assert seq.token_ids == tokens and seq.finish_reason == reason
