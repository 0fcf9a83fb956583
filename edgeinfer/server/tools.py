"""Tool calling and reasoning, shared by the OpenAI and Ollama APIs.

- `parse_tools()` validates a request's `tools` (each `parameters` must be a JSON schema).
- `prepare_chat()` turns messages + tools into what the chat template renders: a template
  that knows tools (its text uses `tools`) gets them as the Hugging Face `tools` variable,
  assistant `tool_calls` and `tool` messages as they are; a template without tool support
  (the bundled gemma3's) gets the built-in fallback: the tools stated in the system turn,
  earlier calls written in our envelope, tool results as user turns.
- `call_grammar()`: the grammar that forces a tool call in our envelope when `tool_choice`
  is `required` or names a function (a Lark grammar with llguidance's `%json` schemas).
- `parse_calls()` reads tool calls out of finished text in each family's format (our/Hermes/
  Qwen `<tool_call>{...}</tool_call>`, Mistral `[TOOL_CALLS][...]`, Llama 3 `<|python_tag|>`
  or a bare `{"name": ..., "parameters": ...}` object); `StreamSplitter` does it on a stream:
  text until a trigger, then one structured call per closed envelope, raw tags never out.
- `ThinkSplitter` moves `<think>...</think>` out of the content into reasoning.

The envelope (what the fallback prompt teaches and the grammar forces):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from edgeinfer.engine.grammar import GrammarError, GrammarSpec, check_schema

from .errors import bad_param

OPEN, CLOSE = "<tool_call>", "</tool_call>"
TRIGGERS = (OPEN, "[TOOL_CALLS]", "<|python_tag|>")


@dataclass
class Tool:
    name: str
    description: str = ""
    parameters: dict = field(default_factory=lambda: {"type": "object", "properties": {}})

    def openai(self) -> dict:
        return {"type": "function", "function": {"name": self.name,
                                                 "description": self.description,
                                                 "parameters": self.parameters}}


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


_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


def parse_tools(raw: list | None, param: str = "tools") -> list[Tool]:
    """Validate `tools` ([{type: function, function: {name, description, parameters}}], the
    shape both APIs use). Raises a 400 APIError naming the bad entry."""
    if not raw:
        return []
    if not isinstance(raw, list):
        raise bad_param(param, f"{param} must be a list of tools")
    tools, seen = [], set()
    for i, t in enumerate(raw):
        where = f"{param}[{i}]"
        if hasattr(t, "model_dump"):
            t = t.model_dump(exclude_none=True)
        if not isinstance(t, dict):
            raise bad_param(where, f"{where} must be an object")
        if t.get("type", "function") != "function":
            raise bad_param(f"{where}.type", f"{where}.type {t.get('type')!r} is not supported "
                                             "(only 'function')")
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise bad_param(f"{where}.function", f"{where}.function must be an object")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise bad_param(f"{where}.function.name", f"{where}.function.name must be 1-64 "
                            "letters, digits, '_', '.' or '-'")
        if name in seen:
            raise bad_param(f"{where}.function.name", f"two tools are named {name!r}")
        seen.add(name)
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        try:
            if not isinstance(params, dict):
                raise GrammarError("parameters must be a JSON schema object")
            check_schema(params)
        except GrammarError as e:
            raise bad_param(f"{where}.function.parameters",
                            f"{where}.function.parameters is not a valid JSON schema: {e}") \
                from None
        tools.append(Tool(name, str(fn.get("description") or ""), params))
    return tools


@dataclass
class Choice:
    """What tool_choice asks: mode none | auto | required | named (then `name`)."""
    mode: str = "auto"
    name: str | None = None


def parse_tool_choice(raw: Any, tools: list[Tool], param: str = "tool_choice") -> Choice:
    if raw is None:
        return Choice("auto" if tools else "none")
    if hasattr(raw, "model_dump"):
        raw = raw.model_dump(exclude_none=True)
    if isinstance(raw, str):
        if raw not in ("none", "auto", "required"):
            raise bad_param(param, f"{param} {raw!r} must be 'none', 'auto', 'required' or "
                                   "{'type': 'function', 'function': {'name': ...}}")
        if raw != "none" and not tools:
            raise bad_param(param, f"{param} {raw!r} needs tools")
        return Choice(raw)
    if isinstance(raw, dict):
        fn = raw.get("function") if isinstance(raw.get("function"), dict) else {}
        name = fn.get("name")
        if raw.get("type") != "function" or not isinstance(name, str):
            raise bad_param(param, f"{param} must name a function: "
                                   "{'type': 'function', 'function': {'name': ...}}")
        if name not in {t.name for t in tools}:
            raise bad_param(param, f"{param} names {name!r}, which is not in tools")
        return Choice("named", name)
    raise bad_param(param, f"{param} must be a string or an object")


# ----- prompts -----------------------------------------------------------------------------

def template_supports_tools(template: str) -> bool:
    return bool(re.search(r"\btools\b", template or ""))


def fallback_system(tools: list[Tool], choice: Choice, parallel: bool) -> str:
    lines = ["You can call these functions (JSON schemas of their arguments):"]
    for t in tools:
        lines.append(json.dumps({"name": t.name, "description": t.description,
                                 "parameters": t.parameters}))
    lines.append("")
    lines.append("To call a function, answer with exactly this and nothing else:")
    lines.append(f'{OPEN}\n{{"name": "<function name>", "arguments": {{<arguments>}}}}\n{CLOSE}')
    if parallel:
        lines.append("Several calls may follow one another, one envelope each.")
    if choice.mode == "required":
        lines.append("You must call a function now.")
    elif choice.mode == "named":
        lines.append(f"You must call {choice.name} now.")
    else:
        lines.append("If no function is needed, answer normally.")
    lines.append("A function's result comes back in a message that starts with "
                 "'Result of <name>:'.")
    return "\n".join(lines)


def _args_obj(args: Any) -> Any:
    if isinstance(args, str):
        try:
            return json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return args
    return args


def envelope(name: str, arguments: Any) -> str:
    return f'{OPEN}\n{json.dumps({"name": name, "arguments": _args_obj(arguments)})}\n{CLOSE}'


def prepare_chat(messages: list[dict], tools: list[Tool], choice: Choice, parallel: bool,
                 template: str) -> tuple[list[dict], dict]:
    """(messages, template variables) for rendering. Messages may carry `tool_calls`
    ([{function: {name, arguments}}], arguments a dict or a JSON string) and `tool` turns
    with `tool_call_id` / `tool_name` / `name`."""
    use_tools = bool(tools) and choice.mode != "none"
    if template_supports_tools(template):
        out = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls"):
                m["tool_calls"] = [{"id": c.get("id") or f"call_{i}", "type": "function",
                                    "function": {"name": c["function"]["name"],
                                                 "arguments": _args_obj(c["function"].get(
                                                     "arguments"))}}
                                   for i, c in enumerate(m["tool_calls"])]
            out.append(m)
        return out, ({"tools": [t.openai() for t in tools]} if use_tools else {})
    # the built-in fallback
    ids: dict[str, str] = {}
    out = []
    for m in messages:
        role = m.get("role")
        content = m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            parts = [content] if content else []
            for c in m["tool_calls"]:
                fn = c.get("function") or {}
                if c.get("id"):
                    ids[c["id"]] = fn.get("name", "")
                parts.append(envelope(fn.get("name", ""), fn.get("arguments")))
            out.append({"role": "assistant", "content": "\n".join(parts)})
        elif role == "tool":
            name = m.get("tool_name") or m.get("name") or ids.get(m.get("tool_call_id") or "",
                                                                   "the function")
            out.append({"role": "user", "content": f"Result of {name}: {content}"})
        else:
            out.append({"role": role, "content": content})
    if use_tools:
        sys_text = fallback_system(tools, choice, parallel)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + sys_text}
        else:
            out.insert(0, {"role": "system", "content": sys_text})
    # consecutive user turns (a tool result after a user turn) merge, for strict templates
    merged: list[dict] = []
    for m in out:
        if merged and m["role"] == merged[-1]["role"] == "user":
            merged[-1] = {"role": "user", "content": merged[-1]["content"] + "\n\n" + m["content"]}
        else:
            merged.append(m)
    return merged, {}


# ----- grammars ----------------------------------------------------------------------------

def call_schema(tools: list[Tool]) -> dict:
    from edgeinfer.engine.grammar import closed_objects
    alts = [{"type": "object",
             "properties": {"name": {"const": t.name},
                            "arguments": closed_objects(t.parameters)},
             "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    schema = alts[0] if len(alts) == 1 else {"anyOf": alts}
    # one line, with the separators the fallback prompt shows
    return {**schema, "x-guidance": {"whitespace_flexible": False, "item_separator": ", ",
                                     "key_separator": ": "}}


def call_grammar(tools: list[Tool], choice: Choice, parallel: bool) -> GrammarSpec:
    """required / named: output = one (or, parallel, several) envelopes calling the allowed
    tools. auto: free text that never contains the trigger, or text, the trigger, and then
    valid calls only (a lazy `stop` lexeme ends the text at the trigger)."""
    allowed = [t for t in tools if choice.mode != "named" or t.name == choice.name]
    schema = json.dumps(call_schema(allowed))
    one = f'"{OPEN}\\n" %json {schema} "\\n{CLOSE}"'
    more = ' ("\\n" call)*' if parallel else ""
    if choice.mode == "auto":
        lark = (f"start: FREE | text body{more}\n"
                f"FREE: /(?s:.*)/ & ~/(?s:.*{re.escape(OPEN)}.*)/\n"
                f'text[stop="{OPEN}"]: /(?s:.*)/\n'
                f'body: "\\n" %json {schema} "\\n{CLOSE}"\n'
                f"call: {one}\n")
    else:
        lark = f"start: call{more}\ncall: {one}\n"
    return GrammarSpec("lark", lark)


def auto_grammar_fits(template: str) -> bool:
    """With tool_choice auto, constrain calls only where the model writes our envelope: the
    built-in fallback prompt, or a Hermes/Qwen template (`<tool_call>` JSON). Other families
    (Llama 3 JSON, Mistral [TOOL_CALLS]) are parsed from free output."""
    return not template_supports_tools(template) or OPEN in (template or "")


# ----- parsing -----------------------------------------------------------------------------

def _call_from_obj(obj: Any) -> ToolCall | None:
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("function"), dict):                # {"function": {...}} wrappers
        obj = obj["function"]
    name = obj.get("name")
    args = obj.get("arguments", obj.get("parameters", {}))
    args = _args_obj(args)
    if not isinstance(name, str) or not isinstance(args, dict):
        return None
    return ToolCall(name, args)


def _json_values(text: str) -> list[Any]:
    """Every top-level JSON value in text (objects or arrays), in order."""
    dec, out, i = json.JSONDecoder(), [], 0
    while i < len(text):
        j = min([k for k in (text.find("{", i), text.find("[", i)) if k >= 0], default=-1)
        if j < 0:
            break
        try:
            v, end = dec.raw_decode(text, j)
            out.append(v)
            i = end
        except json.JSONDecodeError:
            i = j + 1
    return out


def parse_calls(text: str, tools: list[Tool] | None = None) -> tuple[str, list[ToolCall]]:
    """(content without the calls, calls) for a finished output. Only names in `tools`
    count (when given); text that is not a valid call stays content."""
    names = {t.name for t in tools} if tools else None

    def ok(c: ToolCall | None) -> bool:
        return c is not None and (names is None or c.name in names)

    calls: list[ToolCall] = []
    if OPEN in text:
        content, rest = text.split(OPEN, 1)
        blocks = (OPEN + rest).split(OPEN)[1:]
        leftover = []
        for b in blocks:
            body, _, after = b.partition(CLOSE)
            vals = _json_values(body)
            c = _call_from_obj(vals[0]) if vals else None
            if ok(c):
                calls.append(c)
                if after.strip():
                    leftover.append(after.strip())
            else:
                leftover.append(OPEN + b)
        if calls:
            return (content.strip() + ("\n" + "\n".join(leftover) if leftover else "")).strip(), \
                calls
        return text, []
    for tag in ("[TOOL_CALLS]", "<|python_tag|>"):
        if tag in text:
            content, rest = text.split(tag, 1)
            for v in _json_values(rest):
                for o in (v if isinstance(v, list) else [v]):
                    c = _call_from_obj(o)
                    if ok(c):
                        calls.append(c)
            if calls:
                return content.strip(), calls
            return text, []
    stripped = text.strip()
    if stripped.startswith("{") or stripped.startswith("["):     # Llama 3.x bare JSON
        vals = _json_values(stripped)
        for v in vals:
            for o in (v if isinstance(v, list) else [v]):
                c = _call_from_obj(o)
                if ok(c) and names is not None:
                    calls.append(c)
        if calls:
            return "", calls
    return text, []


def _holdback(buf: str, tags: tuple[str, ...]) -> int:
    """How many trailing characters of buf could be the start of a tag."""
    n = 0
    for t in tags:
        for k in range(min(len(t) - 1, len(buf)), 0, -1):
            if buf.endswith(t[:k]):
                n = max(n, k)
                break
    return n


class StreamSplitter:
    """Streamed text -> ("text", str) and ("call", ToolCall) events. Text flows until a tool
    trigger; after it everything is held and parsed when an envelope closes (our format) or
    when the stream ends (the others). Raw tags never reach the client."""

    def __init__(self, tools: list[Tool]):
        self.tools = tools
        self.buf = ""
        self.in_call = False
        self.after_call = False           # drop the newlines between envelopes
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> list[tuple[str, Any]]:
        self.buf += text
        ev: list[tuple[str, Any]] = []
        while True:
            if self.after_call:
                self.buf = self.buf.lstrip("\n")
                if not self.buf:
                    return ev
                self.after_call = False
            if not self.in_call:
                hits = [(self.buf.find(t), t) for t in TRIGGERS if t in self.buf]
                if hits:
                    i, _ = min(hits)
                    if i:
                        ev.append(("text", self.buf[:i]))
                    self.buf = self.buf[i:]
                    self.in_call = True
                    continue
                keep = _holdback(self.buf, TRIGGERS)
                if len(self.buf) > keep:
                    ev.append(("text", self.buf[:len(self.buf) - keep]))
                    self.buf = self.buf[len(self.buf) - keep:]
                return ev
            if self.buf.startswith(OPEN) and CLOSE in self.buf:
                block, _, rest = self.buf.partition(CLOSE)
                _, calls = parse_calls(block + CLOSE, self.tools)
                for c in calls:
                    self.calls.append(c)
                    ev.append(("call", c))
                if not calls:                     # not a valid call: it was text after all
                    ev.append(("text", block + CLOSE))
                self.buf = rest
                self.after_call = bool(calls)
                self.in_call = False
                continue
            return ev

    def flush(self) -> list[tuple[str, Any]]:
        if not self.buf:
            return []
        text, calls = parse_calls(self.buf, self.tools)
        if not calls and self.calls and self.buf.startswith(OPEN):
            text = ""        # a further call cut by max_tokens: not content, and not a call
        self.buf = ""
        ev: list[tuple[str, Any]] = []
        if text:
            ev.append(("text", text))
        for c in calls:
            self.calls.append(c)
            ev.append(("call", c))
        return ev


# ----- reasoning ---------------------------------------------------------------------------

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def can_think(engine) -> bool:
    """The model writes <think>...</think>: its template or vocabulary knows the tag."""
    tmpl = getattr(engine, "chat_template", "") or ""
    vocab = getattr(getattr(engine, "tokenizer", None), "token_to_id", {}) or {}
    return THINK_OPEN in tmpl or THINK_OPEN in vocab


class ThinkSplitter:
    """Streamed text -> (reasoning, content) pieces. Reasoning is what sits between <think>
    and </think>; templates that open the block in the prompt (Qwen3, DeepSeek-R1) make the
    output start inside it, so `started=True` begins in reasoning."""

    def __init__(self, started: bool = False):
        self.state = "think" if started else "start"
        self.buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        self.buf += text
        reasoning = content = ""
        while self.buf:
            if self.state == "start":
                s = self.buf.lstrip()
                if s.startswith(THINK_OPEN):
                    self.buf = s[len(THINK_OPEN):]
                    self.state = "think"
                    continue
                if THINK_OPEN.startswith(s):          # could still become <think>
                    return reasoning, content
                self.state = "content"
                continue
            if self.state == "think":
                if THINK_CLOSE in self.buf:
                    r, _, self.buf = self.buf.partition(THINK_CLOSE)
                    reasoning += r
                    self.state = "after"
                    continue
                keep = _holdback(self.buf, (THINK_CLOSE,))
                reasoning += self.buf[:len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep:]
                return reasoning, content
            if self.state == "after":            # the blank lines after </think>
                self.buf = self.buf.lstrip("\n")
                if not self.buf:
                    return reasoning, content
                self.state = "content"
            content += self.buf
            self.buf = ""
        return reasoning, content

    def flush(self) -> tuple[str, str]:
        b, self.buf = self.buf, ""
        return (b, "") if self.state == "think" else ("", b)


def split_thinking(text: str, started: bool = False) -> tuple[str, str]:
    s = ThinkSplitter(started)
    r1, c1 = s.feed(text)
    r2, c2 = s.flush()
    return r1 + r2, c1 + c2


# ----- constraints for a request -----------------------------------------------------------

async def build_constraints(engine, spec: GrammarSpec, n: int, param: str) -> list:
    """n independent matchers for `spec` (one per choice), built off the event loop and off
    the engine thread, bounded in time. A bad or too-slow grammar is a 400 naming `param`."""
    import asyncio

    from edgeinfer.engine import grammar as g

    from .errors import APIError
    tok = engine.tokenizer
    if not hasattr(tok, "token_bytes") or not hasattr(tok, "types"):
        raise APIError(501, "structured output needs edgeinfer's own tokenizer for this model "
                       "(its vocabulary is read by the llama.cpp backend only)",
                       param=param, code="not_implemented")
    vocab = max(int(engine.cfg.vocab_size), tok.vocab_size)

    def work() -> list:
        view = g.tokenizer_view(tok, vocab)
        return [g.GrammarConstraint(g.compile_spec(view, spec), vocab, tok.eot_ids)
                for _ in range(n)]
    try:
        return await asyncio.wait_for(asyncio.to_thread(work), g.COMPILE_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise bad_param(param, f"{param}: the grammar took more than "
                               f"{g.COMPILE_TIMEOUT_S:g} s to compile; simplify it") from None
    except GrammarError as e:
        raise APIError(400, f"{param}: {e}", param=param, code="invalid_grammar") from None
