"""Tool calling and reasoning, shared by the OpenAI and Ollama APIs.

- `parse_tools()` validates a request's `tools` (each `parameters` must be a JSON schema).
- `prepare_chat()` turns messages + tools into what the chat template renders: a template
  that knows tools (its text uses `tools`) gets them as the Hugging Face `tools` variable,
  assistant `tool_calls` and `tool` messages as they are; a template without tool support
  (the bundled gemma3's) gets the built-in fallback: the tools stated in the system turn,
  earlier calls written in our envelope, tool results as user turns.
- `call_grammar()` (`tool_grammar`): the grammar that forces a call in our envelope when
  `tool_choice` is `required` or names a function, and the lazy grammar of auto mode (free
  text until a call starts, then only a valid call of a declared tool).
- Reading calls out of the model's text (every shape models write: tags, fences, bare JSON,
  Mistral, Llama 3; validated against each tool's schema) is `tool_parse`'s job;
  `parse_calls` and `StreamSplitter` are re-exported here for the API modules.
- `ThinkSplitter` moves `<think>...</think>` out of the content into reasoning.

The envelope (what the fallback prompt teaches and the grammar forces):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
"""
from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from typing import Any

from jsonschema.exceptions import SchemaError

from edgeinfer.engine import grammar as g
from edgeinfer.engine.grammar import GrammarError, GrammarSpec, check_schema

from .errors import APIError, bad_param
from .tool_grammar import (auto_grammar_fits, auto_spec, call_grammar, call_schema,  # noqa: F401
                           template_supports_tools)
from .tool_parse import (CLOSE, OPEN, StreamSplitter, Tool, ToolCall, holdback,  # noqa: F401
                         args_obj as _args_obj, parse_calls)


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
            tool = Tool(name, str(fn.get("description") or ""), params)
            tool.validator()          # the schema that calls are checked against must be one
        except GrammarError as e:
            raise bad_param(f"{where}.function.parameters",
                            f"{where}.function.parameters is not a valid JSON schema: {e}") \
                from None
        except SchemaError as e:
            raise bad_param(f"{where}.function.parameters",
                            f"{where}.function.parameters is not a valid JSON schema: "
                            f"{e.message}") from None
        tools.append(tool)
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
                keep = holdback(self.buf, (THINK_CLOSE,))
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
    tok = engine.tokenizer
    if not hasattr(tok, "token_bytes") or not hasattr(tok, "types"):
        raise APIError(501, "structured output needs edgeinfer's own tokenizer for this model "
                       "(its vocabulary is read by the llama.cpp backend only)",
                       param=param, code="not_implemented")
    vocab = max(int(engine.cfg.vocab_size), tok.vocab_size)

    def work() -> list:
        grammars = g.grammars_for(tok, vocab)      # the model's: it goes with its tokenizer
        return [grammars.constraint(spec) for _ in range(n)]
    try:
        return await asyncio.wait_for(asyncio.to_thread(work), g.COMPILE_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise bad_param(param, f"{param}: the grammar took more than "
                               f"{g.COMPILE_TIMEOUT_S:g} s to compile; simplify it") from None
    except GrammarError as e:
        raise APIError(400, f"{param}: {e}", param=param, code="invalid_grammar") from None
