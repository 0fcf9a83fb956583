"""Token sampling: parameters, per-sequence state, and a batched sampler.

Order of application (llama.cpp's sampler chain), per row of logits:

  1. logit bias        logits[id] += bias; a bias of -100 (or less) is an exact ban (-inf).
                       With `ignore_eos`, the model's EOS ids are banned too (as llama.cpp).
  2. penalties         repeat penalty over the last `repeat_last_n` tokens of prompt+output
                       (llama.cpp: positive logits divided by it, negative ones multiplied);
                       then frequency/presence penalties over *generated* tokens only
                       (OpenAI: logit -= count * frequency_penalty + (count > 0) * presence).
  3. top-k             keep the k largest logits.
  4. top-p             keep the smallest most-likely prefix whose probability (softmax at
                       temperature 1 over what top-k left) reaches top_p.
  5. min-p             keep tokens with p >= min_p * p_max (logit >= max + ln(min_p)).
  6. temperature       divide the survivors' logits by T.
  7. sample            one uniform draw from the sequence's own PCG64 generator.

Temperature 0 (or top_k 1) is greedy: argmax after steps 1-2, no softmax, no RNG draw.

Logprobs (when asked) are of the distribution after bias and penalties, before top-k/p,
min-p and temperature: the model's view of the token, comparable across sampling settings.

Exactness note: with no truncation step active, tokens whose tempered probability relative
to the best token is below e^-40 are dropped before the draw; their total mass is at most
V * e^-40 (< 1e-11 for V = 262,144), far below anything a float64 uniform draw resolves.
Top-k and top-p are exact.

Reproducibility: each sequence owns a `SeqSamplingState` whose generator is seeded once
(`np.random.Generator(np.random.PCG64(seed))`; choice i of an n>1 request uses spawn key i).
Rows are sampled independently, so a seed gives the same tokens alone or batched.
"""
from __future__ import annotations

import math
import numbers
import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

MAX_LOGPROBS = 20
MAX_N = 128
MAX_STOP_STRINGS = 64
BAN_BIAS = -100.0          # OpenAI: "-100 should result in a ban"
_TAIL_CUT = 40.0           # tempered log-ratio below which a token is dropped (see above)
_BLOCK = 4096              # categorical draw: two-level cumsum above this many candidates
_U64 = (1 << 64) - 1


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
    n: int = 1
    logprobs: int | None = None         # None = off; k = sampled token + k alternatives

    def __post_init__(self):
        # Lenient shapes from JSON (a single stop string, lists, "123" bias keys); the
        # values themselves are checked by validate().
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, (list, tuple)):
            object.__setattr__(self, "stop", tuple(self.stop))
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
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            bad(f"n must be between 1 and {MAX_N}")
        if self.logprobs is not None and (not _is_int(self.logprobs)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            bad(f"logprobs must be between 0 and {MAX_LOGPROBS}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


class SeqSamplingState:
    """Everything sampling needs to remember about one sequence (one choice of a request).

    Create it once per sequence, keep it across preemption, and call `append(token)` after
    every sampled token. Only the engine thread touches it.
    """

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int] = (), *,
                 choice_index: int = 0, eos_token_ids: Iterable[int] = ()):
        self.params = params
        # The effective seed is kept so a random-seed request can be logged and replayed.
        self.seed: int = params.seed if params.seed is not None else secrets.randbits(63)
        spawn = (choice_index,) if choice_index else ()
        self.rng = np.random.Generator(
            np.random.PCG64(np.random.SeedSequence(self.seed & _U64, spawn_key=spawn)))
        prompt = np.asarray(prompt_ids, dtype=np.int64).reshape(-1)
        self._tokens = np.empty(max(64, 2 * prompt.size), dtype=np.int64)
        self._tokens[:prompt.size] = prompt
        self._len = prompt.size
        self.n_prompt = prompt.size
        # Bias as sparse (ids, values); bans become -inf so no logit can outweigh them.
        bias = {int(k): float(v) for k, v in params.logit_bias.items()}
        if params.ignore_eos:
            for t in eos_token_ids:
                bias[int(t)] = -math.inf
        ids = np.fromiter(bias.keys(), dtype=np.int64, count=len(bias))
        vals = np.fromiter(bias.values(), dtype=np.float32, count=len(bias))
        vals[vals <= BAN_BIAS] = -np.inf
        self.bias_ids, self.bias_values = ids, vals

    def append(self, token: int) -> None:
        if self._len == self._tokens.size:
            grown = np.empty(2 * self._tokens.size, dtype=np.int64)
            grown[:self._len] = self._tokens[:self._len]
            self._tokens = grown
        self._tokens[self._len] = token
        self._len += 1

    @property
    def generated(self) -> np.ndarray:
        return self._tokens[self.n_prompt:self._len]

    @property
    def num_generated(self) -> int:
        return self._len - self.n_prompt

    def repeat_window(self) -> np.ndarray:
        """Distinct token ids of the repeat-penalty window (last n of prompt + output)."""
        n = self.params.repeat_last_n
        if n == 0 or self._len == 0:
            return self._tokens[:0]
        start = 0 if n < 0 else max(0, self._len - n)
        return np.unique(self._tokens[start:self._len])

    def generated_counts(self) -> tuple[np.ndarray, np.ndarray]:
        return np.unique(self.generated, return_counts=True)


