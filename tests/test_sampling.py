"""Sampler: greedy, seeds, truncation supports, penalties, bias, temperature, logprobs,
validation. Distribution checks use fixed seeds, so they are deterministic."""
from __future__ import annotations

import math

import numpy as np
import pytest

from edgeinfer.runners.sampling_params import SamplingParams

from edgeinfer.runners.sampling import Sampler, SeqSamplingState, _categorical, process_logits, truncate


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def draw(logits: np.ndarray, n: int, **kw) -> np.ndarray:
    """n tokens from one sequence (no history effects: no penalties in these calls)."""
    st = SeqSamplingState(SamplingParams(seed=kw.pop("seed", 0), **kw))
    s = Sampler()
    row = logits[None, :].astype(np.float32)
    return np.array([s.sample(row, [st]).tokens[0] for _ in range(n)])


def probs_logits(probs) -> np.ndarray:
    return np.log(np.asarray(probs, dtype=np.float64)).astype(np.float32)


# --- greedy and seeds --------------------------------------------------------------------

def test_greedy_is_argmax_per_row():
    logits = np.random.default_rng(1).standard_normal((4, 5000)).astype(np.float32)
    states = [SeqSamplingState(SamplingParams(temperature=0.0)) for _ in range(4)]
    res = Sampler().sample(logits, states)
    assert res.tokens.tolist() == logits.argmax(axis=1).tolist()
    assert np.isnan(res.logprobs).all() and res.top_logprobs is None


def test_top_k_one_equals_greedy():
    logits = np.random.default_rng(2).standard_normal((3, 3000)).astype(np.float32)
    states = [SeqSamplingState(SamplingParams(temperature=1.5, top_k=1, seed=i)) for i in range(3)]
    for _ in range(5):
        assert Sampler().sample(logits, states).tokens.tolist() == logits.argmax(1).tolist()


def _run(params: SamplingParams, steps: int, batch_with: list | None = None, seed_logits=3):
    """Generate `steps` tokens; logits depend on the step so the sequence is non-trivial.
    Optionally share each batch with unrelated sequences."""
    rng = np.random.default_rng(seed_logits)
    st = SeqSamplingState(params, prompt_ids=[1, 2, 3])
    others = [SeqSamplingState(p) for p in (batch_with or [])]
    out = []
    for _ in range(steps):
        row = (rng.standard_normal(2000) * 2).astype(np.float32)
        rows = np.stack([row] + [np.roll(row, 7)] * len(others))
        res = Sampler().sample(rows, [st] + others)
        st.append(int(res.tokens[0]))
        for o, t in zip(others, res.tokens[1:]):
            o.append(int(t))
        out.append(int(res.tokens[0]))
    return out


def test_same_seed_same_tokens_alone_or_batched():
    p = SamplingParams(temperature=1.0, top_p=0.95, repeat_penalty=1.1, frequency_penalty=0.5,
                       seed=1234)
    alone = _run(p, 40)
    assert alone == _run(p, 40)
    batched = _run(p, 40, batch_with=[SamplingParams(temperature=1.2, seed=9),
                                      SamplingParams(temperature=0.7)])
    assert batched == alone
    assert _run(SamplingParams(temperature=1.0, top_p=0.95, repeat_penalty=1.1,
                               frequency_penalty=0.5, seed=1235), 40) != alone


def test_seed_stream_matches_plain_pcg64_and_choices_differ():
    p = SamplingParams(seed=77)
    a = SeqSamplingState(p).rng.random(5)
    assert np.array_equal(a, np.random.Generator(np.random.PCG64(77)).random(5))
    b = SeqSamplingState(p, choice_index=1).rng.random(5)
    assert not np.array_equal(a, b)
    assert np.array_equal(b, SeqSamplingState(p, choice_index=1).rng.random(5))
    # A request without a seed gets a random one, recorded for replay.
    s1, s2 = SeqSamplingState(SamplingParams()), SeqSamplingState(SamplingParams())
    assert s1.seed != s2.seed
    assert SeqSamplingState(SamplingParams(seed=-1)).seed == -1  # negative seeds are fixed seeds


# --- truncation supports -----------------------------------------------------------------

PROBS = [0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02]


def test_top_k_support():
    toks = draw(probs_logits(PROBS), 3000, temperature=1.0, top_k=3)
    assert set(toks.tolist()) == {0, 1, 2}


def test_top_p_support():
    # cumulative 0.4, 0.65, 0.80, 0.90: top_p 0.7 keeps the crossing token -> {0, 1, 2}
    toks = draw(probs_logits(PROBS), 3000, temperature=1.0, top_p=0.7)
    assert set(toks.tolist()) == {0, 1, 2}
    toks = draw(probs_logits(PROBS), 3000, temperature=1.0, top_p=0.3)
    assert set(toks.tolist()) == {0}


def test_min_p_support():
    # min_p 0.2 keeps p >= 0.08 -> {0, 1, 2, 3}
    toks = draw(probs_logits(PROBS), 4000, temperature=1.0, min_p=0.2)
    assert set(toks.tolist()) == {0, 1, 2, 3}


