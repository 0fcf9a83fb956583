"""Embedding requests in the engine: prefill-only sequences that never take prefix-cache hits.

Pooling needs the final hidden state of every prompt position it pools (mean pooling needs all
of them), and a prefix-cache hit would skip computing the cached positions. So a pooled
sequence is admitted with a fresh table (no lookup), and it ends in the step that computes its
last position, before its blocks are published: it neither takes nor leaves cache entries.
"""
from __future__ import annotations

from edgeinfer.engine.kv_manager import KVCacheManager
from edgeinfer.engine.sequence import Sequence


def is_pooled(seq: Sequence) -> bool:
    return getattr(seq, "pooling", None) is not None


class _NoLookup:
    """The prefix cache as a pooled sequence's admission sees it: nothing matches (and the
    lookup is not counted); eviction and everything else are the real cache's."""

    def __init__(self, prefix):
        self._prefix = prefix

    def match_nodes(self, token_ids):
        return []

    def record_lookup(self, *args) -> None:
        pass

    def __getattr__(self, name):
        return getattr(self._prefix, name)


class PoolingAwareKV(KVCacheManager):
    """The KV manager, except that pooled (embedding) sequences skip the prefix lookup."""

    def admit(self, seq: Sequence, reserved_len: int, headroom: int) -> int | None:
        if not is_pooled(seq) or self.prefix is None:
            return super().admit(seq, reserved_len, headroom)
        prefix, self.prefix = self.prefix, _NoLookup(self.prefix)   # engine thread only
        try:
            return super().admit(seq, reserved_len, headroom)
        finally:
            self.prefix = prefix
