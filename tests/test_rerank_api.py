"""Reranking and encoder embeddings through a real daemon: /v1/rerank and /rerank (llama-server /
Jina shape) on a synthetic BERT reranker, scores equal to llama.cpp's rank pooling; /api/embed
(official ollama client) and /v1/embeddings (official openai client) on a BERT embedding model
against llama.cpp; generation on an embedding-only model and embeddings from a reranker are
400s in each API's shape."""
from __future__ import annotations

import numpy as np
import ollama
import openai
import pytest

from daemon_fixture import start_daemon
from synth_bert import write_bert
from test_embed_bert import DOCS, QUERY, _llama, _llama_rank_scores, unit

TEXTS = ["the quick brown fox jumps over the lazy dog.", "paris is the capital of france!",
         "hello"]


@pytest.fixture(scope="module")
def bert_daemon(tmp_path_factory):
    from edgeinfer.store.model_store import Store
    d = tmp_path_factory.mktemp("bert-daemon")
    files = {"rank": write_bert(d / "rank.gguf", reranker=True, seed=3),
             "mean": write_bert(d / "mean.gguf", "mean", seed=1)}
    home = d / "home"
    store = Store(home)
    store.register_file(files["rank"], "bert-rerank:test")
    store.register_file(files["mean"], "bert-embed:test")
    daemon = start_daemon(home)
    try:
        yield daemon, files
    finally:
        daemon.stop()


def test_rerank_matches_llamacpp_and_sorts(bert_daemon):
    d, files = bert_daemon
    from edgeinfer.formats.tokenizer import Tokenizer
    from edgeinfer.server.embeddings_api import rerank_prompt

    class _E:          # rerank_prompt reads engine.tokenizer
        tokenizer = Tokenizer.from_file(files["rank"])
    ref = _llama_rank_scores(files["rank"], [rerank_prompt(_E, QUERY, doc) for doc in DOCS])
    for path in ("/v1/rerank", "/rerank"):
        r = d.post(path, {"model": "bert-rerank:test", "query": QUERY, "documents": DOCS})
        assert r.status_code == 200, r.text
        body = r.json()
        res = body["results"]
        assert sorted(x["index"] for x in res) == list(range(len(DOCS)))
        scores = [x["relevance_score"] for x in res]
        assert scores == sorted(scores, reverse=True)
        for x in res:
            assert abs(x["relevance_score"] - ref[x["index"]]) < 1e-3
            assert "document" not in x
        assert body["usage"]["prompt_tokens"] > 0
    r = d.post("/v1/rerank", {"model": "bert-rerank:test", "query": QUERY,
                              "documents": [{"text": t} for t in DOCS], "top_n": 2,
                              "return_documents": True})
    res = r.json()["results"]
    assert len(res) == 2 and res[0]["document"] == {"text": DOCS[res[0]["index"]]}
    assert res[0]["index"] == int(np.argmax(ref))


def test_rerank_bad_requests(bert_daemon):
    d, _ = bert_daemon
    r = d.post("/v1/rerank", {"model": "bert-rerank:test", "query": QUERY, "documents": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "documents"
    r = d.post("/v1/rerank", {"model": "bert-embed:test", "query": QUERY, "documents": ["a"]})
    assert r.status_code == 400 and "rank head" in r.json()["error"]["message"]
    r = d.post("/rerank", {"model": "bert-rerank:test", "documents": ["a"]})
    assert r.status_code == 400 and "query" in r.json()["error"]


def test_bert_embeddings_through_both_clients(bert_daemon):
    import llama_cpp
    d, files = bert_daemon
    llm = _llama(files["mean"], llama_cpp.LLAMA_POOLING_TYPE_MEAN)
    try:
        ref = [unit(llm.embed(t, normalize=True)) for t in TEXTS]
    finally:
        llm.close()
    ol = ollama.Client(host=d.url, timeout=300)
    r = ol.embed(model="bert-embed:test", input=TEXTS)
    for e, want in zip(r.embeddings, ref):
        assert float(np.asarray(e) @ want) > 0.9999
    with openai.OpenAI(base_url=d.url + "/v1", api_key="x", max_retries=0, timeout=300) as oa:
        r = oa.embeddings.create(model="bert-embed:test", input=TEXTS)
        for e, want in zip(r.data, ref):
            assert float(np.asarray(e.embedding) @ want) > 0.9999
        with pytest.raises(openai.BadRequestError) as e:
            oa.embeddings.create(model="bert-rerank:test", input="x")
        assert "rerank" in e.value.message
        with pytest.raises(openai.BadRequestError) as e:
            oa.completions.create(model="bert-embed:test", prompt="hello", max_tokens=3)
        assert "embedding model" in e.value.message


def test_generation_on_encoder_is_a_400(bert_daemon):
    d, _ = bert_daemon
    r = d.post("/api/generate", {"model": "bert-embed:test", "prompt": "hello", "raw": True,
                                 "stream": False})
    assert r.status_code == 400 and "embedding model" in r.json()["error"]


def test_show_says_an_encoder_only_embeds(bert_daemon):
    d, _ = bert_daemon
    client = ollama.Client(host=d.url)
    assert client.show("bert-embed:test").capabilities == ["embedding"]