def test_top_k_then_top_p_renormalizes_over_top_k():
    # After top_k=2 the masses are 0.4/0.65 and 0.25/0.65: top_p 0.6 keeps only token 0.
    toks = draw(probs_logits(PROBS), 1000, temperature=1.0, top_k=2, top_p=0.6)
    assert set(toks.tolist()) == {0}


def _reference_truncate(row: np.ndarray, p: SamplingParams) -> set[int]:
    """The textbook chain with a full sort (slow, obviously right)."""
    order = np.lexsort((np.arange(row.size), -row))
    if p.top_k:
        order = order[:p.top_k]
    pr = softmax(row[order].astype(np.float64))
    if p.top_p < 1:
        keep = int(np.searchsorted(np.cumsum(pr), p.top_p, side="left")) + 1
        order, pr = order[:keep], pr[:keep]
    if p.min_p > 0:
        order = order[pr >= p.min_p * pr.max()]
    return set(order.tolist())


def _row(shape: str) -> np.ndarray:
    rng = np.random.default_rng(len(shape))
    if shape == "peaked":  # few strong tokens over a heavy floor: near-max probe fails
        x = (rng.standard_normal(262144) * 2.0).astype(np.float32)
        x[rng.choice(262144, 8, replace=False)] += np.linspace(14, 8, 8, dtype=np.float32)
        return x
    scale = {"flat": 0.5, "normal": 3.0, "sharp": 12.0}[shape]
    return (rng.standard_normal(262144) * scale).astype(np.float32)


@pytest.mark.parametrize("shape", ["flat", "normal", "sharp", "peaked"])
@pytest.mark.parametrize("kw", [dict(top_p=0.9), dict(top_p=0.5), dict(top_p=0.99),
                                dict(top_k=50, top_p=0.8), dict(min_p=0.05), dict(min_p=0.5),
                                dict(top_p=0.95, min_p=0.1), dict(top_k=200)])
def test_truncate_matches_full_sort_on_large_vocab(shape, kw):
    row = _row(shape)
    p = SamplingParams(temperature=1.0, **kw)
    assert set(truncate(row, p).tolist()) == _reference_truncate(row, p)


def test_large_nucleus_sampling_stays_in_support():
    row = _row("peaked")
    p = SamplingParams(temperature=0.9, top_p=0.95, min_p=1e-6)
    support = _reference_truncate(row, p)
    assert len(support) > 5000  # the bucketed path, not the near-max probe
    toks = draw(row, 300, temperature=0.9, top_p=0.95, min_p=1e-6, seed=4)
    assert set(toks.tolist()) <= support


# --- penalties and bias ------------------------------------------------------------------

def test_repeat_penalty_divides_positive_multiplies_negative():
    row = np.array([2.0, -2.0, 1.0, -1.0, 0.5, 3.0], dtype=np.float32)
    # window of last 3 tokens of prompt+output: ids 0, 1, 4 (3 is outside the window)
    st = SeqSamplingState(SamplingParams(repeat_penalty=2.0, repeat_last_n=3), prompt_ids=[3, 0, 1])
    st.append(4)
    out = process_logits(row, st)
    np.testing.assert_allclose(out, [1.0, -4.0, 1.0, -1.0, 0.25, 3.0])
    assert row[1] == -2.0  # input untouched
    st_all = SeqSamplingState(SamplingParams(repeat_penalty=2.0, repeat_last_n=-1), prompt_ids=[3, 0, 1])
    np.testing.assert_allclose(process_logits(row, st_all), [1.0, -4.0, 1.0, -2.0, 0.5, 3.0])


def test_frequency_presence_count_generated_tokens_only():
    row = np.zeros(6, dtype=np.float32)
    st = SeqSamplingState(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25),
                          prompt_ids=[5, 5, 5])
    for t in (1, 1, 1, 2):
        st.append(t)
    out = process_logits(row, st)
    np.testing.assert_allclose(out, [0, -(3 * 0.5 + 0.25), -(0.5 + 0.25), 0, 0, 0])


def test_bias_then_penalty_order():
    row = np.array([1.0, 0.0, 0.0], dtype=np.float32)
    st = SeqSamplingState(SamplingParams(logit_bias={0: 3.0, 1: -1.0}, repeat_penalty=2.0),
                          prompt_ids=[0, 1])
    # bias first (4, -1), then penalty (4/2, -1*2)
    np.testing.assert_allclose(process_logits(row, st), [2.0, -2.0, 0.0])


def test_no_processing_returns_input_without_copy():
    row = np.arange(10, dtype=np.float32)
    st = SeqSamplingState(SamplingParams(), prompt_ids=[1, 2])
    assert process_logits(row, st) is row


