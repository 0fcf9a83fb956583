"""OpenAI Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}.

The request maps onto the chat path (edgeinfer.server.tools for tools and the call grammar,
the chat splitter of openai_api for text and calls):

- `input`: a string (one user message) or items: messages ({role, content} with content a
  string or input_text/output_text parts), `function_call` (an assistant turn's call),
  `function_call_output` (a tool turn); `instructions` become the system message (not
  carried to later turns, as OpenAI does).
- `tools` (type function: name, description, parameters), `tool_choice` (none, auto,
  required, or {type: function, name}), `parallel_tool_calls`, `max_output_tokens`,
  `temperature`, `top_p`, `text.format` (text, json_object, json_schema) and the sampler
  extensions of the chat endpoint (top_k, min_p, seed, DRY, XTC, ...).
- `previous_response_id`: the conversation so far (that response's input and output) comes
  from a bounded in-memory store (LRU, at most STORE_MAX_ITEMS responses and
  STORE_MAX_BYTES of their text, each kept STORE_TTL_S); `store: false` keeps a response
  out of it; an unknown or expired id is a 404 in OpenAI's error shape.
- streaming: response.created, response.in_progress, then per output item
  response.output_item.added, (text) response.content_part.added,
  response.output_text.delta..., response.output_text.done, response.content_part.done,
  (call) response.function_call_arguments.delta, response.function_call_arguments.done,
  then response.output_item.done; finally response.completed (or response.incomplete when
  max_output_tokens cut it), each with a sequence_number.

Status `incomplete` with incomplete_details.reason `max_output_tokens` when the length
limit ended the output. Ignored: truncation, metadata (echoed), user, service_tier,
include, background (false only). `reasoning.effort` goes to templates that take
`reasoning_effort` (gpt-oss); a Harmony model's reasoning is a `reasoning` item
(response.reasoning_text.delta / .done when streamed). llama-server's `grammar` (GBNF) is
honoured as in chat.
"""
from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from typing import Any, AsyncIterator, Union

from fastapi import APIRouter, Request
from pydantic import Field

from edgeinfer.engine.grammar import GrammarSpec, any_json_object, json_schema
from edgeinfer.formats.chat_template import ChatTemplateError

from . import generation, harmony as hm, tools as tl
from .errors import APIError, bad_param
from .generation import Generation
from .images import MAX_IMAGES, ImageCollector, build_with_images, check_text
from .openai_api import _ChatOut, _given, _sampling
from .schemas import _OpenAISampling

router = APIRouter(prefix="/v1", tags=["openai"])

STORE_MAX_ITEMS = 512
STORE_MAX_BYTES = 64 << 20
STORE_TTL_S = 3600.0


class ResponsesRequest(_OpenAISampling):
    input: Union[str, list[dict[str, Any]]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, Any] | None = None
    background: bool = False


# ----- the store ---------------------------------------------------------------------------

class ResponseStore:
    """id -> (created, messages of the conversation including this response's output, the
    response body). LRU over at most max_items entries and max_bytes of stored text; an
    entry older than ttl_s is gone. Thread-safe (handlers run on the event loop, tests may
    poke it from elsewhere)."""

    def __init__(self, max_items: int = STORE_MAX_ITEMS, max_bytes: int = STORE_MAX_BYTES,
                 ttl_s: float = STORE_TTL_S):
        self.max_items, self.max_bytes, self.ttl_s = max_items, max_bytes, ttl_s
        self._d: OrderedDict[str, tuple[float, int, list[dict], dict]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._d)

    def put(self, rid: str, messages: list[dict], body: dict) -> None:
        # images (ImageRef) count by their bytes
        size = len(json.dumps(messages, default=lambda o: "")) + len(json.dumps(body)) + \
            sum(len(r.data) for m in messages for r in m.get("_edgeinfer_images", ()))
        with self._lock:
            self._drop(rid)
            self._d[rid] = (time.monotonic(), size, messages, body)
            self._bytes += size
            while self._d and (len(self._d) > self.max_items or self._bytes > self.max_bytes):
                self._drop(next(iter(self._d)))

    def get(self, rid: str) -> tuple[list[dict], dict] | None:
        with self._lock:
            e = self._d.get(rid)
            if e is None:
                return None
            if time.monotonic() - e[0] > self.ttl_s:
                self._drop(rid)
                return None
            self._d.move_to_end(rid)
            return e[2], e[3]

    def delete(self, rid: str) -> bool:
        with self._lock:
            return self._drop(rid)

    def _drop(self, rid: str) -> bool:
        e = self._d.pop(rid, None)
        if e is not None:
            self._bytes -= e[1]
        return e is not None


