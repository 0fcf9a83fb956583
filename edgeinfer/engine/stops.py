"""Stop strings over streamed text, and the stop-token set.

Detokenized text arrives in pieces (one per token, already UTF-8 safe). A stop string can
straddle any number of pieces, so `StopMatcher` holds back the longest tail of what it has
seen that could still be the start of a stop string, and emits the rest. When a stop string
completes, everything before its first occurrence is emitted and the stop string itself (and
anything after it) never is. Stop *tokens* need no text matching: the engine checks
membership in `stop_token_set(...)`.
"""
from __future__ import annotations

from collections.abc import Iterable

from edgeinfer.engine.repetition import REASON as REPETITION


class StopMatcher:
    """Incremental matcher for a fixed list of stop strings.

    `push(text) -> (emit, stopped)`; once stopped, further pushes emit nothing.
    `flush()` returns the held-back tail at the end of generation (empty after a stop).
    """

    def __init__(self, stop: Iterable[str]):
        stops = tuple(dict.fromkeys(s for s in stop))  # dedupe, keep order
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError("stop strings must be non-empty strings")
        self.stops: tuple[str, ...] = stops
        # Every proper prefix of every stop string: the tails worth holding back.
        self._prefixes = frozenset(s[:i] for s in stops for i in range(1, len(s)))
        self._max_hold = max((len(s) - 1 for s in stops), default=0)
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # which stop string ended the text

    def push(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        buf = self._held + text
        if not self.stops:
            return buf, False
        # Earliest start wins: the emitted text is the text cut before the first stop.
        cut, which = -1, None
        for s in self.stops:
            i = buf.find(s)
            if i != -1 and (cut == -1 or i < cut):
                cut, which = i, s
        if cut != -1:
            self._held = ""
            self.stopped = True
            self.matched = which
            return buf[:cut], True
        # Hold the longest suffix that is a proper prefix of some stop string. Anything
        # before it cannot start a match: a match starting there would either be complete
        # (found above) or be a longer held suffix.
        hold = 0
        for n in range(min(len(buf), self._max_hold), 0, -1):
            if buf[-n:] in self._prefixes:
                hold = n
                break
        self._held = buf[len(buf) - hold:] if hold else ""
        return buf[:len(buf) - hold], False

    def flush(self) -> str:
        """End of generation without a stop: release whatever was held back."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    @property
    def held(self) -> str:
        return self._held


def stop_token_set(stop_token_ids: Iterable[int], eos_token_ids: Iterable[int],
                   ignore_eos: bool) -> frozenset[int]:
    """Token ids that end a sequence: the request's own plus the model's EOS/EOT ids
    (unless `ignore_eos`, in which case the sampler bans EOS instead, as llama.cpp does)."""
    ids = set(int(t) for t in stop_token_ids)
    if not ignore_eos:
        ids.update(int(t) for t in eos_token_ids)
    return frozenset(ids)


def length_reason(num_output_tokens: int, max_tokens: int, num_tokens: int,
                  max_model_len: int) -> str | None:
    """"length" once a request has its max_tokens or its sequence fills the context."""
    if num_output_tokens >= max_tokens or num_tokens >= max_model_len:
        return "length"
    return None


class FinishCheck:
    """The one place that decides, token by token, whether a request is finished and what
    text it shows: stop tokens, stop strings, a completed grammar, then length (a stop on the
    last allowed token reports "stop": the model ended the text, not the limit).

    `push(token, num_output_tokens, num_tokens) -> (text, token_shown, reason)`: the text to
    emit now, whether the token belongs to the output (stop tokens do not), and the finish
    reason or None. Held-back text is released when the request ends by length.

    `repetition` (a RepetitionGuard, engine/repetition.py): the output also ends, with reason
    "repetition", once it copies itself. It sees the shown tokens one at a time, so where it
    cuts depends only on the tokens, never on how many a step produced (a verified draft
    brings several at once; a check per step would cut a speculative run elsewhere).
    """

    def __init__(self, detokenizer, stop: Iterable[str], stop_token_ids: frozenset[int],
                 max_tokens: int, max_model_len: int, constraint=None, repetition=None):
        self.detok = detokenizer
        self.matcher = StopMatcher(stop)
        self.stop_ids = stop_token_ids
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len
        self.constraint = constraint
        self.repetition = repetition

    def push(self, token: int, num_output_tokens: int, num_tokens: int
             ) -> tuple[str, bool, str | None]:
        if token in self.stop_ids:
            return "", False, "stop"
        text, hit = self.matcher.push(self.detok.add(token))
        if hit:
            return text, True, "stop"
        if self.constraint is not None:
            self.constraint.accept(token)
            if self.constraint.is_complete():
                return text + self._flush(), True, "stop"
        reason = length_reason(num_output_tokens, self.max_tokens, num_tokens, self.max_model_len)
        if reason is None and self.repetition is not None and self.repetition.feed((token,)):
            reason = REPETITION
        if reason:
            text += self._flush()
        return text, True, reason

    def _flush(self) -> str:
        return self.matcher.push(self.detok.flush())[0] + self.matcher.flush()
