"""The sliding-window layer group: window blocks released as they leave every window, the
prefix cache past the window, and the accounting in both pools.

Scenarios run through test_scheduler's fake runner, which writes each token into both the
full-attention store and the window store and checks that every chunk sees exactly its
last `window` positions through the window table (and everything through the block table),
so a released block that is still needed, or a hit with missing window K/V, shows up as a
corrupt view or a token stream that differs from the reference.
"""
from __future__ import annotations

import pytest

from edgeinfer.engine.block_pool import BlockPoolError
from edgeinfer.engine.kv_manager import KVCacheManager
from edgeinfer.engine.sequence import Sequence
from test_scheduler import Harness, _config, _prompt

BS = 4
W = 10                     # positions p - 9 .. p: 4 window blocks at most (span)


class _P:
    max_tokens = 100


def _harness(num_blocks=200, window_blocks=16, **kw):
    kw.setdefault("max_tokens_per_step", 16)
    return Harness(_config(num_blocks=num_blocks, block_size=BS, **kw),
                   window=W, window_blocks=window_blocks)


def test_span_and_first_window_block():
    kv = KVCacheManager(64, BS, window=W, window_blocks=8)
    assert kv.window_span_blocks == 4          # ceil(9 / 4) + 1
    assert kv.first_window_block(9) == 0       # position 9 sees 0..9
    assert kv.first_window_block(12) == 0      # sees 3..12: block 0 still needed
    assert kv.first_window_block(13) == 1      # sees 4..13
    assert kv.window_blocks_for(5) == 2 and kv.window_blocks_for(1000) == 4


def test_a_long_sequence_holds_one_window_of_window_blocks():
    h = _harness(window_blocks=4 + 4 + 1)      # one window + one 16-token chunk + 1
    seq = h.add(0, _prompt(0, 150), 60)
    peak = 0
    while h.sched.has_work():
        h.step()
        if seq.block_table:
            held = len(seq.window_table) - seq.window_released
            peak = max(peak, held)
            if not seq.is_prefilling:   # decoding: at most one window's blocks
                assert held <= h.kv.window_span_blocks
            assert all(b == -1 for b in seq.window_table[:seq.window_released])
    h.assert_matches_reference(0)
    assert peak <= 4 + 4 + 1
    assert h.kv.stats().window_blocks_used == 0


def test_more_sequences_fit_than_full_tables_would_allow():
    # 4 sequences of 120 tokens: 4 x 30 window blocks without release, 4 x 4 with it
    h = _harness(num_blocks=4 * 32, window_blocks=4 * 5 + 4, max_tokens_per_step=16,
                 output_reserve=0)
    for i in range(4):
        h.add(i, _prompt(10 + i, 100), 20)
    h.run()
    for i in range(4):
        h.assert_matches_reference(i)
    assert h.sched.stats().num_preemptions == 0


def test_prefix_hit_longer_than_the_window_equals_a_cold_run():
    h = _harness()
    prompt = _prompt(1, 60)                     # 15 full blocks, window = 4 blocks
    a = h.add(0, prompt, 5)
    h.run()
    b = h.add(1, prompt + _prompt(2, 7), 9)
    h.run()
    # everything up to the last full block of b's prompt before its last token is a hit
    assert b.num_cached_tokens == 60 > W
    h.assert_matches_reference(0)
    h.assert_matches_reference(1)
    # only the last window of the hit had to be cached in the window pool
    assert a.is_finished and b.is_finished


def test_hit_shortens_to_where_window_blocks_are_still_cached():
    # a window pool of 9 blocks: while a 80-token prompt prefills, the window blocks it
    # released early are evicted for its later ones; the tree keeps all 20 nodes
    h = _harness(window_blocks=9)
    prompt = _prompt(3, 80)
    h.add(0, prompt, 1)
    h.run()
    tree = h.kv.prefix
    nodes = [_node(tree, prompt, i) for i in range(20)]
    assert all(n is not None for n in nodes)
    with_window = [i for i, n in enumerate(nodes) if n.window_id >= 0]
    assert with_window == list(range(20 - len(with_window), 20)) and 3 <= len(with_window) < 10
    # the whole prompt: its last window (blocks 17..19) is cached, so the hit is complete
    c = h.add(2, prompt + _prompt(5, 3), 6)
    h.run()
    assert c.num_cached_tokens == 80
    h.assert_matches_reference(2)
    # a prefix that ends where no window K/V is left: no hit at all (every shorter hit's
    # window reaches back to evicted blocks), and the result is still right
    assert all(nodes[i].window_id < 0 for i in range(7, 10))
    b = h.add(1, prompt[:40] + _prompt(4, 5), 6)
    h.run()
    assert b.num_cached_tokens == 0
    h.assert_matches_reference(1)
    # b computed blocks 0..9 again: the tree's nodes got their window blocks back
    assert all(nodes[i].window_id >= 0 for i in range(7, 10))
    d = h.add(3, prompt[:40] + _prompt(6, 5), 6)
    h.run()
    assert d.num_cached_tokens == 40
    h.assert_matches_reference(3)


def _node(tree, tokens, index):
    node = tree.root
    for i in range(index + 1):
        node = node.children.get(tuple(tokens[i * BS:(i + 1) * BS]))
        if node is None:
            return None
    return node


