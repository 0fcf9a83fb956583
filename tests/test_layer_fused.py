"""The fused decoder-layer kernels (backends/cpu/_layer.py) give the bits of the ops they fuse.

ops.norm_qkv must equal add, rms_norm, matmuls (q, k, v) and norm_rope of q and k; and
ops.out_add_norm must equal matmul, add and rms_norm, bit for bit (np.array_equal), for every
repackable weight type, several row counts, and one or two threads. qwen3moe's forward, which
takes them for steps of a few tokens, must give the logits of the unfused forward.
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numba
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

from edgeinfer.backends.cpu import _int8, _layer, _stamp
from edgeinfer.backends.cpu.ops import CpuOps
from edgeinfer.backends.cpu.quants import QuantMatrix
from edgeinfer.backends.cpu.repack import PackedMatrix
from edgeinfer.runners.base import ScheduledSpan
from synth_archs import variant_model

CACHE = Path(__file__).resolve().parent.parent / ".cache" / "test-models" / "synth-archs"

needs_simd = pytest.mark.skipif(not _int8.HAVE_SIMD, reason="no vector tile kernel here")


def test_kernel_cache_stamp_is_current():
    want = _stamp.deps_hash(_layer._DEPS)
    assert _layer._DEPS_HASH == want, f"update _DEPS_HASH in backends/cpu/_layer.py to {want!r}"
    assert _layer._CACHE


# where a k-quant block keeps its f16 scales (d, dmin), which random bytes must not make
# NaN or infinite (gguf's quantizer writes only the legacy formats)
_HALVES = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.Q2_K: (80, 82), Q.Q3_K: (108,)}


def _packed(rng, qtype, N: int, K: int) -> PackedMatrix:
    if qtype in _HALVES:
        bs, ts = GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (N, K // bs, ts), dtype=np.uint8)
        for o in _HALVES[qtype]:
            d = rng.uniform(1e-3, 2e-2, (N, K // bs)).astype(np.float16)
            raw[:, :, o:o + 2] = d.view(np.uint8).reshape(N, K // bs, 2)
        raw = raw.reshape(-1)
    else:
        w = (rng.standard_normal((N, K)) * 0.1).astype(np.float32)
        raw = quantize(w, qtype).reshape(-1)
    return PackedMatrix.from_quant(QuantMatrix.from_bytes(raw, qtype, K, N))


def _batch(T: int) -> SimpleNamespace:
    # what ops._rope_tables reads of a ForwardBatch
    return SimpleNamespace(positions=np.arange(7, 7 + T, dtype=np.int32), cache={})


# (q/k type, v type, o type): k-quants with and without offsets, the legacy formats (Q8_0's
# activation blocks of 32), mixed formats in one call, a width of 16-row blocks (Q6_K)
TYPES = [(Q.Q4_K, Q.Q6_K, Q.Q4_K), (Q.Q8_0, Q.Q8_0, Q.Q8_0), (Q.Q5_K, Q.Q4_0, Q.Q6_K),
         (Q.Q4_1, Q.Q5_0, Q.Q5_1), (Q.Q2_K, Q.Q3_K, Q.Q8_0)]


@needs_simd
@pytest.mark.parametrize("types", TYPES, ids=lambda t: "-".join(x.name for x in t))
@pytest.mark.parametrize("T", [1, 3, 9])
@pytest.mark.parametrize("threads", [1, 2])
def test_fused_layer_ops_are_the_ops(types, T, threads):
    rng = np.random.default_rng(T)
    X, H, KVH, D = 512, 8, 2, 64
    wq, wk, wv = (_packed(rng, t, n, X) for t, n in ((types[0], H * D), (types[0], KVH * D),
                                                      (types[1], KVH * D)))
    wo = _packed(rng, types[2], X, H * D)
    wn, wn2, qn, kn = (rng.uniform(0.5, 1.5, n).astype(np.float32) for n in (X, X, D, D))
    x = rng.standard_normal((T, X)).astype(np.float32)
    y = rng.standard_normal((T, X)).astype(np.float32)
    a = rng.standard_normal((T, H * D)).astype(np.float32)
    eps, base = 1e-6, 1e6
    ops = CpuOps(repack=True)
    assert ops.fused_layer_rows(T, X, (wq, wk, wv, wo))
    prev = numba.get_num_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    try:
        for add in (None, y):
            # the ops, one by one
            x1 = x.copy()
            if add is not None:
                x1 = ops.add(x1, add)
            h = ops.rms_norm(x1, wn, eps)
            q1, k1, v1 = ops.matmuls(h, (wq, wk, wv))
            b1 = _batch(T)
            q1 = ops.norm_rope(q1.reshape(T, H, D), qn, eps, b1, base, 1.0, True)
            k1 = ops.norm_rope(k1.reshape(T, KVH, D), kn, eps, b1, base, 1.0, True)
            # fused
            x2 = x.copy()
            q2, k2, v2 = ops.norm_qkv(x2, add, wn, eps, (wq, wk, wv), (H, KVH), qn, kn,
                                      _batch(T), base, 1.0, True, None, threads)
            assert np.array_equal(x1, x2)
            assert np.array_equal(q1.reshape(T, -1), q2)
            assert np.array_equal(k1.reshape(T, -1), k2)
            assert np.array_equal(v1, v2)
        x1 = x.copy()
        x1 = ops.add(x1, ops.matmul(a, wo))
        h1 = ops.rms_norm(x1, wn2, eps)
        x2 = x.copy()
        h2 = ops.out_add_norm(a, wo, x2, wn2, eps, threads)
        assert np.array_equal(x1, x2)
        assert np.array_equal(h1, h2)
        # and the SwiGLU FFN of h in the same call (gate and up of different formats here)
        F = 768
        gate, up = _packed(rng, types[0], F, X), _packed(rng, types[1], F, X)
        down = _packed(rng, types[2], X, F)
        fl = ops.fused_layer(wn, eps, (wq, wk, wv), (H, KVH), qn, kn, True, wo, wn2,
                             ffn=(gate, up, down))
        assert fl.ffn is not None and fl.ffn.takes(T)
        x3 = x.copy()
        f = fl.attn_out_ffn(a, x3, threads)
        assert np.array_equal(x1, x3)
        assert np.array_equal(f, ops.swiglu_matmul(*ops.matmuls(h1, (gate, up)), down))
        # the step's end: the last residual add, final norm and output matrix (also one
        # whose rows end in a partial tile of 16)
        out_w = wq if T != 3 else _packed(rng, types[1], 40, X)
        head = ops.fused_head(wn2, eps, out_w)
        for add in (None, y):
            x1 = x.copy()
            if add is not None:
                x1 = ops.add(x1, add)
            want = ops.matmul(ops.rms_norm(x1, wn2, eps), out_w)
            x2 = x.copy()
            assert np.array_equal(head(x2, add, threads), want)
            assert np.array_equal(x1, x2)
    finally:
        numba.set_num_threads(prev)


def test_not_fused_when_a_matrix_is_not_repacked_or_the_step_is_large():
    rng = np.random.default_rng(0)
    w = _packed(rng, Q.Q8_0, 64, 256)
    ops = CpuOps(repack=True)
    assert ops.fused_layer_rows(1, 256, (w, w))
    assert not ops.fused_layer_rows(512, 256, (w, w))          # a prefill: the parallel ops
    raw = quantize(rng.standard_normal((64, 256)).astype(np.float32), Q.Q8_0).reshape(-1)
    assert not ops.fused_layer_rows(1, 256, (w, QuantMatrix.from_bytes(raw, Q.Q8_0, 256, 64)))
    assert not CpuOps(numerics="f32").fused_layer_rows(1, 256, (w,))


def _span(seq: int, start: int, toks, table) -> ScheduledSpan:
    return ScheduledSpan(seq, start, tuple(toks), tuple(int(b) for b in table), True)


def _logits(path: Path, fused: bool, kv: str | None = None) -> tuple[np.ndarray, int]:
    """A prefill, decode steps of one token, then decode steps of two sequences at once; the
    logits of every step, and how many forwards took the fused layers."""
    from edgeinfer.runners.native import ModelRunner
    r = ModelRunner.load(str(path), kv_budget_bytes=32 << 20, kv_cache_type=kv)
    model = r.model
    real = model._fusable
    took = []

    def fusable(batch):
        ok = fused and real(batch)
        took.append(ok)
        return ok
    model._fusable = fusable
    return _steps(r), sum(took)


def _steps(r) -> np.ndarray:
    """A prefill, decode steps of one token, then decode steps of two sequences at once,
    on runner r: the logits of every step."""
    toks = [int(t) for t in np.random.default_rng(1).integers(3, 250, 40)]
    ta, tb = list(range(0, 4)), list(range(4, 8))
    rows = [r.forward([_span(0, 0, toks[:20], ta)])]
    rows += [r.forward([_span(0, i, [toks[i]], ta)]) for i in range(20, 26)]
    rows.append(r.forward([_span(1, 0, toks[5:17], tb)]))
    for i in range(26, 32):       # two sequences' decode rows in one step
        rows.append(r.forward([_span(0, i, [toks[i]], ta), _span(1, i - 14, [toks[i]], tb)]))
    return np.concatenate(rows)


@pytest.mark.parametrize("ftype,kv", [("Q4_K_M", None), ("Q8_0", None), ("Q4_K_M", "q8_0")])
def test_qwen3moe_fused_forward_gives_the_same_logits(ftype, kv):
    """One- and two-token steps with the f16 cache (LayerStep's own attention calls) and
    the q8_0 one (ops.attention)."""
    path = variant_model(CACHE, "qwen3moe", ftype)
    fused, n = _logits(path, True, kv)
    plain, _ = _logits(path, False, kv)
    if _int8.HAVE_SIMD:
        assert n >= 12            # the decode steps (one and two rows) took the fused layers
    assert np.array_equal(fused, plain)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("starts", [(5,), (600,), (2100,), (40, 2100)])
@pytest.mark.parametrize("kv", ["f16", "q8_0"])
def test_layer_step_attends_as_ops_attention(threads, starts, kv):
    """ops.layer_step's attend (the per-step choices made once: split or tiled kernel, heads
    per item, parallel from less work than ops.attention) writes the cache and attends as
    ops.attention, short and long contexts (600 keys: parallel here, serial there; a lone
    token's long context splits over two threads), one sequence or two; a q8_0 cache goes
    through ops.attention itself."""
    from edgeinfer.backends.base import ForwardBatch
    rng = np.random.default_rng(len(starts))
    H, KVH, D, bs = 8, 1, 64, 16
    ops = CpuOps(repack=True, kv_cache_type=kv)
    per_seq = max(starts) // bs + 2
    caches = [ops.new_kv_cache(1, per_seq * len(starts), bs, KVH, D) for _ in range(2)]
    pool = caches[0].k[0]
    if kv == "f16":     # finite halves
        fills = [rng.uniform(-1, 1, pool.size).astype(np.float16).view(np.uint8) for _ in "kv"]
    else:               # q8_0 blocks: an f16 scale, 32 int8 codes
        fills = [rng.integers(0, 256, pool.nbytes, dtype=np.uint8) for _ in "kv"]
        for f in fills:
            f.reshape(-1, 34)[:, :2] = np.full((1,), 0.01, np.float16).view(np.uint8)
    for c in caches:
        c.k[0].reshape(-1).view(np.uint8)[:] = fills[0]
        c.v[0].reshape(-1).view(np.uint8)[:] = fills[1]
    tables = np.arange(per_seq * len(starts), dtype=np.int32).reshape(len(starts), per_seq)
    T = len(starts)
    pos = np.array(starts, np.int32)
    slots = np.array([tables[s, p // bs] * bs + p % bs for s, p in enumerate(starts)], np.int64)

    def batch():
        return ForwardBatch(np.zeros(T, np.int32), pos, slots, np.arange(T, dtype=np.int32),
                            tables, np.arange(T, dtype=np.int64))
    q, k, v = (rng.standard_normal((T, h, D)).astype(np.float32) for h in (H, KVH, KVH))
    prev = numba.get_num_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    try:
        want = ops.attention(q.copy(), k.copy(), v.copy(), caches[0], 0, batch(), 0.125, 0)
        step = ops.layer_step(batch(), H, KVH, D, 0.125, 1e4, 1.0)
        assert step.fast == (kv == "f16")
        if step.fast:       # the lone long-context token: split over the threads
            assert step.plan.split == (T == 1 and starts[0] >= 2048 and numba.get_num_threads() > 1)
        got = step.attend(q.copy(), k.copy(), v.copy(), caches[1], 0)
    finally:
        numba.set_num_threads(prev)
    assert np.array_equal(want, got)
    assert np.array_equal(caches[0].k[0], caches[1].k[0])
    assert np.array_equal(caches[0].v[0], caches[1].v[0])


def test_layer_step_rope_rows_are_rope_tables():
    """A one-token step's rope rows (kept by position) are kernels.rope_tables' for that
    position, whether computed for this step or kept from an earlier one."""
    from edgeinfer.backends.base import ForwardBatch
    from edgeinfer.backends.cpu.kernels import rope_tables
    ops = CpuOps(repack=True)
    pos = np.array([3, 700, 4095], np.int32)
    for _ in range(2):          # computed, then kept
        for i, p in enumerate(pos):
            cos, sin = rope_tables(pos[i:i + 1], 64, 1e6, 1.0)
            b = ForwardBatch(np.zeros(1, np.int32), pos[i:i + 1], np.zeros(1, np.int64),
                             np.zeros(1, np.int32), np.zeros((1, 1), np.int32),
                             np.zeros(1, np.int64))
            step = ops.layer_step(b, 8, 1, 64, 0.125, 1e6, 1.0)
            assert np.array_equal(step.cos, cos) and np.array_equal(step.sin, sin)


def _llama_logits(path: Path, fused: bool, kv: str | None = None) -> tuple[np.ndarray, int]:
    """_logits' steps on a llama-family model (models/llama.py), its fused path on or off;
    with how many forwards took it."""
    from edgeinfer.models.llama import LlamaModel
    from edgeinfer.runners.native import ModelRunner
    r = ModelRunner.load(str(path), kv_budget_bytes=32 << 20, kv_cache_type=kv)
    model = r.model
    assert isinstance(model, LlamaModel)
    took = []
    real = model._forward_fused

    def counted(batch, cache):
        took.append(1)
        return real(batch, cache)
    model._forward_fused = counted
    if not fused:
        model._fused_ok = False
    return _steps(r), len(took)


@pytest.mark.parametrize("arch,kv", [("llama", None), ("qwen2", None), ("qwen3", None),
                                     ("qwen2", "q8_0")])
def test_llama_family_fused_forward_gives_the_same_logits(arch, kv):
    """The dense llama block's decode steps through the fused attention block: q/k/v biases
    (qwen2), QK-norm (qwen3) or neither (llama); the same bits as the separate ops."""
    from synth import synthetic_model
    path = synthetic_model(CACHE.parent / "synth", arch, "Q4_K_M")
    fused, n = _llama_logits(path, True, kv)
    plain, m = _llama_logits(path, False, kv)
    assert m == 0
    if _int8.HAVE_SIMD:
        assert n >= 12            # the decode steps (one and two rows) took the fused path
    assert np.array_equal(fused, plain)
