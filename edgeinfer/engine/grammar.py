"""Grammar-constrained decoding on llguidance: tokenizer views, grammar compiles, matchers.

Three pieces, each cached where it pays:

- `tokenizer_view(tok, vocab_size)`: llguidance's `LLTokenizer` built from our GGUF
  vocabulary (each token's bytes; control tokens marked with llguidance's 0xFF prefix so no
  grammar can emit them as text; the end-of-generation ids as EOS). ~1 s on gemma3's 262k
  vocabulary, so it is built once per tokenizer and kept (weakly keyed on the tokenizer).
- `GrammarSpec` -> `compile_spec()`: JSON Schema, "any JSON object", regex, a choice list,
  GBNF (llama.cpp's format) or Lark become one llguidance grammar. Bad input raises
  `GrammarError` naming what is wrong; compiles are bounded by llguidance's parser limits
  and by a wall-clock timeout when the caller uses `compile_async` (off the event loop and
  off the engine thread). Compiled matchers are cached per (view, grammar) and each request
  gets a `deep_copy()` of the cached one, which is microseconds.
- `GrammarConstraint`: the per-request matcher behind the engine's `TokenConstraint`
  protocol (edgeinfer.engine.constraint): `allowed_tokens()` (bool [vocab]), `bitmask()`
  (llguidance's packed int32 mask, for a sampler that applies bits directly), `accept()`,
  `is_complete()`.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from edgeinfer.engine.constraint import ConstraintError
from edgeinfer.formats.tokenizer.vocab import TokenType

try:                                   # an optional dependency: the server says so if absent
    import llguidance as _llg
    from llguidance import LLMatcher, LLParserLimits, LLTokenizer, TokenizerWrapper
except ImportError:                    # pragma: no cover - exercised only without the extra
    _llg = None

# The llguidance parser limits for requests: llguidance's defaults, with errors that do not
# echo the grammar back (a schema can be large; the message names the problem).
_LIMITS_KW = dict(verbose_errors=False)
COMPILE_TIMEOUT_S = 10.0               # a grammar that takes longer is refused (400)
MAX_SPEC_BYTES = 1 << 20               # 1 MiB of schema / grammar text


class GrammarError(ValueError):
    """A grammar or schema that cannot be compiled; the API answers 400 with this text."""


def available() -> bool:
    return _llg is not None


def _require() -> None:
    if _llg is None:
        raise GrammarError("structured output needs the llguidance package, which is not "
                           "installed (pip install llguidance)")


# ----- tokenizer views ---------------------------------------------------------------------

# Added (user-defined) tokens that are markup the model writes as text, which the tool-call
# grammars match by their bytes: Qwen / Hermes write `<tool_call>` as one token, and a grammar
# that saw it as a chat tag would forbid the very token the model wants at a call.
TEXT_TAGS = frozenset(("<tool_call>", "</tool_call>"))


class _GGUFVocab:
    """The object llguidance's TokenizerWrapper reads: token bytes, EOS/BOS, specials, and a
    callable that tokenizes bytes (used for forced text and canonical-token checks)."""

    def __init__(self, tok, vocab_size: int):
        types = tok.types
        tokens: list[bytes] = list(tok.token_bytes)
        special = []
        for i in np.nonzero((types == TokenType.CONTROL) | (types == TokenType.UNKNOWN))[0]:
            i = int(i)
            tokens[i] = b"\xff" + tok.tokens[i].encode("utf-8", "surrogateescape")
            special.append(i)
        for i in np.nonzero(types == TokenType.USER_DEFINED)[0]:
            i = int(i)
            t = tok.tokens[i]
            if t in TEXT_TAGS:
                continue
            if t.startswith("<") and t.endswith(">") and len(t) > 2:   # chat tags: not text
                tokens[i] = b"\xff" + t.encode("utf-8", "surrogateescape")
                special.append(i)
        for i, b in enumerate(tokens):
            if not b:                    # llguidance wants every token to have some bytes
                tokens[i] = b"\xff<[" + str(i).encode() + b"]>"
                special.append(i)
        while len(tokens) < vocab_size:  # the output matrix may be padded past the vocabulary
            tokens.append(b"\xff<[" + str(len(tokens)).encode() + b"]>")
            special.append(len(tokens) - 1)
        self.tokens = tokens
        self.special_token_ids = special
        # the tokenize callback must never hand llguidance a token the view marks as not text
        # (a user-defined chat tag our tokenizer would cut out of the text): llguidance would
        # allow it for forced bytes and then reject it when it is sampled
        self._as_text = frozenset(i for i in special if i < len(tok.tokens)
                                  and types[i] == TokenType.USER_DEFINED)
        eos = sorted(tok.eot_ids) or ([tok.eos_id] if tok.eos_id is not None else [])
        self.eos_token_ids = eos
        self.eos_token_id = tok.eos_id if tok.eos_id in eos else (eos[0] if eos else 0)
        self.bos_token_id = tok.bos_id
        # weakly: the view is cached per tokenizer (and held by cached matchers), and must not
        # keep an unloaded model's vocabulary alive
        self._tok = weakref.proxy(tok)

    def __call__(self, text: bytes | str) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tok.encode(text, add_special=False, parse_special=False,
                                as_text=self._as_text)


class _Cache:
    """LRU of compiled matchers (fresh, never advanced) per (view, grammar key)."""

    def __init__(self, size: int = 64):
        self.size = size
        self._d: OrderedDict = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, key):
        with self._lock:
            m = self._d.get(key)
            if m is not None:
                self._d.move_to_end(key)
                self.hits += 1
            else:
                self.misses += 1
            return m

    def put(self, key, m) -> None:
        with self._lock:
            self._d[key] = m
            self._d.move_to_end(key)
            while len(self._d) > self.size:
                self._d.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._d.clear()


class Grammars:
    """One tokenizer's compiled grammars: llguidance's view of the vocabulary and an LRU of
    fresh matchers. It lives as long as the tokenizer, that is as the loaded model (the daemon's
    Prompter, or the engine in its process): nothing of an unloaded model's stays."""

    def __init__(self, tok, vocab_size: int, cache_size: int = 64):
        _require()
        vocab = _GGUFVocab(tok, vocab_size)
        self.vocab_size = vocab_size
        self.eos_ids = tok.eot_ids
        self.view = LLTokenizer(TokenizerWrapper(vocab), n_vocab=vocab_size,
                                eos_token=vocab.eos_token_ids or None)
        self.cache = _Cache(cache_size)

    def compile(self, spec: "GrammarSpec") -> "LLMatcher":
        """A fresh matcher for `spec` (cached; the caller gets its own copy). GrammarError
        with llguidance's reason when the grammar cannot be compiled."""
        if spec.kind == "json_schema" and not isinstance(spec.source, str):
            check_schema(spec.source)      # before the key recurses through it
        key = spec.key()
        m = self.cache.get(key)
        if m is None:
            m = compile_spec(self.view, spec)
            self.cache.put(key, m)
        return m.deep_copy()

    def constraint(self, spec: "GrammarSpec") -> "GrammarConstraint":
        return GrammarConstraint(self.compile(spec), self.vocab_size, self.eos_ids, spec=spec)


