"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models."""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from pydantic import Field
from fastapi.responses import StreamingResponse

from edgeinfer.formats.chat_template import ChatTemplateError
from edgeinfer.engine.core import RequestOutput

from edgeinfer.engine.grammar import GrammarSpec, any_json_object, json_schema

from edgeinfer.store.bundled_listing import list_models as list_store_models

from . import generation, harmony as hm, tools as tl
from .errors import APIError, bad_param
from .generation import Generation, params_or_400
from .images import ImageCollector, build_with_images, check_text
from .schemas import ChatCompletionRequest, CompletionRequest, _OpenAISampling, sampler_kwargs

router = APIRouter(prefix="/v1", tags=["openai"])


def _state(request: Request):
    return request.app.state.manager, request.app.state.metrics


def _sampling(body: _OpenAISampling, max_tokens: int | None, logprobs: int | None):
    stop = body.stop if body.stop is not None else ()
    if isinstance(stop, list) and len(stop) > 16:
        raise bad_param("stop", "stop accepts at most 16 sequences")
    bias = {}
    for k, v in (body.logit_bias or {}).items():
        try:
            bias[int(k)] = v
        except ValueError:
            raise bad_param("logit_bias", f"logit_bias key {k!r} is not a token id") from None
    # OpenAI's defaults: temperature 1, top_p 1, no other truncation.
    return params_or_400(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0, min_p=body.min_p or 0.0,
        repeat_penalty=body.repetition_penalty or body.repeat_penalty or 1.0,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        logit_bias=bias, seed=body.seed, max_tokens=max_tokens, stop=stop,
        logprobs=logprobs, ignore_eos=body.ignore_eos, **sampler_kwargs(body))


def _given(body: _OpenAISampling) -> set[str]:
    """SamplingParams names the request set (the rest may take the model's defaults)."""
    given = set(body.model_fields_set)
    if given & {"max_tokens", "max_completion_tokens"}:
        given.add("max_tokens")
    return given


def _messages(body: ChatCompletionRequest, images: ImageCollector | None = None
              ) -> list[dict[str, Any]]:
    """The messages as the chat template takes them; `image_url` parts become a marker in
    the text, their bytes go to `images`."""
    out = []
    for i, m in enumerate(body.messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                where = f"messages[{i}].content[{j}]"
                if part.type == "image_url" and images is not None:
                    url = (part.model_extra or {}).get("image_url")
                    url = url.get("url") if isinstance(url, dict) else url
                    texts.append(images.url(url, f"{where}.image_url"))
                    continue
                if part.type != "text" or part.text is None:
                    raise bad_param(f"messages[{i}].content",
                                    f"content part type {part.type!r} is not supported "
                                    "(text and image_url)")
                texts.append(check_text(part.text, where) if images else part.text)
            content = "".join(texts)
        role = "system" if m.role == "developer" else m.role
        msg: dict[str, Any] = {"role": role, "content": content or ""}
        for k in ("reasoning_content", "reasoning"):       # earlier reasoning, sent back
            if role == "assistant" and isinstance((m.model_extra or {}).get(k), str):
                msg[k] = m.model_extra[k]
        if m.tool_calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name,
                                               "arguments": c.function.arguments}}
                                 for c in m.tool_calls]
        if m.tool_call_id:
            msg["tool_call_id"] = m.tool_call_id
        if m.name and role == "tool":
            msg["name"] = m.name
        out.append(msg)
    return out


