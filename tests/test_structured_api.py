"""Structured output and tool calls through a real daemon, with the official `openai` and
`ollama` clients on the bundled gemma3 270M (a base model: only the grammar makes its output
parse, which is the point). Greedy decoding throughout."""
from __future__ import annotations

import json

import ollama
import openai
import pytest
from pydantic import BaseModel, Field

from daemon_fixture import backend_daemon, shared_daemon  # noqa: F401  (module fixtures)

pytest.importorskip("llguidance")

MODEL = "gemma3:270m"


@pytest.fixture(scope="module")
def oa(shared_daemon):  # noqa: F811
    with openai.OpenAI(base_url=shared_daemon.url + "/v1", api_key="unused",
                       max_retries=0, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def oa_backend(backend_daemon):  # noqa: F811
    with openai.OpenAI(base_url=backend_daemon.url + "/v1", api_key="unused",
                       max_retries=0, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def ol(shared_daemon):  # noqa: F811
    return ollama.Client(host=shared_daemon.url, timeout=300)


class City(BaseModel):
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)
    population: int = Field(ge=0, le=99_999_999)   # a base model would write 0s forever


PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer"},
                         "languages": {"type": "array", "items": {"enum": ["en", "fr", "de"]},
                                       "maxItems": 3}},
          "required": ["name", "age", "languages"], "additionalProperties": False}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "maxLength": 20},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    # bounded: a base model left alone writes digits until max_tokens
    "parameters": {"type": "object",
                   "properties": {"a": {"type": "integer", "minimum": -999, "maximum": 999},
                                  "b": {"type": "integer", "minimum": -999, "maximum": 999}},
                   "required": ["a", "b"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _validate_person(obj) -> None:
    assert set(obj) == {"name", "age", "languages"}
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 20
    assert isinstance(obj["age"], int)
    assert all(x in ("en", "fr", "de") for x in obj["languages"])


# ----- OpenAI ------------------------------------------------------------------------------

def test_json_schema_response_parses_and_validates(oa_backend):
    r = oa_backend.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=120,
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    c = r.choices[0]
    assert c.finish_reason == "stop", c.message.content
    _validate_person(json.loads(c.message.content))


def test_json_object_response(oa):
    r = oa.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=150,
        messages=[{"role": "user", "content": "Give me a JSON object about cats."}],
        response_format={"type": "json_object"})
    c = r.choices[0]
    if c.finish_reason == "stop":
        assert isinstance(json.loads(c.message.content), dict)
    else:                   # cut by max_tokens: exactly what was produced, an object's start
        assert c.finish_reason == "length" and c.message.content.startswith("{")


def test_parse_with_pydantic_model(oa):
    r = oa.chat.completions.parse(
        model=MODEL, temperature=0, max_tokens=120, response_format=City,
        messages=[{"role": "user", "content": "Tell me about Paris."}])
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, City)
    assert len(parsed.name) <= 24


def test_length_cut_inside_json_invents_nothing(oa):
    r = oa.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=5,
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": PERSON}})
    c = r.choices[0]
    assert c.finish_reason == "length"
    assert r.usage.completion_tokens == 5
    with pytest.raises(json.JSONDecodeError):
        json.loads(c.message.content)
    assert c.message.content.startswith('{"name": ')


def test_required_tool_call(oa_backend):
    r = oa_backend.chat.completions.create(model=MODEL, temperature=0, max_tokens=80, messages=ASK,
                                   tools=[WEATHER, ADD], tool_choice="required",
                                   parallel_tool_calls=False)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    assert len(c.message.tool_calls) == 1
    call = c.message.tool_calls[0]
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name in ("get_weather", "add")
    args = json.loads(call.function.arguments)
    assert set(args) == ({"city", "unit"} if call.function.name == "get_weather" else {"a", "b"})
    assert not c.message.content


def test_named_tool_choice(oa):
    r = oa.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=60, messages=ASK, tools=[WEATHER, ADD],
        tool_choice={"type": "function", "function": {"name": "add"}},
        parallel_tool_calls=False)
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "add"
    args = json.loads(call.function.arguments)
    assert isinstance(args["a"], int) and isinstance(args["b"], int)


def test_streamed_tool_call_deltas(oa):
    ref = oa.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=80, messages=ASK, tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False).choices[0].message.tool_calls[0]
    calls: dict[int, dict] = {}
    content, reasons = "", []
    for ev in oa.chat.completions.create(
            model=MODEL, temperature=0, max_tokens=80, messages=ASK, tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            parallel_tool_calls=False, stream=True):
        for ch in ev.choices:
            content += ch.delta.content or ""
            reasons.append(ch.finish_reason)
            for d in ch.delta.tool_calls or []:
                assert d.index is not None
                slot = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                slot["id"] = d.id or slot["id"]
                if d.function:
                    slot["name"] += d.function.name or ""
                    slot["arguments"] += d.function.arguments or ""
    assert "<tool_call>" not in content and content == ""
    assert reasons[-1] == "tool_calls"
    assert list(calls) == [0]
    assert calls[0]["id"].startswith("call_") and calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == json.loads(ref.function.arguments)


