"""Ollama-compatible routes under /api: generate, chat, tags, ps, show, pull, delete, copy,
version. Streaming is NDJSON (one JSON object per line) unless `"stream": false`."""
from __future__ import annotations

import asyncio
import functools
import json
import os
import time
from datetime import datetime, timezone
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse

from edgeinfer import __version__
from edgeinfer.formats.chat_template import ChatTemplateError, chat_template_for
from edgeinfer.engine.core import RequestOutput
from edgeinfer.formats.gguf_file import GGUFError, read_gguf
from edgeinfer.formats.model_config import EMBEDDING_ARCHS, summarize
from edgeinfer.backends.cpu_plan import FileLayout
from edgeinfer.runners.choice import describe_weights, device_of, weights_format_of
from edgeinfer.store.model_store import ModelNotFound, StoreError

from edgeinfer.engine.grammar import any_json_object, json_schema

from . import generation, harmony as hm, tools as tl
from .errors import APIError, bad_param, not_found
from .generation import Generation, params_or_400
from .images import MEDIA_MARKER, ImageCollector, build_with_images, check_text, from_b64
from .metrics import iso
from .model_manager import parse_keep_alive
from edgeinfer.store.bundled_listing import list_models

from .schemas import (ChatRequest, CopyRequest, GenerateRequest, ModelNameRequest,
                      OllamaOptions, PullRequest, _OllamaBase, sampler_kwargs)

router = APIRouter(prefix="/api", tags=["ollama"])


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _ns(seconds: float | None) -> int:
    return int(max(0.0, seconds or 0.0) * 1e9)


def _sampling(opts: OllamaOptions | None, prompt_len: int, want_lp: bool, top_lp: int | None):
    o = opts or OllamaOptions()
    max_tokens = None
    if o.num_predict is not None:
        if o.num_predict == 0 or o.num_predict < -2:
            raise bad_param("options.num_predict", "num_predict must be -1 (no limit), -2 "
                            "(fill the context) or a positive number of tokens")
        max_tokens = o.num_predict if o.num_predict > 0 else None
    if o.num_ctx is not None:
        if prompt_len >= o.num_ctx:
            raise bad_param("options.num_ctx", f"the prompt is {prompt_len} tokens, but num_ctx "
                            f"is {o.num_ctx} (leave room for at least one output token)")
        room = o.num_ctx - prompt_len
        max_tokens = room if max_tokens is None else min(max_tokens, room)

    def pick(v, default):
        return default if v is None else v
    # Ollama's defaults, not SamplingParams' own.
    return params_or_400(
        temperature=pick(o.temperature, 0.8), top_k=pick(o.top_k, 40),
        top_p=pick(o.top_p, 0.9), min_p=pick(o.min_p, 0.0),
        repeat_penalty=pick(o.repeat_penalty, 1.1), repeat_last_n=pick(o.repeat_last_n, 64),
        presence_penalty=pick(o.presence_penalty, 0.0),
        frequency_penalty=pick(o.frequency_penalty, 0.0),
        seed=o.seed, max_tokens=max_tokens, stop=o.stop if o.stop is not None else (),
        logprobs=(top_lp or 0) if want_lp else None,
        **sampler_kwargs(o, skip=("repeat_last_n",)))


def _given(opts: OllamaOptions | None) -> set[str]:
    """SamplingParams names the options set (the rest may take the model's defaults)."""
    given = set(opts.model_fields_set) if opts is not None else set()
    if "num_predict" in given:
        given.add("max_tokens")
    return given


