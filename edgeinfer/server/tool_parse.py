"""Tool calls out of model text, in every shape instruct models write them.

Shapes read (a call must name a declared tool and its arguments must validate against that
tool's JSON schema, or it stays text):

- Hermes / Qwen / our envelope: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  any number of them, anywhere in the reply;
- a fenced block (```` ```json ```` or a bare ```` ``` ````) at the start of a line holding a
  call object or an array of them;
- a bare call object or array at the start of a line: `{"name": ..., "arguments": {...}}`,
  `parameters` instead of `arguments` (Llama 3's JSON form), `{"function": {...}}` wrappers;
- Mistral: `[TOOL_CALLS][{...}, ...]` and `[TOOL_CALLS]name[ARGS]{...}`;
- Llama 3: `<|python_tag|>{"name": ..., "parameters": {...}}` (several joined by `;`) and
  the built-in form `<|python_tag|>name.call(key="value")`.

`StreamSplitter` reads a stream: text flows until something could start a call (a tag
anywhere; a fence, `{` or `[` at a line start), then is held until it is decided: calls
(events, the markup gone) or text after all (released as written). `parse_calls` runs the
same splitter over a finished reply, so a streamed and a whole reply always agree.
"""
from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

import regex
from jsonschema import ValidationError, validators
from jsonschema.validators import validator_for

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PREFIXES = ("[TOOL_CALLS]", "<|python_tag|>")     # everything after them is calls
TAGS = (OPEN, *PREFIXES)
FENCE = "```"
FENCE_LANGS = ("", "json", "tool_call", "tool_code")
# the keys a call object can open with; any other first key is ordinary JSON, released at once
CALL_KEYS = ("name", "function", "type", "arguments", "parameters", "id")
MAX_PYCALL = 8192          # longest `name.call(...)` handed to ast.parse


PATTERN_TIMEOUT_S = 0.05   # a schema `pattern` checked against model output (see _bounded)


def _search(pattern: str, text: str) -> bool:
    """re.search as jsonschema does, but with a time limit: a client's catastrophic pattern
    (`(a+)+$`) run on the event loop must not stall every other request."""
    try:
        return regex.search(pattern, text, timeout=PATTERN_TIMEOUT_S) is not None
    except TimeoutError:
        return False


def _pattern(validator, pattern, instance, schema):
    if validator.is_type(instance, "string") and not _search(pattern, instance):
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


def _pattern_properties(validator, patterns, instance, schema):
    if not validator.is_type(instance, "object"):
        return
    for pattern, sub in patterns.items():
        for k, v in instance.items():
            if _search(pattern, k):
                yield from validator.descend(v, sub, path=k, schema_path=pattern)


def _bounded(cls):
    """The validator class with `pattern` / `patternProperties` on time-limited regexes."""
    return validators.extend(cls, {"pattern": _pattern,
                                   "patternProperties": _pattern_properties})


@dataclass
class Tool:
    name: str
    description: str = ""
    parameters: dict = field(default_factory=lambda: {"type": "object", "properties": {}})
    _validator: Any = field(default=None, init=False, repr=False, compare=False)

    def openai(self) -> dict:
        return {"type": "function", "function": {"name": self.name,
                                                 "description": self.description,
                                                 "parameters": self.parameters}}

    def validator(self):
        """The jsonschema validator of the arguments schema (raises SchemaError if the
        schema is not one; parse_tools calls this so that is a 400 before generation)."""
        if self._validator is None:
            cls = _bounded(validator_for(self.parameters))
            cls.check_schema(self.parameters)
            self._validator = cls(self.parameters)
        return self._validator

    def accepts(self, arguments: Any) -> bool:
        if not isinstance(arguments, dict):
            return False
        try:
            return self.validator().is_valid(arguments)
        except RecursionError:                  # absurdly deep arguments: not a call
            return False


@dataclass
class ToolCall:
    name: str
    arguments: dict
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self, index: int | None = None) -> dict:
        d = {"id": self.id, "type": "function",
             "function": {"name": self.name, "arguments": json.dumps(self.arguments)}}
        if index is not None:
            d = {"index": index, **d}
        return d

    def ollama(self) -> dict:
        return {"function": {"name": self.name, "arguments": self.arguments}}


def args_obj(args: Any) -> Any:
    """Arguments as an object: OpenAI sends them as a JSON string, Ollama as an object."""
    if isinstance(args, str):
        try:
            return json.loads(args) if args.strip() else {}
        except (json.JSONDecodeError, RecursionError):
            return args
    return args


