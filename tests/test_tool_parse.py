"""edgeinfer.server.tool_parse: tool calls in every shape models write, whole and streamed.

Each shape is read from a finished reply (`parse_calls`) and from a stream cut at every
character and in random pieces (`StreamSplitter`); the two must agree, and no tag or fence
of a call may reach the text. A call must name a declared tool and pass its schema."""
from __future__ import annotations

import random

import pytest

from edgeinfer.server import tools as T
from edgeinfer.server.errors import APIError
from edgeinfer.server.tool_parse import StreamSplitter, parse_calls

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
TOOLS = T.parse_tools([WEATHER, ADD])
TOKYO = ("get_weather", {"city": "Tokyo"})
SUM = ("add", {"a": 17, "b": 25})

# (reply, content, calls)
SHAPES = {
    "bare": ('{"name": "get_weather", "arguments": {"city": "Tokyo"}}', "", [TOKYO]),
    "bare-parameters": ('{"name": "get_weather", "parameters": {"city": "Tokyo"}}', "",
                        [TOKYO]),
    "bare-wrapped": ('{"type": "function", "function": {"name": "get_weather", '
                     '"arguments": "{\\"city\\": \\"Tokyo\\"}"}}', "", [TOKYO]),
    "bare-array": ('[{"name": "get_weather", "arguments": {"city": "Tokyo"}}, '
                   '{"name": "add", "arguments": {"a": 17, "b": 25}}]', "", [TOKYO, SUM]),
    "fence-json": ('```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": '
                   '"Tokyo"\n  }\n}\n```', "", [TOKYO]),
    "fence-plain": ('```\n{"name": "add", "arguments": {"a": 17, "b": 25}}\n```', "", [SUM]),
    "fence-array": ('```json\n[{"name": "get_weather", "arguments": {"city": "Tokyo"}},\n'
                    ' {"name": "add", "arguments": {"a": 17, "b": 25}}]\n```', "",
                    [TOKYO, SUM]),
    "text-then-fence": ("I'll look that up.\n```json\n{\"name\": \"get_weather\", "
                        "\"arguments\": {\"city\": \"Tokyo\"}}\n```\n",
                        "I'll look that up.", [TOKYO]),
    "text-then-bare": ('Checking the weather:\n{"name": "get_weather", "arguments": '
                       '{"city": "Tokyo"}}', "Checking the weather:", [TOKYO]),
    "bare-then-text": ('{"name": "get_weather", "arguments": {"city": "Tokyo"}}\n'
                       'That fetches it.', "That fetches it.", [TOKYO]),
    "tags": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tokyo"}}\n'
             '</tool_call>', "", [TOKYO]),
    "tags-two": ('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tokyo"}}'
                 '\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 17, "b": 25}}'
                 '\n</tool_call>', "Sure.", [TOKYO, SUM]),
    "tags-fenced-inside": ('<tool_call>\n```json\n{"name": "add", "arguments": '
                           '{"a": 17, "b": 25}}\n```\n</tool_call>', "", [SUM]),
    "mistral": ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Tokyo"}, '
                '"id": "abcdefghi"}, {"name": "add", "arguments": {"a": 17, "b": 25}, '
                '"id": "bcdefghij"}]', "", [TOKYO, SUM]),
    "mistral-v11": ('[TOOL_CALLS]get_weather[ARGS]{"city": "Tokyo"}', "", [TOKYO]),
    "llama3-python-tag": ('<|python_tag|>{"name": "get_weather", "parameters": '
                          '{"city": "Tokyo"}}; {"name": "add", "parameters": {"a": 17, "b": 25}}',
                          "", [TOKYO, SUM]),
    "llama3-builtin": ('<|python_tag|>get_weather.call(city="Tokyo")', "", [TOKYO]),
}