def test_logit_bias_ban_and_force():
    logits = np.random.default_rng(5).standard_normal(1000).astype(np.float32)
    best = int(logits.argmax())
    toks = draw(logits, 50, temperature=0.0, logit_bias={best: -100})
    assert best not in toks and (toks == np.argsort(logits)[-2]).all()
    assert best not in draw(logits * 30, 300, temperature=2.0, logit_bias={best: -100})
    assert (draw(logits, 50, temperature=1.0, logit_bias={"17": 100}) == 17).all()


def test_ignore_eos_bans_eos():
    logits = np.zeros((1, 10), dtype=np.float32)
    logits[0, 2] = 50.0
    st = SeqSamplingState(SamplingParams(temperature=0.0, ignore_eos=True), eos_token_ids=[2])
    assert Sampler().sample(logits, [st]).tokens[0] != 2
    st = SeqSamplingState(SamplingParams(temperature=0.0), eos_token_ids=[2])
    assert Sampler().sample(logits, [st]).tokens[0] == 2


def test_greedy_with_bans_reads_the_raw_row_and_agrees_with_the_full_path():
    # SeqSamplingState.plain_greedy: greedy whose only processing is bans takes the raw row's
    # argmax when it is finite and not banned, else the full path. Rows where that matters:
    # the max banned, a banned and an allowed token tied at the max, NaN, +inf, no finite
    # allowed logit (the raw fallback), and plain random rows.
    rng = np.random.default_rng(3)
    rows = [rng.standard_normal(64).astype(np.float32) for _ in range(20)]
    r = rng.standard_normal(64).astype(np.float32); r[5] = 9.0; rows.append(r)       # banned max
    r = rng.standard_normal(64).astype(np.float32); r[5] = r[9] = 9.0; rows.append(r)  # tie
    r = rng.standard_normal(64).astype(np.float32); r[[3, 20]] = np.nan; rows.append(r)
    r = rng.standard_normal(64).astype(np.float32); r[30] = np.inf; rows.append(r)
    r = np.full(64, -np.inf, np.float32); r[5] = 1.0; rows.append(r)                 # fallback
    for kw in (dict(ignore_eos=True), dict(logit_bias={5: -100, 7: -100}),
               dict(ignore_eos=True, logit_bias={5: -100}), dict()):
        for row in rows:
            fast = SeqSamplingState(SamplingParams(temperature=0.0, **kw), eos_token_ids=[5])
            full = SeqSamplingState(SamplingParams(temperature=0.0, **kw), eos_token_ids=[5])
            assert fast.plain_greedy
            full.plain_greedy = False
            got = Sampler().sample(row[None], [fast])
            want = Sampler().sample(row[None], [full])
            assert got.tokens[0] == want.tokens[0] and got.errors == want.errors, (kw, row)
    # anything more than bans takes the full path
    for kw in (dict(logit_bias={5: 2.0}), dict(repeat_penalty=1.1), dict(logprobs=0),
               dict(frequency_penalty=0.5), dict(temperature=0.7)):
        assert not SeqSamplingState(SamplingParams(**{"temperature": 0.0, **kw})).plain_greedy


@pytest.mark.parametrize("kw", [dict(), dict(temperature=2.0), dict(temperature=0.0),
                                dict(temperature=1.5, top_p=0.9, min_p=0.01), dict(top_k=2)])
def test_all_banned_falls_back_to_raw_argmax(kw):
    # Issue 18: the fallback used to sample the raw row at the request's temperature, so
    # tokens 0 and 2 came out with their raw probabilities (0.9% at T=0.8, 21% at T=2).
    # 2,000 seeds: a sampling fallback would fail here with probability > 1 - 1e-7.
    logits = np.array([[0.0, 5.0, 1.0]], dtype=np.float32)
    s = Sampler()
    for seed in range(2000):
        st = SeqSamplingState(SamplingParams(logit_bias={0: -100, 1: -100, 2: -100}, seed=seed,
                                             **kw))
        assert s.sample(logits, [st]).tokens[0] == 1, seed
    # Random seeds too (the issue's own form), and a large flat row where a sampled
    # fallback would almost never hit the argmax.
    for _ in range(500):
        st = SeqSamplingState(SamplingParams(logit_bias={0: -100, 1: -100, 2: -100}, **kw))
        assert s.sample(logits, [st]).tokens[0] == 1
    row = np.random.default_rng(11).standard_normal((1, 5000)).astype(np.float32)
    ban = {i: -100 for i in range(5000)}
    for seed in range(50):
        res = Sampler().sample(row, [SeqSamplingState(SamplingParams(logit_bias=ban, seed=seed,
                                                                     logprobs=0, **kw))])
        assert res.tokens[0] == row.argmax() and res.errors == [None]
        # logprob of the raw row (the fallback's distribution): finite, <= 0
        want = row[0, row.argmax()] - np.log(np.exp(row[0].astype(np.float64)).sum())
        assert res.logprobs[0] == pytest.approx(want, abs=1e-5)


def test_fallback_draws_nothing_from_the_generator():
    st = SeqSamplingState(SamplingParams(logit_bias={0: -100, 1: -100}, seed=5))
    Sampler().sample(np.array([[1.0, 2.0]], np.float32), [st])
    assert st.rng.random() == SeqSamplingState(SamplingParams(seed=5)).rng.random()


