"""Prompt scoring in the engine: prompt logprobs, and prompt-only requests (max_tokens 0).

A request that asks for prompt logprobs must compute every prompt position: a prefix-cache
hit would skip the rows whose logits it needs. So it is admitted without a prefix lookup
(as vLLM does for prompt_logprobs); its blocks are published as usual afterwards, so later
requests still reuse them. Its spans carry `prompt_logprobs = k` until the engine holds a
logprob for every prompt position (a preemption mid-prompt recomputes and overwrites).

A score-only request (the OpenAI `max_tokens: 0`) runs its prompt and ends with finish
reason "length" at the point where its first token would be sampled; that token is dropped
(not streamed, not counted).
"""
from __future__ import annotations

from edgeinfer.runners.sampling_params import MAX_LOGPROBS
from edgeinfer.runners.logprobs import PromptLogprobs


class PromptScoring:
    """One request's prompt-scoring state (engine thread only)."""

    def __init__(self, prompt_len: int, k: int | None, score_only: bool):
        if k is not None and not (isinstance(k, int) and 0 <= k <= MAX_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}")
        self.k = k
        self.score_only = score_only
        self.n = prompt_len
        self.logprobs: list[float | None] = [None] * prompt_len if k is not None else []
        self.top: list[list[tuple[int, float]] | None] = [None] * prompt_len if k is not None else []
        self._have = [False] * prompt_len if k is not None else []
        self.missing = prompt_len - 1 if k is not None else 0
        self.delivered = k is None

    @property
    def wants(self) -> bool:
        """Whether spans should still ask the runner for prompt logprobs."""
        return self.k is not None and self.missing > 0

    def add(self, plp: PromptLogprobs) -> None:
        for i, (lp, top) in enumerate(zip(plp.logprobs, plp.top)):
            p = plp.start + i
            if not 1 <= p < self.n:
                continue
            if not self._have[p]:
                self._have[p] = True
                self.missing -= 1
            self.logprobs[p] = lp
            self.top[p] = top

    def take(self) -> tuple[list, list] | None:
        """The complete prompt logprobs, once (None before they are complete or after)."""
        if self.delivered or self.missing:
            return None
        self.delivered = True
        self.top[0] = None
        return self.logprobs, self.top
