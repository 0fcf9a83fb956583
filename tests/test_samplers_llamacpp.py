"""DRY, XTC, typical-p and mirostat against llama.cpp's own samplers (libllama through
llama-cpp-python's ctypes handle) where their behaviour is deterministic, and against plain
reference implementations of the documented algorithms where it is not (random draws)."""
from __future__ import annotations

import ctypes
import math

import numpy as np
import pytest

from edgeinfer.runners import sampling as S
from edgeinfer.runners import sampling_params as P
from edgeinfer.runners.sampling_params import SamplingParams
from edgeinfer.runners.sampling import Sampler, SeqSamplingState

L = pytest.importorskip("llama_cpp")
lib = L.llama_cpp._lib

# Our own prototypes for the few entry points used (the binding's may lag the library).
lib.llama_sampler_init_dry.restype = ctypes.c_void_p
# (vocab, multiplier, base, allowed_length, penalty_last_n, breakers, n_breakers) in the
# llama.cpp that llama-cpp-python 0.3.36 ships; with no vocab, -1 ("the context") means 0
lib.llama_sampler_init_dry.argtypes = [ctypes.c_void_p, ctypes.c_float, ctypes.c_float,
                                       ctypes.c_int32, ctypes.c_int32,
                                       ctypes.POINTER(ctypes.c_char_p), ctypes.c_size_t]
lib.llama_sampler_init_typical.restype = ctypes.c_void_p
lib.llama_sampler_init_typical.argtypes = [ctypes.c_float, ctypes.c_size_t]
lib.llama_sampler_init_top_p.restype = ctypes.c_void_p
lib.llama_sampler_init_top_p.argtypes = [ctypes.c_float, ctypes.c_size_t]
lib.llama_sampler_init_min_p.restype = ctypes.c_void_p
lib.llama_sampler_init_min_p.argtypes = [ctypes.c_float, ctypes.c_size_t]
lib.llama_sampler_init_top_k.restype = ctypes.c_void_p
lib.llama_sampler_init_top_k.argtypes = [ctypes.c_int32]
lib.llama_sampler_init_xtc.restype = ctypes.c_void_p
lib.llama_sampler_init_xtc.argtypes = [ctypes.c_float, ctypes.c_float, ctypes.c_size_t,
                                       ctypes.c_uint32]
lib.llama_sampler_init_mirostat_v2.restype = ctypes.c_void_p
lib.llama_sampler_init_mirostat_v2.argtypes = [ctypes.c_uint32, ctypes.c_float, ctypes.c_float]
lib.llama_sampler_apply.restype = None
lib.llama_sampler_apply.argtypes = [ctypes.c_void_p, ctypes.POINTER(L.llama_token_data_array)]
lib.llama_sampler_accept.restype = None
lib.llama_sampler_accept.argtypes = [ctypes.c_void_p, ctypes.c_int32]
lib.llama_sampler_free.restype = None
lib.llama_sampler_free.argtypes = [ctypes.c_void_p]


def llama_apply(samplers, logits) -> tuple[dict[int, float], int]:
    """Apply llama.cpp samplers in order to a row; returns ({id: logit} of what is left,
    selected index or -1). Frees the samplers."""
    n = len(logits)
    data = (L.llama_token_data * n)(*[L.llama_token_data(i, float(x), 0.0)
                                      for i, x in enumerate(logits)])
    arr = L.llama_token_data_array(data=ctypes.cast(data, ctypes.POINTER(L.llama_token_data)),
                                   size=n, selected=-1, sorted=False)
    try:
        for smpl in samplers:
            lib.llama_sampler_apply(smpl, ctypes.byref(arr))
        left = {arr.data[i].id: arr.data[i].logit for i in range(arr.size)}
        sel = arr.data[arr.selected].id if arr.selected >= 0 else -1
        return left, sel
    finally:
        for smpl in samplers:
            lib.llama_sampler_free(smpl)