# --- non-finite logits and other edges ---------------------------------------------------

@pytest.mark.parametrize("kw", [dict(temperature=0.0), dict(), dict(temperature=2.0),
                                dict(top_k=3), dict(top_p=0.5), dict(min_p=0.2)])
def test_nan_logits_are_never_chosen(kw):
    logits = np.array([[np.nan, 1.0, np.nan, 0.5, np.nan]], np.float32)
    s = Sampler()
    seen = set()
    for seed in range(300):
        res = s.sample(logits, [SeqSamplingState(SamplingParams(seed=seed, logprobs=5, **kw))])
        t = int(res.tokens[0])
        seen.add(t)
        assert t in (1, 3) and np.isfinite(res.logprobs[0]) and res.logprobs[0] <= 0
        assert {i for i, _ in res.top_logprobs[0]} == {1, 3}
    assert kw.get("temperature", 0.8) == 0.0 or kw == dict(top_p=0.5) or seen == {1, 3}
    assert not np.isnan(logits[0, [1, 3]]).any()  # input untouched


def test_plus_inf_logits_share_the_mass():
    logits = np.array([[3.0, np.inf, 1.0, np.inf, -np.inf]], np.float32)
    s = Sampler()
    assert s.sample(logits, [SeqSamplingState(SamplingParams(temperature=0.0))]).tokens[0] == 1
    toks = [int(s.sample(logits, [SeqSamplingState(SamplingParams(seed=i, logprobs=0))]).tokens[0])
            for i in range(400)]
    assert set(toks) == {1, 3} and 140 < toks.count(1) < 260
    res = s.sample(logits, [SeqSamplingState(SamplingParams(seed=0, logprobs=4))])
    assert res.logprobs[0] == pytest.approx(-math.log(2))
    assert [i for i, _ in res.top_logprobs[0]] == [1, 3]
    # a ban on a +inf token wins (inf + -inf is NaN, which counts as -inf)
    st = SeqSamplingState(SamplingParams(temperature=0.0, logit_bias={1: -100}))
    assert s.sample(logits, [st]).tokens[0] == 3


@pytest.mark.parametrize("bad", [np.nan, -np.inf])
def test_row_without_any_finite_logit_is_an_error_not_a_token(bad):
    logits = np.array([[bad] * 4, [0.0, 1.0, 3.0, 2.0]], np.float32)
    logits[0, 1] = -np.inf
    states = [SeqSamplingState(SamplingParams(seed=1, logprobs=2)),
              SeqSamplingState(SamplingParams(temperature=0.0))]
    res = Sampler().sample(logits, states)
    assert res.tokens.tolist() == [-1, 2]
    assert res.errors[0] and "finite" in res.errors[0] and res.errors[1] is None
    assert np.isnan(res.logprobs[0]) and res.top_logprobs[0] == []


def test_tiny_temperature_is_greedy():
    rng = np.random.default_rng(12)
    s = Sampler()
    for temp in (1e-45, 1e-39, 2.0 ** -128):
        for i in range(50):
            logits = rng.standard_normal((1, 300)).astype(np.float32)
            logits[0, i % 3] = 9.0        # the max at the start, where a NaN weight hid it
            st = SeqSamplingState(SamplingParams(temperature=temp, seed=i))
            assert s.sample(logits, [st]).tokens[0] == i % 3
    # ties go to the lower id, as greedy does (weights of NaN used to pick the last one)
    logits = np.array([[0.0, 4.0, 1.0, 4.0]], np.float32)
    for temp in (1e-45, 2.0 ** -128):
        st = SeqSamplingState(SamplingParams(temperature=temp, seed=0))
        assert s.sample(logits, [st]).tokens[0] == 1
    # the smallest temperature that still samples is exact: it is greedy in effect
    logits = np.array([[1.0, 1.0 - 1e-6, 0.0]], np.float32)
    st = SeqSamplingState(SamplingParams(temperature=2.0 ** -127, seed=3))
    assert all(s.sample(logits, [st]).tokens[0] == 0 for _ in range(50))


@pytest.mark.parametrize("kw", [dict(temperature=0.0), dict(), dict(top_k=1), dict(top_k=5),
                                dict(top_p=0.0), dict(top_p=0.3), dict(min_p=1.0)])
def test_vocab_of_one(kw):
    res = Sampler().sample(np.array([[-3.0]], np.float32),
                           [SeqSamplingState(SamplingParams(seed=0, logprobs=3, **kw))])
    assert res.tokens.tolist() == [0] and res.logprobs[0] == 0.0
    assert res.top_logprobs == [[(0, 0.0)]]


@pytest.mark.parametrize("kw", [dict(top_p=0.0), dict(min_p=1.0), dict(top_k=1, top_p=0.0)])
def test_strictest_truncation_keeps_the_max(kw):
    row = _row("flat")          # many tokens near the max: the bucketed top-p path too
    best = int(row.argmax())
    toks = draw(row, 20, temperature=1.0, **kw)
    assert (toks == best).all()