def test_evicted_window_blocks_never_serve_a_hit_directly():
    kv = KVCacheManager(64, BS, window=W, window_blocks=12)
    a = Sequence(0, _prompt(5, 41), _P())
    assert kv.admit(a, 0, kv.available()) is not None
    assert kv.prepare_write(a, 0, 41)
    a.num_computed_tokens = 41
    kv.on_computed(a)
    # a sees positions 31.. from now on: blocks 0..6 are released but stay cached
    assert a.window_released == kv.first_window_block(41) == 8
    kv.free(a)
    kv.check_invariants([])
    # evict every window block: the tree keeps its nodes, the window pool gets them back
    assert kv.prefix.evict_window(100) == 10
    assert kv.window_pool.num_free == 12
    b = Sequence(1, a.token_ids + [1], _P())
    cost = kv.admit(b, 0, kv.available())
    assert cost is not None and b.num_cached_tokens == 0 and b.window_table == []
    kv.check_invariants([b])


def test_hit_takes_only_the_last_window_of_window_blocks():
    kv = KVCacheManager(64, BS, window=W, window_blocks=16)
    a = Sequence(0, _prompt(6, 48), _P())
    kv.admit(a, 0, kv.available())
    kv.prepare_write(a, 0, 48)
    a.num_computed_tokens = 48
    kv.on_computed(a)
    kv.free(a)
    b = Sequence(1, a.token_ids + [7, 7], _P())
    before = kv.window_pool.num_evictable
    cost = kv.admit(b, 0, kv.available())
    assert b.num_cached_tokens == 48
    lo = kv.first_window_block(48)               # 48 - 9 = 39 -> block 9
    assert lo == 9 and b.window_released == 9
    assert b.window_table[:9] == [-1] * 9 and all(w >= 0 for w in b.window_table[9:])
    assert len(b.window_table) == 12
    # revived 3 cached window blocks, promised one more for the window of its decode
    assert cost[1] == 3 + (kv.window_blocks_for(50) - 3)
    assert kv.window_pool.num_evictable == before - 3
    kv.check_invariants([b])


def test_window_blocks_are_private_to_writes():
    kv = KVCacheManager(64, BS, window=W, window_blocks=16)
    a = Sequence(0, _prompt(7, 12), _P())
    kv.admit(a, 0, kv.available())
    kv.prepare_write(a, 0, 12)
    a.num_computed_tokens = 12
    kv.on_computed(a)
    # a published block 2 (positions 8..11): its window block may not be written again
    a.num_computed_tokens = 8
    with pytest.raises(BlockPoolError):
        kv.prepare_write(a, 8, 12)


def test_window_pool_shortage_refuses_the_write_atomically():
    kv = KVCacheManager(64, BS, window=W, window_blocks=3)
    a = Sequence(0, _prompt(8, 20), _P())
    kv.admit(a, 0, (64, 10))                    # the caller's headroom: not checked here
    assert not kv.prepare_write(a, 0, 16)       # 4 window blocks > 3
    assert a.window_table == [] and kv.window_pool.num_free == 3
    assert kv.prepare_write(a, 0, 12)
    kv.check_invariants([a])


def test_plan_sizes_the_window_pool_by_the_scheduler_and_the_rest_by_the_budget(gemma3_path):
    from edgeinfer.formats.gguf_file import read_gguf
    from edgeinfer.formats.model_config import load_model_config
    from edgeinfer.runners.base import plan_kv, window_layers_of
    gf = read_gguf(str(gemma3_path))
    cfg = load_model_config(gf)
    gf.close()
    assert window_layers_of(cfg) == tuple(i for i in range(18) if (i + 1) % 6)
    one = plan_kv(cfg, 1 << 30, 2, 16)
    assert one.window_blocks == 0 and one.bytes_per_token == 18432
    two = plan_kv(cfg, 1 << 30, 2, 16, windowed=True, max_running_seqs=16,
                  max_tokens_per_step=512)
    assert (two.bytes_per_token, two.window_bytes_per_token) == (3072, 15360)
    assert two.window_blocks == 16 * 34 + 32 and two.nbytes <= 1 << 30
    assert two.capacity_tokens > 5 * one.capacity_tokens
    # a 32K context: 3 layers for every token, 15 for one window (33 blocks)
    assert two.context_bytes(32768) == 32768 * 3072 + 33 * 16 * 15360
    assert one.context_bytes(32768) == 32768 * 18432
    # small budgets: both pools the same size, so the window pool is never the shortage
    small = plan_kv(cfg, 8 << 20, 2, 16, windowed=True)
    assert small.window_blocks == small.num_blocks == (8 << 20) // (16 * 18432)
    # min_tokens still wins
    assert plan_kv(cfg, 0, 2, 16, min_tokens=1000, windowed=True).capacity_tokens >= 1000


def test_show_and_ps_say_what_the_window_layers_keep(gemma3_path):
    from edgeinfer.cli.manage import format_ps
    from edgeinfer.cli.show import kv_row, load_summary
    _, text = kv_row(load_summary(str(gemma3_path)), "cpu", "f16")
    assert text.startswith("18,432 bytes/token (f16 on cpu)")
    assert "15 of 18 layers see only the last 512 tokens" in text
    assert "3,072 bytes/token past them, 104 MB for a 32K context" in text
    out = format_ps([{"name": "gemma3:270m", "digest": "a" * 64, "size": 1, "backend": "cpu",
                      "kv_cache_type": "f16", "kv_bytes_per_token": 3072, "kv_window": 512}])
    assert "f16 3,072 B/tok + 512-tok window" in out
