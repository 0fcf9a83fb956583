"""gpt-oss's Harmony format through a real daemon, with the official openai and ollama clients.

Random weights do not write Harmony, so the output is forced with a grammar:

- through the daemon, a GBNF grammar (llama-server's `grammar` extension). GBNF cannot name
  special tokens, and forced text that spells a user-defined token (<|end|>, <|channel|>,
  which llama.cpp's rules make user-defined in a Harmony vocabulary) breaks the engine's
  grammar matcher, so the daemon's model has only <|return|> / <|call|> as special tokens and
  the grammar spells the markup as text: the text the daemon splits is the same either way,
  and its template (the bundled Harmony one) is what marks it as a Harmony model;
- in process (test_engine_output_with_harmony_tokens), a model with the whole Harmony
  vocabulary and a Lark grammar over the real special tokens, ending in <|return|> /
  <|call|>: the engine's own output text goes through the splitter.

The prompt side (reasoning_effort / think levels, earlier reasoning and calls in multi-turn)
is checked by the prompt token counts the daemon reports against the template rendered here
and tokenized with the model's own tokenizer.
"""
from __future__ import annotations

import json

import httpx
import numpy as np
import ollama
import openai
import pytest

from daemon_fixture import start_daemon
from edgeinfer.formats.chat_template import builtin_template, encode_prompt, render_chat
from edgeinfer.formats.synthetic import TinyShape, random_f32_tensors, write_tiny_gguf

pytest.importorskip("llguidance")

MODEL, PLAIN, TOKENS = "harmony:latest", "plain:latest", "harmony-tokens:latest"
SPECIALS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
            "<|return|>", "<|call|>")
TEMPLATE = builtin_template("harmony")
ASK = [{"role": "user", "content": "What is 2+2?"}]
ANSWER = (r'root ::= "<|channel|>analysis<|message|>The sum is 4.<|end|><|start|>assistant'
          r'<|channel|>final<|message|>It is 4."')
CALL = (r'root ::= "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant'
        r'<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
        r'{\"city\": \"Paris\"}"')
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
SHAPE = TinyShape(64, 128, 2, 1, 32, 2, 2048)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = tmp_path_factory.mktemp("harmony")
    paths = {}
    for name, kw in ((MODEL, dict(extra_specials=("<|return|>", "<|call|>"),
                                  chat_template=TEMPLATE)),
                     (PLAIN, {}),
                     # the markup as special tokens, as gpt-oss has it: auto mode's grammar
                     (TOKENS, dict(extra_specials=SPECIALS, chat_template=TEMPLATE))):
        p = paths[name] = d / f"{name.split(':')[0]}.gguf"
        write_tiny_gguf(p, "qwen3", SHAPE, random_f32_tensors(np.random.default_rng(0)),
                        file_type=0, name="synthetic-harmony", **kw)
    from edgeinfer.store.model_store import Store
    home = d / "home"
    for name, p in paths.items():
        Store(home).register_file(p, name)
    dm = start_daemon(home)
    dm.model_path = paths[MODEL]
    try:
        yield dm
    finally:
        dm.stop()


@pytest.fixture(scope="module")
def oa(daemon):
    with openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0,
                       timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def tok(daemon):
    from edgeinfer.formats.tokenizer.vocab import Tokenizer
    return Tokenizer.from_file(str(daemon.model_path))


def n_prompt(tok, messages, **extra) -> int:
    return len(encode_prompt(tok, render_chat(TEMPLATE, messages, **extra)))


def test_reasoning_and_final_split(oa):
    r = oa.chat.completions.create(model=MODEL, messages=ASK, max_tokens=300, temperature=0,
                                   extra_body={"grammar": ANSWER})
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "stop"
    assert m.content == "It is 4."
    assert m.model_extra["reasoning_content"] == "The sum is 4."
    assert "<|" not in m.content


def test_streamed_split(oa):
    reasoning, content, n = "", "", 0
    for ev in oa.chat.completions.create(model=MODEL, messages=ASK, max_tokens=300,
                                         temperature=0, stream=True,
                                         extra_body={"grammar": ANSWER}):
        for ch in ev.choices:
            content += ch.delta.content or ""
            reasoning += (ch.delta.model_extra or {}).get("reasoning_content") or ""
            n += 1
    assert (reasoning, content) == ("The sum is 4.", "It is 4.")
    assert n > 3                     # pieces, not one lump


