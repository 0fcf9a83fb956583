"""What a request asks of the sampler: SamplingParams (plain data, validated), the limits
the APIs enforce, and DRY's sequence breakers found in a vocabulary. The sampler itself is
edgeinfer.runners.sampling (the runner's); the engine and the daemon only pass these on.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import threading
import weakref
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

MAX_LOGPROBS = 20
MAX_N = 128
MAX_STOP_STRINGS = 64
DRY_BREAKERS = ("\n", ":", "\"", "*")   # llama-server's default sequence breakers
MAX_DRY_BREAKERS = 64
MAX_DRY_BREAKER_CHARS = 40         # llama.cpp truncates breakers to this many characters
MIROSTAT_M = 100                   # mirostat v1: tokens used to estimate the Zipf exponent
BAN_BIAS = -100.0          # OpenAI: "-100 should result in a ban"
_PROBE = 10.0              # top-p: first look for the nucleus within this of the max
_NUCLEUS_BINS = 2048       # top-p without top-k: logit buckets instead of a full sort
_BLOCK = 4096              # categorical draw: two-level cumsum above this many candidates
_U64 = (1 << 64) - 1
# Below this, 1/T is past float32's range (~2**128): such a temperature is greedy (T -> 0).
_MIN_TEMPERATURE = 2.0 ** -127


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling settings. Constructing one validates it (ValueError naming
    the field); `validate(vocab_size)` re-checks token ids once the model is known."""
    temperature: float = 0.8            # 0 = greedy
    top_k: int = 0                      # 0 = off
    top_p: float = 1.0                  # 1 = off
    min_p: float = 0.0                  # 0 = off
    repeat_penalty: float = 1.0         # 1 = off
    repeat_last_n: int = 64             # -1 = whole context, 0 = off
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    seed: int | None = None             # None = fresh random seed per request
    max_tokens: int | None = None       # None = until the context is full
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # end with reason "repetition" once the output copies itself verbatim (engine/repetition.py;
    # the server turns it on for base models); checked token by token, not per step
    stop_on_repetition: bool = False
    n: int = 1
    logprobs: int | None = None         # None = off; k = sampled token + k alternatives
    # llama.cpp's further samplers (llama-server's names and defaults; all off by default)
    typical_p: float = 1.0              # 1 = off
    xtc_probability: float = 0.0        # 0 = off
    xtc_threshold: float = 0.1          # > 0.5 = off
    dry_multiplier: float = 0.0         # 0 = off
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1        # -1 = whole context, 0 = off
    dry_sequence_breakers: tuple[str, ...] = DRY_BREAKERS
    # The breakers as token ids: filled from the model's vocabulary by `with_vocabulary()`
    # (the server does it when the model is known); None = not resolved (no breakers).
    dry_breaker_ids: tuple[int, ...] | None = None
    mirostat: int = 0                   # 0 = off, 1 = v1, 2 = v2
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1

    def __post_init__(self):
        # Lenient shapes from JSON (a single stop string, lists, "123" bias keys); the
        # values themselves are checked by validate().
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, (list, tuple)):
            object.__setattr__(self, "stop", tuple(self.stop))
        if isinstance(self.dry_sequence_breakers, str):
            object.__setattr__(self, "dry_sequence_breakers", (self.dry_sequence_breakers,))
        elif isinstance(self.dry_sequence_breakers, list):
            object.__setattr__(self, "dry_sequence_breakers", tuple(self.dry_sequence_breakers))
        if isinstance(self.dry_breaker_ids, (list, set, frozenset)):
            object.__setattr__(self, "dry_breaker_ids", tuple(self.dry_breaker_ids))
        if isinstance(self.stop_token_ids, (list, tuple, set, frozenset)):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if isinstance(self.logit_bias, Mapping):
            bias = {}
            for k, v in self.logit_bias.items():
                if isinstance(k, str) and k.strip().lstrip("-").isdigit():
                    k = int(k)
                bias[k] = v
            object.__setattr__(self, "logit_bias", bias)
        self.validate()

    def validate(self, vocab_size: int | None = None) -> None:
        def bad(msg: str):
            raise ValueError(msg)

        if not _is_real(self.temperature) or not 0.0 <= self.temperature <= 2.0:
            bad("temperature must be between 0 and 2")
        if not _is_int(self.top_k) or self.top_k < 0:
            bad("top_k must be an integer >= 0 (0 disables it)")
        if not _is_real(self.top_p) or not 0.0 <= self.top_p <= 1.0:
            bad("top_p must be between 0 and 1")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            bad("min_p must be between 0 and 1")
        if not _is_real(self.repeat_penalty) or self.repeat_penalty <= 0.0:
            bad("repeat_penalty must be greater than 0 (1 disables it)")
        if not _is_int(self.repeat_last_n) or self.repeat_last_n < -1:
            bad("repeat_last_n must be an integer >= -1 (-1 = whole context, 0 = off)")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not _is_real(v) or not -2.0 <= v <= 2.0:
                bad(f"{name} must be between -2 and 2")
        if not isinstance(self.logit_bias, Mapping):
            bad("logit_bias must be a mapping of token id to bias")
        for k, v in self.logit_bias.items():
            if not _is_int(k) or k < 0:
                bad(f"logit_bias keys must be token ids >= 0, got {k!r}")
            if vocab_size is not None and k >= vocab_size:
                bad(f"logit_bias token id {k} is outside the vocabulary (size {vocab_size})")
            if not _is_real(v) or not -100.0 <= v <= 100.0:
                bad(f"logit_bias values must be between -100 and 100, got {v!r} for {k}")
        if self.seed is not None and (not _is_int(self.seed)
                                      or not -(1 << 63) <= self.seed <= _U64):
            bad("seed must be an integer (64-bit) or null")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            bad("max_tokens must be an integer >= 1")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            bad("stop must be a string or a list of non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            bad(f"stop accepts at most {MAX_STOP_STRINGS} strings")
        if not isinstance(self.stop_token_ids, tuple) or not all(
                _is_int(t) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids must be a list of token ids >= 0")
        if vocab_size is not None and any(t >= vocab_size for t in self.stop_token_ids):
            bad(f"stop_token_ids must be below the vocabulary size {vocab_size}")
        if not isinstance(self.ignore_eos, bool):
            bad("ignore_eos must be true or false")
        if not isinstance(self.stop_on_repetition, bool):
            bad("stop_on_repetition must be true or false")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            bad(f"n must be between 1 and {MAX_N}")
        if self.logprobs is not None and (not _is_int(self.logprobs)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            bad(f"logprobs must be between 0 and {MAX_LOGPROBS}")
        if not _is_real(self.typical_p) or not 0.0 <= self.typical_p <= 1.0:
            bad("typical_p must be between 0 and 1 (1 disables it)")
        if not _is_real(self.xtc_probability) or not 0.0 <= self.xtc_probability <= 1.0:
            bad("xtc_probability must be between 0 and 1 (0 disables it)")
        if not _is_real(self.xtc_threshold) or not 0.0 <= self.xtc_threshold <= 1.0:
            bad("xtc_threshold must be between 0 and 1 (above 0.5 disables XTC)")
        if not _is_real(self.dry_multiplier) or self.dry_multiplier < 0.0:
            bad("dry_multiplier must be >= 0 (0 disables DRY)")
        if not _is_real(self.dry_base) or self.dry_base < 1.0:
            bad("dry_base must be >= 1")
        if not _is_int(self.dry_allowed_length) or self.dry_allowed_length < 0:
            bad("dry_allowed_length must be an integer >= 0")
        if not _is_int(self.dry_penalty_last_n) or self.dry_penalty_last_n < -1:
            bad("dry_penalty_last_n must be an integer >= -1 (-1 = whole context, 0 = off)")
        br = self.dry_sequence_breakers
        if not isinstance(br, tuple) or not all(isinstance(b, str) and b for b in br):
            bad("dry_sequence_breakers must be a list of non-empty strings")
        if len(br) > MAX_DRY_BREAKERS:
            bad(f"dry_sequence_breakers accepts at most {MAX_DRY_BREAKERS} strings")
        if self.dry_breaker_ids is not None and (not isinstance(self.dry_breaker_ids, tuple) or
                                                 not all(_is_int(t) and t >= 0
                                                         for t in self.dry_breaker_ids)):
            bad("dry_breaker_ids must be a list of token ids >= 0")
        if self.mirostat not in (0, 1, 2) or not _is_int(self.mirostat):
            bad("mirostat must be 0 (off), 1 or 2")
        if not _is_real(self.mirostat_tau) or self.mirostat_tau < 0.0:
            bad("mirostat_tau must be >= 0")
        if not _is_real(self.mirostat_eta) or self.mirostat_eta < 0.0:
            bad("mirostat_eta must be >= 0")

    @property
    def dry_on(self) -> bool:
        return self.dry_multiplier > 0.0 and self.dry_penalty_last_n != 0

    @property
    def xtc_on(self) -> bool:
        return self.xtc_probability > 0.0 and self.xtc_threshold <= 0.5

    @property
    def extended(self) -> bool:
        """A sampler beyond top-k/top-p/min-p is on: the draw takes the general path."""
        return bool(self.mirostat) or self.typical_p < 1.0 or self.xtc_on

    @property
    def greedy(self) -> bool:
        return self.temperature < _MIN_TEMPERATURE or self.top_k == 1


# per tokenizer (weakly: an unloaded model's vocabulary must not stay alive for this), per
# breaker list
_BREAKER_CACHE: "weakref.WeakKeyDictionary[Any, dict[tuple[str, ...], tuple[int, ...]]]" = \
    weakref.WeakKeyDictionary()


# one pass at a time: a caller that finds one under way (a load's thread, then the first
# request that uses DRY) waits for its answer instead of repeating it
_BREAKER_LOCK = threading.Lock()


def breaker_ids(tokenizer, breakers: Sequence[str]) -> tuple[int, ...]:
    """Token ids whose text (special tokens rendered) contains one of `breakers` (each cut
    to 40 characters, as llama.cpp does). One pass over the vocabulary per (tokenizer,
    breakers), then cached for as long as the tokenizer lives."""
    key = tuple(breakers)
    hit = _BREAKER_CACHE.get(tokenizer, {}).get(key)
    if hit is not None:
        return hit
    with _BREAKER_LOCK:
        per_tok = _BREAKER_CACHE.setdefault(tokenizer, {})
        hit = per_tok.get(key)
        if hit is not None:
            return hit
        needles = [b[:MAX_DRY_BREAKER_CHARS].encode("utf-8") for b in breakers]
        if hasattr(tokenizer, "piece_table"):
            out = _ids_containing(tokenizer.piece_table(True), needles)
        else:       # a tokenizer without a table (llama.cpp's, asked over a pipe)
            size = int(getattr(tokenizer, "vocab_size", 0)
                       or len(getattr(tokenizer, "tokens", ())))
            out = tuple(t for t in range(size)
                        if any(nd in tokenizer.piece(t, True) for nd in needles))
        if len(per_tok) > 16:
            per_tok.clear()
        per_tok[key] = out
        return out


def _ids_containing(pieces: list[bytes], needles: list[bytes]) -> tuple[int, ...]:
    """Ids whose piece contains one of `needles`, in one search of the joined vocabulary
    per needle (every start, overlapping ones too), each hit mapped to its piece by offset;
    a hit that runs past its piece's end is not one."""
    import re

    import numpy as np      # lazy: the CLI imports this module for SamplingParams alone
    blob = b"".join(pieces)
    ends = np.cumsum(np.fromiter(map(len, pieces), np.int64, len(pieces)))
    hits = []
    for nd in needles:
        if not nd:
            continue
        if len(nd) == 1:
            at = np.flatnonzero(np.frombuffer(blob, np.uint8) == nd[0])
        else:
            at = np.fromiter((m.start() for m in re.finditer(b"(?=" + re.escape(nd) + b")", blob)),
                             np.int64)
        ids = np.searchsorted(ends, at, side="right")     # every hit is inside the blob
        hits.append(ids[at + len(nd) <= ends[ids]])
    if not hits:
        return ()
    return tuple(np.unique(np.concatenate(hits)).tolist())


def with_vocabulary(params: SamplingParams, tokenizer) -> SamplingParams:
    """`params` with DRY's sequence breakers resolved to token ids of this vocabulary
    (unchanged when DRY is off or they are resolved already)."""
    if not params.dry_on or params.dry_breaker_ids is not None:
        return params
    import dataclasses
    return dataclasses.replace(params, dry_breaker_ids=breaker_ids(
        tokenizer, params.dry_sequence_breakers))


# Defaults for base models (no chat template of their own: never trained to stop), for what
# a request leaves unset. README "The first run" has the measurements behind them.
BASE_DRY_MULTIPLIER = 0.8        # llama-server's suggested DRY strength (base 1.75, length 2)
BASE_MAX_TOKENS = 256            # an output cap where the request sets none


def is_base_model(engine) -> bool:
    """The GGUF has no chat template of its own (the engine then uses a built-in one)."""
    return not engine.has_own_template


def base_model_params(params: SamplingParams, given: Collection[str] = ()) -> SamplingParams:
    """A base model's defaults (DRY on, an output cap) for what `given` does not name.
    DRY only when sampling: a greedy request (temperature 0) asks for the model's own argmax,
    which is what parity checks against llama.cpp compare (the cap and the repetition stop
    still bound it)."""
    kw: dict = {}
    if "dry_multiplier" not in given and not params.greedy:
        kw["dry_multiplier"] = BASE_DRY_MULTIPLIER
    if "max_tokens" not in given and (params.max_tokens is None
                                      or params.max_tokens > BASE_MAX_TOKENS):
        kw["max_tokens"] = BASE_MAX_TOKENS
    return dataclasses.replace(params, **kw) if kw else params
