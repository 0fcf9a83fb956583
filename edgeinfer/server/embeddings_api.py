"""Embeddings and reranking, in each API's shape.

- Ollama: `POST /api/embed` ({model, input: str | [str], truncate, dimensions, keep_alive,
  options} -> {model, embeddings, total_duration, load_duration, prompt_eval_count}) and the
  older `POST /api/embeddings` ({model, prompt} -> {embedding}, not normalized, as Ollama).
- OpenAI: `POST /v1/embeddings` (input as a string, strings, token ids or lists of token ids;
  encoding_format float | base64; dimensions; usage).
- llama-server / Jina: `POST /v1/rerank` and `/rerank` ({model, query, documents, top_n} ->
  {results: [{index, relevance_score, document?}]} sorted by score), on a model whose pooling
  is `rank` (a reranker with a classification head).

Every input of one call is submitted to the engine at once, so they batch in the continuous
batcher (engine.submit_embed); each finishes with its pooled vector. Vectors are L2-normalized
(llama.cpp's `embd_normalize = 2`, Ollama's `normalize`); `dimensions` keeps the first n
values and normalizes again (Matryoshka). A vector that is not finite is an error, never a NaN
in a response.
"""
from __future__ import annotations

import asyncio
import base64
import time
from typing import Any, Literal, Union

import numpy as np
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from edgeinfer.engine.core import RequestError, RequestOutput

from .errors import APIError, bad_param
from .generation import ClientGone
from .model_manager import parse_keep_alive
from .schemas import KeepAlive, OllamaOptions

router = APIRouter(tags=["embeddings"])


class _Loose(BaseModel):
    model_config = ConfigDict(extra="allow")


class OllamaEmbedRequest(_Loose):
    model: str = Field(min_length=1)
    input: Union[str, list[str], None] = None
    truncate: bool = True
    dimensions: int | None = None
    keep_alive: KeepAlive = None
    options: OllamaOptions | None = None


class OllamaEmbeddingsRequest(_Loose):
    model: str = Field(min_length=1)
    prompt: str | None = None
    keep_alive: KeepAlive = None
    options: OllamaOptions | None = None