# replies that must stay text, untouched
TEXT = {
    "undeclared-tool": '{"name": "launch_rocket", "arguments": {}}',
    "schema-missing-required": '{"name": "get_weather", "arguments": {"town": "Tokyo"}}',
    "schema-wrong-type": '```json\n{"name": "add", "arguments": {"a": "17", "b": 25}}\n```',
    "array-with-a-bad-call": ('[{"name": "get_weather", "arguments": {"city": "Tokyo"}}, '
                              '{"name": "launch_rocket", "arguments": {}}]'),
    "tag-undeclared": '<tool_call>\n{"name": "launch_rocket", "arguments": {}}\n</tool_call>',
    "plain-json": '{"city": "Tokyo", "temperature": 21}',
    "json-fence-not-a-call": 'Here:\n```json\n{"city": "Tokyo"}\n```\nDone.',
    "python-fence": 'Code:\n```python\nx = {"name": "get_weather", "arguments": {}}\n```\nok',
    "inline-json": 'Write {"name": "get_weather", "arguments": {"city": "Tokyo"}} to call it.',
    "markdown-link": "[the docs](https://example.com) say a < b and [x] too.",
    "tag-in-prose": "The <tool_call> tag wraps calls.",
    "python-tag-code": "<|python_tag|>import os; print(os.getcwd())",
    "prose": "It is sunny in Tokyo today.\n\n- a list\n- of things",
}


def stream(text: str, cuts: list[int], truncated: bool = False):
    s = StreamSplitter(TOOLS)
    ev, last = [], 0
    for c in cuts + [len(text)]:
        ev += s.feed(text[last:c])
        last = c
    ev += s.flush(truncated)
    return ev


def summary(ev) -> tuple[str, list]:
    calls = [(v.name, v.arguments) for k, v in ev if k == "call"]
    text = "".join(v for k, v in ev if k == "text")
    return (text.strip() if calls else text), calls


def every_cut(text: str):
    yield list(range(1, len(text)))                    # a character at a time
    rng = random.Random(len(text))
    for _ in range(3):                                 # random token-sized pieces
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, len(text) // 4)))
        yield cuts


@pytest.mark.parametrize("name", SHAPES)
def test_each_shape_whole_and_streamed(name):
    reply, content, calls = SHAPES[name]
    text, got = parse_calls(reply, TOOLS)
    assert [(c.name, c.arguments) for c in got] == calls
    assert text == content
    for cuts in every_cut(reply):
        ev = stream(reply, cuts)
        assert summary(ev) == (content, calls), cuts
        streamed = "".join(v for k, v in ev if k == "text")
        for markup in ("<tool_call>", "</tool_call>", "```", "[TOOL_CALLS]", "<|python_tag|>",
                       '"name"'):
            assert markup not in streamed


@pytest.mark.parametrize("name", TEXT)
def test_what_is_not_a_call_stays_text(name):
    reply = TEXT[name]
    assert parse_calls(reply, TOOLS) == (reply, [])
    for cuts in every_cut(reply):
        assert summary(stream(reply, cuts)) == (reply, [])


def test_no_tools_no_calls():
    reply = SHAPES["bare"][0]
    assert parse_calls(reply, []) == (reply, [])


# ----- truncated at max_tokens ---------------------------------------------------------------

CUT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tok'


@pytest.mark.parametrize("reply", [
    CUT,
    '```json\n{"name": "get_weather", "arguments": {"city": "Tok',
    '{"name": "get_weather", "arguments": {"city": "Tok',
    '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Tok',
])
def test_a_truncated_call_is_text(reply):
    assert parse_calls(reply, TOOLS, truncated=True) == (reply, [])
    assert parse_calls(reply, TOOLS) == (reply, [])


def test_a_complete_but_unclosed_call_counts_only_when_not_cut():
    # the model stopped (end of turn) after the JSON without writing </tool_call> or ```
    for reply in ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tokyo"}}',
                  '```json\n{"name": "get_weather", "arguments": {"city": "Tokyo"}}\n'):
        assert summary(stream(reply, [])) == ("", [TOKYO])
        # cut by max_tokens: the closing markup might have been followed by more
        assert summary(stream(reply, [], truncated=True)) == (reply, [])


