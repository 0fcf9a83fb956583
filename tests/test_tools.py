"""edgeinfer.server.tools without a daemon: tool validation, the built-in fallback prompt,
real tool-use chat templates (llama.cpp's models/templates) rendering tools, calls and
results, parsing each family's call format, the streaming splitter and the <think> split."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from edgeinfer.formats.chat_template import builtin_template, render_chat
from edgeinfer.server import tools as T
from edgeinfer.server.errors import APIError

REPO = Path(__file__).resolve().parent.parent
TEMPLATES = Path(os.environ.get("EDGEINFER_TEST_DATA", REPO / ".cache" / "llama-vocab")) / "templates"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TOOLS = T.parse_tools([WEATHER])
CONV = [{"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather",
                                      "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather",
         "content": "21 degrees and sunny"}]


def real(name: str) -> str:
    p = TEMPLATES / f"{name}.jinja"
    if not p.exists():
        pytest.skip(f"real chat templates missing in {TEMPLATES}: run tests/data/fetch_llama_vocab.sh")
    return p.read_text("utf-8")


# ----- validation --------------------------------------------------------------------------

@pytest.mark.parametrize("raw,param", [
    ([{"type": "retrieval"}], "tools[0].type"),
    ([{"type": "function"}], "tools[0].function"),
    ([{"type": "function", "function": {"name": "bad name!"}}], "tools[0].function.name"),
    ([WEATHER, WEATHER], "tools[1].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "objct"}}}],
     "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "strin"}}}}}],
     "tools[0].function.parameters"),
])
def test_bad_tools_name_the_field(raw, param):
    with pytest.raises(APIError) as e:
        T.parse_tools(raw)
    assert e.value.status == 400 and e.value.param == param


def test_tool_choice():
    assert T.parse_tool_choice(None, TOOLS).mode == "auto"
    assert T.parse_tool_choice(None, []).mode == "none"
    c = T.parse_tool_choice({"type": "function", "function": {"name": "get_weather"}}, TOOLS)
    assert (c.mode, c.name) == ("named", "get_weather")
    for bad in ("sometimes", {"type": "function", "function": {"name": "nope"}}, 3):
        with pytest.raises(APIError):
            T.parse_tool_choice(bad, TOOLS)
    with pytest.raises(APIError):
        T.parse_tool_choice("required", [])


# ----- prompts -----------------------------------------------------------------------------

def test_fallback_prompt_for_a_template_without_tools():
    tmpl = builtin_template("gemma")
    assert not T.template_supports_tools(tmpl)
    msgs, extra = T.prepare_chat(CONV, TOOLS, T.Choice("required"), False, tmpl)
    assert extra == {}
    text = render_chat(tmpl, msgs)
    assert '"name": "get_weather"' in text and "You must call a function now." in text
    # the earlier call in our envelope, the result as a user turn naming the function
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' \
        in text
    assert "Result of get_weather: 21 degrees and sunny" in text
    assert text.endswith("<start_of_turn>model\n")


def test_tool_choice_none_leaves_tools_out():
    tmpl = builtin_template("gemma")
    msgs, _ = T.prepare_chat(CONV[:1], TOOLS, T.Choice("none"), True, tmpl)
    assert "get_weather" not in render_chat(tmpl, msgs)


FAMILIES = [
    # template, what the rendered prompt shows for the earlier call, a model's call
    ("Qwen-Qwen2.5-7B-Instruct", '"name": "get_weather"',
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'),
    ("Qwen-Qwen3-0.6B", '"name": "get_weather"',
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'),
    ("NousResearch-Hermes-3-Llama-3.1-8B-tool_use", "get_weather",
     '<tool_call>\n{"arguments": {"city": "Rome"}, "name": "get_weather"}\n</tool_call>'),
    ("meta-llama-Llama-3.1-8B-Instruct", "get_weather",
     '{"name": "get_weather", "parameters": {"city": "Rome"}}'),
    ("meta-llama-Llama-3.2-3B-Instruct", "get_weather",
     '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}'),
    ("mistralai-Mistral-Nemo-Instruct-2407", "get_weather",
     '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}, "id": "abcdefghi"}]'),
]


@pytest.mark.parametrize("name,shown,output", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_real_tool_templates_round_trip(name, shown, output):
    tmpl = real(name)
    assert T.template_supports_tools(tmpl)
    conv = CONV
    if "Mistral" in name:      # Mistral's template wants 9-character call ids
        conv = json.loads(json.dumps(CONV).replace("call_1", "abcdefghi"))
    msgs, extra = T.prepare_chat(conv, TOOLS, T.Choice("auto"), True, tmpl)
    assert extra["tools"][0]["function"]["name"] == "get_weather"
    text = render_chat(tmpl, msgs, bos_token="<s>", eos_token="</s>", **extra)
    assert "Weather in a city" in text            # the tool's description reached the prompt
    assert shown in text.split("Weather in Paris?", 1)[1]    # the earlier call, after the question
    assert "21 degrees and sunny" in text
    content, calls = T.parse_calls(output, TOOLS)
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Rome"})]
    assert content == ""


# ----- parsing -----------------------------------------------------------------------------

def test_parse_keeps_text_and_ignores_unknown_tools():
    text, calls = T.parse_calls('Let me check.\n<tool_call>\n{"name": "get_weather", '
                                '"arguments": {"city": "Oslo"}}\n</tool_call>', TOOLS)
    assert text == "Let me check." and calls[0].arguments == {"city": "Oslo"}
    text, calls = T.parse_calls('<tool_call>{"name": "launch", "arguments": {}}</tool_call>',
                                TOOLS)
    assert calls == [] and "launch" in text
    assert T.parse_calls('{"a": 1}', TOOLS) == ('{"a": 1}', [])     # plain JSON is content
    assert T.parse_calls("just words", TOOLS) == ("just words", [])


def test_openai_and_ollama_shapes():
    c = T.ToolCall("get_weather", {"city": "Oslo"})
    o = c.openai(0)
    assert o["index"] == 0 and o["id"].startswith("call_")
    assert json.loads(o["function"]["arguments"]) == {"city": "Oslo"}
    assert c.ollama() == {"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}


def test_stream_splitter_holds_back_tags():
    s = T.StreamSplitter(TOOLS)
    out = []
    for piece in ["Sure", " <", "tool_", "call>\n{\"name\": \"get_weather\", ",
                  "\"arguments\": {\"city\": \"Oslo\"}}\n</tool", "_call>", " done"]:
        out += s.feed(piece)
    out += s.flush()
    texts = "".join(v for k, v in out if k == "text")
    assert "<" not in texts and texts == "Sure  done"
    assert [v.name for k, v in out if k == "call"] == ["get_weather"]


def test_stream_splitter_passes_a_lone_angle_bracket():
    s = T.StreamSplitter(TOOLS)
    out = s.feed("a < b") + s.feed(" and c") + s.flush()
    assert "".join(v for _, v in out) == "a < b and c"


def test_call_grammar_forces_the_named_tool():
    add = {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}}}}
    tools = T.parse_tools([WEATHER, add])
    g = T.call_grammar(tools, T.Choice("named", "add"), parallel=False)
    assert g.kind == "lark" and '"const": "add"' in g.source and "get_weather" not in g.source
    g = T.call_grammar(tools, T.Choice("required"), parallel=True)
    assert "get_weather" in g.source and '("\\n" call)*' in g.source


# ----- reasoning ---------------------------------------------------------------------------

def test_think_split():
    assert T.split_thinking("<think>a plan</think>\n\nThe answer.") == ("a plan", "The answer.")
    assert T.split_thinking("No thinking here.") == ("", "No thinking here.")
    assert T.split_thinking("still thinking</think>done", started=True) == \
        ("still thinking", "done")
    s = T.ThinkSplitter()
    parts = [s.feed(p) for p in ["<thi", "nk>x y", "</th", "ink>", "\n", "\nz"]] + [s.flush()]
    assert "".join(r for r, _ in parts) == "x y" and "".join(c for _, c in parts) == "z"


def test_can_think():
    class E:
        chat_template = "{{ '<think>' }}"
        tokenizer = None
    assert T.can_think(E())
    E.chat_template = builtin_template("gemma")
    assert not T.can_think(E())


# ----- the auto grammar (text, or text then valid calls) -------------------------------------

@pytest.fixture(scope="module")
def tok(gemma3_path):
    from edgeinfer.formats.gguf_file import read_gguf
    from edgeinfer.formats.tokenizer import Tokenizer
    f = read_gguf(gemma3_path)
    try:
        return Tokenizer.from_gguf(f.metadata)
    finally:
        f.close()


def _feed(tok, c, text) -> bool:
    for t in tok.encode(text, add_special=False, parse_special=False):
        if not c.allowed_tokens()[t]:
            return False
        c.accept(t)
    return True


def test_auto_grammar_allows_text_or_valid_calls(tok):
    pytest.importorskip("llguidance")
    from edgeinfer.engine import grammar as g
    spec = T.call_grammar(TOOLS, T.Choice("auto"), parallel=True)
    eos = min(tok.eot_ids)

    def fresh():
        return g.GrammarConstraint.for_spec(tok, tok.vocab_size, spec)
    c = fresh()
    assert _feed(tok, c, "It is sunny in Paris, I think. a < b.")
    assert c.allowed_tokens()[eos]                    # plain text may end anywhere
    c = fresh()
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert _feed(tok, c, "Let me look. " + call)
    assert c.allowed_tokens()[eos]
    c = fresh()                                       # after the trigger: only a valid call
    assert _feed(tok, c, 'Ok <tool_call>\n{"name": "')
    assert not c.allowed_tokens()[tok.encode("launch", add_special=False)[0]]
    assert not c.allowed_tokens()[eos]


def test_auto_grammar_fits_only_envelope_families():
    assert T.auto_grammar_fits(builtin_template("gemma"))
    assert T.auto_grammar_fits("{% if tools %}<tool_call>{% endif %}")
    assert not T.auto_grammar_fits("{% if tools %}[TOOL_CALLS]{% endif %}")
