"""gpt-oss's Harmony format: the output split into reasoning, content and tool calls.

A Harmony completion is a run of messages, each a header then a body:

    <|channel|>analysis<|message|>...reasoning...<|end|>
    <|start|>assistant<|channel|>final<|message|>...answer...<|return|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>

(the prompt ends in `<|start|>assistant`, so the first header starts at `<|channel|>`; the
recipient `to=...` may also sit before the channel, right after the role). `<|return|>` and
`<|call|>` end generation, so they never reach the text. Channels: `analysis` -> reasoning,
`final` -> content, `commentary` with a `functions.NAME` recipient -> a tool call, commentary
without one (a preamble meant for the user) -> content.

`HarmonySplitter` reads the detokenized stream (the special tokens rendered as text) and
gives the same events as tool_parse.StreamSplitter plus ("reasoning", str): reasoning and
content as they come, a call once its message is complete. A call that names no declared
tool, or whose arguments are not a JSON object valid for its schema, is not dropped: its
arguments come out as content, so the client sees what the model wrote.
"""
from __future__ import annotations

import json
import re
from typing import Any

from edgeinfer.engine.grammar import GrammarSpec

from .errors import bad_param
from .tool_grammar import args_schema
from .tool_parse import Tool, ToolCall, holdback

CHANNEL, MESSAGE, START, END = "<|channel|>", "<|message|>", "<|start|>", "<|end|>"
CONSTRAIN = "<|constrain|>"
RETURN, CALL = "<|return|>", "<|call|>"
# what ends a body: the message's end, or a new header the model began without <|end|>
_BODY_ENDS = (END, START, CHANNEL, RETURN, CALL)
# the prompt ends in `<|start|>assistant`, so the first header may open with the recipient
# (` to=functions.NAME<|channel|>commentary json<|message|>`, as gpt-oss's template writes
# calls) as well as with the channel
_HEADER_OPENS = (CHANNEL, START, "to=")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL_NAME = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
MAX_HEADER = 512          # longer than any real header: a runaway one is text, not markup


def is_harmony(template: str, vocab: dict | None) -> bool:
    """The model speaks Harmony: its vocabulary or its template knows the channel tags."""
    vocab = vocab or {}
    if CHANNEL in vocab and MESSAGE in vocab:
        return True
    return CHANNEL in (template or "") and MESSAGE in (template or "")


def uses_effort(template: str) -> bool:
    """The template takes a `reasoning_effort` variable (gpt-oss's puts it in the system
    message); other templates cannot be told a level."""
    return "reasoning_effort" in (template or "")


class HarmonySplitter:
    def __init__(self, tools: list[Tool], calls_on: bool = True):
        self.tools = {t.name: t for t in tools} if calls_on else {}
        self.buf = ""
        self.state = "start"          # start | header | body
        self.kind = "content"         # the body's destination: reasoning | content | call
        self.recipient: str | None = None

    # ----- public -------------------------------------------------------------------------

    def feed(self, text: str) -> list[tuple[str, Any]]:
        self.buf += text
        return self._run(final=False)

    def flush(self, truncated: bool = False) -> list[tuple[str, Any]]:
        """End of output. A call cut short by the length limit is not a call: its partial
        arguments come out as content."""
        ev = self._run(final=True)
        if self.state == "body":
            if self.kind == "call":
                ev += self._finish_call(self.buf, truncated)
            elif self.buf:
                ev.append((self._dest(), self.buf))
        elif self.state == "header" and self.buf.startswith("to="):
            ev.append(("text", self.buf))      # never became a header: it was text
        # an unfinished header of tags is markup the model never completed: nothing to show
        self.buf = ""
        self.state = "start"
        return ev

    # ----- the machine --------------------------------------------------------------------

    def _dest(self) -> str:
        return "reasoning" if self.kind == "reasoning" else "text"

    def _run(self, final: bool) -> list[tuple[str, Any]]:
        ev: list[tuple[str, Any]] = []
        while self.buf:
            if self.state == "start":
                s = self.buf.lstrip()
                if s.startswith(_HEADER_OPENS):
                    self.buf, self.state = s, "header"
                    continue
                if not final and any(t.startswith(s) for t in _HEADER_OPENS):
                    break                          # could still become a header
                # no header at all: plain text is the answer
                self.state, self.kind, self.recipient = "body", "content", None
                continue
            if self.state == "header":
                i = self.buf.find(MESSAGE)
                if i < 0:
                    if len(self.buf) > MAX_HEADER:       # not a header after all
                        self.state, self.kind = "body", "content"
                        ev.append(("text", self.buf))
                        self.buf = ""
                    break
                self._header(self.buf[:i])
                self.buf = self.buf[i + len(MESSAGE):]
                self.state = "body"
                continue
            # body
            cut = _first(self.buf, _BODY_ENDS)
            if cut is None:
                if self.kind == "call":              # arguments are read whole
                    break
                keep = 0 if final else holdback(self.buf, _BODY_ENDS)
                out = self.buf[:len(self.buf) - keep]
                if out:
                    ev.append((self._dest(), out))
                self.buf = self.buf[len(self.buf) - keep:]
                break
            i, tag = cut
            body = self.buf[:i]
            if self.kind == "call":
                ev += self._finish_call(body, False)
            elif body:
                ev.append((self._dest(), body))
            # <|end|>, <|return|>, <|call|> close the message; <|start|> / <|channel|> open
            # the next header (kept so the header sees it)
            self.buf = self.buf[i + len(tag):] if tag in (END, RETURN, CALL) else self.buf[i:]
            self.state = "start"
        return ev

    def _header(self, header: str) -> None:
        m = _CHANNEL_NAME.search(header)
        channel = m.group(1).lower() if m else ""
        r = _RECIPIENT.search(header.replace(CONSTRAIN, " "))
        self.recipient = r.group(1) if r else None
        if self.recipient and self.recipient.startswith("functions."):
            self.kind = "call"
        elif channel == "analysis":
            self.kind = "reasoning"
        else:       # final, commentary preambles, anything unknown: the user's to read
            self.kind = "content"

    def _finish_call(self, body: str, truncated: bool) -> list[tuple[str, Any]]:
        name = (self.recipient or "")[len("functions."):]
        tool = self.tools.get(name)
        if tool is not None and not truncated:
            try:
                args = json.loads(body) if body.strip() else {}
            except (json.JSONDecodeError, RecursionError):
                args = None
            if isinstance(args, dict) and tool.accepts(args):
                return [("call", ToolCall(name, args))]
        return [("text", body)] if body else []


