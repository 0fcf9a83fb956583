"""The work between the matmuls: activation quantization (backends/cpu/_actquant.py), the
shared-quantization matmuls (packed.packed_matmuls, ops.matmuls), the RMS norm eight rows at a
time (_norm.py) and the 16-lane GeGLU (_geglu.py), each the bits of the code it replaces.

quantize_rows (16-lane vectors) must give the same bits as the scalar reference built on
kernels.quantize_act_block, the one the float path's act_round_q8_0/_k use: over random rows
and the edge cases (zero blocks, ties at .5, +amax and -amax in one block, huge and tiny values).
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgeinfer.backends.cpu import _actquant as aq
from edgeinfer.backends.cpu import _geglu, _norm
from edgeinfer.backends.cpu import kernels as K

# (A, B): Q8_0 for the legacy quants; Q8_K with 32- (Q4_K, Q5_K) or 16-column (Q2_K, Q3_K, Q6_K)
# weight blocks
FORMATS = [(32, 32), (256, 32), (256, 16)]


def quantize(fn, x, A, B, zp, *extra):
    M, Kc = x.shape
    nb = Kc // B
    out = (np.full((M, Kc), 99, np.int8), np.full((nb, M), 7, np.float32),
           np.full((nb, M), 7, np.float32), np.full((nb, M), 7, np.int32))
    fn(x, A, B, zp, *out, *extra)
    return out


def assert_same_bits(got, want):
    for g, w, name in zip(got, want, ("qa", "da", "bsf", "zb")):
        np.testing.assert_array_equal(g.view(np.uint8 if g.itemsize == 1 else np.uint32),
                                      w.view(np.uint8 if w.itemsize == 1 else np.uint32),
                                      err_msg=name)


def edge_rows(A: int, Kc: int) -> np.ndarray:
    rng = np.random.default_rng(7)
    x = rng.standard_normal((14, Kc)).astype(np.float32)
    x[0] = 0.0                                   # a zero row
    x[1, :A] = 0.0                               # one zero block in a random row
    x[1, A:2 * A] = -0.0
    x[2] = np.float32(0.5)                       # one value everywhere: codes 127
    x[3, :A] = rng.integers(-127, 128, A) + np.float32(0.5)  # with amax 127.5 ... ties below
    x[4] = rng.integers(-254, 255, Kc).astype(np.float32) / 2 * (127 / 127.0)
    x[4, ::A] = 127.0                            # amax 127: idv 1, x.5 values tie
    x[5, ::A] = 3.0                              # +amax first, -amax later in each block
    x[5, 5::A] = -3.0
    x[5] = np.clip(x[5], -3.0, 3.0)
    x[6, ::A] = -3.0                             # -amax first, +amax later
    x[6, 9::A] = 3.0
    x[6] = np.clip(x[6], -3.0, 3.0)
    x[7] *= np.float32(1e30)                     # huge
    x[8] *= np.float32(1e-30)                    # tiny (and subnormal codes' scales)
    x[9] *= np.float32(1e-36)                    # near the smallest amax whose 127/amax is finite
    x[10, :] = -2.0                              # negative constant: Q8_K's scale is negative
    x[11, 3] = 1e6                               # one outlier per row
    x[12] = np.abs(x[12])                        # all positive
    x[13] = -np.abs(x[13])                       # all negative
    return x


@pytest.mark.parametrize("A,B", FORMATS)
@pytest.mark.parametrize("par", [False, True])
def test_vector_quantize_equals_scalar_reference_on_edges(A, B, par):
    x = edge_rows(A, 1024)
    assert_same_bits(quantize(aq.quantize_rows, x, A, B, 16, par),
                     quantize(aq.quantize_rows_ref, x, A, B, 16, False))


@pytest.mark.parametrize("A,B", FORMATS)
def test_codes_are_the_float_paths_rounding(A, B):
    """codes * scale equal act_round_q8_0/_k's values, the float path's activations."""
    x = edge_rows(A, 512)
    qa, da, _, _ = quantize(aq.quantize_rows, x, A, B, 0, False)
    rounder = K.act_round_q8_0 if A == 32 else K.act_round_q8_k
    want = rounder(x, np.empty_like(x))
    with np.errstate(invalid="ignore"):      # the huge row: its f16 scale is inf, 0 * inf
        got = qa.astype(np.float32) * np.repeat(da.T, B, axis=1)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_sums_and_zero_point_terms():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 512)).astype(np.float32)
    for A, B in FORMATS:
        qa, da, bsf, zb = quantize(aq.quantize_rows, x, A, B, 128, False)
        sums = qa.astype(np.int32).reshape(3, -1, B).sum(-1).T
        np.testing.assert_array_equal(bsf, sums.astype(np.float32))
        np.testing.assert_array_equal(zb, 128 * sums)


@settings(max_examples=60, deadline=None)
@given(fmt=st.sampled_from(FORMATS), m=st.integers(1, 9), kb=st.integers(1, 4),
       scale=st.sampled_from([1e-3, 1.0, 57.0, 1e4]), seed=st.integers(0, 2**31 - 1),
       par=st.booleans())
def test_vector_quantize_fuzzed(fmt, m, kb, scale, seed, par):
    A, B = fmt
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((m, 256 * kb)) * scale).astype(np.float32)
    # coarse values make exact ties at .5 after scaling, and repeated maxima
    if seed % 2:
        x = np.round(x * 4) / 4
    assert_same_bits(quantize(aq.quantize_rows, x, A, B, 8, par),
                     quantize(aq.quantize_rows_ref, x, A, B, 8, par))


# -- one quantization per input: packed_matmuls / ops.matmuls -------------------------------

def _packed_matmuls_equal_one_matmul_each(types_rows, parts):
    from edgeinfer.backends.cpu.packed import packed_matmul, packed_matmuls
    from edgeinfer.backends.cpu.quants import QuantMatrix, random_quant_rows
    from edgeinfer.backends.cpu.repack import PackedMatrix
    rng = np.random.default_rng(5)
    Kc = 512
    ws = [PackedMatrix.from_quant(QuantMatrix.from_bytes(random_quant_rows(t, n, Kc, rng), t, Kc, n))
          for t, n in types_rows]
    for M in (1, 5, 300):
        x = rng.standard_normal((M, Kc)).astype(np.float32)
        for part in parts(ws):                  # one region runs up to three matrices
            for got, w in zip(packed_matmuls(x, part), part):
                np.testing.assert_array_equal(got.view(np.uint32),
                                              packed_matmul(x, w).view(np.uint32))
    with pytest.raises(ValueError):
        packed_matmuls(np.zeros((1, 256), np.float32), ws)


def test_packed_matmuls_equal_one_matmul_each_gemma3_formats():
    """Gemma 3 270M's own groups (q/k Q5_0 with v in Q5_0 or Q8_0; gate/up Q5_0: kernels the
    install's warm-up compiles): Q5_0 zp 16 and Q8_0 zp 128 share one set of Q8_0 codes, and
    each matrix gets the bits packed_matmul gives it alone, for one row and for a batch."""
    from gguf import GGMLQuantizationType as T
    _packed_matmuls_equal_one_matmul_each(
        ((T.Q5_0, 64), (T.Q5_0, 16), (T.Q8_0, 16), (T.Q5_0, 600)),
        lambda ws: (ws[:1], ws[:2], ws[:3], [ws[0], ws[1], ws[1]], ws[::3]))


@pytest.mark.slow      # compiles a closure per format group: ~2 minutes on a fresh cache
def test_packed_matmuls_equal_one_matmul_each():
    """Shared codes across formats and zero points (Q5_0 zp 16 and Q8_0 zp 128 share Q8_0
    codes; Q4_K offsets and Q6_K's 16-column blocks share Q8_K codes), in one parallel region
    per three matrices, give each matrix the bits packed_matmul gives it alone, for one row
    and for a batch."""
    from gguf import GGMLQuantizationType as T
    _packed_matmuls_equal_one_matmul_each(
        ((T.Q5_0, 48), (T.Q8_0, 16), (T.Q4_K, 40), (T.Q6_K, 32), (T.Q5_0, 600), (T.Q4_0, 16)),
        lambda ws: (ws[:1], ws[:2], ws[:4], ws))


def _old_path(ops, monkeypatch):
    """The path before shared quantization: one ops.matmul (one quantization) per matrix, by
    the scalar quantizer; kernels.rms_norm (one row at a time) and kernels' scalar GeGLU."""
    from edgeinfer.backends.cpu import packed
    monkeypatch.setattr(ops, "matmuls", lambda x, ws: tuple(ops.matmul(x, w) for w in ws))

    monkeypatch.setattr(packed._actquant, "quantize_rows", aq.quantize_rows_ref)
    monkeypatch.setattr(_norm, "rms_norm", K.rms_norm)
    monkeypatch.setattr(_geglu, "gelu_tanh_mul_f16", K.gelu_tanh_mul_f16)
    # and the fused norms (_norm.add_rms_norm, _norm.norm_rope) as the ops they fuse
    monkeypatch.setattr(ops, "add_rms_norm", lambda x, a, wa, wx, eps: ops.rms_norm(
        ops.add(x, ops.rms_norm(a, wa, eps)), wx, eps))
    monkeypatch.setattr(ops, "norm_rope", lambda x, w, eps, batch, base, scale, neox, ff=None:
                        ops.rope(ops.rms_norm(x, w, eps), batch, base, scale, neox, ff))


# the synthetic llama compiles the scalar path for its own formats: ~2 minutes on a fresh cache
@pytest.mark.parametrize("model", ["gemma3", pytest.param("llama", marks=pytest.mark.slow)])
def test_model_logits_are_the_bits_of_the_per_matrix_path(model, gemma3_path, monkeypatch):
    """Logits of a fixed prompt (a 24-token prefill, then one decoded token) through
    ops.matmuls and the vector quantizer equal those of the per-matrix scalar path."""
    import sys
    from pathlib import Path

    from edgeinfer.backends.cpu.ops import CpuOps
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import fidelity as F
    import synth
    if model == "gemma3":
        path = str(gemma3_path)
    else:
        path = str(synth.synthetic_model(Path(gemma3_path).parent, "llama", "Q4_K_M"))
    toks = [2] + [int(t) for t in np.random.default_rng(3).integers(10, 200, 24)]
    ours = F.Ours(path, CpuOps(repack=True), len(toks))
    try:
        new = [ours.logits(toks, 0, 24), ours.logits(toks, 24, 25)]
        with monkeypatch.context() as m:
            _old_path(ours.runner.ops, m)
            old = [ours.logits(toks, 0, 24), ours.logits(toks, 24, 25)]
    finally:
        ours.close()
    for a, b in zip(new, old):
        assert np.isfinite(a).all()
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


# -- RMS norm, eight rows at a time (_norm.py) -------------------------------------------------

@pytest.mark.parametrize("M,n", [(1, 640), (7, 640), (8, 640), (13, 256), (129, 640), (37, 2048)])
@pytest.mark.parametrize("par", [False, True])
def test_rms_norm_rows8_is_the_one_row_kernel(M, n, par):
    rng = np.random.default_rng(M * n)
    x = (rng.standard_normal((M, n)) * rng.choice([1e-3, 1.0, 300.0], size=(M, 1))).astype(np.float32)
    x[0, :5] = 1e20                       # a row whose float64 sum keeps what float32 would not
    x[M // 2] = 0.0                       # eps alone
    w = rng.standard_normal(n).astype(np.float32)
    got = _norm.rms_norm(x, w, 1e-6, np.empty_like(x), par)
    want = K.rms_norm(x, w, 1e-6, np.empty_like(x), False)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("M,n", [(1, 640), (8, 640), (13, 256), (129, 640)])
@pytest.mark.parametrize("par", [False, True])
def test_add_rms_norm_is_norm_add_norm(M, n, par):
    rng = np.random.default_rng(M + n)
    x = (rng.standard_normal((M, n)) * 30).astype(np.float32)
    a = (rng.standard_normal((M, n)) * rng.choice([1e-3, 1.0, 300.0], size=(M, 1))).astype(np.float32)
    a[M // 2] = 0.0
    wa, wx = (rng.standard_normal(n).astype(np.float32) for _ in range(2))
    want_x = x + K.rms_norm(a, wa, 1e-6, np.empty_like(a), False)
    want_h = K.rms_norm(want_x, wx, 1e-6, np.empty_like(x), False)
    got_x, got_a = x.copy(), a.copy()
    got_h = _norm.add_rms_norm(got_x, got_a, wa, wx, 1e-6, np.empty_like(x), par)
    np.testing.assert_array_equal(got_x.view(np.uint32), want_x.view(np.uint32))
    np.testing.assert_array_equal(got_h.view(np.uint32), want_h.view(np.uint32))


@pytest.mark.parametrize("T,H", [(1, 4), (1, 1), (9, 4), (130, 1)])
@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("par", [False, True])
def test_norm_rope_is_norm_then_rope(T, H, neox, par):
    rng = np.random.default_rng(T * 10 + H)
    D = 256
    x = (rng.standard_normal((T, H, D)) * 5).astype(np.float32)
    w = rng.standard_normal(D).astype(np.float32)
    cos, sin = K.rope_tables(rng.integers(0, 30000, T).astype(np.int64), D, 1e6, 1.0, None)
    want = K.rms_norm(x.reshape(T * H, D), w, 1e-6, np.empty((T * H, D), np.float32), False)
    want = want.reshape(T, H, D)
    K.rope_inplace(want, cos, sin, neox, False)
    got = _norm.norm_rope(x, w, 1e-6, cos, sin, neox, par)
    assert got is x
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


# -- GeGLU, 16 lanes at a time (_geglu.py) ------------------------------------------------------

@pytest.mark.parametrize("M,n", [(1, 2048), (3, 2050), (40, 640), (2, 7)])
@pytest.mark.parametrize("par", [False, True])
def test_geglu_vector_is_the_scalar_kernel(M, n, par):
    rng = np.random.default_rng(M + n)
    table = K.gelu_f16_table()
    g = (rng.standard_normal((M, n)) * 4).astype(np.float32)
    u = rng.standard_normal((M, n)).astype(np.float32)
    edges = np.array([-10.0, 10.0, -10.000001, 9.999999, 0.0, -0.0, 65520.0, -1e-8, np.nan,
                      np.inf, -np.inf, 1e-30], np.float32)
    flat = g.reshape(-1)
    flat[:min(len(edges), flat.size)] = edges[:flat.size]
    want = K.gelu_tanh_mul_f16(g, u, np.empty_like(g), table, False)
    got = _geglu.gelu_tanh_mul_f16(g, u, np.empty_like(g), table, par)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    inplace = g.copy()                     # ops.geglu writes into gate
    _geglu.gelu_tanh_mul_f16(inplace, u, inplace, table, par)
    np.testing.assert_array_equal(inplace.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("A,B", FORMATS)
@pytest.mark.parametrize("par", [False, True])
def test_padded_entry_stride_is_the_same_entries(A, B, par):
    """da, bsf, zb with a row stride S > M (entry_stride: no 2 KB strides at M = 512) hold
    in their first M columns the entries of the [nb, M] layout."""
    x = np.random.default_rng(31).standard_normal((40, 512)).astype(np.float32) * 3
    M, Kc = x.shape
    S = aq.entry_stride(M)
    assert S >= M and S % 16 == 0 and (S // 16) % 2 == 1
    nb = Kc // B
    padded = (np.empty((M, Kc), np.int8), np.full((nb, S), 7, np.float32),
              np.full((nb, S), 7, np.float32), np.full((nb, S), 7, np.int32))
    aq.quantize_rows(x, A, B, 8, *padded, par)
    want = quantize(aq.quantize_rows, x, A, B, 8, par)
    assert_same_bits((padded[0],) + tuple(np.ascontiguousarray(a[:, :M]) for a in padded[1:]),
                     want)
    assert [aq.entry_stride(m) for m in (1, 8, 16, 17, 496, 512, 520)] == \
        [1, 8, 16, 48, 496, 528, 528]


@pytest.mark.parametrize("A,B", FORMATS)
@pytest.mark.parametrize("M", [1, 5, 16, 17, 40])
def test_quantize_swiglu_rows_is_swiglu_then_quantize(A, B, M):
    """The fused SwiGLU + quantization gives quantize_rows(swiglu(gate, up))'s bits, serial
    and parallel, with the scratch of ROW_GROUP rows cut anywhere."""
    from edgeinfer.backends.cpu import _swiglu
    rng = np.random.default_rng(M)
    g = (rng.standard_normal((M, 768)) * 4).astype(np.float32)
    u = rng.standard_normal((M, 768)).astype(np.float32)
    g[0, :A] = 0.0                                   # an all-zero block
    h = _swiglu.swiglu(g, u, np.empty_like(g), False)
    want = quantize(aq.quantize_rows, h, A, B, 0, False)
    for par in (False, True):
        got = quantize(lambda x, *a: aq.quantize_swiglu_rows(x, u, *a), g, A, B, 0, par)
        assert_same_bits(got, want)
