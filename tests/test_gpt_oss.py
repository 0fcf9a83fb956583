"""gpt-oss on the native engine against libllama, the oracle, and its pieces: MXFP4 weights
read in place, attention sinks, the architecture's choices (each shown to matter).

The model is a small random GGUF in llama.cpp's layout (tests/synth_archs.py "gpt-oss":
4 layers, width 256, 8 query / 2 KV heads, 16 experts of which 4 are used, a 24-token window
on even layers, YaRN x32 past an original context of 64), quantized by llama.cpp's own
quantizer with MXFP4_MOE: experts MXFP4, attention and head Q8_0, router F32.
"""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from edgeinfer.backends.cpu import attention as A
from edgeinfer.backends.cpu import mxfp4 as MX
from edgeinfer.backends.cpu.kernels import act_round_q8_0
from greedy_parity import assert_file_greedy_matches
from synth_archs import variant_model, write_variant
from test_arch_parity import CACHE, TOKENS
from test_engine_parity import _Chunk, check_agreement, llama_logits

llama_cpp = pytest.importorskip("llama_cpp")


def _path(ftype: str):
    return variant_model(CACHE, "gpt-oss", ftype)


def our_logits(path, tokens: list[int], prefill: int, runner=None) -> np.ndarray:
    """Prefill `prefill` tokens in one chunk, decode the rest one by one, through shuffled
    block tables of both pools (the window layers' K/V in a pool of their own)."""
    from edgeinfer.runners.native import ModelRunner
    r = runner or ModelRunner.load(str(path), kv_budget_bytes=32 << 20)
    rng, n = np.random.default_rng(0), len(tokens) // 16 + 2
    table = list(rng.permutation(r.kv_plan.num_blocks)[:n])
    window = list(rng.permutation(r.kv_plan.window_blocks)[:n])
    assert window, "the window layers keep their K/V apart"
    rows = [r.forward([_Chunk(0, tokens[:prefill], table, window_table=window)])]
    rows += [r.forward([_Chunk(i, [tokens[i]], table, window_table=window)])
             for i in range(prefill, len(tokens))]
    return np.concatenate(rows)


# -- MXFP4 ------------------------------------------------------------------------------------

def _mxfp4(rng, n: int, k: int):
    raw = gguf_quantize(rng.standard_normal((n, k)).astype(np.float32),
                        GGMLQuantizationType.MXFP4)
    raw[0, 0], raw[1, 0] = 1, 0     # exponent bytes below 2: ggml's subnormal scales
    return MX.Mxfp4Matrix(raw.reshape(n, -1), k, n), gguf_dequantize(
        raw, GGMLQuantizationType.MXFP4).reshape(n, k)


def test_mxfp4_decodes_as_gguf():
    m, ref = _mxfp4(np.random.default_rng(0), 8, 128)
    np.testing.assert_array_equal(MX.dequantize(m.data, m.K), ref)
    np.testing.assert_array_equal(m.rows([3, 0]), ref[[3, 0]])


def test_mxfp4_matmul_is_ggml_q8_0_dot_and_batch_invariant():
    """x in Q8_0 blocks times the MXFP4 values, as ggml's vec_dot_mxfp4_q8_0 (products exact,
    so only the float additions differ from a float64 sum); every row the same bits alone
    as in any batch; float32 activations with numerics='f32'."""
    rng = np.random.default_rng(1)
    m, ref = _mxfp4(rng, 96, 256)
    x = rng.standard_normal((9, 256)).astype(np.float32)
    xq = act_round_q8_0(x, np.empty_like(x))
    y = MX.matmul(x, m)
    want = xq.astype(np.float64) @ ref.T.astype(np.float64)
    assert np.abs(y - want).max() < 1e-6 * np.abs(want).max()
    for i in range(len(x)):
        np.testing.assert_array_equal(MX.matmul(x[i], m), y[i])
    np.testing.assert_array_equal(MX.matmul(x[2:5], m), y[2:5])
    yf = MX.matmul(x, m, q8=False)
    assert np.abs(yf - x.astype(np.float64) @ ref.T).max() < 1e-5 * np.abs(want).max()
    assert np.abs(yf - y).max() > 1e-4      # the Q8_0 rounding is really applied


