"""Integer-dot matmul on repacked weights (backends/cpu/repack.py, _int8.py).

Checks: repacking is lossless (decoded rows bit-equal gguf's dequantize), the product equals
the float64 product of the ggml-rounded activations and the dequantized weights, a row's
result is bit-identical alone and in any batch, and the VNNI kernel gives the same bits as the
portable one.
"""
from __future__ import annotations

import numba
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants as ref
from hypothesis import given, settings
from hypothesis import strategies as st

from edgeinfer.backends.cpu import _int8
from edgeinfer.backends.cpu import kernels as K
from edgeinfer.backends.cpu.matmul import matmul
from edgeinfer.backends.cpu.ops import CpuOps, repacked_bytes
from edgeinfer.backends.cpu.quants import QuantMatrix, random_quant_rows
from edgeinfer.backends.cpu.packed import SERIAL_MACS, packed_matmul
from edgeinfer.backends.cpu.repack import REPACKABLE, PackedMatrix

TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]
needs_vnni = pytest.mark.skipif(not _int8.HAVE_VNNI, reason="this CPU has no AVX-512 VNNI")


def make(qtype, N, K, seed=0) -> QuantMatrix:
    rng = np.random.default_rng(seed)
    return QuantMatrix.from_bytes(random_quant_rows(qtype, N, K, rng), qtype, K, N)


def dense(w: QuantMatrix) -> np.ndarray:
    return np.asarray(ref.dequantize(w.data, w.qtype), np.float32).reshape(w.N, w.K)


def ggml_rounded(x: np.ndarray, w: PackedMatrix) -> np.ndarray:
    rounder = K.act_round_q8_0 if w.A == 32 else K.act_round_q8_k
    return rounder(x, np.empty_like(x))


def test_every_legacy_and_k_quant_is_repackable():
    assert {int(t) for t in TYPES} == set(REPACKABLE)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("N", [37, 32])     # a partial last tile; full tiles (Q8_0's direct path)
def test_repacked_rows_are_exact(qtype, N):
    w = make(qtype, N, 512, seed=3)
    p = PackedMatrix.from_quant(w)
    rows = p.rows(np.arange(w.N))
    np.testing.assert_array_equal(rows.view(np.uint32), dense(w).view(np.uint32))
    ids = np.array([N - 1, 0, 17, 17])
    np.testing.assert_array_equal(p.rows(ids), dense(w)[ids])
    with pytest.raises(IndexError):
        p.rows(np.array([N]))


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0, T.Q4_0, T.Q5_0, T.Q5_1],
                         ids=lambda t: t.name)
def test_straight_from_bytes_repacking_equals_unpacking(qtype):
    """The one-pass kernels (tile_q4_k, tile_q6_k, tile_legacy, tile_q8_0) write the bytes
    of the general path: codes unpacked with numpy, then tile_codes."""
    from edgeinfer.backends.cpu import repack
    w = make(qtype, 48, 768, seed=11)
    direct = PackedMatrix.from_quant(w)
    codes, zp, d, sc, dm, mn = repack.unpack_parts(w)
    q = np.zeros_like(direct.q)
    h = np.zeros_like(direct.h)
    _int8.tile_codes(np.ascontiguousarray(codes), direct.bits, q, h)
    np.testing.assert_array_equal(direct.q, q)
    if direct.bits == 5:
        np.testing.assert_array_equal(direct.h, h)
    assert direct.zero_point == zp

    def tiles(a):
        return a.reshape(-1, 16, a.shape[1]).transpose(0, 2, 1)
    if sc is None:          # legacy: half scales (and minimums)
        np.testing.assert_array_equal(direct.s.view(np.float16).astype(np.float32), tiles(d))
        if dm is not None:
            np.testing.assert_array_equal(direct.o.view(np.float16).astype(np.float32), tiles(dm))
    else:
        np.testing.assert_array_equal(direct.s.astype(np.float32), tiles(sc))
        np.testing.assert_array_equal(direct.d.view(np.float16).astype(np.float32), tiles(d))
        assert direct.has_o == (dm is not None)
        if dm is not None:
            np.testing.assert_array_equal(direct.o.astype(np.float32), tiles(mn))
            np.testing.assert_array_equal(direct.dm.view(np.float16).astype(np.float32), tiles(dm))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("M", [1, 3, 4, 8, 13])