def test_top_logprobs_list_only_possible_tokens():
    logits = np.array([[1.0, 2.0, 3.0, 0.5]], np.float32)
    st = SeqSamplingState(SamplingParams(temperature=0.0, logprobs=4, logit_bias={2: -100, 3: -100}))
    res = Sampler().sample(logits, [st])
    assert [i for i, _ in res.top_logprobs[0]] == [1, 0]
    assert all(np.isfinite(v) for _, v in res.top_logprobs[0])


# --- temperature and the draw ------------------------------------------------------------

@pytest.mark.parametrize("temp", [0.5, 1.0, 1.7])
def test_temperature_scales_distribution(temp):
    logits = np.array([0.0, 1.0, 2.0, 2.5, -1.0], dtype=np.float32)
    n = 20000
    toks = draw(logits, n, temperature=temp, seed=42)
    freq = np.bincount(toks, minlength=5) / n
    want = softmax(logits.astype(np.float64) / temp)
    # 4.5 sigma of a binomial proportion: fails only on a real bias, not on noise
    tol = 4.5 * np.sqrt(want * (1 - want) / n) + 1e-3
    assert np.all(np.abs(freq - want) <= tol), (freq, want)


def test_categorical_block_path_matches_plain_cumsum():
    rng = np.random.default_rng(7)
    w = rng.random(50_001).astype(np.float32) ** 4
    w[rng.random(w.size) < 0.3] = 0.0
    cum = np.cumsum(w, dtype=np.float64)
    for u in rng.random(300):
        want = min(int(np.searchsorted(cum, u * cum[-1], side="right")), w.size - 1)
        got = _categorical(w, float(u))
        # The two-level sum differs from the flat one only by rounding near an edge.
        assert got == want or abs(cum[got] - cum[want]) <= 1e-6 * cum[-1]
        assert w[got] > 0


def test_large_vocab_sampling_without_truncation_follows_distribution():
    rng = np.random.default_rng(8)
    row = (rng.standard_normal(262144) * 0.5).astype(np.float32)
    row[:3] = [9.0, 8.0, 7.0]  # three heavy tokens and a long light tail
    n = 3000
    toks = draw(row, n, temperature=1.0, seed=3)
    pr = softmax(row.astype(np.float64))
    for t in range(3):
        tol = 4.5 * math.sqrt(pr[t] * (1 - pr[t]) / n)
        assert abs((toks == t).mean() - pr[t]) <= tol
    tail = pr[3:].sum()
    assert abs((toks >= 3).mean() - tail) <= 4.5 * math.sqrt(tail * (1 - tail) / n)


# --- logprobs -----------------------------------------------------------------------------

def test_logprobs_after_penalties_before_temperature():
    logits = np.random.default_rng(9).standard_normal((2, 500)).astype(np.float32)
    p = SamplingParams(temperature=0.7, top_k=5, logprobs=3, logit_bias={4: 2.0}, seed=1)
    states = [SeqSamplingState(p), SeqSamplingState(SamplingParams(temperature=0.0))]
    res = Sampler().sample(logits, states)
    processed = logits[0].astype(np.float64).copy()
    processed[4] += 2.0
    lp = np.log(softmax(processed))
    assert res.logprobs[0] == pytest.approx(lp[res.tokens[0]], abs=1e-5)
    assert np.isnan(res.logprobs[1]) and res.top_logprobs[1] == []
    top = res.top_logprobs[0]
    assert [t for t, _ in top] == np.argsort(-lp)[:3].tolist()
    np.testing.assert_allclose([v for _, v in top], np.sort(lp)[::-1][:3], atol=1e-5)


# --- validation ---------------------------------------------------------------------------

@pytest.mark.parametrize("kw, msg", [
    (dict(temperature=2.5), "temperature must be between 0 and 2"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_k=-1), "top_k"),
    (dict(top_k=2.5), "top_k"),
    (dict(top_p=1.5), "top_p must be between 0 and 1"),
    (dict(min_p=-0.1), "min_p"),
    (dict(repeat_penalty=0.0), "repeat_penalty"),
    (dict(repeat_last_n=-2), "repeat_last_n"),
    (dict(frequency_penalty=2.1), "frequency_penalty must be between -2 and 2"),
    (dict(presence_penalty=-3), "presence_penalty"),
    (dict(logit_bias={5: 101}), "logit_bias values"),
    (dict(logit_bias={-1: 1.0}), "logit_bias keys"),
    (dict(logit_bias={"x": 1.0}), "logit_bias keys"),
    (dict(seed=1.5), "seed"),
    (dict(seed=True), "seed"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(stop=("ok", "")), "stop"),
    (dict(stop=[1]), "stop"),
    (dict(stop_token_ids=[-3]), "stop_token_ids"),
    (dict(n=0), "n must be between 1"),
    (dict(logprobs=21), "logprobs must be between 0 and 20"),
    (dict(ignore_eos="yes"), "ignore_eos"),
])
def test_validation_errors_name_the_field(kw, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**kw)


