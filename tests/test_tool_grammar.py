"""The lazy auto-mode tool grammar (edgeinfer.server.tool_grammar) on a real chat vocabulary,
Qwen2.5-Coder's (151k tokens, `<tool_call>` one added token): free text is untouched; from a
trigger on (`<tool_call>` anywhere; a bare, array or fenced `{"name": "` at the start of the
reply) only a valid call of a declared tool is allowed, after which the turn can end."""
from __future__ import annotations

import pytest

from edgeinfer.server import tools as T

pytest.importorskip("llguidance")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
TOOLS = T.parse_tools([WEATHER, ADD])
CALL = '{"name": "get_weather", "arguments": {"city": "Tokyo"}}'
CALL2 = '{"name": "add", "arguments": {"a": 17, "b": 25}}'


@pytest.fixture(scope="module")
def tok(qwen_coder_path):
    from edgeinfer.formats.gguf_file import read_gguf
    from edgeinfer.formats.tokenizer import Tokenizer
    f = read_gguf(qwen_coder_path)
    try:
        return Tokenizer.from_gguf(f.metadata)
    finally:
        f.close()


def matcher(tok, parallel: bool = True):
    from edgeinfer.engine import grammar as g
    spec = T.call_grammar(TOOLS, T.Choice("auto"), parallel)
    return g.GrammarConstraint.for_spec(tok, tok.vocab_size, spec)


def run(tok, text: str, parallel: bool = True):
    """(matcher, None) if every token of text is allowed, else (matcher, the refused text)."""
    c = matcher(tok, parallel)
    ids = tok.encode(text, add_special=False, parse_special=False)
    for k, t in enumerate(ids):
        if not c.allowed_tokens()[t]:
            return c, tok.decode(ids[k:])
        c.accept(t)
    return c, None


def eos_ok(tok, c) -> bool:
    return bool(c.allowed_tokens()[min(tok.eot_ids)])


@pytest.mark.parametrize("text", [
    "It is sunny in Tokyo. a < b, and [links](x) too.",
    'Write {"name": "get_weather"} in the middle of a sentence: not a call.',
    '{"city": "Tokyo", "note": "plain JSON is text"}',
    "```python\nprint({'name': 1})\n```",
    "Here:\n" + CALL,                     # a bare call after text is not a trigger
    '{"name": "Alice", "age": 7}',        # opens like a call, but names no declared tool
    '{"name": "launch_rocket", "arguments": {}}',     # the same: text (then parsed as text)
    '```json\n[{"name": "add_user", "id": 1}]\n```',     # a prefix of `add`, then more
])
def test_free_text_is_untouched_and_can_end_anywhere(tok, text):
    c, refused = run(tok, text)
    assert refused is None and eos_ok(tok, c)


@pytest.mark.parametrize("text", [
    CALL,
    "  \n" + CALL,
    '{"name": "get_weather", "parameters": {"city": "Tokyo"}}',           # Llama 3's key
    '{\n  "name": "get_weather",\n  "arguments": {"city": "Tokyo"}\n}',
    "```json\n" + CALL + "\n```",
    "```\n" + CALL + "\n```",
    "[" + CALL + ", " + CALL2 + "]",
    "```json\n[" + CALL + ",\n " + CALL2 + "]\n```",
    "<tool_call>\n" + CALL + "\n</tool_call>",
    "Let me check. <tool_call>\n" + CALL + "\n</tool_call>\n<tool_call>\n" + CALL2
    + "\n</tool_call>",
])
def test_calls_in_each_shape_are_allowed_and_then_the_turn_ends(tok, text):
    c, refused = run(tok, text)
    assert refused is None
    assert eos_ok(tok, c)
    c, refused = run(tok, text + " And some chat after the call.")
    assert refused is not None                      # after a call: only the end of the turn


def test_qwen_writes_tool_call_as_one_token_and_the_grammar_allows_it(tok):
    ids = tok.encode("<tool_call>", add_special=False, parse_special=False)
    assert len(ids) == 1
    c, refused = run(tok, "<tool_call>")
    assert refused is None and not eos_ok(tok, c)   # a call started: it must be finished


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "launch_rocket"',                     # undeclared tool
    '```json\n{"name": "get_weather", "arguments": {"town": "x"}}',   # unknown argument
    '[{"name": "add", "arguments": {"a": "17"',                   # wrong type
    '<tool_call>\n{"name": "get_weather", "arguments": {}}',      # a required key missing
    '<tool_call>\nI will call it',                                # prose after the trigger
])
def test_after_a_trigger_only_a_valid_call(tok, text):
    _, refused = run(tok, text)
    assert refused is not None


def test_one_call_when_parallel_calls_are_off(tok):
    assert run(tok, "[" + CALL + "]", parallel=False)[1] is None
    assert run(tok, "[" + CALL + ", " + CALL2 + "]", parallel=False)[1] is not None
    two = "<tool_call>\n" + CALL + "\n</tool_call>\n<tool_call>\n" + CALL2 + "\n</tool_call>"
    assert run(tok, two, parallel=False)[1] is not None