def rows(n, vocab, seed, scale=3.0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(vocab) * scale).astype(np.float32) for _ in range(n)]


# ----- typical-p, top-p, min-p on the general path ------------------------------------------

@pytest.mark.parametrize("typ", [0.2, 0.5, 0.9, 0.99])
def test_typical_matches_llamacpp(typ):
    for row in rows(20, 64, seed=int(typ * 100)):
        want, _ = llama_apply([lib.llama_sampler_init_typical(typ, 1)], row)
        got = S.truncate_ext(row, SamplingParams(typical_p=typ, temperature=1.0))
        assert sorted(want) == got.tolist()


@pytest.mark.parametrize("k,typ,top_p,min_p", [(0, 0.7, 0.9, 0.0), (20, 0.8, 0.95, 0.05),
                                               (10, 0.5, 1.0, 0.1), (0, 0.95, 0.5, 0.02)])
def test_chain_top_k_typical_top_p_min_p_matches_llamacpp(k, typ, top_p, min_p):
    for row in rows(20, 80, seed=k + 7):
        chain = []
        if k:
            chain.append(lib.llama_sampler_init_top_k(k))
        chain.append(lib.llama_sampler_init_typical(typ, 1))
        if top_p < 1:
            chain.append(lib.llama_sampler_init_top_p(top_p, 1))
        if min_p:
            chain.append(lib.llama_sampler_init_min_p(min_p, 1))
        want, _ = llama_apply(chain, row)
        got = S.truncate_ext(row, SamplingParams(top_k=k, typical_p=typ, top_p=top_p,
                                                 min_p=min_p, temperature=1.0))
        assert sorted(want) == got.tolist()


@pytest.mark.parametrize("typ,xtc", [(0.9, None), (0.5, None), (1.0, 0.05), (0.95, 0.1)])
def test_large_vocabulary_differs_from_llamacpp_only_in_a_negligible_tail(typ, xtc):
    # above 4,096 tokens the general path leaves out a tail of at most 1e-6 of the mass;
    # llama.cpp sums 100k float32 probabilities, so its cut points move by ~1e-4 of the mass
    row = rows(1, 100_000, seed=42, scale=3.0)[0]
    chain = [lib.llama_sampler_init_typical(typ, 1)] if typ < 1 else []
    if xtc:
        chain.append(lib.llama_sampler_init_xtc(1.0, xtc, 0, 1))
    want, _ = llama_apply(chain, row)
    got = S.truncate_ext(row, SamplingParams(typical_p=typ, temperature=1.0,
                                             xtc_probability=1.0 if xtc else 0.0,
                                             xtc_threshold=xtc or 0.1), xtc_draw=0.5)
    pr = np.exp(row.astype(np.float64) - row.max())
    pr /= pr.sum()
    diff = np.setxor1d(np.fromiter(want, np.int64), got)
    assert pr[diff].sum() < 1e-3
    assert len(got) > 100


# ----- XTC ------------------------------------------------------------------------------

@pytest.mark.parametrize("thr", [0.05, 0.1, 0.2, 0.3, 0.5])
def test_xtc_matches_llamacpp_when_it_fires(thr):
    # probability 1: llama.cpp's draw in [0, 1) never exceeds it, so XTC always applies
    for scale in (1.0, 2.0, 4.0):
        for row in rows(10, 40, seed=int(thr * 1000 + scale), scale=scale):
            want, _ = llama_apply([lib.llama_sampler_init_xtc(1.0, thr, 0, 1)], row)
            got = S.truncate_ext(row, SamplingParams(xtc_probability=1.0, xtc_threshold=thr,
                                                     temperature=1.0), xtc_draw=0.5)
            assert sorted(want) == got.tolist()


