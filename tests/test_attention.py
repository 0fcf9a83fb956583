"""The tiled CPU attention kernel (backends/cpu/attention.py): the same bits as the per-token
kernel in every batch shape (batch invariance), and close to a float64 reference."""
from __future__ import annotations

import numpy as np
import pytest
from numba import njit

from edgeinfer.backends.cpu import _stamp
from edgeinfer.backends.cpu import attention as A
from edgeinfer.backends.cpu._simd import vload, vstore

SCALE = np.float32(0.0625)


def _pools(rng, nblk, bs, KVH, D, f16):
    shape = (nblk, bs, KVH, D)
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    if f16:
        return k.astype(np.float16).view(np.uint16), v.astype(np.float16).view(np.uint16)
    return k, v


def _as_f32(pool):
    return pool.view(np.float16).astype(np.float32) if pool.dtype == np.uint16 else pool


def _reference64(q, kc, vc, tables, seq, pos, window, scale):
    """float64 attention, each token alone, no f16 rounding of q or the weights."""
    T, H, D = q.shape
    bs, KVH = kc.shape[1], kc.shape[2]
    k32, v32 = _as_f32(kc), _as_f32(vc)
    ref = np.empty((T, H, D))
    for t in range(T):
        p, s = pos[t], seq[t]
        lo = max(0, p - window + 1) if window > 0 else 0
        ks = np.stack([k32[tables[s, x // bs], x % bs] for x in range(lo, p + 1)])
        vs = np.stack([v32[tables[s, x // bs], x % bs] for x in range(lo, p + 1)])
        for h in range(H):
            kvh = h // (H // KVH)
            sc = ks[:, kvh].astype(np.float64) @ q[t, h].astype(np.float64) * float(scale)
            w = np.exp(sc - sc.max())
            ref[t, h] = (w / w.sum()) @ vs[:, kvh]
    return ref


def _attend(q, kc, vc, tables, seq, pos, window, rounding, par=True, nh=None, **kw):
    T, H, _ = q.shape
    if nh is None:
        nh = H // kc.shape[2]
    return A.paged_attention(q, kc, vc, tables, seq, pos, window, SCALE, rounding,
                             np.empty_like(q), par, nh, **kw)


# The per-token kernel (attention._attend_heads, one token x nh heads per work item) in the
# serial loop of paged_attention_ref, without its parallel loop and second inlined copy: the
# same bits, and a third of the compile time on an empty kernel cache (~4 s instead of ~10 s
# per pool type here). test_gpt_oss checks paged_attention_ref itself against the tiled
# kernel. Compiled as if defined in attention.py, so that numba's disk cache is keyed on that
# file (and its _DEPS_HASH) like the kernels it inlines: an edit there cannot leave a stale
# reference in the cache, and a warm cache need not compile it again.
_PER_TOKEN = """
def _per_token(q, kc, vc, tables, seq, pos, window, scale, rounding, out, nh, sinks):
    T, H = q.shape[0], q.shape[1]
    for it in range(T * (H // nh)):
        _attend_heads(q, kc, vc, tables, seq, pos, window, scale, rounding, out,
                      it // (H // nh), (it % (H // nh)) * nh, nh, sinks)
    return out
"""
_ns = {"__name__": __name__, "_attend_heads": A._attend_heads}    # a cached copy's module
exec(compile(_PER_TOKEN, A.__file__, "exec"), _ns)
_per_token = njit(nogil=True, cache=A._CACHE)(_ns["_per_token"])


def _ref(q, kc, vc, tables, seq, pos, window, rounding, nh=1):
    return _per_token(q, kc, vc, tables, seq, pos, window, SCALE, rounding, np.empty_like(q),
                      nh, A._sinks(None))


# (T per sequence, H, KVH, D, window): Gemma 3 270M's shape, GQA groups, multi-head, odd sizes
SHAPES = [(45, 4, 1, 256, 0), (45, 4, 1, 256, 17), (30, 8, 2, 64, 0), (30, 8, 2, 64, 9),
          (21, 4, 4, 96, 0), (21, 6, 2, 80, 11), (9, 3, 1, 48, 0)]


@pytest.mark.parametrize("T,H,KVH,D,window", SHAPES)
@pytest.mark.parametrize("f16", [True, False])
def test_tiled_equals_per_token_kernel(T, H, KVH, D, window, f16):
    """Two sequences' chunks in one batch: every tiling, head grouping, thread split and
    serial run gives the per-token kernel's bits."""
    rng = np.random.default_rng(T * D + window)
    bs, nblk = 16, 24
    kc, vc = _pools(rng, nblk, bs, KVH, D, f16)
    tables = rng.permutation(nblk).astype(np.int32).reshape(2, -1)
    q = rng.standard_normal((2 * T, H, D)).astype(np.float32)
    seq = np.repeat(np.array([1, 0], np.int32), T)
    pos = np.concatenate([np.arange(100, 100 + T), np.arange(3, 3 + T)]).astype(np.int32)
    group = H // KVH
    for rounding in (True, False):
        want = _ref(q, kc, vc, tables, seq, pos, window, rounding)
        for nh in [n for n in (1, 2, 3, 4) if group % n == 0]:
            for par, threads, tile in ((True, None, A.TILE), (True, 3, 5), (False, None, 1),
                                       (False, None, 7)):
                got = _attend(q, kc, vc, tables, seq, pos, window, rounding, par, nh,
                              threads=threads, tile=tile)
                np.testing.assert_array_equal(got, want, err_msg=f"{nh=} {par=} {tile=}")
        if not rounding:
            ref = _reference64(q, kc, vc, tables, seq, pos, window, SCALE)
            np.testing.assert_allclose(want, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("window", [0, 300])
@pytest.mark.parametrize("pool", ["f16", "f32", "q8_0"])
@pytest.mark.parametrize("H,KVH,D", [(8, 2, 64), (14, 2, 64), (4, 1, 128), (2, 1, 256)])
def test_tiles_past_the_widened_key_chunks_equal_the_per_token_kernel(window, pool, H, KVH, D):
    """Tiles of many rows widen K and V to float32 wide_keys(D) keys at a time (64, 32 or
    16 keys: 16 KB) (and sum V by FMA where the weights and the pool are halves; on AVX2
    score keys in the lanes from a transposed copy, and sum V six rows at a time): past
    several chunks, with a window that starts inside one (not on an 8-key block), an odd
    number of rows (Qwen2.5's group of 7 heads, a last tile of 5 tokens), every row still
    gets the per-token kernel's bits."""
    rng = np.random.default_rng(7 + window)
    bs = 16
    wk = A.wide_keys(D)
    nblk = (3 * wk + 64) // bs
    kc, vc = _pools(rng, nblk, bs, KVH, D, pool == "f16")
    if pool == "q8_0":          # ggml's q8_0 blocks, written by the cache's own store
        from edgeinfer.backends.cpu import kernels as K
        k, v = kc.reshape(-1, KVH, D), vc.reshape(-1, KVH, D)
        width = K.kv_row_width("q8_0", D)
        kc, vc = (np.zeros((nblk, bs, KVH, width), np.uint8) for _ in range(2))
        K.kv_write(kc, vc, k, v, np.arange(nblk * bs, dtype=np.int64))
    tables = rng.permutation(nblk).astype(np.int32).reshape(1, -1)
    T = 21
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    seq = np.zeros(T, np.int32)
    pos = np.arange(3 * wk + 10, 3 * wk + 10 + T).astype(np.int32)
    for rounding in (True, False):
        want = _ref(q, kc, vc, tables, seq, pos, window, rounding)
        for nh in [n for n in (7, 4, 2, 1) if (H // KVH) % n == 0]:
            assert A.TILE * nh >= A.WIDE_MIN_ROWS
            got = _attend(q, kc, vc, tables, seq, pos, window, rounding, True, nh)
            np.testing.assert_array_equal(got, want, err_msg=f"{nh=} {rounding=}")


@pytest.mark.parametrize("window", [0, 40])
def test_a_token_is_the_same_bits_in_any_chunk_split(window):
    """A 150-token prompt prefilled in one chunk, in uneven chunks, token by token (decode),
    and mixed into a batch with another sequence's decode token and prefill chunk: every
    token's output is identical."""
    rng = np.random.default_rng(7)
    H, KVH, D, bs, nblk, n = 4, 1, 256, 16, 40, 150
    kc, vc = _pools(rng, nblk, bs, KVH, D, True)
    tables = rng.permutation(nblk).astype(np.int32).reshape(2, -1)
    q = rng.standard_normal((n, H, D)).astype(np.float32)
    seq = np.zeros(n, np.int32)
    pos = np.arange(n, dtype=np.int32)
    whole = _attend(q, kc, vc, tables, seq, pos, window, True)
    cuts = [0, 1, 17, 18, 64, 99, 150]
    for a, b in zip(cuts, cuts[1:]):
        part = _attend(q[a:b], kc, vc, tables, seq[a:b], pos[a:b], window, True)
        np.testing.assert_array_equal(part, whole[a:b])
    for t in (0, 5, 80, 149):
        one = _attend(q[t:t + 1], kc, vc, tables, seq[t:t + 1], pos[t:t + 1], window, True,
                      nh=2)
        np.testing.assert_array_equal(one[0], whole[t])
    # mixed: a decode token of sequence 1, a chunk of sequence 0, another of sequence 1
    q1 = rng.standard_normal((12, H, D)).astype(np.float32)
    mq = np.concatenate([q1[:1], q[60:90], q1[1:]])
    mseq = np.array([1] + [0] * 30 + [1] * 11, np.int32)
    mpos = np.concatenate([[200], pos[60:90], np.arange(201, 212)]).astype(np.int32)
    mixed = _attend(mq, kc, vc, tables, mseq, mpos, window, True)
    np.testing.assert_array_equal(mixed[1:31], whole[60:90])
    alone1 = _attend(q1, kc, vc, tables, np.ones(12, np.int32),
                     np.arange(200, 212, dtype=np.int32), window, True)
    np.testing.assert_array_equal(mixed[[0] + list(range(31, 42))], alone1)


@pytest.mark.parametrize("KVH,T", [(1, 1), (1, 2), (2, 1)])
def test_few_tokens_split_over_threads_give_the_same_bits(KVH, T):
    """A decode step with fewer (token, KV head) pairs than threads splits each pair's keys,
    rows and columns over the threads (_run_split): the bits of the per-token kernel, for
    long and windowed contexts, any thread count."""
    rng = np.random.default_rng(KVH * 10 + T)
    H, D, bs, nblk = 4, 256, 16, 80
    kc, vc = _pools(rng, nblk, bs, KVH, D, True)
    tables = rng.permutation(nblk).astype(np.int32).reshape(2, -1)
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    seq = np.arange(T, dtype=np.int32) % 2
    pos = np.array([637, 3][:T], np.int32)
    for window in (0, 100):
        for rounding in (True, False):
            want = _ref(q, kc, vc, tables, seq, pos, window, rounding)
            for threads in (2, 3, 4, 7):
                got = _attend(q, kc, vc, tables, seq, pos, window, rounding, threads=threads)
                np.testing.assert_array_equal(got, want, err_msg=f"{threads=} {window=}")
                split = A._run_split(q, kc, vc, tables, seq, pos, window, SCALE, rounding,
                                     np.empty_like(q), threads)
                np.testing.assert_array_equal(split, want, err_msg=f"{threads=} {window=}")


def test_non_consecutive_positions_and_repeated_sequences():
    """Tiles break where positions jump or the sequence changes; a batch may hold tokens of
    one sequence out of order (speculative verification builds such batches)."""
    rng = np.random.default_rng(3)
    H, KVH, D, bs, nblk = 4, 1, 64, 8, 30
    kc, vc = _pools(rng, nblk, bs, KVH, D, True)
    tables = rng.permutation(nblk).astype(np.int32).reshape(3, -1)
    seq = np.array([0, 0, 0, 2, 2, 0, 1, 1, 1, 1, 2], np.int32)
    pos = np.array([5, 6, 9, 40, 41, 7, 0, 1, 2, 3, 12], np.int32)
    q = rng.standard_normal((len(seq), H, D)).astype(np.float32)
    for window in (0, 3):
        want = _ref(q, kc, vc, tables, seq, pos, window, True)
        np.testing.assert_array_equal(_attend(q, kc, vc, tables, seq, pos, window, True), want)
        np.testing.assert_array_equal(
            _attend(q, kc, vc, tables, seq, pos, window, True, False, tile=2), want)


def test_rounded_weights_match_a_numpy_emulation():
    """ggml_rounding: q and the softmax weights rounded to f16, then the float64 sum; the
    kernel stays within float32 rounding of that."""
    rng = np.random.default_rng(11)
    H, KVH, D, bs, nblk, T = 4, 1, 256, 16, 8, 20
    kc, vc = _pools(rng, nblk, bs, KVH, D, True)
    tables = np.arange(nblk, dtype=np.int32).reshape(1, -1)
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    pos = np.arange(60, 60 + T, dtype=np.int32)
    seq = np.zeros(T, np.int32)
    got = _attend(q, kc, vc, tables, seq, pos, 0, True)
    k32 = _as_f32(kc).reshape(-1, D)
    v32 = _as_f32(vc).reshape(-1, D)
    qr = q.astype(np.float16).astype(np.float64)
    for t in range(T):
        sc = k32[:pos[t] + 1] @ qr[t].T * float(SCALE)           # [keys, H]
        w = np.exp(sc - sc.max(0))
        w = (w / w.sum(0)).astype(np.float16).astype(np.float64)
        np.testing.assert_allclose(got[t], (w.T @ v32[:pos[t] + 1]), rtol=2e-4, atol=2e-5)


@njit
def _vexp_array(x, out):
    for i in range(0, x.shape[0], 16):
        vstore(out, i, A.vexp(vload(x, i)))
    return out


def test_vexp_is_within_two_ulp_of_exp():
    x = np.concatenate([-np.geomspace(1e-8, 87.3, 200000), [0.0, -0.0],
                        np.linspace(-10, 0, 62)]).astype(np.float32)
    got = _vexp_array(x, np.empty_like(x))
    want = np.exp(x.astype(np.float64))
    ulp = np.spacing(want.astype(np.float32)).astype(np.float64)
    assert np.all(np.abs(got - want) <= 2 * ulp)
    assert np.all(got[x == 0] == 1.0)
    edge = np.array([-np.inf, -1e30, -88.0, -100.0] + [0.0] * 12, np.float32)
    assert np.all(_vexp_array(edge, np.empty_like(edge))[:4] == 0.0)


def test_heads_per_item_leaves_work_for_every_thread():
    assert A.heads_per_item(T=512, H=4, KVH=1, threads=2) == 4     # prefill: whole groups
    assert A.heads_per_item(T=1, H=4, KVH=1, threads=2) == 2       # decode: two halves
    assert A.heads_per_item(T=1, H=4, KVH=1, threads=1) == 4       # serial: the whole group
    assert A.heads_per_item(T=1, H=8, KVH=8, threads=2) == 1       # no grouping to do


def test_kernel_cache_stamp_is_current():
    want = _stamp.deps_hash(A._DEPS)
    assert A._DEPS_HASH == want, f"update _DEPS_HASH in backends/cpu/attention.py to {want!r}"
    assert A._CACHE
