"""Auto-mode tool calls from a real instruct model, as agent frameworks use them.

One daemon (a subprocess, tests/daemon_fixture.py) serves Qwen2.5-Coder 0.5B Instruct, the
registry test model whose template renders tools. With `tool_choice` auto (the default) and
greedy decoding: the official `openai`, `ollama`, `anthropic` clients and langchain-openai
get the calls as tool calls, streamed and not; a tool result goes back through Qwen's own
template (`<tool_response>`) and the answer uses it; a question that needs no tool stays text;
a call cut by max_tokens is text with finish_reason length. Without the grammar the model
writes its calls as fenced or bare JSON (`test_the_shapes_qwen_writes_unconstrained`)."""
from __future__ import annotations

import json

import httpx
import ollama
import openai
import pytest

from daemon_fixture import start_daemon

pytest.importorskip("llguidance")

MODEL = "qwen2.5-coder:0.5b"
SMOL = "smollm2:135m"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "description": "The city name"}},
                   "required": ["city"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                    "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
TOKYO = [{"role": "user", "content": "What's the weather in Tokyo?"}]
RESULT = "Tokyo: 22°C, light rain, wind 10 km/h"
# Qwen2.5-Coder 0.5B, handed the result as the last turn, calls the same tool again (its first
# token after <tool_response> is '{"' at logprob -0.01 to -0.09, with or without tools or a
# system prompt): a limit of the 0.5B model, not of the rendering. Asked to summarize in the
# next user turn it answers from the result, which is what the round trips below check (its
# answers move with any wording, even the key order of a tool's schema: the prompts are fixed).
FOLLOW_UP = {"role": "user", "content": "Summarize the result."}
MARKUP = ("<tool_call>", "```", '"name"', "[TOOL_CALLS]", "<|python_tag|>")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, qwen_coder_path, smollm2_path):
    from edgeinfer.store.model_store import Store
    home = tmp_path_factory.mktemp("tools-real")
    Store(home).register_file(qwen_coder_path, MODEL)
    Store(home).register_file(smollm2_path, SMOL)            # loaded only by the slow test
    d = start_daemon(home, EDGEINFER_MAX_MODEL_LEN="2048", EDGEINFER_MAX_QUEUE="4")
    try:
        r = d.post("/api/chat", {"model": MODEL, "stream": False, "options": {
            "temperature": 0, "num_predict": 2}, "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 200, r.text
        yield d
    finally:
        d.stop()


@pytest.fixture(scope="module")
def oa(daemon):
    with openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0,
                       timeout=300) as c:
        yield c


def chat(oa, messages, stream=False, **kw):
    """(content, [(name, arguments dict)], finish_reason, raw calls) of one choice."""
    args = dict(model=MODEL, messages=messages, tools=[WEATHER, ADD], temperature=0,
                max_tokens=60) | kw
    if not stream:
        c = oa.chat.completions.create(**args).choices[0]
        calls = c.message.tool_calls or []
        return (c.message.content, [(x.function.name, json.loads(x.function.arguments))
                                    for x in calls], c.finish_reason, calls)
    content, parts, finish = "", {}, None
    for ch in oa.chat.completions.create(stream=True, **args):
        for choice in ch.choices:
            d = choice.delta
            content += d.content or ""
            for t in d.tool_calls or []:
                p = parts.setdefault(t.index, {"id": None, "name": "", "arguments": ""})
                p["id"] = t.id or p["id"]
                p["name"] += (t.function.name or "") if t.function else ""
                p["arguments"] += (t.function.arguments or "") if t.function else ""
            finish = choice.finish_reason or finish
    calls = [parts[i] for i in sorted(parts)]
    assert all(p["id"] for p in calls)
    return (content or None, [(p["name"], json.loads(p["arguments"])) for p in calls], finish,
            calls)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_openai_auto_tool_call(oa, stream):
    content, calls, finish, _ = chat(oa, TOKYO, stream)
    assert calls == [("get_weather", {"city": "Tokyo"})]
    assert finish == "tool_calls"
    assert not (content or "").strip()            # no fence, tag or JSON left as content


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_openai_auto_tool_call_with_integer_arguments(oa, stream):
    ask = [{"role": "user", "content": "What is 17 plus 25? Use the add tool."}]
    content, calls, finish, _ = chat(oa, ask, stream)
    assert calls == [("add", {"a": 17, "b": 25})] and finish == "tool_calls"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_reply_that_needs_no_tool_stays_text(oa, stream):
    ask = [{"role": "user", "content": "Write a haiku about the sea."}]
    content, calls, finish, _ = chat(oa, ask, stream)
    assert calls == [] and finish == "stop"
    assert content and content.strip() and not any(m in content for m in MARKUP)


def test_round_trip_the_answer_uses_the_tool_result(oa):
    _, calls, _, raw = chat(oa, TOKYO, tools=[WEATHER])
    assert calls == [("get_weather", {"city": "Tokyo"})]
    follow = TOKYO + [{"role": "assistant", "content": None,
                       "tool_calls": [c.model_dump() for c in raw]},
                      {"role": "tool", "tool_call_id": raw[0].id, "content": RESULT}, FOLLOW_UP]
    content, calls, finish, _ = chat(oa, follow, tools=[WEATHER])
    assert finish == "stop" and calls == []
    assert "22" in content and "rain" in content.lower()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_text_before_a_call_stays_content(oa, stream):
    # what Qwen writes here: 'The tool response for the request "..." is:\n\n{"name": ...}',
    # prose, then a bare call on its own line (after text: parsed, not grammar-constrained)
    follow = TOKYO + [{"role": "assistant", "content": "", "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Tokyo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": RESULT},
        {"role": "user", "content": "Summarize the tool result for me."}]
    content, calls, finish, _ = chat(oa, follow, stream, tools=[WEATHER], max_tokens=80)
    assert calls == [("get_weather", {"city": "Tokyo"})] and finish == "tool_calls"
    assert content.strip().endswith(":") and RESULT in content
    assert not any(m in content for m in MARKUP)


def test_required_writes_qwens_own_tag_token_and_ends_the_turn(oa):
    # the forced envelope starts with <tool_call>, one added token in Qwen's vocabulary:
    # the grammar's view treats it as text, so the model writes its own token, then ends
    ask = [{"role": "user", "content": "What is 17 plus 25?"}]
    r = oa.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER, ADD],
                                   tool_choice="required", temperature=0, max_tokens=60,
                                   logprobs=True)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    assert [(x.function.name, json.loads(x.function.arguments))
            for x in c.message.tool_calls] == [("add", {"a": 17, "b": 25})]
    assert c.logprobs.content[0].token == "<tool_call>"
    assert r.usage.completion_tokens < 60                # it stopped on its own