@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_after_reasoning(oa, stream):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
              tools=[WEATHER], max_tokens=300, temperature=0, extra_body={"grammar": CALL})
    if not stream:
        r = oa.chat.completions.create(**kw)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls"
        assert not ch.message.content
        assert ch.message.model_extra["reasoning_content"] == "Need weather."
        (c,) = ch.message.tool_calls
        assert (c.function.name, json.loads(c.function.arguments)) == \
            ("get_weather", {"city": "Paris"})
        return
    args, names, finish, content = "", [], None, ""
    for ev in oa.chat.completions.create(stream=True, **kw):
        for ch in ev.choices:
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                if tc.function.name:
                    names.append(tc.function.name)
                args += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    assert (names, json.loads(args), finish, content) == \
        (["get_weather"], {"city": "Paris"}, "tool_calls", "")


def test_reasoning_effort_reaches_the_system_message(oa, tok):
    for effort in ("low", "medium", "high"):
        r = oa.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1,
                                       reasoning_effort=effort)
        assert r.usage.prompt_tokens == n_prompt(tok, ASK, reasoning_effort=effort), effort
    r = oa.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1)
    assert r.usage.prompt_tokens == n_prompt(tok, ASK)          # the template's medium
    assert n_prompt(tok, ASK, reasoning_effort="low") != n_prompt(tok, ASK,
                                                                   reasoning_effort="high")


def test_effort_refused_where_it_cannot_be_honoured(oa, daemon):
    with pytest.raises(openai.BadRequestError, match="reasoning_effort"):
        oa.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1,
                                   reasoning_effort="extreme")
    with pytest.raises(openai.BadRequestError, match="takes no reasoning level"):
        oa.chat.completions.create(model=PLAIN, messages=ASK, max_tokens=1,
                                   reasoning_effort="high")


