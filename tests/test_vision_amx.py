"""The vision tower's AMX-BF16 split-precision kernels (backends/cpu/_amx_bf16.py): products
and attention against float64 references, odd shapes, thread-count determinism, and the
float32 fallback where AMX-BF16 (or the OS's permission for it) is missing."""
from __future__ import annotations

import numpy as np
import pytest

from edgeinfer.backends.cpu import _amx_bf16 as amx

needs_amx = pytest.mark.skipif(not amx.available(), reason="no AMX-BF16 in this process")


def _ref(x, w, b=None):
    y = x.astype(np.float64) @ w.astype(np.float64).T
    return y if b is None else y + b


def _rel(got, want):
    return float(np.abs(got - want).max() / np.abs(want).max())


def test_split_is_hi_plus_lo():
    """hi + lo recovers x to about 2^-16 relative; f16 values split exactly."""
    x = np.random.default_rng(0).standard_normal(10000).astype(np.float32) * 100
    hi, lo = amx.split_array(x)
    back = ((hi.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
            + (lo.astype(np.uint32) << 16).view(np.float32))
    assert np.abs(back - x).max() <= 2.0 ** -16 * np.abs(x).max()
    h = x.astype(np.float16).astype(np.float32)
    hi, lo = amx.split_array(h)
    back = ((hi.astype(np.uint32) << 16).view(np.float32)
            + (lo.astype(np.uint32) << 16).view(np.float32))
    assert np.array_equal(back, h)


def test_split_weight_layout():
    """Each B tile holds [16 pairs of K][16 columns][2] of its 32 output columns and chunk;
    padding is zero. (Small integers are exact in bf16: lo is zero.)"""
    rows = np.broadcast_to(np.arange(1, 49, dtype=np.float32)[:, None], (48, 70))
    cols = np.broadcast_to(np.arange(1, 71, dtype=np.float32)[None, :], (48, 70))
    for w, want in ((rows, lambda n, k: n + 1), (cols, lambda n, k: k + 1)):
        b = amx.split_weight(np.ascontiguousarray(w))
        assert b.shape == (2, 3, 2, 2, 16, 16, 2)
        assert (b[:, :, 1] == 0).all()
        hi = (b[:, :, 0].astype(np.uint32) << 16).view(np.float32)
        for n in range(64):
            for k in range(96):
                v = hi[n // 32, k // 32, (n % 32) // 16, (k % 32) // 2, n % 16, k % 2]
                assert v == (want(n, k) if n < 48 and k < 70 else 0)


@needs_amx
@pytest.mark.parametrize("M, K, N", [(1, 1, 1), (37, 70, 50), (64, 96, 64), (33, 31, 17),
                                     (100, 300, 200), (256, 768, 96)])
@pytest.mark.parametrize("bias", [False, True])
def test_matmul_matches_float64(M, K, N, bias):
    rng = np.random.default_rng(M * 7 + K)
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = rng.standard_normal((N, K)).astype(np.float32)
    b = rng.standard_normal(N).astype(np.float32) if bias else None
    got = amx.AmxMatrix(w).matmul(x, b)
    assert got.shape == (M, N) and got.dtype == np.float32
    assert _rel(got, _ref(x, w, b)) < 2e-5


@needs_amx
def test_matmul_f16_activations():
    """f16=True: x rounded to float16 first (ggml's f16 matrices), then exact splits."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((70, 100)).astype(np.float32)
    w = rng.standard_normal((40, 100)).astype(np.float16).astype(np.float32)
    got = amx.AmxMatrix(w).matmul(x, f16=True)
    want = _ref(x.astype(np.float16).astype(np.float32), w)
    assert _rel(got, want) < 2e-5


@needs_amx
@pytest.mark.parametrize("K", [96, 100])
def test_matmul_gelu_input(K):
    """gelu=table: the product of ggml's table GELU of x (ops.gelu's values), in the split."""
    from edgeinfer.backends.cpu import kernels as Kn
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((45, K)) * 6).astype(np.float32)
    x[0, :4] = [-12, 12, -10, 10]
    w = rng.standard_normal((33, K)).astype(np.float32)
    g = Kn.gelu_tanh_mul_f16(x, np.ones_like(x), np.empty_like(x), Kn.gelu_f16_table(), False)
    m = amx.AmxMatrix(w)
    got = m.matmul(x, gelu=Kn.gelu_f16_table())
    assert _rel(got, _ref(g, w)) < 2e-5
    assert np.array_equal(got, m.matmul(g))


@needs_amx
def test_matmul_deterministic_over_threads():
    """Every output is one fixed sequence of tile operations: same bits for 1 or 2 threads
    and run to run."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((300, 512)).astype(np.float32)
    w = amx.AmxMatrix(rng.standard_normal((384, 512)).astype(np.float32))
    b = rng.standard_normal(384).astype(np.float32)
    one = w.matmul(x, b, nw=1)
    assert np.array_equal(one, w.matmul(x, b, nw=2))
    assert np.array_equal(one, w.matmul(x, b))
    # a row's bits do not depend on the other rows of the batch
    assert np.array_equal(one[:40], w.matmul(x[:40], b))


def _attention_ref(qkv, T, H, D, scale):
    e = H * D
    q, k, v = (qkv[:T, i * e:(i + 1) * e].reshape(T, H, D).astype(np.float64) for i in range(3))
    s = np.einsum("thd,uhd->htu", q, k) * scale
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("htu,uhd->thd", p, v).reshape(T, e)


@needs_amx
@pytest.mark.parametrize("T, H, D", [(1, 1, 32), (50, 2, 64), (77, 3, 72), (257, 4, 64)])
def test_attention_matches_float64(T, H, D):
    rng = np.random.default_rng(T)
    qkv = (rng.standard_normal((T + 5, 3 * H * D)) * 2).astype(np.float32)
    got = amx.attention(qkv, T, H, D, 1 / np.sqrt(D))
    assert got.shape == (T, H * D)
    assert _rel(got, _attention_ref(qkv, T, H, D, 1 / np.sqrt(D))) < 1e-4
    assert np.array_equal(got, amx.attention(qkv, T, H, D, 1 / np.sqrt(D), nw=1))


def test_unavailable_without_permission(monkeypatch):
    """No tile permission from the OS (or EDGEINFER_NO_AMX): available() is false."""
    monkeypatch.setattr(amx, "_AVAILABLE", None)
    monkeypatch.setattr(amx, "_permitted", lambda: False)
    assert not amx.available()
    monkeypatch.setattr(amx, "_AVAILABLE", None)
    monkeypatch.setenv("EDGEINFER_NO_AMX", "1")
    assert not amx.available()


def test_tower_falls_back_and_agrees(tmp_path, monkeypatch):
    """Without AMX the tower keeps its float32 ops path; with it, the same embeddings within
    1e-4 of the largest (the parity tests against libmtmd allow 1e-3)."""
    from edgeinfer.formats.image import preprocess_fixed
    from edgeinfer.formats.mmproj import read_mmproj
    from edgeinfer.models.siglip import SiglipVision
    from edgeinfer.runners.native import make_ops
    from vision_synth import noise_rgb, vision_pair
    gf, cfg = read_mmproj(str(vision_pair(tmp_path)[1]))
    px = preprocess_fixed(noise_rgb(80, 60, seed=2), cfg.image_size, cfg.image_mean, cfg.image_std)
    have = amx.available()
    with_amx = SiglipVision(cfg, make_ops("cpu"), gf)
    assert (with_amx.blocks[0].amx is not None) == have
    a = with_amx.encode(px)
    monkeypatch.setattr(amx, "_AVAILABLE", False)
    plain = SiglipVision(cfg, make_ops("cpu"), gf)
    assert plain.blocks[0].amx is None and plain.blocks[0].wq is not None
    b = plain.encode(px)
    assert a.shape == b.shape
    assert _rel(a, b) < 1e-4