def _first(buf: str, tags: tuple[str, ...]) -> tuple[int, str] | None:
    best = None
    for t in tags:
        i = buf.find(t)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, t)
    return best


def split_harmony(text: str, tools: list[Tool] | None = None, truncated: bool = False
                  ) -> tuple[str, str, list[ToolCall]]:
    """A whole reply -> (reasoning, content, calls), the same as streaming it."""
    s = HarmonySplitter(tools or [])
    return _collect(s.feed(text) + s.flush(truncated))


def _collect(events: list[tuple[str, Any]]) -> tuple[str, str, list[ToolCall]]:
    r = "".join(v for k, v in events if k == "reasoning")
    c = "".join(v for k, v in events if k == "text")
    return r, c, [v for k, v in events if k == "call"]


# ----- what the API modules ask -----------------------------------------------------------

EFFORTS = ("low", "medium", "high")


def engine_harmony(engine) -> bool:
    vocab = getattr(getattr(engine, "tokenizer", None), "token_to_id", None)
    return is_harmony(getattr(engine, "chat_template", "") or "", vocab)


def effort_vars(engine, effort: Any, param: str) -> dict:
    """Template variables for a reasoning level: `reasoning_effort` where the template takes
    it; a level the model cannot be given is a 400, not silently dropped."""
    if effort is None:
        return {}
    if effort not in EFFORTS:
        raise bad_param(param, f"{param} {effort!r} must be \"low\", \"medium\" or \"high\"")
    if not uses_effort(getattr(engine, "chat_template", "") or ""):
        raise bad_param(param, f"{param}: this model's chat template takes no reasoning "
                               "level (only gpt-oss style templates with reasoning_effort do)")
    return {"reasoning_effort": effort}


def with_thinking(messages: list[dict]) -> list[dict]:
    """Earlier assistant reasoning under the name gpt-oss's template reads (`thinking`):
    OpenAI clients send it back as `reasoning_content` (or `reasoning`)."""
    out = []
    for m in messages:
        if m.get("role") == "assistant" and not m.get("thinking"):
            r = m.get("reasoning_content") or m.get("reasoning")
            if isinstance(r, str) and r:
                m = {**m, "thinking": r}
        out.append(m)
    return out


