"""Anthropic Messages API: POST /v1/messages and /v1/messages/count_tokens.

A request maps onto the same path as a chat completion: blocks become chat messages (text;
`tool_use` -> an assistant turn's tool_calls; `tool_result` -> a tool turn), tools and
tool_choice go through edgeinfer.server.tools (the model's template, or the built-in
fallback prompt, and the call grammar), and the output is split by the same splitter as
OpenAI's chat. Only the shapes differ:

- content blocks `text` and `tool_use` (id `toolu_...`, `input` an object);
- stop_reason: end_turn | max_tokens (also for edgeinfer's repetition stop) | stop_sequence
  (with `stop_sequence`) | tool_use;
- streaming: SSE with named events message_start, content_block_start, content_block_delta
  (text_delta, input_json_delta), content_block_stop, message_delta (stop_reason, usage),
  message_stop; an error after the stream started is an `error` event;
- errors: {"type": "error", "error": {"type": "invalid_request_error", "message": ...}}.

Accepted and ignored: metadata, service_tier, thinking, container, mcp_servers. A Harmony
(gpt-oss) model's reasoning comes out as `thinking` blocks (thinking_delta when streamed);
earlier thinking blocks go back to its template.
Not supported (400): image and document blocks.
"""
from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator, Literal, Union

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from edgeinfer.formats.chat_template import ChatTemplateError

from . import generation, harmony as hm, tools as tl
from .errors import APIError, bad_param
from .generation import Generation, params_or_400
from .images import ImageCollector, build_with_images, check_text, from_b64
from .openai_api import _ChatOut
from .schemas import _LlamaSamplers, sampler_kwargs

router = APIRouter(prefix="/v1", tags=["anthropic"])

IGNORED = ("metadata", "service_tier", "thinking", "container", "mcp_servers")


class _Loose(BaseModel):
    model_config = ConfigDict(extra="allow")


class Block(_Loose):
    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: Any = None
    tool_use_id: str | None = None
    content: Union[str, list[dict[str, Any]], None] = None
    is_error: bool | None = None


class Message(_Loose):
    role: Literal["user", "assistant"]
    content: Union[str, list[Block]]


class ToolIn(_Loose):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None


class ToolChoiceIn(_Loose):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class _Base(_Loose):
    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    system: Union[str, list[Block], None] = None
    tools: list[ToolIn] | None = None
    tool_choice: ToolChoiceIn | None = None


class MessagesRequest(_Base, _LlamaSamplers):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    # edgeinfer / llama-server extensions, as on the OpenAI endpoints (llama.cpp's samplers
    # and the repetition stop come from _LlamaSamplers)
    seed: int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    backend: str | None = None
    device: str | None = None


class CountTokensRequest(_Base):
    pass


# ----- errors ------------------------------------------------------------------------------

def error_type(status: int) -> str:
    return {400: "invalid_request_error", 401: "authentication_error",
            403: "permission_error", 404: "not_found_error", 413: "request_too_large",
            429: "rate_limit_error", 503: "overloaded_error",
            529: "overloaded_error"}.get(status, "api_error" if status >= 500
                                         else "invalid_request_error")


def error_body(err: APIError) -> dict:
    return {"type": "error", "error": {"type": error_type(err.status), "message": err.message}}