def _output_spec(body: _OpenAISampling) -> tuple[GrammarSpec | None, str]:
    """The grammar the output must follow, from response_format (chat) or llama-server's
    `json_schema` / `grammar` extensions; and the parameter it came from (for 400s)."""
    rf = getattr(body, "response_format", None)
    given = [k for k, v in (("response_format", rf if rf and rf.get("type") != "text" else None),
                            ("json_schema", body.json_schema), ("grammar", body.grammar)) if v]
    if len(given) > 1:
        raise bad_param(given[1], f"{given[0]} and {given[1]} cannot be combined")
    if body.grammar is not None:
        return GrammarSpec("gbnf", body.grammar), "grammar"
    if body.json_schema is not None:
        return json_schema(body.json_schema), "json_schema"
    if rf is None:
        return None, ""
    kind = rf.get("type")
    if kind == "text":
        return None, ""
    if kind == "json_object":
        return any_json_object(), "response_format"
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or "schema" not in js and "name" not in js:
            raise bad_param("response_format.json_schema", "response_format.json_schema must "
                            "be an object with a name and a schema")
        schema = js.get("schema", {"type": "object"})
        if not isinstance(schema, (dict, bool)):
            raise bad_param("response_format.json_schema.schema",
                            "response_format.json_schema.schema must be a JSON schema object")
        return json_schema(schema, strict=js.get("strict") is not False), \
            "response_format.json_schema.schema"
    raise bad_param("response_format.type", f"response_format.type {kind!r} must be 'text', "
                    "'json_object' or 'json_schema'")


def _id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def _usage(gen: Generation) -> dict[str, Any]:
    u = gen.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def _finish_reason(r: str | None, calls: bool = False) -> str:
    if r in ("length", "repetition"):      # both cut the output short
        return "length"
    return "tool_calls" if calls else "stop"


class _ChatOut:
    """One choice's output split into content, reasoning and tool calls, streamed or not."""

    def __init__(self, tools: list, tool_mode: str, think: bool, harmony: bool = False):
        self.tools = tools
        self.calls_on = bool(tools) and tool_mode != "none"
        self.splitter = tl.StreamSplitter(tools) if self.calls_on and not harmony else None
        self.think = tl.ThinkSplitter() if think and not harmony else None
        # gpt-oss: one splitter reads channels (reasoning, content) and calls together
        self.harmony = hm.HarmonySplitter(tools, self.calls_on) if harmony else None
        self.content, self.reasoning = "", ""
        self.calls: list = []

    def feed(self, text: str, final: bool = False, reason: str | None = None) -> list[dict]:
        """Deltas for `text` (the last call with final=True flushes what was held; `reason`,
        the finish reason, says whether the output was cut short)."""
        deltas: list[dict] = []
        if self.harmony is not None:
            return self._events(deltas, self.harmony.feed(text) + (
                self.harmony.flush(truncated=reason in ("length", "repetition"))
                if final else []))
        reasoning, content = (self.think.feed(text) if self.think else ("", text))
        if final and self.think:
            r, c = self.think.flush()
            reasoning, content = reasoning + r, content + c
        if reasoning:
            self.reasoning += reasoning
            deltas.append({"reasoning_content": reasoning})
        events = [("text", content)] if self.splitter is None else self.splitter.feed(content)
        if final and self.splitter is not None:
            events += self.splitter.flush(truncated=reason in ("length", "repetition"))
        return self._events(deltas, events)

    def _events(self, deltas: list[dict], events: list) -> list[dict]:
        for kind, v in events:
            if kind == "reasoning" and v:
                self.reasoning += v
                deltas.append({"reasoning_content": v})
            elif kind == "text" and v:
                self.content += v
                deltas.append({"content": v})
            elif kind == "call":
                i = len(self.calls)
                self.calls.append(v)
                deltas.append({"tool_calls": [{"index": i, "id": v.id, "type": "function",
                                               "function": {"name": v.name, "arguments": ""}}]})
                deltas.append({"tool_calls": [{"index": i, "function": {
                    "arguments": json.dumps(v.arguments)}}]})
        return deltas

    def message(self) -> dict:
        m: dict[str, Any] = {"role": "assistant",
                             "content": self.content.strip() if self.calls else self.content}
        if self.calls:
            m["content"] = m["content"] or None
            m["tool_calls"] = [c.openai() for c in self.calls]
        if self.think is not None or self.harmony is not None:
            m["reasoning_content"] = self.reasoning or None
        return m


