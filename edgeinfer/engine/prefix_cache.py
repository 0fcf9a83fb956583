"""Automatic prefix reuse: a radix tree over full KV blocks (RadixAttention's idea).

Each node stands for one full block: its key is the block's `block_size` token ids, its
path from the root spells the whole token prefix, and it names the block id whose K/V
holds exactly those tokens at those positions. Only full blocks are published, and a
published block is never written again, so sharing it needs no copy.

The tree owns structure and counters; the `BlockPool` owns reference counts and the LRU
order of unreferenced cached blocks. A node's "lock" is its block's refcount: a node whose
block some sequence holds is never evicted. Because every sequence that holds a node's
block also holds all its ancestors' blocks (tables are published in order, duplicates are
adopted, see KVCacheManager), unreferenced nodes only have unreferenced descendants, and
the pool's release order puts descendants first: evicting in LRU order takes leaves only.

Sliding-window layers (Gemma 3's local layers) keep their K/V in a second pool (`window_pool`)
with blocks of their own: a node may also name the window block of its tokens
(`window_id`, -1 when there is none). A window block is needed only while it is inside the
window of a position still to be computed, so sequences release theirs early and the
window pool evicts them in its own LRU order, from any node, without touching the tree; a
node evicted from the tree frees its window block with it. A sequence that holds a node's
window block also holds the node's block (its full-attention table is never trimmed), so
an evictable node's window block is always unreferenced.
"""

from __future__ import annotations

from dataclasses import dataclass

from edgeinfer.engine.block_pool import BlockPool, BlockPoolError


class _Node:
    __slots__ = ("key", "block_id", "window_id", "parent", "children", "last_access")

    def __init__(self, key: tuple[int, ...], block_id: int, parent: _Node | None) -> None:
        self.key = key
        self.block_id = block_id
        self.window_id = -1         # the sliding-window group's block, -1 when none
        self.parent = parent
        self.children: dict[tuple[int, ...], _Node] = {}
        self.last_access = 0


@dataclass(frozen=True)
class PrefixCacheStats:
    num_cached_blocks: int  # nodes in the tree (referenced or not)
    lookups: int
    hits: int  # lookups that reused at least one block
    misses: int
    query_tokens: int  # prompt tokens looked up
    hit_tokens: int  # of which came from the cache (their K/V was not recomputed)
    evicted_blocks: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


