"""HarmonySplitter (edgeinfer/server/harmony.py) on whole and streamed Harmony output: every
way of cutting the stream into pieces must give the same reasoning / content / calls."""
from __future__ import annotations

import random

import pytest

from edgeinfer.server.harmony import HarmonySplitter, is_harmony, split_harmony, uses_effort
from edgeinfer.server.tool_parse import Tool

WEATHER = Tool("get_weather", "", {"type": "object", "properties": {"city": {"type": "string"}},
                                   "required": ["city"]})
TOOLS = [WEATHER]

ANSWER = ("<|channel|>analysis<|message|>The user asks 2+2. That is 4.<|end|>"
          "<|start|>assistant<|channel|>final<|message|>It is 4.")
CALL = ("<|channel|>analysis<|message|>Need the weather.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Paris"}')


def streamed(text: str, cuts: list[int], tools=TOOLS, truncated=False):
    s = HarmonySplitter(tools)
    ev, prev = [], 0
    for c in sorted(cuts) + [len(text)]:
        ev += s.feed(text[prev:c])
        prev = c
    ev += s.flush(truncated)
    r = "".join(v for k, v in ev if k == "reasoning")
    t = "".join(v for k, v in ev if k == "text")
    return r, t, [(c.name, c.arguments) for k, c in ev if k == "call"]


def whole(text, tools=TOOLS, truncated=False):
    r, c, calls = split_harmony(text, tools, truncated)
    return r, c, [(x.name, x.arguments) for x in calls]


def test_reasoning_then_final():
    assert whole(ANSWER) == ("The user asks 2+2. That is 4.", "It is 4.", [])


def test_every_single_cut_and_char_by_char_agree():
    for text in (ANSWER, CALL):
        want = whole(text)
        for i in range(len(text) + 1):            # tags split mid-way, everywhere
            assert streamed(text, [i]) == want, i
        assert streamed(text, list(range(len(text)))) == want


def test_random_multi_cuts():
    rng = random.Random(0)
    text = ANSWER + "<|end|>" + CALL
    want = whole(text)
    for _ in range(200):
        cuts = rng.sample(range(len(text)), rng.randint(1, 12))
        assert streamed(text, cuts) == want


def test_tool_call_after_reasoning():
    assert whole(CALL) == ("Need the weather.", "", [("get_weather", {"city": "Paris"})])


def test_recipient_before_channel():
    text = ('<|start|>assistant to=functions.get_weather<|channel|>commentary json'
            '<|message|>{"city": "Rome"}')
    assert whole(text) == ("", "", [("get_weather", {"city": "Rome"})])


def test_recipient_right_after_the_prompt():
    # the prompt ends in <|start|>assistant: gpt-oss's template writes calls this way
    text = ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}'
    assert whole(text) == ("", "", [("get_weather", {"city": "Oslo"})])
    for i in range(len(text) + 1):
        assert streamed(text, [i]) == whole(text)
    assert whole("to=be or not") == ("", "to=be or not", [])
    assert whole("tomorrow") == ("", "tomorrow", [])


def test_several_segments_and_preamble():
    text = ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>commentary"
            "<|message|>Checking now.<|end|><|start|>assistant<|channel|>analysis<|message|>b"
            "<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>"
            'json<|message|>{"city": "A"}<|end|><|start|>assistant<|channel|>commentary '
            'to=functions.get_weather <|constrain|>json<|message|>{"city": "B"}')
    r, c, calls = whole(text)
    assert (r, c) == ("ab", "Checking now.")
    assert calls == [("get_weather", {"city": "A"}), ("get_weather", {"city": "B"})]


def test_missing_final_channel():
    # cut off while reasoning: all of it is reasoning, no content invented
    assert whole("<|channel|>analysis<|message|>thinking and thinking") == \
        ("thinking and thinking", "", [])
    assert whole("<|channel|>analysis<|message|>done<|end|>") == ("done", "", [])


def test_plain_text_without_header_is_content():
    assert whole("Just text, <|no tags|>.") == ("", "Just text, <|no tags|>.", [])
    assert whole("") == ("", "", [])


@pytest.mark.parametrize("args", ['{"city": ', "not json", '["Paris"]', '{"town": "x"}'])
def test_bad_arguments_come_out_as_text(args):
    text = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>" + args
    assert whole(text) == ("", args, [])
    assert streamed(text, list(range(len(text)))) == ("", args, [])


def test_undeclared_tool_and_tools_off():
    text = '<|channel|>commentary to=functions.launch <|constrain|>json<|message|>{"x": 1}'
    assert whole(text) == ("", '{"x": 1}', [])
    call = '<|channel|>commentary to=functions.get_weather<|message|>{"city": "P"}'
    s = HarmonySplitter(TOOLS, calls_on=False)
    ev = s.feed(call) + s.flush()
    assert ev == [("text", '{"city": "P"}')]


def test_truncated_call_is_text():
    text = '<|channel|>commentary to=functions.get_weather<|message|>{"city": "Par'
    assert whole(text, truncated=True) == ("", '{"city": "Par', [])
    assert whole(text.replace("Par", 'Paris"}'), truncated=True)[2] == []


def test_unfinished_header_shows_nothing():
    assert whole("<|channel|>analysis<|message|>r<|end|><|start|>assistant<|chan") == \
        ("r", "", [])


def test_detection():
    assert is_harmony("", {"<|channel|>": 5, "<|message|>": 6})
    assert not is_harmony("{{ messages }}", {"<think>": 1})
    assert uses_effort("Reasoning: {{ reasoning_effort }}")
    assert not uses_effort("{{ messages }}")
