"""Block tables of sequences: admission with prefix reuse, growth, copy-on-write, release.

The single owner of the block pool and the prefix cache. The scheduler decides *who*
gets blocks; this module decides *which* blocks and keeps tables, refcounts and the tree
consistent.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from edgeinfer.engine.block_pool import BlockPool, BlockPoolError
from edgeinfer.engine.prefix_cache import PrefixCache, PrefixCacheStats, _Node
from edgeinfer.engine.sequence import Sequence


@dataclass(frozen=True)
class KVStats:
    num_blocks: int
    block_size: int
    blocks_used: int  # referenced by at least one sequence
    blocks_free: int  # in the free list
    blocks_cached: int  # unreferenced but holding prefix-cache K/V (evictable)
    prefix: PrefixCacheStats | None


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_cache: bool = True):
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.pool = BlockPool(num_blocks)
        self.prefix: PrefixCache | None = PrefixCache(self.pool, block_size) if enable_prefix_cache else None
        # seq_id -> deepest published node of that sequence, so publishing is O(new blocks)
        self._tail: dict[int, _Node] = {}

    # -- sizes -----------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_available(self) -> int:
        """Blocks obtainable now: free ones plus unreferenced cached ones (evicted on demand)."""
        return self.pool.num_available

    def _allocate(self) -> int:
        block_id = self.pool.allocate()
        if block_id is None and self.prefix is not None and self.prefix.evict(1):
            block_id = self.pool.allocate()
        if block_id is None:
            raise BlockPoolError("allocation past the checked availability")
        return block_id

    # -- admission -------------------------------------------------------------------
    def admit(self, seq: Sequence, reserved_len: int, headroom: int) -> int | None:
        """Give a waiting `seq` its table: cached prefix blocks plus fresh blocks for the rest.

        `reserved_len` tokens (prompt + output reserve) must fit within `headroom`
        available blocks, counting cache hits as already present. Returns the headroom
        consumed, or None (and changes nothing) when it does not fit.
        """
        if seq.block_table:
            raise BlockPoolError(f"{seq!r} admitted while holding blocks")
        tokens = seq.token_ids
        n = len(tokens)
        lookup = self.prefix is not None and seq.reuse_prefix
        need_total = self.blocks_for(max(reserved_len, n))
        max_hit = (n - 1) // self.block_size if lookup else 0
        if headroom < need_total - max_hit:  # cheap reject before walking the tree
            return None
        nodes = self.prefix.match_nodes(tokens) if lookup else []
        hits = [node.block_id for node in nodes]
        # reviving an evictable hit takes it out of the available count
        revived = sum(1 for b in hits if self.pool.ref_count(b) == 0)
        cost = need_total - len(hits) + revived
        if cost > headroom:
            return None
        for b in hits:
            self.pool.incref(b)
        table = hits + [self._allocate() for _ in range(self.blocks_for(n) - len(hits))]
        seq.block_table = table
        seq.num_computed_tokens = seq.num_cached_tokens = len(hits) * self.block_size
        seq.num_published_blocks = len(hits)
        seq.reserved_len = max(reserved_len, n)
        if nodes:
            self._tail[seq.seq_id] = nodes[-1]
        if lookup:
            self.prefix.record_lookup(n, seq.num_cached_tokens)
        return cost

    # -- per-step growth ---------------------------------------------------------------
    def prepare_write(self, seq: Sequence, start: int, end: int) -> bool:
        """Make positions start..end-1 of `seq` writable: append the blocks its table lacks.
        False, changing nothing, when the pool cannot supply them. (Blocks are shared only
        through the prefix cache, and only full ones, so a write never lands in a shared
        block: n > 1 shares a prompt that way, not by forking tables.)"""
        if start != seq.num_computed_tokens or end <= start:
            raise ValueError(f"bad write range {start}..{end} for {seq!r}")
        bs = self.block_size
        table = seq.block_table
        last = (end - 1) // bs
        if last + 1 - len(table) > self.num_available:
            return False
        for idx in range(start // bs, min(last + 1, len(table))):
            b = table[idx]
            if self.pool.ref_count(b) > 1 or self.pool.is_cached(b):
                raise BlockPoolError(f"write into shared or published block {b} of {seq!r}")
        while len(table) <= last:
            table.append(self._allocate())
        return True

    def on_computed(self, seq: Sequence) -> None:
        """Publish the blocks that became full after `seq.num_computed_tokens` advanced."""
        if self.prefix is None:
            return
        n_full = seq.num_computed_tokens // self.block_size
        if n_full <= seq.num_published_blocks:
            return
        bs = self.block_size
        table = seq.block_table
        node = self._tail.get(seq.seq_id)
        for i in range(seq.num_published_blocks, n_full):
            key = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            node = self.prefix.extend(node, key, table[i])
            if node.block_id != table[i]:
                # same tokens computed twice concurrently: share the tree's block and drop
                # ours, which keeps "a table's published prefix is a tree path" true
                self.pool.incref(node.block_id)
                self.pool.free(table[i])
                table[i] = node.block_id
        assert node is not None
        self._tail[seq.seq_id] = node
        seq.num_published_blocks = n_full

    # -- release -----------------------------------------------------------------------
    def free(self, seq: Sequence) -> None:
        """Release all of `seq`'s blocks; published ones stay cached until evicted."""
        self.pool.free_table(seq.block_table)
        seq.block_table = []
        seq.num_published_blocks = 0
        self._tail.pop(seq.seq_id, None)

    # -- reporting -------------------------------------------------------------------
    def stats(self) -> KVStats:
        return KVStats(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            blocks_used=self.pool.num_used,
            blocks_free=self.pool.num_free,
            blocks_cached=self.pool.num_evictable,
            prefix=self.prefix.stats() if self.prefix is not None else None,
        )

    def check_invariants(self, live_sequences: Iterable[Sequence]) -> None:
        live = list(live_sequences)
        self.pool.check_invariants(live)
        if self.prefix is not None:
            self.prefix.check_invariants()
            for seq in live:
                self._check_published_path(seq)
        for seq_id in self._tail:
            if not any(s.seq_id == seq_id and s.block_table for s in live):
                raise BlockPoolError(f"tail node kept for released sequence {seq_id}")

    def _check_published_path(self, seq: Sequence) -> None:
        assert self.prefix is not None
        if seq.num_published_blocks > len(seq.block_table):
            raise BlockPoolError(f"{seq!r} published more blocks than it holds")
        if seq.num_published_blocks * self.block_size > seq.num_computed_tokens:
            raise BlockPoolError(f"{seq!r} published blocks it has not computed")
        node = self.prefix.root
        bs = self.block_size
        for i in range(seq.num_published_blocks):
            node = node.children.get(tuple(seq.token_ids[i * bs : (i + 1) * bs]))
            if node is None or node.block_id != seq.block_table[i]:
                raise BlockPoolError(f"{seq!r} block {i} is not the tree's block for its tokens")