def test_validate_against_vocab_and_lenient_shapes():
    p = SamplingParams(stop="###", stop_token_ids=[1, 2], logit_bias={"10": -5})
    assert p.stop == ("###",) and p.stop_token_ids == (1, 2) and p.logit_bias == {10: -5}
    p.validate(vocab_size=100)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        p.validate(vocab_size=10)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=(50,)).validate(vocab_size=20)
    with pytest.raises(Exception):
        p.temperature = 1.0  # frozen


# --- token masks (structured output) ------------------------------------------------------

def _mask(vocab: int, allowed) -> np.ndarray:
    m = np.zeros(vocab, dtype=bool)
    m[list(allowed)] = True
    return m


@pytest.mark.parametrize("kw", [dict(temperature=0.0), dict(), dict(temperature=2.0),
                                dict(top_k=1), dict(top_k=3), dict(top_p=0.5), dict(min_p=0.5),
                                dict(temperature=1.3, top_k=40, top_p=0.9, min_p=0.01)])
def test_mask_restricts_tokens_before_everything_else(kw):
    rng = np.random.default_rng(13)
    logits = (rng.standard_normal((1, 3000)) * 3).astype(np.float32)
    allowed = rng.choice(3000, 40, replace=False)
    mask = _mask(3000, allowed)
    best_allowed = int(allowed[np.argmax(logits[0, allowed])])
    assert best_allowed != int(logits.argmax())
    s = Sampler()
    seen = set()
    for seed in range(200):
        t = int(s.sample(logits, [SeqSamplingState(SamplingParams(seed=seed, **kw))],
                         [mask]).tokens[0])
        assert mask[t]
        seen.add(t)
    # step 0 comes first: top_k 1 / greedy give the best *allowed* token, not nothing
    if kw.get("temperature", 0.8) == 0.0 or kw.get("top_k") == 1:
        assert seen == {best_allowed}
    elif kw == dict(temperature=2.0):
        assert len(seen) > 10              # the whole allowed set is in play


def test_mask_on_large_vocab_sampling_paths():
    row = _row("flat")[None, :]        # bucketed top-p and min-p drop paths, 262k vocab
    rng = np.random.default_rng(14)
    mask = rng.random(row.shape[1]) < 0.5
    s = Sampler()
    for kw in (dict(top_p=0.9), dict(min_p=0.05), dict(), dict(top_p=0.95, min_p=0.01)):
        for seed in range(20):
            t = int(s.sample(row, [SeqSamplingState(SamplingParams(seed=seed, temperature=1.0,
                                                                   **kw))], [mask]).tokens[0])
            assert mask[t]
    # greedy over a 262k masked row
    st = SeqSamplingState(SamplingParams(temperature=0.0))
    want = int(np.flatnonzero(mask)[np.argmax(row[0, mask])])
    assert s.sample(row, [st], [mask]).tokens[0] == want


def test_empty_mask_is_a_row_error_and_other_rows_are_unaffected():
    logits = np.random.default_rng(15).standard_normal((3, 100)).astype(np.float32)
    params = [SamplingParams(seed=1, logprobs=2), SamplingParams(seed=2, logprobs=2),
              SamplingParams(temperature=0.0, logprobs=1)]
    masks = [None, np.zeros(100, bool), _mask(100, [7, 9])]
    res = Sampler().sample(logits, [SeqSamplingState(p) for p in params], masks)
    assert res.tokens[1] == -1 and "allows no token" in res.errors[1]
    assert res.errors[0] is None and res.errors[2] is None
    assert np.isnan(res.logprobs[1]) and res.top_logprobs[1] == []
    for b in (0, 2):
        alone = Sampler().sample(logits[b:b + 1], [SeqSamplingState(params[b])], [masks[b]])
        assert alone.tokens[0] == res.tokens[b]
        assert alone.logprobs[0] == res.logprobs[b]
        assert alone.top_logprobs[0] == res.top_logprobs[b]


def test_bias_banning_every_allowed_token_falls_back_to_best_allowed_raw():
    logits = np.array([[9.0, 1.0, 3.0, 2.0, 8.0]], np.float32)
    mask = _mask(5, [1, 2, 3])
    s = Sampler()
    for kw in (dict(), dict(temperature=2.0), dict(temperature=0.0), dict(top_k=2)):
        for seed in range(300):
            st = SeqSamplingState(SamplingParams(seed=seed, logprobs=1,
                                                 logit_bias={1: -100, 2: -100, 3: -100}, **kw))
            res = s.sample(logits, [st], [mask])
            assert res.tokens[0] == 2 and res.errors == [None]   # never 0 or 4 (masked)
    # its logprob is of the masked raw distribution
    want = 3.0 - math.log(math.exp(1) + math.exp(3) + math.exp(2))
    assert res.logprobs[0] == pytest.approx(want, abs=1e-6)
    assert [i for i, _ in res.top_logprobs[0]] == [2]
    # a ban of only some allowed tokens is an ordinary ban
    st = SeqSamplingState(SamplingParams(temperature=0.0, logit_bias={2: -100}))
    assert s.sample(logits, [st], [mask]).tokens[0] == 3


