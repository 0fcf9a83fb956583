"""SwiGLU's 16-lane kernel (backends/cpu/_swiglu.py) against ggml's vector SwiGLU.

The reference below runs ggml_v_expf's operations one value at a time with exact FMAs
(fractions, rounded once to float32), so the kernel must give its bits on every lane, and
libm's expf on the scalar tail, as ggml_vec_swiglu_f32 does.
"""
from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from numba import njit

from edgeinfer.backends.cpu import _swiglu

F = np.float32
H = float.fromhex


def _f32(x: Fraction) -> np.float32:
    with np.errstate(over="ignore"):
        return F(float(x)) if abs(x) < 2 ** 1000 else F(np.inf if x > 0 else -np.inf)


def _fma(a, b, c) -> np.float32:
    return _f32(Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c)))


def _expf_ggml(x: np.float32) -> np.float32:
    r = F(H("0x1.8p23"))
    z = _fma(x, F(H("0x1.715476p+0")), r)
    n = F(z - r)
    b = _fma(-n, F(H("0x1.62e4p-1")), x)
    b = _fma(-n, F(H("0x1.7f7d1cp-20")), b)
    u = F(b * b)
    j = _fma(_fma(_fma(F(H("0x1.0e4020p-7")), b, F(H("0x1.573e2ep-5"))), u,
                  _fma(F(H("0x1.555e66p-3")), b, F(H("0x1.fffdb6p-2")))),
             u, _fma(F(H("0x1.ffffecp-1")), b, F(1.0)))
    if abs(float(n)) > 192:
        return F(0.0) if n <= 0 else F(np.inf)
    return _f32(Fraction(float(j)) * Fraction(2) ** int(n))       # scalef: one rounding


def _swiglu_ggml(g: np.float32, u: np.float32) -> np.float32:
    with np.errstate(over="ignore", invalid="ignore"):
        return F(F(g / F(F(1.0) + _expf_ggml(F(F(0.0) - g)))) * u)


@njit
def _libm_swiglu(g, u):
    """ggml_silu_f32 * g one value at a time: expf is libm's here (numpy's float32 exp is
    its own SIMD routine, off by an ulp now and then)."""
    out = np.empty_like(g)
    for i in range(g.shape[0]):
        out[i] = g[i] / (np.float32(1.0) + np.exp(-g[i])) * u[i]
    return out


def _inputs(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    g = np.concatenate([rng.standard_normal(n // 2) * 4, rng.uniform(-110, 110, n // 2),
                        [0.0, -0.0, 87.0, 89.0, -87.0, -89.0, 104.0, -104.0, 1e-30, -1e-30,
                         150.0, -150.0, 300.0, -300.0]])
    g = np.resize(g, n).astype(F).reshape(1, n)
    return g, rng.standard_normal((1, n)).astype(F)


@pytest.mark.parametrize("n", [16, 64 + 7, 1000])
def test_lanes_are_ggml_and_the_tail_is_libm(n):
    g, u = _inputs(n, seed=n)
    with np.errstate(over="ignore", invalid="ignore"):
        out = _swiglu.swiglu(g, u, np.empty_like(g), False)
        body = n // 16 * 16
        want = np.array([_swiglu_ggml(a, b) for a, b in zip(g[0, :body], u[0, :body])], F)
        tail = _libm_swiglu(g[0, body:], u[0, body:])
    np.testing.assert_array_equal(out[0, :body], want)
    np.testing.assert_array_equal(out[0, body:], tail)


def test_close_to_float64_and_in_place_over_many_rows():
    rng = np.random.default_rng(3)
    g = (rng.standard_normal((37, 4864 + 5)) * 3).astype(F)
    u = rng.standard_normal(g.shape).astype(F)
    exact = g.astype(np.float64) / (1 + np.exp(-g.astype(np.float64))) * u
    serial = _swiglu.swiglu(g, u, np.empty_like(g), False)
    g2 = g.copy()
    par = _swiglu.swiglu(g2, u, g2, True)           # out = gate, as CpuOps.swiglu calls it
    np.testing.assert_array_equal(serial, par)      # rows are the same bits on any thread
    rel = np.abs(serial - exact) / np.maximum(np.abs(exact), 1e-20)
    assert rel[np.abs(exact) > 1e-20].max() < 2e-6


def test_ops_swiglu_is_the_kernel_and_takes_strided_inputs():
    from edgeinfer.backends.cpu.ops import CpuOps
    g, u = _inputs(96 * 2, seed=7)
    g, u = g.reshape(2, 96), u.reshape(2, 96)
    wide = np.zeros((2, 192), F)
    wide[:, ::2] = u                                  # a non-contiguous up
    want = _swiglu.swiglu(g.copy(), u, np.empty_like(g), False)
    with np.errstate(over="ignore", invalid="ignore"):
        got = CpuOps().swiglu(g.copy(), wide[:, ::2])
        gate = np.zeros((2, 192), F)
        gate[:, 1::2] = g                             # a non-contiguous gate: still in place
        back = CpuOps().swiglu(gate[:, 1::2], u)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(back, want)
    np.testing.assert_array_equal(gate[:, 1::2], want)