def _logprobs(out: RequestOutput, tok) -> list[dict]:
    def s(t: int) -> str:
        return tok.piece(int(t)).decode("utf-8", errors="replace")
    res = []
    for j, (tid, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        tops = out.top_logprobs[j] if j < len(out.top_logprobs) else []
        res.append({"token": s(tid), "logprob": lp,
                    "top_logprobs": [{"token": s(a), "logprob": l} for a, l in tops]})
    return res


def _timings(gen: Generation, t0: float) -> dict[str, Any]:
    u = gen.usage
    end = u.finish or time.monotonic()
    first = u.first_token or end
    return {"total_duration": _ns(time.monotonic() - t0), "load_duration": _ns(u.load_duration),
            "prompt_eval_count": u.prompt_tokens, "prompt_eval_duration": _ns(first - u.arrival),
            "eval_count": u.completion_tokens, "eval_duration": _ns(end - first),
            "prompt_cached_count": u.cached_tokens}       # edgeinfer: prefix-cache hits


def _ndjson(obj: Any) -> bytes:
    return (json.dumps(obj, separators=(",", ":")) + "\n").encode()


def _placement(body: _OllamaBase) -> tuple[str | None, str | None]:
    """The edgeinfer load options `options.backend` / `options.device` (None: the server's)."""
    o = body.options
    return (o.backend, o.device) if o else (None, None)


def _kv_cache_type(body: _OllamaBase) -> str | None:
    """The edgeinfer load option `options.kv_cache_type` (None: as loaded / the server's)."""
    return body.options.kv_cache_type if body.options else None


async def _load_or_unload(request: Request, body: _OllamaBase, keep_alive: float | None,
                          extra: dict) -> dict:
    """An empty prompt / message list: Ollama's way to load (or, keep_alive 0, unload)."""
    manager = request.app.state.manager
    if keep_alive == 0:
        manager.resolve(body.model)              # 404 for unknown names
        await manager.unload(body.model)
        return {"model": body.model, "created_at": _now(), **extra, "done": True,
                "done_reason": "unload"}
    backend, device = _placement(body)
    lm, _ = await manager.acquire(body.model, backend, sequences=0, keep_alive=keep_alive,
                                  device=device, kv_cache_type=_kv_cache_type(body))
    manager.release(lm, 0)
    return {"model": body.model, "created_at": _now(), **extra, "done": True,
            "done_reason": "load"}


def _format_spec(body: _OllamaBase):
    """Ollama's `format`: "json" (any JSON value; we ask for an object, as Ollama's prompt
    does) or a JSON schema object; "" or null: free text."""
    f = body.format
    if f is None or f == "":
        return None
    if f == "json":
        return any_json_object()
    if isinstance(f, dict):
        return json_schema(f)
    raise bad_param("format", f"format {f!r} must be \"json\" or a JSON schema object")


def _think_mode(body: _OllamaBase, engine) -> bool:
    """Whether to split <think> output into `thinking`. think=true (or a level) for a model
    that cannot think is a 400, as in Ollama."""
    t = body.think
    if isinstance(t, str) and t not in ("low", "medium", "high"):
        raise bad_param("think", f"think {t!r} must be true, false, \"low\", \"medium\" or "
                                 "\"high\"")
    if hm.engine_harmony(engine):
        # gpt-oss always reasons (its output is split whatever `think` says); only the level
        # can be chosen, so turning it off is refused rather than ignored
        if t is False:
            raise bad_param("think", f"\"{body.model}\" (Harmony) cannot turn thinking off; "
                                     "use think \"low\"")
        return True
    able = tl.can_think(engine)
    if t not in (None, False) and not able:
        raise bad_param("think", f"\"{body.model}\" does not support thinking")
    return able and t is not False


class _Out:
    """One response's text split into content, thinking and tool calls."""

    def __init__(self, tools: list, think: bool, harmony: bool = False):
        self.harmony = hm.HarmonySplitter(tools) if harmony else None
        self.splitter = tl.StreamSplitter(tools) if tools and not harmony else None
        self.think = tl.ThinkSplitter() if think and not harmony else None
        self.calls: list = []

    def feed(self, text: str, final: bool = False, reason: str | None = None
             ) -> tuple[str, str, list]:
        if self.harmony is not None:
            ev = self.harmony.feed(text) + (
                self.harmony.flush(truncated=reason in ("length", "repetition")) if final else [])
            calls = [v for k, v in ev if k == "call"]
            self.calls += calls
            return ("".join(v for k, v in ev if k == "reasoning"),
                    "".join(v for k, v in ev if k == "text"), calls)
        thinking, content = self.think.feed(text) if self.think else ("", text)
        if final and self.think:
            r, c = self.think.flush()
            thinking, content = thinking + r, content + c
        if self.splitter is None:
            return thinking, content, []
        events = self.splitter.feed(content) + (
            self.splitter.flush(truncated=reason in ("length", "repetition")) if final else [])
        calls = [v for k, v in events if k == "call"]
        self.calls += calls
        return thinking, "".join(v for k, v in events if k == "text"), calls


async def _run(request: Request, body: _OllamaBase, build_prompt, shape,
               tools: list | None = None) -> Any:
    """Shared body of generate and chat. `build_prompt(engine, think) -> ids`;
    `shape(text, lp, thinking, calls)` -> the per-chunk fields (`response` or `message`)."""
    t0 = time.monotonic()
    manager, metrics = request.app.state.manager, request.app.state.metrics
    keep_alive = parse_keep_alive(body.keep_alive, None) if body.keep_alive is not None else None
    backend, device = _placement(body)
    spec = _format_spec(body)
    tools = tools or []
    gen = await generation.start(manager, metrics, body.model, 1, backend, keep_alive, device,
                                 _kv_cache_type(body))
    with gen.held(streaming=bool(body.stream)):
        engine = gen.lm.engine
        think = _think_mode(body, engine)
        harmony = hm.engine_harmony(engine)
        try:
            prompt = await gen.encode(lambda e: build_prompt(e, body.think))
        except ChatTemplateError as e:
            raise bad_param("messages", str(e)) from None
        spans = None
        if isinstance(prompt, tuple):       # (ids, image spans)
            prompt, spans = prompt
        params = _sampling(body.options, len(prompt), body.logprobs, body.top_logprobs)
        params = gen.adapt(params, _given(body.options),
                           body.options.stop_on_repetition if body.options else None)
        param = "format"
        if spec is None and not harmony and (auto := tl.auto_spec(tools, tl.Choice("auto"), True,
                                                  engine.chat_template)) is not None:
            spec, param = auto, "tools"
        if spec is None and harmony and (auto := hm.auto_spec(engine, tools,
                                                           tl.Choice("auto"))) is not None:
            spec, param = auto, "tools"
        constraints = (await tl.build_constraints(engine, spec, 1, param)
                       if spec is not None else None)
        tok = engine.tokenizer
        o = _Out(tools, think, harmony)

        def final() -> dict:
            return {"model": body.model, "created_at": _now(), **shape("", None, "", []),
                    "done": True, "done_reason": gen.usage.finish_reasons.get(0, "stop"),
                    **_timings(gen, t0)}

        if body.stream:
            gen.submit(prompt, params, constraints=constraints, images=spans)
            events = gen.events()

            async def lines() -> AsyncIterator[bytes]:
                try:
                    async for _, out in events:
                        if out.text or out.token_ids or out.finished:
                            lp = _logprobs(out, tok) if body.logprobs else None
                            thinking, text, calls = o.feed(out.text, final=out.finished,
                                                           reason=out.finish_reason)
                            if text or thinking or calls or lp:
                                yield _ndjson({"model": body.model, "created_at": _now(),
                                               **shape(text, lp, thinking, calls),
                                               "done": False})
                    yield _ndjson(final())
                except APIError as e:
                    yield _ndjson(e.ollama_body())
            return _stream(gen, events, lines())
        text, thinking, calls, lps = "", "", [], []
        gen.submit(prompt, params, constraints=constraints, images=spans)
        async for _, out in gen.events(lambda: request.is_disconnected()):
            th, tx, cl = o.feed(out.text, final=out.finished, reason=out.finish_reason)
            text, thinking, calls = text + tx, thinking + th, calls + cl
            if body.logprobs:
                lps += _logprobs(out, tok)
        res = final()
        res.update(shape(text.strip() if calls else text, lps if body.logprobs else None,
                         thinking, calls))
        return res


def _stream(gen: Generation, events, agen: AsyncIterator[bytes]) -> StreamingResponse:
    return generation.streaming_response(gen, agen, "application/x-ndjson", source=events)


@router.post("/generate")
async def generate(body: GenerateRequest, request: Request):
    images = ImageCollector()
    if body.images:
        if body.raw:
            raise bad_param("images", "images need the model's chat template: they cannot be "
                            "sent with raw: true")
        if not isinstance(body.images, list):
            raise bad_param("images", "images must be a list of base64 strings")
        for j, data in enumerate(body.images):
            images.add(from_b64(data, f"images[{j}]"))
        check_text(body.prompt or "", "prompt")
    ka = parse_keep_alive(body.keep_alive, None) if body.keep_alive is not None else None
    if not body.prompt and not body.system and not images:
        return await _load_or_unload(request, body, ka, {"response": ""})

    def build(engine, think):
        if body.raw:
            return engine.encode_raw(body.prompt or "")
        # the images before the text, as Ollama places them
        prompt = "".join(MEDIA_MARKER for _ in images.refs) + (body.prompt or "")
        messages = ([{"role": "system", "content": body.system}] if body.system else []) + \
            [{"role": "user", "content": prompt}]
        if images:
            return build_with_images(images.refs, messages, "prompt",
                                     **_think_vars(think, engine))(engine)
        return engine.encode_chat(messages, **_think_vars(think, engine))

    def shape(text: str, lp, thinking: str, calls: list) -> dict:
        return {"response": text, **({"thinking": thinking} if thinking else {}),
                **({"logprobs": lp} if lp is not None else {})}
    return await _run(request, body, build, shape)


def _think_vars(think, engine) -> dict:
    """Template variables for `think`: false turns thinking off where the template can; a
    level goes to templates that take `reasoning_effort` (gpt-oss), a 400 for others."""
    if isinstance(think, str):
        return hm.effort_vars(engine, think, "think")
    return {} if think is None else {"enable_thinking": think is not False}


@router.post("/chat")
async def chat(body: ChatRequest, request: Request):
    images = ImageCollector()
    markers: list[str] = []
    for i, m in enumerate(body.messages or []):
        if m.images and not isinstance(m.images, list):
            raise bad_param(f"messages[{i}].images", "images must be a list of base64 strings")
        if m.images:
            check_text(m.content or "", f"messages[{i}].content")
        markers.append("".join(images.add(from_b64(d, f"messages[{i}].images[{j}]"))
                               for j, d in enumerate(m.images or [])))
    ka = parse_keep_alive(body.keep_alive, None) if body.keep_alive is not None else None
    if not body.messages:
        return await _load_or_unload(request, body, ka,
                                     {"message": {"role": "assistant", "content": ""}})
    tools = tl.parse_tools(body.tools)
    messages = []
    for m, mark in zip(body.messages, markers):
        # a message's images before its text, as Ollama places them
        d: dict[str, Any] = {"role": m.role, "content": mark + (m.content or "")}
        if m.tool_calls:
            d["tool_calls"] = [{"type": "function",
                                "function": {"name": c.function.name,
                                             "arguments": c.function.arguments or {}}}
                               for c in m.tool_calls]
        if m.tool_name:
            d["tool_name"] = d["name"] = m.tool_name
        if m.thinking:                    # earlier reasoning (gpt-oss's template reads it)
            d["thinking"] = m.thinking
        messages.append(d)
    choice = tl.Choice("auto" if tools else "none")

    def build(engine, think):
        msgs, extra = tl.prepare_chat(messages, tools, choice, True, engine.chat_template)
        if images:
            return build_with_images(images.refs, msgs, **extra, **_think_vars(think, engine))(engine)
        return engine.encode_chat(msgs, **extra, **_think_vars(think, engine))

    def shape(text: str, lp, thinking: str, calls: list) -> dict:
        msg: dict[str, Any] = {"role": "assistant", "content": text}
        if thinking:
            msg["thinking"] = thinking
        if calls:
            msg["tool_calls"] = [c.ollama() for c in calls]
        return {"message": msg, **({"logprobs": lp} if lp is not None else {})}
    return await _run(request, body, build, shape, tools)


# ----- models ------------------------------------------------------------------------------

def _details(ref) -> dict[str, Any]:
    g = ref.manifest.get("gguf") or {}
    arch = g.get("architecture") or "unknown"
    n = g.get("parameters") or 0
    size = f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M" if n else ""
    return {"parent_model": "", "format": "gguf", "family": arch, "families": [arch],
            "parameter_size": size, "quantization_level": g.get("file_type") or ""}


def _iso_mtime(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).isoformat().replace("+00:00", "Z")


@router.get("/tags")
async def tags(request: Request):
    store = request.app.state.manager.store
    refs = await asyncio.to_thread(list_models, store)
    return {"models": [{"name": r.full_name, "model": r.full_name,
                        "modified_at": _iso_mtime(r.modified_at), "size": r.size,
                        "digest": r.digest, "details": _details(r)} for r in refs]}


@router.get("/ps")
async def ps(request: Request):
    manager = request.app.state.manager
    out = []
    for lm in manager.models.values():
        ref = manager.store.get(lm.name) if ":" in lm.name else None
        exp = lm.expires_at
        on_gpu = lm.device in ("cuda", "mps")
        out.append({"name": lm.name, "model": lm.name, "size": lm.size,
                    "digest": lm.digest or "", "details": _details(ref) if ref else {},
                    "expires_at": iso(exp) or "2262-04-11T23:47:16Z",   # Go's max time
                    "size_vram": lm.size if on_gpu else 0,
                    "context_length": lm.engine.max_model_len,
                    # edgeinfer extensions: what runs it, and how the weights are held
                    "backend": lm.backend, "device": lm.device,
                    "weights_format": lm.weights_format, "active_requests": lm.active,
                    "kv_cache_type": lm.kv_cache_type,
                    "kv_bytes_per_token": lm.kv_bytes_per_token, "kv_bytes": lm.kv_bytes,
                    "kv_window": lm.kv_window, "state": "loaded"})
    # edgeinfer: loads in progress too (Ollama lists only loaded models), with what they are
    # doing: "compiling kernels (k/n)" (a model with weight types no install or pull
    # compiled), then "loading weights"
    for (name, backend), st in list(manager.loading.items()):
        if any(m["name"] == name and m["backend"] == backend for m in out):
            continue
        ref = manager.store.get(name) if ":" in name else None
        out.append({"name": name, "model": name, "size": 0, "digest": ref.digest if ref else "",
                    "details": _details(ref) if ref else {},
                    "expires_at": "2262-04-11T23:47:16Z", "size_vram": 0, "context_length": 0,
                    "backend": backend, "device": "cpu" if backend == "cpu" else backend,
                    "weights_format": "", "active_requests": 0, "state": "loading",
                    "load_progress": st.to_dict()})
    return {"models": out}


def _model_of(body: ModelNameRequest) -> str:
    name = body.model_name()
    if not name:
        raise bad_param("model", "model is required")
    return name


@router.post("/show")
async def show(body: ModelNameRequest, request: Request):
    manager = request.app.state.manager
    ref = manager.resolve(_model_of(body))

    def read() -> dict[str, Any]:
        s, md, info, template, caps, _ = _file_facts(ref)
        details = _details(ref)
        if not details["parameter_size"]:
            details["parameter_size"] = f"{s.n_params / 1e6:.0f}M"
            details["family"] = s.arch
            details["families"] = [s.arch]
            details["quantization_level"] = s.file_type
        proj = ref.manifest.get("projector") if ref.registered else None
        if isinstance(proj, dict):      # Ollama lists the projector's family beside the model's
            details["families"] = list(dict.fromkeys([*(details.get("families") or []),
                                                      "clip"]))
        return {"license": str(md.get("general.license", "")),
                "modelfile": f"# Modelfile generated by edgeinfer\nFROM {ref.path}\n",
                "parameters": "", "template": template, "details": details,
                "model_info": info,
                "capabilities": caps + (["vision"] if isinstance(proj, dict) else []),
                **({"projector_info": {
                    "clip.projector_type": proj.get("projector_type"),
                    "clip.vision.image_size": proj.get("image_size"),
                    "tokens_per_image": proj.get("tokens_per_image"),
                    "size": proj.get("size"), "digest": proj.get("digest")}}
                   if isinstance(proj, dict) else {}),
                # edgeinfer: no chat template of its own (a base model; see README)
                "base_model": not (isinstance(md.get("tokenizer.chat_template"), str)
                                   and md["tokenizer.chat_template"].strip()),
                "modified_at": _iso_mtime(ref.modified_at),
                "runtime": _runtime(manager, ref)}
    return await asyncio.to_thread(read)


def _file_facts(ref) -> tuple:
    """What /api/show reads from a model's GGUF: its summary, the scalar metadata, the chat
    template, the capabilities and the tensor layout the CPU backend would repack (for
    `runtime`: one parse for both). Remembered for the last few files by path, size and
    mtime (as runners.choice remembers a file's facts), so a client asking before each
    request (our CLI, editors) does not parse a vocabulary each time; the vocabulary itself
    is not kept."""
    try:
        st = os.stat(ref.path)
        return _read_facts(str(ref.path), st.st_size, st.st_mtime_ns)
    except GGUFError as e:
        raise APIError(500, f"{ref.full_name}: {e}") from None
    except OSError as e:
        raise APIError(500, f"{ref.full_name}: {e.strerror}") from None


@functools.lru_cache(maxsize=8)
def _read_facts(path: str, size: int, mtime_ns: int) -> tuple:
    # the parse goes on to a load that follows within seconds (`edgeinfer run`: show, then
    # chat), which reads the vocabulary from it instead of parsing again
    f = read_gguf(path, hand_on_s=SHOW_HAND_ON_S)
    try:
        s = summarize(f)
        md = f.metadata
        info = {k: v for k, v in md.items()
                if isinstance(v, (int, float, str, bool)) and k != "tokenizer.chat_template"}
        info["general.parameter_count"] = s.n_params
        template = chat_template_for(md, s.arch)
        caps = _capabilities(template, md)
        md = {k: md[k] for k in ("general.license", "tokenizer.chat_template") if k in md}
        layout = FileLayout.of(f)
    finally:
        f.close()
    return s, md, info, template, caps, layout


SHOW_HAND_ON_S = 10.0


def _capabilities(template: str, md: dict) -> list[str]:
    """Ollama's capability names: encoders only embed; every generating model takes tools
    (its template's own tool format, or edgeinfer's built-in fallback prompt) and embeds
    (mean pooling); "thinking" where the model writes <think>."""
    if md.get("general.architecture") in EMBEDDING_ARCHS:
        return ["embedding"]
    caps = ["completion", "tools", "embedding"]
    tokens = md.get("tokenizer.ggml.tokens") or ()
    if "<think>" in (template or "") or "<think>" in tokens or hm.is_harmony(template, tokens):
        caps.append("thinking")
    return caps


def _runtime(manager, ref) -> dict[str, Any]:
    """edgeinfer extension of /api/show: the loaded copies' backend and weights format, and
    what a load with the server's default backend/device would use."""
    loaded = [{"backend": lm.backend, "device": lm.device, "weights_format": lm.weights_format,
               "weights": describe_weights(lm.backend, lm.weights_format)}
              for (name, _), lm in list(manager.models.items()) if name == ref.full_name]
    try:
        backend = manager.choose_backend(ref)
        fmt = weights_format_of(backend, str(ref.path), manager.config.repack,
                                manager.config.torch_dtype, layout=_file_facts(ref)[5])
        default = {"backend": backend, "device": device_of(backend), "weights_format": fmt,
                   "weights": describe_weights(backend, fmt)}
    except APIError as e:     # e.g. a default device this machine lost: say so, do not fail
        default = {"backend": None, "device": None, "weights_format": None, "error": str(e)}
    return {"loaded": loaded, "default": default}


@router.delete("/delete")
async def delete(body: ModelNameRequest, request: Request):
    manager = request.app.state.manager
    name = _model_of(body)
    await manager.unload(name)
    try:
        await asyncio.to_thread(manager.store.remove, name)
    except ModelNotFound as e:
        raise not_found(name, str(e)) from None
    except StoreError as e:
        raise APIError(400, str(e), param="model") from None
    return Response(status_code=200)


@router.post("/copy")
async def copy(body: CopyRequest, request: Request):
    store = request.app.state.manager.store
    try:
        await asyncio.to_thread(store.copy, body.source, body.destination, False)
    except ModelNotFound as e:
        raise not_found(body.source, str(e)) from None
    except StoreError as e:
        raise APIError(400, str(e)) from None
    return Response(status_code=200)


@router.post("/pull")
async def pull(body: PullRequest, request: Request):
    from edgeinfer.store.pull import pull as do_pull, resolve_source  # lazy: httpx, for pulls only

    source = _model_of(body)
    store = request.app.state.manager.store
    loop = asyncio.get_running_loop()
    q: asyncio.Queue = asyncio.Queue()
    cancelled = False

    def progress(ev) -> None:
        if cancelled:
            raise RuntimeError("client disconnected")   # pull() keeps the partial file
        loop.call_soon_threadsafe(q.put_nowait, ("progress", ev.to_dict()))

    def work() -> None:
        try:
            do_pull(source, name=body.as_name, sha256=body.sha256, store=store,
                    progress=progress)
            loop.call_soon_threadsafe(q.put_nowait, ("done", None))
        except Exception as e:   # one sentence to the client, never a traceback
            loop.call_soon_threadsafe(q.put_nowait, ("error", _pull_error(e)))

    try:   # name/source errors answer with a status, before any streaming starts
        src = await asyncio.to_thread(resolve_source, source, body.as_name, body.sha256, store)
    except Exception as e:
        raise APIError(*_pull_error(e)) from None
    if src.kind == "file":
        # The daemon may serve other machines: never read its local files on request.
        raise bad_param("model", "local files are imported by the CLI (`edgeinfer pull "
                        "./FILE.gguf`), not through the API")
    task = loop.run_in_executor(None, work)

    async def events() -> AsyncIterator[tuple[str, Any]]:
        nonlocal cancelled
        try:
            while True:
                kind, val = await q.get()
                yield kind, val
                if kind != "progress":
                    return
        finally:
            cancelled = True

    if not body.stream:
        last: dict = {}
        async for kind, val in events():
            if kind == "error":
                raise APIError(val[0], val[1])
            if kind == "progress":
                last = val
        await task
        return {"status": last.get("status", "success")}

    async def lines() -> AsyncIterator[bytes]:
        async for kind, val in events():
            if kind == "progress":
                yield _ndjson(val)
            elif kind == "error":
                yield _ndjson({"error": val[1]})
    return StreamingResponse(lines(), media_type="application/x-ndjson")


def _pull_error(e: Exception) -> tuple[int, str]:
    from edgeinfer.store.download import DownloadError  # lazy: httpx, for pulls only
    if isinstance(e, ModelNotFound):
        return 404, str(e)
    if isinstance(e, DownloadError):
        return 502, str(e)
    if isinstance(e, StoreError):
        return 400, str(e)
    return 500, f"pull failed: {e}"


@router.get("/version")
async def version():
    return {"version": __version__}
