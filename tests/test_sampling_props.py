"""Property-based checks of the sampler over random logits (NaN and +-inf included), biases,
penalties, truncation parameters and token masks, against an independent float32
reference of steps 0-2 (mask, bias, penalties) and of the fallback (issue 18):

  - the token is within the vocabulary, or -1 with an error exactly when no allowed token
    has a finite logit;
  - never a banned or masked token while any allowed, unbanned token is possible;
  - when every allowed token is banned: the argmax of the masked raw row;
  - greedy (temperature below 2**-127 or top_k 1) is the argmax of the processed row;
  - sampled tokens respect top-k and min-p;
  - same seed -> same token; a row batched with others == the same row alone;
  - logprobs finite, <= 0, equal to the reference log-softmax; top logprobs sorted,
    finite, of possible tokens only;
  - inputs (logits, masks) are never written.
"""
from __future__ import annotations

import math
from collections import Counter

import numpy as np
from hypothesis import HealthCheck, event, given, settings, strategies as st

from edgeinfer.runners.sampling_params import SamplingParams

from edgeinfer.runners.sampling import Sampler, SeqSamplingState

F32 = np.float32
SPECIALS = (math.nan, math.inf, -math.inf)
SETTINGS = dict(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.large_base_example])


# --- strategies ---------------------------------------------------------------------------

@st.composite
def params_for(draw, vocab: int, rng: np.random.Generator) -> SamplingParams:
    kind = draw(st.sampled_from(["zero", "tiny", "sampled", "sampled", "sampled", "hot"]))
    temperature = {"zero": st.just(0.0), "tiny": st.sampled_from([1e-45, 2.0 ** -127, 1e-3]),
                   "sampled": st.floats(0.05, 2.0), "hot": st.floats(1.5, 2.0)}[kind]
    temperature = draw(temperature)
    ids = st.integers(0, vocab - 1)
    bias = draw(st.dictionaries(ids, st.one_of(st.just(-100.0), st.floats(-100.0, 100.0)),
                                max_size=min(vocab, 6)))
    if draw(st.integers(0, 4)) == 0:            # sometimes ban (almost) everything
        keep = rng.random(vocab) < draw(st.sampled_from([0.0, 0.0, 0.1]))
        bias = {int(i): -100.0 for i in np.flatnonzero(~keep)}
    return SamplingParams(
        temperature=temperature,
        top_k=draw(st.one_of(st.just(0), st.integers(0, vocab + 2))),
        top_p=draw(st.one_of(st.just(1.0), st.floats(0.0, 1.0))),
        min_p=draw(st.one_of(st.just(0.0), st.floats(0.0, 1.0))),
        repeat_penalty=draw(st.one_of(st.just(1.0), st.floats(0.5, 2.0))),
        repeat_last_n=draw(st.integers(-1, 8)),
        frequency_penalty=draw(st.one_of(st.just(0.0), st.floats(-2.0, 2.0))),
        presence_penalty=draw(st.one_of(st.just(0.0), st.floats(-2.0, 2.0))),
        logit_bias=bias,
        seed=draw(st.integers(0, 2 ** 32)),
        logprobs=draw(st.one_of(st.none(), st.integers(0, 5))),
    )


@st.composite
def mask_for(draw, vocab: int, rng: np.random.Generator) -> np.ndarray | None:
    kind = draw(st.sampled_from(["none", "none", "dense", "sparse", "one", "empty"]))
    if kind == "none":
        return None
    if kind == "empty":
        return np.zeros(vocab, bool)
    if kind == "one":
        m = np.zeros(vocab, bool)
        m[draw(st.integers(0, vocab - 1))] = True
        return m
    return rng.random(vocab) < (0.6 if kind == "dense" else 0.05)


