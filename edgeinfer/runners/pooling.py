"""The runner side of embeddings: pooling the final hidden states of prefill-only requests.

An embedding request (NewRequest.pooling set) never samples. Its prompt may arrive in several
chunks over several steps (chunked prefill); each chunk's final hidden states (after the last
norm, as llama.cpp's `t_embd`) are folded into the request's running pool here, and the step
that computes its last prompt position returns the pooled vector in StepResult.hidden.

Pooling types are llama.cpp's (`{arch}.pooling_type`: 0 none, 1 mean, 2 cls, 3 last, 4 rank):
mean averages every prompt position, cls takes position 0, last the last position, none keeps
one vector per position, rank takes position 0 through the model's classification head. The
vectors are returned raw; normalization (L2, llama.cpp's default `embd_normalize = 2`) is the
API layer's, because Matryoshka truncation must happen before it.

Encoder models (non-causal attention, `needs_whole_prompt`) cannot compute a chunk before they
have seen the whole prompt, so their chunks are held here until the last one arrives and the
whole prompt is computed in that step.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from edgeinfer.runners.base import NewRequest, ScheduledSpan, StepPlan

POOLING_TYPES = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}


def pooling_of(metadata: dict, arch: str) -> str:
    """The model's pooling from `{arch}.pooling_type`; decoders without one pool by mean (as
    Ollama does)."""
    v = metadata.get(f"{arch}.pooling_type")
    if v is None:
        return "mean"
    try:
        return POOLING_TYPES.get(int(v), "mean")
    except (TypeError, ValueError):
        return "mean"


@dataclass
class _Pool:
    kind: str
    n_prompt: int
    total: np.ndarray | None = None      # mean: running sum
    count: int = 0
    first: np.ndarray | None = None      # cls / rank: position 0
    last: np.ndarray | None = None
    rows: list[np.ndarray] = field(default_factory=list)    # none: every position


class Pooler:
    """Per-request pooling state, kept from a request's first span to its last."""

    def __init__(self, whole_prompt: bool = False):
        self.whole_prompt = whole_prompt
        self._pools: dict[int, _Pool] = {}
        self._held: dict[int, list[ScheduledSpan]] = {}    # encoder chunks not yet computed

    def __contains__(self, req_id: int) -> bool:
        return req_id in self._pools

    def begin(self, plan: StepPlan) -> None:
        for rid in plan.finished:
            self._pools.pop(rid, None)
            self._held.pop(rid, None)
        for rid in plan.preempted:       # recomputed from position 0
            p = self._pools.get(rid)
            if p is not None:
                self._pools[rid] = _Pool(p.kind, p.n_prompt)
            self._held.pop(rid, None)
        for req in plan.new_requests:
            if req.pooling:
                self._add(req)

    def _add(self, req: NewRequest) -> None:
        self._pools[req.req_id] = _Pool(req.pooling, len(req.prompt_token_ids))

    def split(self, spans: Sequence[ScheduledSpan]) -> tuple[list[ScheduledSpan], list[ScheduledSpan]]:
        """(spans to compute this step, the subset of them that pool). For a whole-prompt
        model an embedding chunk that does not end the prompt is held, and the one that does
        is merged with the held ones into one span from position 0."""
        run, pooled = [], []
        for s in spans:
            p = self._pools.get(s.req_id)
            if p is None:
                run.append(s)
                continue
            if self.whole_prompt:
                held = self._held.setdefault(s.req_id, [])
                held.append(s)
                if s.end < p.n_prompt:
                    continue
                del self._held[s.req_id]
                ids = tuple(t for h in held for t in h.token_ids)
                s = ScheduledSpan(s.req_id, held[0].start, ids, s.block_table, False,
                                  window_table=s.window_table)
            run.append(s)
            pooled.append(s)
        return run, pooled

    def add(self, span: ScheduledSpan, hidden: np.ndarray) -> np.ndarray | None:
        """Fold one span's final hidden states [len(span), E] into its request's pool; the
        pooled result when the span ends the prompt."""
        p = self._pools[span.req_id]
        k = p.kind
        if k == "mean":
            s = hidden.sum(axis=0, dtype=np.float64)
            p.total = s if p.total is None else p.total + s
            p.count += hidden.shape[0]
        elif k in ("cls", "rank"):
            if span.start == 0:
                p.first = hidden[0].copy()
        elif k == "last":
            p.last = hidden[-1].copy()
        else:
            p.rows.append(hidden.copy())
        if span.end < p.n_prompt:
            return None
        if k == "mean":
            return (p.total / max(p.count, 1)).astype(np.float32)
        if k in ("cls", "rank"):
            return p.first
        if k == "last":
            return p.last
        return np.concatenate(p.rows, axis=0)

    def kind(self, req_id: int) -> str | None:
        p = self._pools.get(req_id)
        return p.kind if p is not None else None