def _store(request: Request) -> ResponseStore:
    st = request.app.state
    s = getattr(st, "responses_store", None)
    if s is None:
        s = st.responses_store = ResponseStore()
    return s


def _unknown(rid: str) -> APIError:
    return APIError(404, f"Response with id '{rid}' not found.", param="previous_response_id",
                    code="not_found")


# ----- input -> chat messages --------------------------------------------------------------

IMAGES_KEY = "_edgeinfer_images"      # a message's ImageRefs, kept with it in the store


def _content_text(content: Any, where: str, images: ImageCollector | None = None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_param(where, f"{where} must be a string or a list of content parts")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image" and images is not None:
            if part.get("file_id"):
                raise bad_param(f"{where}[{j}].file_id", f"{where}[{j}]: file_id images are "
                                "not supported; send image_url as a data: URL")
            out.append(images.url(part.get("image_url"), f"{where}[{j}].image_url"))
            continue
        if kind not in ("input_text", "output_text", "text"):
            raise bad_param(f"{where}[{j}]", f"{where}[{j}]: content type {kind!r} is not "
                            "supported (input_text, output_text and input_image only)")
        text = str(part.get("text") or "")
        out.append(check_text(text, f"{where}[{j}]") if images is not None else text)
    return "".join(out)


def input_messages(raw: Union[str, list[dict[str, Any]]], allow_fetch: bool = False
                   ) -> list[dict[str, Any]]:
    """The request's input as chat messages (tool calls and results included); images as
    markers, their refs under IMAGES_KEY (`allow_fetch`: http(s) image URLs allowed)."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_param(where, f"{where} must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_param(f"{where}.role", f"{where}.role must be user, assistant, "
                                "system or developer")
            images = ImageCollector(allow_fetch)
            msg = {"role": "system" if role == "developer" else role,
                   "content": _content_text(item.get("content"), f"{where}.content",
                                            images if role == "user" else None)}
            if images:
                msg[IMAGES_KEY] = list(images.refs)
            out.append(msg)
        elif kind == "function_call":
            name, args = item.get("name"), item.get("arguments", "{}")
            if not isinstance(name, str) or not name:
                raise bad_param(f"{where}.name", f"{where}: a function_call needs a name")
            call = {"id": item.get("call_id") or item.get("id") or f"call_{uuid.uuid4().hex[:24]}",
                    "type": "function", "function": {"name": name, "arguments": args}}
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            cid = item.get("call_id")
            if not isinstance(cid, str):
                raise bad_param(f"{where}.call_id", f"{where}: a function_call_output needs "
                                "call_id")
            output = item.get("output", "")
            if not isinstance(output, str):
                output = _content_text(output, f"{where}.output") if isinstance(output, list) \
                    else json.dumps(output)
            name = next((c["function"]["name"] for m in out for c in m.get("tool_calls") or ()
                         if c["id"] == cid), "")
            out.append({"role": "tool", "tool_call_id": cid, "name": name, "content": output})
        elif kind in ("reasoning", "item_reference"):
            continue
        else:
            raise bad_param(f"{where}.type", f"{where}.type {kind!r} is not supported")
    return out


def _tools(body: ResponsesRequest) -> tuple[list[tl.Tool], tl.Choice]:
    raw = []
    for i, t in enumerate(body.tools or []):
        if t.get("type") != "function":
            raise bad_param(f"tools[{i}].type", f"tools[{i}].type {t.get('type')!r} is not "
                            "supported (only 'function')")
        raw.append({"type": "function", "function": {
            "name": t.get("name"), "description": t.get("description") or "",
            "parameters": t.get("parameters")}})
    tools = tl.parse_tools(raw)
    tc = body.tool_choice
    if isinstance(tc, dict) and tc.get("type") == "function" and "function" not in tc:
        tc = {"type": "function", "function": {"name": tc.get("name")}}
    return tools, tl.parse_tool_choice(tc, tools)


def _text_spec(body: ResponsesRequest):
    fmt = (body.text or {}).get("format")
    if body.grammar is not None:          # llama-server's GBNF extension, as in chat
        if fmt and fmt.get("type") != "text":
            raise bad_param("grammar", "grammar and text.format cannot be combined")
        return GrammarSpec("gbnf", body.grammar)
    if not fmt or fmt.get("type") == "text":
        return None
    kind = fmt.get("type")
    if kind == "json_object":
        return any_json_object()
    if kind == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, (dict, bool)):
            raise bad_param("text.format.schema", "text.format.schema must be a JSON schema")
        return json_schema(schema, strict=fmt.get("strict") is not False)
    raise bad_param("text.format.type", f"text.format.type {kind!r} must be 'text', "
                    "'json_object' or 'json_schema'")


# ----- output ------------------------------------------------------------------------------

def _msg_item(mid: str, text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": mid, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": []}]}


def _reasoning_item(rid: str, text: str, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": rid, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def _effort(body: ResponsesRequest) -> Any:
    r = (body.model_extra or {}).get("reasoning")
    return r.get("effort") if isinstance(r, dict) else None


def _call_item(call: tl.ToolCall, status: str = "completed", arguments: str | None = None
               ) -> dict:
    return {"type": "function_call", "id": "fc_" + call.id.removeprefix("call_"),
            "call_id": call.id, "name": call.name,
            "arguments": json.dumps(call.arguments) if arguments is None else arguments,
            "status": status}


def _usage(gen: Generation) -> dict:
    u = gen.usage
    return {"input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt_tokens + u.completion_tokens}


def _skeleton(body: ResponsesRequest, rid: str, created: int, tools: list[tl.Tool]) -> dict:
    return {"id": rid, "object": "response", "created_at": created, "status": "in_progress",
            "background": False, "error": None, "incomplete_details": None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "model": body.model, "output": [], "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": None, "summary": None}, "store": body.store,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": body.text or {"format": {"type": "text"}},
            "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
            "tools": [{"type": "function", "name": t.name, "description": t.description,
                       "parameters": t.parameters, "strict": True} for t in tools],
            "top_p": 1.0 if body.top_p is None else body.top_p, "truncation": "disabled",
            "usage": None, "user": body.user, "metadata": body.metadata or {}}


def _finish(resp: dict, gen: Generation, output: list[dict]) -> dict:
    cut = gen.usage.finish_reasons.get(0) in ("length", "repetition")
    resp.update(status="incomplete" if cut else "completed", output=output,
                usage=_usage(gen),
                incomplete_details={"reason": "max_output_tokens"} if cut else None)
    return resp


def _conversation(messages: list[dict], output: list[dict]) -> list[dict]:
    """The chat messages a later turn continues from: this turn's and its output's."""
    conv = list(messages)
    text = "".join(c["text"] for it in output if it["type"] == "message" for c in it["content"])
    calls = [{"id": it["call_id"], "type": "function",
              "function": {"name": it["name"], "arguments": it["arguments"]}}
             for it in output if it["type"] == "function_call"]
    msg: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        msg["tool_calls"] = calls
    thinking = "".join(c["text"] for it in output if it["type"] == "reasoning"
                       for c in it["content"])
    if thinking:                  # gpt-oss's template reads earlier reasoning as `thinking`
        msg["thinking"] = thinking
    conv.append(msg)
    return conv


@router.post("/responses")
async def create_response(body: ResponsesRequest, request: Request):
    if body.background:
        raise bad_param("background", "background responses are not supported")
    manager, metrics = request.app.state.manager, request.app.state.metrics
    store = _store(request)
    history: list[dict] = []
    if body.previous_response_id:
        got = store.get(body.previous_response_id)
        if got is None:
            raise _unknown(body.previous_response_id)
        history = got[0]
    params = _sampling(body, body.max_output_tokens, None)
    turn = input_messages(body.input, ImageCollector.for_request(request).allow_fetch)
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions
                else []) + history + turn
    tools, choice = _tools(body)
    spec, spec_param = _text_spec(body), "text.format"
    if choice.mode in ("required", "named"):
        if spec is not None:
            raise bad_param("text.format", "text.format cannot be combined with a forced "
                            "tool_choice")
        spec, spec_param = tl.call_grammar(tools, choice, body.parallel_tool_calls), "tools"
    gen = await generation.start(manager, metrics, body.model, 1, body.backend,
                                 device=body.device)
    with gen.held(streaming=bool(body.stream)):
        engine = gen.lm.engine
        given = _given(body)
        if "max_output_tokens" in given:
            given.add("max_tokens")
        params = gen.adapt(params, given, body.stop_on_repetition)
        harmony = hm.engine_harmony(engine)
        if harmony and choice.mode in ("required", "named"):   # Harmony's call, not our envelope
            spec, spec_param = hm.call_grammar(tools, choice,
                                         engine.tokenizer.token_to_id), "tools"
        chat, tvars = tl.prepare_chat(messages, tools, choice, body.parallel_tool_calls,
                                      engine.chat_template)
        tvars.update(hm.effort_vars(engine, _effort(body), "reasoning.effort"))
        if spec is None and not harmony and (auto := tl.auto_spec(tools, choice, body.parallel_tool_calls,
                                                  engine.chat_template)) is not None:
            spec, spec_param = auto, "tools"
        if spec is None and harmony and (auto := hm.auto_spec(engine, tools, choice)) is not None:
            spec, spec_param = auto, "tools"
        refs = [r for m in messages for r in m.get(IMAGES_KEY, ())]
        spans = None
        try:
            if refs:
                if len(refs) > MAX_IMAGES:
                    raise bad_param("input", f"at most {MAX_IMAGES} images per conversation")
                prompt, spans = await gen.encode(build_with_images(refs, chat, "input",
                                                                   **tvars))
            else:
                prompt = await gen.encode(lambda e: e.encode_chat(chat, **tvars))
        except ChatTemplateError as e:
            raise bad_param("input", str(e)) from None
        constraints = (await tl.build_constraints(engine, spec, 1, spec_param)
                       if spec is not None else None)
        out = _ChatOut(tools, choice.mode, tl.can_think(engine), harmony)
        rid, created = f"resp_{uuid.uuid4().hex}", int(time.time())
        resp = _skeleton(body, rid, created, tools)
        keep = (lambda output: store.put(rid, _conversation(history + turn, output), resp)) \
            if body.store else (lambda output: None)
        gen.submit(prompt, params, "input", constraints=constraints, images=spans)
        if body.stream:
            events = gen.events()
            return generation.streaming_response(
                gen, _stream(gen, events, out, resp, keep), "text/event-stream",
                source=events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        async for _, ev in gen.events(lambda: request.is_disconnected()):
            out.feed(ev.text, final=ev.finished, reason=ev.finish_reason)
        output: list[dict] = []
        if harmony and out.reasoning:
            output.append(_reasoning_item(f"rs_{uuid.uuid4().hex}", out.reasoning))
        text = out.content.strip() if out.calls else out.content
        if text or not out.calls:
            output.append(_msg_item(f"msg_{uuid.uuid4().hex}", text))
        output += [_call_item(c) for c in out.calls]
        _finish(resp, gen, output)
        keep(output)
        return resp


def _sse(seq: list[int], obj: dict) -> bytes:
    obj["sequence_number"] = seq[0]
    seq[0] += 1
    return f"event: {obj['type']}\ndata: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


async def _stream(gen: Generation, events, out, resp: dict, keep) -> AsyncIterator[bytes]:
    seq = [0]
    yield _sse(seq, {"type": "response.created", "response": dict(resp)})
    yield _sse(seq, {"type": "response.in_progress", "response": dict(resp)})
    output: list[dict] = []
    text_i: int | None = None            # output index of the open message item
    think_i: int | None = None           # output index of the open reasoning item (Harmony)

    def close_think():
        nonlocal think_i
        if think_i is None:
            return []
        item = output[think_i]
        i, think_i = think_i, None
        item["status"] = "completed"
        return [_sse(seq, {"type": "response.reasoning_text.done", "item_id": item["id"],
                           "output_index": i, "content_index": 0,
                           "text": item["content"][0]["text"]}),
                _sse(seq, {"type": "response.output_item.done", "output_index": i,
                           "item": item})]

    def close_text():
        nonlocal text_i
        if text_i is None:
            return []
        item = output[text_i]
        part = item["content"][0]
        i, text_i = text_i, None
        item["status"] = "completed"
        return [_sse(seq, {"type": "response.output_text.done", "item_id": item["id"],
                           "output_index": i, "content_index": 0, "text": part["text"],
                           "logprobs": []}),
                _sse(seq, {"type": "response.content_part.done", "item_id": item["id"],
                           "output_index": i, "content_index": 0, "part": part}),
                _sse(seq, {"type": "response.output_item.done", "output_index": i,
                           "item": item})]
    try:
        async for _, ev in events:
            n_calls = len(out.calls)
            for d in out.feed(ev.text, final=ev.finished, reason=ev.finish_reason):
                if d.get("reasoning_content") and out.harmony is not None:
                    for b in close_text():
                        yield b
                    if think_i is None:
                        think_i = len(output)
                        item = _reasoning_item(f"rs_{uuid.uuid4().hex}", "", "in_progress")
                        output.append(item)
                        yield _sse(seq, {"type": "response.output_item.added",
                                         "output_index": think_i, "item": item})
                    item = output[think_i]
                    item["content"][0]["text"] += d["reasoning_content"]
                    yield _sse(seq, {"type": "response.reasoning_text.delta",
                                     "item_id": item["id"], "output_index": think_i,
                                     "content_index": 0, "delta": d["reasoning_content"]})
                piece = d.get("content")
                if not piece:
                    continue
                for b in close_think():
                    yield b
                if text_i is None:
                    text_i = len(output)
                    item = _msg_item(f"msg_{uuid.uuid4().hex}", "", "in_progress")
                    output.append(item)
                    yield _sse(seq, {"type": "response.output_item.added",
                                     "output_index": text_i,
                                     "item": {**item, "content": []}})
                    yield _sse(seq, {"type": "response.content_part.added",
                                     "item_id": item["id"], "output_index": text_i,
                                     "content_index": 0,
                                     "part": {"type": "output_text", "text": "",
                                              "annotations": [], "logprobs": []}})
                item = output[text_i]
                item["content"][0]["text"] += piece
                yield _sse(seq, {"type": "response.output_text.delta", "item_id": item["id"],
                                 "output_index": text_i, "content_index": 0, "delta": piece,
                                 "logprobs": []})
            for call in out.calls[n_calls:]:
                for b in close_text() + close_think():
                    yield b
                i = len(output)
                item = _call_item(call)
                output.append(item)
                args = item["arguments"]
                yield _sse(seq, {"type": "response.output_item.added", "output_index": i,
                                 "item": {**item, "arguments": "", "status": "in_progress"}})
                yield _sse(seq, {"type": "response.function_call_arguments.delta",
                                 "item_id": item["id"], "output_index": i, "delta": args})
                yield _sse(seq, {"type": "response.function_call_arguments.done",
                                 "item_id": item["id"], "output_index": i, "arguments": args,
                                 "name": item["name"]})
                yield _sse(seq, {"type": "response.output_item.done", "output_index": i,
                                 "item": item})
    except APIError as e:
        yield _sse(seq, {"type": "error", "code": e.code, "message": e.message,
                         "param": e.param})
        return
    for b in close_text() + close_think():
        yield b
    _finish(resp, gen, output)
    keep(output)
    kind = "response.completed" if resp["status"] == "completed" else "response.incomplete"
    yield _sse(seq, {"type": kind, "response": resp})


@router.get("/responses/{rid}")
async def get_response(rid: str, request: Request):
    got = _store(request).get(rid)
    if got is None:
        raise _unknown(rid)
    return got[1]


@router.delete("/responses/{rid}")
async def delete_response(rid: str, request: Request):
    if not _store(request).delete(rid):
        raise _unknown(rid)
    return {"id": rid, "object": "response", "deleted": True}
