"""The KV block allocator: which block ids are free, owned, or cached-and-evictable.

The runner's K/V arrays are `[num_blocks, block_size, n_kv_heads, head_dim]` per layer;
this module only hands out the ids 0..num_blocks-1 and never touches data.

Every block is in exactly one state:
  free       ref 0, not cached: in the free list, contents meaningless
  owned      ref > 0: held by that many sequence block tables (the prefix cache holds no
             refs of its own: "cached" is a separate flag, so refcount == #tables)
  evictable  ref 0 and cached: its K/V is published in the prefix cache, nobody uses it;
             kept in LRU order (the order the blocks became unreferenced) until the
             prefix cache evicts it back to the free list.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable

from edgeinfer.engine.sequence import Sequence


class BlockPoolError(AssertionError):
    """A broken pool invariant (a bug in the serving core, never a user error)."""


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        self.num_blocks = num_blocks
        self._ref = [0] * num_blocks
        self._cached = [False] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        # cached blocks with ref 0, oldest release first (LRU). Sequences release their
        # tables last block first, so a tree node's descendants always sit before it here.
        self._evictable: OrderedDict[int, None] = OrderedDict()

    # -- queries ---------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_available(self) -> int:
        """Blocks an allocation could get, evicting unreferenced cached blocks if needed."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_available

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def is_cached(self, block_id: int) -> bool:
        return self._cached[block_id]

    def is_evictable(self, block_id: int) -> bool:
        return block_id in self._evictable

    def evictable_lru(self) -> list[int]:
        """Evictable block ids, least recently released first (for tests and stats)."""
        return list(self._evictable)

    # -- ownership -------------------------------------------------------------------
    def allocate(self) -> int | None:
        """A free block with ref 1, or None when the free list is empty.

        Evictable blocks are not taken here: reclaiming them is the prefix cache's job,
        because it must drop the tree node first.
        """
        if not self._free:
            return None
        block_id = self._free.popleft()
        self._ref[block_id] = 1
        return block_id

    def incref(self, block_id: int) -> None:
        if self._ref[block_id] == 0:
            if not self._cached[block_id]:
                raise BlockPoolError(f"incref of free block {block_id}")
            del self._evictable[block_id]  # a cache hit revives it
        self._ref[block_id] += 1

    def free(self, block_id: int) -> None:
        """Drop one table's reference; at zero the block becomes evictable or free."""
        ref = self._ref[block_id]
        if ref <= 0:
            raise BlockPoolError(f"double free of block {block_id}")
        self._ref[block_id] = ref - 1
        if ref == 1:
            if self._cached[block_id]:
                self._evictable[block_id] = None
            else:
                self._free.append(block_id)

    def free_table(self, block_table: list[int]) -> None:
        # last block first keeps descendants ahead of their ancestors in LRU order
        for block_id in reversed(block_table):
            self.free(block_id)

    # -- prefix-cache hooks -------------------------------------------------------------
    def mark_cached(self, block_id: int) -> None:
        """The prefix cache published this (owned, full) block."""
        if self._ref[block_id] == 0:
            raise BlockPoolError(f"caching unowned block {block_id}")
        if self._cached[block_id]:
            raise BlockPoolError(f"block {block_id} cached twice")
        self._cached[block_id] = True

    def pop_lru_evictable(self) -> int | None:
        """The least recently released evictable block, still marked cached, or None."""
        if not self._evictable:
            return None
        block_id, _ = self._evictable.popitem(last=False)
        return block_id

    def drop_evictable(self, block_id: int) -> None:
        """Free an evictable block out of LRU order (the prefix cache dropped the tree node
        it was attached to: a sliding-window block of an evicted full-attention node)."""
        if block_id not in self._evictable:
            raise BlockPoolError(f"drop of block {block_id} that is not evictable")
        del self._evictable[block_id]
        self.reclaim(block_id)

    def reclaim(self, block_id: int) -> None:
        """The prefix cache dropped its node for a block from pop_lru_evictable."""
        if self._ref[block_id] != 0 or not self._cached[block_id] or block_id in self._evictable:
            raise BlockPoolError(f"reclaim of block {block_id} that was not popped for eviction")
        self._cached[block_id] = False
        self._free.append(block_id)

    # -- checking --------------------------------------------------------------------
    def check_invariants(self, live_sequences: Iterable[Sequence],
                         table_of=lambda seq: seq.block_table) -> None:
        """Every block is exactly one of free / owned / evictable; refs match the tables
        (`table_of(seq)`: the ids it holds in this pool; a sliding-window group's table
        without its released entries)."""
        holders = [0] * self.num_blocks
        for seq in live_sequences:
            table = table_of(seq)
            if seq.is_finished and table:
                raise BlockPoolError(f"finished {seq!r} still holds blocks")
            if len(set(table)) != len(table):
                raise BlockPoolError(f"{seq!r} holds a block twice: {table}")
            for block_id in table:
                if not 0 <= block_id < self.num_blocks:
                    raise BlockPoolError(f"{seq!r} holds bad block id {block_id}")
                holders[block_id] += 1
        free = set(self._free)
        if len(free) != len(self._free):
            raise BlockPoolError("a block is twice in the free list")
        for block_id in range(self.num_blocks):
            ref = self._ref[block_id]
            if ref != holders[block_id]:
                raise BlockPoolError(
                    f"block {block_id}: refcount {ref} but {holders[block_id]} tables hold it"
                )
            states = (
                (block_id in free)
                + (ref > 0)
                + (block_id in self._evictable)
            )
            if states != 1:
                raise BlockPoolError(
                    f"block {block_id} is in {states} states (free={block_id in free}, "
                    f"ref={ref}, evictable={block_id in self._evictable})"
                )
            if block_id in free and self._cached[block_id]:
                raise BlockPoolError(f"free block {block_id} still marked cached")
            if block_id in self._evictable and not self._cached[block_id]:
                raise BlockPoolError(f"evictable block {block_id} is not cached")
