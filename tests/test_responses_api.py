"""The OpenAI Responses API (/v1/responses) through a real daemon with the official `openai`
client's responses.create and responses.stream, on the bundled gemma3 270M (a base model:
the call grammar is what makes its tool calls parse). Greedy decoding throughout."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from daemon_fixture import shared_daemon  # noqa: F401  (module fixture)
from edgeinfer.server.responses_api import ResponseStore, input_messages

MODEL = "gemma3:270m"
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object",
                          "properties": {"city": {"type": "string", "maxLength": 20},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def oa(shared_daemon):  # noqa: F811
    with openai.OpenAI(base_url=shared_daemon.url + "/v1", api_key="unused", max_retries=0,
                       timeout=300) as c:
        yield c


def test_create_with_string_input(oa):
    r = oa.responses.create(model=MODEL, input="Why is the sky blue?", max_output_tokens=12,
                            temperature=0, instructions="Answer in one sentence.")
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].type == "message" and r.output_text.strip()
    assert r.usage.output_tokens == 12 and r.usage.input_tokens > 10
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_stream_events_match_create(oa):
    kw = dict(model=MODEL, input="Name three colors.", max_output_tokens=16, temperature=0)
    full = oa.responses.create(**kw)
    kinds, text, seqs = [], "", []
    with oa.responses.stream(**kw) as s:
        for ev in s:
            kinds.append(ev.type)
            seqs.append(ev.sequence_number)
            if ev.type == "response.output_text.delta":
                text += ev.delta
    assert kinds[:2] == ["response.created", "response.in_progress"]
    for k in ("response.output_item.added", "response.content_part.added",
              "response.output_text.delta", "response.output_text.done",
              "response.content_part.done", "response.output_item.done"):
        assert k in kinds
    assert kinds[-1] == "response.incomplete"           # max_output_tokens cut it
    assert seqs == list(range(len(seqs)))
    assert text == full.output_text


def test_forced_function_call_streamed_and_round_trip_with_previous_response_id(oa):
    ask = "What is the weather in Paris?"
    with oa.responses.stream(model=MODEL, input=ask, tools=[WEATHER], temperature=0,
                             tool_choice={"type": "function", "name": "get_weather"},
                             parallel_tool_calls=False, max_output_tokens=60) as s:
        kinds, args = [], ""
        for ev in s:
            kinds.append(ev.type)
            if ev.type == "response.function_call_arguments.delta":
                args += ev.delta
        final = s.get_final_response()
    assert "response.function_call_arguments.done" in kinds
    assert kinds[-1] == "response.completed" and final.status == "completed"
    call = [o for o in final.output if o.type == "function_call"][0]
    assert call.name == "get_weather" and json.loads(call.arguments) == json.loads(args)
    assert json.loads(call.arguments)["unit"] in ("celsius", "fahrenheit")
    # the result goes back by previous_response_id: the stored turn is in the prompt
    r2 = oa.responses.create(model=MODEL, previous_response_id=final.id, temperature=0,
                             max_output_tokens=8, tools=[WEATHER],
                             input=[{"type": "function_call_output", "call_id": call.call_id,
                                     "output": "21 degrees, sunny"}])
    alone = oa.responses.create(model=MODEL, temperature=0, max_output_tokens=1,
                                tools=[WEATHER],
                                input=[{"type": "function_call_output",
                                        "call_id": call.call_id, "output": "21 degrees, sunny"}])
    assert r2.usage.input_tokens > alone.usage.input_tokens + 10
    # the same conversation given as items in full costs the same prompt
    items = [{"role": "user", "content": ask},
             {"type": "function_call", "call_id": call.call_id, "name": call.name,
              "arguments": call.arguments},
             {"type": "function_call_output", "call_id": call.call_id,
              "output": "21 degrees, sunny"}]
    r3 = oa.responses.create(model=MODEL, input=items, temperature=0, max_output_tokens=8,
                             tools=[WEATHER])
    assert r3.usage.input_tokens == r2.usage.input_tokens
    assert r3.output_text == r2.output_text


def test_create_function_call_not_streamed(oa):
    r = oa.responses.create(model=MODEL, input="Weather in Rome?", tools=[WEATHER],
                            tool_choice="required", temperature=0, max_output_tokens=60,
                            parallel_tool_calls=False)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].call_id.startswith("call_")
    assert r.status == "completed"


def test_text_format_json_schema(oa):
    r = oa.responses.create(model=MODEL, input="Invent a person.", temperature=0,
                            max_output_tokens=60,
                            text={"format": {"type": "json_schema", "name": "person",
                                             "schema": PERSON, "strict": True}})
    obj = json.loads(r.output_text)
    assert set(obj) == {"name", "age"} and isinstance(obj["age"], int)


def test_previous_response_id_unknown_is_404_and_store_false(oa, shared_daemon):  # noqa: F811
    with pytest.raises(openai.NotFoundError) as e:
        oa.responses.create(model=MODEL, input="hi", previous_response_id="resp_nope",
                            max_output_tokens=2)
    assert e.value.status_code == 404 and "resp_nope" in str(e.value.message)
    r = oa.responses.create(model=MODEL, input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        oa.responses.create(model=MODEL, input="again", previous_response_id=r.id,
                            max_output_tokens=2)
    kept = oa.responses.create(model=MODEL, input="hi", max_output_tokens=2)
    assert oa.responses.retrieve(kept.id).id == kept.id
    oa.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        oa.responses.retrieve(kept.id)
    r = httpx.post(shared_daemon.url + "/v1/responses", json={"model": MODEL, "input": [
        {"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_store_is_bounded_lru_with_ttl():
    s = ResponseStore(max_items=3, max_bytes=10_000, ttl_s=1000)
    for i in range(5):
        s.put(f"r{i}", [{"role": "user", "content": "x"}], {"id": f"r{i}"})
    assert len(s) == 3 and s.get("r0") is None and s.get("r4") is not None
    s.get("r2")                                   # r2 becomes the most recent
    s.put("r5", [], {})
    assert s.get("r3") is None and s.get("r2") is not None
    big = ResponseStore(max_items=100, max_bytes=300, ttl_s=1000)
    for i in range(10):
        big.put(f"b{i}", [{"role": "user", "content": "y" * 50}], {})
    assert 1 <= len(big) < 10 and big.get("b9") is not None
    old = ResponseStore(ttl_s=0.0)
    old.put("o", [], {})
    import time
    time.sleep(0.01)
    assert old.get("o") is None


def test_input_items_to_messages():
    msgs = input_messages([
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "input_text", "text": "a"},
                                     {"type": "input_text", "text": "b"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"x\": 1}"},
        {"type": "function_call_output", "call_id": "c2", "output": "ok"}])
    assert msgs[0] == {"role": "system", "content": "be brief"}
    assert msgs[1] == {"role": "user", "content": "ab"}
    assert [c["function"]["name"] for c in msgs[2]["tool_calls"]] == ["f", "g"]
    assert msgs[3] == {"role": "tool", "tool_call_id": "c2", "name": "g", "content": "ok"}
