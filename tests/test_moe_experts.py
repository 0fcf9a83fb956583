"""The CPU backend's grouped expert kernels (backends/cpu/experts.py, _moe.py, _router.py).

The grouped path must give every (token, expert) row the bits the per-expert path gives
(each chosen expert's matrices multiplied on its own rows by packed_matmuls, ops.swiglu,
the weighted sum slot by slot), a token the same FFN output alone or among any others, and
read only the chosen experts' tiles, each once per step. The expert tensors are real
llama.cpp-quantized ones (tests/synth_archs.py) or written here with gguf's quantizer in
llama.cpp's 3-D layout, so every repackable kind of weight code runs.
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from edgeinfer.backends.cpu import _int8, _moe, _router, _stamp
from edgeinfer.backends.cpu.ops import CpuOps
from edgeinfer.formats.gguf_file import read_gguf
from edgeinfer.models.qwen3moe import ExpertFFN
from synth_archs import variant_model

CACHE = Path(__file__).resolve().parent.parent / ".cache" / "test-models" / "synth-archs"
P = "blk.0."

needs_simd = pytest.mark.skipif(not _int8.HAVE_SIMD, reason="no vector tile kernel here")


class PerExpertFFN(ExpertFFN):
    """The same experts run one at a time (overriding `expert` asks for that path)."""

    def expert(self, ops, x, e: int):
        return super().expert(ops, x, e)


def _write_bank(path: Path, tensors: dict) -> Path:
    """A GGUF holding only blk.0's router and expert tensors: name -> (float32 values or
    block bytes, type, ggml shape)."""
    from gguf import GGUFWriter
    w = GGUFWriter(str(path), "qwen3moe")
    for name, (data, qtype, shape) in tensors.items():
        rows = tuple(reversed(shape))[:-1]          # numpy order, the last axis as bytes
        data = data.view(np.float32) if qtype == Q.F32 else data.view(np.uint8)
        w.add_tensor(name, data.reshape(*rows, -1), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _quantized_bank(tmp_path: Path, types, E=12, X=256, F=96, seed=0) -> Path:
    """Random experts in llama.cpp's layout (gate/up [E, F, X], down [E, X, F] row-major),
    each tensor quantized to its type by gguf's quantizer; an F32 router [E, X]."""
    from gguf.quants import quantize
    rng = np.random.default_rng(seed)
    t = {P + "ffn_gate_inp.weight": ((rng.standard_normal((E, X)) * 0.2).astype(np.float32),
                                     Q.F32, (X, E))}
    for (m, rows, cols), qtype in zip((("ffn_gate_exps", F, X), ("ffn_up_exps", F, X),
                                       ("ffn_down_exps", X, F)), types):
        w = (rng.standard_normal((E, rows, cols)) / np.sqrt(cols)).astype(np.float32)
        t[P + m + ".weight"] = (quantize(w, qtype), qtype, (cols, rows, E))
    return _write_bank(tmp_path / "bank.gguf", t)


def _copied_bank(tmp_path: Path, src: Path, layer_of: dict) -> Path:
    """A bank whose tensors are copies of llama.cpp-quantized ones: m -> (layer, tensor)."""
    gf = read_gguf(str(src))
    try:
        t = {}
        for m in ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
            layer, name = layer_of.get(m, (0, m))
            info = gf.tensors[f"blk.{layer}.{name}.weight"]
            t[P + m + ".weight"] = (np.array(gf.raw(info.name)), Q(int(info.ggml_type)),
                                    tuple(int(d) for d in info.shape))
        return _write_bank(tmp_path / "bank.gguf", t)
    finally:
        gf.close()


def _ffns(path: Path, k: int):
    gf = read_gguf(str(path))
    cfg = SimpleNamespace(n_expert_used=k)
    grouped = ExpertFFN(cfg, CpuOps(repack=True), gf, P)
    per = PerExpertFFN(cfg, CpuOps(repack=True), gf, P)
    return gf, grouped, per