def test_a_call_cut_by_max_tokens_is_text_not_an_invented_call(oa):
    for stream in (False, True):
        content, calls, finish, _ = chat(oa, TOKYO, stream, max_tokens=8)
        assert calls == [] and finish == "length"
        assert content                              # what was written, as text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_ollama_auto_tool_call(daemon, stream):
    cl = ollama.Client(host=daemon.url, timeout=300)
    args = dict(model=MODEL, messages=TOKYO, tools=[WEATHER, ADD],
                options={"temperature": 0, "num_predict": 60})
    if stream:
        calls, content = [], ""
        for part in cl.chat(stream=True, **args):
            calls += part.message.tool_calls or []
            content += part.message.content or ""
    else:
        r = cl.chat(**args)
        calls, content = r.message.tool_calls or [], r.message.content or ""
    assert [(c.function.name, dict(c.function.arguments)) for c in calls] == \
        [("get_weather", {"city": "Tokyo"})]
    assert not content.strip()


def test_ollama_round_trip(daemon):
    cl = ollama.Client(host=daemon.url, timeout=300)
    opts = {"temperature": 0, "num_predict": 60, "repeat_penalty": 1.0}    # plain greedy
    r = cl.chat(model=MODEL, messages=TOKYO, tools=[WEATHER], options=opts)
    call = r.message.tool_calls[0]
    msgs = TOKYO + [r.message, {"role": "tool", "tool_name": call.function.name,
                                "content": RESULT}, FOLLOW_UP]
    r = cl.chat(model=MODEL, messages=msgs, tools=[WEATHER], options=opts)
    assert not r.message.tool_calls
    assert "22" in r.message.content and "rain" in r.message.content


