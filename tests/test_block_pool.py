"""BlockPool: free / owned / evictable bookkeeping and its invariant check."""

import pytest

from edgeinfer.engine.block_pool import BlockPool, BlockPoolError
from edgeinfer.engine.sequence import Sequence


class _Params:
    max_tokens = 8


def _seq(seq_id, table):
    s = Sequence(seq_id, [1, 2, 3], _Params())
    s.block_table = list(table)
    return s


def test_allocate_until_empty_then_none():
    pool = BlockPool(3)
    got = [pool.allocate() for _ in range(3)]
    assert sorted(got) == [0, 1, 2]
    assert pool.allocate() is None
    assert pool.num_free == 0 and pool.num_used == 3
    pool.check_invariants([_seq(0, got)])


def test_free_returns_uncached_block_to_free_list():
    pool = BlockPool(2)
    b = pool.allocate()
    pool.incref(b)
    pool.free(b)
    assert pool.ref_count(b) == 1 and pool.num_free == 1
    pool.free(b)
    assert pool.ref_count(b) == 0 and pool.num_free == 2
    pool.check_invariants([])


def test_double_free_and_incref_of_free_block_are_caught():
    pool = BlockPool(2)
    b = pool.allocate()
    pool.free(b)
    with pytest.raises(BlockPoolError):
        pool.free(b)
    with pytest.raises(BlockPoolError):
        pool.incref(b)


def test_cached_block_goes_to_evictable_in_release_order():
    pool = BlockPool(4)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    for x in (a, b, c):
        pool.mark_cached(x)
    pool.free_table([a, b])  # released last-first: b then a
    pool.free(c)
    assert pool.evictable_lru() == [b, a, c]
    assert pool.num_evictable == 3 and pool.num_free == 1 and pool.num_available == 4
    pool.check_invariants([])
    # a hit revives a block: out of the LRU, owned again
    pool.incref(a)
    assert pool.evictable_lru() == [b, c]
    pool.check_invariants([_seq(0, [a])])
    assert pool.pop_lru_evictable() == b
    pool.reclaim(b)
    assert not pool.is_cached(b) and pool.num_free == 2
    pool.check_invariants([_seq(0, [a])])


def test_reclaim_requires_a_popped_block():
    pool = BlockPool(2)
    a = pool.allocate()
    pool.mark_cached(a)
    with pytest.raises(BlockPoolError):
        pool.reclaim(a)  # still owned
    pool.free(a)
    with pytest.raises(BlockPoolError):
        pool.reclaim(a)  # evictable but not popped


def test_mark_cached_needs_an_owned_block():
    pool = BlockPool(2)
    with pytest.raises(BlockPoolError):
        pool.mark_cached(0)


def test_invariants_catch_leaks_double_ownership_and_bad_refcounts():
    pool = BlockPool(4)
    a, b = pool.allocate(), pool.allocate()
    pool.check_invariants([_seq(0, [a]), _seq(1, [b])])
    with pytest.raises(BlockPoolError, match="refcount"):
        pool.check_invariants([_seq(0, [a])])  # b leaked: owned by nobody
    with pytest.raises(BlockPoolError, match="refcount"):
        pool.check_invariants([_seq(0, [a, b]), _seq(1, [b])])  # b held twice, ref 1
    with pytest.raises(BlockPoolError, match="twice"):
        pool.check_invariants([_seq(0, [a, a]), _seq(1, [b])])
    pool.incref(b)
    pool.check_invariants([_seq(0, [a, b]), _seq(1, [b])])


def test_invariants_catch_a_finished_sequence_holding_blocks():
    from edgeinfer.engine.sequence import SequenceStatus

    pool = BlockPool(2)
    a = pool.allocate()
    s = _seq(0, [a])
    s.status = SequenceStatus.FINISHED_LENGTH
    with pytest.raises(BlockPoolError, match="finished"):
        pool.check_invariants([s])