class OpenAIEmbeddingsRequest(_Loose):
    model: str = Field(min_length=1)
    input: Union[str, list[str], list[int], list[list[int]]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # edgeinfer extensions: truncate over-long inputs instead of a 400; backend / device
    truncate: bool = False
    backend: str | None = None
    device: str | None = None


class RerankDocument(_Loose):
    text: str


class RerankRequest(_Loose):
    model: str = Field(min_length=1)
    query: str
    documents: list[Union[str, RerankDocument]]
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = False
    truncate: bool = True
    backend: str | None = None
    device: str | None = None


# ----- shared ------------------------------------------------------------------------------

def _ns(seconds: float) -> int:
    return int(max(0.0, seconds) * 1e9)


def normalize(v: np.ndarray, dimensions: int | None = None) -> np.ndarray:
    """L2-normalized float32 (the first `dimensions` values when given)."""
    v = np.asarray(v, np.float64).reshape(-1)
    if dimensions is not None:
        v = v[:dimensions]
    n = float(np.sqrt(v @ v))
    return (v / n if n > 0 else v).astype(np.float32)


def _check_dimensions(dimensions: int | None, n_embd: int) -> None:
    if dimensions is None:
        return
    if dimensions < 1:
        raise bad_param("dimensions", "dimensions must be a positive number")
    if dimensions > n_embd:
        raise bad_param("dimensions", f"dimensions is {dimensions}, but this model's "
                        f"embeddings have {n_embd}: ask for {n_embd} or fewer")


class _Held:
    """A loaded model held for one call (released once)."""

    def __init__(self, request: Request, lm, load_duration: float):
        self.manager = request.app.state.manager
        self.metrics = getattr(request.app.state, "metrics", None)
        self.lm, self.load_duration = lm, load_duration
        self.engine = lm.engine
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.manager.release(self.lm, 1)


async def _hold(request: Request, model: str, backend: str | None, device: str | None,
                keep_alive: Any, need: str = "embed") -> _Held:
    ka = parse_keep_alive(keep_alive, None) if keep_alive is not None else None
    lm, load = await request.app.state.manager.acquire(model, backend, sequences=1,
                                                        keep_alive=ka, device=device)
    held = _Held(request, lm, load)
    engine = held.engine
    pooling = getattr(engine, "pooling", None)
    if pooling is None:
        held.release()
        raise APIError(400, f"{model!r} runs on the {lm.backend} backend, which cannot compute "
                       "embeddings: load it on the native backend (cpu or torch)",
                       param="model", code="embeddings_not_supported")
    if need == "rank" and pooling != "rank":
        held.release()
        raise APIError(400, f"{model!r} has no rank head (its pooling is {pooling!r}): rerank "
                       "needs a reranker model (a BERT cross-encoder with a classification "
                       "head, pooling_type rank)", param="model", code="rerank_not_supported")
    if need == "embed" and pooling in ("none", "rank"):
        held.release()
        what = "a reranker (use /v1/rerank)" if pooling == "rank" else \
            "a model without pooling (pooling_type none)"
        raise APIError(400, f"{model!r} is {what}: it gives no one vector per input",
                       param="model", code="embeddings_not_supported")
    return held


def _fit(ids: list[int], limit: int, truncate: bool, index: int, param: str) -> list[int]:
    if len(ids) <= limit:
        return ids
    if not truncate:
        raise bad_param(param, f"input {index} is {len(ids)} tokens, more than the {limit} this "
                        "model takes: shorten it, or send truncate=true to cut it")
    return ids[:limit]


async def _run(held: _Held, prompts: list[list[int]], pooling: str | None = None,
               request: Request | None = None) -> list[np.ndarray]:
    """Submit every prompt at once (they batch in the engine); the raw pooled vectors in order."""
    engine = held.engine
    loop = asyncio.get_running_loop()
    q: asyncio.Queue = asyncio.Queue()

    def sink(out: RequestOutput) -> None:
        if out.finished:
            loop.call_soon_threadsafe(q.put_nowait, out)

    ids: list[int] = []
    results: dict[int, RequestOutput] = {}
    try:
        for p in prompts:
            try:
                ids.append(engine.submit_embed(p, sink, pooling))
            except RequestError as e:
                raise APIError(400, f"input {len(ids)}: {e}", param="input",
                               code="invalid_input") from None
        while len(results) < len(ids):
            try:
                out = await asyncio.wait_for(q.get(), 0.5)
            except asyncio.TimeoutError:
                if request is not None and await request.is_disconnected():
                    raise ClientGone() from None
                continue
            results[out.request_id] = out
            if held.metrics is not None:     # prompt tokens and finish reasons in /metrics
                held.metrics.on_finish(held.lm.name, out.finish_reason or "stop",
                                       out.num_prompt_tokens, 0, 0, out.arrival_time, None,
                                       out.finish_time)
            if out.finish_reason != "stop" or out.embedding is None:
                raise APIError(500, f"embedding failed: {out.error or out.finish_reason}",
                               code="engine_error")
        vecs = [results[i].embedding for i in ids]
    finally:
        for i in ids:
            if i not in results:         # an error or a gone client: free their blocks
                engine.abort(i)
    for k, v in enumerate(vecs):
        if not np.isfinite(v).all():
            raise APIError(500, f"the model produced a non-finite embedding for input {k}",
                           code="engine_error")
    return vecs


async def _tokenize(held: _Held, texts: list[str]) -> list[list[int]]:
    engine = held.engine
    return await asyncio.to_thread(lambda: [engine.encode_raw(t) for t in texts])


# ----- Ollama ------------------------------------------------------------------------------

def _placement(options: OllamaOptions | None) -> tuple[str | None, str | None]:
    return (options.backend, options.device) if options else (None, None)


@router.post("/api/embed")
async def ollama_embed(body: OllamaEmbedRequest, request: Request):
    t0 = time.monotonic()
    if isinstance(body.input, list) and not body.input:
        raise bad_param("input", "input is an empty list: send a string or a list of strings")
    texts = [body.input] if isinstance(body.input, str) else list(body.input or [])
    backend, device = _placement(body.options)
    held = await _hold(request, body.model, backend, device, body.keep_alive)
    try:
        if not texts or texts == [""]:     # Ollama's way to load a model: nothing to embed
            return {"model": body.model, "embeddings": [], "total_duration": _ns(time.monotonic() - t0),
                    "load_duration": _ns(held.load_duration), "prompt_eval_count": 0}
        _check_dimensions(body.dimensions, held.engine.cfg.n_embd)
        limit = held.engine.max_embed_tokens
        prompts = [_fit(p, limit, body.truncate, i, "input")
                   for i, p in enumerate(await _tokenize(held, texts))]
        vecs = await _run(held, prompts, request=request)
        return {"model": body.model,
                "embeddings": [normalize(v, body.dimensions).tolist() for v in vecs],
                "total_duration": _ns(time.monotonic() - t0),
                "load_duration": _ns(held.load_duration),
                "prompt_eval_count": sum(len(p) for p in prompts)}
    finally:
        held.release()


@router.post("/api/embeddings")
async def ollama_embeddings(body: OllamaEmbeddingsRequest, request: Request):
    backend, device = _placement(body.options)
    held = await _hold(request, body.model, backend, device, body.keep_alive)
    try:
        if not body.prompt:
            return {"embedding": []}
        (ids,) = await _tokenize(held, [body.prompt])
        ids = _fit(ids, held.engine.max_embed_tokens, True, 0, "prompt")
        (vec,) = await _run(held, [ids], request=request)
        # the legacy endpoint returns the pooled vector as it is (Ollama does not normalize it)
        return {"embedding": np.asarray(vec, np.float32).reshape(-1).tolist()}
    finally:
        held.release()


# ----- OpenAI ------------------------------------------------------------------------------

def _openai_inputs(inp) -> tuple[list[str] | None, list[list[int]] | None]:
    if isinstance(inp, str):
        return [inp], None
    if not inp:
        raise bad_param("input", "input must not be empty")
    if all(isinstance(x, int) for x in inp):
        return None, [list(inp)]
    if all(isinstance(x, str) for x in inp):
        return list(inp), None
    if all(isinstance(x, list) for x in inp):
        for i, x in enumerate(inp):
            if not x:
                raise bad_param("input", f"input {i} is an empty list of token ids")
        return None, [list(x) for x in inp]
    raise bad_param("input", "input must be a string, a list of strings, a list of token ids "
                    "or a list of lists of token ids")


@router.post("/v1/embeddings")
async def openai_embeddings(body: OpenAIEmbeddingsRequest, request: Request):
    texts, token_lists = _openai_inputs(body.input)
    if texts is not None and any(t == "" for t in texts):
        raise bad_param("input", f"input {texts.index('')} is an empty string")
    held = await _hold(request, body.model, body.backend, body.device, None)
    try:
        _check_dimensions(body.dimensions, held.engine.cfg.n_embd)
        prompts = token_lists if token_lists is not None else await _tokenize(held, texts)
        limit = held.engine.max_embed_tokens
        prompts = [_fit(p, limit, body.truncate, i, "input") for i, p in enumerate(prompts)]
        vecs = await _run(held, prompts, request=request)
    finally:
        held.release()
    data = []
    for i, v in enumerate(vecs):
        u = normalize(v, body.dimensions)
        emb: Any = (base64.b64encode(u.astype("<f4").tobytes()).decode("ascii")
                    if body.encoding_format == "base64" else u.tolist())
        data.append({"object": "embedding", "index": i, "embedding": emb})
    n = sum(len(p) for p in prompts)
    return {"object": "list", "data": data, "model": body.model,
            "usage": {"prompt_tokens": n, "total_tokens": n}}


# ----- rerank ------------------------------------------------------------------------------

def rerank_prompt(engine, query: str, doc: str) -> list[int]:
    """llama.cpp's format_prompt_rerank: [BOS] query [EOS] [SEP] doc [EOS], each special
    token where the vocabulary asks for it (EOS falls back to SEP)."""
    tok = engine.tokenizer
    q = tok.encode(query, add_special=False, parse_special=False)
    d = tok.encode(doc, add_special=False, parse_special=False)
    bos, eos, sep = (getattr(tok, a, None) for a in ("bos_id", "eos_id", "sep_id"))
    if eos is None:
        eos = sep
    add_bos = bool(getattr(tok, "add_bos", False))
    add_eos = bool(getattr(tok, "add_eos", False))
    add_sep = bool(getattr(tok, "add_sep", False))
    out = ([bos] if add_bos and bos is not None else []) + q
    if add_eos and eos is not None:
        out.append(eos)
    if add_sep and sep is not None:
        out.append(sep)
    out += d
    if add_eos and eos is not None:
        out.append(eos)
    return out


async def _rerank(body: RerankRequest, request: Request):
    if not body.documents:
        raise bad_param("documents", "documents must be a non-empty list")
    docs = [d if isinstance(d, str) else d.text for d in body.documents]
    held = await _hold(request, body.model, body.backend, body.device, None, need="rank")
    try:
        engine = held.engine
        prompts = await asyncio.to_thread(lambda: [rerank_prompt(engine, body.query, d)
                                                   for d in docs])
        limit = engine.max_embed_tokens
        prompts = [_fit(p, limit, body.truncate, i, "documents") for i, p in enumerate(prompts)]
        scores = await _run(held, prompts, "rank", request=request)
    finally:
        held.release()
    results = []
    for i, s in enumerate(scores):
        r: dict[str, Any] = {"index": i, "relevance_score": float(np.asarray(s).reshape(-1)[0])}
        if body.return_documents:
            r["document"] = {"text": docs[i]}
        results.append(r)
    results.sort(key=lambda r: -r["relevance_score"])
    if body.top_n is not None:
        results = results[:body.top_n]
    n = sum(len(p) for p in prompts)
    return {"model": body.model, "object": "list", "results": results,
            "usage": {"prompt_tokens": n, "total_tokens": n}}


@router.post("/v1/rerank")
async def rerank_v1(body: RerankRequest, request: Request):
    return await _rerank(body, request)


@router.post("/rerank")
async def rerank(body: RerankRequest, request: Request):
    return await _rerank(body, request)
