"""Block tables of sequences: admission with prefix reuse, growth, copy-on-write, release.

The single owner of the block pool and the prefix cache. The scheduler decides *who*
gets blocks; this module decides *which* blocks and keeps tables, refcounts and the tree
consistent.

Two layer groups when the model has sliding-window layers (Gemma 3: 5 of every 6 layers see
only the last `window` positions), as vLLM's hybrid KV cache manager has them: the
full-attention layers keep K/V of every position in `pool` through `seq.block_table`; the
sliding-window layers keep theirs in `window_pool` through `seq.window_table`, indexed the
same way (position p in entry p // block_size), whose entries are released (-1) as soon as
no position still to be computed can see them. A sequence so holds at most
`window_span_blocks` window blocks, whatever its length. Admission and growth count blocks
in both pools; a prefix-cache hit ends where the window blocks of its last `window`
positions are still cached.
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
    # the sliding-window group's pool (0 when the model has none)
    window: int = 0
    window_blocks: int = 0
    window_blocks_used: int = 0
    window_blocks_cached: int = 0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_cache: bool = True,
                 window: int = 0, window_blocks: int = 0):
        """`window > 0`: a sliding-window group whose layers attend to the last `window`
        positions, with its own pool of `window_blocks` blocks."""
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        if window < 0 or (window and window_blocks <= 0):
            raise ValueError("a window group needs a positive window and pool")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.pool = BlockPool(num_blocks)
        self.window = window
        self.window_pool: BlockPool | None = BlockPool(window_blocks) if window else None
        # most window blocks a sequence holds when it computes one position: those that
        # cover positions p - window + 1 .. p
        self.window_span_blocks = -(-(window - 1) // block_size) + 1 if window else 0
        self.prefix: PrefixCache | None = (
            PrefixCache(self.pool, block_size, self.window_pool) if enable_prefix_cache else None)
        # seq_id -> deepest published node of that sequence, so publishing is O(new blocks)
        self._tail: dict[int, _Node] = {}

    # -- sizes -----------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def first_window_block(self, start: int) -> int:
        """The first window-table entry that positions from `start` on can still see."""
        return max(0, (start - self.window + 1) // self.block_size) if self.window else 0

    def window_blocks_for(self, num_tokens: int) -> int:
        """Window blocks a sequence of `num_tokens` tokens holds while it decodes."""
        return min(self.blocks_for(num_tokens), self.window_span_blocks)

    @property
    def num_available(self) -> int:
        """Blocks obtainable now: free ones plus unreferenced cached ones (evicted on demand)."""
        return self.pool.num_available

    def available(self) -> tuple[int, int]:
        """Blocks obtainable now in (the full-attention pool, the window pool)."""
        return (self.pool.num_available,
                self.window_pool.num_available if self.window_pool is not None else 0)

    def headroom(self, running: Iterable[Sequence]) -> tuple[int, int]:
        """available() less the blocks promised to `running` sequences but not yet taken:
        in the full pool their reserved length, in the window pool one window each."""
        full = win = 0
        for s in running:
            full += max(0, self.blocks_for(s.reserved_len) - len(s.block_table))
            if self.window:
                held = len(s.window_table) - s.window_released
                win += max(0, self.window_blocks_for(s.reserved_len) - held)
        a_full, a_win = self.available()
        return a_full - full, a_win - win

    def _allocate(self) -> int:
        block_id = self.pool.allocate()
        if block_id is None and self.prefix is not None and self.prefix.evict(1):
            block_id = self.pool.allocate()
        if block_id is None:
            raise BlockPoolError("allocation past the checked availability")
        return block_id

    def _allocate_window(self) -> int:
        assert self.window_pool is not None
        block_id = self.window_pool.allocate()
        if block_id is None and self.prefix is not None and self.prefix.evict_window(1):
            block_id = self.window_pool.allocate()
        if block_id is None:
            raise BlockPoolError("window allocation past the checked availability")
        return block_id

    def _window_hit(self, nodes: list[_Node]) -> int:
        """The longest hit (in blocks) whose last `window` positions have window K/V."""
        run = 0
        best = 0
        for i, node in enumerate(nodes):
            run = run + 1 if node.window_id >= 0 else 0
            h = i + 1
            if run >= h - self.first_window_block(h * self.block_size):
                best = h
        return best

    # -- admission -------------------------------------------------------------------
    def admit(self, seq: Sequence, reserved_len: int,
              headroom: int | tuple[int, int]) -> tuple[int, int] | None:
        """Give a waiting `seq` its table: cached prefix blocks plus fresh blocks for the rest.

        `reserved_len` tokens (prompt + output reserve) must fit within `headroom`
        available blocks (per pool: see headroom(); an int is the full pool's, with the
        whole window pool), counting cache hits as already present. Returns the headroom
        consumed per pool, or None (and changes nothing) when it does not fit. Window
        blocks beyond the hit are taken as the prefill reaches them (prepare_write).
        """
        if seq.block_table or seq.window_table:
            raise BlockPoolError(f"{seq!r} admitted while holding blocks")
        if isinstance(headroom, int):
            headroom = (headroom, self.available()[1])
        room_full, room_win = headroom
        tokens = seq.token_ids
        n = len(tokens)
        lookup = self.prefix is not None and seq.reuse_prefix
        reserved = max(reserved_len, n)
        need_total = self.blocks_for(reserved)
        max_hit = (n - 1) // self.block_size if lookup else 0
        if room_full < need_total - max_hit:  # cheap reject before walking the tree
            return None
        nodes = self.prefix.match_nodes(tokens) if lookup else []
        if self.window and nodes:
            nodes = nodes[:self._window_hit(nodes)]
        hits = [node.block_id for node in nodes]
        # reviving an evictable hit takes it out of the available count
        revived = sum(1 for b in hits if self.pool.ref_count(b) == 0)
        cost = need_total - len(hits) + revived
        if cost > room_full:
            return None
        cost_win = 0
        lo = self.first_window_block(len(hits) * self.block_size)
        if self.window:
            wpool = self.window_pool
            whits = [node.window_id for node in nodes[lo:]]
            cost_win = (sum(1 for b in whits if wpool.ref_count(b) == 0)
                        + max(0, self.window_blocks_for(reserved) - len(whits)))
            if cost_win > room_win:
                return None
            for b in whits:
                wpool.incref(b)
            seq.window_table = [-1] * lo + whits
            seq.window_released = lo
        for b in hits:
            self.pool.incref(b)
        table = hits + [self._allocate() for _ in range(self.blocks_for(n) - len(hits))]
        seq.block_table = table
        seq.num_computed_tokens = seq.num_cached_tokens = len(hits) * self.block_size
        seq.num_published_blocks = len(hits)
        seq.reserved_len = reserved
        if nodes:
            self._tail[seq.seq_id] = nodes[-1]
        if lookup:
            self.prefix.record_lookup(n, seq.num_cached_tokens)
        return cost, cost_win

    # -- per-step growth ---------------------------------------------------------------
    def prepare_write(self, seq: Sequence, start: int, end: int) -> bool:
        """Make positions start..end-1 of `seq` writable: append the blocks its tables lack
        (releasing window blocks no position from `start` on can see first). False,
        changing nothing else, when a pool cannot supply them. (Blocks are shared only
        through the prefix cache, and only full ones, so a write never lands in a shared
        block: n > 1 shares a prompt that way, not by forking tables.)"""
        if start != seq.num_computed_tokens or end <= start:
            raise ValueError(f"bad write range {start}..{end} for {seq!r}")
        bs = self.block_size
        table = seq.block_table
        last = (end - 1) // bs
        if last + 1 - len(table) > self.num_available:
            return False
        if self.window:
            self._release_window(seq, start)
            wtable = seq.window_table
            if last + 1 - len(wtable) > self.window_pool.num_available:
                return False
            for idx in range(start // bs, min(last + 1, len(wtable))):
                b = wtable[idx]
                if self.window_pool.ref_count(b) > 1 or self.window_pool.is_cached(b):
                    raise BlockPoolError(f"write into shared or published window block {b} "
                                         f"of {seq!r}")
            while len(wtable) <= last:
                wtable.append(self._allocate_window())
        for idx in range(start // bs, min(last + 1, len(table))):
            b = table[idx]
            if self.pool.ref_count(b) > 1 or self.pool.is_cached(b):
                raise BlockPoolError(f"write into shared or published block {b} of {seq!r}")
        while len(table) <= last:
            table.append(self._allocate())
        return True

    def _release_window(self, seq: Sequence, start: int) -> None:
        """Release the window blocks that no position from `start` on can see (published
        ones stay cached, evictable, for prefix hits that end inside their window)."""
        lo = self.first_window_block(start)
        wtable = seq.window_table
        if lo <= seq.window_released:
            return
        if len(wtable) < lo:
            wtable.extend([-1] * (lo - len(wtable)))
        # oldest first: the window pool's LRU then evicts a prefix's early window blocks
        # before its late ones, which a hit that ends later needs
        for i in range(seq.window_released, lo):
            b = wtable[i]
            if b >= 0:
                self.window_pool.free(b)
                wtable[i] = -1
        seq.window_released = lo

    def on_computed(self, seq: Sequence) -> None:
        """Publish the blocks that became full after `seq.num_computed_tokens` advanced,
        then release the window blocks the next positions cannot see."""
        if self.prefix is not None:
            self._publish(seq)
        if self.window:
            self._release_window(seq, seq.num_computed_tokens)

    def _publish(self, seq: Sequence) -> None:
        assert self.prefix is not None
        n_full = seq.num_computed_tokens // self.block_size
        if n_full <= seq.num_published_blocks:
            return
        bs = self.block_size
        table = seq.block_table
        wtable = seq.window_table
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
            if self.window and i < len(wtable) and wtable[i] >= 0:
                w = wtable[i]
                if node.window_id < 0:
                    self.prefix.attach_window(node, w)
                elif node.window_id != w:      # the same sharing for the window block
                    self.window_pool.incref(node.window_id)
                    self.window_pool.free(w)
                    wtable[i] = node.window_id
        assert node is not None
        self._tail[seq.seq_id] = node
        seq.num_published_blocks = n_full

    # -- release -----------------------------------------------------------------------
    def free(self, seq: Sequence) -> None:
        """Release all of `seq`'s blocks; published ones stay cached until evicted."""
        self.pool.free_table(seq.block_table)
        seq.block_table = []
        if self.window_pool is not None:
            for b in seq.window_table:      # oldest first, as _release_window
                if b >= 0:
                    self.window_pool.free(b)
        seq.window_table = []
        seq.window_released = 0
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
            window=self.window,
            window_blocks=self.window_pool.num_blocks if self.window_pool else 0,
            window_blocks_used=self.window_pool.num_used if self.window_pool else 0,
            window_blocks_cached=self.window_pool.num_evictable if self.window_pool else 0,
        )

    def check_invariants(self, live_sequences: Iterable[Sequence]) -> None:
        live = list(live_sequences)
        self.pool.check_invariants(live)
        if self.window_pool is not None:
            self.window_pool.check_invariants(
                live, lambda s: [b for b in s.window_table if b >= 0])
            for seq in live:
                self._check_window_table(seq)
        else:
            for seq in live:
                if seq.window_table:
                    raise BlockPoolError(f"{seq!r} has a window table without a window group")
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

    def _check_window_table(self, seq: Sequence) -> None:
        wt = seq.window_table
        rel = seq.window_released
        if any(b >= 0 for b in wt[:rel]) or any(b < 0 for b in wt[rel:]):
            raise BlockPoolError(f"{seq!r} window table {wt} is not released-then-held")
        if seq.block_table and rel > self.first_window_block(seq.num_computed_tokens):
            raise BlockPoolError(f"{seq!r} released window blocks it can still see")
        if seq.block_table and len(wt) * self.block_size < seq.num_computed_tokens:
            raise BlockPoolError(f"{seq!r} window table does not cover its computed tokens")
        if self.prefix is not None:
            node = self.prefix.root
            bs = self.block_size
            for i in range(seq.num_published_blocks):
                node = node.children[tuple(seq.token_ids[i * bs : (i + 1) * bs])]
                if i < len(wt) and wt[i] >= 0 and node.window_id != wt[i]:
                    raise BlockPoolError(f"{seq!r} window block {i} is not the tree's")