def test_xtc_skips_when_the_draw_is_above_the_probability_and_past_half():
    row = np.array([5.0, 4.9, 4.8, 0.0, -1.0], np.float32)
    p = SamplingParams(xtc_probability=0.3, xtc_threshold=0.1, temperature=1.0)
    assert S.truncate_ext(row, p, xtc_draw=0.9).tolist() == [0, 1, 2, 3, 4]
    assert S.truncate_ext(row, p, xtc_draw=0.1).tolist() == [2, 3, 4]   # 0 and 1 removed
    off = SamplingParams(xtc_probability=1.0, xtc_threshold=0.6, temperature=1.0)
    assert not off.xtc_on and not off.extended


def test_xtc_never_picks_the_top_tokens_when_always_on():
    row = np.array([6.0, 5.5, 5.0, 1.0, 0.5], np.float32)
    st = SeqSamplingState(SamplingParams(xtc_probability=1.0, xtc_threshold=0.1,
                                         temperature=1.0, seed=3))
    toks = {int(Sampler().sample(row[None], [st]).tokens[0]) for _ in range(200)}
    assert 0 not in toks and 1 not in toks and 2 in toks


# ----- DRY ------------------------------------------------------------------------------

def llama_dry(history, mult, base, allowed, last_n, vocab):
    if last_n == -1:                  # the whole history
        last_n = len(history) + 1
    smpl = lib.llama_sampler_init_dry(None, mult, base, allowed, last_n, None, 0)
    for t in history:
        lib.llama_sampler_accept(smpl, int(t))
    left, _ = llama_apply([smpl], np.zeros(vocab, np.float32))
    return np.array([left[i] for i in range(vocab)], np.float32)


def ours_dry(history, vocab, breakers=(), **kw):
    p = SamplingParams(temperature=0.0, dry_breaker_ids=tuple(breakers), **kw)
    st = SeqSamplingState(p, history)
    return S.process_logits(np.zeros(vocab, np.float32), st).copy()


def test_dry_llamacpp_worked_example():
    a, b, c, y = 0, 1, 2, 3
    hist = [a, b, c, c, b, c, y, a, b, c]
    got = ours_dry(hist, 5, dry_multiplier=0.8, dry_base=1.75, dry_allowed_length=2)
    # c extends a 3-repeat ("a b c" -> c), y a 2-repeat ("b c" -> y), b only a 1-repeat
    assert got[c] == pytest.approx(-0.8 * 1.75)
    assert got[y] == pytest.approx(-0.8)
    assert got[a] == 0 and got[b] == 0 and got[4] == 0
    np.testing.assert_allclose(got, llama_dry(hist, 0.8, 1.75, 2, -1, 5), rtol=1e-6)


@pytest.mark.parametrize("seed", range(12))
def test_dry_matches_llamacpp_on_repetitive_histories(seed):
    rng = np.random.default_rng(seed)
    vocab = 6
    # a repeated phrase with noise: long matches, overlapping matches, runs of one token
    phrase = rng.integers(0, vocab, rng.integers(2, 9))
    hist = np.concatenate([phrase] * int(rng.integers(2, 6)) + [rng.integers(0, vocab, 5)]
                          + [phrase[:int(rng.integers(1, len(phrase) + 1))]])
    if seed % 3 == 0:
        hist = np.concatenate([hist, np.full(int(rng.integers(3, 30)), 2)])
    mult, base = float(rng.uniform(0.3, 2)), float(rng.uniform(1.1, 3))
    allowed = int(rng.integers(0, 4))
    last_n = int(rng.choice([-1, 0, 5, 17, 1000]))
    want = llama_dry(hist.tolist(), mult, base, allowed, last_n, vocab)
    got = ours_dry(hist.tolist(), vocab, dry_multiplier=mult, dry_base=base,
                   dry_allowed_length=allowed, dry_penalty_last_n=last_n)
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_dry_huge_repeat_is_clamped_finite_and_matches_llamacpp():
    hist = [1] * 3000
    got = ours_dry(hist, 4, dry_multiplier=1.0, dry_base=1.75, dry_allowed_length=2)
    assert np.isfinite(got).all() and got[1] < -1e30
    np.testing.assert_allclose(got, llama_dry(hist, 1.0, 1.75, 2, -1, 4), rtol=1e-5)