class _Pieces:
    """Token strings for logprobs: the token's bytes, decoded leniently."""

    def __init__(self, tokenizer):
        self.tok = tokenizer

    def text(self, tid: int) -> tuple[str, list[int]]:
        b = self.tok.piece(int(tid))
        return b.decode("utf-8", errors="replace"), list(b)

    def chat_logprobs(self, out: RequestOutput) -> list[dict]:
        items = []
        for j, (tid, lp) in enumerate(zip(out.token_ids, out.logprobs)):
            s, b = self.text(tid)
            tops = out.top_logprobs[j] if j < len(out.top_logprobs) else []
            items.append({"token": s, "logprob": lp, "bytes": b, "top_logprobs": [
                {"token": t, "logprob": l, "bytes": bb}
                for t, bb, l in ((*self.text(a), l) for a, l in tops)]})
        return items


async def _with_disconnect(request: Request):
    return await request.is_disconnected()


def _stream(gen: Generation, agen: AsyncIterator[bytes]) -> StreamingResponse:
    return generation.streaming_response(
        gen, agen, "text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


@router.get("/models")
async def list_models(request: Request):
    manager, _ = _state(request)
    refs = await asyncio.to_thread(list_store_models, manager.store)
    data = [{"id": r.full_name, "object": "model", "created": int(r.modified_at),
             "owned_by": "edgeinfer"} for r in refs]
    return {"object": "list", "data": data}


@router.get("/models/{model:path}")
async def get_model(model: str, request: Request):
    manager, _ = _state(request)
    ref = manager.resolve(model)
    return {"id": ref.full_name, "object": "model", "created": int(ref.modified_at),
            "owned_by": "edgeinfer"}


@router.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    manager, metrics = _state(request)
    max_tokens = body.max_completion_tokens or body.max_tokens
    want_lp = body.logprobs
    if body.top_logprobs and not want_lp:
        raise bad_param("top_logprobs", "top_logprobs requires logprobs: true")
    params = _sampling(body, max_tokens, (body.top_logprobs or 0) if want_lp else None)
    images = ImageCollector.for_request(request)
    messages = _messages(body, images)
    tools = tl.parse_tools(body.tools)
    choice = tl.parse_tool_choice(body.tool_choice, tools)
    spec, spec_param = _output_spec(body)
    if choice.mode in ("required", "named"):
        if spec is not None:
            raise bad_param(spec_param, f"{spec_param} cannot be combined with tool_choice "
                            f"{'required' if choice.mode == 'required' else 'naming a function'}")
        spec, spec_param = tl.call_grammar(tools, choice, body.parallel_tool_calls), "tools"
    gen = await generation.start(manager, metrics, body.model, body.n, body.backend,
                                 device=body.device, kv_cache_type=body.kv_cache_type)
    with gen.held(streaming=bool(body.stream)):
        engine = gen.lm.engine
        params = gen.adapt(params, _given(body), body.stop_on_repetition)
        harmony = hm.engine_harmony(engine)
        if harmony:
            messages = hm.with_thinking(messages)
            if choice.mode in ("required", "named"):     # Harmony's call, not our envelope
                spec = hm.call_grammar(tools, choice,
                                         engine.tokenizer.token_to_id)
        msgs, extra = tl.prepare_chat(messages, tools, choice, body.parallel_tool_calls,
                                      engine.chat_template)
        extra.update(hm.effort_vars(engine, body.reasoning_effort, "reasoning_effort"))
        if spec is None and not harmony and (auto := tl.auto_spec(tools, choice, body.parallel_tool_calls,
                                                  engine.chat_template)) is not None:
            spec, spec_param = auto, "tools"
        if spec is None and harmony and (auto := hm.auto_spec(engine, tools, choice)) is not None:
            spec, spec_param = auto, "tools"
        spans = None
        try:
            if images:
                prompt, spans = await gen.encode(build_with_images(images.refs, msgs, **extra))
            else:
                prompt = await gen.encode(lambda e: e.encode_chat(msgs, **extra))
        except ChatTemplateError as e:
            raise bad_param("messages", str(e)) from None
        constraints = (await tl.build_constraints(engine, spec, body.n, spec_param)
                       if spec is not None else None)
        think = tl.can_think(engine)
        outs = [_ChatOut(tools, choice.mode, think, harmony) for _ in range(body.n)]
        rid, created, model = _id("chatcmpl"), int(time.time()), body.model
        pieces = _Pieces(engine.tokenizer)
        predicted = await asyncio.to_thread(_prediction_ids, body.prediction, engine)
        if body.stream:
            usage_on = bool(body.stream_options and body.stream_options.include_usage)
            gen.submit(prompt, params, constraints=constraints, prediction=predicted,
                       images=spans)
            events = gen.events()
            return _stream(gen, _chat_chunks(gen, events, rid, created, model, body.n,
                                             want_lp, usage_on, pieces, outs))
        lps: list[list] = [[] for _ in range(body.n)]
        gen.submit(prompt, params, constraints=constraints, prediction=predicted, images=spans)
        async for i, out in gen.events(lambda: request.is_disconnected()):
            outs[i].feed(out.text, final=out.finished, reason=out.finish_reason)
            if want_lp:
                lps[i] += pieces.chat_logprobs(out)
        choices = [{"index": i, "message": outs[i].message(),
                    "logprobs": {"content": lps[i]} if want_lp else None,
                    "finish_reason": _finish_reason(gen.usage.finish_reasons.get(i),
                                                    bool(outs[i].calls))}
                   for i in range(body.n)]
        return {"id": rid, "object": "chat.completion", "created": created, "model": model,
                "system_fingerprint": "edgeinfer", "choices": choices, "usage": _usage(gen)}


async def _chat_chunks(gen, events, rid, created, model, n, want_lp, usage_on, pieces, outs):
    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "system_fingerprint": "edgeinfer"}
    extra = {"usage": None} if usage_on else {}
    for i in range(n):
        yield _sse({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                         "logprobs": None, "finish_reason": None}], **extra})
    try:
        async for i, out in events:
            if out.text or out.token_ids or out.finished:
                lp = {"content": pieces.chat_logprobs(out)} if want_lp else None
                for delta in outs[i].feed(out.text, final=out.finished,
                                          reason=out.finish_reason):
                    yield _sse({**base, "choices": [{"index": i, "delta": delta, "logprobs": lp,
                                                     "finish_reason": None}], **extra})
                    lp = None
                if lp and lp["content"]:       # tokens whose text is held back: logprobs now
                    yield _sse({**base, "choices": [{"index": i, "delta": {}, "logprobs": lp,
                                                     "finish_reason": None}], **extra})
            if out.finished:
                yield _sse({**base, "choices": [{"index": i, "delta": {}, "logprobs": None,
                                                 "finish_reason": _finish_reason(
                                                     out.finish_reason, bool(outs[i].calls))}],
                            **extra})
    except APIError as e:           # the status line is gone; report in the stream
        yield _sse(e.openai_body())
        return
    if usage_on:
        yield _sse({**base, "choices": [], "usage": _usage(gen)})
    yield b"data: [DONE]\n\n"


