"""Dequantization and embedding rows: bit-exact against gguf.quants.dequantize."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants as ref

from edgeinfer.backends.cpu.quants import (
    SUPPORTED_TYPES, QuantMatrix, block_size, dequantize, get_rows, random_quant_rows, row_bytes)

ALL = [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0,
       T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]
# types gguf can quantize itself: realistic (not random-byte) blocks for these
QUANTIZABLE = [T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]


def reference(raw: np.ndarray, qtype) -> np.ndarray:
    return np.asarray(ref.dequantize(raw, qtype), dtype=np.float32).reshape(-1)


def assert_bits_equal(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == np.float32 and got.shape == want.shape
    diff = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
    assert diff.size == 0, f"{diff.size} values differ, first at {diff[0]}: {got[diff[0]]} vs {want[diff[0]]}"


def test_supported_types_cover_the_design_list():
    assert set(SUPPORTED_TYPES) == set(ALL)


@pytest.mark.parametrize("qtype", ALL, ids=lambda t: t.name)
@pytest.mark.parametrize("seed", [0, 1])
def test_random_blocks_bit_exact(qtype, seed):
    rng = np.random.default_rng(seed)
    K = 512
    raw = random_quant_rows(qtype, 24, K, rng)
    assert_bits_equal(dequantize(raw, qtype, 24 * K), reference(raw, qtype))


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda t: t.name)
def test_quantized_values_bit_exact(qtype):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((16, 256)).astype(np.float32) * rng.uniform(0.01, 3, (16, 1)).astype(np.float32)
    x[3] = 0.0                                    # an all-zero row: zero scales
    raw = ref.quantize(x, qtype)
    assert_bits_equal(dequantize(raw, qtype, x.size), reference(raw, qtype))


def test_f16_special_values_exact():
    h = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 6.1e-5, 5.96e-8, -5.96e-8, 65504, -65504,
                  1e-6, 3.14159] + [0.0] * 20, dtype=np.float16)
    h[20:] = np.arange(0x0001, 0x0400, 0x0400 // 12, dtype=np.uint16)[:12].view(np.float16)  # subnormals
    got = dequantize(h.view(np.uint8), T.F16, h.size)
    want = h.astype(np.float32)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16], ids=lambda t: t.name)
def test_float_types_any_length(qtype):
    rng = np.random.default_rng(3)
    raw = random_quant_rows(qtype, 1, 64, rng).reshape(-1)
    n = 37                                        # not a multiple of the 32-value pseudo-block
    esize = 4 if qtype == T.F32 else 2
    assert_bits_equal(dequantize(raw[: n * esize], qtype, n), reference(raw[: n * esize], qtype))


def test_dequantize_rejects_bad_sizes():
    raw = random_quant_rows(T.Q4_K, 1, 256, np.random.default_rng(0))
    with pytest.raises(ValueError):
        dequantize(raw, T.Q4_K, 100)              # not a whole block
    with pytest.raises(ValueError):
        dequantize(raw, T.Q4_K, 512)              # more elements than bytes
    with pytest.raises(ValueError):
        dequantize(raw, T.IQ2_XS, 256)            # unsupported type


@pytest.mark.parametrize("qtype", ALL, ids=lambda t: t.name)
def test_get_rows_matches_reference(qtype):
    rng = np.random.default_rng(11)
    N, K = 40, 512
    raw = random_quant_rows(qtype, N, K, rng)
    w = QuantMatrix.from_bytes(raw, qtype, K, N)
    full = reference(raw, qtype).reshape(N, K)
    ids = np.array([39, 0, 7, 7, 21], dtype=np.int32)   # repeats and any int dtype are fine
    got = get_rows(w, ids)
    assert got.shape == (5, K)
    assert_bits_equal(got.reshape(-1), full[ids].reshape(-1))
    assert get_rows(w, np.array([], dtype=np.int64)).shape == (0, K)
    with pytest.raises(IndexError):
        get_rows(w, [N])
    with pytest.raises(IndexError):
        get_rows(w, [-1])


def test_quant_matrix_validates_and_does_not_copy():
    raw = random_quant_rows(T.Q8_0, 8, 64, np.random.default_rng(0))
    w = QuantMatrix.from_bytes(raw, T.Q8_0, 64, 8)
    assert np.shares_memory(w.data, raw)
    assert not w.data.flags.writeable
    assert w.data.shape == (8, row_bytes(T.Q8_0, 64)) and w.nbytes == raw.nbytes
    assert block_size(T.Q6_K) == 256
    with pytest.raises(ValueError):
        QuantMatrix.from_bytes(raw, T.Q8_0, 64, 9)
    with pytest.raises(ValueError):
        QuantMatrix.from_bytes(raw, T.Q4_K, 100, 8)      # K not a multiple of 256
    with pytest.raises(ValueError):
        QuantMatrix(raw.reshape(4, -1), T.Q8_0, 64, 8)


def _row_slices(n_rows: int) -> list[slice]:
    if n_rows <= 4096:
        return [slice(0, n_rows)]
    return [slice(0, 2048), slice(n_rows // 2, n_rows // 2 + 512), slice(n_rows - 1024, n_rows)]


def test_every_tensor_of_the_real_model_bit_exact(gemma3_path):
    from edgeinfer.formats.gguf_file import read_gguf

    g = read_gguf(str(gemma3_path))
    seen = set()
    for name, t in g.tensors.items():
        raw = g.raw(name)
        if len(t.shape) == 1:
            assert_bits_equal(dequantize(raw, t.ggml_type, t.n_elements), reference(raw, t.ggml_type))
            seen.add(t.ggml_type)
            continue
        K, N = int(t.shape[0]), int(t.shape[1])
        w = QuantMatrix.from_gguf(g, name)
        for sl in _row_slices(N):
            want = reference(w.data[sl], t.ggml_type)
            ids = np.arange(sl.start, sl.stop)
            assert_bits_equal(get_rows(w, ids).reshape(-1), want)
            assert_bits_equal(dequantize(w.data[sl], t.ggml_type, ids.size * K), want)
        seen.add(t.ggml_type)
    assert {T.Q4_K, T.Q5_0, T.Q6_K, T.Q8_0, T.F32} <= seen