@st.composite
def rows(draw, large: bool):
    """One batch row: (raw logits, params, mask, prompt ids, generated ids)."""
    seed = draw(st.integers(0, 2 ** 32))
    rng = np.random.default_rng(seed)
    if large:
        vocab = draw(st.integers(4097, 12000))
        kind = draw(st.sampled_from(["flat", "normal", "peaked", "floor"]))
        if kind == "floor":       # one token over a wide floor 10.5 below: top-p buckets
            x = np.full(vocab, -10.5, F32) + (rng.standard_normal(vocab) * 0.01).astype(F32)
            x[rng.integers(vocab)] = 0.0
        else:
            scale = {"flat": 0.5, "normal": 3.0, "peaked": 2.0}[kind]
            x = (rng.standard_normal(vocab) * scale).astype(F32)
            if kind == "peaked":
                x[rng.choice(vocab, 8, replace=False)] += np.linspace(14, 8, 8, dtype=F32)
    else:
        vocab = draw(st.integers(1, 40))
        x = np.array(draw(st.lists(st.one_of(st.floats(-30, 30, width=32),
                                             st.floats(-2, 2, width=32),
                                             st.sampled_from([0.0, 1.0, -1.0]),   # ties
                                             st.floats(-2.0 ** 100, 2.0 ** 100, width=32)),
                                   min_size=vocab, max_size=vocab)), F32)
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 2, 3]))):   # NaN / +-inf sprinkled in
        x[draw(st.integers(0, vocab - 1))] = draw(st.sampled_from(SPECIALS))
    if draw(st.integers(0, 14)) == 0:           # a whole row of one special value
        x[:] = draw(st.sampled_from(SPECIALS))
    p = draw(params_for(vocab, rng))
    mask = draw(mask_for(vocab, rng))
    hist = st.lists(st.integers(0, vocab - 1), max_size=10)
    return x, p, mask, draw(hist), draw(hist)


# --- the reference ------------------------------------------------------------------------

def finite_view(x: np.ndarray) -> np.ndarray:
    x = np.where(np.isnan(x), F32(-np.inf), x).astype(F32)
    if (x == np.inf).any():
        x = np.where(x == np.inf, F32(0.0), F32(-np.inf)).astype(F32)
    return x


def reference(raw, p: SamplingParams, mask, prompt, gen) -> tuple[np.ndarray, np.ndarray]:
    """(processed row after steps 0-2 made finite-or--inf, fallback row: masked raw)."""
    x = raw.astype(F32).copy()
    if mask is not None:
        x[~mask] = -np.inf
    fallback = finite_view(x.copy())
    with np.errstate(all="ignore"):
        for t, v in p.logit_bias.items():
            x[t] = -np.inf if v <= -100 else x[t] + F32(v)
        if p.repeat_penalty != 1.0 and p.repeat_last_n != 0:
            hist = list(prompt) + list(gen)
            window = hist if p.repeat_last_n < 0 else hist[-p.repeat_last_n:]
            rp = F32(p.repeat_penalty)
            for t in set(window):
                x[t] = x[t] / rp if x[t] > 0 else x[t] * rp
        if (p.frequency_penalty or p.presence_penalty) and gen:
            for t, c in Counter(gen).items():
                x[t] -= F32(c) * F32(p.frequency_penalty) + F32(p.presence_penalty)
    return finite_view(x), fallback


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max()
    return x - (m + math.log(np.exp(x - m).sum()))


def state(x, p, mask, prompt, gen) -> SeqSamplingState:
    s = SeqSamplingState(p, prompt_ids=prompt)
    for t in gen:
        s.append(t)
    return s


def run(batch, sampler=None):
    logits = np.stack([r[0] for r in batch])
    masks = [r[2] for r in batch]
    states = [state(*r) for r in batch]
    return (sampler or Sampler()).sample(logits, states,
                                         masks if any(m is not None for m in masks) else None)