# ----- reading call objects ----------------------------------------------------------------

def _call(obj: Any, tools: dict[str, Tool]) -> ToolCall | None:
    """A call object -> ToolCall, if it names a declared tool with valid arguments."""
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("function"), dict):        # {"type": "function", "function": {...}}
        obj = obj["function"]
    name = obj.get("name")
    args = args_obj(obj["arguments"] if "arguments" in obj else obj.get("parameters", {}))
    tool = tools.get(name) if isinstance(name, str) else None
    if tool is None or not tool.accepts(args):
        return None
    return ToolCall(name, args)


def _calls(values: list, tools: dict[str, Tool]) -> list[ToolCall] | None:
    """Every value (arrays flattened) a valid call, or None: part of a reply is never half
    calls and half text."""
    out = []
    for v in values:
        for o in (v if isinstance(v, list) else [v]):
            c = _call(o, tools)
            if c is None:
                return None
            out.append(c)
    return out or None


_SEP = re.compile(r"[\s,;]*")


def _json_seq(s: str) -> list | None:
    """s as JSON values separated by whitespace, ',' or ';' and nothing else; else None."""
    dec, out, i = json.JSONDecoder(), [], _SEP.match(s).end()
    while i < len(s):
        if s[i] not in "{[":
            return None
        try:
            v, i = dec.raw_decode(s, i)
        except (json.JSONDecodeError, RecursionError):     # broken, or nested absurdly deep
            return None
        out.append(v)
        i = _SEP.match(s, i).end()
    return out


_INNER_FENCE = re.compile(r"^```[A-Za-z_]*\s*\n(.*?)\n?\s*```$", re.S)


def parse_region(s: str, tools: dict[str, Tool]) -> list[ToolCall] | None:
    """The inside of a call envelope, fence or bare value -> calls, or None."""
    s = s.strip()
    m = _INNER_FENCE.match(s)                  # a fence inside a <tool_call> envelope
    if m:
        s = m.group(1).strip()
    vals = _json_seq(s)
    return _calls(vals, tools) if vals else None


_MISTRAL_V11 = re.compile(r"\s*([A-Za-z0-9_.\-]{1,64})(?:\[CALL_ID\][A-Za-z0-9]+)?\[ARGS\]")


def _mistral_named(s: str, tools: dict[str, Tool]) -> list[ToolCall] | None:
    """[TOOL_CALLS]name[ARGS]{...} (Mistral's v11 tokenizer format), repeated."""
    dec, out, i = json.JSONDecoder(), [], 0
    while i < len(s) and s[i:].strip():
        m = _MISTRAL_V11.match(s, i)
        if not m:
            return None
        try:
            args, i = dec.raw_decode(s, m.end())
        except (json.JSONDecodeError, RecursionError):
            return None
        c = _call({"name": m.group(1), "arguments": args}, tools)
        if c is None:
            return None
        out.append(c)
    return out or None


def _python_call(s: str, tools: dict[str, Tool]) -> list[ToolCall] | None:
    """Llama 3's built-in form, `name.call(key=literal, ...)`: parsed (never evaluated)."""
    s = s.strip()
    if not s or len(s) > MAX_PYCALL:
        return None
    try:
        node = ast.parse(s, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "call" and isinstance(node.func.value, ast.Name)
            and not node.args):
        return None
    try:
        args = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg}
    except (ValueError, SyntaxError, TypeError, RecursionError, MemoryError):
        return None
    c = _call({"name": node.func.value.id, "arguments": args}, tools)
    return [c] if c else None


def parse_prefixed(s: str, tools: dict[str, Tool]) -> list[ToolCall] | None:
    """What follows [TOOL_CALLS] or <|python_tag|>."""
    return parse_region(s, tools) or _mistral_named(s, tools) or _python_call(s, tools)


# ----- the splitter ------------------------------------------------------------------------

def holdback(buf: str, tags: tuple[str, ...]) -> int:
    """How many trailing characters of buf could be the start of a tag."""
    n = 0
    for t in tags:
        for k in range(min(len(t) - 1, len(buf)), 0, -1):
            if buf.endswith(t[:k]):
                n = max(n, k)
                break
    return n


# a JSON value's pieces for bracket matching: whole strings, brackets, runs of anything else
_JSON_PIECES = re.compile(r'"(?:[^"\\]|\\.)*"|[{}\[\]]|[^"{}\[\]]+')
_FIRST_KEY = re.compile(r'\{\s*(?:"((?:[^"\\]|\\.)*)("?)|(.))?', re.S)


