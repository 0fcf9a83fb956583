"""tool_choice auto on a Harmony model (gpt-oss): harmony.auto_grammar, in process.

A synthetic model with the whole Harmony vocabulary (the markup as special tokens) and
random weights. Random weights never start a call by themselves, so a call is started for
them: `Steer` forces the first tokens of the output (a call header up to `to=functions.`)
and then hands over to the grammar under test, or to nothing (the model's free output).
Without the grammar the model goes on with a name no tool has; with it, the same start ends
in a call of a declared tool with arguments its schema accepts. A reply that is not a call
is the model's own, token for token: the grammar only constrains headers that name a
function.
"""
from __future__ import annotations

import numpy as np
import pytest

from edgeinfer.formats.chat_template import builtin_template
from edgeinfer.formats.synthetic import TinyShape, random_f32_tensors, write_tiny_gguf

pytest.importorskip("llguidance")

SPECIALS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
            "<|return|>", "<|call|>")
SHAPE = TinyShape(64, 128, 2, 1, 32, 2, 2048)
CITY = {"type": "function", "function": {
    "name": "pick_city", "description": "Pick a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                   "required": ["city"]}}}
FLAG = {"type": "function", "function": {
    "name": "set_flag", "description": "Set the flag",
    "parameters": {"type": "object", "properties": {"on": {"type": "boolean"}},
                   "required": ["on"]}}}
ASK = [{"role": "user", "content": "Which city?"}]


class Steer:
    """The first tokens forced to `prefix`, then `inner` decides (None: anything goes)."""

    def __init__(self, prefix: list[int], vocab: int, inner=None):
        self.prefix, self.vocab, self.inner, self.pos = prefix, vocab, inner, 0

    def allowed_tokens(self) -> np.ndarray:
        if self.pos < len(self.prefix):
            a = np.zeros(self.vocab, dtype=bool)
            a[self.prefix[self.pos]] = True
            return a
        return self.inner.allowed_tokens() if self.inner else np.ones(self.vocab, dtype=bool)

    def accept(self, token: int) -> None:
        if self.inner is not None:
            self.inner.accept(token)
        self.pos += 1

    def is_complete(self) -> bool:
        return self.pos >= len(self.prefix) and self.inner is not None \
            and self.inner.is_complete()


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from edgeinfer.engine.core import Engine, EngineConfig
    p = tmp_path_factory.mktemp("hauto") / "h.gguf"
    write_tiny_gguf(p, "qwen3", SHAPE, random_f32_tensors(np.random.default_rng(0)),
                    file_type=0, extra_specials=SPECIALS, chat_template=builtin_template("harmony"))
    e = Engine(str(p), EngineConfig(max_model_len=1024, kv_budget_bytes=32 << 20))
    try:
        yield e
    finally:
        e.shutdown()


def _setup(e):
    from edgeinfer.engine import grammar as g
    from edgeinfer.server import harmony as hm, tools as tl
    tok = e.tokenizer
    tools = tl.parse_tools([CITY, FLAG])
    spec = hm.auto_grammar(tools, tok.token_to_id, tok.eot_ids)
    vocab = max(int(e.cfg.vocab_size), tok.vocab_size)
    return tok, tools, vocab, lambda: g.grammars_for(tok, vocab).constraint(spec)


def _ids(tok, text):
    return tok.encode(text, add_special=False, parse_special=True)


def test_grammar_shape_and_fallback():
    from edgeinfer.server import harmony as hm, tools as tl
    tools = tl.parse_tools([CITY, FLAG])
    vocab = {s: i for i, s in enumerate(SPECIALS)}
    spec = hm.auto_grammar(tools, vocab)
    assert "CALL_TO" in spec.source and '"pick_city" ctail <|message|> %json' in spec.source
    # markup spelled as text (no such tokens): no grammar, calls read from free output
    assert hm.auto_grammar(tools, {"<|return|>": 0, "<|call|>": 1}) is None
    assert hm.auto_grammar([], vocab) is None
    assert hm.auto_spec(type("E", (), {"tokenizer": type("T", (), {"token_to_id": vocab})})(),
                        tools, tl.Choice("required")) is None


@pytest.mark.parametrize("text,ok", [
    ("<|channel|>analysis<|message|>a<b, to=functions.x is text here<|end|><|start|>assistant"
     "<|channel|>final<|message|>It is Paris.", True),
    ("Plain text with no header", True),
    ('<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>commentary'
     ' to=functions.pick_city <|constrain|>json<|message|>{"city": "Rome"}', True),
    (' to=functions.set_flag<|channel|>commentary json<|message|>{"on": true}', True),
    ('<|channel|>commentary to=functions.delete_all <|constrain|>json<|message|>{}', False),
    ('<|channel|>commentary to=functions.pick_city <|constrain|>json<|message|>{"city": "Oslo"}',
     False),
    ('<|channel|>commentary to=functions.set_flag <|constrain|>json<|message|>{"on": 1}', False),
    ('<|channel|>commentary to=functions.set_flag <|constrain|>json<|message|>{"on": true, '
     '"x": 1}', False),
])
def test_what_the_grammar_accepts(engine, text, ok):
    from edgeinfer.engine.constraint import ConstraintError
    from edgeinfer.server.harmony import split_harmony
    tok, tools, vocab, constraint = _setup(engine)
    c = constraint()
    try:
        for i in _ids(tok, text):
            assert c.allowed_tokens()[i]
            c.accept(i)
        accepted = c.text_so_far_is_complete()
    except (ConstraintError, AssertionError):
        accepted = False
    assert accepted == ok
    if ok:           # what it accepts, the splitter reads: calls valid, the rest text
        r, content, calls = split_harmony(text, tools)
        assert all(x.name in ("pick_city", "set_flag") for x in calls)
        assert ("to=functions." in text and "Plain" not in text and "final" not in text) \
            == bool(calls)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_started_call_ends_valid(engine, seed):
    from edgeinfer.runners.sampling_params import SamplingParams
    from edgeinfer.server.harmony import split_harmony
    tok, tools, vocab, constraint = _setup(engine)
    prompt = engine.encode_chat(ASK, tools=[CITY, FLAG])
    prefix = _ids(tok, "<|channel|>commentary to=functions.")
    params = SamplingParams(temperature=1.0, seed=seed, max_tokens=60)
    free = engine.generate(prompt, params, constraint=Steer(prefix, vocab))
    # free output: the model writes no declared name, so no call comes out
    assert not free.text.split("to=functions.", 1)[1].startswith(("pick_city", "set_flag"))
    assert split_harmony(free.text, tools)[2] == []
    out = engine.generate(prompt, params, constraint=Steer(prefix, vocab, constraint()))
    assert out.finish_reason == "stop", out.text
    r, content, calls = split_harmony(out.text, tools)
    assert content == "" and len(calls) == 1, out.text
    (c,) = calls
    assert (c.name, c.arguments) in [("pick_city", {"city": "Paris"}),
                                     ("pick_city", {"city": "Rome"}),
                                     ("set_flag", {"on": True}), ("set_flag", {"on": False})]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_answers_are_untouched(engine, seed):
    # the model's own answer, greedy and sampled, with and without the grammar: the same
    # tokens (the markup tokens other than the channel's are kept out by a bias in both runs,
    # so the answer stays one message: random weights would otherwise write any tag anywhere)
    from edgeinfer.runners.sampling_params import SamplingParams
    tok, tools, vocab, constraint = _setup(engine)
    prompt = engine.encode_chat(ASK, tools=[CITY, FLAG])
    prefix = _ids(tok, "<|channel|>final<|message|>")
    bias = {tok.token_to_id[s]: -100.0 for s in SPECIALS if s not in ("<|return|>",)}
    for temp in (0.0, 1.0):
        params = SamplingParams(temperature=temp, seed=seed, max_tokens=40, logit_bias=bias)
        free = engine.generate(prompt, params, constraint=Steer(prefix, vocab))
        out = engine.generate(prompt, params, constraint=Steer(prefix, vocab, constraint()))
        assert out.token_ids == free.token_ids, (temp, free.text, out.text)


def test_free_output_the_grammar_allows_is_kept(engine):
    # no bias, greedy: where the model's own output (markup tokens and all) is one the
    # grammar allows, the constrained run gives the same tokens. (Sampled, a mask that takes
    # out tokens the model gave some weight, markup it may not write here, moves the draw;
    # test_answers_are_untouched samples with that markup kept out.)
    from edgeinfer.engine.constraint import ConstraintError
    from edgeinfer.runners.sampling_params import SamplingParams
    tok, tools, vocab, constraint = _setup(engine)
    kept = 0
    for q in ("Which city?", "Weather in Paris?", "Set the flag.", "Hello", "2+2?", "Why?"):
        prompt = engine.encode_chat([{"role": "user", "content": q}], tools=[CITY, FLAG])
        for start in ("<|channel|>analysis<|message|>", "<|channel|>final<|message|>"):
            prefix = _ids(tok, start)
            params = SamplingParams(temperature=0, max_tokens=30)
            free = engine.generate(prompt, params, constraint=Steer(prefix, vocab))
            c = constraint()
            try:
                for i in free.token_ids:
                    if i not in tok.eot_ids:
                        c.accept(i)
            except ConstraintError:
                continue
            out = engine.generate(prompt, params, constraint=Steer(prefix, vocab, constraint()))
            assert out.token_ids == free.token_ids, (q, free.text, out.text)
            kept += 1
    assert kept >= 6