def _prompts(body: CompletionRequest, engine) -> list[list[int]]:
    p = body.prompt
    if isinstance(p, str):
        p = [p]
    if not p:
        raise bad_param("prompt", "prompt must not be empty")
    if all(isinstance(x, int) for x in p):
        return [list(p)]                                   # one prompt of token ids
    out = []
    for x in p:
        if isinstance(x, str):
            out.append(engine.encode_raw(x))
        elif isinstance(x, list) and all(isinstance(t, int) for t in x):
            out.append(list(x))
        else:
            raise bad_param("prompt", "prompt must be a string, a list of strings, a list of "
                                      "token ids or a list of lists of token ids")
    if len(out) > 16:
        raise bad_param("prompt", "at most 16 prompts per request")
    return out


class _CompletionBody(CompletionRequest):
    # OpenAI accepts 0 here: with echo, the prompt is scored and nothing is generated
    max_tokens: int | None = Field(default=None, ge=0)


@router.post("/completions")
async def completions(body: _CompletionBody, request: Request):
    manager, metrics = _state(request)
    if body.best_of not in (None, body.n):
        raise bad_param("best_of", "best_of is not supported (it must equal n)")
    if body.suffix:
        raise bad_param("suffix", "suffix (fill-in-the-middle) is not supported")
    score_only = body.max_tokens == 0
    params = _sampling(body, 1 if score_only else body.max_tokens or 16, body.logprobs)
    # echo + logprobs: the prompt tokens' logprobs too (legacy shape, null for the first)
    scoring = {"prompt_logprobs": body.logprobs if body.echo and body.logprobs is not None
               else None, "score_only": score_only}
    spec, spec_param = _output_spec(body)
    gen = await generation.start(manager, metrics, body.model, body.n, body.backend,
                                 device=body.device, kv_cache_type=body.kv_cache_type)
    with gen.held(streaming=bool(body.stream)):
        params = gen.adapt(params, _given(body) | {"max_tokens"}, body.stop_on_repetition)
        prompts = await gen.encode(lambda e: _prompts(body, e))
        if spec is not None and len(prompts) > 1:
            raise bad_param(spec_param, f"{spec_param} supports one prompt per request")
        constraints = (await tl.build_constraints(gen.lm.engine, spec, body.n, spec_param)
                       if spec is not None else None)
        if len(prompts) > 1 and body.stream:
            # One Generation holds n sequences; several prompts hold n each.
            raise bad_param("prompt", "streaming supports one prompt per request")
        prompt = prompts[0] if len(prompts) == 1 else None
        rid, created, model = _id("cmpl"), int(time.time()), body.model
        tok = gen.lm.engine.tokenizer
        echo = [tok.decode(p) if body.echo else "" for p in prompts]
        if body.stream:
            gen.submit(prompt, params, "prompt", constraints=constraints, **scoring)
            events = gen.events()
            return _stream(gen, _completion_chunks(gen, events, rid, created, model, echo[0],
                                                   body, tok, prompt))
        # Every prompt's n sequences are submitted at once, so they batch together in the
        # engine instead of running one prompt after another.
        gens = [gen]
        try:
            for _ in prompts[1:]:
                gens.append(await generation.start(manager, metrics, body.model, body.n,
                                                   body.backend, device=body.device,
                                                   kv_cache_type=body.kv_cache_type))
            for g, ids in zip(gens, prompts):
                g.stop_on_repetition = gen.stop_on_repetition
                g.submit(ids, params, "prompt", constraints=constraints, **scoring)

            async def collect(pi: int, g) -> list[dict]:
                texts = [echo[pi]] * body.n
                lps: list[dict] = [_empty_lp() for _ in range(body.n)]
                head = None
                async for i, out in g.events(lambda: request.is_disconnected()):
                    if out.prompt_logprobs is not None:
                        head = _prompt_lp(out, prompts[pi], tok)
                    if body.logprobs is not None:
                        _add_lp(lps[i], out, tok, len(texts[i]))
                    texts[i] += out.text
                if head is not None:
                    lps = [_join_lp(head, lp) for lp in lps]
                return [{"index": pi * body.n + i, "text": texts[i],
                         "logprobs": lps[i] if body.logprobs is not None else None,
                         "finish_reason": _finish_reason(g.usage.finish_reasons.get(i))}
                        for i in range(body.n)]

            per_prompt = await asyncio.gather(*(collect(pi, g) for pi, g in enumerate(gens)))
        finally:
            for g in gens:
                g.release()
        choices = [c for cs in per_prompt for c in cs]
        usage = {"prompt_tokens": sum(g.usage.prompt_tokens for g in gens),
                 "completion_tokens": sum(g.usage.completion_tokens for g in gens),
                 "cached": sum(g.usage.cached_tokens for g in gens)}
        return {"id": rid, "object": "text_completion", "created": created, "model": model,
                "system_fingerprint": "edgeinfer", "choices": choices,
                "usage": {"prompt_tokens": usage["prompt_tokens"],
                          "completion_tokens": usage["completion_tokens"],
                          "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"],
                          "prompt_tokens_details": {"cached_tokens": usage["cached"]}}}