class PrefixCache:
    def __init__(self, pool: BlockPool, block_size: int,
                 window_pool: BlockPool | None = None) -> None:
        self.pool = pool
        self.window_pool = window_pool
        self.block_size = block_size
        self.root = _Node((), -1, None)
        self._by_block: dict[int, _Node] = {}
        self._by_window: dict[int, _Node] = {}
        self._clock = 0  # logical time: deterministic, cheaper than a syscall
        self._lookups = 0
        self._hits = 0
        self._query_tokens = 0
        self._hit_tokens = 0
        self._evicted = 0

    def __len__(self) -> int:
        return len(self._by_block)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _key(self, token_ids: list[int], index: int) -> tuple[int, ...]:
        bs = self.block_size
        return tuple(token_ids[index * bs : (index + 1) * bs])

    # -- lookup ----------------------------------------------------------------------
    def match_nodes(self, token_ids: list[int]) -> list[_Node]:
        """Nodes of the longest cached full-block prefix that leaves >= 1 token to compute."""
        # the last token is always recomputed so the forward pass produces its logits
        max_blocks = (len(token_ids) - 1) // self.block_size
        now = self._tick()
        node = self.root
        path: list[_Node] = []
        for i in range(max_blocks):
            child = node.children.get(self._key(token_ids, i))
            if child is None:
                break
            child.last_access = now
            path.append(child)
            node = child
        return path

    def match(self, token_ids: list[int]) -> list[int]:
        """Block ids of the longest cached full-block prefix (the caller increfs them)."""
        return [n.block_id for n in self.match_nodes(token_ids)]

    def record_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Count one admission's lookup (separate from match so retries are not counted)."""
        self._lookups += 1
        self._hits += num_hit_tokens > 0
        self._query_tokens += num_query_tokens
        self._hit_tokens += num_hit_tokens

    # -- insertion -------------------------------------------------------------------
    def extend(self, parent: _Node | None, key: tuple[int, ...], block_id: int) -> _Node:
        """Publish one full block under `parent` (None = root); returns the tree's node.

        If the tree already has these tokens under `parent` (another sequence computed
        the same prefix concurrently), the existing node is returned unchanged and the
        caller should switch its table to `node.block_id`.
        """
        if len(key) != self.block_size:
            raise ValueError("only full blocks are cached")
        parent = self.root if parent is None else parent
        node = parent.children.get(key)
        if node is None:
            if block_id in self._by_block:
                raise BlockPoolError(f"block {block_id} is already cached elsewhere")
            self.pool.mark_cached(block_id)
            node = _Node(key, block_id, parent)
            parent.children[key] = node
            self._by_block[block_id] = node
        node.last_access = self._tick()
        return node

    def insert(self, token_ids: list[int], block_ids: list[int]) -> list[int]:
        """Publish every full block of `token_ids` stored in `block_ids` (all owned).

        Returns the tree's block id for each full block: equal to the given id, or the id
        of an existing node with the same tokens, which the caller should adopt.
        """
        n_full = min(len(token_ids) // self.block_size, len(block_ids))
        node: _Node | None = None
        canonical: list[int] = []
        for i in range(n_full):
            node = self.extend(node, self._key(token_ids, i), block_ids[i])
            canonical.append(node.block_id)
        return canonical

    # -- eviction --------------------------------------------------------------------
    def evict(self, num_blocks: int) -> int:
        """Return up to `num_blocks` unreferenced leaves to the free list, LRU first."""
        evicted = 0
        while evicted < num_blocks:
            block_id = self.pool.pop_lru_evictable()
            if block_id is None:
                break
            node = self._by_block.pop(block_id)
            if node.children:
                raise BlockPoolError(f"LRU order would evict inner node of block {block_id}")
            assert node.parent is not None
            del node.parent.children[node.key]
            node.parent = None
            if node.window_id >= 0:
                assert self.window_pool is not None
                del self._by_window[node.window_id]
                self.window_pool.drop_evictable(node.window_id)
                node.window_id = -1
            self.pool.reclaim(block_id)
            evicted += 1
        self._evicted += evicted
        return evicted

    # -- the sliding-window group --------------------------------------------------------
    def attach_window(self, node: _Node, window_id: int) -> None:
        """Publish `window_id` (an owned, full window block) as `node`'s window block."""
        assert self.window_pool is not None
        if node.window_id >= 0:
            raise BlockPoolError(f"node of block {node.block_id} already has a window block")
        if window_id in self._by_window:
            raise BlockPoolError(f"window block {window_id} is already cached elsewhere")
        self.window_pool.mark_cached(window_id)
        node.window_id = window_id
        self._by_window[window_id] = node

    def evict_window(self, num_blocks: int) -> int:
        """Return up to `num_blocks` unreferenced window blocks to the window pool's free
        list, LRU first; their nodes stay in the tree (without window K/V, a hit can no
        longer end right after them)."""
        assert self.window_pool is not None
        evicted = 0
        while evicted < num_blocks:
            window_id = self.window_pool.pop_lru_evictable()
            if window_id is None:
                break
            node = self._by_window.pop(window_id)
            node.window_id = -1
            self.window_pool.reclaim(window_id)
            evicted += 1
        return evicted

    # -- reporting -------------------------------------------------------------------
    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(
            num_cached_blocks=len(self._by_block),
            lookups=self._lookups,
            hits=self._hits,
            misses=self._lookups - self._hits,
            query_tokens=self._query_tokens,
            hit_tokens=self._hit_tokens,
            evicted_blocks=self._evicted,
        )

    def check_invariants(self) -> None:
        """Tree <-> pool agreement and the leaves-first eviction order."""
        lru_pos = {b: i for i, b in enumerate(self.pool.evictable_lru())}
        seen = 0
        stack = [self.root]
        while stack:
            node = stack.pop()
            for key, child in node.children.items():
                seen += 1
                b = child.block_id
                if child.parent is not node or child.key != key:
                    raise BlockPoolError(f"broken tree links at block {b}")
                if len(key) != self.block_size:
                    raise BlockPoolError(f"node of block {b} is not a full block")
                if self._by_block.get(b) is not child:
                    raise BlockPoolError(f"block {b} missing from the block index")
                if not self.pool.is_cached(b):
                    raise BlockPoolError(f"tree block {b} not marked cached in the pool")
                if node is not self.root and self.pool.ref_count(node.block_id) == 0:
                    if self.pool.ref_count(b) != 0:
                        raise BlockPoolError(
                            f"block {b} is referenced but its parent {node.block_id} is not"
                        )
                    if lru_pos[b] > lru_pos[node.block_id]:
                        raise BlockPoolError(
                            f"leaf {b} would be evicted after its parent {node.block_id}"
                        )
                stack.append(child)
        if seen != len(self._by_block):
            raise BlockPoolError("block index holds nodes that are not in the tree")
        for w, node in self._by_window.items():
            if node.window_id != w or self._by_block.get(node.block_id) is not node:
                raise BlockPoolError(f"window block {w} indexed for a node that lost it")
            assert self.window_pool is not None
            if not self.window_pool.is_cached(w):
                raise BlockPoolError(f"window block {w} not marked cached in its pool")
            if self.pool.ref_count(node.block_id) == 0 and self.window_pool.ref_count(w):
                raise BlockPoolError(f"window block {w} is referenced but its node's block "
                                     f"{node.block_id} is not")
        if self.window_pool is not None:
            n_w = sum(self.window_pool.is_cached(b) for b in range(self.window_pool.num_blocks))
            if n_w != len(self._by_window):
                raise BlockPoolError(f"window pool marks {n_w} blocks cached, tree has "
                                     f"{len(self._by_window)}")
        n_cached = sum(self.pool.is_cached(b) for b in range(self.pool.num_blocks))
        if n_cached != seen:
            raise BlockPoolError(f"pool marks {n_cached} blocks cached, tree has {seen}")