# per tokenizer, weakly: the entry goes with the tokenizer
_grammars: "weakref.WeakKeyDictionary[Any, dict[int, Grammars]]" = weakref.WeakKeyDictionary()
_grammars_lock = threading.Lock()


def grammars_for(tok, vocab_size: int | None = None) -> Grammars:
    """The Grammars of `tok` at `vocab_size` (at least the tokenizer's own), built once."""
    n = max(vocab_size or 0, tok.vocab_size)
    with _grammars_lock:
        per = _grammars.setdefault(tok, {})
        g = per.get(n)
        if g is None:
            g = per[n] = Grammars(tok, n)
    return g


def tokenizer_view(tok, vocab_size: int | None = None):
    """llguidance's LLTokenizer for our Tokenizer, built once per (tokenizer, vocab size)."""
    return grammars_for(tok, vocab_size).view


# ----- grammar specs -----------------------------------------------------------------------

KINDS = ("json_schema", "json_object", "regex", "choice", "gbnf", "lark")


@dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to. `source`: a schema (dict or JSON text) for
    json_schema, None for json_object, the pattern for regex, a list of strings for choice,
    the grammar text for gbnf / lark."""
    kind: str
    source: Any = None
    strict: bool = True

    def key(self) -> str:
        src = self.source
        if isinstance(src, (dict, list)):
            src = json.dumps(src, sort_keys=True, separators=(",", ":"))
        return f"{self.kind}\x00{self.strict}\x00{src}"


def json_schema(schema: Any, strict: bool = True) -> GrammarSpec:
    return GrammarSpec("json_schema", schema, strict)


def any_json_object() -> GrammarSpec:
    return GrammarSpec("json_object")


_JSON_OPTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


MAX_SCHEMA_DEPTH = 128                 # nesting of objects/arrays in a schema's JSON text


def _depth(x: Any) -> int:
    """Nesting depth of a JSON value, without recursion (a hostile schema may be deep)."""
    deepest, stack = 0, [(x, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            v = list(v.values())
        if isinstance(v, list):
            deepest = max(deepest, d)
            if d > MAX_SCHEMA_DEPTH:
                return d
            stack.extend((c, d + 1) for c in v if isinstance(c, (dict, list)))
    return deepest


def check_schema(schema: Any) -> None:
    """A schema's shape before any compile: not too deep, and a schema at all."""
    if _depth(schema) > MAX_SCHEMA_DEPTH:
        raise GrammarError(f"the JSON schema is nested more than {MAX_SCHEMA_DEPTH} levels deep")
    _check_schema(schema)