def test_tool_result_round_trip(oa):
    first = oa.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=60, messages=ASK, tools=[WEATHER],
        tool_choice="required", parallel_tool_calls=False).choices[0].message
    call = first.tool_calls[0]
    follow = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                    {"role": "tool", "tool_call_id": call.id, "content": "21 degrees, sunny"}]
    r = oa.chat.completions.create(model=MODEL, temperature=0, max_tokens=8, messages=follow,
                                   tools=[WEATHER])
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the call and the result are in the prompt: longer than the question alone
    base = oa.chat.completions.create(model=MODEL, temperature=0, max_tokens=1, messages=ASK,
                                      tools=[WEATHER])
    assert r.usage.prompt_tokens > base.usage.prompt_tokens + 15


def test_auto_tool_choice_text_passes_through_the_auto_grammar(oa):
    # the base model answers in prose here; under the auto grammar prose stays free
    ref = oa.chat.completions.create(model=MODEL, temperature=0, max_tokens=12, messages=ASK,
                                     tools=[WEATHER], tool_choice="none")
    r = oa.chat.completions.create(model=MODEL, temperature=0, max_tokens=12, messages=ASK,
                                   tools=[WEATHER])
    c = r.choices[0]
    assert c.finish_reason == "length" and c.message.tool_calls is None
    assert c.message.content and "<tool_call>" not in c.message.content
    assert r.usage.prompt_tokens > ref.usage.prompt_tokens      # the tools are in the prompt


def test_tool_choice_none_gives_text(oa):
    r = oa.chat.completions.create(model=MODEL, temperature=0, max_tokens=8, messages=ASK,
                                   tools=[WEATHER], tool_choice="none")
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason == "length"


def test_completions_gbnf_grammar(oa):
    r = oa.completions.create(model=MODEL, prompt="The answer is", max_tokens=10, temperature=0,
                              extra_body={"grammar": 'root ::= " " ("yes" | "no") "."'})
    assert r.choices[0].text in (" yes.", " no.")
    assert r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("kw,param,words", [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format.json_schema.schema", "'type'"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {
            "a": {"type": "string", "pattern": "(("}}}}}},
     "response_format.json_schema.schema", "regex"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "yaml"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
     "tools[0].function.parameters", "schema"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
])
def test_bad_schemas_are_400_in_openai_shape(oa, kw, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        oa.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, **kw)
    err = e.value.body
    assert e.value.status_code == 400
    assert err["param"] == param, err
    assert words in err["message"], err


def test_hostile_schema_is_400_and_the_engine_goes_on(oa):
    deep: dict = {"type": "string"}
    for _ in range(300):
        deep = {"type": "object", "properties": {"a": deep}}
    for schema, words in ((deep, "nested more than"),
                          ({"enum": [f"v{i}" for i in range(100_000)]}, "too big")):
        with pytest.raises(openai.BadRequestError) as e:
            oa.chat.completions.create(
                model=MODEL, messages=ASK, max_tokens=4,
                response_format={"type": "json_schema",
                                 "json_schema": {"name": "x", "schema": schema}})
        assert words in e.value.body["message"]
    r = oa.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason == "length"


# ----- Ollama ------------------------------------------------------------------------------

def test_ollama_format_schema(ol):
    r = ol.chat(model=MODEL, messages=[{"role": "user", "content": "Tell me about Paris."}],
                format=City.model_json_schema(), options={"temperature": 0, "num_predict": 120})
    assert r.done_reason == "stop"
    City.model_validate_json(r.message.content)


def test_ollama_format_json_generate(ol):
    r = ol.generate(model=MODEL, prompt="A JSON object with a name:", format="json",
                    options={"temperature": 0, "num_predict": 150})
    assert r.done_reason == "stop", r      # the grammar completed the object
    assert isinstance(json.loads(r.response), dict)


def test_ollama_streamed_format(ol):
    parts = [c.message.content for c in ol.chat(
        model=MODEL, messages=[{"role": "user", "content": "Tell me about Paris."}],
        format=City.model_json_schema(), stream=True,
        options={"temperature": 0, "num_predict": 120})]
    City.model_validate_json("".join(parts))


def test_ollama_tools_and_tool_messages(ol):
    msgs = ASK + [{"role": "assistant", "content": "",
                   "tool_calls": [{"function": {"name": "get_weather",
                                                "arguments": {"city": "Paris",
                                                              "unit": "celsius"}}}]},
                  {"role": "tool", "tool_name": "get_weather", "content": "21 degrees"}]
    r = ol.chat(model=MODEL, messages=msgs, tools=[WEATHER],
                options={"temperature": 0, "num_predict": 6})
    assert r.done
    plain = ol.chat(model=MODEL, messages=ASK, options={"temperature": 0, "num_predict": 1})
    assert r.prompt_eval_count > plain.prompt_eval_count + 30