def process_logits(row: np.ndarray, state: SeqSamplingState) -> np.ndarray:
    """Steps 1-2 (bias, penalties) on one row of logits. Returns `row` itself when nothing
    applies, otherwise a modified float32 copy; the input is never written. Only the few
    affected ids are touched (sparse), so this is cheap for any vocabulary size."""
    p = state.params
    vocab = row.shape[0]
    rep_ids = state.repeat_window() if p.repeat_penalty != 1.0 else None
    use_fp = p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
    gen_ids, gen_counts = state.generated_counts() if use_fp and state.num_generated else (None, None)
    if not state.bias_ids.size and (rep_ids is None or not rep_ids.size) and gen_ids is None:
        return row
    out = np.array(row, dtype=np.float32, copy=True)
    if state.bias_ids.size:
        ok = state.bias_ids < vocab            # ids were checked against the vocab at the API
        out[state.bias_ids[ok]] += state.bias_values[ok]
    if rep_ids is not None and rep_ids.size:
        rep_ids = rep_ids[(rep_ids >= 0) & (rep_ids < vocab)]
        v = out[rep_ids]
        out[rep_ids] = np.where(v > 0, v / np.float32(p.repeat_penalty),
                                v * np.float32(p.repeat_penalty))
    if gen_ids is not None:
        ok = (gen_ids >= 0) & (gen_ids < vocab)
        ids, counts = gen_ids[ok], gen_counts[ok].astype(np.float32)
        out[ids] -= counts * np.float32(p.frequency_penalty) + np.float32(p.presence_penalty)
    return out


@dataclass
class SampleResult:
    tokens: np.ndarray                    # int64[B]
    logprobs: np.ndarray                  # float64[B]; NaN for rows that did not ask
    top_logprobs: list[list[tuple[int, float]]] | None  # None if no row asked for any


def _log_normalizer(row: np.ndarray, m: float) -> float:
    """log(sum(exp(row))) given its max m; one pass over the vocabulary."""
    return float(m) + math.log(float(np.exp(row - m).sum(dtype=np.float64)))


def _top_n(row: np.ndarray, n: int) -> np.ndarray:
    """Indices of the n largest values, largest first (ties by lower id)."""
    if n >= row.shape[0]:
        idx = np.arange(row.shape[0])
    else:
        idx = np.argpartition(row, row.shape[0] - n)[row.shape[0] - n:]
    return idx[np.lexsort((idx, -row[idx]))]


def _top_k_ids(row: np.ndarray, k: int) -> np.ndarray:
    """Ids of the k largest logits (any order). Partition finds the k-th value, then one
    compare pass collects everything at or above it; ties at the boundary go to lower ids."""
    v = row.shape[0]
    kth = np.partition(row, v - k)[v - k]
    idx = np.flatnonzero(row >= kth)
    if idx.size > k:
        idx = idx[np.lexsort((idx, -row[idx]))[:k]]
    return idx


def _categorical(weights: np.ndarray, u: float) -> int:
    """Position j with cumsum(weights)[j-1] <= u*total < cumsum(weights)[j]. Above _BLOCK
    entries a two-level search (block sums, then one block) avoids a full-length cumsum."""
    n = weights.shape[0]
    if n <= _BLOCK:
        cum = np.cumsum(weights, dtype=np.float64)
        j = min(int(np.searchsorted(cum, u * cum[-1], side="right")), n - 1)
        while weights[j] == 0.0 and j > 0:     # u*total rounded up to the total
            j -= 1
        return j
    pad = (-n) % _BLOCK
    w = np.concatenate([weights, np.zeros(pad, weights.dtype)]) if pad else weights
    blocks = w.reshape(-1, _BLOCK).sum(axis=1, dtype=np.float64)
    cum = np.cumsum(blocks)
    target = u * cum[-1]
    b = min(int(np.searchsorted(cum, target, side="right")), blocks.size - 1)
    while blocks[b] == 0.0 and b > 0:          # rounding landed past the last non-empty block
        b -= 1
    inner = np.cumsum(w[b * _BLOCK:(b + 1) * _BLOCK], dtype=np.float64)
    rest = target - (cum[b - 1] if b else 0.0)
    j = min(int(np.searchsorted(inner, rest, side="right")), _BLOCK - 1)
    while w[b * _BLOCK + j] == 0.0 and j > 0:  # never land on zero-weight padding
        j -= 1
    return min(b * _BLOCK + j, n - 1)