def _ggml_avx2_dot(codes: np.ndarray, scales: np.ndarray, qa: np.ndarray, da: np.ndarray):
    """ggml_vec_dot_mxfp4_q8_0's AVX2 order in numpy, one row x one activation row: per block
    8 int32 lanes of 4 products, block pairs into two 8-lane float accumulators by FMA (exact
    in float64, then rounded), accumulators added, hsum_float_8, an odd block in scalar."""
    nb = len(scales)
    acc = np.zeros((2, 8), np.float32)
    for b in range(nb - nb % 2):
        lanes = (codes[b].astype(np.int32) * qa[b]).reshape(8, 4).sum(1)
        d = np.float32(da[b] * scales[b])
        acc[b % 2] = (np.float64(d) * lanes + acc[b % 2]).astype(np.float32)
    s = acc[0] + acc[1]
    r = s[4:] + s[:4]
    total = (r[0] + r[2]) + (r[1] + r[3])
    if nb % 2:
        total += np.float32(da[-1] * scales[-1]) * np.float32((codes[-1].astype(np.int32) * qa[-1]).sum())
    return np.float32(total)


@pytest.mark.parametrize("k", [256, 224])           # an even and an odd number of blocks
def test_mxfp4_dot_is_ggml_avx2_order_bit_for_bit(k):
    from edgeinfer.backends.cpu._actquant import quantize_rows
    rng = np.random.default_rng(k)
    m, _ = _mxfp4(rng, 6, k)
    x = (rng.standard_normal((3, k)) * 4).astype(np.float32)
    nb = k // 32
    qa, da = np.empty((3, k), np.int8), np.empty((nb, 3), np.float32)
    quantize_rows(x, 32, 32, 0, qa, da, np.empty((nb, 3), np.float32),
                  np.empty((nb, 3), np.int32), False)
    blocks = m.data.reshape(6, nb, 17)
    codes = np.concatenate([MX.KVALUES[blocks[..., 1:] & 15], MX.KVALUES[blocks[..., 1:] >> 4]],
                           axis=2)
    want = np.array([[_ggml_avx2_dot(codes[n], MX.E8M0_HALF[blocks[n, :, 0]],
                                     qa[i].reshape(nb, 32), da[:, i]) for n in range(6)]
                     for i in range(3)])
    np.testing.assert_array_equal(MX.matmul(x, m), want)


def test_mxfp4_cache_stamp_is_current():
    from edgeinfer.backends.cpu import _stamp
    assert MX._DEPS_HASH == _stamp.deps_hash(MX._DEPS), _stamp.deps_hash(MX._DEPS)


def test_native_tensor_types_are_the_cpu_kernels():
    from edgeinfer.backends.cpu.quants import SUPPORTED_TYPES
    from edgeinfer.formats.model_config import NATIVE_TENSOR_TYPES
    assert NATIVE_TENSOR_TYPES == {t.name for t in SUPPORTED_TYPES} | {"MXFP4"}


# -- attention sinks ---------------------------------------------------------------------------

