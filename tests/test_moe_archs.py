"""Mixtral (a `llama` file with experts), qwen2moe and dots1 on the native engine
(models/moe.py) against libllama, the oracle.

Each is a small random GGUF in llama.cpp's layout (tests/synth_archs.py "mixtral",
"qwen2moe", "dots1"), quantized by llama.cpp's quantizer: next-token logits within the tolerance of
the other synthetic architectures (test_arch_parity: 5% of the largest logit, argmax equal
where libllama's margin is decisive; F32 within 1e-3), greedy text equal over 32 tokens, two
sequences in one step each getting its solo logits. The routing rules are tested on
hand-made logits (ties: the lower index), and a wrong choice (qwen2moe's weights
renormalized, its shared expert ungated; dots1's softmax for sigmoid, no selection bias, no
scale) is caught by the comparison.
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from greedy_parity import assert_file_greedy_matches
from synth_archs import VARIANTS, variant_model, write_variant
from test_arch_parity import TOKENS, assert_solo_logits_in_a_batch, our_logits
from test_engine_parity import check_agreement, llama_logits

llama_cpp = pytest.importorskip("llama_cpp")

CACHE = Path(__file__).resolve().parent.parent / ".cache" / "test-models" / "synth-archs"
NAMES = ["mixtral", "qwen2moe", "dots1"]


def _err(ours, ref) -> float:
    return float(np.abs(ours - ref[39:]).max() / np.abs(ref).max())


@pytest.mark.parametrize("name", NAMES)
def test_auto_picks_native_cpu_and_show_says_so(name):
    from edgeinfer.cli.show import load_summary
    from edgeinfer.formats.gguf_file import read_gguf
    from edgeinfer.formats.model_config import load_model_config
    from edgeinfer.runners.choice import BackendChoiceError, resolve, resolve_for_file
    path = str(variant_model(CACHE, name, "Q8_0"))
    assert resolve_for_file(path, "auto") == "cpu"
    s = load_summary(path)
    assert s.native and s.cpu_only
    gf = read_gguf(path)
    try:
        cfg = load_model_config(gf)
    finally:
        gf.close()
    v = VARIANTS[name]
    assert (cfg.arch, cfg.n_expert, cfg.n_expert_used) == (v.arch, v.n_expert, v.n_expert_used)
    assert cfg.n_ff_exp == v.n_ff_exp and cfg.n_ff_shexp == v.n_ff_shexp + v.n_ff_exp * v.n_shared
    assert cfg.expert_norm == (name != "qwen2moe") and cfg.shexp_gate == (name == "qwen2moe")
    assert cfg.expert_gating == ("sigmoid" if name == "dots1" else "softmax")
    assert (cfg.n_dense_lead, cfg.expert_bias) == (v.n_dense_lead, v.probs_bias)
    assert cfg.expert_scale == v.weights_scale
    # a GPU asked of auto is refused, not handed a model the torch backend lacks
    with pytest.raises(BackendChoiceError, match="CPU backend only"):
        resolve("auto", "cuda", v.arch, True, s.cpu_only)


def test_dense_llama_is_not_cpu_only():
    from edgeinfer.formats.gguf_file import read_gguf
    from edgeinfer.formats.model_config import cpu_only_file
    gf = read_gguf(str(variant_model(CACHE, "smollm3", "F32")))
    try:
        assert not cpu_only_file(gf)
    finally:
        gf.close()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("ftype", ["Q4_K_M", "Q8_0"])
def test_logits_match_libllama(name, ftype):
    path = variant_model(CACHE, name, ftype)
    ref = llama_logits(path, TOKENS)
    ours = our_logits(path, TOKENS, 40)
    stats = check_agreement(ours, ref[39:], rel_tol=0.05)
    assert stats["top1"] >= 0.85 and stats["top5"] >= 0.85, stats


@pytest.mark.parametrize("name", NAMES)
def test_f32_logits_close(name):
    path = variant_model(CACHE, name, "F32")
    err = _err(our_logits(path, TOKENS, 40), llama_logits(path, TOKENS))
    assert err < 1e-3, err


def _renormalize(r):
    for w in r.model.layers:
        w.moe.norm = True


def _ungate_shared(r):
    for w in r.model.layers:
        w.shared.gate_inp = None


def _no_shared(r):
    for w in r.model.layers:
        w.shared = None


def _one_fewer_expert(r):
    for w in r.model.layers:
        w.moe.k -= 1


def _moe_layers(r):
    return [w.moe for w in r.model.layers if w.moe is not None]


def _softmax_gating(r):
    for m in _moe_layers(r):
        m.gating = "softmax"


def _no_selection_bias(r):
    for m in _moe_layers(r):
        m.bias = None


def _unscaled(r):
    for m in _moe_layers(r):
        m.scale = 1.0


@pytest.mark.parametrize("name,wrong", [
    ("qwen2moe", _renormalize), ("qwen2moe", _ungate_shared), ("qwen2moe", _no_shared),
    ("mixtral", _one_fewer_expert),
    ("dots1", _softmax_gating), ("dots1", _no_selection_bias), ("dots1", _unscaled),
])
def test_a_wrong_choice_is_caught(name, wrong):
    path = variant_model(CACHE, name, "F32")
    err = _err(our_logits(path, TOKENS, 40, patch=wrong), llama_logits(path, TOKENS))
    assert err > 5e-3, err


@pytest.mark.parametrize("name", NAMES)
def test_greedy_text_matches(name):
    assert_file_greedy_matches(variant_model(CACHE, name, "Q8_0"))


@pytest.mark.parametrize("name", NAMES)
def test_batch_gives_each_sequence_its_solo_logits(name):
    """Two sequences in one step get exactly the logits each gets alone, and a prefill's
    last row equals the same token decoded after the rest (repacked: routing, grouped
    experts and the shared expert compute each row alike for any batch)."""
    from edgeinfer.runners.native import ModelRunner
    from edgeinfer.models.moe import GatedExperts
    r = ModelRunner.load(str(variant_model(CACHE, name, "Q8_0")), kv_budget_bytes=16 << 20,
                         repack=True)
    assert r.ops.rows_exact
    if name != "mixtral":       # routed in the model, the experts run grouped
        layers = r.model.layers[VARIANTS[name].n_dense_lead:]
        assert all(isinstance(w.moe, GatedExperts) and w.moe.bank.grouped is not None
                   for w in layers)
    assert_solo_logits_in_a_batch(r)


def test_qwen2moe_grouped_gives_the_per_expert_bits_and_reads_only_the_chosen():
    """The routing done in the model, handed to the grouped kernel (ops.moe_ffn), gives the
    bits of the same experts run one at a time; a decode step reads only its k experts."""
    from edgeinfer.backends.cpu.ops import CpuOps
    from edgeinfer.formats.gguf_file import read_gguf
    from edgeinfer.formats.model_config import load_model_config
    from edgeinfer.models.moe import GatedExperts

    class PerExpert(GatedExperts):
        def expert(self, ops, x, e: int):
            return super().expert(ops, x, e)

    gf = read_gguf(str(variant_model(CACHE, "qwen2moe", "Q8_0")))
    try:
        cfg = load_model_config(gf)
        ops = CpuOps(repack=True)
        grouped, per = GatedExperts(cfg, ops, gf, "blk.1."), PerExpert(cfg, ops, gf, "blk.1.")
        assert grouped.bank.grouped is not None and per.bank.grouped is None
        h = np.random.default_rng(4).standard_normal((30, cfg.n_embd)).astype(np.float32)
        ids, w = grouped.route(ops, h)
        assert np.array_equal(per.route(ops, h)[0], ids)
        assert not np.allclose(w.sum(1), 1.0)           # qwen2moe: not renormalized
        a = grouped(ops, h)
        assert np.array_equal(a, per(ops, h))
        for t in (0, 29):
            assert np.array_equal(grouped(ops, h[t:t + 1]), a[t:t + 1])
        g = grouped.bank.grouped
        g.tiles_read[:] = 0
        grouped(ops, h[:1])
        chosen = np.zeros(g.E, bool)
        chosen[ids[0]] = True
        assert np.array_equal(g.tiles_read > 0, np.broadcast_to(chosen, g.tiles_read.shape))
    finally:
        gf.close()


def test_router_logits_are_each_rows_own_bits():
    from edgeinfer.backends.cpu.ops import CpuOps
    from edgeinfer.formats.gguf_file import read_gguf
    gf = read_gguf(str(variant_model(CACHE, "qwen2moe", "Q8_0")))
    try:
        bank = CpuOps(repack=True).expert_bank(gf, "blk.0.")
        h = np.random.default_rng(6).standard_normal((70, 256)).astype(np.float32)
        logits = bank.logits(h)
        ref = h.astype(np.float64) @ bank.router_f32.T.astype(np.float64)
        np.testing.assert_allclose(logits, ref, atol=1e-4 * np.abs(ref).max())
        for t in (0, 69):
            assert np.array_equal(bank.logits(h[t:t + 1])[0], logits[t])
    finally:
        gf.close()


def test_gate_rules_on_hand_made_logits():
    """build_moe_ffn's routing: softmax or sigmoid probabilities, top k of probability plus
    bias (ties: the lower index), weights the unbiased probabilities, optionally divided by
    their sum and scaled."""
    from edgeinfer.models.moe import gate, softmax_rows
    logits = np.array([[1.0, 3.0, 2.0, 0.0], [0.5, 0.5, 4.0, 0.5], [2.0, 2.0, 2.0, 2.0]],
                      np.float32)
    p = softmax_rows(logits)
    ids, w = gate(logits, 2, "softmax", norm=False)
    assert ids.tolist() == [[1, 2], [2, 0], [0, 1]]
    assert np.array_equal(w, np.take_along_axis(p, ids, 1))      # qwen2moe: as they are
    ids_n, w_n = gate(logits, 2, "softmax", norm=True)             # Mixtral: renormalized
    assert np.array_equal(ids_n, ids)
    np.testing.assert_allclose(w_n.sum(1), 1.0, rtol=1e-6)
    assert w_n[2].tolist() == [0.5, 0.5]
    # sigmoid: the bias moves the choice, not the weights; scaled after normalizing
    bias = np.array([0.0, 0.0, 0.0, 10.0], np.float32)
    ids_s, w_s = gate(logits, 2, "sigmoid", norm=True, scale=2.5, bias=bias)
    assert ids_s[:, 0].tolist() == [3, 3, 3] and ids_s[:, 1].tolist() == [1, 2, 0]
    s = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))
    ref = np.take_along_axis(s, ids_s, 1)
    np.testing.assert_allclose(w_s, 2.5 * ref / ref.sum(1, keepdims=True), rtol=1e-6)
    # a weight sum below 2^-14 is clamped there, as ggml_clamp
    tiny = np.full((1, 4), -30.0, np.float32)
    _, w_t = gate(tiny, 2, "sigmoid", norm=True)
    np.testing.assert_allclose(w_t, 1.0 / (1.0 + np.exp(30.0)) / 6.103515625e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="gating"):
        gate(logits, 2, "softplus")


@pytest.mark.parametrize("name,key,value,kind", [
    ("qwen2moe", "qwen2moe.expert_gating_func", 2, "u32"),
    ("qwen2moe", "qwen2moe.expert_shared_count", 2, "u32"),
    ("qwen2moe", "qwen2moe.expert_weights_scale", 2.5, "f32"),
    ("mixtral", "llama.expert_shared_feed_forward_length", 512, "u32"),
    ("mixtral", "llama.expert_group_count", 4, "u32"),
    ("mixtral", "llama.expert_gating_func", 2, "u32"),
    ("dots1", "dots1.expert_gating_func", 3, "u32"),
    ("dots1", "dots1.expert_group_count", 4, "u32"),
])
def test_keys_we_do_not_implement_fall_back_to_llamacpp(tmp_path, name, key, value, kind):
    """A key we do not implement names itself: `--backend auto` runs the file on llama.cpp,
    `show` says not native, an explicit cpu load is the error naming the key."""
    from edgeinfer.cli.show import load_summary
    from edgeinfer.formats.model_config import UnsupportedFeature
    from edgeinfer.runners.choice import resolve_for_file
    from edgeinfer.runners.native import ModelRunner
    p = str(write_variant(tmp_path / "m.gguf", name, VARIANTS[name].seed,
                          **({"extra_u32": {key: value}} if kind == "u32" else
                             {"extra_f32": {key: value}})))
    assert resolve_for_file(p, "auto") == "llamacpp"
    assert not load_summary(p).native
    with pytest.raises(UnsupportedFeature, match=key.replace(".", r"\.")):
        ModelRunner.load(p, backend="cpu", kv_budget_bytes=16 << 20)


def test_moe_refuses_other_backends():
    from edgeinfer.models.moe import MoeModel
    with pytest.raises(ValueError, match="cpu backend only"):
        MoeModel(SimpleNamespace(arch="qwen2moe"), SimpleNamespace(name="torch"), None)


def test_the_daemon_runs_a_llama_file_with_experts_on_the_cpu_where_auto_means_a_gpu(
        monkeypatch, tmp_path):
    """The daemon's own choice (ModelManager.choose_backend): where auto would pick torch:cuda
    for a dense llama file, a llama file with experts (native on the CPU backend only) still
    gets cpu, and a dense one gets the GPU."""
    from types import SimpleNamespace

    from edgeinfer.runners import choice
    from edgeinfer.server.model_manager import ModelManager, ServerConfig
    from edgeinfer.store.model_store import Store
    monkeypatch.setattr(choice, "auto_backend", lambda: "torch:cuda")
    mm = ModelManager(ServerConfig(), Store(tmp_path))
    ref = SimpleNamespace(path=str(variant_model(CACHE, "mixtral", "Q8_0")), manifest={})
    assert mm.choose_backend(ref, "auto") == "cpu"
    dense = SimpleNamespace(path=str(variant_model(CACHE, "smollm3", "F32")), manifest={})
    assert mm.choose_backend(dense, "auto") == "torch:cuda"