def _prediction_ids(pred: dict | None, engine) -> list[int] | None:
    """OpenAI's Predicted Outputs (`{"type": "content", "content": str | [text parts]}`):
    its tokens become a source of speculative drafts. The output is what it would be
    without it; only the speed changes."""
    if pred is None:
        return None
    if pred.get("type") != "content":
        raise bad_param("prediction", 'prediction.type must be "content"')
    content = pred.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text"
                   and isinstance(p.get("text"), str) for p in content):
            raise bad_param("prediction", "prediction.content parts must be text parts")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise bad_param("prediction", "prediction.content must be a string or text parts")
    return engine.tokenizer.encode(content, add_special=False, parse_special=False) or None


def _empty_lp() -> dict:
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


def _prompt_lp(out: RequestOutput, prompt: list[int], tok) -> dict:
    """The prompt's part of a legacy logprobs object (echo): null for the first token."""
    lp, offset = _empty_lp(), 0
    for j, tid in enumerate(prompt):
        s = tok.piece(int(tid)).decode("utf-8", errors="replace")
        lp["tokens"].append(s)
        lp["token_logprobs"].append(out.prompt_logprobs[j])
        tops = out.prompt_top_logprobs[j]
        lp["top_logprobs"].append(None if tops is None else {
            tok.piece(int(a)).decode("utf-8", errors="replace"): v for a, v in tops})
        lp["text_offset"].append(offset)
        offset += len(s)
    return lp