class StreamSplitter:
    """Streamed text -> ("text", str) and ("call", ToolCall) events (see the module doc)."""

    def __init__(self, tools: list[Tool]):
        self.tools = {t.name: t for t in tools}
        self.buf = ""
        self.kind: str | None = None     # None: text; else the candidate at buf[0]
        self.line_start = True           # buf[0] starts a line
        self.in_code = False             # inside a fenced block that is not a call
        self.skip_nl = False             # after a call: its trailing newlines are markup
        self.calls: list[ToolCall] = []
        self._scan = (0, 0)              # bare JSON: (resume offset, depth)

    def feed(self, text: str) -> list[tuple[str, Any]]:
        self.buf += text
        return self._run(False, False)

    def flush(self, truncated: bool = False) -> list[tuple[str, Any]]:
        """The rest at the end of the stream. `truncated`: the output was cut (max_tokens),
        so an unclosed call is not taken as complete."""
        return self._run(True, truncated)

    # --- driver ----------------------------------------------------------------------------
    def _run(self, final: bool, truncated: bool) -> list[tuple[str, Any]]:
        ev: list[tuple[str, Any]] = []
        while True:
            if self.skip_nl:
                rest = self.buf.lstrip("\r\n")
                if not rest and not final:
                    self.buf = ""
                    return ev
                self.buf, self.skip_nl = rest, False
            if not self.buf:
                return ev
            step = self._text if self.kind is None else self._candidate
            if not step(ev, final, truncated):
                return ev

    def _emit(self, ev: list, text: str) -> None:
        if text:
            ev.append(("text", text))
            self.line_start = text.endswith("\n")

    def _release(self, ev: list, n: int, code: bool = False) -> bool:
        """buf[:n] was not a call after all: it is text; scanning resumes after it."""
        self._emit(ev, self.buf[:n])
        self.buf, self.kind = self.buf[n:], None
        self.in_code = code
        return True

    def _done(self, ev: list, calls: list[ToolCall], end: int) -> bool:
        for c in calls:
            self.calls.append(c)
            ev.append(("call", c))
        self.buf, self.kind = self.buf[end:], None
        self.skip_nl = self.line_start = True
        return True

    def _unclosed(self, ev: list, calls: list[ToolCall] | None, truncated: bool) -> bool:
        """End of stream inside a candidate: complete calls count unless the output was cut;
        a further call cut short after real ones is dropped (neither text nor a call)."""
        if calls and not truncated:
            return self._done(ev, calls, len(self.buf))
        if truncated and self.calls:
            self.buf, self.kind = "", None
            return False
        return self._release(ev, len(self.buf))

    # --- text ------------------------------------------------------------------------------
    def _text(self, ev: list, final: bool, truncated: bool) -> bool:
        buf = self.buf
        hits = [(buf.find(t), t) for t in TAGS if t in buf]
        tag_at, tag = min(hits) if hits else (len(buf), None)
        in_code, pos, at_line = self.in_code, 0, self.line_start
        end, kind = None, None
        while pos < tag_at:
            if at_line:
                j = pos
                while j < len(buf) and buf[j] in " \t":
                    j += 1
                if tag is not None and j == tag_at:          # a tag at the line start wins
                    break
                rest = buf[j:j + 12]
                if not final and (j == len(buf) or len(rest) < 12 and (
                        FENCE.startswith(rest) or PREFIXES[0].startswith(rest))):
                    end = pos                 # too little of the line to tell: hold it
                    break
                if in_code:
                    if rest.startswith(FENCE):               # the closing fence
                        in_code = False
                elif rest.startswith(FENCE):
                    end, kind = pos, "fence"
                    break
                elif rest[:1] in ("{", "["):
                    end, kind = pos, "bare"
                    break
            nl = buf.find("\n", pos)
            if nl < 0 or nl >= tag_at:
                break
            pos, at_line = nl + 1, True
        if end is None:
            if tag is not None:
                end, kind = tag_at, ("tag" if tag == OPEN else "prefix")
            else:
                end = len(buf) - (0 if final else holdback(buf, TAGS))
        self._emit(ev, buf[:end])
        self.in_code, self.buf = in_code, buf[end:]
        if kind is None:
            return False
        self.kind, self._scan = kind, (0, 0)
        return True

    # --- candidates ------------------------------------------------------------------------
    def _candidate(self, ev: list, final: bool, truncated: bool) -> bool:
        return {"tag": self._tag, "prefix": self._prefix, "fence": self._fence,
                "bare": self._bare}[self.kind](ev, final, truncated)

    def _tag(self, ev: list, final: bool, truncated: bool) -> bool:
        buf, n = self.buf, len(OPEN)
        s = buf[n:].lstrip()
        if s and s[0] not in '{["`':                      # the tag in prose, not a call
            return self._release(ev, n)
        end = buf.find(CLOSE, n)
        if end >= 0:
            calls = parse_region(buf[n:end], self.tools)
            if calls:
                return self._done(ev, calls, end + len(CLOSE))
            return self._release(ev, end + len(CLOSE))
        if not final:
            return False
        return self._unclosed(ev, parse_region(buf[n:], self.tools), truncated)

    def _prefix(self, ev: list, final: bool, truncated: bool) -> bool:
        if not final:                      # everything after the tag is calls: wait for all
            return False
        tag = next(t for t in PREFIXES if self.buf.startswith(t))
        return self._unclosed(ev, parse_prefixed(self.buf[len(tag):], self.tools), truncated)

    def _opens_call(self, i: int, final: bool) -> bool | None:
        """buf[i] is '{' (or '[' then '{'): could this be a call object? None: not known yet."""
        buf = self.buf
        if buf[i] == "[":
            s = buf[i + 1:].lstrip()
            if not s:
                return None if not final else False
            if s[0] != "{":
                return False
            i = len(buf) - len(s)
        m = _FIRST_KEY.match(buf, i)
        if m.group(3) is not None:                        # '{' then something not a key
            return False
        if m.group(1) is None or not m.group(2):          # key not complete yet
            return None if not final else False
        return m.group(1) in CALL_KEYS

    def _fence(self, ev: list, final: bool, truncated: bool) -> bool:
        buf = self.buf
        j = len(buf) - len(buf.lstrip(" \t")) + len(FENCE)
        nl = buf.find("\n", j)
        if nl < 0:
            return self._release(ev, len(buf), code=True) if final else False
        if buf[j:nl].strip().lower() not in FENCE_LANGS:   # ```python etc.: code, shown as is
            return self._release(ev, nl + 1, code=True)
        s = buf[nl + 1:].lstrip()
        if not s:
            return self._release(ev, len(buf)) if final else False
        ok = s[0] in "{[" and self._opens_call(len(buf) - len(s), final)
        if ok is None:
            return False
        if not ok:
            return self._release(ev, nl + 1, code=True)
        close = buf.find(FENCE, nl + 1)
        if close >= 0:
            calls = parse_region(buf[nl + 1:close], self.tools)
            if calls:
                return self._done(ev, calls, close + len(FENCE))
            return self._release(ev, close + len(FENCE))
        if not final:
            return False
        return self._unclosed(ev, parse_region(buf[nl + 1:], self.tools), truncated)

    def _bare(self, ev: list, final: bool, truncated: bool) -> bool:
        buf = self.buf
        j = len(buf) - len(buf.lstrip(" \t"))
        ok = self._opens_call(j, final)
        if ok is None:
            return False
        if not ok:
            return self._release(ev, j + 1)
        end = self._json_end(j)
        if end is not None:
            calls = parse_region(buf[j:end], self.tools)
            if calls:
                return self._done(ev, calls, end)
            return self._release(ev, end)
        if not final:
            return False
        return self._unclosed(ev, None, truncated)

    def _json_end(self, start: int) -> int | None:
        """End of the JSON object/array at buf[start], or None while it is still open;
        resumes where the last call stopped (a stream grows by a token at a time)."""
        pos, depth = self._scan
        pos = max(pos, start)
        buf = self.buf
        while pos < len(buf):
            m = _JSON_PIECES.match(buf, pos)
            if m is None:                    # an unterminated string: wait for its end
                break
            piece = m.group()
            if piece in "{[":
                depth += 1
            elif piece in "}]":
                depth -= 1
                if depth == 0:
                    return m.end()
            pos = m.end()
        self._scan = (pos, depth)
        return None


def parse_calls(text: str, tools: list[Tool] | None, truncated: bool = False
                ) -> tuple[str, list[ToolCall]]:
    """(content, calls) for a finished reply; without tools there are no calls. Content is
    the text around the calls (stripped when there are calls), or the reply untouched."""
    if not tools:
        return text, []
    sp = StreamSplitter(tools)
    ev = sp.feed(text) + sp.flush(truncated)
    calls = [v for k, v in ev if k == "call"]
    content = "".join(v for k, v in ev if k == "text")
    return (content.strip() if calls else content), calls