def test_product_matches_float64_reference(qtype, M):
    w = make(qtype, 53, 768, seed=M)
    p = PackedMatrix.from_quant(w)
    x = np.random.default_rng(M).standard_normal((M, w.K)).astype(np.float32)
    xr = ggml_rounded(x, p).astype(np.float64)
    want = xr @ dense(w).astype(np.float64).T
    scale = np.abs(xr) @ np.abs(dense(w)).astype(np.float64).T + 1e-30
    y = packed_matmul(x, p)
    assert y.shape == (M, w.N) and y.dtype == np.float32
    assert (np.abs(y - want) / scale).max() < 1e-5
    # and the float kernels on the same rounded activations agree to float32 summation order
    np.testing.assert_allclose(y, matmul(xr.astype(np.float32), w), rtol=0, atol=1e-5 * scale.max())


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K, T.Q6_K, T.Q5_1], ids=lambda t: t.name)
def test_a_row_is_bit_identical_alone_and_in_any_batch(qtype):
    w = make(qtype, 70, 512, seed=9)
    p = PackedMatrix.from_quant(w)
    x = np.random.default_rng(4).standard_normal((19, w.K)).astype(np.float32)
    alone = np.stack([packed_matmul(x[i:i + 1], p)[0] for i in range(len(x))])
    for m in (2, 3, 4, 5, 8, 9, 12, 16, 17, 19):
        np.testing.assert_array_equal(packed_matmul(x[:m], p), alone[:m])
    perm = np.random.default_rng(5).permutation(len(x))
    np.testing.assert_array_equal(packed_matmul(x[perm], p), alone[perm])


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q5_0], ids=lambda t: t.name)
def test_row_groups_across_chunks_of_tiles(qtype):
    """Products of 8 rows or more run each group of rows across a thread's chunk of tiles
    (_int8._make_tiles): with several tiles a chunk, 8-, 4- and 1-row groups and a partial
    last tile, every row has the bits of the row alone and of the portable loop."""
    _threads_for_parallel()
    w = make(qtype, 16 * 100 + 5, 256, seed=21)
    p = PackedMatrix.from_quant(w)
    assert _int8._chunk_tiles(101, numba.get_num_threads(), 21, 64) >= 2
    x = np.random.default_rng(22).standard_normal((21, w.K)).astype(np.float32)
    y, alone, ran = _products(x, p, range(len(x)))
    assert ran[0] > 1
    np.testing.assert_array_equal(y, alone)
    if _int8.HAVE_SIMD:
        np.testing.assert_array_equal(y, packed_matmul(x, p, use_vnni=False))


def _threads_for_parallel() -> int:
    """Give this thread numba's full team; the parallel path needs two threads or more."""
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    n = numba.get_num_threads()
    assert n >= 2, ("NUMBA_NUM_THREADS is 1: the parallel int8 path cannot run, so these "
                    "batch-invariance tests would check the serial path only")
    return n


def _products(x, p, rows) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """The batched product, each row alone, and the thread count each call ran on."""
    ran: list[int] = []
    real = _int8.run_matmuls

    def spy(*args):
        ran.append(int(args[-2]))        # nw: 1 = serial, > 1 = the parallel kernel
        return real(*args)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_int8, "run_matmuls", spy)
        y = packed_matmul(x, p)
        alone = np.stack([packed_matmul(x[i:i + 1], p)[0] for i in rows])
    return y, alone, ran


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K, T.Q6_K, T.Q4_0], ids=lambda t: t.name)
def test_row_alone_serial_equals_row_in_parallel_batch(qtype):
    """A lone row (under SERIAL_MACS: the calling thread) and the same row inside a batch big
    enough for the parallel kernel give the same bits."""
    nthreads = _threads_for_parallel()
    w = make(qtype, 128, 1024, seed=3)
    p = PackedMatrix.from_quant(w)
    x = np.random.default_rng(8).standard_normal((8, w.K)).astype(np.float32)
    assert 1 * w.K * w.N < SERIAL_MACS <= len(x) * w.K * w.N      # the sizes span the threshold
    y, alone, ran = _products(x, p, range(len(x)))
    assert ran[0] == nthreads and set(ran[1:]) == {1}, ran
    np.testing.assert_array_equal(y, alone)