def test_a_second_call_cut_short_is_dropped():
    reply = SHAPES["tags"][0] + "\n" + CUT
    for cuts in every_cut(reply):
        assert summary(stream(reply, cuts, truncated=True)) == ("", [TOKYO])


# ----- streaming behaviour -----------------------------------------------------------------

def test_text_streams_before_a_call_and_code_is_not_held():
    s = StreamSplitter(TOOLS)

    def text(piece: str) -> str:
        ev = s.feed(piece)
        assert all(k == "text" for k, _ in ev)
        return "".join(v for _, v in ev)
    assert text("Let me check") == "Let me check"
    assert text(".\n```js") == ".\n"                       # a fence could open a call
    assert text("on\n") == ""
    assert text("{") == ""
    assert text('"city"') == '```json\n{"city"'            # not a call's first key: released
    s = StreamSplitter(TOOLS)
    assert text("```python\nprint(1)\n") == "```python\nprint(1)\n"
    # inside a code block a line opening with '{' is code, not a call
    assert text('{"name": "get_weather"') == '{"name": "get_weather"'
    assert text("\n```\n") == "\n```\n"                   # the block closes
    assert text('{"name"') == ""                              # and calls are watched again


def test_stream_splitter_holds_back_tags():
    s = StreamSplitter(TOOLS)
    out = []
    for piece in ["Sure", " <", "tool_", "call>\n{\"name\": \"get_weather\", ",
                  "\"arguments\": {\"city\": \"Oslo\"}}\n</tool", "_call>", " done"]:
        out += s.feed(piece)
    out += s.flush()
    assert "".join(v for k, v in out if k == "text") == "Sure  done"
    assert [v.name for k, v in out if k == "call"] == ["get_weather"]


def test_calls_stream_as_soon_as_they_close():
    s = StreamSplitter(TOOLS)
    first, second = SHAPES["tags-two"][0].split("<tool_call>", 2)[1:]
    ev = s.feed("Sure.\n<tool_call>" + first)
    assert [k for k, _ in ev] == ["text", "call"]
    ev = s.feed("<tool_call>" + second)
    assert [(v.name, v.arguments) for k, v in ev if k == "call"] == [SUM]


# ----- tools and schemas -------------------------------------------------------------------

def test_a_tool_whose_schema_jsonschema_rejects_is_a_400():
    bad = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "minLength": "three"}}}}}
    with pytest.raises(APIError) as e:
        T.parse_tools([bad])
    assert e.value.status == 400 and e.value.param == "tools[0].function.parameters"


def test_schema_validation_uses_the_declared_schema():
    enum = {"type": "function", "function": {"name": "unit", "parameters": {
        "type": "object", "properties": {"u": {"enum": ["C", "F"]}}, "required": ["u"]}}}
    tools = T.parse_tools([enum])
    assert parse_calls('{"name": "unit", "arguments": {"u": "C"}}', tools)[1]
    assert not parse_calls('{"name": "unit", "arguments": {"u": "K"}}', tools)[1]


def test_hostile_output_and_schemas_stay_text_without_an_error():
    deep = '{"name": "get_weather", "arguments": {"city": "x", "n": ' + "[" * 100_000 + \
        "]" * 100_000 + "}}"
    assert parse_calls(deep, TOOLS) == (deep, [])
    assert summary(stream("<|python_tag|>get_weather.call(city=" + "(" * 50_000, [])) == \
        ("<|python_tag|>get_weather.call(city=" + "(" * 50_000, [])
    # a catastrophic pattern on the model's text is cut off, not run for minutes
    evil = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"s": {"type": "string", "pattern": "^(a+)+$"}},
        "patternProperties": {"^(b+)+$": {"type": "string"}}}}}
    tools = T.parse_tools([evil])
    reply = '{"name": "f", "arguments": {"s": "' + "a" * 40 + '!"}}'
    assert parse_calls(reply, tools) == (reply, [])
    assert parse_calls('{"name": "f", "arguments": {"s": "aaa"}}', tools)[1]
    assert not parse_calls('{"name": "f", "arguments": {"s": "aaa", "bbb": 1}}', tools)[1]
