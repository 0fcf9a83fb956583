"""Embeddings through a real daemon process with the official clients: Ollama /api/embed
(ollama.Client.embed) and /api/embeddings, OpenAI /v1/embeddings (openai embeddings.create,
float and base64), Matryoshka `dimensions`, truncation, and each API's 400s. The vectors are
compared with llama.cpp's (llama-cpp-python, embedding=True, mean pooling) on the same model."""
from __future__ import annotations

import base64

import numpy as np
import ollama
import openai
import pytest

from daemon_fixture import shared_daemon  # noqa: F401  (module fixture)

MODEL = "gemma3:270m"
TEXTS = ["The quick brown fox jumps over the lazy dog.",
         "Embeddings map text to vectors so that similar meanings lie close together.",
         "Paris is the capital of France.",
         "hello"]


def unit(v) -> np.ndarray:
    v = np.asarray(v, np.float64)
    return v / np.linalg.norm(v)


@pytest.fixture(scope="module")
def reference(gemma3_path):
    import llama_cpp
    llm = llama_cpp.Llama(str(gemma3_path), embedding=True, n_ctx=512, verbose=False,
                          pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN)
    out = {t: unit(llm.embed(t, normalize=True)) for t in TEXTS}
    out["__tokens__"] = {t: llm.tokenize(t.encode()) for t in TEXTS}
    llm.close()
    return out


