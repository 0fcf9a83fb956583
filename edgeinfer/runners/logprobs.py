"""Prompt logprobs on the runner side: log-softmax over chunks of logit rows.

A request that asks for prompt logprobs (`ScheduledSpan.prompt_logprobs = k`) gets, for
every prompt position p >= 1, log P(prompt[p] | prompt[:p]) from the raw model logits (no
bias, penalties or temperature: the model's own distribution, as vLLM's prompt_logprobs and
llama.cpp's perplexity tool), plus the k most likely tokens at that position.

The logits of row p (position p) predict token p + 1. Runners compute those rows in chunks
of at most `CHUNK_ROWS` positions, so a long scored prompt never holds positions x
vocabulary floats at once: each chunk is reduced to one float and k pairs per row here.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

CHUNK_ROWS = 64           # logit rows [CHUNK_ROWS, vocab] float32: 64 MiB at a 262k vocabulary


@dataclass
class PromptLogprobs:
    """Prompt logprobs a step computed for one request: entry i is of prompt position
    `start + i` (start >= 1: position 0 has no prefix and no logprob)."""
    start: int
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)

    def extend(self, other: "PromptLogprobs") -> None:
        if other.start != self.start + len(self.logprobs):
            raise ValueError("prompt logprob chunks out of order")
        self.logprobs += other.logprobs
        self.top += other.top


def rows_logprobs(logits: np.ndarray, targets: np.ndarray, k: int
                  ) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """Log-softmax of each row of `logits` [R, V]: the logprob of targets[r], and the k best
    (token, logprob) pairs of each row, best first. float64 accumulation; O(R x V) time and
    one [R, V] float32 temporary."""
    x = np.asarray(logits, np.float32)
    r = x.shape[0]
    if r == 0:
        return [], []
    m = x.max(axis=1, keepdims=True)
    if not np.all(np.isfinite(m)):
        m = np.where(np.isfinite(m), m, 0.0).astype(np.float32)
    e = np.exp(x - m)                                       # [R, V] float32 temporary
    lse = m[:, 0].astype(np.float64) + np.log(e.sum(axis=1, dtype=np.float64))
    del e
    rows = np.arange(r)
    lp = (x[rows, np.asarray(targets, np.int64)].astype(np.float64) - lse).tolist()
    tops: list[list[tuple[int, float]]] = []
    if k > 0:
        kk = min(k, x.shape[1])
        idx = np.argpartition(x, -kk, axis=1)[:, -kk:]
        vals = np.take_along_axis(x, idx, axis=1).astype(np.float64) - lse[:, None]
        order = np.argsort(-vals, axis=1, kind="stable")
        idx = np.take_along_axis(idx, order, axis=1)
        vals = np.take_along_axis(vals, order, axis=1)
        for i in range(r):
            tops.append([(int(t), float(v)) for t, v in zip(idx[i], vals[i]) if v > -np.inf])
    else:
        tops = [[] for _ in range(r)]
    return lp, tops


def wanted_positions(start: int, end: int, prompt_len: int) -> range:
    """Positions in start..end-1 whose row predicts a prompt token (p + 1 < prompt_len)."""
    return range(start, min(end, prompt_len - 1))


def score_spans(spans, prompts, run_rows, vocab: int):
    """Run the spans that asked for prompt logprobs, CHUNK_ROWS positions at a time.

    `prompts[req_id]` is each request's prompt; `run_rows(span, rows)` runs the model over
    `span` (its K/V written, attending over everything before it) and returns float32 logits
    for the given row indices of the span. Pieces of one span run in order, so each attends
    over the K/V the previous one wrote. Returns ({req_id: PromptLogprobs}, the spans that
    sample, and their logits [n, vocab]: the last row of each)."""
    out: dict[int, PromptLogprobs] = {}
    sampled, rows_out = [], []
    for span in spans:
        prompt = prompts[span.req_id]
        k = int(span.prompt_logprobs or 0)
        res = None
        for a in range(span.start, span.end, CHUNK_ROWS):
            b = min(a + CHUNK_ROWS, span.end)
            # the span's rows a..b, computed only (no sampling, no mask, no draft)
            piece = replace(span, start=a, token_ids=span.token_ids[a - span.start:b - span.start],
                            sample=False, token_mask=None, prompt_logprobs=None, num_draft=0)
            want = wanted_positions(a, b, len(prompt))
            rows = [p - a for p in want]
            last = span.sample and b == span.end
            if last:
                rows.append(b - 1 - a)
            logits = run_rows(piece, rows if rows else [b - 1 - a])
            n = len(want)
            if n:
                targets = np.asarray(prompt[want.start + 1:want.stop + 1], np.int64)
                lp, top = rows_logprobs(logits[:n], targets, k)
                chunk = PromptLogprobs(want.start + 1, lp, top)
                if res is None:
                    res = chunk
                else:
                    res.extend(chunk)
            if last:
                sampled.append(span)
                rows_out.append(np.array(logits[-1], np.float32))
            del logits
        if res is not None:
            out[span.req_id] = res
    sample_logits = (np.stack(rows_out) if rows_out else np.empty((0, vocab), np.float32))
    return out, sampled, sample_logits