def _join_lp(head: dict, tail: dict) -> dict:
    return {k: head[k] + tail[k] for k in head}


def _add_lp(lp: dict, out: RequestOutput, tok, offset: int) -> None:
    for j, (tid, l) in enumerate(zip(out.token_ids, out.logprobs)):
        s = tok.piece(int(tid)).decode("utf-8", errors="replace")
        lp["tokens"].append(s)
        lp["token_logprobs"].append(l)
        tops = out.top_logprobs[j] if j < len(out.top_logprobs) else []
        lp["top_logprobs"].append({tok.piece(int(a)).decode("utf-8", errors="replace"): v
                                   for a, v in tops})
        lp["text_offset"].append(offset)
        offset += len(s)


async def _completion_chunks(gen, events, rid, created, model, echo, body, tok, prompt):
    base = {"id": rid, "object": "text_completion", "created": created, "model": model,
            "system_fingerprint": "edgeinfer"}
    usage_on = bool(body.stream_options and body.stream_options.include_usage)
    extra = {"usage": None} if usage_on else {}
    # with logprobs the echo waits for the prompt's logprobs (choice 0's first event; the
    # other choices start after it)
    echo_lp = echo and body.logprobs is not None
    if echo and not echo_lp:
        for i in range(body.n):
            yield _sse({**base, "choices": [{"index": i, "text": echo, "logprobs": None,
                                             "finish_reason": None}], **extra})
    try:
        async for i, out in events:
            if echo_lp and out.prompt_logprobs is not None:
                head = _prompt_lp(out, prompt, tok)
                for j in range(body.n):
                    yield _sse({**base, "choices": [{"index": j, "text": echo, "logprobs": head,
                                                     "finish_reason": None}], **extra})
            lp = None
            if body.logprobs is not None:
                lp = _empty_lp()
                _add_lp(lp, out, tok, 0)
            if out.text or out.token_ids or out.finished:
                yield _sse({**base, "choices": [{
                    "index": i, "text": out.text, "logprobs": lp,
                    "finish_reason": _finish_reason(out.finish_reason) if out.finished else None}],
                    **extra})
    except APIError as e:
        yield _sse(e.openai_body())
        return
    if usage_on:
        yield _sse({**base, "choices": [], "usage": _usage(gen)})
    yield b"data: [DONE]\n\n"
