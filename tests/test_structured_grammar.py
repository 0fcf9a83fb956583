"""edgeinfer.engine.grammar on the bundled gemma3 vocabulary (262k tokens): the tokenizer
view, each grammar kind, the TokenConstraint protocol, and bad grammars."""
from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("llguidance")

from edgeinfer.engine import grammar as g  # noqa: E402
from edgeinfer.engine.constraint import ConstraintError  # noqa: E402


@pytest.fixture(scope="module")
def tok(gemma3_path):
    from edgeinfer.formats.gguf_file import read_gguf
    from edgeinfer.formats.tokenizer import Tokenizer
    f = read_gguf(gemma3_path)
    try:
        return Tokenizer.from_gguf(f.metadata)
    finally:
        f.close()


def _walk(tok, c: g.GrammarConstraint, text: str) -> None:
    """Feed text token by token, checking each token was allowed."""
    for t in tok.encode(text, add_special=False, parse_special=False):
        allowed = c.allowed_tokens()
        assert allowed.dtype == bool and allowed.shape == (tok.vocab_size,)
        assert allowed[t], f"{tok.piece(t)!r} was masked out"
        assert not c.is_complete(), f"complete before {tok.piece(t)!r}"
        c.accept(t)


def _generate_greedy_from_mask(tok, c: g.GrammarConstraint, prefer, limit=200) -> str:
    """A stand-in model: at each step pick the allowed token that `prefer` ranks best."""
    out = []
    for _ in range(limit):
        if c.is_complete():
            break
        allowed = np.nonzero(c.allowed_tokens())[0]
        assert len(allowed), "empty mask"
        t = int(min(allowed, key=prefer))
        if t in tok.eot_ids:
            break
        c.accept(t)
        out.append(t)
    return tok.decode(out)


SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "pets": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "pets"], "additionalProperties": False}


def test_view_is_built_once_and_marks_control_tokens(tok):
    v1 = g.tokenizer_view(tok, tok.vocab_size)
    v2 = g.tokenizer_view(tok, tok.vocab_size)
    assert v1 is v2
    assert v1.vocab_size == tok.vocab_size
    assert set(v1.eos_tokens) == set(tok.eot_ids)
    bos = tok.bos_id
    assert v1.is_special_token(bos)
    assert not v1.is_special_token(tok.encode("hello", add_special=False)[0])


def test_json_schema_walk_then_complete(tok):
    c = g.GrammarConstraint.for_spec(tok, tok.vocab_size, g.json_schema(SCHEMA))
    _walk(tok, c, '{"name": "Rex", "age": 3, "pets": ["cat"]}')
    assert c.is_complete()
    allowed = np.nonzero(c.allowed_tokens())[0]
    assert set(allowed.tolist()) <= set(tok.eot_ids)


def test_json_schema_rejects_a_wrong_token(tok):
    c = g.GrammarConstraint.for_spec(tok, tok.vocab_size, g.json_schema(SCHEMA))
    bad = tok.encode("Hello", add_special=False)[0]
    assert not c.allowed_tokens()[bad]
    with pytest.raises(ConstraintError):
        c.accept(bad)


def test_mask_driven_generation_validates(tok):
    # a "model" that prefers short closing tokens ends up with a minimal but valid object
    c = g.GrammarConstraint.for_spec(tok, tok.vocab_size, g.json_schema(SCHEMA))

    def prefer(t):
        p = tok.piece(int(t))
        return (not any(ch in p for ch in b'"]}0'), len(p), t)
    text = _generate_greedy_from_mask(tok, c, prefer)
    obj = json.loads(text)
    assert set(obj) == {"name", "age", "pets"} and isinstance(obj["age"], int)


def test_any_json_object(tok):
    c = g.GrammarConstraint.for_spec(tok, tok.vocab_size, g.any_json_object())
    assert not c.allowed_tokens()[tok.encode("[", add_special=False)[0]]
    _walk(tok, c, '{"a": [1, 2, {"b": null}]}')
    assert c.is_complete()


def test_regex_choice_gbnf_lark(tok):
    c = g.GrammarConstraint.for_spec(tok, tok.vocab_size, g.GrammarSpec("regex", r"[0-9]{3}-[a-z]+"))
    _walk(tok, c, "123-abc")
    assert c.text_so_far_is_complete()
    c = g.GrammarConstraint.for_spec(tok, tok.vocab_size, g.GrammarSpec("choice", ["yes", "no"]))
    text = _generate_greedy_from_mask(tok, c, prefer=lambda t: -len(tok.piece(int(t))))
    assert text in ("yes", "no")
    c = g.GrammarConstraint.for_spec(tok, tok.vocab_size,
                                     g.GrammarSpec("gbnf", 'root ::= "id-" [0-9] [0-9]'))
    _walk(tok, c, "id-42")
    assert c.is_complete()
    c = g.GrammarConstraint.for_spec(tok, tok.vocab_size,
                                     g.GrammarSpec("lark", 'start: "x" NUM\nNUM: /[0-9]+/'))
    _walk(tok, c, "x7")


def test_a_literal_that_spells_a_chat_tag_is_written_as_text(tok):
    """"<start_of_image>" is a user-defined token in gemma3's vocabulary, one the view marks as
    not text. A grammar literal that spells it is text: the mask must only offer tokens the
    matcher then accepts (it used to offer the tag and reject it when sampled)."""
    tag = tok.token_to_id["<start_of_image>"]
    c = g.GrammarConstraint.for_spec(tok, tok.vocab_size,
                                     g.GrammarSpec("gbnf", 'root ::= "a<start_of_image>b"'))
    out = []
    while not c.is_complete():
        allowed = np.nonzero(c.allowed_tokens())[0]
        assert len(allowed) and tag not in allowed
        c.accept(int(allowed[0]))
        out.append(int(allowed[0]))
    assert tok.decode(out) == "a<start_of_image>b"


