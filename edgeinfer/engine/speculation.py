"""Prompt-lookup speculative decoding: drafts from the request's own text, no draft model.

When the last few tokens of a sequence also occur earlier in it (a code listing being
reproduced, a quoted document, a JSON object echoing its input), the tokens that followed
that earlier occurrence are a cheap guess of what comes next. The runner checks a guess of
k tokens in one forward pass over k + 1 positions: it samples at each position as it would
have one step at a time and keeps the draft tokens up to the first one it did not sample,
plus the token it sampled there. Output is exactly what plain decoding gives (the same
draws from the same generator), so this only changes speed.

It pays where a step costs about the same for one row as for eight (decode reads every
weight once either way) and the guesses are often right; so drafts are proposed only for
small batches, and a request whose guesses keep failing stops getting them.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_DRAFT = 7             # 8 rows: one load of each int8 weight tile serves them all
NGRAM_SIZES = (3, 2)      # longest match first
MIN_TOKENS = 16           # nothing worth looking up in a shorter sequence
WINDOW = 4096             # look back at most this far (bounded cost per step)
MAX_BATCH = 2             # decoding sequences above which speculation is off
PROBATION = 12            # proposed tokens before a request's acceptance is judged
MIN_ACCEPTANCE = 0.3      # below this, the request's guesses cost more than they save
FIRST_DRAFT = 3           # draft length before the request has shown how well it guesses


def propose(tokens: np.ndarray, k: int = MAX_DRAFT,
            prediction: np.ndarray | None = None) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the sequence's last
    n-gram (n = 3, then 2), or [] when there is none. `tokens`: int array, prompt + output;
    `prediction`: text the output is expected to repeat, searched before the sequence (so
    the sequence's own occurrences, being later, win)."""
    n_tok = tokens.shape[0]
    if k <= 0 or (n_tok < MIN_TOKENS and prediction is None):
        return []
    hist = tokens[max(0, n_tok - WINDOW):]
    if prediction is not None and prediction.size:
        hist = np.concatenate([prediction, hist])
    for n in NGRAM_SIZES:
        if hist.shape[0] <= n:
            continue
        tail = hist[-n:]
        # positions i where hist[i:i+n] == tail, excluding the tail itself
        windows = np.lib.stride_tricks.sliding_window_view(hist[:-1], n)
        hits = np.flatnonzero((windows == tail).all(axis=1))
        hits = hits[hits + n < hist.shape[0]]
        if hits.size:
            start = int(hits[-1]) + n          # the most recent occurrence
            draft = hist[start:start + k]
            return [int(t) for t in draft]
    return []


@dataclass
class SpeculationStats:
    """One request's record: how many draft tokens it was offered and kept, and how long
    its next draft may be (doubling while whole drafts are kept, back to what was kept
    plus one after a miss), so a verify pass is only as wide as it is likely to pay."""
    proposed: int = 0
    accepted: int = 0
    next_k: int = FIRST_DRAFT

    def worth_it(self) -> bool:
        return self.proposed < PROBATION or self.accepted >= MIN_ACCEPTANCE * self.proposed

    def record(self, proposed: int, accepted: int) -> None:
        self.proposed += proposed
        self.accepted += accepted
        self.next_k = (min(MAX_DRAFT, 2 * proposed) if accepted == proposed
                       else max(1, accepted + 1))