def test_mask_whose_allowed_tokens_have_no_finite_logit_is_an_error():
    logits = np.array([[5.0, -np.inf, np.nan, 1.0]], np.float32)
    st = SeqSamplingState(SamplingParams(seed=0, logit_bias={1: -100}))
    res = Sampler().sample(logits, [st], [_mask(4, [1, 2])])
    assert res.tokens[0] == -1 and "finite" in res.errors[0]
    # NaN among allowed tokens: the finite allowed one is chosen
    res = Sampler().sample(logits, [SeqSamplingState(SamplingParams(temperature=0.0))],
                           [_mask(4, [2, 3])])
    assert res.tokens[0] == 3


def test_logprobs_with_a_mask_are_of_the_masked_distribution():
    rng = np.random.default_rng(16)
    logits = rng.standard_normal((1, 500)).astype(np.float32)
    allowed = [3, 50, 77, 120, 400]
    p = SamplingParams(temperature=0.9, logprobs=10, logit_bias={50: 1.5}, seed=2)
    res = Sampler().sample(logits, [SeqSamplingState(p)], [_mask(500, allowed)])
    x = logits[0].astype(np.float64)
    x[50] += 1.5
    lp = x[allowed] - np.log(np.exp(x[allowed]).sum())
    lp_of = dict(zip(allowed, lp))
    assert res.tokens[0] in allowed
    assert res.logprobs[0] == pytest.approx(lp_of[int(res.tokens[0])], abs=1e-5)
    top = res.top_logprobs[0]
    assert [t for t, _ in top] == [allowed[i] for i in np.argsort(-lp)]   # only allowed, 5
    np.testing.assert_allclose([v for _, v in top], np.sort(lp)[::-1], atol=1e-5)


def test_constrained_greedy_and_seeded_output_is_batch_invariant():
    rng = np.random.default_rng(17)
    vocab, steps = 800, 15
    params = [SamplingParams(temperature=0.0, repeat_penalty=1.3),
              SamplingParams(temperature=0.9, top_p=0.9, seed=4, logprobs=2),
              SamplingParams(temperature=0.0, logit_bias={5: 3.0}),
              SamplingParams(temperature=1.1, min_p=0.05, seed=8)]
    rows = (rng.standard_normal((steps, len(params), vocab)) * 2).astype(np.float32)
    masks = rng.random((steps, len(params), vocab)) < 0.2
    masked = [True, True, False, True]          # row 2 has no mask: mixed batches
    batched = [SeqSamplingState(p, prompt_ids=[1, 2]) for p in params]
    alone = [SeqSamplingState(p, prompt_ids=[1, 2]) for p in params]
    s_batch, s_alone = Sampler(), Sampler()
    for t in range(steps):
        mk = [masks[t, b] if masked[b] else None for b in range(len(params))]
        res = s_batch.sample(rows[t], batched, mk)
        for b, st in enumerate(alone):
            one = s_alone.sample(rows[t, b:b + 1], [st], [mk[b]])
            assert one.tokens[0] == res.tokens[b]
            assert one.logprobs[0] == res.logprobs[b] or np.isnan(res.logprobs[b])
            if mk[b] is not None:
                assert mk[b][res.tokens[b]]
            st.append(int(one.tokens[0]))
            batched[b].append(int(res.tokens[b]))


def test_no_masks_and_all_none_masks_agree_and_inputs_are_untouched():
    logits = np.random.default_rng(18).standard_normal((2, 300)).astype(np.float32)
    before = logits.copy()
    mask = _mask(300, range(0, 300, 3))
    mask_before = mask.copy()
    p = SamplingParams(seed=9, logprobs=3, repeat_penalty=1.2, logit_bias={4: -100})
    a = Sampler().sample(logits, [SeqSamplingState(p, prompt_ids=[3, 6]) for _ in range(2)])
    b = Sampler().sample(logits, [SeqSamplingState(p, prompt_ids=[3, 6]) for _ in range(2)],
                         [None, None])
    assert a.tokens.tolist() == b.tokens.tolist() and a.errors == b.errors == [None, None]
    Sampler().sample(logits, [SeqSamplingState(p, prompt_ids=[3, 6]) for _ in range(2)],
                     [mask, mask])
    assert np.array_equal(logits, before) and np.array_equal(mask, mask_before)


@pytest.mark.parametrize("bad", [np.ones(299, bool), np.ones(300, np.int8), [True] * 300,
                                 np.ones((1, 300), bool)])
def test_bad_masks_are_refused(bad):
    logits = np.zeros((1, 300), np.float32)
    with pytest.raises(ValueError, match="token mask"):
        Sampler().sample(logits, [SeqSamplingState(SamplingParams())], [bad])
    with pytest.raises(ValueError, match="masks"):
        Sampler().sample(logits, [SeqSamplingState(SamplingParams())], [None, None])