def test_compiles_are_cached_per_model(tok):
    spec = g.json_schema({"type": "object", "properties": {"q": {"type": "string"}}})
    g.GrammarConstraint.for_spec(tok, tok.vocab_size, spec)
    cache = g.grammars_for(tok, tok.vocab_size).cache
    hits = cache.hits
    a = g.GrammarConstraint.for_spec(tok, tok.vocab_size, spec)
    b = g.GrammarConstraint.for_spec(tok, tok.vocab_size, spec)
    assert cache.hits == hits + 2
    a.accept(a_tok := int(np.nonzero(a.allowed_tokens())[0][0]))   # copies are independent
    assert b.allowed_tokens()[a_tok]


def _nested(depth: int) -> dict:
    s: dict = {"type": "string"}
    for _ in range(depth):
        s = {"type": "object", "properties": {"a": s}, "required": ["a"]}
    return s


@pytest.mark.parametrize("spec,words", [
    (g.json_schema({"type": "objet"}), "'type'"),
    (g.json_schema({"type": "object", "properties": {"a": {"type": "string",
                                                           "pattern": "(("}}}), "regex"),
    (g.json_schema("{not json"), "not valid JSON"),
    (g.json_schema([1, 2]), "must be an object"),
    (g.GrammarSpec("gbnf", "root ::= missing_rule"), "missing_rule"),
    (g.GrammarSpec("choice", []), "non-empty list"),
    (g.GrammarSpec("regex", "(unclosed"), "regex"),
    (g.GrammarSpec("nope", "x"), "unknown grammar kind"),
    (g.json_schema(_nested(500)), "nested more than"),
    (g.json_schema({"enum": [f"v{i}" for i in range(100_000)]}), "too big"),
])
def test_bad_grammars_name_the_problem(tok, spec, words):
    with pytest.raises(g.GrammarError) as e:
        g.GrammarConstraint.for_spec(tok, tok.vocab_size, spec)
    assert words.lower() in str(e.value).lower()


def test_apply_bitmask(tok):
    c = g.GrammarConstraint.for_spec(tok, tok.vocab_size, g.GrammarSpec("choice", ["yes", "no"]))
    logits = np.zeros(tok.vocab_size, np.float32)
    g.apply_bitmask(logits, c.bitmask())
    assert np.array_equal(np.isfinite(logits), c.allowed_tokens())


# ----- through the engine (the constraint hook) ------------------------------------------

@pytest.fixture(scope="module")
def engine(gemma3_path):
    from edgeinfer.engine.core import Engine, EngineConfig
    e = Engine(str(gemma3_path), EngineConfig(max_model_len=1024, kv_budget_bytes=32 << 20))
    yield e
    e.shutdown()


PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"enum": ["Paris", "Rome", "Oslo"]}},
          "required": ["name", "age", "city"]}


def test_greedy_generation_follows_the_schema(engine):
    from edgeinfer.engine.core import greedy
    prompt = engine.encode_chat([{"role": "user", "content": "Describe a person."}])
    free = engine.generate(prompt, greedy(20))
    with pytest.raises(json.JSONDecodeError):      # the base model alone writes prose
        json.loads(free.text)
    c = g.GrammarConstraint.for_spec(engine.tokenizer, engine.cfg.vocab_size,
                                     g.json_schema(PERSON))
    out = engine.generate(prompt, greedy(100), constraint=c)
    assert out.finish_reason == "stop", out.text
    obj = json.loads(out.text)
    assert set(obj) == {"name", "age", "city"}          # closed: no invented keys
    assert len(obj["name"]) <= 16 and 0 <= obj["age"] <= 120
    assert obj["city"] in ("Paris", "Rome", "Oslo")
    assert c.tokens == len(out.token_ids)


def test_constrained_output_cut_by_length(engine):
    from edgeinfer.engine.core import greedy
    prompt = engine.encode_chat([{"role": "user", "content": "Describe a person."}])
    c = g.GrammarConstraint.for_spec(engine.tokenizer, engine.cfg.vocab_size,
                                     g.json_schema(PERSON))
    out = engine.generate(prompt, greedy(4), constraint=c)
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    assert out.text.startswith('{"name": ') and not c.is_complete()


class _RejectsEverything:
    """A constraint whose matcher turns down the token it allowed (a grammar engine bug)."""

    def __init__(self, vocab):
        self.vocab = vocab

    def allowed_tokens(self):
        return np.ones(self.vocab, bool)

    def accept(self, token):
        raise ConstraintError(f"grammar rejected token {token}")

    def is_complete(self):
        return False


def test_a_rejected_sample_fails_that_request_and_the_engine_goes_on(engine):
    from edgeinfer.engine.core import greedy
    prompt = engine.encode_chat([{"role": "user", "content": "Describe a person."}])
    bad = engine.generate(prompt, greedy(8), constraint=_RejectsEverything(engine.cfg.vocab_size))
    assert bad.finish_reason == "error" and "grammar rejected token" in bad.error
    assert engine.scheduler.live_sequences() == []          # its blocks went back
    again = engine.generate(prompt, greedy(4))
    assert again.finish_reason == "length" and len(again.token_ids) == 4