def _check_schema(schema: Any) -> None:
    """Reject what is not a JSON Schema at all, naming the problem (llguidance checks the
    keywords it implements, and refuses unknown ones unless lenient)."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise GrammarError(f"a JSON schema must be an object, not {type(schema).__name__}")
    t = schema.get("type")
    ok = ("string", "number", "integer", "boolean", "object", "array", "null")
    for x in (t if isinstance(t, list) else [t] if t is not None else []):
        if x not in ok:
            raise GrammarError(f"schema keyword 'type': {x!r} is not a JSON Schema type "
                               f"(one of {', '.join(ok)})")
    props = schema.get("properties")
    if props is not None:
        if not isinstance(props, dict):
            raise GrammarError("schema keyword 'properties' must be an object")
        for k, v in props.items():
            try:
                _check_schema(v)
            except GrammarError as e:
                raise GrammarError(f"properties.{k}: {e}") from None
    req = schema.get("required")
    if req is not None and not (isinstance(req, list) and all(isinstance(r, str) for r in req)):
        raise GrammarError("schema keyword 'required' must be a list of property names")


_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains")


def closed_objects(schema: Any, depth: int = 0) -> Any:
    """A copy of `schema` where objects that list `properties` and say nothing of
    `additionalProperties` allow no others: what llama.cpp's schema converter (and so
    llama-server and Ollama) does, and what users of `format` / `response_format` expect
    from a small model, which would otherwise invent keys."""
    if depth > 64 or not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for k in _SUBSCHEMA_LISTS:
        if isinstance(out.get(k), list):
            out[k] = [closed_objects(x, depth + 1) for x in out[k]]
    for k in _SUBSCHEMA_MAPS:
        if isinstance(out.get(k), dict):
            out[k] = {n: closed_objects(x, depth + 1) for n, x in out[k].items()}
    for k in _SUBSCHEMAS:
        if isinstance(out.get(k), dict):
            out[k] = closed_objects(out[k], depth + 1)
    if "properties" in out and "additionalProperties" not in out and \
            "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    return out


def to_llguidance(spec: GrammarSpec) -> str:
    """The llguidance grammar text for a spec (not yet checked against a tokenizer)."""
    _require()
    k, src = spec.kind, spec.source
    if isinstance(src, str) and len(src) > MAX_SPEC_BYTES:
        raise GrammarError(f"the {k} grammar is {len(src)} bytes, more than the "
                           f"{MAX_SPEC_BYTES} allowed")
    if k == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTS)
    if k == "json_schema":
        if isinstance(src, str):
            try:
                src = json.loads(src)
            except json.JSONDecodeError as e:
                raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
        check_schema(src)
        src = closed_objects(src)
        if len(json.dumps(src)) > MAX_SPEC_BYTES:
            raise GrammarError(f"the JSON schema is more than {MAX_SPEC_BYTES} bytes")
        opts = dict(_JSON_OPTS)
        if not spec.strict:
            opts["lenient"] = True
        try:
            return LLMatcher.grammar_from_json_schema(src, defaults=opts)
        except ValueError as e:
            raise GrammarError(f"invalid JSON schema: {e}") from None
    if k == "regex":
        if not isinstance(src, str):
            raise GrammarError("a regex grammar must be a string")
        return LLMatcher.grammar_from_regex(src)
    if k == "choice":
        if not (isinstance(src, list) and src and all(isinstance(x, str) for x in src)):
            raise GrammarError("a choice grammar must be a non-empty list of strings")
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(x) for x in src))
    if k in ("gbnf", "lark"):
        if not isinstance(src, str) or not src.strip():
            raise GrammarError(f"a {k} grammar must be non-empty text")
        try:
            return _llg.grammar_from("gbnf" if k == "gbnf" else "lark", src)
        except ValueError as e:
            raise GrammarError(str(e)) from None
    raise GrammarError(f"unknown grammar kind {k!r} (one of {', '.join(KINDS)})")


def _clean(msg: str) -> str:
    msg = (msg or "").strip()
    for prefix in ("Error: ", "error: "):
        if msg.startswith(prefix):
            msg = msg[len(prefix):]
    msg = " ".join(x.strip() for x in msg.splitlines() if x.strip())
    if len(msg) > 400:
        msg = msg[:400] + "..."
    return msg or "the grammar could not be compiled"


def compile_spec(view, spec: GrammarSpec) -> "LLMatcher":
    """A new matcher for `spec` on `view` (uncached: Grammars.compile caches per model).
    Raises GrammarError with llguidance's reason when the grammar cannot be compiled."""
    _require()
    if spec.kind == "json_schema" and not isinstance(spec.source, str):
        check_schema(spec.source)          # before anything recurses through it
    m = LLMatcher(view, to_llguidance(spec), log_level=0, limits=LLParserLimits(**_LIMITS_KW))
    if m.is_error():
        raise GrammarError(f"cannot compile the {spec.kind.replace('_', ' ')}: "
                           f"{_clean(m.get_error())}")
    return m