def brute_dry(hist, mult, base, allowed, breakers):
    """Reference: for each earlier end position, the longest common suffix with the
    history that does not reach a breaker token; penalize the following token."""
    n = len(hist)
    limit = n
    for i in range(n):
        if hist[n - 1 - i] in breakers:
            limit = i
            break
    best: dict[int, int] = {}
    for j in range(n - 1):
        m = 0
        while m <= j and hist[j - m] == hist[n - 1 - m]:
            m += 1
        m = min(m, limit)
        if m >= allowed:
            t = hist[j + 1]
            best[t] = max(best.get(t, -1), m)
    return {t: mult * base ** (m - allowed) for t, m in best.items() if t not in breakers}


@pytest.mark.parametrize("seed", range(8))
def test_dry_sequence_breakers_against_reference(seed):
    rng = np.random.default_rng(100 + seed)
    vocab, breakers = 5, {4}
    phrase = rng.integers(0, vocab, 6)
    hist = np.concatenate([phrase, phrase, phrase[:4]]).tolist()
    got = ours_dry(hist, vocab, breakers, dry_multiplier=1.0, dry_base=2.0,
                   dry_allowed_length=1)
    ref = brute_dry(hist, 1.0, 2.0, 1, breakers)
    want = np.zeros(vocab, np.float32)
    for t, pen in ref.items():
        want[t] -= pen
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_dry_breaker_ids_from_a_vocabulary():
    class Tok:
        vocab_size = 5
        pieces = [b"hello", b"a:b", b"\n\n", b"x", b"<eos>"]

        def piece(self, t, special=False):
            return self.pieces[t]
    assert P.breaker_ids(Tok(), ("\n", ":")) == (1, 2)
    p = P.with_vocabulary(SamplingParams(dry_multiplier=0.5, dry_sequence_breakers=["x"]),
                          Tok())
    assert p.dry_breaker_ids == (3,)
    off = SamplingParams()
    assert P.with_vocabulary(off, Tok()) is off


def test_dry_stops_a_greedy_loop():
    # greedy on logits that always prefer continuing the loop 0 1 2 0 1 2 ...
    vocab = 8
    base_logits = np.zeros(vocab, np.float32)
    base_logits[3:] = 1.0                         # other text: 1 below the loop's token
    st = SeqSamplingState(SamplingParams(temperature=0.0, dry_multiplier=0.8,
                                         dry_allowed_length=2), [0, 1, 2, 0, 1, 2, 0])
    sampler = Sampler()
    out = []
    for _ in range(12):
        row = base_logits.copy()
        row[(st.history[-1] + 1) % 3] = 2.0        # the model wants the loop
        t = int(sampler.sample(row[None], [st]).tokens[0])
        st.append(t)
        out.append(t)
    assert any(t >= 3 for t in out)               # DRY broke out of the loop
    plain = SeqSamplingState(SamplingParams(temperature=0.0), [0, 1, 2, 0, 1, 2, 0])
    row = base_logits.copy()
    row[1] = 2.0
    assert int(sampler.sample(row[None], [plain]).tokens[0]) == 1    # without DRY: loops


def test_dry_validation():
    for bad in (dict(dry_multiplier=-1), dict(dry_base=0.5), dict(dry_allowed_length=-1),
                dict(dry_penalty_last_n=-2), dict(dry_sequence_breakers=[""]),
                dict(dry_sequence_breakers=["x"] * 65), dict(typical_p=1.5),
                dict(xtc_probability=2), dict(mirostat=3), dict(mirostat_tau=-1)):
        with pytest.raises(ValueError, match=next(iter(bad)).split("_")[0]):
            SamplingParams(**bad)


