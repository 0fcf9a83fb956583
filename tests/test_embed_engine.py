"""Embeddings in the engine: prefill-only requests whose last step returns pooled hidden
states, batched in the continuous batcher, never served from the prefix cache; parity with
llama.cpp's embeddings (llama-cpp-python, embedding=True) on the bundled gemma3."""
from __future__ import annotations

import numpy as np
import pytest

from edgeinfer.engine.core import Engine, EngineConfig, RequestError, embed_all, greedy

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Embeddings map text to vectors so that similar meanings lie close together.",
    "hello",
    "A local inference daemon serves quantized language models on a laptop.",
    "Paris is the capital of France.",
    "numba compiles Python loops to machine code",
]


def unit(v) -> np.ndarray:
    v = np.asarray(v, np.float64)
    return v / np.linalg.norm(v)


@pytest.fixture(scope="module")
def engine(gemma3_path):
    eng = Engine(str(gemma3_path), EngineConfig(backend="cpu"))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def reference(gemma3_path):
    """llama.cpp's mean-pooled, L2-normalized embedding of each text."""
    import llama_cpp
    llm = llama_cpp.Llama(str(gemma3_path), embedding=True, n_ctx=512, verbose=False,
                          pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN)
    out = {t: unit(llm.embed(t, normalize=True)) for t in TEXTS}
    llm.close()
    return out


def test_model_pooling_defaults_to_mean(engine):
    # gemma3 has no pooling_type: decoders pool by mean, as Ollama does
    assert engine.pooling == "mean"


def test_parity_with_llamacpp_mean_pooling(engine, reference):
    outs = embed_all(engine, [engine.encode_raw(t) for t in TEXTS])
    for t, o in zip(TEXTS, outs):
        assert o.finished and o.finish_reason == "stop" and o.num_output_tokens == 0
        assert o.embedding.shape == (engine.cfg.n_embd,)
        assert np.isfinite(o.embedding).all()
        cos = float(unit(o.embedding) @ reference[t])
        assert cos > 0.999, (t, cos)


def test_many_inputs_batch_in_one_step(engine):
    prompts = [engine.encode_raw(t) for t in TEXTS]
    before = engine.steps
    outs = embed_all(engine, prompts)
    # all six prompts (~70 tokens) fit one step's token budget: one forward pass, not six
    assert engine.steps - before == 1
    # and batching does not change the result: each alone gives the same vector
    alone = embed_all(engine, [prompts[1]])[0].embedding
    assert float(unit(alone) @ unit(outs[1].embedding)) > 0.99999


def test_no_prefix_cache_hit_for_pooled_positions(engine):
    text = " ".join(TEXTS * 3)           # > 100 tokens: several full 16-token blocks
    ids = engine.encode_raw(text)
    first = embed_all(engine, [ids])[0]
    # a generation request with the same prompt leaves its full blocks in the prefix cache
    gen = engine.generate(ids, greedy(2))
    assert gen.finished
    hits_before = engine.stats()["prefix_cached_tokens"]
    again = embed_all(engine, [ids])[0]
    assert again.num_cached_tokens == 0
    assert engine.stats()["prefix_cached_tokens"] == hits_before     # no lookup served it
    assert float(unit(again.embedding) @ unit(first.embedding)) > 0.99999
    # while a generation request does hit the cache
    assert engine.generate(ids, greedy(1)).num_cached_tokens >= 16


def test_chunked_prefill_pools_every_chunk(gemma3_path, engine):
    ids = engine.encode_raw(" ".join(TEXTS))
    whole = embed_all(engine, [ids])[0].embedding
    small = Engine(str(gemma3_path), EngineConfig(backend="cpu", max_tokens_per_step=16,
                                                  max_running_seqs=4))
    try:
        before = small.steps
        out = embed_all(small, [ids])[0]
        assert small.steps - before >= len(ids) // 16      # really chunked
    finally:
        small.close()
    assert float(unit(out.embedding) @ unit(whole)) > 0.9999


def test_embeddings_mix_with_generation(engine):
    events = []
    gid = engine.submit(engine.encode_raw("Once upon a time"), greedy(5), events.append)
    eids = [engine.submit_embed(engine.encode_raw(t), events.append) for t in TEXTS[:3]]
    engine._drain_commands()
    steps = 0
    while engine.scheduler.has_work():
        engine.step()
        steps += 1
    done = {e.request_id: e for e in events if e.finished}
    assert set(done) == {gid, *eids}
    assert done[gid].num_output_tokens == 5
    assert all(done[i].embedding is not None for i in eids)
    assert done[gid].embedding is None
    assert steps <= 6          # the embeddings rode along the generation's prefill step


def test_other_poolings(engine):
    ids = engine.encode_raw(TEXTS[0])
    (mean,) = embed_all(engine, [ids], "mean")
    (last,) = embed_all(engine, [ids], "last")
    (cls,) = embed_all(engine, [ids], "cls")
    (none,) = embed_all(engine, [ids], "none")
    assert none.embedding.shape == (len(ids), engine.cfg.n_embd)
    np.testing.assert_allclose(none.embedding.mean(axis=0), mean.embedding, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(none.embedding[-1], last.embedding, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(none.embedding[0], cls.embedding, rtol=1e-5, atol=1e-5)


def test_last_pooling_parity(gemma3_path, engine):
    import llama_cpp
    llm = llama_cpp.Llama(str(gemma3_path), embedding=True, n_ctx=512, verbose=False,
                          pooling_type=llama_cpp.LLAMA_POOLING_TYPE_LAST)
    try:
        ref = unit(llm.embed(TEXTS[1], normalize=True))
    finally:
        llm.close()
    (out,) = embed_all(engine, [engine.encode_raw(TEXTS[1])], "last")
    # one position's state carries the quantization noise a mean averages out (0.9989 seen)
    assert float(unit(out.embedding) @ ref) > 0.995


def test_bad_inputs(engine):
    with pytest.raises(RequestError, match="empty"):
        engine.submit_embed([], lambda o: None)
    with pytest.raises(RequestError, match="tokens, more than"):
        engine.submit_embed([2] * (engine.max_embed_tokens + 1), lambda o: None)
    with pytest.raises(RequestError, match="outside the vocabulary"):
        engine.submit_embed([engine.cfg.vocab_size], lambda o: None)