async def compile_async(view, spec: GrammarSpec, timeout: float = COMPILE_TIMEOUT_S):
    """compile_spec on a worker thread, bounded in wall time (llguidance drops the GIL while
    it builds). A compile past the timeout is a GrammarError; its thread finishes on its own
    and the result is dropped."""
    try:
        return await asyncio.wait_for(asyncio.to_thread(compile_spec, view, spec), timeout)
    except asyncio.TimeoutError:
        raise GrammarError(f"the {spec.kind.replace('_', ' ')} took more than {timeout:g} s "
                           f"to compile; simplify it") from None


# ----- the per-request constraint ----------------------------------------------------------

class GrammarConstraint:
    """One request's matcher, implementing edgeinfer.engine.constraint.TokenConstraint."""

    def __init__(self, matcher: "LLMatcher", vocab_size: int, eos_ids=(),
                 spec: "GrammarSpec | None" = None):
        self.m = matcher
        self.spec = spec        # what it was compiled from: an engine process compiles it again
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self._mask = np.full(self.words, -1, dtype=np.int32)
        self._eos = frozenset(int(e) for e in eos_ids)
        self.tokens = 0
        self.mask_seconds = 0.0
        self._fresh = False              # _mask holds the mask for the current state

    @classmethod
    def for_spec(cls, tok, vocab_size: int, spec: GrammarSpec) -> "GrammarConstraint":
        """The constraint for `spec` from the tokenizer's Grammars (compiles cached)."""
        return grammars_for(tok, vocab_size).constraint(spec)

    def bitmask(self) -> np.ndarray:
        """int32 [ceil(vocab/32)]: bit j of word i allows token 32*i + j (llguidance's
        layout). The array is reused by the next call."""
        if self._fresh:
            return self._mask
        if self.m.is_error():
            raise ConstraintError(f"grammar: {_clean(self.m.get_error())}")
        t = time.perf_counter()
        self.m.unsafe_compute_mask_ptr(self._mask.ctypes.data, self._mask.nbytes)
        self.mask_seconds += time.perf_counter() - t
        if self.m.is_error():
            raise ConstraintError(f"grammar: {_clean(self.m.get_error())}")
        self._fresh = True
        return self._mask

    def allowed_tokens(self) -> np.ndarray:
        bits = np.unpackbits(self.bitmask().view(np.uint8), bitorder="little")
        return bits[:self.vocab_size].view(bool)

    def accept(self, token: int) -> None:
        self._fresh = False
        if not self.m.consume_token(int(token)):
            raise ConstraintError(f"grammar rejected token {int(token)}: "
                                  f"{_clean(self.m.get_error())}")
        self.tokens += 1

    def is_complete(self) -> bool:
        """True when nothing more can follow: the grammar stopped, or only EOS may come."""
        if self.m.is_stopped():
            return True
        if not self.m.is_accepting():
            return False
        ff = self.m.compute_ff_tokens()
        if ff:
            return False
        mask = self.bitmask()
        nz = np.nonzero(mask)[0]
        allowed = []
        for w in nz.tolist():
            v = int(mask[w]) & 0xFFFFFFFF
            while v:
                b = v & -v
                allowed.append(32 * w + b.bit_length() - 1)
                if len(allowed) > len(self._eos) + 1:
                    return False
                v ^= b
        return bool(allowed) and all(a in self._eos for a in allowed)

    def text_so_far_is_complete(self) -> bool:
        return self.m.is_accepting()


def apply_bitmask(logits: np.ndarray, mask: np.ndarray) -> None:
    """logits[i] = -inf where the mask's bit i is 0 (float32 [vocab], in place)."""
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[:logits.shape[-1]]
    logits[..., bits == 0] = -np.inf


__all__ = ["GrammarSpec", "GrammarError", "GrammarConstraint", "tokenizer_view",
           "compile_spec", "compile_async", "json_schema", "any_json_object", "available",
           "apply_bitmask", "KINDS"]