@pytest.mark.parametrize("temp", [0.6, 1.4])
def test_masked_sampling_follows_the_masked_distribution(temp):
    logits = np.array([[2.0, 0.5, 3.0, 1.0, -0.5, 2.5]], np.float32)
    allowed = [0, 1, 3, 4]
    mask = _mask(6, allowed)
    n = 20000
    st = SeqSamplingState(SamplingParams(temperature=temp, seed=21))
    s = Sampler()
    toks = np.array([s.sample(logits, [st], [mask]).tokens[0] for _ in range(n)])
    freq = np.bincount(toks, minlength=6) / n
    want = np.zeros(6)
    want[allowed] = softmax(logits[0, allowed].astype(np.float64) / temp)
    tol = 4.5 * np.sqrt(want * (1 - want) / n) + 1e-3
    assert np.all(np.abs(freq - want) <= tol), (freq, want)


class _Pieces:
    """A vocabulary table: piece(t) and piece_table() agree, as Tokenizer's do."""

    def __init__(self, pieces):
        self._p = list(pieces)
        self.vocab_size = len(self._p)

    def piece(self, t, render_special=False):
        return self._p[t]

    def piece_table(self, render_special=False):
        return self._p


def test_breaker_ids_search_the_joined_vocabulary_as_a_token_by_token_pass_would():
    """DRY's breakers resolve in one search of the joined pieces: the same ids as asking each
    piece, with hits across a piece boundary refused, overlapping and repeated needles,
    multi-byte UTF-8 and empty pieces."""
    from edgeinfer.runners.sampling_params import breaker_ids
    rng = np.random.default_rng(7)
    alphabet = [b"a", b"b", b":", b"\n", b"\xc3\xa9", b"aa", b"*", b" the"]
    pieces = [b"".join(rng.choice(alphabet, size=rng.integers(0, 5))) for _ in range(3000)]
    pieces[10:14] = [b"x a", b"ab", b"", b"a"]          # "aa", "ab" across boundaries
    tok = _Pieces(pieces)
    for needles in (["\n", ":", "\"", "*"], ["aa"], ["ab", "é", "the"], ["é:"], ["zz"]):
        want = tuple(t for t in range(len(pieces))
                     if any(n.encode() in pieces[t] for n in needles))
        assert breaker_ids(tok, needles) == want, needles


def test_breaker_ids_make_one_pass_however_many_ask_at_once():
    """A load's or first request's pass and a DRY request's wait for one answer: the
    vocabulary is searched once (each pass holds the GIL ~0.1 s for 151k tokens)."""
    import threading
    from edgeinfer.runners.sampling_params import breaker_ids

    class Vocab:
        passes = 0

        def piece_table(self, render_special):
            Vocab.passes += 1
            threading.Event().wait(0.05)       # a pass long enough for the others to arrive
            return [b"a", b"\n", b"b:", b"c"] * 1000

    tok = Vocab()
    results = []
    threads = [threading.Thread(target=lambda: results.append(breaker_ids(tok, ["\n", ":"])))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert Vocab.passes == 1
    assert len(set(results)) == 1 and len(results[0]) == 2000


def test_a_chat_models_first_request_does_not_wait_for_drys_breakers(monkeypatch):
    """Only a base model (DRY on by its defaults) looks its breakers up while its prompt is
    encoded; a chat model's prompt goes to the engine first (server/generation.py), unless
    its vocabulary is asked token by token (seconds: never on the event loop)."""
    import asyncio
    from types import SimpleNamespace
    from edgeinfer.server import generation

    looked_up = []
    monkeypatch.setattr(generation, "breaker_ids", lambda tok, b: looked_up.append(tok))
    table = SimpleNamespace(piece=lambda i, r=False: b"x", piece_table=lambda r: [b"x"])
    by_pipe = SimpleNamespace(piece=lambda i, r=False: b"x")    # llama.cpp's, token by token
    for own_template, tok, expected in ((True, table, 0), (False, table, 1),
                                        (True, by_pipe, 1)):
        looked_up.clear()
        engine = SimpleNamespace(tokenizer=tok, has_own_template=own_template)
        gen = generation.Generation.__new__(generation.Generation)
        gen.lm = SimpleNamespace(engine=engine)
        assert asyncio.run(gen.encode(lambda e: [1, 2, 3])) == [1, 2, 3]
        assert len(looked_up) == expected, own_template


def test_distinct_is_np_unique():
    """The repeat window's distinct ids (sampling._distinct, which leaves numpy.ma
    unimported) are np.unique's: sorted, each once, the same dtype."""
    from edgeinfer.runners.sampling import _distinct
    rng = np.random.default_rng(3)
    for n in (0, 1, 2, 7, 64, 4096):
        for dtype in (np.int32, np.int64):
            a = rng.integers(0, max(1, n // 3), n).astype(dtype)
            got, want = _distinct(a), np.unique(a)
            assert got.dtype == want.dtype and np.array_equal(got, want), (n, dtype)