@settings(max_examples=25, deadline=None)
@given(qtype=st.sampled_from(TYPES), n=st.integers(1, 160), kb=st.sampled_from([1, 4]),
       m=st.integers(1, 12), seed=st.integers(0, 2**16))
def test_batch_invariance_fuzzed(qtype, n, kb, m, seed):
    """Sizes on both sides of SERIAL_MACS (up to 12 x 1024 x 160 multiply-adds), so both the
    serial and the parallel kernel run; each call is checked to take the path its size asks."""
    nthreads = _threads_for_parallel()
    w = make(qtype, n, 256 * kb, seed=seed)
    p = PackedMatrix.from_quant(w)
    x = np.random.default_rng(seed).standard_normal((m, w.K)).astype(np.float32) * 3
    y, alone, ran = _products(x, p, range(m))
    want = [nthreads if rows * w.K * w.N >= SERIAL_MACS else 1 for rows in [m] + [1] * m]
    assert ran == want
    np.testing.assert_array_equal(alone, y)


def _slow_except(types, keep):
    """Each forced kernel compiles one closure per format (~10 s): the default run checks the
    bundled model's formats, `-m slow` every other."""
    return [t if t in keep else pytest.param(t, marks=pytest.mark.slow) for t in types]


@needs_vnni
@pytest.mark.parametrize("qtype", _slow_except(TYPES, (T.Q8_0, T.Q5_0, T.Q4_K, T.Q6_K)),
                         ids=lambda t: t.name)
def test_vnni_kernel_equals_portable_kernel(qtype):
    w = make(qtype, 48, 512, seed=11)
    p = PackedMatrix.from_quant(w)
    x = np.random.default_rng(6).standard_normal((13, w.K)).astype(np.float32)
    np.testing.assert_array_equal(packed_matmul(x, p, use_vnni=True),
                                  packed_matmul(x, p, use_vnni=False))


def test_zero_rows_and_zero_blocks():
    w = make(T.Q4_K, 16, 512)
    p = PackedMatrix.from_quant(w)
    x = np.zeros((3, 512), np.float32)
    x[1, :256] = 1.0                     # one all-zero Q8_K activation block
    y = packed_matmul(x, p)
    assert np.all(y[0] == 0) and np.all(y[2] == 0)
    np.testing.assert_allclose(y[1], dense(w)[:, :256].sum(axis=1), rtol=1e-5, atol=1e-5)


def test_cpu_ops_repack_setting(monkeypatch, gemma3_path):
    from edgeinfer.formats.gguf_file import read_gguf
    gf = read_gguf(gemma3_path)
    ops = CpuOps(repack=False)
    assert isinstance(ops.matrix(gf, "blk.0.attn_q.weight"), QuantMatrix)
    assert "gguf" in ops.weights_format
    ops = CpuOps(repack=True)
    w = ops.matrix(gf, "blk.0.attn_q.weight")
    assert isinstance(w, PackedMatrix) and "int8" in ops.weights_format
    x = np.random.default_rng(0).standard_normal((2, w.K)).astype(np.float32)
    plain = CpuOps(repack=False)
    np.testing.assert_allclose(ops.matmul(x, w), plain.matmul(x, plain.matrix(gf, "blk.0.attn_q.weight")),
                               rtol=0, atol=1e-4)
    assert ops.matmul(x[0], w).shape == (w.N,)
    with pytest.raises(ValueError, match="ggml"):
        CpuOps(numerics="f32", repack=True)
    # what the decision weighs: gemma3 270M repacked is about its file (codes at their own bits)
    assert 200e6 < repacked_bytes(gf) < 400e6


def test_parallel_result_is_the_serial_result_every_time():
    """Dynamic tile scheduling (atomic counter) must cover every tile exactly once, call after
    call, with allocations happening in between."""
    import numba
    w = make(T.Q8_0, 4096, 640, seed=2)
    p = PackedMatrix.from_quant(w)
    x = np.random.default_rng(2).standard_normal((3, w.K)).astype(np.float32)
    n = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        ref = packed_matmul(x, p)
    finally:
        numba.set_num_threads(n)
    for _ in range(200):
        np.testing.assert_array_equal(packed_matmul(x, p), ref)
        _ = [np.ones(1, np.int64) for _ in range(3)]


