"""One request's token stream and its place in the serving core.

A `Sequence` is a plain mutable object owned by the scheduler: the scheduler and the KV
manager change its status, block table and counters; the engine reads it, fills
`sampling_state` and never assigns the other fields itself.
"""

from __future__ import annotations

import enum
import time
from typing import Any


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no blocks
    RUNNING = "running"  # admitted: holds blocks, prefilling or decoding
    PREEMPTED = "preempted"  # evicted for lack of blocks; queued again, recomputes on resume
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"
    FINISHED_REPETITION = "repetition"  # the output copied itself (engine/repetition.py)

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset(
    {
        SequenceStatus.FINISHED_STOPPED,
        SequenceStatus.FINISHED_LENGTH,
        SequenceStatus.FINISHED_ABORTED,
        SequenceStatus.FINISHED_ERROR,
        SequenceStatus.FINISHED_REPETITION,
    }
)

# finish_reason string (what the APIs report) -> terminal status
FINISH_REASONS: dict[str, SequenceStatus] = {s.value: s for s in _FINISHED}


class Sequence:
    """Token ids, progress counters and the block table of one generation stream.

    Positions 0..num_computed_tokens-1 have their K/V in the blocks of `block_table`
    (position p lives in block `block_table[p // block_size]`, slot `p % block_size`).
    """

    def __init__(
        self,
        seq_id: int,
        prompt_token_ids: list[int],
        params: Any,
        arrival_time: float | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("a sequence needs at least one prompt token")
        self.seq_id = seq_id
        # the request's one token history: prompt, then output (the views below slice it)
        self.token_ids: list[int] = list(prompt_token_ids)
        self._num_prompt = len(self.token_ids)
        self.params = params  # duck-typed SamplingParams: needs .max_tokens
        self.status = SequenceStatus.WAITING
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prefix-cache hit at the latest admission
        self.block_table: list[int] = []
        # the sliding-window layers' table (KVCacheManager with a window group): indexed like
        # block_table, -1 for the leading blocks already released (out of every window)
        self.window_table: list[int] = []
        self.window_released = 0  # leading entries of window_table that are -1
        # leading blocks of block_table that are published in the prefix cache
        self.num_published_blocks = 0
        # token count whose blocks admission promised room for (prompt + output reserve)
        self.reserved_len = 0
        # False: admit without a prefix-cache lookup, so every prompt position is computed
        # (embeddings pool them all; prompt scoring needs each position's logits)
        self.reuse_prefix = True
        self.num_preemptions = 0
        # [start, end) of each image in the prompt: computed in one step each (its positions
        # attend to one another), never cut across two chunks
        self.image_spans: list[tuple[int, int]] = []
        self.finish_reason: str | None = None
        self.error: str | None = None  # human-readable cause when finish_reason == "error"
        self.sampling_state: Any = None  # the engine's slot (RNG, penalties, detokenizer...)

    # -- derived values -------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self._num_prompt]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self._num_prompt:]

    @property
    def num_prompt_tokens(self) -> int:
        return self._num_prompt

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self._num_prompt

    @property
    def max_tokens(self) -> int:
        return int(self.params.max_tokens)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def is_prefilling(self) -> bool:
        """True while more than the last known token still needs its K/V computed."""
        return self.num_computed_tokens < self.num_tokens - 1

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})"
        )
