"""Element-wise CPU kernels against their direct formulas."""
from __future__ import annotations

import numpy as np

from edgeinfer.backends.cpu import attention as A
from edgeinfer.backends.cpu import kernels as K


def test_gelu_table_equals_the_f16_formula():
    rng = np.random.default_rng(0)
    edge = np.array([-10, -9.999, 9.999, 10, 0, -0.0, 1e-8, -1e-8, 65504, 7e4, np.inf, -np.inf],
                    np.float32)
    g = np.concatenate([rng.standard_normal(50000).astype(np.float32) * 4, edge]).reshape(2, -1)
    up = rng.standard_normal(g.shape).astype(np.float32)
    got = K.gelu_tanh_mul_f16(g.copy(), up, np.empty_like(g), K.gelu_f16_table(), True)
    serial = K.gelu_tanh_mul_f16(g.copy(), up, np.empty_like(g), K.gelu_f16_table(), False)
    np.testing.assert_array_equal(got, serial)
    with np.errstate(over="ignore"):      # 7e4 rounds to inf in f16, as in the kernel
        h = g.astype(np.float16).astype(np.float32).reshape(-1)
    direct = K.gelu_f16_values(h, np.empty_like(h)).reshape(g.shape)
    want = (np.where(g <= -10, 0, np.where(g >= 10, g, direct)) * up).astype(np.float32)
    np.testing.assert_array_equal(got, want)
    # and close to the float32 GELU (f16 rounding only)
    ref = K.gelu_tanh_mul(g[:, :-6].copy(), up[:, :-6], np.empty_like(g[:, :-6]), True)
    np.testing.assert_allclose(got[:, :-6], ref, rtol=3e-3, atol=1e-3 * np.abs(up).max())


def test_serial_and_parallel_kernels_agree_bit_for_bit():
    """Small inputs run serially, large ones in parallel: a token's numbers must not depend on
    which (batch invariance)."""
    rng = np.random.default_rng(1)
    T, H, KVH, D, bs, nblk = 37, 4, 1, 256, 16, 8
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    kc = rng.standard_normal((nblk, bs, KVH, D)).astype(np.float32)
    vc = rng.standard_normal((nblk, bs, KVH, D)).astype(np.float32)
    tables = rng.permutation(nblk).astype(np.int32).reshape(1, -1)
    seq = np.zeros(T, np.int32)
    pos = np.arange(60, 60 + T, dtype=np.int32)
    for window in (0, 32):
        a = A.paged_attention(q, kc, vc, tables, seq, pos, window, np.float32(0.0625), True,
                              np.empty_like(q), True)
        b = A.paged_attention(q, kc, vc, tables, seq, pos, window, np.float32(0.0625), True,
                              np.empty_like(q), False)
        np.testing.assert_array_equal(a, b)
    x = rng.standard_normal((9, 640)).astype(np.float32)
    w = rng.standard_normal(640).astype(np.float32)
    np.testing.assert_array_equal(K.rms_norm(x, w, 1e-6, np.empty_like(x), True),
                                  K.rms_norm(x, w, 1e-6, np.empty_like(x), False))
    cos, sin = K.rope_tables(pos, D, 10000.0)
    r1, r2 = q.copy(), q.copy()
    K.rope_inplace(r1, cos, sin, True, True)
    K.rope_inplace(r2, cos, sin, True, False)
    np.testing.assert_array_equal(r1, r2)


def test_grouped_heads_give_the_same_bits_as_one_head_at_a_time():
    """Grouped-query attention reads each K/V row once for several heads; every head's
    result must be bit-identical to the head computed alone, in any batch and split, and
    match a float64 reference."""
    rng = np.random.default_rng(2)
    T, H, KVH, D, bs, nblk = 23, 8, 2, 64, 16, 12
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    kc = rng.standard_normal((nblk, bs, KVH, D)).astype(np.float32)
    vc = rng.standard_normal((nblk, bs, KVH, D)).astype(np.float32)
    tables = rng.permutation(nblk).astype(np.int32).reshape(2, -1)
    seq = np.array([0] * 13 + [1] * 10, np.int32)
    pos = np.concatenate([np.arange(30, 43), np.arange(80, 90)]).astype(np.int32)
    for window in (0, 20):
        for rounding in (True, False):
            outs = [A.paged_attention(q, kc, vc, tables, seq, pos, window, np.float32(0.125),
                                      rounding, np.empty_like(q), par, nh)
                    for nh in (1, 2, 4) for par in (True, False)]
            for o in outs[1:]:
                np.testing.assert_array_equal(o, outs[0])
            alone = A.paged_attention(q[5:6], kc, vc, tables, seq[5:6], pos[5:6], window,
                                      np.float32(0.125), rounding, np.empty_like(q[5:6]),
                                      False, 4)
            np.testing.assert_array_equal(alone[0], outs[0][5])
        # float64 reference for the unrounded path
        ref = np.empty((T, H, D))
        for t in range(T):
            p, s = pos[t], seq[t]
            lo = max(0, p - window + 1) if window > 0 else 0
            ks = np.stack([kc[tables[s, x // bs], x % bs] for x in range(lo, p + 1)])
            vs = np.stack([vc[tables[s, x // bs], x % bs] for x in range(lo, p + 1)])
            for h in range(H):
                kvh = h // (H // KVH)
                sc = ks[:, kvh].astype(np.float64) @ q[t, h].astype(np.float64) * 0.125
                w = np.exp(sc - sc.max())
                ref[t, h] = (w / w.sum()) @ vs[:, kvh]
        got = A.paged_attention(q, kc, vc, tables, seq, pos, window, np.float32(0.125), False,
                                np.empty_like(q), True, 4)
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)

