"""BERT encoders on the native engine against llama.cpp on the same synthetic GGUF files:
mean and CLS pooled embeddings (F32 and Q8_0 from llama.cpp's quantizer), a reranker's rank
pooling through its classification head, whole-prompt computation under chunked prefill, and
generation refused on an embedding-only model."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgeinfer.engine.core import Engine, EngineConfig, RequestError, embed_all, greedy
from synth import quantize
from synth_bert import write_bert

TEXTS = ["the quick brown fox jumps over the lazy dog.",
         "paris is the capital of france!",
         "hello",
         "Searching vectors, locally: embedding models work here.",
         "the the the the the the the the the the the the the the the the the the the the"]
QUERY = "what is the capital of france?"
DOCS = ["paris is the capital of france.", "the quick brown fox", "dogs and cats",
        "france has a capital city", "water"]


def unit(v) -> np.ndarray:
    v = np.asarray(v, np.float64).reshape(-1)
    return v / np.linalg.norm(v)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("bert")
    out = {"mean": write_bert(d / "bert-mean-F32.gguf", "mean", seed=1),
           "cls": write_bert(d / "bert-cls-F32.gguf", "cls", seed=2),
           "rank": write_bert(d / "bert-rank-F32.gguf", reranker=True, seed=3)}
    out["mean-Q8_0"] = quantize(out["mean"], d / "bert-mean-Q8_0.gguf", "Q8_0")
    return out


def _llama(path: Path, pooling: int):
    import llama_cpp
    return llama_cpp.Llama(str(path), embedding=True, n_ctx=512, n_batch=512, n_ubatch=512,
                           verbose=False, pooling_type=pooling)


def _engine(path: Path, **kw) -> Engine:
    return Engine(str(path), EngineConfig(backend="cpu", **kw))


@pytest.mark.parametrize("kind,pooling,floor", [("mean", 1, 0.9999), ("cls", 2, 0.9999),
                                                ("mean-Q8_0", 1, 0.999)])
def test_embeddings_match_llamacpp(files, kind, pooling, floor):
    llm = _llama(files[kind], pooling)
    eng = _engine(files[kind])
    try:
        assert eng.pooling == kind.split("-")[0]
        ids = [eng.encode_raw(t) for t in TEXTS]
        assert ids == [llm.tokenize(t.encode()) for t in TEXTS]       # [CLS] ... [SEP]
        outs = embed_all(eng, ids)
        for t, o in zip(TEXTS, outs):
            ref = unit(llm.embed(t, normalize=True))
            assert float(unit(o.embedding) @ ref) > floor, t
    finally:
        eng.close()
        llm.close()


def test_whole_prompt_under_chunked_prefill(files):
    """Non-causal attention needs the whole prompt in one pass: with a 16-token step budget
    the runner holds the chunks and computes them together, giving the same vector."""
    text = " ".join(TEXTS)
    ref_eng = _engine(files["mean"])
    small = _engine(files["mean"], max_tokens_per_step=16, max_running_seqs=4)
    try:
        ids = ref_eng.encode_raw(text)
        assert len(ids) > 40
        whole = embed_all(ref_eng, [ids])[0].embedding
        before = small.steps
        outs = embed_all(small, [ids, ref_eng.encode_raw(TEXTS[2])])
        assert small.steps - before >= len(ids) // 16
        assert float(unit(outs[0].embedding) @ unit(whole)) > 0.99999
        alone = embed_all(ref_eng, [ref_eng.encode_raw(TEXTS[2])])[0].embedding
        assert float(unit(outs[1].embedding) @ unit(alone)) > 0.99999
    finally:
        ref_eng.close()
        small.close()


def test_batching_does_not_mix_sequences(files):
    eng = _engine(files["mean"])
    try:
        ids = [eng.encode_raw(t) for t in TEXTS]
        before = eng.steps
        together = embed_all(eng, ids)
        assert eng.steps - before == 1
        for i, o in zip(ids, together):
            alone = embed_all(eng, [i])[0].embedding
            np.testing.assert_allclose(o.embedding, alone, rtol=1e-4, atol=1e-5)
    finally:
        eng.close()


def _llama_rank_scores(path: Path, prompts: list[list[int]]) -> list[float]:
    import llama_cpp
    llm = _llama(path, llama_cpp.LLAMA_POOLING_TYPE_RANK)
    try:
        out = []
        for toks in prompts:
            llm._batch.reset()
            llm._ctx.kv_cache_clear()
            llm._batch.add_sequence(toks, 0, True)
            llm._ctx.decode(llm._batch)
            out.append(float(llama_cpp.llama_get_embeddings_seq(llm._ctx.ctx, 0)[0]))
        return out
    finally:
        llm.close()


def test_rerank_scores_match_llamacpp(files):
    from edgeinfer.server.embeddings_api import rerank_prompt
    eng = _engine(files["rank"])
    try:
        assert eng.pooling == "rank"
        prompts = [rerank_prompt(eng, QUERY, d) for d in DOCS]
        q = eng.tokenizer.encode(QUERY, add_special=False)
        # llama.cpp's format: [CLS] query [SEP] doc (bert adds no EOS)
        assert prompts[0][:len(q) + 2] == [101, *q, 102]
        ours = [float(o.embedding[0]) for o in embed_all(eng, prompts, "rank")]
    finally:
        eng.close()
    ref = _llama_rank_scores(files["rank"], prompts)
    np.testing.assert_allclose(ours, ref, atol=1e-3)
    assert len(set(np.round(ours, 4))) == len(DOCS)       # a real spread, not a constant


def test_generation_refused_on_an_encoder(files):
    eng = _engine(files["mean"])
    try:
        with pytest.raises(RequestError, match="embedding model"):
            eng.submit(eng.encode_raw("hello"), greedy(4), lambda o: None)
    finally:
        eng.close()


@pytest.mark.parametrize("kind,pooling", [("mean", None), ("rank", "rank")])
def test_torch_backend_agrees(files, kind, pooling):
    pytest.importorskip("torch")
    a, b = _engine(files[kind]), Engine(str(files[kind]), EngineConfig(backend="torch:cpu"))
    try:
        ids = [a.encode_raw(t) for t in TEXTS]
        for x, y in zip(embed_all(a, ids, pooling), embed_all(b, ids, pooling)):
            np.testing.assert_allclose(x.embedding, y.embedding, atol=2e-3, rtol=1e-3)
    finally:
        a.close()
        b.close()


@pytest.fixture(scope="module")
def nomic_files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("nomic")
    f32 = write_bert(d / "nomic-F32.gguf", "mean", seed=5, arch="nomic-bert")
    return {"F32": f32, "Q8_0": quantize(f32, d / "nomic-Q8_0.gguf", "Q8_0")}


@pytest.mark.parametrize("ftype,floor", [("F32", 0.9999), ("Q8_0", 0.999)])
def test_nomic_bert_matches_llamacpp(nomic_files, ftype, floor):
    """nomic-bert: rotary positions, fused attn_qkv, SwiGLU; mean pooling."""
    llm = _llama(nomic_files[ftype], 1)
    eng = _engine(nomic_files[ftype])
    try:
        assert eng.cfg.arch == "nomic-bert" and eng.cfg.fused_qkv
        ids = [eng.encode_raw(t) for t in TEXTS]
        assert ids == [llm.tokenize(t.encode()) for t in TEXTS]
        for t, o in zip(TEXTS, embed_all(eng, ids)):
            assert float(unit(o.embedding) @ unit(llm.embed(t, normalize=True))) > floor, t
    finally:
        eng.close()
        llm.close()


@pytest.fixture(scope="module")
def gemma_embedding_files(tmp_path_factory) -> dict[str, Path]:
    from synth_bert import write_gemma_embedding
    d = tmp_path_factory.mktemp("gemma-embedding")
    plain = write_gemma_embedding(d / "ge-F32.gguf", seed=7, dense=False)
    dense = write_gemma_embedding(d / "ge-dense-F32.gguf", seed=8, dense=True)
    return {"F32": plain, "dense-F32": dense,
            "dense-Q8_0": quantize(dense, d / "ge-dense-Q8_0.gguf", "Q8_0")}


@pytest.mark.parametrize("kind,floor", [("F32", 0.9999), ("dense-F32", 0.9999),
                                        ("dense-Q8_0", 0.999)])
def test_embedding_gemma_matches_llamacpp(gemma_embedding_files, kind, floor):
    """gemma-embedding: bidirectional gemma3 block, symmetric sliding window on local layers
    (prompts longer than the window), mean pooling, then the dense_2/dense_3 projections."""
    text = " ".join(TEXTS)             # ~90 tokens: past the synthetic model's 32-token window
    llm = _llama(gemma_embedding_files[kind], 1)
    eng = _engine(gemma_embedding_files[kind])
    try:
        assert eng.cfg.arch == "gemma-embedding" and not eng.cfg.causal
        assert eng.runner.embedding_only
        texts = [text, *TEXTS]
        ids = [eng.encode_raw(t) for t in texts]
        assert ids == [llm.tokenize(t.encode()) for t in texts]
        assert len(ids[0]) > 64
        for t, o in zip(texts, embed_all(eng, ids)):
            assert float(unit(o.embedding) @ unit(llm.embed(t, normalize=True))) > floor, t
    finally:
        eng.close()
        llm.close()


def test_embedding_gemma_torch_backend_agrees(gemma_embedding_files):
    pytest.importorskip("torch")
    path = gemma_embedding_files["dense-F32"]
    a, b = _engine(path), Engine(str(path), EngineConfig(backend="torch:cpu"))
    try:
        ids = [a.encode_raw(t) for t in [" ".join(TEXTS), *TEXTS]]
        for x, y in zip(embed_all(a, ids), embed_all(b, ids)):
            assert float(unit(x.embedding) @ unit(y.embedding)) > 0.99999
    finally:
        a.close()
        b.close()