def check(batch):
    # all rows share the vocabulary size of the first
    vocab = batch[0][0].size
    batch = [r for r in batch if r[0].size == vocab]
    copies = [(r[0].copy(), None if r[2] is None else r[2].copy()) for r in batch]
    with np.errstate(all="ignore"):
        res = run(batch)
        again = run(batch)
    assert res.tokens.dtype == np.int64 and res.tokens.shape == (len(batch),)
    assert len(res.errors) == len(batch)
    # same seed -> same result
    assert res.tokens.tolist() == again.tokens.tolist()
    np.testing.assert_array_equal(res.logprobs, again.logprobs)
    assert res.top_logprobs == again.top_logprobs and res.errors == again.errors
    for b, (raw, p, mask, prompt, gen) in enumerate(batch):
        # inputs untouched
        np.testing.assert_array_equal(raw, copies[b][0])
        if mask is not None:
            np.testing.assert_array_equal(mask, copies[b][1])
        # batched == alone
        with np.errstate(all="ignore"):
            one = run([batch[b]])
        assert one.tokens[0] == res.tokens[b] and one.errors[0] == res.errors[b]
        np.testing.assert_array_equal(one.logprobs[0], res.logprobs[b])
        assert (one.top_logprobs or [[]])[0] == (res.top_logprobs[b] if res.top_logprobs else [])

        proc, fb = reference(raw, p, mask, prompt, gen)
        tok, err = int(res.tokens[b]), res.errors[b]
        event(f"mask={'none' if mask is None else 'some'}; nonfinite={not np.isfinite(raw).all()}")
        if (proc > -np.inf).any():
            dist = proc
            event("greedy" if p.temperature < 2.0 ** -127 or p.top_k == 1 else "sampled")
            assert err is None and 0 <= tok < vocab
            assert proc[tok] > -np.inf                     # never banned or masked
            if p.temperature < 2.0 ** -127 or p.top_k == 1:
                assert tok == int(np.argmax(proc))          # greedy == argmax
            else:
                if p.top_k:
                    assert np.count_nonzero(proc > proc[tok]) < p.top_k
                if p.min_p > 0:
                    m = float(proc.max())
                    assert proc[tok] >= F32(m + math.log(p.min_p))
        elif (fb > -np.inf).any():
            dist = fb                                       # issue 18: best allowed raw
            event("fallback")
            assert err is None and tok == int(np.argmax(fb))
            assert mask is None or mask[tok]
        else:
            event("error row")
            assert tok == -1 and isinstance(err, str) and err
            assert np.isnan(res.logprobs[b])
            assert res.top_logprobs is None or res.top_logprobs[b] == []
            continue
        if p.logprobs is None:
            assert np.isnan(res.logprobs[b])
            continue
        lp = float(res.logprobs[b])
        ref = log_softmax(dist[dist > -np.inf])
        ref_all = np.full(vocab, -np.inf)
        ref_all[dist > -np.inf] = ref
        assert math.isfinite(lp) and lp <= 0.0
        assert abs(lp - ref_all[tok]) <= 1e-4 + 1e-6 * abs(float(dist[tok]))
        top = res.top_logprobs[b] if res.top_logprobs is not None else []
        want_n = min(p.logprobs, int(np.count_nonzero(dist > -np.inf)))
        assert len(top) == want_n
        vals = [v for _, v in top]
        assert all(math.isfinite(v) and v <= 0.0 for v in vals)
        assert vals == sorted(vals, reverse=True)
        for i, v in top:
            assert 0 <= i < vocab and dist[i] > -np.inf
            assert abs(v - ref_all[i]) <= 1e-4 + 1e-6 * abs(float(dist[i]))
        if top:
            assert abs(top[0][1] - ref_all.max()) <= 1e-4 + 1e-6 * abs(float(dist.max()))


# --- the properties -------------------------------------------------------------------------

@settings(max_examples=200, **SETTINGS)     # 200: 400 took 12 s of the default run
@given(st.lists(rows(large=False), min_size=1, max_size=4))
def test_sampler_invariants_small_vocab(batch):
    check(batch)


@settings(max_examples=60, **SETTINGS)
@given(st.lists(rows(large=True), min_size=1, max_size=2))
def test_sampler_invariants_large_vocab(batch):
    check(batch)