def is_anthropic_path(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


# ----- request -> chat ---------------------------------------------------------------------

def _text_of(content: Any, where: str) -> str:
    """A tool_result's or system's content: a string or a list of text blocks."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for j, b in enumerate(content):
        b = b.model_dump() if hasattr(b, "model_dump") else b
        if not isinstance(b, dict) or b.get("type") != "text":
            kind = b.get("type") if isinstance(b, dict) else type(b).__name__
            raise bad_param(f"{where}[{j}]", f"{where}[{j}]: block type {kind!r} is not "
                            "supported here (text only)")
        parts.append(str(b.get("text") or ""))
    return "".join(parts)


def _image_block(b: Block, where: str, images: ImageCollector) -> str:
    """An image block (source base64, or a url that must be a data: URL) -> its marker."""
    src = (b.model_extra or {}).get("source")
    if not isinstance(src, dict):
        raise bad_param(f"{where}.source", f"{where}: an image block needs a source")
    kind = src.get("type")
    if kind == "base64":
        return images.add(from_b64(src.get("data"), f"{where}.source.data"))
    if kind == "url":
        return images.url(src.get("url"), f"{where}.source.url")
    raise bad_param(f"{where}.source.type", f"{where}: image source type {kind!r} is not "
                    "supported (base64, or a data: url)")


def chat_messages(body: _Base, images: ImageCollector | None = None) -> list[dict[str, Any]]:
    """Anthropic messages -> the chat messages tools.prepare_chat takes (image blocks: a
    marker in the text, their bytes in `images`)."""
    out: list[dict[str, Any]] = []
    if body.system:
        out.append({"role": "system", "content": _text_of(body.system, "system")})
    names: dict[str, str] = {}
    for i, m in enumerate(body.messages):
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        texts, calls, results, thinking = [], [], [], []
        for j, b in enumerate(m.content):
            where = f"messages[{i}].content[{j}]"
            if b.type == "text":
                texts.append(check_text(b.text or "", where) if images is not None
                             else b.text or "")
            elif b.type == "image" and images is not None and m.role == "user":
                texts.append(_image_block(b, where, images))
            elif b.type == "tool_use" and m.role == "assistant":
                if not b.name:
                    raise bad_param(f"{where}.name", f"{where}: a tool_use block needs a name")
                args = b.input if b.input is not None else {}
                if not isinstance(args, dict):
                    raise bad_param(f"{where}.input", f"{where}.input must be an object")
                cid = b.id or f"toolu_{uuid.uuid4().hex[:24]}"
                names[cid] = b.name
                calls.append({"id": cid, "type": "function",
                              "function": {"name": b.name, "arguments": args}})
            elif b.type == "tool_result" and m.role == "user":
                if not b.tool_use_id:
                    raise bad_param(f"{where}.tool_use_id",
                                    f"{where}: a tool_result block needs tool_use_id")
                text = _text_of(b.content, f"{where}.content")
                if b.is_error:
                    text = f"Error: {text}"
                results.append({"role": "tool", "tool_call_id": b.tool_use_id,
                                "name": names.get(b.tool_use_id, ""), "content": text})
            elif b.type == "thinking" and m.role == "assistant":
                # earlier reasoning: templates that read `thinking` (gpt-oss's) get it back
                t = (b.model_extra or {}).get("thinking")
                if isinstance(t, str):
                    thinking.append(t)
            elif b.type in ("thinking", "redacted_thinking"):
                continue
            else:
                raise bad_param(where, f"{where}: block type {b.type!r} is not supported in a "
                                f"{m.role} message")
        out.extend(results)
        if texts or calls or not results:
            msg: dict[str, Any] = {"role": m.role, "content": "".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            if thinking:
                msg["thinking"] = "".join(thinking)
            out.append(msg)
    return out


def parse_tools(body: _Base) -> tuple[list[tl.Tool], tl.Choice, bool]:
    raw = []
    for t in body.tools or []:
        if t.type not in (None, "custom") and t.input_schema is None:
            raise bad_param("tools", f"tool type {t.type!r} (a server tool) is not supported")
        raw.append({"type": "function", "function": {
            "name": t.name, "description": t.description or "",
            "parameters": t.input_schema or {"type": "object", "properties": {}}}})
    tools = tl.parse_tools(raw)
    tc = body.tool_choice
    if tc is None:
        return tools, tl.Choice("auto" if tools else "none"), True
    if tc.type == "tool" and not tc.name:
        raise bad_param("tool_choice.name", "tool_choice of type 'tool' needs a name")
    mapped: Any = {"auto": "auto", "any": "required", "none": "none"}.get(tc.type) or \
        {"type": "function", "function": {"name": tc.name}}
    return tools, tl.parse_tool_choice(mapped, tools), not tc.disable_parallel_tool_use


# ----- output ------------------------------------------------------------------------------

def _tool_use(call: tl.ToolCall) -> dict:
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"),
            "name": call.name, "input": call.arguments}


def _stop_reason(finish: str | None, calls: bool, stop_seq: str | None) -> str:
    if calls:
        return "tool_use"
    if finish in ("length", "repetition"):     # both cut the output short
        return "max_tokens"
    if stop_seq is not None:
        return "stop_sequence"
    return "end_turn"


def _which_stop(tokenizer, ids: list[int], shown: str, stops: list[str],
                finish: str | None) -> str | None:
    """The stop sequence that ended the output (the engine strips it): the first one found
    in the raw decoded output right after the text that was shown."""
    if finish != "stop" or not stops or not ids:
        return None
    raw = tokenizer.decode(ids)
    tail = raw[max(0, len(shown) - 1):]
    hits = [(tail.find(s), s) for s in stops if s in tail]
    return min(hits)[1] if hits else None


def _usage(gen: Generation) -> dict:
    u = gen.usage
    return {"input_tokens": u.prompt_tokens, "output_tokens": u.completion_tokens,
            "cache_read_input_tokens": u.cached_tokens, "cache_creation_input_tokens": 0}


def _sse(event: str, obj: dict) -> bytes:
    return f"event: {event}\ndata: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


class _Blocks:
    """Turns the chat splitter's deltas into Anthropic content blocks, streamed or not."""

    def __init__(self):
        self.blocks: list[dict] = []
        self.open: int | None = None          # index of the open text or thinking block

    def feed(self, deltas: list[dict]) -> list[bytes]:
        ev: list[bytes] = []
        for d in deltas:
            if d.get("reasoning_content"):     # Harmony's analysis channel: a thinking block
                if self.open is not None and self.blocks[self.open]["type"] != "thinking":
                    ev += self.close()
                if self.open is None:
                    self.open = len(self.blocks)
                    self.blocks.append({"type": "thinking", "thinking": "", "signature": ""})
                    ev.append(_sse("content_block_start", {
                        "type": "content_block_start", "index": self.open,
                        "content_block": {"type": "thinking", "thinking": "", "signature": ""}}))
                self.blocks[self.open]["thinking"] += d["reasoning_content"]
                ev.append(_sse("content_block_delta", {
                    "type": "content_block_delta", "index": self.open,
                    "delta": {"type": "thinking_delta", "thinking": d["reasoning_content"]}}))
            if d.get("content"):
                if self.open is not None and self.blocks[self.open]["type"] != "text":
                    ev += self.close()
                if self.open is None:
                    self.open = len(self.blocks)
                    self.blocks.append({"type": "text", "text": ""})
                    ev.append(_sse("content_block_start", {
                        "type": "content_block_start", "index": self.open,
                        "content_block": {"type": "text", "text": ""}}))
                self.blocks[self.open]["text"] += d["content"]
                ev.append(_sse("content_block_delta", {
                    "type": "content_block_delta", "index": self.open,
                    "delta": {"type": "text_delta", "text": d["content"]}}))
        return ev

    def call(self, call: tl.ToolCall) -> list[bytes]:
        ev = self.close()
        block = _tool_use(call)
        i = len(self.blocks)
        self.blocks.append(block)
        ev.append(_sse("content_block_start", {
            "type": "content_block_start", "index": i,
            "content_block": {**block, "input": {}}}))
        ev.append(_sse("content_block_delta", {
            "type": "content_block_delta", "index": i,
            "delta": {"type": "input_json_delta", "partial_json": json.dumps(call.arguments)}}))
        ev.append(_sse("content_block_stop", {"type": "content_block_stop", "index": i}))
        return ev

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        i, self.open = self.open, None
        return [_sse("content_block_stop", {"type": "content_block_stop", "index": i})]


def _given(body: MessagesRequest) -> set[str]:
    return set(body.model_fields_set) | {"max_tokens"}


@router.post("/messages")
async def messages(body: MessagesRequest, request: Request):
    manager, metrics = request.app.state.manager, request.app.state.metrics
    stops = list(body.stop_sequences or [])
    if len(stops) > 16:
        raise bad_param("stop_sequences", "stop_sequences accepts at most 16 strings")
    extra = sampler_kwargs(body)
    params = params_or_400(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0,
        min_p=body.min_p or 0.0, repeat_penalty=body.repeat_penalty or 1.0,
        seed=body.seed, max_tokens=body.max_tokens, stop=tuple(stops), **extra)
    images = ImageCollector.for_request(request)
    msgs = chat_messages(body, images)
    tools, choice, parallel = parse_tools(body)
    spec = tl.call_grammar(tools, choice, parallel) if choice.mode in ("required", "named") \
        else None
    gen = await generation.start(manager, metrics, body.model, 1, body.backend,
                                 device=body.device)
    with gen.held(streaming=bool(body.stream)):
        engine = gen.lm.engine
        params = gen.adapt(params, _given(body), body.stop_on_repetition)
        harmony = hm.engine_harmony(engine)
        if harmony and choice.mode in ("required", "named"):   # Harmony's call, not our envelope
            spec = hm.call_grammar(tools, choice,
                                         engine.tokenizer.token_to_id)
        chat, tvars = tl.prepare_chat(msgs, tools, choice, parallel, engine.chat_template)
        if spec is None and not harmony:
            spec = tl.auto_spec(tools, choice, parallel, engine.chat_template)
        if spec is None and harmony:
            spec = hm.auto_spec(engine, tools, choice)
        spans = None
        try:
            if images:
                prompt, spans = await gen.encode(build_with_images(images.refs, chat, **tvars))
            else:
                prompt = await gen.encode(lambda e: e.encode_chat(chat, **tvars))
        except ChatTemplateError as e:
            raise bad_param("messages", str(e)) from None
        constraints = (await tl.build_constraints(engine, spec, 1, "tools")
                       if spec is not None else None)
        out = _ChatOut(tools, choice.mode, tl.can_think(engine), harmony)
        mid, model = f"msg_{uuid.uuid4().hex[:24]}", body.model
        gen.submit(prompt, params, constraints=constraints, images=spans)
        if body.stream:
            events = gen.events()
            return generation.streaming_response(
                gen, _stream(gen, events, out, mid, model, stops, engine.tokenizer),
                "text/event-stream", source=events,
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        ids: list[int] = []
        async for _, ev in gen.events(lambda: request.is_disconnected()):
            ids += ev.token_ids
            out.feed(ev.text, final=ev.finished, reason=ev.finish_reason)
        finish = gen.usage.finish_reasons.get(0)
        content: list[dict] = []
        if harmony and out.reasoning:
            content.append({"type": "thinking", "thinking": out.reasoning, "signature": ""})
        if out.content and (out.content.strip() or not out.calls):
            content.append({"type": "text", "text": out.content.strip() if out.calls
                            else out.content})
        content += [_tool_use(c) for c in out.calls]
        seq = _which_stop(engine.tokenizer, ids, out.content, stops, finish)
        return {"id": mid, "type": "message", "role": "assistant", "model": model,
                "content": content,
                "stop_reason": _stop_reason(finish, bool(out.calls), seq),
                "stop_sequence": seq, "usage": _usage(gen)}


async def _stream(gen: Generation, events, out, mid: str, model: str, stops: list[str],
                  tokenizer) -> AsyncIterator[bytes]:
    blocks = _Blocks()
    yield _sse("message_start", {"type": "message_start", "message": {
        "id": mid, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": gen.usage.prompt_tokens, "output_tokens": 0,
                  "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}}})
    ids: list[int] = []
    finish = None
    try:
        async for _, ev in events:
            ids += ev.token_ids
            n_calls = len(out.calls)
            deltas = out.feed(ev.text, final=ev.finished, reason=ev.finish_reason)
            for b in blocks.feed([d for d in deltas if "content" in d or
                                  (out.harmony is not None and "reasoning_content" in d)]):
                yield b
            for call in out.calls[n_calls:]:
                for b in blocks.call(call):
                    yield b
            if ev.finished:
                finish = ev.finish_reason
    except APIError as e:
        yield _sse("error", error_body(e))
        return
    for b in blocks.close():
        yield b
    seq = _which_stop(tokenizer, ids, out.content, stops, finish)
    yield _sse("message_delta", {"type": "message_delta", "delta": {
        "stop_reason": _stop_reason(finish, bool(out.calls), seq), "stop_sequence": seq},
        "usage": {"output_tokens": gen.usage.completion_tokens,
                  "input_tokens": gen.usage.prompt_tokens,
                  "cache_read_input_tokens": gen.usage.cached_tokens}})
    yield _sse("message_stop", {"type": "message_stop"})


@router.post("/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request):
    manager, metrics = request.app.state.manager, request.app.state.metrics
    images = ImageCollector.for_request(request)
    msgs = chat_messages(body, images)
    tools, choice, parallel = parse_tools(body)
    gen = await generation.start(manager, metrics, body.model, 1)
    try:
        engine = gen.lm.engine
        chat, tvars = tl.prepare_chat(msgs, tools, choice, parallel, engine.chat_template)
        try:
            if images:
                prompt = (await gen.encode(build_with_images(images.refs, chat, **tvars)))[0]
            else:
                prompt = await gen.encode(lambda e: e.encode_chat(chat, **tvars))
        except ChatTemplateError as e:
            raise bad_param("messages", str(e)) from None
        return JSONResponse({"input_tokens": len(prompt)})
    finally:
        gen.release()

