"""The boundary between the engine and a runner: plain data in, plain data out.

Each engine step the scheduler's decisions become one `StepPlan`; a runner executes it (one
forward pass over every scheduled span, then sampling) and returns a `StepResult`. Nothing
live crosses: no `Sequence` objects, no status strings, only request ids, token ids, block
tables and sampling settings, so a runner can sit behind a process or a network boundary.

Request lifetime on the runner side: a request id appears in `StepPlan.new_requests` the
first time it is scheduled (the runner creates its sampling state then), in `preempted` when
the scheduler dropped its KV (the runner forgets what it computed, keeps its sampling
state), and in `finished` once (the runner drops everything it holds for it).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from edgeinfer.engine.sampling import SamplingParams
from edgeinfer.formats.model_config import ModelConfig
from edgeinfer.runners.logprobs import PromptLogprobs


@dataclass(frozen=True)
class KVPlan:
    """The KV pool's shape, fixed at load: `num_blocks` blocks of `block_size` tokens."""
    num_blocks: int
    block_size: int
    bytes_per_token: int

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        return self.capacity_tokens * self.bytes_per_token


def plan_kv(cfg: ModelConfig, budget_bytes: int, bytes_per_value: int, block_size: int = 16,
            min_tokens: int = 0) -> KVPlan:
    """Size the pool from a memory budget with 2 x layers x kv_heads x head_dim x bytes."""
    per_token = cfg.kv_bytes_per_token(bytes_per_value)
    tokens = max(budget_bytes // per_token, min_tokens)
    return KVPlan(max(1, tokens // block_size), block_size, per_token)


@dataclass(frozen=True)
class NewRequest:
    """What a runner keeps for a request from its first step to its last."""
    req_id: int
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    choice_index: int = 0               # n > 1: choice i draws from spawn key i of the seed
    # embeddings: a prefill-only request whose spans never sample; the runner pools the final
    # hidden states of all its prompt positions ("mean", "cls", "last", "rank" or "none") and
    # returns the result in StepResult.hidden in the step that computes its last position
    pooling: str | None = None


@dataclass(frozen=True)
class ScheduledSpan:
    """Compute K/V for positions start..start+len(token_ids)-1 of request `req_id` into its
    block table, attending over positions 0..end-1; when `sample` is set the span ends at the
    request's last known token and one token is sampled from the logits there, restricted
    to `token_mask` (bool [vocab], True = allowed) when one is given.

    `prompt_logprobs = k`: the runner also returns, for each position p of the span whose
    row predicts a prompt token (p + 1 < prompt length), log P(prompt[p + 1] | prefix) and
    the k best alternatives (StepResult.prompt_logprobs; computed in chunks of rows, see
    edgeinfer.runners.logprobs). The engine sets it only on spans of a request that asked,
    and admits such a request without prefix-cache reuse, so its spans cover every position.

    `num_draft = k` (speculative decoding, `sample` set): the last k token_ids are a guess,
    not known tokens. The runner samples at each of the last k + 1 positions in order, as
    plain decoding would, and stops at the first sample that differs from the guess: the
    request's tokens in StepResult are the accepted guesses and that one sample."""
    req_id: int
    start: int
    token_ids: tuple[int, ...]
    block_table: tuple[int, ...]
    sample: bool
    token_mask: np.ndarray | None = None
    prompt_logprobs: int | None = None
    num_draft: int = 0

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)

    @property
    def is_decode(self) -> bool:
        return self.sample and len(self.token_ids) == 1 + self.num_draft and self.start > 0


@dataclass(frozen=True)
class StepPlan:
    spans: tuple[ScheduledSpan, ...]            # decodes first, then prefill chunks
    new_requests: tuple[NewRequest, ...] = ()
    preempted: tuple[int, ...] = ()             # KV dropped: will recompute from position 0
    finished: tuple[int, ...] = ()              # gone: release everything held for them

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.spans)


@dataclass
class StepResult:
    """Per request id that sampled this step: its new tokens (a list, so a speculative
    verifier can accept several), their logprobs when asked, and the top alternatives."""
    tokens: dict[int, list[int]] = field(default_factory=dict)
    logprobs: dict[int, list[float]] = field(default_factory=dict)
    top_logprobs: dict[int, list[list[tuple[int, float]]]] = field(default_factory=dict)
    # prompt tokens the runner did not recompute because its own cache held them (the
    # llama.cpp runner's slot reuse); the native runners' reuse is the prefix cache's
    reused_tokens: dict[int, int] = field(default_factory=dict)
    # pooled hidden states for prefill-only requests (embeddings), float32 [hidden] (pooling
    # "none": [prompt tokens, hidden]; "rank": [classes]), not normalized
    hidden: dict[int, np.ndarray] | None = None
    # requests whose row could not be sampled (a token mask that allows nothing): the engine
    # ends them with this message; the rest of the batch is unaffected
    errors: dict[int, str] = field(default_factory=dict)
    # per request whose span asked: prompt logprobs of the positions this step computed
    prompt_logprobs: dict[int, PromptLogprobs] = field(default_factory=dict)


class KVAllocator(Protocol):
    """Block tables for the scheduler (edgeinfer.engine.kv_manager.KVCacheManager is the one
    implementation; a runner says how to build it: with or without a prefix cache)."""
    num_blocks: int
    block_size: int


class Runner(Protocol):
    """One loaded model on one backend, executing one step at a time (engine thread only)."""
    cfg: ModelConfig
    kv_plan: KVPlan
    kind: str                     # "cpu", "torch:cuda", "llamacpp", ...
    weights_format: str           # how the weights sit in memory, for show / ps
    prefix_caching: bool          # False: block ids are capacity accounting only
    supports_drafts: bool         # verifies ScheduledSpan.num_draft guesses

    @property
    def tokenizer(self): ...
    def execute(self, plan: StepPlan) -> StepResult: ...
    @property
    def weights_bytes(self) -> int: ...      # what the backend holds for the weights
    @property
    def kv_bytes(self) -> int: ...           # the KV pool as allocated
    def close(self) -> None: ...
