"""Fused quantized matmul: every path (matvec, multi-row micro-kernel, F32 BLAS) agrees with x @ W^T."""
from __future__ import annotations

import threading

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants as ref
from hypothesis import given, settings
from hypothesis import strategies as st

from edgeinfer.backends.cpu import _kernels
from edgeinfer.backends.cpu.matmul import QuantMatrix, matmul, numba_threads, warm_kernels
from edgeinfer.backends.cpu.quants import get_rows
from edgeinfer.backends.cpu.quants import random_quant_rows

ALL = [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0,
       T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]


def dense(w: QuantMatrix) -> np.ndarray:
    return np.asarray(ref.dequantize(w.data, w.qtype), dtype=np.float64).reshape(w.N, w.K)


def assert_close(y: np.ndarray, x: np.ndarray, wd: np.ndarray) -> None:
    """Relative error per output, scaled by sum |x||w| (fp32 accumulation in any order)."""
    x64 = np.asarray(x, np.float64).reshape(-1, wd.shape[1])
    want = x64 @ wd.T
    scale = np.abs(x64) @ np.abs(wd).T + 1e-30
    err = np.abs(np.asarray(y, np.float64).reshape(want.shape) - want) / scale
    assert err.max() < 1e-4, f"max scaled error {err.max():.3g}"


def make(qtype, N, K, seed=0) -> QuantMatrix:
    rng = np.random.default_rng(seed)
    return QuantMatrix.from_bytes(random_quant_rows(qtype, N, K, rng), qtype, K, N)


@pytest.mark.parametrize("qtype", ALL, ids=lambda t: t.name)
@pytest.mark.parametrize("M", [1, 2, 4, 9, 70])   # matvec; micro-kernel padded, exact, multi-tile
def test_all_paths_match_reference(qtype, M):
    N, K = 53, 512                    # N not a multiple of the 16-row work chunk
    w = make(qtype, N, K, seed=M)
    x = np.random.default_rng(100 + M).standard_normal((M, K)).astype(np.float32)
    y = matmul(x, w)
    assert y.shape == (M, N) and y.dtype == np.float32
    assert_close(y, x, dense(w))


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K], ids=lambda t: t.name)
def test_vector_input_and_out_buffer(qtype):
    w = make(qtype, 40, 256)
    x = np.random.default_rng(1).standard_normal(256).astype(np.float32)
    y = matmul(x, w)
    assert y.shape == (40,)
    assert_close(y, x, dense(w))
    out = np.full((1, 40), np.nan, np.float32)
    assert matmul(x[None], w, out=out) is out
    np.testing.assert_array_equal(out[0], y)
    assert matmul(np.zeros((0, 256), np.float32), w).shape == (0, 40)
    with pytest.raises(ValueError):
        matmul(np.zeros((2, 255), np.float32), w)
    with pytest.raises(ValueError):
        matmul(x[None], w, out=np.empty((1, 41), np.float32))


def test_non_float32_and_strided_inputs_are_accepted():
    w = make(T.Q5_0, 24, 128)
    x = np.random.default_rng(2).standard_normal((6, 256))[:, ::2]   # float64, strided
    assert_close(matmul(x, w), x, dense(w))


def test_large_prefill_shape():
    # N spans many 16-row decode chunks with a partial last one; M spans two 64-row x tiles
    w = make(T.Q6_K, 1501, 1024, seed=5)
    x = np.random.default_rng(6).standard_normal((130, 1024)).astype(np.float32)
    assert_close(matmul(x, w), x, dense(w))


@settings(max_examples=15, deadline=None)
@given(qtype=st.sampled_from([T.Q8_0, T.Q5_0, T.Q4_K, T.Q6_K, T.Q4_0]),
       N=st.integers(1, 70), nblk=st.integers(1, 3), M=st.integers(1, 24), seed=st.integers(0, 2**16))
def test_shapes_property(qtype, N, nblk, M, seed):
    K = nblk * 256
    w = make(qtype, N, K, seed)
    x = np.random.default_rng(seed).standard_normal((M, K)).astype(np.float32)
    assert_close(matmul(x, w), x, dense(w))


