"""phi3, smollm3, mistral3 and qwen3moe on the native engine against libllama, the oracle.

Each architecture is a small random GGUF in llama.cpp's own layout (tests/synth_archs.py),
quantized by llama.cpp's quantizer. Next-token logits with teacher forcing meet the tolerance
of our dense synthetic models (test_engine_parity.test_synthetic_parity: 5% of the largest
logit, argmax equal wherever llama.cpp's margin is decisive), and greedy text equals
libllama's over 32 tokens (greedy_parity.assert_greedy_matches). A few checks show the
comparison is sensitive to what each architecture adds (a wrong choice is caught).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from edgeinfer.formats.model_config import NATIVE_ARCHS
from edgeinfer.runners.choice import auto_backend, resolve
from greedy_parity import assert_file_greedy_matches
from synth_archs import VARIANTS, variant_model
from test_engine_parity import _Chunk, check_agreement, llama_logits

llama_cpp = pytest.importorskip("llama_cpp")

CACHE = Path(__file__).resolve().parent.parent / ".cache" / "test-models" / "synth-archs"
DENSE = ["phi3", "phi3-mini4", "smollm3", "mistral3", "mistral3-logmul"]
ALL = DENSE + ["qwen3moe"]
TOKENS = [int(t) for t in np.random.default_rng(1).integers(3, 250, 72)]


def our_logits(path: Path, tokens: list[int], prefill: int, patch=None, runner=None) -> np.ndarray:
    """Prefill `prefill` tokens in one chunk, decode the rest one by one (a shuffled block
    table); `patch(runner)` may change the loaded model first."""
    from edgeinfer.runners.native import ModelRunner
    r = runner or ModelRunner.load(str(path), kv_budget_bytes=32 << 20)
    if patch is not None:
        patch(r)
    table = list(np.random.default_rng(0).permutation(r.kv_plan.num_blocks)[:len(tokens) // 16 + 2])
    rows = [r.forward([_Chunk(0, tokens[:prefill], table)])]
    rows += [r.forward([_Chunk(i, [tokens[i]], table)]) for i in range(prefill, len(tokens))]
    return np.concatenate(rows)


@pytest.mark.parametrize("arch", ["phi3", "smollm3", "mistral3", "qwen3moe"])
def test_auto_picks_native(arch):
    assert arch in NATIVE_ARCHS
    assert resolve("auto", None, arch) == ("cpu" if arch == "qwen3moe" else auto_backend())
    assert resolve("auto", "cpu", arch) == "cpu"


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("ftype", ["Q4_K_M", "Q8_0"])
def test_logits_match_libllama(name, ftype):
    path = variant_model(CACHE, name, ftype)
    ref = llama_logits(path, TOKENS)          # libllama loads the file: it is the oracle
    # the prefill chunk crosses mistral3's original context (64): temperature scaling starts
    ours = our_logits(path, TOKENS, 40)
    stats = check_agreement(ours, ref[39:], rel_tol=0.05)
    assert stats["top1"] >= 0.85 and stats["top5"] >= 0.85, stats


@pytest.mark.parametrize("name", ALL + ["qwen3moe-128"])
def test_f32_logits_close(name):
    """Unquantized, the two engines agree to float rounding (~1e-4 of the largest logit):
    every structural choice (fused rows, partial rotary, factors, mscale, NoPE layers,
    temperature) is right, not merely inside the quantized tolerance."""
    path = variant_model(CACHE, name, "F32")
    ref = llama_logits(path, TOKENS)
    ours = our_logits(path, TOKENS, 40)
    err = np.abs(ours - ref[39:]).max() / np.abs(ref).max()
    assert err < 1e-3, err


@pytest.mark.parametrize("name,wrong", [
    ("smollm3", lambda r: setattr(r.model, "cfg", dataclasses.replace(r.model.cfg, no_rope_step=0))),
    ("phi3", lambda r: setattr(r.model, "mscale", 1.0)),
    ("phi3-mini4", lambda r: setattr(r.model, "rope_freqs",       # the long factors
                                     r.ops.vector(r.gf, "rope_factors_long.weight"))),
    ("mistral3", lambda r: setattr(r.model, "temperature", lambda q, b: None)),
    ("qwen3moe", lambda r: [setattr(w.moe, "k", w.moe.k - 1) for w in r.model.layers]),
])
def test_a_wrong_choice_is_caught(name, wrong):
    path = variant_model(CACHE, name, "F32")
    ref = llama_logits(path, TOKENS)
    ours = our_logits(path, TOKENS, 40, patch=wrong)
    err = np.abs(ours - ref[39:]).max() / np.abs(ref).max()
    assert err > 5e-3, err


@pytest.mark.parametrize("name", DENSE[:4] + ["qwen3moe"])
def test_greedy_text_matches(name):
    assert_file_greedy_matches(variant_model(CACHE, name, "Q8_0"))


@pytest.mark.parametrize("name", ["phi3-mini4", "smollm3", "mistral3"])
def test_torch_backend_runs_the_dense_variants(name):
    """torch (on its CPU device) runs the same forward: within 2% of libllama's largest logit
    (it keeps activations in f32 where llama.cpp rounds them to 8 bits; measured 0.3-1%)."""
    pytest.importorskip("torch")
    from edgeinfer.runners.native import ModelRunner
    path = variant_model(CACHE, name, "Q8_0")
    ref = llama_logits(path, TOKENS)
    r = ModelRunner.load(str(path), backend="torch:cpu", kv_budget_bytes=16 << 20)
    ours = our_logits(path, TOKENS, 40, runner=r)
    assert np.abs(ours - ref[39:]).max() / np.abs(ref).max() < 0.02


@pytest.mark.parametrize("n_ctx", [4096, 8192])
def test_phi3_long_factors_past_the_original_context(n_ctx):
    """The engine's context picks Phi's LongRoPE factors as llama.cpp's n_ctx does: short up
    to the original context (4096 here), long past it."""
    from edgeinfer.engine.core import Engine, EngineConfig
    path = variant_model(CACHE, "phi3", "F32")
    ref = llama_logits(path, TOKENS, n_ctx=n_ctx)
    engine = Engine(str(path), EngineConfig(max_model_len=n_ctx))
    try:
        ours = our_logits(path, TOKENS, 40, runner=engine.runner)
    finally:
        engine.close()
    err = np.abs(ours - ref[39:]).max() / np.abs(ref).max()
    assert err < 1e-3, err


def test_variants_cover_the_architectures():
    assert {v.arch for v in VARIANTS.values()} >= {"phi3", "smollm3", "mistral3", "qwen3moe"}


# -- qwen3moe: which experts run --------------------------------------------------------------

def _count_expert_calls(r) -> list:
    calls = []
    for i, w in enumerate(r.model.layers):
        real = w.moe.expert

        def expert(ops, x, e, real=real, i=i):
            calls.append((i, e, x.shape[0]))
            return real(ops, x, e)
        w.moe.expert = expert
    return calls


def _chosen(r, seen: list) -> list:
    """Per layer, the experts each step routes its tokens to: the FFN's input recorded and
    routed again by ExpertFFN.route (the grouped kernel routes inside its own call)."""
    real = r.model.ffn

    def ffn(w, h):
        seen.append(w.moe.route(r.ops, h)[0])
        return real(w, h)
    r.model.ffn = ffn
    return seen


def test_moe_grouped_reads_only_the_chosen_experts_once():
    """Repacked, a layer's experts are one grouped bank: a decode step reads the tiles of
    the token's k experts only, a prefill each chosen expert's tiles once for all its rows."""
    from edgeinfer.backends.cpu._moe import TILES
    from edgeinfer.runners.native import ModelRunner
    r = ModelRunner.load(str(variant_model(CACHE, "qwen3moe", "Q8_0")), kv_budget_bytes=16 << 20,
                         repack=True)
    banks = [w.moe.bank.grouped for w in r.model.layers]
    assert all(b is not None for b in banks)
    seen = _chosen(r, [])
    table = list(range(8))
    for start, toks in ((0, TOKENS[:20]), (20, [TOKENS[20]])):
        seen.clear()
        for b in banks:
            b.tiles_read[:] = 0
        r.forward([_Chunk(start, toks, table)])
        for layer, (ids, b) in enumerate(zip(seen, banks)):
            chosen = np.zeros(b.E, bool)
            chosen[np.unique(ids)] = True
            assert ids.shape == (len(toks), VARIANTS["qwen3moe"].n_expert_used)
            tiles = b.P[:, TILES]              # tiles per expert, of gate, up and down
            assert np.array_equal(b.tiles_read, tiles[:, None] * chosen[None, :]), layer


def test_moe_per_expert_path_runs_only_the_chosen_experts():
    """Not repacked (experts stay mapped), each chosen expert runs once for all its rows."""
    from edgeinfer.runners.native import ModelRunner
    cfg_k = VARIANTS["qwen3moe"].n_expert_used
    r = ModelRunner.load(str(variant_model(CACHE, "qwen3moe", "Q8_0")), kv_budget_bytes=16 << 20,
                         repack=False)
    assert all(w.moe.bank.grouped is None for w in r.model.layers)
    calls = _count_expert_calls(r)
    table = list(range(8))
    r.forward([_Chunk(0, TOKENS[:20], table)])
    # prefill: tokens grouped by expert, each expert of a layer called once for all its rows
    per_layer = {}
    for layer, e, n in calls:
        per_layer.setdefault(layer, []).append(e)
    for experts in per_layer.values():
        assert len(experts) == len(set(experts))
    assert sum(n for _, _, n in calls) == 20 * cfg_k * len(r.model.layers)
    calls.clear()
    r.forward([_Chunk(20, [TOKENS[20]], table)])
    assert len(calls) == cfg_k * len(r.model.layers)           # k experts per layer, no more
    assert all(n == 1 for _, _, n in calls)


def test_moe_128_experts_q8_0():
    path = variant_model(CACHE, "qwen3moe-128", "Q8_0")
    ref = llama_logits(path, TOKENS)
    stats = check_agreement(our_logits(path, TOKENS, 40), ref[39:], rel_tol=0.05)
    assert stats["top1"] >= 0.85 and stats["top5"] >= 0.85, stats


@pytest.mark.parametrize("ftype", ["Q8_0", "Q4_K_M"])
def test_moe_batch_gives_each_sequence_its_solo_logits(ftype):
    """Two sequences in one step (their tokens grouped by expert together) get exactly the
    logits each gets alone; a prefill's last row equals the same token decoded after the
    rest (repacked: every row of the model, router and grouped experts included, is
    computed alike for any batch, so the ops report rows_exact)."""
    from edgeinfer.runners.native import ModelRunner
    path = str(variant_model(CACHE, "qwen3moe", ftype))
    r = ModelRunner.load(path, kv_budget_bytes=16 << 20, repack=True)
    assert r.ops.rows_exact
    assert_solo_logits_in_a_batch(r)


def assert_solo_logits_in_a_batch(r) -> None:
    """On runner r (16-token blocks, at least 10 free): two sequences in one step get exactly
    the logits each gets alone, and a prefill's last row equals that token decoded after the
    rest."""
    from edgeinfer.runners.base import ScheduledSpan
    a, b = TOKENS[:24], TOKENS[30:50]

    def span(sid, start, toks, table):
        return ScheduledSpan(sid, start, tuple(toks), tuple(table), True)
    solo_a = r.forward([span(0, 0, a, (0, 1))])
    solo_b = r.forward([span(1, 0, b, (2, 3))])
    both = r.forward([span(0, 0, a, (4, 5)), span(1, 0, b, (6, 7))])
    assert np.array_equal(both[0], solo_a[0])
    assert np.array_equal(both[1], solo_b[0])
    r.forward([span(0, 0, a[:-1], (8, 9))])
    step = r.forward([span(0, len(a) - 1, a[-1:], (8, 9))])
    assert np.array_equal(step[0], solo_a[0])


def test_moe_router_matches_llama_cpp_softmax_topk_norm():
    """ExpertFFN.route: softmax over all experts' logits, the top k, renormalized (llama.cpp's
    qwen3moe gating), against a float64 reference from the router's weights."""
    from edgeinfer.formats.gguf_file import read_gguf
    from edgeinfer.formats.model_config import load_model_config
    from edgeinfer.models.qwen3moe import ExpertFFN
    from edgeinfer.backends.cpu.ops import CpuOps
    gf = read_gguf(str(variant_model(CACHE, "qwen3moe", "Q8_0")))
    try:
        cfg = load_model_config(gf)
        ops = CpuOps()
        f = ExpertFFN(cfg, ops, gf, "blk.1.")
        h = np.random.default_rng(2).standard_normal((50, cfg.n_embd)).astype(np.float32)
        top, w = f.route(ops, h)
        router = np.frombuffer(gf.raw("blk.1.ffn_gate_inp.weight"), np.float32)
        logits = h.astype(np.float64) @ router.reshape(cfg.n_expert, -1).T
        p = np.exp(logits - logits.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        ref = np.argsort(-p, axis=1, kind="stable")[:, :cfg.n_expert_used]
        assert np.array_equal(top, ref)
        ref_w = np.take_along_axis(p, ref, 1)
        np.testing.assert_allclose(w, ref_w / ref_w.sum(1, keepdims=True), rtol=1e-5)
    finally:
        gf.close()


@pytest.mark.parametrize("key,value,kind", [
    ("qwen3moe.expert_gating_func", 2, "u32"),          # sigmoid
    ("qwen3moe.expert_shared_count", 1, "u32"),
    ("qwen3moe.expert_weights_scale", 2.5, "f32"),
])
def test_moe_config_we_do_not_implement_names_the_key(tmp_path, key, value, kind):
    from synth_archs import write_variant
    from edgeinfer.formats.gguf_file import GGUFError, read_gguf
    from edgeinfer.formats.model_config import load_model_config
    p = write_variant(tmp_path / "m.gguf", "qwen3moe",
                      **({"extra_u32": {key: value}} if kind == "u32" else
                         {"extra_f32": {key: value}}))
    with pytest.raises(GGUFError, match=key.replace(".", r"\.")):
        load_model_config(read_gguf(str(p)))


def test_moe_unsupported_gating_falls_back_to_llamacpp_under_auto(tmp_path):
    """auto runs a file with a feature the native engine lacks on llama.cpp, and `show`
    says so (it failed on such a file before); an explicit cpu load is the error naming
    the key."""
    from synth_archs import write_variant
    from edgeinfer.cli.show import load_summary, placement_rows
    from edgeinfer.formats.model_config import UnsupportedFeature
    from edgeinfer.runners.choice import resolve_for_file
    from edgeinfer.runners.native import ModelRunner
    p = str(write_variant(tmp_path / "m.gguf", "qwen3moe",
                          extra_u32={"qwen3moe.expert_gating_func": 2}))
    assert resolve_for_file(p, "auto") == "llamacpp"
    assert resolve_for_file(str(variant_model(CACHE, "qwen3moe", "F32")), "auto") == "cpu"
    from edgeinfer.cli.run import local_backend
    assert local_backend(p, "auto", None) == "llamacpp"
    s = load_summary(p)
    assert not s.native
    assert dict(placement_rows(s, []))["backend"].startswith("llamacpp (not loaded")
    with pytest.raises(UnsupportedFeature, match=r"qwen3moe\.expert_gating_func"):
        ModelRunner.load(p, backend="cpu", kv_budget_bytes=16 << 20)


def test_moe_refuses_other_backends():
    from edgeinfer.runners.choice import BackendChoiceError
    with pytest.raises(BackendChoiceError, match="CPU backend only"):
        resolve("auto", "cuda", "qwen3moe")


def test_moe_experts_count_in_the_weights_estimate():
    """The CPU backend's memory estimate (and its repack-or-not decision) counts the 3-D
    expert tensors at their repacked size, not only the 2-D matrices."""
    from edgeinfer.backends.cpu.ops import CpuOps, repacked_bytes
    from edgeinfer.formats.gguf_file import read_gguf
    gf = read_gguf(str(variant_model(CACHE, "qwen3moe", "Q4_K_M")))
    try:
        exps = sum(t.nbytes for n, t in gf.tensors.items() if "_exps" in n)
        on_file = sum(t.nbytes for t in gf.tensors.values())
        assert repacked_bytes(gf) > exps
        est = CpuOps(repack=True).weights_nbytes(gf)
        assert 0.95 * on_file < est < 1.2 * on_file
    finally:
        gf.close()
