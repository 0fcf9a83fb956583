"""The Anthropic Messages API (/v1/messages, /v1/messages/count_tokens) through a real
daemon with the official `anthropic` client, on the bundled gemma3 270M (a base model: the
call grammar is what makes its tool calls parse). Greedy decoding throughout."""
from __future__ import annotations

import json

import httpx
import pytest

from daemon_fixture import shared_daemon, start_daemon, register_gemma  # noqa: F401

anthropic = pytest.importorskip("anthropic")

MODEL = "gemma3:270m"
WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object",
                            "properties": {"city": {"type": "string", "maxLength": 20},
                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
                            "required": ["city", "unit"], "additionalProperties": False}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# The anthropic client (2.x) no longer has temperature/top_p/top_k arguments; the API takes them
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def ac(shared_daemon):  # noqa: F811
    with anthropic.Anthropic(base_url=shared_daemon.url, api_key="unused", max_retries=0,
                             timeout=300) as c:
        yield c


def test_create_text(ac):
    r = ac.messages.create(model=MODEL, max_tokens=12, extra_body=GREEDY,
                           system="You answer in one sentence.",
                           messages=[{"role": "user", "content": "Why is the sky blue?"}])
    assert r.type == "message" and r.role == "assistant" and r.model == MODEL
    assert r.id.startswith("msg_")
    assert len(r.content) == 1 and r.content[0].type == "text" and r.content[0].text.strip()
    assert r.stop_reason == "max_tokens"
    assert r.usage.output_tokens == 12 and r.usage.input_tokens > 10


def test_stream_events_and_text_match_non_streamed(ac):
    kw = dict(model=MODEL, max_tokens=16, extra_body=GREEDY,
              messages=[{"role": "user", "content": "Name three colors."}])
    full = ac.messages.create(**kw)
    kinds, text = [], ""
    with ac.messages.stream(**kw) as s:
        for ev in s:
            kinds.append(ev.type)
            if ev.type == "content_block_delta" and ev.delta.type == "text_delta":
                text += ev.delta.text
        final = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "content_block_stop" in kinds
    assert "message_delta" in kinds
    assert text == full.content[0].text == final.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 16


def test_stop_sequence_is_reported(ac):
    free = ac.messages.create(model=MODEL, max_tokens=24, extra_body=GREEDY, messages=ASK)
    words = free.content[0].text.split()
    assert len(words) > 3
    stop = words[2]
    r = ac.messages.create(model=MODEL, max_tokens=24, extra_body=GREEDY, messages=ASK,
                           stop_sequences=[stop])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    assert stop not in r.content[0].text
    assert free.content[0].text.startswith(r.content[0].text)


def test_forced_tool_use_and_round_trip(ac):
    r = ac.messages.create(model=MODEL, max_tokens=60, extra_body=GREEDY, messages=ASK,
                           tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"})
    assert r.stop_reason == "tool_use"
    calls = [b for b in r.content if b.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert calls[0].id.startswith("toolu_")
    assert set(calls[0].input) == {"city", "unit"}
    assert calls[0].input["unit"] in ("celsius", "fahrenheit")
    follow = ASK + [{"role": "assistant", "content": [b.model_dump() for b in r.content]},
                    {"role": "user", "content": [{"type": "tool_result",
                                                  "tool_use_id": calls[0].id,
                                                  "content": "21 degrees, sunny"}]}]
    r2 = ac.messages.create(model=MODEL, max_tokens=8, extra_body=GREEDY, messages=follow,
                            tools=[WEATHER])
    assert r2.stop_reason in ("end_turn", "max_tokens", "tool_use")
    # the call and its result are in the prompt
    n_ask = ac.messages.count_tokens(model=MODEL, messages=ASK, tools=[WEATHER]).input_tokens
    assert r2.usage.input_tokens > n_ask + 15


def test_streamed_tool_use_input_json_delta(ac):
    kw = dict(model=MODEL, max_tokens=60, extra_body=GREEDY, messages=ASK, tools=[WEATHER],
              tool_choice={"type": "any"})
    partial, starts = "", []
    with ac.messages.stream(**kw) as s:
        for ev in s:
            if ev.type == "content_block_start":
                starts.append(ev.content_block.type)
            if ev.type == "content_block_delta" and ev.delta.type == "input_json_delta":
                partial += ev.delta.partial_json
        final = s.get_final_message()
    assert "tool_use" in starts
    assert final.stop_reason == "tool_use"
    block = [b for b in final.content if b.type == "tool_use"][0]
    assert json.loads(partial) == block.input
    assert block.input["unit"] in ("celsius", "fahrenheit")


def test_count_tokens(ac):
    a = ac.messages.count_tokens(model=MODEL, messages=ASK).input_tokens
    b = ac.messages.count_tokens(model=MODEL, messages=ASK, system="Be brief.").input_tokens
    r = ac.messages.create(model=MODEL, max_tokens=1, extra_body=GREEDY, messages=ASK)
    assert a == r.usage.input_tokens and b > a


def test_errors_in_anthropic_shape(ac, shared_daemon):  # noqa: F811
    with pytest.raises(anthropic.NotFoundError) as e:
        ac.messages.create(model="nope:1b", max_tokens=4, messages=ASK)
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as e:
        ac.messages.create(model=MODEL, max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "image", "source": {
                "type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "image" in e.value.body["error"]["message"]
    r = httpx.post(shared_daemon.url + "/v1/messages", json={"model": MODEL, "messages": ASK})
    assert r.status_code == 400                  # max_tokens is required
    assert r.json()["type"] == "error" and "max_tokens" in r.json()["error"]["message"]
    r = httpx.post(shared_daemon.url + "/v1/messages", json={
        "model": MODEL, "max_tokens": 4, "messages": ASK, "temperature": 7})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_x_api_key(tmp_path, gemma3_path):
    home = tmp_path / "home"
    register_gemma(home, gemma3_path)
    d = start_daemon(home, api_key="sekrit")
    try:
        with anthropic.Anthropic(base_url=d.url, api_key="sekrit", max_retries=0,
                                 timeout=300) as c:
            n = c.messages.count_tokens(model=MODEL, messages=ASK).input_tokens
            assert n > 5
        with anthropic.Anthropic(base_url=d.url, api_key="wrong", max_retries=0,
                                 timeout=60) as c:
            with pytest.raises(anthropic.AuthenticationError) as e:
                c.messages.count_tokens(model=MODEL, messages=ASK)
            assert e.value.body["error"]["type"] == "authentication_error"
    finally:
        d.stop()