# -- the compact layout: codes at the format's own bits, half scales ------------------------

def _act_codes(x, p):
    from edgeinfer.backends.cpu import _actquant
    M, Kx = x.shape
    nb = Kx // p.B
    qa = np.empty((M, Kx), np.int8)
    da, bsf = np.empty((nb, M), np.float32), np.empty((nb, M), np.float32)
    zb = np.empty((nb, M), np.int32)
    _actquant.quantize_rows(x, p.A, p.B, p.zero_point, qa, da, bsf, zb, False)
    return qa, da, bsf, zb


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_product_bits_match_a_numpy_model_of_the_arithmetic(qtype):
    """Independent of the tile layout. Legacy formats: per block, in float32, t = s * (isum -
    zb) [+ o * bsf] and acc += da * t, blocks in order. K-quants: per 256-column super-block,
    I = sum of sc * (isum - zb) and Imn = sum of mn * (block sum) exactly in int64 (the kernel's
    int32 cannot overflow), t = d * float(I) [- dm * float(Imn)], acc += da * t (numpy rounds
    each op, as the kernel does)."""
    from edgeinfer.backends.cpu.repack import unpack_parts
    w = make(qtype, 37, 512, seed=21)
    p = PackedMatrix.from_quant(w)
    codes, zp, d, sc, dm, mn = unpack_parts(w)
    x = np.random.default_rng(22).standard_normal((5, w.K)).astype(np.float32)
    qa, da, bsf, zb = _act_codes(x, p)
    sums = np.stack([qa[:, b * p.B:(b + 1) * p.B].astype(np.int64).sum(1)
                     for b in range(w.K // p.B)])                                    # [nb, M]
    np.testing.assert_array_equal(zb, sums if dm is not None else zp * sums)         # block_zb
    want = np.zeros((5, w.N), np.float32)
    c64 = codes.astype(np.int64) - zp
    isums = [qa[:, b * p.B:(b + 1) * p.B].astype(np.int64) @ c64[:, b * p.B:(b + 1) * p.B].T
             for b in range(w.K // p.B)]                                              # [M, N]
    if sc is None:
        for b, isum in enumerate(isums):
            t = d[:, b].astype(np.float32) * isum.astype(np.float32)
            if dm is not None:
                t = t + dm[:, b].astype(np.float32) * bsf[b][:, None]
            want = want + da[b][:, None] * t
    else:
        per = 256 // p.B
        for sb in range(w.K // 256):
            blocks = range(sb * per, (sb + 1) * per)
            i_sc = sum(isums[b] * sc[:, b].astype(np.int64) for b in blocks)
            assert np.abs(i_sc).max() < 2 ** 31
            t = d[:, sb].astype(np.float32) * i_sc.astype(np.float32)
            if dm is not None:
                i_mn = sum(sums[b][:, None] * mn[:, b].astype(np.int64) for b in blocks)
                t = t - dm[:, sb].astype(np.float32) * i_mn.astype(np.float32)
            want = want + da[sb * per][:, None] * t
    for vnni in ([False, True] if _int8.HAVE_VNNI else [False]):
        np.testing.assert_array_equal(packed_matmul(x, p, use_vnni=vnni).view(np.uint32),
                                      want.view(np.uint32))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("N", [37, 32])
def test_packed_nbytes_is_the_real_size(qtype, N):
    from edgeinfer.backends.cpu.repack import packed_nbytes
    w = make(qtype, N, 512)
    p = PackedMatrix.from_quant(w)
    assert packed_nbytes(qtype, w.K, N) == p.nbytes
    if N % 16 == 0:
        if qtype in (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q6_K):
            assert p.nbytes == w.nbytes      # exactly the GGUF's bytes
        else:            # Q4_K 4.625 bits (4.5), Q5_K 5.625 (5.5); Q2_K, Q3_K as 4-bit codes
            assert p.nbytes <= w.nbytes * {T.Q4_K: 1.03, T.Q5_K: 1.03, T.Q3_K: 1.33,
                                           T.Q2_K: 1.96}[qtype]
    assert p.bits == {T.Q8_0: 8, T.Q6_K: 6, T.Q5_0: 5, T.Q5_1: 5, T.Q5_K: 5}.get(qtype, 4)


def test_half_widening_is_exact_for_every_half():
    from numba import njit

    @njit
    def widen_all(h, out):
        for i in range(h.size):
            out[i] = _int8.widen(h[i])
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    got = np.empty(h.size, np.float32)
    widen_all(h, got)
    want = h.view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q5_1, T.Q8_0], ids=lambda t: t.name)
def test_subnormal_and_signed_half_scales(qtype):
    """Half scales the kernels widen: subnormals, negative zero, large values."""
    w = make(qtype, 32, 256, seed=5)
    blocks = w.blocks.copy()
    halves = np.array([0x0001, 0x03FF, 0x8001, 0x8000, 0x7BFF, 0x0400, 0xFBFF, 0x3C00], np.uint16)
    d = halves[np.arange(blocks.shape[0] * blocks.shape[1]) % halves.size]
    blocks[:, :, 0:2] = d.reshape(blocks.shape[0], blocks.shape[1], 1).view(np.uint8).reshape(
        blocks.shape[0], blocks.shape[1], 2)
    w2 = QuantMatrix.from_bytes(blocks.reshape(w.N, -1), qtype, w.K, w.N)
    p = PackedMatrix.from_quant(w2)
    np.testing.assert_array_equal(p.rows(np.arange(w2.N)).view(np.uint32),
                                  dense(w2).view(np.uint32))
    x = np.random.default_rng(7).standard_normal((3, w.K)).astype(np.float32)
    y = packed_matmul(x, p, use_vnni=False)
    if _int8.HAVE_VNNI:
        np.testing.assert_array_equal(packed_matmul(x, p, use_vnni=True).view(np.uint32),
                                      y.view(np.uint32))
    assert np.isfinite(y).all()


@pytest.mark.parametrize("qtypes", [(T.Q5_0, T.Q5_0, T.Q8_0), (T.Q5_0, T.Q5_0), (T.Q4_K, T.Q6_K, T.Q8_0)],
                         ids=lambda ts: "-".join(t.name for t in ts))
def test_int8_matmul_many_gives_each_matrix_its_own_bits(qtypes):
    """Several matrices in one parallel region: each output as int8_matmul alone gives it."""
    nthreads = _threads_for_parallel()
    x = np.random.default_rng(31).standard_normal((3, 512)).astype(np.float32)
    ps = [PackedMatrix.from_quant(make(t, n, 512, seed=n)) for t, n in zip(qtypes, (70, 16, 40))]
    jobs, alone = [], []
    for p in ps:
        qa, da, bsf, zb = _act_codes(x, p)
        out = np.full((3, p.N), np.nan, np.float32)
        jobs.append((p.q, p.h, p.s, p.o, p.d, p.dm, p.fmt, qa, da, bsf, zb, out))
        ref = np.empty((3, p.N), np.float32)
        _int8.int8_matmul(p.q, p.h, p.s, p.o, p.d, p.dm, p.fmt, qa, da, bsf, zb, ref,
                          _int8.HAVE_VNNI, 1, np.zeros(1, np.int64))
        alone.append(ref)
    for nw in (1, nthreads):
        for j in jobs:
            j[-1][:] = np.nan
        _int8.int8_matmul_many(jobs, _int8.HAVE_VNNI, nw, np.zeros(1, np.int64))
        for j, ref in zip(jobs, alone):
            np.testing.assert_array_equal(j[-1].view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("isa", sorted(set(_int8.HOST_ISAS) - {_int8.PORTABLE}),
                         ids=lambda i: {v: k for k, v in _int8.ISA_NAMES.items()}[i])
@pytest.mark.parametrize("qtype", _slow_except([T.Q8_0, T.Q5_0, T.Q4_1, T.Q4_K, T.Q5_K, T.Q6_K],
                                               (T.Q8_0, T.Q5_0, T.Q4_K, T.Q6_K)),
                         ids=lambda t: t.name)
def test_every_vector_kernel_of_this_cpu_equals_the_portable_one(qtype, isa):
    """AVX2 (vpmaddubsw; 8-bit codes through the sign trick), AVX-VNNI and AVX-512 VNNI tile
    kernels, forced one by one: the portable loop's bits, 1 to 13 rows."""
    name = {v: k for k, v in _int8.ISA_NAMES.items()}[isa]
    w = make(qtype, 48, 512, seed=12)
    p = PackedMatrix.from_quant(w)
    x = np.random.default_rng(13).standard_normal((13, w.K)).astype(np.float32) * 4
    x[2, :40] = 0.0
    for m in (1, 5, 13):
        np.testing.assert_array_equal(packed_matmul(x[:m], p, use_vnni=name).view(np.uint32),
                                      packed_matmul(x[:m], p, use_vnni=False).view(np.uint32))


@pytest.mark.parametrize("isa", sorted(set(_int8.HOST_ISAS) - {_int8.PORTABLE}),
                         ids=lambda i: {v: k for k, v in _int8.ISA_NAMES.items()}[i])
@pytest.mark.parametrize("qtype,fill", [(T.Q4_K, 0xFF), (T.Q5_K, 0xFF), (T.Q6_K, 0xFF),
                                        (T.Q8_0, 0xFF), (T.Q8_0, 0x00)],
                         ids=["Q4_K", "Q5_K", "Q6_K", "Q8_0-max", "Q8_0-min"])
def test_vector_kernels_at_the_largest_codes(qtype, fill, isa):
    """Every code at its format's extreme (15, 31, 63; Q8_0's 127 and -128) times activation
    codes of +-127: the AVX2 kernel's 16-bit pair sums (vpmaddubsw, summed over up to 8 quads
    before widening) stay exact there, as in every vector kernel."""
    name = {v: k for k, v in _int8.ISA_NAMES.items()}[isa]
    p = PackedMatrix.from_quant(make(qtype, 32, 512, seed=5))
    p.q[:] = fill
    p.h[:] = fill
    x = np.ones((9, p.K), np.float32)
    x[1::3] = -1.0
    x[2::3, 1::2] = -1.0
    np.testing.assert_array_equal(packed_matmul(x, p, use_vnni=name).view(np.uint32),
                                  packed_matmul(x, p, use_vnni=False).view(np.uint32))


@pytest.mark.parametrize("isa", sorted(set(_int8.HOST_ISAS) - {_int8.PORTABLE}),
                         ids=lambda i: {v: k for k, v in _int8.ISA_NAMES.items()}[i])
@pytest.mark.parametrize("qtype", [t for t in TYPES if t != T.Q8_0], ids=lambda t: t.name)
def test_prefill_on_unpacked_codes_gives_the_portable_bits(qtype, isa):
    """Products of UNPACK_MIN_ROWS rows or more of 5- and 6-bit codes unpack a thread's
    tiles to a byte per code, UNPACKED_BYTES at a time, and run the 8-bit tile loop on them:
    the portable loop's bits, over several such batches of tiles, a partial last tile, and
    8-, 4- and 1-row groups (the other formats, the packed loop, at the same sizes)."""
    name = {v: k for k, v in _int8.ISA_NAMES.items()}[isa]
    K_ = 4096
    tiles_a_batch = max(1, _int8.UNPACKED_BYTES // (K_ * 16))
    N = 16 * (2 * tiles_a_batch + 1) + 5            # three batches, the last tile partial
    p = PackedMatrix.from_quant(make(qtype, N, K_, seed=21))
    M = _int8.UNPACK_MIN_ROWS + 13                  # groups of 8, then 4, then 1
    x = np.random.default_rng(22).standard_normal((M, K_)).astype(np.float32) * 3
    x[3, :300] = 0.0
    want = packed_matmul(x, p, use_vnni=False).view(np.uint32)
    np.testing.assert_array_equal(packed_matmul(x, p, use_vnni=name).view(np.uint32), want)
    for m in (1, 7):                                # below the threshold: packed tiles
        np.testing.assert_array_equal(packed_matmul(x[:m], p, use_vnni=name).view(np.uint32),
                                      want[:m])


def test_isa_detection_is_honest():
    feats = _int8._FEATURES
    assert _int8.HAVE_VNNI == bool(feats.get("avx512vnni") and feats.get("avx512bw"))
    assert (_int8.AVX2 in _int8.HOST_ISAS) == bool(feats.get("avx2") and feats.get("f16c"))
    assert _int8.isa_of(True) == _int8.BEST_ISA and _int8.isa_of(False) == _int8.PORTABLE
    for name, isa in _int8.ISA_NAMES.items():
        if isa not in _int8.HOST_ISAS:
            with pytest.raises(ValueError):
                _int8.isa_of(name)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1])
def test_legacy_one_pass_repack_equals_the_unpacked_path(qtype):
    """tile_legacy (whole tiles) against tile_codes on unpack_parts' codes (which a last,
    padded tile still takes): the same bytes in every array of the first tiles."""
    rng = np.random.default_rng(int(qtype))
    K = 96
    rows = random_quant_rows(qtype, 33, K, rng)
    fast = PackedMatrix.from_quant(QuantMatrix.from_bytes(rows[:32].reshape(-1), qtype, K, 32))
    slow = PackedMatrix.from_quant(QuantMatrix.from_bytes(rows.reshape(-1), qtype, K, 33))
    for name in ("q", "h", "s", "o"):
        a, b = getattr(fast, name), getattr(slow, name)
        if name == "h" and fast.bits != 5:
            continue
        np.testing.assert_array_equal(a, b[:2], err_msg=name)
    assert (fast.has_o, fast.zero_point, fast.fmt) == (slow.has_o, slow.zero_point, slow.fmt)
    np.testing.assert_array_equal(fast.rows(np.arange(32)), slow.rows(np.arange(32)))


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q5_0, T.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("M", [1, 5, 17, 40])
def test_swiglu_matmul_is_matmul_of_swiglu(qtype, M):
    """CpuOps.swiglu_matmul (SwiGLU straight into the activation codes) has the bits of
    matmul(swiglu(gate, up)), on the vector and the portable kernel, and with weights that
    are not repacked."""
    from edgeinfer.backends.cpu import _swiglu
    from edgeinfer.backends.cpu.packed import packed_swiglu_matmul
    w = make(qtype, 48, 512, seed=M)
    p = PackedMatrix.from_quant(w)
    rng = np.random.default_rng(M + 1)
    g = (rng.standard_normal((M, 512)) * 3).astype(np.float32)
    u = rng.standard_normal((M, 512)).astype(np.float32)
    h = _swiglu.swiglu(g, u, np.empty_like(g), False)
    for vnni in ([True, False] if _int8.HAVE_SIMD else [False]):
        np.testing.assert_array_equal(packed_swiglu_matmul(g, u, p, use_vnni=vnni),
                                      packed_matmul(h, p, use_vnni=vnni))
    ops = CpuOps(repack=True)
    np.testing.assert_array_equal(ops.swiglu_matmul(g.copy(), u, p), ops.matmul(h, p))
    plain = CpuOps(repack=False)
    np.testing.assert_array_equal(plain.swiglu_matmul(g.copy(), u, w), plain.matmul(h, w))


def test_padded_activation_entries_give_the_same_bits():
    """int8_matmul reads da, bsf, zb with their row stride S >= M (packed.ActCodes pads it,
    _actquant.entry_stride): the same bits as the [nb, M] layout."""
    from edgeinfer.backends.cpu import _actquant
    w = make(T.Q6_K, 64, 512, seed=4)
    p = PackedMatrix.from_quant(w)
    x = np.random.default_rng(9).standard_normal((24, 512)).astype(np.float32)
    M, nb = 24, 512 // p.B
    outs = []
    for S in (M, _actquant.entry_stride(M)):
        qa = np.empty((M, 512), np.int8)
        da, bsf = np.empty((nb, S), np.float32), np.empty((nb, S), np.float32)
        zb = np.empty((nb, S), np.int32)
        _actquant.quantize_rows(x, p.A, p.B, p.zero_point, qa, da, bsf, zb, False)
        for vnni in ([True, False] if _int8.HAVE_SIMD else [False]):
            out = np.empty((M, p.N), np.float32)
            _int8.int8_matmul(p.q, p.h, p.s, p.o, p.d, p.dm, p.fmt, qa, da, bsf, zb, out,
                              vnni, 2, np.zeros(1, np.int64))
            outs.append(out)
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])
    with pytest.raises(ValueError, match="S >= M"):
        _int8.int8_matmul(p.q, p.h, p.s, p.o, p.d, p.dm, p.fmt, qa, da[:, :4].copy(),
                          bsf, zb, np.empty((M, p.N), np.float32), True, 1, np.zeros(1, np.int64))