def truncate(row: np.ndarray, p: SamplingParams) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Steps 3-5 (top-k, top-p, min-p) on a processed row: the surviving ids and their
    logits, or (None, None) when no truncation step is active (every id survives)."""
    vocab = row.shape[0]
    m = float(row.max())
    idx = vals = None
    if p.top_k and p.top_k < vocab:
        idx = _top_k_ids(row, p.top_k)
        vals = row[idx]
    if p.top_p < 1.0:
        if idx is not None:
            e = np.exp(vals - m)
            z = float(e.sum(dtype=np.float64))
        else:
            e_all = np.exp(row - m)
            z = float(e_all.sum(dtype=np.float64))
            # Sorting 262k logits is the slow part, so sort only a threshold set of the
            # best tokens. Everything outside it is smaller than everything inside, so once
            # its mass reaches top_p its sorted order is the true nucleus. The last cut
            # ln(V / (1 - top_p)) guarantees that (tail mass <= V e^-c <= (1-top_p) z).
            final = math.log(vocab / max(1.0 - p.top_p, 1e-12))
            for c in (4.0, 8.0, 16.0, final):
                c = min(c, final)
                idx = np.flatnonzero(row >= m - c)
                e = e_all[idx]
                if c == final or e.sum(dtype=np.float64) >= p.top_p * z:
                    break
            vals = row[idx]
        order = np.lexsort((idx, -vals))
        idx, vals, e = idx[order], vals[order], e[order]
        cum = np.cumsum(e, dtype=np.float64)
        keep = int(np.searchsorted(cum, p.top_p * z, side="left")) + 1  # include the crossing token
        idx, vals = idx[:keep], vals[:keep]
    if p.min_p > 0.0:
        floor = m + math.log(p.min_p)   # top-k/top-p always keep the max, so m still holds
        if idx is None:
            idx = np.flatnonzero(row >= floor)
            vals = row[idx]
        else:
            ok = vals >= floor
            idx, vals = idx[ok], vals[ok]
    return idx, vals


def _sample_row(row: np.ndarray, p: SamplingParams, u: float) -> int:
    """Steps 3-7 on a processed row (temperature > 0). `u` is the row's uniform draw."""
    m = float(row.max())
    idx, vals = truncate(row, p)
    t = p.temperature
    if idx is None:
        idx = np.flatnonzero(row >= m - _TAIL_CUT * t)
        vals = row[idx]
    w = np.exp((vals - m) / np.float32(t))
    return int(idx[_categorical(w, u)])


class Sampler:
    """Samples one token per row of a logits batch; stateless apart from the caller's
    per-sequence states, so one Sampler serves the whole engine."""

    def sample(self, logits: np.ndarray, states: Sequence[SeqSamplingState]) -> SampleResult:
        logits = np.asarray(logits)
        if logits.ndim != 2 or logits.shape[0] != len(states):
            raise ValueError(f"logits shape {logits.shape} does not match {len(states)} states")
        if logits.dtype != np.float32:
            logits = logits.astype(np.float32)
        batch = logits.shape[0]
        tokens = np.empty(batch, dtype=np.int64)
        logprobs = np.full(batch, np.nan, dtype=np.float64)
        want_top = any(s.params.logprobs for s in states)
        top: list[list[tuple[int, float]]] | None = [[] for _ in range(batch)] if want_top else None
        for b, state in enumerate(states):
            p = state.params
            row = process_logits(logits[b], state)
            m = float(row.max())
            if not math.isfinite(m):
                # Every token banned (or the model produced no finite logit): fall back to
                # the raw argmax rather than failing the whole batch.
                row = logits[b]
                m = float(row.max())
            if p.greedy:
                tok = int(np.argmax(row))
            else:
                tok = _sample_row(row, p, float(state.rng.random()))
            tokens[b] = tok
            if p.logprobs is not None:
                lse = _log_normalizer(row, m)
                logprobs[b] = float(row[tok]) - lse
                if p.logprobs:
                    ids = _top_n(row, p.logprobs)
                    top[b] = [(int(i), float(row[i]) - lse) for i in ids]
        return SampleResult(tokens=tokens, logprobs=logprobs, top_logprobs=top)