def test_sinks_join_the_softmax_denominator():
    """Against float64: each head's weights are exp(s - m) / (sum exp(s - m) + exp(sink - m));
    the tiled kernel, the per-token one and the split one give the same bits with sinks, and
    a -inf sink is no sink."""
    rng = np.random.default_rng(2)
    T, H, KVH, D, bs, nblk = 5, 4, 2, 64, 16, 8
    k = rng.standard_normal((nblk, bs, KVH, D)).astype(np.float32)
    v = rng.standard_normal((nblk, bs, KVH, D)).astype(np.float32)
    tables = rng.permutation(nblk).astype(np.int32).reshape(1, -1)
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    seq, pos = np.zeros(T, np.int32), np.array([40, 41, 42, 43, 90], np.int32)
    sinks = np.array([3.0, -1.0, 0.5, 8.0], np.float32)
    scale = np.float32(0.125)
    for window in (0, 24):
        args = (q, k, v, tables, seq, pos, window, scale, False)
        got = A.paged_attention(*args, np.empty_like(q), True, 2, sinks=sinks)
        for t in range(T):
            lo = max(0, pos[t] - window + 1) if window else 0
            keys = np.arange(lo, pos[t] + 1)
            kk = k[tables[0, keys // bs], keys % bs].astype(np.float64)
            vv = v[tables[0, keys // bs], keys % bs].astype(np.float64)
            for h in range(H):
                s = kk[:, h // 2] @ q[t, h] * float(scale)
                m = max(s.max(), sinks[h])
                e = np.exp(s - m)
                want = e @ vv[:, h // 2] / (e.sum() + np.exp(sinks[h] - m))
                np.testing.assert_allclose(got[t, h], want, atol=2e-5)
        np.testing.assert_array_equal(
            got, A.paged_attention_ref(*args, np.empty_like(q), False, 1, sinks=sinks))
        split = A._run_split(q[4:], k, v, tables, seq[4:], pos[4:], window, scale, False,
                             np.empty_like(q[4:]), 3, sinks)
        np.testing.assert_array_equal(split, got[4:])
        none = A.paged_attention(*args, np.empty_like(q), True, 2)
        np.testing.assert_array_equal(
            A.paged_attention(*args, np.empty_like(q), True, 2,
                              sinks=np.full(H, -np.inf, np.float32)), none)
        assert np.abs(none - got).max() > 1e-2


# -- the architecture against libllama ---------------------------------------------------------

def test_logits_match_libllama_mxfp4():
    path = _path("MXFP4_MOE")
    ref = llama_logits(path, TOKENS)
    # the 40-token prefill crosses the 24-token window and YaRN's original context (64 is
    # crossed in decode); MXFP4 experts through their own kernel
    stats = check_agreement(our_logits(path, TOKENS, 40), ref[39:], rel_tol=0.05)
    assert stats["top1"] >= 0.85 and stats["top5"] >= 0.85, stats


def test_f32_logits_close():
    """Unquantized, the engines agree to float rounding: every choice (sinks, window layers,
    YaRN, biases, router, clamped SwiGLU) is right, not merely inside the tolerance."""
    path = _path("F32")
    ref = llama_logits(path, TOKENS)
    err = np.abs(our_logits(path, TOKENS, 40) - ref[39:]).max() / np.abs(ref).max()
    assert err < 1e-3, err


def _no_sinks(r):
    for w in r.model.layers:
        w.sinks = None


def _router_softmax_over_all(r):
    from edgeinfer.models.qwen3moe import ExpertFFN
    for w in r.model.layers:
        w.moe.route = lambda ops, h, m=w.moe: ExpertFFN.route(m, ops, h)


def _unclamped(r, monkeypatch):
    from edgeinfer.models import gpt_oss

    def swiglu(g, u):
        g[:] = g / (1 + np.exp(-gpt_oss.SWIGLU_ALPHA * g)) * (u + np.float32(1.0))
        return g
    monkeypatch.setattr(gpt_oss, "swiglu_oai", swiglu)


@pytest.mark.parametrize("wrong", [
    _no_sinks,
    _router_softmax_over_all,
    _unclamped,
    lambda r: setattr(r.model, "mscale", 1.0),          # YaRN's attention factor
    lambda r: [setattr(w.moe, "b_up", w.moe.b_up * 0) for w in r.model.layers],
], ids=["sinks", "router", "clamp", "yarn_mscale", "expert_bias"])
def test_a_wrong_choice_is_caught(wrong, monkeypatch):
    from edgeinfer.runners.native import ModelRunner
    path = _path("F32")
    ref = llama_logits(path, TOKENS)
    r = ModelRunner.load(str(path), kv_budget_bytes=32 << 20)
    if wrong is _unclamped:
        wrong(r, monkeypatch)
    else:
        wrong(r)
    err = np.abs(our_logits(path, TOKENS, 40, runner=r) - ref[39:]).max() / np.abs(ref).max()
    assert err > 5e-3, err


def test_batch_gives_each_sequence_its_solo_logits():
    """Two sequences in one step (tokens grouped by expert together, MXFP4 rows, sinks, window
    layers) get the logits each gets alone; a prefill's last row equals that token decoded
    after the rest."""
    from edgeinfer.runners.base import ScheduledSpan
    from edgeinfer.runners.native import ModelRunner
    r = ModelRunner.load(str(_path("MXFP4_MOE")), kv_budget_bytes=16 << 20)
    a, b = TOKENS[:40], TOKENS[40:70]

    def span(sid, start, toks, table, window):
        return ScheduledSpan(sid, start, tuple(toks), tuple(table), True,
                             window_table=tuple(window))
    solo_a = r.forward([span(0, 0, a, (0, 1, 2), (0, 1, 2))])
    solo_b = r.forward([span(1, 0, b, (3, 4), (3, 4))])
    both = r.forward([span(0, 0, a, (5, 6, 7), (5, 6, 7)), span(1, 0, b, (8, 9), (8, 9))])
    np.testing.assert_array_equal(both[0], solo_a[0])
    np.testing.assert_array_equal(both[1], solo_b[0])
    r.forward([span(0, 0, a[:-1], (10, 11, 12), (10, 11, 12))])
    step = r.forward([span(0, len(a) - 1, a[-1:], (10, 11, 12), (10, 11, 12))])
    np.testing.assert_array_equal(step[0], solo_a[0])


def test_grouped_mxfp4_experts_are_the_expert_by_expert_bits():
    """The grouped MXFP4 path (one call per projection for all (token, slot) rows) gives the
    bits of running the chosen experts one by one, for a prefill's rows and a lone token."""
    from edgeinfer.runners.native import ModelRunner
    r = ModelRunner.load(str(_path("MXFP4_MOE")), kv_budget_bytes=16 << 20)
    moe = r.model.layers[1].moe
    assert moe.banks is not None
    h = np.random.default_rng(5).standard_normal((37, 256)).astype(np.float32)
    for rows in (h, h[3:4]):
        grouped = moe(r.ops, rows)
        banks, moe.banks = moe.banks, None
        try:
            one_by_one = moe(r.ops, rows)
        finally:
            moe.banks = banks
        np.testing.assert_array_equal(grouped, one_by_one)


def test_greedy_text_matches():
    assert_file_greedy_matches(_path("MXFP4_MOE"))


# -- choice and bad input ----------------------------------------------------------------------

def test_auto_picks_native_cpu():
    from edgeinfer.runners.choice import BackendChoiceError, resolve, resolve_for_file
    assert resolve("auto", None, "gpt-oss") == "cpu"
    assert resolve_for_file(str(_path("MXFP4_MOE")), "auto") == "cpu"
    with pytest.raises(BackendChoiceError, match="CPU backend only"):
        resolve("auto", "cuda", "gpt-oss")


def test_a_quant_type_we_lack_falls_back_to_llamacpp():
    """IQ4_NL experts (llama.cpp quantizes them without an imatrix): auto runs the file on
    llama.cpp and `show` says so; an explicit cpu load is an error naming the tensor type."""
    from edgeinfer.cli.show import load_summary
    from edgeinfer.formats.model_config import UnsupportedFeature
    from edgeinfer.runners.choice import resolve_for_file
    from edgeinfer.runners.native import ModelRunner
    p = str(_path("IQ4_NL"))
    assert resolve_for_file(p, "auto") == "llamacpp"
    assert not load_summary(p).native
    with pytest.raises(UnsupportedFeature, match="IQ4_NL"):
        ModelRunner.load(p, backend="cpu", kv_budget_bytes=16 << 20)


@pytest.mark.parametrize("key,value", [
    ("gpt-oss.attention.sliding_window_pattern", 3),
    ("gpt-oss.expert_gating_func", 2),                  # sigmoid
])
def test_a_key_we_do_not_implement_names_it(tmp_path, key, value):
    from edgeinfer.formats.gguf_file import read_gguf
    from edgeinfer.formats.model_config import UnsupportedFeature, load_model_config
    p = write_variant(tmp_path / "m.gguf", "gpt-oss", extra_u32={key: value})
    with pytest.raises(UnsupportedFeature, match=key.replace(".", r"\.")):
        load_model_config(read_gguf(str(p)))


def test_kernel_warmup_has_an_mxfp4_step():
    """install and a gpt-oss load compile the MXFP4 kernels ahead (a 2-D MXFP4 tensor is
    no float:TYPE step, which has no MXFP4 block decoder)."""
    from edgeinfer.backends.cpu import warmup as cpu
    from edgeinfer.engine import warmup
    keys = warmup.keys_for_model(str(_path("MXFP4_MOE")))
    assert "mxfp4" in keys and not any(k.endswith(":MXFP4") for k in keys)
    assert "mxfp4" in warmup.install_keys()
    cpu.run("mxfp4")


def test_show_and_ps_say_the_mxfp4_weights_stay_mapped():
    from edgeinfer.backends.cpu.ops import CpuOps
    from edgeinfer.formats.gguf_file import read_gguf
    from edgeinfer.runners.native import ModelRunner
    gf = read_gguf(str(_path("MXFP4_MOE")))
    try:
        assert "MXFP4 read in place" in CpuOps().weights_format_for(gf)
        on_file = sum(t.nbytes for n, t in gf.tensors.items() if t.type_name == "MXFP4")
        assert CpuOps().weights_nbytes(gf) >= on_file      # counted once, as the file has them
    finally:
        gf.close()
    r = ModelRunner.load(str(_path("MXFP4_MOE")), kv_budget_bytes=16 << 20)
    assert "MXFP4 read in place" in r.weights_format
    gf = read_gguf(str(_path("Q8_0")))
    try:
        assert "MXFP4" not in CpuOps().weights_format_for(gf)
    finally:
        gf.close()