# ----- mirostat -------------------------------------------------------------------------

def test_mirostat_v2_survivors_and_mu_update():
    row = np.array([3.0, 2.5, 1.0, 0.0, -2.0], np.float32)
    p = SamplingParams(mirostat=2, mirostat_tau=1.0, mirostat_eta=0.5, temperature=1.0, seed=1)
    st = SeqSamplingState(p)
    assert st.mu == 2.0
    probs = np.exp(row - row.max()) / np.exp(row - row.max()).sum()
    allowed = np.flatnonzero(-np.log2(probs) <= 2.0)         # tokens 0 and 1
    tok = int(Sampler().sample(row[None], [st]).tokens[0])
    assert tok in allowed
    q = probs[allowed] / probs[allowed].sum()
    surprise = -math.log2(q[list(allowed).index(tok)])
    assert st.mu == pytest.approx(2.0 - 0.5 * (surprise - 1.0))
    # llama.cpp's mirostat v2 picks among the same survivors
    for seed in range(20):
        _, sel = llama_apply([lib.llama_sampler_init_mirostat_v2(seed, 1.0, 0.5)], row)
        assert sel in allowed


def test_mirostat_v1_k_from_the_zipf_estimate_and_mu_update():
    # Zipf logits with exponent 1.1: s_hat is 1.1 exactly, so k follows the formula
    vocab = 2000
    row = (-1.1 * np.log(np.arange(1, vocab + 1))).astype(np.float32)
    sampler = Sampler()
    for mu in (3.0, 6.0, 9.0):
        p = SamplingParams(mirostat=1, mirostat_tau=3.0, mirostat_eta=0.1, temperature=1.0,
                           seed=int(mu))
        st = SeqSamplingState(p)
        st.mu = mu
        eps = 0.1
        k = int((eps * 2 ** mu / (1 - vocab ** -eps)) ** (1 / 1.1))
        for _ in range(30):
            st.mu = mu
            t = int(sampler.sample(row[None], [st]).tokens[0])
            assert t < max(k, 1)                      # ids are ranks here
            w = np.exp(row[:max(k, 1)].astype(np.float64))
            surprise = -math.log2(w[t] / w.sum())
            assert st.mu == pytest.approx(mu - 0.1 * (surprise - 3.0), rel=1e-6)


def test_extended_samplers_seeded_reproducible_and_batch_invariant():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, 300)).astype(np.float32) * 3
    params = [SamplingParams(typical_p=0.8, seed=1), SamplingParams(xtc_probability=0.5, seed=2),
              SamplingParams(mirostat=2, seed=3)]

    def run(batch: bool):
        states = [SeqSamplingState(p) for p in params]
        s = Sampler()
        out = []
        for _ in range(30):
            if batch:
                out.append(s.sample(logits, states).tokens.tolist())
            else:
                out.append([int(s.sample(logits[i:i + 1], [st]).tokens[0])
                            for i, st in enumerate(states)])
            for st, t in zip(states, out[-1]):
                st.append(t)
        return out
    assert run(True) == run(False) == run(True)


@pytest.mark.parametrize("typ", [0.2, 0.5, 0.9, 0.99])
def test_typical_with_a_probability_that_underflows(typ):
    # a logit 800 below the rest (a logit bias, a masked vocabulary) has probability 0 in
    # float64: -log 0 = inf used to turn the mass histogram's buckets into NaN (a crash);
    # such a token carries no mass, so the kept set is the one without it
    for row in rows(10, 64, seed=int(typ * 100) + 1):
        low = row.copy()
        low[5] = row.max() - 800.0
        got = S.truncate_ext(low, SamplingParams(typical_p=typ, temperature=1.0))
        without = S.truncate_ext(np.delete(row, 5), SamplingParams(typical_p=typ, temperature=1.0))
        assert got.tolist() == [int(i) + (i >= 5) for i in without]