def test_langchain_tool_loop(daemon):
    lc = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage

    def get_weather(city: str) -> str:
        return RESULT if city == "Tokyo" else "unknown city"

    llm = lc.ChatOpenAI(base_url=daemon.url + "/v1", api_key="unused", model=MODEL,
                        temperature=0, max_tokens=60, max_retries=0, timeout=300)
    # the same tool definition as the other tests (a 0.5B model's answers move with the
    # wording of a tool's description)
    agent = llm.bind_tools([WEATHER])
    msgs = [HumanMessage("What's the weather in Tokyo?")]
    ai = agent.invoke(msgs)
    assert [(c["name"], c["args"]) for c in ai.tool_calls] == [("get_weather",
                                                                 {"city": "Tokyo"})]
    msgs += [ai] + [ToolMessage(get_weather(**c["args"]), tool_call_id=c["id"])
                    for c in ai.tool_calls] + [HumanMessage(FOLLOW_UP["content"])]
    final = agent.invoke(msgs)
    assert not final.tool_calls
    assert "22" in final.content and "rain" in final.content


def test_responses_and_anthropic_apis_read_the_same_calls(daemon, oa):
    r = oa.responses.create(model=MODEL, input=TOKYO[0]["content"], temperature=0,
                            max_output_tokens=60,
                            tools=[{"type": "function", **WEATHER["function"]}])
    calls = [o for o in r.output if o.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == \
        [("get_weather", {"city": "Tokyo"})]
    anthropic = pytest.importorskip("anthropic")
    with anthropic.Anthropic(base_url=daemon.url, api_key="unused", max_retries=0,
                             timeout=300) as ac:
        m = ac.messages.create(model=MODEL, max_tokens=60, messages=TOKYO,
                               extra_body={"temperature": 0},
                               tools=[{"name": "get_weather",
                                       "description": WEATHER["function"]["description"],
                                       "input_schema": WEATHER["function"]["parameters"]}])
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use"
    assert [(u.name, u.input) for u in uses] == [("get_weather", {"city": "Tokyo"})]


def test_the_shapes_qwen_writes_unconstrained(daemon, oa, qwen_coder_path):
    """The same prompt rendered by Qwen's template, completed without any grammar: the model
    writes a fenced or bare JSON call (not its template's <tool_call> tags), which is why the
    parser and the lazy grammar accept those shapes; the parser reads what it wrote."""
    from edgeinfer.formats.chat_template import render_chat
    from edgeinfer.formats.gguf_file import read_gguf
    from edgeinfer.formats.tokenizer import Tokenizer
    from edgeinfer.server import tools as T
    f = read_gguf(qwen_coder_path)
    try:
        tmpl, tok = f.metadata["tokenizer.chat_template"], Tokenizer.from_gguf(f.metadata)
    finally:
        f.close()
    tools = T.parse_tools([WEATHER, ADD])
    msgs, extra = T.prepare_chat(TOKYO, tools, T.Choice("auto"), True, tmpl)
    ids = tok.encode(render_chat(tmpl, msgs, **extra), add_special=True, parse_special=True)
    raw = oa.completions.create(model=MODEL, prompt=ids, max_tokens=60, temperature=0)
    text = raw.choices[0].text
    assert text.lstrip().startswith(("```", "{", "<tool_call>")), text
    content, calls = T.parse_calls(text, tools)
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Tokyo"})]
    assert content == ""


def test_bad_tool_requests_are_400_not_500(daemon):
    bad = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "minLength": "three"}}}}}
    r = httpx.post(daemon.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": TOKYO, "tools": [bad]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].function.parameters"


@pytest.mark.slow          # its Q4_1 kernels may compile for minutes on a cold JIT cache
def test_smollm2_with_tools_answers_in_text_through_the_fallback_prompt(oa):
    """SmolLM2's ChatML template has no tools: the built-in fallback prompt teaches our
    envelope and the lazy grammar watches for it. The 135M model answers in prose; the
    grammar must leave that untouched and the reply must end on its own."""
    for stream in (False, True):
        content, calls, finish, _ = chat(oa, TOKYO, stream, model=SMOL, max_tokens=120)
        assert finish in ("stop", "tool_calls")
        if calls:
            assert all(name in ("get_weather", "add") for name, _ in calls)
        else:
            assert finish == "stop" and content and not any(m in content for m in MARKUP)