def test_multi_turn_reasoning_and_tool_results(oa, tok):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    sent = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "reasoning_content": "Need weather.",
             "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]
    r = oa.chat.completions.create(model=MODEL, messages=sent, tools=[WEATHER], max_tokens=1)
    want = [sent[0], {"role": "assistant", "content": "", "thinking": "Need weather.",
                      "tool_calls": [{"function": {"name": "get_weather",
                                                   "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "content": '{"temp": 21}'}]
    assert r.usage.prompt_tokens == n_prompt(tok, want, tools=[WEATHER])
    # the reasoning and the call are in that prompt: without them it is shorter
    assert n_prompt(tok, [sent[0], want[2]], tools=[WEATHER]) < r.usage.prompt_tokens


def test_ollama_think_levels(daemon, tok):
    ol = ollama.Client(host=daemon.url, timeout=300)
    for level in ("low", "high"):
        r = ol.chat(model=MODEL, messages=ASK, think=level, options={"num_predict": 1})
        assert r.prompt_eval_count == n_prompt(tok, ASK, reasoning_effort=level), level
    r = ol.chat(model=MODEL, messages=ASK, think=True, options={"num_predict": 1})
    assert r.prompt_eval_count == n_prompt(tok, ASK)
    with pytest.raises(ollama.ResponseError, match="cannot turn thinking off"):
        ol.chat(model=MODEL, messages=ASK, think=False, options={"num_predict": 1})
    with pytest.raises(ollama.ResponseError, match="does not support thinking"):
        ol.chat(model=PLAIN, messages=ASK, think="high", options={"num_predict": 1})
    assert "thinking" in ol.show(MODEL).capabilities
    # multi-turn: Ollama's `thinking` and tool_calls go back into the template
    hist = [ASK[0], {"role": "assistant", "content": "", "thinking": "Need weather.",
                     "tool_calls": [{"function": {"name": "get_weather",
                                                  "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "content": '{"temp": 21}', "tool_name": "get_weather"}]
    r = ol.chat(model=MODEL, messages=hist, tools=[WEATHER], options={"num_predict": 1})
    want = [ASK[0], {**hist[1], "tool_calls": [{"type": "function", **hist[1]["tool_calls"][0]}]},
            {"role": "tool", "content": '{"temp": 21}', "name": "get_weather"}]
    assert r.prompt_eval_count == n_prompt(tok, want, tools=[WEATHER])



def test_engine_output_with_harmony_tokens(tmp_path):
    from edgeinfer.engine import grammar as g
    from edgeinfer.engine.core import Engine, EngineConfig
    from edgeinfer.runners.sampling_params import SamplingParams
    from edgeinfer.server.harmony import engine_harmony, split_harmony
    from edgeinfer.server.tool_parse import Tool
    p = tmp_path / "h.gguf"
    write_tiny_gguf(p, "qwen3", SHAPE, random_f32_tensors(np.random.default_rng(0)),
                    file_type=0, extra_specials=SPECIALS, chat_template=TEMPLATE)
    e = Engine(str(p), EngineConfig(max_model_len=1024, kv_budget_bytes=32 << 20))
    try:
        tok = e.tokenizer
        assert engine_harmony(e)
        ids = {s: tok.token_to_id[s] for s in SPECIALS}
        assert {ids["<|return|>"], ids["<|call|>"]} <= set(tok.eot_ids)
        prompt = e.encode_chat(ASK)
        vocab = max(int(e.cfg.vocab_size), tok.vocab_size)
        tools = [Tool("get_weather", "", WEATHER["function"]["parameters"])]
        for lark, want in (
                ('start: <|channel|> "analysis" <|message|> "The sum is 4." <|end|> <|start|> '
                 '"assistant" <|channel|> "final" <|message|> "It is 4." <|return|>',
                 ("The sum is 4.", "It is 4.", [])),
                ('start: <|channel|> "analysis" <|message|> "Need weather." <|end|> <|start|> '
                 '"assistant" <|channel|> "commentary to=functions.get_weather " <|constrain|> '
                 '"json" <|message|> "{\\"city\\": \\"Paris\\"}" <|call|>',
                 ("Need weather.", "", [("get_weather", {"city": "Paris"})]))):
            c = g.grammars_for(tok, vocab).constraint(g.GrammarSpec("lark", lark))
            out = e.generate(prompt, SamplingParams(temperature=0, max_tokens=300), constraint=c)
            assert out.finish_reason == "stop"
            # the markup tokens were generated as tokens, and print; the end token does not
            for s in ("<|channel|>", "<|message|>", "<|start|>", "<|end|>"):
                assert ids[s] in out.token_ids
            assert "<|return|>" not in out.text and "<|call|>" not in out.text
            r, content, calls = split_harmony(out.text, tools)
            assert (r, content, [(x.name, x.arguments) for x in calls]) == want
    finally:
        e.shutdown()


# ----- Responses and Anthropic ------------------------------------------------------------

def test_responses_reasoning_item_and_message(oa):
    r = oa.responses.create(model=MODEL, input="What is 2+2?", max_output_tokens=300,
                            temperature=0, extra_body={"grammar": ANSWER})
    assert [it.type for it in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "The sum is 4."
    assert r.output_text == "It is 4."


def test_responses_streamed_call_then_continuation(oa, tok):
    types, reasoning, calls, done = [], "", [], None
    with oa.responses.stream(model=MODEL, input="Weather in Paris?", tools=[{
            "type": "function", **WEATHER["function"]}], max_output_tokens=300, temperature=0,
            extra_body={"grammar": CALL}) as s:
        for ev in s:
            types.append(ev.type)
            if ev.type == "response.reasoning_text.delta":
                reasoning += ev.delta
            if ev.type == "response.output_item.done" and ev.item.type == "function_call":
                calls.append((ev.item.name, json.loads(ev.item.arguments), ev.item.call_id))
            if ev.type == "response.completed":
                done = ev.response
    assert reasoning == "Need weather."
    assert [c[:2] for c in calls] == [("get_weather", {"city": "Paris"})]
    assert types.index("response.reasoning_text.done") < types.index(
        "response.function_call_arguments.done")
    assert [it.type for it in done.output] == ["reasoning", "function_call"]
    # the stored turn goes back with its reasoning as `thinking`, then the tool's result
    r = oa.responses.create(model=MODEL, previous_response_id=done.id, max_output_tokens=1,
                            tools=[{"type": "function", **WEATHER["function"]}],
                            input=[{"type": "function_call_output", "call_id": calls[0][2],
                                    "output": '{"temp": 21}'}])
    want = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "thinking": "Need weather.",
             "tool_calls": [{"function": {"name": "get_weather",
                                          "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "content": '{"temp": 21}', "name": "get_weather"}]
    assert r.usage.input_tokens == n_prompt(tok, want, tools=[WEATHER])


def test_responses_effort(oa, tok):
    r = oa.responses.create(model=MODEL, input="What is 2+2?", max_output_tokens=1,
                            reasoning={"effort": "low"})
    assert r.usage.input_tokens == n_prompt(tok, ASK, reasoning_effort="low")
    with pytest.raises(openai.BadRequestError, match="reasoning.effort"):
        oa.responses.create(model=PLAIN, input="Hi", max_output_tokens=1,
                            reasoning={"effort": "low"})


def test_anthropic_thinking_blocks_go_back(daemon, tok):
    import anthropic
    with anthropic.Anthropic(base_url=daemon.url, api_key="unused", max_retries=0) as c:
        hist = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "Need weather.", "signature": ""},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                     "input": {"city": "Paris"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                              "content": '{"temp": 21}'}]}]
        tools = [{"name": "get_weather", "description": "Weather in a city",
                  "input_schema": WEATHER["function"]["parameters"]}]
        n = c.messages.count_tokens(model=MODEL, messages=hist, tools=tools).input_tokens
    want = [hist[0], {"role": "assistant", "content": "", "thinking": "Need weather.",
                      "tool_calls": [{"function": {"name": "get_weather",
                                                   "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "content": '{"temp": 21}', "name": "get_weather"}]
    assert n == n_prompt(tok, want, tools=[WEATHER])


@pytest.mark.parametrize("text,blocks", [
    (ANSWER_TEXT := ("<|channel|>analysis<|message|>The sum is 4.<|end|><|start|>assistant"
                     "<|channel|>final<|message|>It is 4."),
     [{"type": "thinking", "thinking": "The sum is 4.", "signature": ""},
      {"type": "text", "text": "It is 4."}])])
def test_anthropic_stream_blocks(text, blocks):
    # the Anthropic stream's block builder over the chat splitter's deltas, piece by piece
    from edgeinfer.server.anthropic_api import _Blocks
    from edgeinfer.server.openai_api import _ChatOut
    out, b, events = _ChatOut([], "none", False, harmony=True), _Blocks(), []
    for i, ch in enumerate(text):
        events += b.feed(out.feed(ch, final=i == len(text) - 1))
    events += b.close()
    assert b.blocks == blocks
    kinds = [json.loads(e.decode().split("data: ", 1)[1])["type"] for e in events]
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 2


def test_ollama_out_streamed_pieces():
    # Ollama's API takes no GBNF, so its chunk builder is fed the text directly: the same
    # splitter gives `thinking`, content and tool_calls, whatever the chunking
    from edgeinfer.server.ollama_api import _Out
    from edgeinfer.server.tools import parse_tools
    text = ("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant to=functions."
            'get_weather<|channel|>commentary json<|message|>{"city": "Paris"}')
    for step in (1, 3, 7, len(text)):
        o, th, tx, calls = _Out(parse_tools([WEATHER]), True, harmony=True), "", "", []
        for i in range(0, len(text), step):
            a, b, c = o.feed(text[i:i + step], final=i + step >= len(text), reason="stop")
            th, tx, calls = th + a, tx + b, calls + c
        assert (th, tx) == ("Need weather.", "")
        assert [c.ollama() for c in calls] == [
            {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]


CITY = {"type": "function", "function": {
    "name": "pick_city", "description": "",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                   "required": ["city"]}}}


@pytest.mark.parametrize("tool_choice", ["required",
                                         {"type": "function", "function": {"name": "pick_city"}}])
def test_forced_tool_choice_is_a_harmony_call(oa, tool_choice):
    # required / named: a grammar over Harmony's own call header (not another model's
    # envelope), reasoning first optional. The random model fills it in, so each sampled
    # answer is one of the grammar's two shapes: a valid call, or reasoning cut by the
    # length limit (random weights never close the analysis channel; this model, its markup
    # spelled in characters, always opens it: the call itself is test_forced_call_in_process's)
    for seed in range(3):
        r = oa.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, CITY],
                                       tool_choice=tool_choice, max_tokens=120, seed=seed,
                                       temperature=1.0)
        ch = r.choices[0]
        if ch.finish_reason == "length":
            assert not ch.message.content and not ch.message.tool_calls
            assert ch.message.model_extra["reasoning_content"]
            continue
        assert ch.finish_reason == "tool_calls", ch.message
        (c,) = ch.message.tool_calls
        args = json.loads(c.function.arguments)
        assert c.function.name == "pick_city" or tool_choice == "required"
        assert args in ({"city": "Paris"}, {"city": "Rome"}) if c.function.name == "pick_city" \
            else isinstance(args["city"], str)


def test_forced_call_in_process(tmp_path):
    # the whole Harmony vocabulary: the forced-call grammar over the real special tokens
    from edgeinfer.engine import grammar as g
    from edgeinfer.engine.core import Engine, EngineConfig
    from edgeinfer.runners.sampling_params import SamplingParams
    from edgeinfer.server import harmony as hm, tools as tl
    p = tmp_path / "h.gguf"
    write_tiny_gguf(p, "qwen3", SHAPE, random_f32_tensors(np.random.default_rng(0)),
                    file_type=0, extra_specials=SPECIALS, chat_template=TEMPLATE)
    e = Engine(str(p), EngineConfig(max_model_len=1024, kv_budget_bytes=32 << 20))
    try:
        tok = e.tokenizer
        tools = tl.parse_tools([WEATHER, CITY])
        spec = hm.call_grammar(tools, tl.Choice("named", "pick_city"), tok.token_to_id)
        assert 'call: <|channel|> "commentary to=functions."' in spec.source
        c = g.grammars_for(tok, max(int(e.cfg.vocab_size), tok.vocab_size)).constraint(spec)
        out = e.generate(e.encode_chat(ASK, tools=[WEATHER, CITY]),
                         SamplingParams(temperature=0, max_tokens=200), constraint=c)
        assert out.finish_reason == "stop", out.text
        assert tok.token_to_id["<|constrain|>"] in out.token_ids
        r, content, calls = hm.split_harmony(out.text, tools)
        assert content == ""
        assert [(x.name, x.arguments["city"] in ("Paris", "Rome")) for x in calls] == \
            [("pick_city", True)]
    finally:
        e.shutdown()


FLAG = {"type": "function", "function": {
    "name": "set_flag", "description": "",
    "parameters": {"type": "object", "properties": {"on": {"type": "boolean"}},
                   "required": ["on"]}}}
ODD = {"type": "function", "function": {      # a valid schema llguidance cannot compile
    "name": "odd", "description": "",
    "parameters": {"type": "object", "properties": {"a": {"type": "string",
                                                          "format": "no-such-format"}}}}}


def test_auto_mode_is_constrained(oa, daemon):
    # tool_choice auto on a model with Harmony's markup tokens: the auto grammar (see
    # test_harmony_auto.py) is compiled for the request, so a schema it cannot compile is a
    # 400 naming tools, on every API; on the model whose markup is text there is no grammar
    import anthropic
    for tc in (None, "auto"):
        kw = {} if tc is None else {"tool_choice": tc}
        with pytest.raises(openai.BadRequestError, match="no-such-format") as e:
            oa.chat.completions.create(model=TOKENS, messages=ASK, tools=[CITY, ODD],
                                       max_tokens=1, **kw)
        assert e.value.body["param"] == "tools"
    r = oa.chat.completions.create(model=MODEL, messages=ASK, tools=[ODD], max_tokens=1)
    assert r.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="no-such-format"):
        oa.responses.create(model=TOKENS, input="Hi", max_output_tokens=1,
                            tools=[{"type": "function", **ODD["function"]}])
    # (raw: the ollama client's tool model drops `format`)
    r = httpx.post(daemon.url + "/api/chat", timeout=300, json={
        "model": TOKENS, "messages": ASK, "tools": [ODD], "stream": False,
        "options": {"num_predict": 1}})
    assert r.status_code == 400 and "no-such-format" in r.text
    with anthropic.Anthropic(base_url=daemon.url, api_key="unused", max_retries=0) as c, \
            pytest.raises(anthropic.BadRequestError, match="no-such-format"):
        c.messages.create(model=TOKENS, max_tokens=1, messages=ASK, tools=[{
            "name": "odd", "input_schema": ODD["function"]["parameters"]}])
    # a compilable request runs: whatever the random model writes is an answer or a valid
    # call of a declared tool
    for seed in range(2):
        r = oa.chat.completions.create(model=TOKENS, messages=ASK, tools=[CITY, FLAG],
                                       max_tokens=40, seed=seed, temperature=1.0)
        ch = r.choices[0]
        assert ch.finish_reason in ("stop", "length", "tool_calls"), ch
        for c in ch.message.tool_calls or []:
            assert c.function.name in ("pick_city", "set_flag")