def test_callable_from_a_worker_thread_and_deterministic():
    w = make(T.Q4_K, 300, 512)
    x = np.random.default_rng(3).standard_normal((4, 512)).astype(np.float32)
    main = [matmul(x[:1], w), matmul(x, w)]
    got = {}

    def work():
        got["y"] = [matmul(x[:1], w), matmul(x, w)]

    t = threading.Thread(target=work)
    t.start()
    t.join()
    for a, b in zip(main, got["y"]):
        np.testing.assert_array_equal(a, b)
    assert numba_threads() >= 1


def test_real_model_tensors(gemma3_path):
    from edgeinfer.formats.gguf_file import read_gguf

    g = read_gguf(str(gemma3_path))
    done = set()
    rng = np.random.default_rng(4)
    for name, t in g.tensors.items():
        if len(t.shape) != 2 or t.ggml_type in done:
            continue
        w = QuantMatrix.from_gguf(g, name)
        if w.N > 4096:                            # the embedding: check a row slice
            w = QuantMatrix(w.data[:4096], w.qtype, w.K, 4096)
        x = rng.standard_normal((5, w.K)).astype(np.float32)
        wd = dense(w)
        assert_close(matmul(x[0], w), x[0], wd)
        assert_close(matmul(x, w), x, wd)
        done.add(t.ggml_type)
    assert {T.Q4_K, T.Q5_0, T.Q6_K, T.Q8_0} <= done


def test_one_compiled_signature_per_kernel():
    """Odd inputs (read-only, float64, strided, int32 ids, writable weights) reuse the kernels."""
    warm_kernels([T.Q8_0])
    rng = np.random.default_rng(9)
    raw = random_quant_rows(T.Q8_0, 8, 64, rng)
    for data in (raw, raw.copy()):
        w = QuantMatrix(data, T.Q8_0, 64, 8)           # writable data is made read-only
        xr = rng.standard_normal((5, 64)).astype(np.float32)
        xr.flags.writeable = False
        matmul(xr[0], w)
        matmul(xr, w)
        matmul(rng.standard_normal((3, 128))[:, ::2], w)
        for ids in (np.array([1, 2], np.int32), np.arange(_kernels.SERIAL_ROWS + 4) % 8):
            ids = ids.astype(np.int32)          # a decode step's ids, then a prompt's
            ids.flags.writeable = False
            get_rows(w, ids)
    for kernel in (_kernels.rows_serial, _kernels.rows_driver, _kernels.matvec_driver,
                   _kernels.matmul_driver, *_kernels.SERIAL[int(T.Q8_0)]):
        assert len(kernel.signatures) == 1, kernel.signatures


def test_serial_kernels_take_their_types_block_sizes():
    """dec_T and dot_T carry their type's block sizes as literals: they must be D.BLOCK's."""
    import inspect
    import re

    from edgeinfer.backends.cpu import _decode as D
    for code, (dec, dot) in _kernels.SERIAL.items():
        bs, ts = D.BLOCK[code]
        assert re.search(rf"\b{bs}, {ts}, n0", inspect.getsource(dec.py_func)), dec
        assert re.search(rf"\b{ts}, n0", inspect.getsource(dot.py_func)), dot


@pytest.mark.parametrize("module", ["_kernels", "kernels", "_int8", "_actquant", "_geglu", "_norm",
                                    "_amx_bf16"])
def test_kernel_cache_stamp_is_current(module):
    """numba keys its disk cache on a kernel's own file; the hash there must cover its inlined
    deps (backends/cpu/_stamp.py)."""
    import importlib

    from edgeinfer.backends.cpu import _stamp
    mod = importlib.import_module(f"edgeinfer.backends.cpu.{module}")
    want = _stamp.deps_hash(mod._DEPS)
    assert mod._DEPS_HASH == want, f"update _DEPS_HASH in backends/cpu/{module}.py to {want!r}"
    assert mod._CACHE
