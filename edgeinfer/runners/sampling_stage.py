"""The runner side of sampling: per-request sampler state, and one batched draw per step.

Every runner (native or llama.cpp) ends its step here: it has float32 logits for the spans
that sample, and this turns them into a `StepResult`. The state of a request (its seeded
generator, the token history penalties look at) is created when the request first appears
in a plan and dropped when the plan says it finished, so it survives preemption.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from edgeinfer.runners.sampling import Sampler, SeqSamplingState
from edgeinfer.runners.base import NewRequest, ScheduledSpan, StepPlan, StepResult


class SamplingStage:
    def __init__(self, eos_token_ids: Iterable[int] = ()):
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self._states: dict[int, SeqSamplingState] = {}
        self._sampler = Sampler()

    def __len__(self) -> int:
        return len(self._states)

    def begin(self, plan: StepPlan) -> None:
        """Drop finished requests, create state for new ones (call before the forward)."""
        for rid in plan.finished:
            self._states.pop(rid, None)
        for req in plan.new_requests:
            self._add(req)

    def _add(self, req: NewRequest) -> None:
        prompt = req.prompt_token_ids
        if req.images:      # penalties and DRY see the text: no image placeholders
            prompt = tuple(t for t in prompt if t >= 0)
        self._states[req.req_id] = SeqSamplingState(
            req.sampling, prompt, choice_index=req.choice_index,
            eos_token_ids=self.eos_token_ids)

    def sample(self, spans: Sequence[ScheduledSpan], logits: np.ndarray) -> StepResult:
        """Tokens for the spans that sample, in order. `logits` has one row per span, or
        1 + num_draft rows for a span with a draft (its last positions, in order)."""
        result = StepResult()
        if not spans:
            return result
        try:
            states = [self._states[s.req_id] for s in spans]
        except KeyError as e:
            raise RuntimeError(f"request {e.args[0]} was scheduled before it was announced "
                               "in a plan's new_requests") from None
        rows, plain, r = [], [], 0
        for i, s in enumerate(spans):
            rows.append(r)
            r += 1 + s.num_draft
            if not s.num_draft:
                plain.append(i)
        if r != logits.shape[0]:
            raise RuntimeError(f"{logits.shape[0]} rows of logits for {r} sampled positions")
        if len(plain) == len(spans):        # no drafts: row i is span i's (no 1 MB copy)
            self._sample_rows(spans, states, logits, result)
        elif plain:
            self._sample_rows([spans[i] for i in plain], [states[i] for i in plain],
                              logits[[rows[i] for i in plain]], result)
        for i, s in enumerate(spans):
            if s.num_draft:
                self._verify(s, states[i], logits[rows[i]:rows[i] + 1 + s.num_draft], result)
        return result

    def _sample_rows(self, spans, states, logits: np.ndarray, result: StepResult) -> None:
        """One token per span from its row, batched."""
        masks = [s.token_mask for s in spans]
        if any(m is not None for m in masks):
            out = self._sampler.sample(logits, states, masks)
        else:
            out = self._sampler.sample(logits, states)
        errors = getattr(out, "errors", None)
        for i, (span, st) in enumerate(zip(spans, states)):
            if errors is not None and errors[i] is not None:
                result.errors[span.req_id] = errors[i]
                continue
            tok = int(out.tokens[i])
            st.append(tok)
            result.tokens.setdefault(span.req_id, []).append(tok)
            if st.params.logprobs is not None:
                result.logprobs.setdefault(span.req_id, []).append(float(out.logprobs[i]))
                if out.top_logprobs is not None:
                    result.top_logprobs.setdefault(span.req_id, []).append(out.top_logprobs[i])

    def _verify(self, span: ScheduledSpan, state: SeqSamplingState, logits: np.ndarray,
                result: StepResult) -> None:
        """Sample position by position as plain decoding would (the same state updates, the
        same draws); keep going while the sample equals the guess."""
        draft = span.token_ids[len(span.token_ids) - span.num_draft:]
        for j in range(span.num_draft + 1):
            self._sample_rows([span], [state], logits[j:j + 1], result)
            got = result.tokens.get(span.req_id)
            if span.req_id in result.errors or not got:
                return
            if j == span.num_draft or got[-1] != draft[j]:
                return