def call_grammar(tools: list[Tool], choice, vocab: dict | None = None) -> GrammarSpec:
    """tool_choice required / named for a Harmony model: optional reasoning on the analysis
    channel, then one call on the commentary channel to an allowed function, its arguments by
    the tool's schema. The markup is written as the vocabulary's special tokens (Lark's
    <|...|> syntax: the text grammar of other models cannot see them), as text where the
    vocabulary has no such token. The output ends with the arguments (the model's <|call|>
    would end it anyway)."""
    vocab = vocab or {}

    def m(tag: str) -> str:
        return tag if tag in vocab else json.dumps(tag)
    allowed = [t for t in tools if choice.mode != "named" or t.name == choice.name]
    rules = ["start: analysis? call",
             f'analysis: {m(CHANNEL)} "analysis" {m(MESSAGE)} THOUGHT {m(END)} {m(START)} '
             '"assistant"',
             # reasoning never holds the end tag as text (else, where the markup is text, the
             # lexeme could swallow it)
             r"THOUGHT: /(?s:.*)/ & ~/(?s:.*<\|end\|>.*)/",
             f'call: {m(CHANNEL)} "commentary to=functions." ('
             + " | ".join(f"call{i}" for i in range(len(allowed))) + ")"]
    for i, t in enumerate(allowed):
        rules.append(f"call{i}: {json.dumps(t.name + ' ')} {m(CONSTRAIN)} \"json\" "
                     f"{m(MESSAGE)} %json {args_schema(t)}")
    return GrammarSpec("lark", "\n".join(rules) + "\n")


def auto_grammar(tools: list[Tool], vocab: dict | None = None, eos_ids=()) -> GrammarSpec | None:
    """tool_choice auto (tools declared) for a Harmony model: free messages, or a call to a
    declared function whose arguments follow its schema. A lazy grammar over Harmony's
    special tokens: every message is free (header text, <|channel|> / <|constrain|>, then
    <|message|> and any body) except that header text may not name a `functions.` recipient;
    the one lexeme that does (CALL_TO: header text up to its first `to=functions.`) leaves
    only the call: a declared name, the rest of the header in a layout the template and
    HarmonySplitter know, <|message|> and the arguments by the tool's schema (%json). The
    call ends the output (the model's <|call|> ends it anyway). A reply whose headers name
    no function is constrained by nothing but the markup's order (one <|message|> per
    message, <|end|><|start|> between messages), so its tokens are the ones the model would
    have sampled; bodies are free text, `to=functions.` included.

    None where the vocabulary lacks the markup tokens (gpt-oss has them all): spelled as
    text, the tags would have to be kept out of free text, and the lexemes that do so are
    not reliable; such a model's calls are read from free output, as before."""
    vocab = vocab or {}
    if not tools or not all(t in vocab for t in (CHANNEL, MESSAGE, START, END, CONSTRAIN)):
        return None
    to = r"to=functions\."
    # a body is any tokens but the markup and the ends, matched as tokens, not text: a text
    # lexeme holds valid UTF-8 only, and a model may write a character's bytes apart
    markup = sorted({int(vocab[t]) for t in (CHANNEL, MESSAGE, START, END, CONSTRAIN,
                                             RETURN, CALL) if t in vocab}
                    | {int(i) for i in eos_ids})
    rules = [
        "start: (msg sep)* (msg | call)",
        f"sep: {END} {START}",
        # a message: its header, then <|message|> and the body (a reply that opens with no
        # header is header text to the grammar, content to the splitter)
        f"msg: hdr ({MESSAGE} body)?",
        f"hdr: (HTEXT | {CHANNEL} | {CONSTRAIN})*",
        f"HTEXT: /(?s:.+)/ & ~/(?s:.*{to}.*)/",
        "body: <[^" + ",".join(map(str, markup)) + "]>*",
        # header text up to (and with) its first function recipient: the call's trigger
        f"CALL_TO: /(?s:.*){to}/ & ~/(?s:.*{to}(?s:.+))/",
        "call: hdr CALL_TO (" + " | ".join(f"call{i}" for i in range(len(tools))) + ")",
        # after the name: ` <|constrain|>json` (our template; gpt-oss's usual output),
        # ` json`, or the channel after the recipient (`<|channel|>commentary json`)
        f'ctail: " "? {CONSTRAIN} "json" | " json" '
        f'| {CHANNEL} "commentary" (" json" | " "? {CONSTRAIN} "json")?',
    ]
    for i, t in enumerate(tools):
        rules.append(f"call{i}: {json.dumps(t.name)} ctail {MESSAGE} %json {args_schema(t)}")
    return GrammarSpec("lark", "\n".join(rules) + "\n")


def auto_spec(engine, tools: list[Tool], choice) -> GrammarSpec | None:
    """The Harmony auto-mode grammar for a request (tools given, tool_choice auto), or None:
    the one rule every API follows."""
    if not tools or choice.mode != "auto":
        return None
    tok = engine.tokenizer
    return auto_grammar(tools, getattr(tok, "token_to_id", None), getattr(tok, "eot_ids", ()))