def test_ollama_think_on_a_model_that_cannot_think(ol):
    with pytest.raises(ollama.ResponseError) as e:
        ol.chat(model=MODEL, messages=ASK, think=True, options={"num_predict": 2})
    assert e.value.status_code == 400 and "does not support thinking" in e.value.error
    r = ol.chat(model=MODEL, messages=ASK, think=False,
                options={"temperature": 0, "num_predict": 2})
    assert r.done and not r.message.thinking


@pytest.mark.parametrize("fmt,words", [
    ({"type": "objekt"}, "'type'"),
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "(("}}}, "regex"),
])
def test_ollama_bad_format_is_400(ol, fmt, words):
    with pytest.raises(ollama.ResponseError) as e:
        ol.chat(model=MODEL, messages=ASK, format=fmt, options={"num_predict": 2})
    assert e.value.status_code == 400 and words in e.value.error


def test_ollama_unknown_format_string_is_400(shared_daemon):  # noqa: F811
    # the ollama client refuses it before sending; a raw client gets Ollama's error shape
    r = shared_daemon.post("/api/generate", {"model": MODEL, "prompt": "x", "format": "yaml",
                                             "stream": False})
    assert r.status_code == 400 and "format" in r.json()["error"]


def test_ollama_bad_tool_is_400(ol):
    with pytest.raises(ollama.ResponseError) as e:
        ol.chat(model=MODEL, messages=ASK, options={"num_predict": 2},
                tools=[{"type": "function", "function": {
                    "name": "f", "parameters": {"type": "object",
                                                "properties": {"a": {"type": "strng"}}}}}])
    assert e.value.status_code == 400 and "tools[0].function.parameters" in e.value.error
    assert "'strng'" in e.value.error


def test_ollama_show_capabilities(ol):
    caps = ol.show(MODEL).capabilities
    assert "completion" in caps and "tools" in caps and "thinking" not in caps


# ----- auto: a few-shot conversation makes the base model call on its own ------------------

FEW_SHOT_OL = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": "",
     "tool_calls": [{"function": {"name": "get_weather",
                                  "arguments": {"city": "Paris", "unit": "celsius"}}}]},
    {"role": "tool", "tool_name": "get_weather", "content": "21 degrees"},
    {"role": "assistant", "content": "It is 21 degrees in Paris."},
    {"role": "user", "content": "What is the weather in Rome?"}]


def _few_shot_openai() -> list[dict]:
    m = json.loads(json.dumps(FEW_SHOT_OL))
    m[1]["tool_calls"] = [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}]
    m[2] = {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}
    return m


def test_ollama_auto_tool_call(ol):
    r = ol.chat(model=MODEL, messages=FEW_SHOT_OL, tools=[WEATHER],
                options={"temperature": 0, "num_predict": 60})
    calls = r.message.tool_calls
    assert calls and calls[0].function.name == "get_weather"
    assert isinstance(calls[0].function.arguments, dict)          # an object, not a string
    assert set(calls[0].function.arguments) == {"city", "unit"}
    assert "<tool_call>" not in r.message.content


def test_ollama_streamed_tool_call(ol):
    ref = ol.chat(model=MODEL, messages=FEW_SHOT_OL, tools=[WEATHER],
                  options={"temperature": 0, "num_predict": 60}).message.tool_calls
    content, calls = "", []
    for chunk in ol.chat(model=MODEL, messages=FEW_SHOT_OL, tools=[WEATHER], stream=True,
                         options={"temperature": 0, "num_predict": 60}):
        content += chunk.message.content or ""
        calls += chunk.message.tool_calls or []
    assert "<tool_call>" not in content and content.strip() == ""
    assert [c.model_dump() for c in calls] == [c.model_dump() for c in ref]


def test_openai_auto_tool_call_streamed(oa):
    msgs = _few_shot_openai()
    r = oa.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER],
                                   temperature=0, max_tokens=60, parallel_tool_calls=False)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c.message
    args = json.loads(c.message.tool_calls[0].function.arguments)
    names, content = [], ""
    for ev in oa.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER],
                                         temperature=0, max_tokens=60,
                                         parallel_tool_calls=False, stream=True):
        for ch in ev.choices:
            content += ch.delta.content or ""
            for d in ch.delta.tool_calls or []:
                if d.function and d.function.name:
                    names.append(d.function.name)
                if d.function and d.function.arguments:
                    assert json.loads(d.function.arguments) == args
    assert names == ["get_weather"] and "<tool_call>" not in content