@pytest.fixture(scope="module")
def oa(shared_daemon):  # noqa: F811
    with openai.OpenAI(base_url=shared_daemon.url + "/v1", api_key="unused", max_retries=0,
                       timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def ol(shared_daemon):  # noqa: F811
    return ollama.Client(host=shared_daemon.url, timeout=300)


# ----- Ollama ------------------------------------------------------------------------------

def test_ollama_embed_batch_matches_llamacpp(ol, reference):
    r = ol.embed(model=MODEL, input=TEXTS)
    assert r.model == MODEL
    assert len(r.embeddings) == len(TEXTS)
    for t, e in zip(TEXTS, r.embeddings):
        e = np.asarray(e)
        assert e.shape == (640,) and np.isfinite(e).all()
        assert abs(np.linalg.norm(e) - 1) < 1e-5                  # normalized
        assert float(e @ reference[t]) > 0.999, t
    assert r.prompt_eval_count == sum(len(reference["__tokens__"][t]) for t in TEXTS)
    assert r.total_duration > 0 and r.load_duration is not None


def test_ollama_embed_single_string_and_dimensions(ol, reference):
    full = np.asarray(ol.embed(model=MODEL, input=TEXTS[0]).embeddings[0])
    r = ol.embed(model=MODEL, input=TEXTS[0], dimensions=64)
    small = np.asarray(r.embeddings[0])
    assert small.shape == (64,)
    assert abs(np.linalg.norm(small) - 1) < 1e-5
    np.testing.assert_allclose(small, unit(full[:64]), atol=1e-5)    # Matryoshka: cut, renorm


def test_ollama_embed_truncation(shared_daemon, ol):  # noqa: F811
    long = "word " * 3000                  # far past the daemon's 1024-token context
    r = ol.embed(model=MODEL, input=[TEXTS[0], long])
    assert len(r.embeddings) == 2 and np.isfinite(r.embeddings[1]).all()
    assert r.prompt_eval_count < 1024 + 20
    with pytest.raises(ollama.ResponseError) as e:
        ol.embed(model=MODEL, input=[TEXTS[0], long], truncate=False)
    assert e.value.status_code == 400 and "input 1" in e.value.error
    assert "truncate" in e.value.error


def test_ollama_embed_bad_input(shared_daemon):  # noqa: F811
    r = shared_daemon.post("/api/embed", {"model": MODEL, "input": []})
    assert r.status_code == 400 and "empty" in r.json()["error"]
    r = shared_daemon.post("/api/embed", {"model": MODEL, "input": "x", "dimensions": 4096})
    assert r.status_code == 400 and "640" in r.json()["error"]
    r = shared_daemon.post("/api/embed", {"model": "nope:1", "input": "x"})
    assert r.status_code == 404 and isinstance(r.json()["error"], str)
    # no input: Ollama's way to load the model
    r = shared_daemon.post("/api/embed", {"model": MODEL})
    assert r.status_code == 200 and r.json()["embeddings"] == []


def test_ollama_legacy_embeddings(shared_daemon, ol, reference):  # noqa: F811
    r = ol.embeddings(model=MODEL, prompt=TEXTS[2])
    e = np.asarray(r.embedding)
    assert e.shape == (640,)
    assert abs(np.linalg.norm(e) - 1) > 1e-3          # raw, as Ollama's legacy endpoint
    assert float(unit(e) @ reference[TEXTS[2]]) > 0.999
    assert shared_daemon.post("/api/embeddings", {"model": MODEL, "prompt": ""}).json() == \
        {"embedding": []}


# ----- OpenAI ------------------------------------------------------------------------------

def test_openai_embeddings_float_and_base64(oa, reference):
    r = oa.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert [d.index for d in r.data] == list(range(len(TEXTS)))
    for t, d in zip(TEXTS, r.data):
        assert float(np.asarray(d.embedding) @ reference[t]) > 0.999
    n = sum(len(reference["__tokens__"][t]) for t in TEXTS)
    assert r.usage.prompt_tokens == n and r.usage.total_tokens == n
    # the client's default asks for base64 and decodes it itself
    r64 = oa.embeddings.create(model=MODEL, input=TEXTS)
    for a, b in zip(r.data, r64.data):
        np.testing.assert_allclose(a.embedding, b.embedding, atol=1e-6)


def test_openai_raw_base64_bytes(shared_daemon):  # noqa: F811
    r = shared_daemon.post("/v1/embeddings", {"model": MODEL, "input": TEXTS[0],
                                              "encoding_format": "base64"})
    emb = r.json()["data"][0]["embedding"]
    v = np.frombuffer(base64.b64decode(emb), "<f4")
    assert v.shape == (640,) and abs(np.linalg.norm(v) - 1) < 1e-5


def test_openai_token_id_inputs(oa, reference):
    toks = [reference["__tokens__"][t] for t in TEXTS[:2]]
    r = oa.embeddings.create(model=MODEL, input=toks, encoding_format="float")
    for t, d in zip(TEXTS, r.data):
        assert float(np.asarray(d.embedding) @ reference[t]) > 0.999
    r1 = oa.embeddings.create(model=MODEL, input=toks[0], encoding_format="float")
    np.testing.assert_allclose(r1.data[0].embedding, r.data[0].embedding, atol=1e-5)


def test_openai_dimensions(oa):
    r = oa.embeddings.create(model=MODEL, input=TEXTS[1], dimensions=128, encoding_format="float")
    v = np.asarray(r.data[0].embedding)
    assert v.shape == (128,) and abs(np.linalg.norm(v) - 1) < 1e-5


def test_openai_errors(oa, shared_daemon):  # noqa: F811
    with pytest.raises(openai.BadRequestError) as e:
        oa.embeddings.create(model=MODEL, input=["ok", "word " * 3000])
    assert "input 1" in e.value.message
    body = e.value.body
    assert body["type"] == "invalid_request_error" and body["param"] == "input"
    with pytest.raises(openai.BadRequestError):
        oa.embeddings.create(model=MODEL, input=[])
    with pytest.raises(openai.BadRequestError) as e:
        oa.embeddings.create(model=MODEL, input="x", dimensions=641)
    assert e.value.body["param"] == "dimensions"
    with pytest.raises(openai.BadRequestError):
        oa.embeddings.create(model=MODEL, input=[[1, 2], [10 ** 9]])
    with pytest.raises(openai.NotFoundError):
        oa.embeddings.create(model="missing:1", input="x")
    # truncate (an edgeinfer extension) cuts instead
    r = shared_daemon.post("/v1/embeddings", {"model": MODEL, "input": "word " * 3000,
                                              "truncate": True})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] <= 1023


def test_rerank_needs_a_rank_model(shared_daemon):  # noqa: F811
    for path in ("/v1/rerank", "/rerank"):
        r = shared_daemon.post(path, {"model": MODEL, "query": "q", "documents": ["a", "b"]})
        assert r.status_code == 400, r.text
        assert "rank head" in r.text


def test_embeddings_leave_no_blocks(shared_daemon, ol):  # noqa: F811
    from daemon_fixture import wait_idle
    ol.embed(model=MODEL, input=TEXTS * 4)
    m = wait_idle(shared_daemon, baseline_used=0)
    assert m["running"] == 0


def test_embeddings_count_in_metrics(shared_daemon, ol):  # noqa: F811
    def prompt_tokens() -> float:
        for line in shared_daemon.get("/metrics").text.splitlines():
            if line.startswith("edgeinfer_prompt_tokens_total") and MODEL in line:
                return float(line.rsplit(" ", 1)[1])
        return 0.0
    before = prompt_tokens()
    r = ol.embed(model=MODEL, input=TEXTS)
    assert prompt_tokens() - before == r.prompt_eval_count
