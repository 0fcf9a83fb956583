"""Radix prefix cache and the KV manager's table operations (admit, publish, COW, evict)."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from edgeinfer.engine.block_pool import BlockPool, BlockPoolError
from edgeinfer.engine.kv_manager import KVCacheManager
from edgeinfer.engine.prefix_cache import PrefixCache
from edgeinfer.engine.sequence import Sequence

BS = 4


class _Params:
    max_tokens = 100


def _seq(seq_id, tokens):
    return Sequence(seq_id, list(tokens), _Params())


def _admit(kv, seq, reserved_len=0):
    cost = kv.admit(seq, reserved_len, headroom=kv.num_available)
    assert cost is not None
    return cost


def _compute_all(kv, seq):
    """Pretend the runner computed every known token of `seq`."""
    assert kv.prepare_write(seq, seq.num_computed_tokens, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    kv.on_computed(seq)


# -- the tree on its own ----------------------------------------------------------------
def _owned_blocks(pool, n):
    return [pool.allocate() for _ in range(n)]


def test_match_returns_longest_full_block_prefix_but_never_everything():
    pool = BlockPool(8)
    tree = PrefixCache(pool, BS)
    tokens = list(range(12))  # 3 full blocks
    blocks = _owned_blocks(pool, 3)
    assert tree.insert(tokens, blocks) == blocks
    assert tree.match(tokens + [99]) == blocks
    # the whole prompt cached: the last block is left to compute so logits exist
    assert tree.match(tokens) == blocks[:2]
    assert tree.match(tokens[:9]) == blocks[:2]
    assert tree.match(tokens[:8]) == blocks[:1]
    assert tree.match([0, 1, 2, 7, 4]) == []
    diverge = tokens[:4] + [50, 51, 52, 53, 54]
    assert tree.match(diverge) == blocks[:1]
    tree.check_invariants()


def test_insert_ignores_partial_block_and_dedups_same_tokens():
    pool = BlockPool(8)
    tree = PrefixCache(pool, BS)
    first = _owned_blocks(pool, 2)
    assert tree.insert(list(range(7)), first) == first[:1]  # 7 tokens: one full block
    second = _owned_blocks(pool, 2)
    # same first block computed elsewhere: the tree keeps its block; the new one is added
    assert tree.insert(list(range(8)), second) == [first[0], second[1]]
    assert len(tree) == 2
    assert not pool.is_cached(second[0]) and not pool.is_cached(first[1])
    tree.check_invariants()


def test_a_block_id_cannot_be_cached_twice():
    pool = BlockPool(4)
    tree = PrefixCache(pool, BS)
    (b,) = _owned_blocks(pool, 1)
    tree.insert([1, 2, 3, 4], [b])
    with pytest.raises(BlockPoolError):
        tree.insert([9, 9, 9, 9], [b])


# -- through the KV manager --------------------------------------------------------------
def test_admission_reuses_cached_blocks_and_counts_hits():
    kv = KVCacheManager(16, BS)
    a = _seq(0, range(10))
    _admit(kv, a)
    assert a.num_cached_tokens == 0 and len(a.block_table) == 3
    _compute_all(kv, a)
    assert a.num_published_blocks == 2
    b = _seq(1, list(range(8)) + [70, 71, 72])
    _admit(kv, b)
    assert b.num_cached_tokens == 8 and b.num_computed_tokens == 8
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]
    st = kv.stats().prefix
    assert (st.lookups, st.hits, st.misses) == (2, 1, 1)
    assert (st.query_tokens, st.hit_tokens) == (21, 8)
    kv.check_invariants([a, b])
    kv.free(a)
    kv.free(b)
    kv.check_invariants([])
    assert kv.stats().blocks_cached == 2 and kv.stats().blocks_used == 0


def test_admission_refuses_what_does_not_fit_and_changes_nothing():
    kv = KVCacheManager(4, BS)
    s = _seq(0, range(10))
    assert kv.admit(s, reserved_len=20, headroom=4) is None  # 5 blocks > 4
    assert s.block_table == [] and kv.pool.num_free == 4
    assert kv.stats().prefix.lookups == 0
    assert kv.admit(s, reserved_len=16, headroom=4) == (4, 0)
    kv.check_invariants([s])


def test_revived_cached_blocks_cost_headroom():
    kv = KVCacheManager(6, BS)
    a = _seq(0, range(9))
    _admit(kv, a)
    _compute_all(kv, a)
    kv.free(a)  # 2 published blocks now evictable, 4 free
    b = _seq(1, list(range(8)) + [5])
    # needs 3 blocks: 2 hits (both evictable, so they leave the available count) + 1 new
    assert kv.admit(b, 0, headroom=2) is None
    assert kv.admit(b, 0, headroom=3) == (3, 0)
    assert b.num_cached_tokens == 8
    kv.check_invariants([b])


def test_concurrent_duplicate_prefill_adopts_the_published_block():
    kv = KVCacheManager(16, BS)
    prompt = list(range(9))
    a, b = _seq(0, prompt), _seq(1, prompt)
    _admit(kv, a)
    _admit(kv, b)  # a has not published yet: no hit
    assert b.num_cached_tokens == 0
    _compute_all(kv, a)
    before = list(b.block_table)
    _compute_all(kv, b)
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] == before[2]  # the partial block stays its own
    assert kv.pool.num_free == 16 - 4  # b's two duplicate blocks went back
    kv.check_invariants([a, b])


def test_eviction_is_lru_by_release_and_leaves_first():
    kv = KVCacheManager(12, BS)
    seqs = [_seq(i, [100 * i + t for t in range(9)]) for i in range(3)]  # 2 full blocks each
    for s in seqs:
        _admit(kv, s)
        _compute_all(kv, s)
    tables = {s.seq_id: list(s.block_table) for s in seqs}
    for i in (0, 2, 1):  # released in this order
        kv.free(seqs[i])
    kv.check_invariants([])
    tree = kv.prefix
    # a hit on seq 0's prefix makes it the most recently used once released again
    again = _seq(9, [t for t in range(9)])
    _admit(kv, again)
    assert again.num_cached_tokens == 8
    kv.free(again)
    assert tree.evict(1) == 1
    assert not kv.pool.is_cached(tables[2][1])  # seq 2's leaf went first
    assert kv.pool.is_cached(tables[2][0])
    assert tree.evict(3) == 3  # rest of 2, then 1's two blocks
    for b in tables[1][:2] + tables[2][:2]:
        assert not kv.pool.is_cached(b)
    assert kv.pool.is_cached(tables[0][0]) and kv.pool.is_cached(tables[0][1])
    kv.check_invariants([])
    assert tree.evict(10) == 2 and len(tree) == 0
    assert kv.pool.num_free == 12
    assert tree.stats().evicted_blocks == 6


def test_shared_prefix_survives_while_a_sharer_runs():
    kv = KVCacheManager(12, BS)
    system = list(range(8))
    a = _seq(0, system + [50, 51, 52, 53, 54])
    _admit(kv, a)
    _compute_all(kv, a)
    b = _seq(1, system + [60, 61, 62])
    _admit(kv, b)
    assert b.num_cached_tokens == 8
    kv.free(a)
    # only a's private full block is evictable; the shared system blocks are b's too
    assert kv.prefix.evict(10) == 1
    assert kv.pool.is_cached(b.block_table[0]) and kv.pool.is_cached(b.block_table[1])
    kv.check_invariants([b])


def test_allocation_evicts_cached_blocks_when_the_free_list_is_empty():
    kv = KVCacheManager(3, BS)
    a = _seq(0, range(9))
    _admit(kv, a)
    _compute_all(kv, a)
    kv.free(a)
    assert kv.pool.num_free == 1 and kv.num_available == 3
    b = _seq(1, [7] * 12)
    _admit(kv, b)  # needs all three blocks: both cached ones are evicted
    assert len(b.block_table) == 3 and len(kv.prefix) == 0
    kv.check_invariants([b])


def test_prepare_write_refuses_atomically_when_the_pool_is_short():
    kv = KVCacheManager(2, BS)
    s = _seq(0, range(8))
    _admit(kv, s)
    s.num_computed_tokens = 8
    s.append_token(1)
    assert kv.prepare_write(s, 8, 9) is False
    assert len(s.block_table) == 2
    kv.check_invariants([s])


def test_writing_into_a_published_block_is_refused():
    kv = KVCacheManager(4, BS)
    s = _seq(0, range(5))
    _admit(kv, s)
    _compute_all(kv, s)
    s.num_computed_tokens = 3  # a bug elsewhere rewinding the counter
    with pytest.raises(BlockPoolError):
        kv.prepare_write(s, 3, 5)


def test_invariant_check_catches_a_table_that_disagrees_with_the_tree():
    kv = KVCacheManager(8, BS)
    a = _seq(0, range(9))
    _admit(kv, a)
    _compute_all(kv, a)
    a.token_ids[1] = 999  # table claims tokens the cached block does not hold
    with pytest.raises(BlockPoolError):
        kv.check_invariants([a])


def test_without_prefix_cache_blocks_go_straight_back():
    kv = KVCacheManager(4, BS, enable_prefix_cache=False)
    a = _seq(0, range(9))
    _admit(kv, a)
    _compute_all(kv, a)
    kv.free(a)
    assert kv.pool.num_free == 4 and kv.stats().prefix is None
    b = _seq(1, range(9))
    _admit(kv, b)
    assert b.num_cached_tokens == 0
    kv.check_invariants([b])


# -- stateful: random table operations against a fake KV store ----------------------------
_PREFIXES = [[7] * 12, [7] * 8 + [3] * 4, [1, 2, 3, 4, 5, 6, 7, 8]]


class KVTables(RuleBasedStateMachine):
    """Admit, compute, free and evict in any order; every computed position must read
    back, through the block table, the token the sequence has there."""

    def __init__(self):
        super().__init__()
        self.kv = KVCacheManager(10, BS)
        self.store = [[None] * BS for _ in range(10)]
        self.live: list[Sequence] = []
        self.next_id = 0

    @rule(prefix=st.sampled_from(_PREFIXES), tail=st.lists(st.integers(0, 9), max_size=9),
          reserve=st.integers(0, 12))
    def admit(self, prefix, tail, reserve):
        seq = _seq(self.next_id, prefix + tail)
        self.next_id += 1
        if self.kv.admit(seq, seq.num_tokens + reserve, self.kv.num_available) is not None:
            assert seq.num_computed_tokens < seq.num_tokens
            self.live.append(seq)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 50), n=st.integers(1, 9), token=st.integers(0, 9))
    def compute(self, i, n, token):
        seq = self.live[i % len(self.live)]
        start = seq.num_computed_tokens
        end = min(seq.num_tokens, start + n)
        if not self.kv.prepare_write(seq, start, end):
            return
        for p in range(start, end):
            b = seq.block_table[p // BS]
            assert self.kv.pool.ref_count(b) == 1 and not self.kv.pool.is_cached(b)
            self.store[b][p % BS] = seq.token_ids[p]
        seq.num_computed_tokens = end
        self.kv.on_computed(seq)
        if end == seq.num_tokens:
            seq.append_token(token)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 50))
    def free(self, i):
        seq = self.live.pop(i % len(self.live))
        self.kv.free(seq)

    @rule(n=st.integers(1, 4))
    def evict(self, n):
        before = self.kv.pool.num_evictable
        assert self.kv.prefix.evict(n) == min(n, before)

    @invariant()
    def tables_read_back_their_tokens(self):
        self.kv.check_invariants(self.live)
        for seq in self.live:
            view = [self.store[seq.block_table[p // BS]][p % BS]
                    for p in range(seq.num_computed_tokens)]
            assert view == seq.token_ids[: seq.num_computed_tokens]


KVTables.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestKVTables = KVTables.TestCase
