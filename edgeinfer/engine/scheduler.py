"""Continuous batching: which tokens of which sequences run in the next forward pass.

Each `schedule()` builds one batch under a token budget:
  1. drop aborted sequences;
  2. one decode token for every running sequence that has finished its prefill (oldest
     first); if the pool cannot give one of them its next block, preempt the newest
     running sequence (free its blocks, requeue it at the front, recompute later);
  3. the next prefill chunk of running sequences still prefilling (chunked prefill);
  4. admit waiting sequences in FIFO order while the budget, the running limit and the
     pool allow, each with its first prefill chunk.
`update()` then advances the counters from what the runner computed and sampled.

Admission control: a waiting sequence is admitted when the pool can hold blocks for its
prompt plus an output reserve of min(remaining max_tokens, output_reserve) tokens, after
the reserves already promised to running sequences (counting unreferenced prefix-cache
blocks as free); with a sliding-window group, its pool must also hold one window more
(KVCacheManager.headroom). The reserve is a promise, not an allocation: blocks are taken as decode
reaches them, and preemption covers the case where the promises were too small.

The engine thread owns the scheduler (nothing here is thread-safe); one step is:
    out = sched.schedule()
    runner: forward out.chunks, sample one token for each chunk with needs_logits
            -> sampled {seq_id: token}
    sched.update(out, sampled)               # advance counters, append tokens
    engine: FinishCheck per sampled token (stop, length) -> sched.finish(seq_id, reason);
            stream the new tokens; report out.finished (errors, pool-length), out.aborted.
Cancellation from other threads goes through the engine's own queue to sched.abort().
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from edgeinfer.engine.kv_manager import KVCacheManager, KVStats
from edgeinfer.engine.sequence import FINISH_REASONS, Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    num_blocks: int
    block_size: int = 16
    max_running_seqs: int = 16
    max_tokens_per_step: int = 512  # token budget of one forward pass
    max_model_len: int = 8192  # prompt + output, in tokens
    output_reserve: int = 256  # output tokens whose blocks admission keeps room for

    def __post_init__(self) -> None:
        if self.num_blocks <= 0 or self.block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        if self.max_running_seqs <= 0:
            raise ValueError("max_running_seqs must be positive")
        if self.max_tokens_per_step < self.max_running_seqs:
            # every running sequence must be able to decode every step
            raise ValueError("max_tokens_per_step must be >= max_running_seqs")
        if self.max_model_len < 2:
            raise ValueError("max_model_len must allow a prompt token and an output token")
        if self.output_reserve < 0:
            raise ValueError("output_reserve must be >= 0")


@dataclass(frozen=True)
class ScheduledChunk:
    """Compute K/V of positions start..start+len(token_ids)-1 of `seq` into its block table,
    attending over positions 0..start+len(token_ids)-1."""

    seq: Sequence
    start: int  # == seq.num_computed_tokens when scheduled
    token_ids: list[int]
    needs_logits: bool  # the chunk ends at the last known token: sample one token
    # speculative decoding: the last `num_draft` token_ids are proposed, not yet known
    # tokens; the runner samples at each of them and keeps the prefix the model agrees with
    num_draft: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_decode(self) -> bool:
        return (self.needs_logits and len(self.token_ids) == 1 + self.num_draft
                and self.start > 0)


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)  # decodes first, then prefills
    preempted: list[Sequence] = field(default_factory=list)  # requeued; will recompute
    aborted: list[Sequence] = field(default_factory=list)  # cancelled and released
    finished: list[Sequence] = field(default_factory=list)  # ended while scheduling (error/length)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass(frozen=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_preemptions: int
    kv: KVStats

    @property
    def blocks_used(self) -> int:
        return self.kv.blocks_used

    @property
    def blocks_free(self) -> int:
        return self.kv.blocks_free

    @property
    def blocks_cached(self) -> int:
        return self.kv.blocks_cached

    @property
    def prefix_hits(self) -> int:
        return self.kv.prefix.hits if self.kv.prefix else 0

    @property
    def prefix_misses(self) -> int:
        return self.kv.prefix.misses if self.kv.prefix else 0

    @property
    def cached_tokens(self) -> int:
        return self.kv.prefix.hit_tokens if self.kv.prefix else 0

    def to_dict(self) -> dict[str, float]:
        """Flat numbers for /metrics and the TUI."""
        prefix = self.kv.prefix
        return {
            "running": self.num_running,
            "waiting": self.num_waiting,
            "preemptions": self.num_preemptions,
            "kv_blocks_total": self.kv.num_blocks,
            "kv_blocks_used": self.blocks_used,
            "kv_blocks_free": self.blocks_free,
            "kv_blocks_cached": self.blocks_cached,
            "kv_window_blocks_total": self.kv.window_blocks,
            "kv_window_blocks_used": self.kv.window_blocks_used,
            "prefix_hits": self.prefix_hits,
            "prefix_misses": self.prefix_misses,
            "prefix_cached_tokens": self.cached_tokens,
            "prefix_query_tokens": prefix.query_tokens if prefix else 0,
            "prefix_hit_rate": prefix.hit_rate if prefix else 0.0,
            "prefix_evicted_blocks": prefix.evicted_blocks if prefix else 0,
        }


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        if kv.num_blocks != config.num_blocks or kv.block_size != config.block_size:
            raise ValueError("SchedulerConfig and KVCacheManager disagree on the pool shape")
        self.config = config
        self.kv = kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the last one is the newest
        self._live: dict[int, Sequence] = {}  # seq_id -> waiting or running sequence
        self._aborts: set[int] = set()
        self._num_preemptions = 0

    # -- requests in and out -------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if seq.seq_id in self._live:
            raise ValueError(f"sequence id {seq.seq_id} is already scheduled")
        if seq.status is not SequenceStatus.WAITING or seq.block_table:
            raise ValueError(f"{seq!r} is not a fresh waiting sequence")
        self._live[seq.seq_id] = seq
        self.waiting.append(seq)

    def abort(self, seq_id: int) -> bool:
        """Cancel a sequence; it leaves at the next schedule() (unknown ids: False)."""
        if seq_id not in self._live:
            return False
        self._aborts.add(seq_id)
        return True

    def finish(self, seq_id: int, reason: str) -> bool:
        """End a sequence now (the engine's stop tokens and strings) and free its blocks."""
        seq = self._live.get(seq_id)
        if seq is None:
            return False
        self._finish(seq, reason)
        return True

    def get(self, seq_id: int) -> Sequence | None:
        return self._live.get(seq_id)

    def has_work(self) -> bool:
        return bool(self._live)

    # -- one step ------------------------------------------------------------------
    def schedule(self, drafts: dict[int, list[int]] | None = None) -> SchedulerOutput:
        """One step's batch. `drafts` (speculative decoding): proposed next tokens per
        sequence id, verified in its decode chunk when the budget and the pool allow."""
        out = SchedulerOutput()
        drafts = drafts or {}
        self._apply_aborts(out)
        budget = self.config.max_tokens_per_step

        # 1. decodes, oldest first; victims come from the unscheduled newest end
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            if seq.is_prefilling:
                i += 1
                continue
            start = seq.num_computed_tokens
            ok = self.kv.prepare_write(seq, start, start + 1)
            while not ok:
                if len(self.running) == 1:
                    # it holds the whole pool and still needs more: the pool is its context
                    self._finish(seq, "length")
                    out.finished.append(seq)
                    break
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    break
                ok = self.kv.prepare_write(seq, start, start + 1)
            if not ok:
                continue  # seq left running; index i now names the next sequence
            draft = self._fit_draft(seq, drafts.get(seq.seq_id), budget)
            out.chunks.append(ScheduledChunk(seq, start, [seq.token_ids[start], *draft], True,
                                             len(draft)))
            budget -= 1 + len(draft)
            i += 1

        # 2. running sequences still prefilling, in admission order
        for seq in self.running:
            if budget <= 0:
                break
            if seq.is_prefilling:
                budget -= self._schedule_prefill(seq, budget, out)

        # 3. admissions, strictly FIFO; none in a step that had to preempt
        if not out.preempted:
            self._admit(budget, out)
        return out

    def _fit_draft(self, seq: Sequence, draft: list[int] | None, budget: int) -> list[int]:
        """The part of a proposed draft this step can verify: within the budget left after
        one token for every decode, the request's max_tokens and the context, and blocks
        the pool can give now (a draft never preempts anyone)."""
        if not draft:
            return []
        decodes_left = sum(1 for s in self.running if not s.is_prefilling)
        room = min(len(draft), budget - decodes_left,
                   seq.max_tokens - seq.num_output_tokens - 1,
                   self.config.max_model_len - seq.num_tokens - 1)
        start = seq.num_computed_tokens
        while room > 0 and not self.kv.prepare_write(seq, start, start + 1 + room):
            room //= 2
        return list(draft[:max(room, 0)])

    def _schedule_prefill(self, seq: Sequence, budget: int, out: SchedulerOutput) -> int:
        start = seq.num_computed_tokens
        end = min(seq.num_tokens, start + budget)
        for a, b in seq.image_spans:    # an image goes in one chunk: cut before it, or take it
            if a < end < b:
                end = a if a > start else b
        if not self.kv.prepare_write(seq, start, end):   # admission reserved these blocks
            return 0
        out.chunks.append(
            ScheduledChunk(seq, start, seq.token_ids[start:end], end == seq.num_tokens)
        )
        return end - start

    def _admit(self, budget: int, out: SchedulerOutput) -> None:
        if budget <= 0 or not self.waiting or len(self.running) >= self.config.max_running_seqs:
            return
        kv = self.kv
        # per pool, available blocks less those promised to running sequences: O(running)
        headroom = kv.headroom(self.running)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_running_seqs:
            seq = self.waiting[0]
            if seq.num_prompt_tokens >= self.config.max_model_len:
                self.waiting.popleft()
                seq.error = (
                    f"prompt too long: {seq.num_prompt_tokens} tokens leave no room for output "
                    f"within max_model_len {self.config.max_model_len}"
                )
                self._finish(seq, "error")
                out.finished.append(seq)
                continue
            if kv.blocks_for(seq.num_tokens) > kv.num_blocks:
                self.waiting.popleft()
                if seq.num_output_tokens:  # a resumed sequence outgrew the pool
                    self._finish(seq, "length")
                else:
                    seq.error = (
                        f"prompt too long for the KV pool: {seq.num_tokens} tokens need "
                        f"{kv.blocks_for(seq.num_tokens)} blocks of {kv.block_size}, "
                        f"the pool has {kv.num_blocks}"
                    )
                    self._finish(seq, "error")
                out.finished.append(seq)
                continue
            remaining = max(seq.max_tokens - seq.num_output_tokens, 0)
            reserved_len = min(
                seq.num_tokens + min(remaining, self.config.output_reserve),
                self.config.max_model_len,
            )
            if not self.running:
                # alone, it only has to fit its prompt: never starve a request whose
                # prompt fits the pool because of the reserve
                cost = kv.admit(seq, reserved_len, headroom=kv.available())
                if cost is None:
                    cost = kv.admit(seq, seq.num_tokens, headroom=kv.available())
            else:
                cost = kv.admit(seq, reserved_len, headroom)
            if cost is None:
                break  # FIFO: nobody overtakes the head of the queue
            headroom = (headroom[0] - cost[0], headroom[1] - cost[1])
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            budget -= self._schedule_prefill(seq, budget, out)

    def _apply_aborts(self, out: SchedulerOutput) -> None:
        if not self._aborts:
            return
        aborts, self._aborts = self._aborts, set()
        for seq_id in sorted(aborts):
            seq = self._live.get(seq_id)
            if seq is not None:
                self._finish(seq, "abort")
                out.aborted.append(seq)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self._remove_running(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.PREEMPTED
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self._num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def _remove_running(self, seq: Sequence) -> None:
        if self.running and self.running[-1] is seq:
            self.running.pop()  # victims are the newest: O(1)
        else:
            self.running.remove(seq)

    def _finish(self, seq: Sequence, reason: str) -> None:
        if reason not in FINISH_REASONS:
            raise ValueError(f"unknown finish reason {reason!r}")
        if seq.status is SequenceStatus.RUNNING:
            self._remove_running(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass  # already popped by the caller
        self.kv.free(seq)
        seq.status = FINISH_REASONS[reason]
        seq.finish_reason = reason
        del self._live[seq.seq_id]
        self._aborts.discard(seq.seq_id)

    # -- after the forward pass ----------------------------------------------------------
    def update(self, output: SchedulerOutput, sampled: dict[int, list[int]]) -> None:
        """Advance every computed chunk and append its sampled tokens: one, or for a chunk
        with a draft the accepted draft tokens and the one after them. Whether a request is
        finished (stop, length) is the engine's decision (edgeinfer.engine.stops.FinishCheck);
        it calls finish(). Sequences aborted or finished since schedule() are skipped."""
        for chunk in output.chunks:
            seq = chunk.seq
            if seq.status is not SequenceStatus.RUNNING or seq.seq_id in self._aborts:
                continue
            if chunk.start != seq.num_computed_tokens:
                raise ValueError(f"chunk at {chunk.start} does not continue {seq!r}")
            if not chunk.needs_logits:
                seq.num_computed_tokens += len(chunk.token_ids)
                self.kv.on_computed(seq)
                continue
            tokens = sampled.get(seq.seq_id)
            if isinstance(tokens, int):
                tokens = [tokens]
            if not tokens:
                raise ValueError(f"no sampled token for {seq!r}, whose chunk needed logits")
            draft = chunk.token_ids[len(chunk.token_ids) - chunk.num_draft:]
            accepted = len(tokens) - 1
            if accepted > chunk.num_draft or list(tokens[:accepted]) != list(draft[:accepted]):
                raise ValueError(f"sampled {tokens} do not continue the draft {draft} of {seq!r}")
            # K/V is right up to the last accepted draft token; the rest of the draft's slots
            # are overwritten before anything reads them
            for token in tokens:
                seq.append_token(int(token))
            seq.num_computed_tokens += len(chunk.token_ids) - chunk.num_draft + accepted
            self.kv.on_computed(seq)

    # -- reporting -------------------------------------------------------------------
    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_preemptions=self._num_preemptions,
            kv=self.kv.stats(),
        )

    def live_sequences(self) -> list[Sequence]:
        return list(self._live.values())

    def check_invariants(self) -> None:
        live = self.live_sequences()
        self.kv.check_invariants(live)
        for seq in self.waiting:
            assert seq.status in (SequenceStatus.WAITING, SequenceStatus.PREEMPTED), seq
            assert not seq.block_table and seq.num_computed_tokens == 0, seq
        for seq in self.running:
            assert seq.status is SequenceStatus.RUNNING, seq
            assert seq.num_computed_tokens < seq.num_tokens, seq
            need = self.kv.blocks_for(seq.num_computed_tokens)
            assert len(seq.block_table) >= need, seq
        assert len(self.waiting) + len(self.running) == len(live)
        assert len(self.running) <= self.config.max_running_seqs
