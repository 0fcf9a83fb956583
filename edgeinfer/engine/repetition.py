"""Degenerate repetition: output that has started copying itself verbatim.

A base model (no chat template, never trained to stop) asked a question often answers, then
writes the same paragraph again and again until the context is full. `RepetitionGuard` sees
it in the generated token ids: the output's tail equals the tokens one period P earlier for
R tokens in a row, with R >= max(P, min_run) and P <= max_period. So a 100-token paragraph
stops when it has been written twice in full; a short phrase or a single token after it has
repeated for `min_run` tokens (48 by default: seven "the cat sat on the mat." in a row).

One Z-function pass over the last 2 * max_period + min_run tokens (numba, linear) gives
R for every period at once; it runs every `every` tokens, so it costs a few microseconds
per token. The request is then finished with its own reason, "repetition".
"""
from __future__ import annotations

import numpy as np

REASON = "repetition"


def _period(window: np.ndarray, max_period: int, min_run: int) -> int:
    """The smallest period of a degenerate repeat at the end of `window`, or 0. numba is
    imported here, where a guard runs (the engine), not with this module: the daemon imports
    it through engine.core, and numba would add ~0.1 s to its start and ~65 MB to its RSS."""
    from edgeinfer.engine._periodic_tail import longest_periodic_tail
    from edgeinfer.runners.sampling import suffix_z
    return int(longest_periodic_tail(suffix_z(window), max_period, min_run))


class RepetitionGuard:
    def __init__(self, max_period: int = 256, min_run: int = 48, every: int = 4):
        self.max_period, self.min_run, self.every = max_period, min_run, every
        self.window = 2 * max_period + min_run
        self._buf = np.empty(max(1024, 2 * self.window), np.int64)
        self._n = 0
        self._since = 0
        self.period = 0

    def feed(self, token_ids) -> bool:
        """Add generated ids; True once the output repeats itself (then `period` is set)."""
        for t in token_ids:
            if self._n == self._buf.size:               # keep only the window
                keep = self._buf[self._n - self.window:self._n].copy()
                self._buf[:self.window] = keep
                self._n = self.window
            self._buf[self._n] = t
            self._n += 1
        self._since += len(token_ids)
        if self.period or self._since < self.every or self._n <= self.min_run:
            return bool(self.period)
        self._since = 0
        tail = self._buf[max(0, self._n - self.window):self._n]
        self.period = _period(tail, self.max_period, self.min_run)
        return bool(self.period)


def repeats(token_ids, max_period: int = 256, min_run: int = 48) -> int:
    """The period of a degenerate repeat at the end of token_ids, or 0."""
    h = np.asarray(token_ids, dtype=np.int64)
    if h.size <= min_run:
        return 0
    w = h[-(2 * max_period + min_run):]
    return _period(w, max_period, min_run)