def _h(T: int, X: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((T, X)).astype(np.float32)


def _check_bits(path: Path, k: int, T: int = 45) -> None:
    gf, grouped, per = _ffns(path, k)
    try:
        assert grouped.bank.grouped is not None and per.bank.grouped is None
        ops = CpuOps(repack=True)
        h = _h(T, grouped.bank.grouped.X)
        ids, w = grouped.route(ops, h)
        assert np.array_equal(per.route(ops, h)[0], ids)
        a, b = grouped(ops, h), per(ops, h)          # routed in the kernel, or apart
        assert np.array_equal(a, b), np.abs(a - b).max()
        assert np.array_equal(ops.moe_ffn(grouped.bank, h, ids, w), a)
        # a token alone gets its row of the batch (routing included)
        for t in (0, 7, T - 1):
            assert np.array_equal(grouped(ops, h[t:t + 1]), a[t:t + 1])
        assert np.isfinite(a).all() and np.abs(a).max() > 0
    finally:
        gf.close()


@needs_simd
@pytest.mark.parametrize("types", [
    (Q.Q4_0, Q.Q4_0, Q.Q8_0),           # 4-bit codes, 8-bit codes for down
    (Q.Q5_0, Q.Q5_1, Q.Q4_1),           # fifth-bit planes, offsets; up's zero point differs
])
def test_grouped_gives_the_per_expert_bits(tmp_path, types):
    _check_bits(_quantized_bank(tmp_path, types), k=3)


@needs_simd
def test_grouped_llama_cpp_k_quants(tmp_path):
    """Q4_K gate/up, Q6_K down as llama.cpp's Q4_K_M writes them; then an up of another
    activation format than gate's (Q6_K: 16-column blocks), so x is quantized twice."""
    src = variant_model(CACHE, "qwen3moe", "Q4_K_M")
    gf = read_gguf(str(src))
    q6 = [i for i in range(4) if int(gf.tensors[f"blk.{i}.ffn_down_exps.weight"].ggml_type) == Q.Q6_K]
    q4 = [i for i in range(4) if int(gf.tensors[f"blk.{i}.ffn_down_exps.weight"].ggml_type) == Q.Q4_K]
    gf.close()
    assert q6 and q4
    _check_bits(_copied_bank(tmp_path, src, {"ffn_down_exps": (q6[0], "ffn_down_exps")}), k=4)
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    _check_bits(_copied_bank(mixed, src, {"ffn_up_exps": (q6[0], "ffn_down_exps"),
                                          "ffn_down_exps": (q4[0], "ffn_down_exps")}), k=4)


@needs_simd
def test_prefill_sized_batch_and_decode_rows_agree(tmp_path):
    """A prefill-sized step (parallel quantization, many rows per expert) gives each token
    the bits it gets decoded alone, and the grouped bits equal the per-expert ones."""
    _check_bits(_quantized_bank(tmp_path, (Q.Q8_0, Q.Q8_0, Q.Q4_0), E=16, X=512, F=128),
                k=4, T=300)


@needs_simd
def test_only_the_chosen_experts_tiles_are_read_once(tmp_path):
    gf, grouped, _ = _ffns(_quantized_bank(tmp_path, (Q.Q4_0, Q.Q4_0, Q.Q4_0)), k=3)
    try:
        ops = CpuOps(repack=True)
        g = grouped.bank.grouped
        tiles = g.P[:, _moe.TILES]
        assert tiles.tolist() == [96 // 16, 96 // 16, 256 // 16]
        h = _h(1, g.X)
        ids, _ = grouped.route(ops, h)
        g.tiles_read[:] = 0
        grouped(ops, h)                              # decode: one token, its k experts
        chosen = np.zeros(g.E, bool)
        chosen[ids[0]] = True
        assert np.array_equal(g.tiles_read, tiles[:, None] * chosen[None, :])
        h = _h(40, g.X, seed=3)
        ids, _ = grouped.route(ops, h)
        g.tiles_read[:] = 0
        grouped(ops, h)                              # a prefill: each chosen expert once
        chosen = np.zeros(g.E, bool)
        chosen[np.unique(ids)] = True
        assert chosen.sum() > 3
        assert np.array_equal(g.tiles_read, tiles[:, None] * chosen[None, :])
    finally:
        gf.close()


def test_routing_softmax_top_k_renormalized():
    """llama.cpp's softmax gating with normalized weights: ties go to the lower index."""
    logits = np.array([[1.0, 3.0, 2.0, 0.0], [0.5, 0.5, 4.0, 0.5], [2.0, 2.0, 2.0, 2.0]],
                      np.float32)
    ids, w = np.empty((3, 2), np.int64), np.empty((3, 2), np.float32)
    _router.route_logits(logits, 2, ids, w)
    assert ids.tolist() == [[1, 2], [2, 0], [0, 1]]
    p = np.exp(logits[0] - 3.0) / np.exp(logits[0] - 3.0).sum()
    np.testing.assert_allclose(w[0], p[[1, 2]] / p[[1, 2]].sum(), rtol=1e-6)
    np.testing.assert_allclose(w.sum(1), 1.0, rtol=1e-6)
    assert w[2].tolist() == [0.5, 0.5]


def test_router_logits_and_choice_match_a_float64_reference():
    rng = np.random.default_rng(5)
    E, X, T, k = 42, 300, 64, 6     # X not a multiple of 16, E not of 4: the tails count too
    x = rng.standard_normal((T, X)).astype(np.float32)
    wr = rng.standard_normal((E, X)).astype(np.float32)
    wr.setflags(write=False)        # read-only as the file's map gives it: the kernels warmed
    logits = np.empty((T, E), np.float32)
    ids, w = np.empty((T, k), np.int64), np.empty((T, k), np.float32)
    _router.route(x, wr, k, logits, ids, w, 2, True)          # rows split between threads
    ref = x.astype(np.float64) @ wr.T.astype(np.float64)
    np.testing.assert_allclose(logits, ref, atol=1e-3 * np.abs(ref).max())
    assert np.array_equal(ids, np.argsort(-logits, axis=1, kind="stable")[:, :k])
    # each row the bits it gets alone: serially, or its experts split between threads
    one = (np.empty((1, E), np.float32), np.empty((1, k), np.int64), np.empty((1, k), np.float32))
    for t in (0, 33):
        for nw in (1, 2):
            _router.route(x[t:t + 1], wr, k, *one, nw, False)
            assert np.array_equal(one[0][0], logits[t]) and np.array_equal(one[2][0], w[t])


def test_unrepacked_experts_stay_mapped(tmp_path):
    """Without repacking every expert is a view of the file's bytes, run one by one."""
    gf = read_gguf(str(_quantized_bank(tmp_path, (Q.Q4_0, Q.Q4_0, Q.Q8_0))))
    try:
        ops = CpuOps(repack=False)
        f = ExpertFFN(SimpleNamespace(n_expert_used=2), ops, gf, P)
        assert f.bank.grouped is None and not ops.weights_copied
        raw = gf.raw(P + "ffn_up_exps.weight")
        assert np.shares_memory(f.up[5].data, raw)
        assert np.isfinite(f(ops, _h(3, 256))).all()
    finally:
        gf.close()


@pytest.mark.parametrize("module", [_moe, _router])
def test_kernel_cache_stamp_is_current(module):
    want = _stamp.deps_hash(module._DEPS)
    assert module._DEPS_HASH == want, f"update _DEPS_HASH in {module.__name__} to {want!r}"
    assert module._CACHE
