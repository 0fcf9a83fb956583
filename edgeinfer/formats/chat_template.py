"""Chat templates: render a conversation into the prompt text a model was trained on.

Templates come from the GGUF (`tokenizer.chat_template`, Hugging Face Jinja) and are untrusted:
they run in Jinja's immutable sandbox, where reaching for Python internals (`__class__`,
`__globals__`, ...) raises at once, everything that can grow a value (repetition, `+`, `~`,
join, widths, formats, big integers) is size-capped, the output is capped and a render has a
time budget. The environment mirrors Hugging Face's (trim_blocks, lstrip_blocks,
loopcontrols, `raise_exception`, `strftime_now`, a non-HTML-escaping `tojson`) so real
templates render the same text they render in `transformers`.

GGUFs without a template get a built-in one per architecture (edgeinfer/formats/templates/*.jinja).
"""
from __future__ import annotations

import json
import operator
import re
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from importlib import resources
from typing import Any

import jinja2
from jinja2 import nodes, pass_eval_context
from jinja2.compiler import CodeGenerator, Frame, optimizeconst
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_OUTPUT_CHARS = 4_000_000     # a prompt far larger than any context window
MAX_REPEAT = 1_000_000           # 'x' * n, [..] * n, widths
MAX_VALUE_CHARS = 16_000_000     # any one string or list the template builds
MAX_RENDER_SECONDS = 2.0         # real templates render in milliseconds


class ChatTemplateError(ValueError):
    """A template that cannot be rendered; the message says why, for a person."""


class ChatTemplateSecurityError(ChatTemplateError):
    """A template that tried to escape the sandbox or exhaust resources."""


class _TemplateRaised(Exception):
    """raise_exception() called by the template itself."""


class _GenerationTag(Extension):
    """Hugging Face's {% generation %}...{% endgeneration %} marks assistant text for
    training masks; for rendering it is a no-op around its body."""
    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


_WIDTH_METHODS = frozenset(["ljust", "rjust", "center", "zfill", "expandtabs"])
_BIG_WIDTH = re.compile(r"\d{7,}")       # a format width or precision of a million or more


def _check_width(n: Any) -> None:
    if isinstance(n, int) and n > MAX_REPEAT:
        raise SecurityError("the template asks for a string that is too long")


# widths taken from arguments: '{:>{w}}'.format(..., w=n) and '%*d' % (n, x)
_ARG_WIDTH = re.compile(r"\{[^{}]*:[^{}]*\{|%[-+ #0]*\d*\.?\*")


def _check_format(fmt: Any) -> None:
    if isinstance(fmt, str) and (_BIG_WIDTH.search(fmt) or _ARG_WIDTH.search(fmt)):
        raise SecurityError("the template formats with a width that is too large")


class _Budget:
    """Stops a template that runs too long (loops that print nothing escape the output cap).

    A trace hook counts lines executed in compiled template code only ("<template>" frames)
    and checks the clock every 1024 lines; raising inside the hook aborts the render.
    """

    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds
        self.lines = 0

    def global_trace(self, frame: Any, event: str, arg: Any) -> Any:
        return self.local_trace if frame.f_code.co_filename == "<template>" else None

    def local_trace(self, frame: Any, event: str, arg: Any) -> Any:
        self.lines += 1
        if not self.lines & 1023 and time.monotonic() > self.deadline:
            raise SecurityError("the template ran for too long")
        return self.local_trace


def _checked_join(parts: Any, sep: str = "") -> str:
    parts = [str(p) for p in parts]
    if sum(map(len, parts)) + len(sep) * len(parts) > MAX_VALUE_CHARS:
        raise SecurityError("the template builds a string that is too long")
    return sep.join(parts)


class _CodeGenerator(CodeGenerator):
    """`a ~ b` compiles to a length-checked join (Jinja has no hook for it otherwise)."""

    @optimizeconst
    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.checked_join((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _Sandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset(["*", "**", "%", "+"])
    code_generator_class = _CodeGenerator
    checked_join = staticmethod(_checked_join)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str):
            name = getattr(__obj, "__name__", "")
            if name in _WIDTH_METHODS:
                for v in (*args, *kwargs.values()):
                    _check_width(v)
            elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) \
                    and isinstance(args[1], str):
                # the exact result length, without building it
                grow = owner.count(args[0]) * (len(args[1]) - len(args[0]))
                if len(owner) + grow > MAX_VALUE_CHARS:
                    raise SecurityError("the template builds a string that is too long")
        return super().call(__context, __obj, *args, **kwargs)

    def wrap_str_format(self, value: Any) -> Any:
        # Jinja swaps str.format for its sandboxed formatter at attribute access
        if getattr(value, "__name__", "") in ("format", "format_map") and \
                isinstance(getattr(value, "__self__", None), str):
            _check_format(value.__self__)
        return super().wrap_str_format(value)

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        # Jinja returns a silent Undefined here; an untrusted template gets no second try.
        raise SecurityError(f"access to attribute {attribute!r} of a "
                            f"{type(obj).__name__!r} object is not allowed")

    def call_binop(self, context: Any, operator_: str, left: Any, right: Any) -> Any:
        if operator_ == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) \
                        and len(seq) * n > MAX_REPEAT:
                    raise SecurityError("the template builds a sequence that is too long")
            if isinstance(left, int) and isinstance(right, int) \
                    and left.bit_length() + right.bit_length() > 4096:
                raise SecurityError("the template computes a number that is too large")
            return operator.mul(left, right)
        if operator_ == "+":
            if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)) \
                    and len(left) + len(right) > MAX_VALUE_CHARS:
                raise SecurityError("the template builds a sequence that is too long")
            return operator.add(left, right)
        if operator_ == "%":
            _check_format(left)
            return operator.mod(left, right)
        if operator_ == "**":
            if isinstance(right, (int, float)) and abs(right) > 64:
                raise SecurityError("the template computes a power that is too large")
            return operator.pow(left, right)
        return super().call_binop(context, operator_, left, right)


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False, ensure_ascii: bool = False) -> str:
    # Hugging Face's tojson: no HTML escaping, unicode kept as is
    if isinstance(indent, int) and indent > 64 or isinstance(indent, str) and len(indent) > 64:
        raise SecurityError("the template asks for a JSON indent that is too large")
    return json.dumps(value, indent=indent, separators=separators, sort_keys=sort_keys,
                      ensure_ascii=ensure_ascii)


def _capped_join(join: Any) -> Any:
    @pass_eval_context
    def capped(eval_ctx: Any, value: Any, d: str = "", attribute: Any = None) -> str:
        items = list(value)
        if sum(len(x) if isinstance(x, str) else 16 for x in items) + len(d) * len(items) \
                > MAX_VALUE_CHARS:
            raise SecurityError("the template builds a string that is too long")
        return join(eval_ctx, items, d, attribute)
    return capped


def _capped_filter(f: Any, arg: str) -> Any:
    def capped(value: Any, *args: Any, **kwargs: Any) -> Any:
        for v in (*args, *kwargs.values()):
            _check_width(v)
        return f(value, *args, **kwargs)
    return capped


@lru_cache(maxsize=1)
def _env() -> _Sandbox:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True,
                   extensions=["jinja2.ext.loopcontrols", _GenerationTag])
    env.filters["tojson"] = _tojson
    # width-taking filters run even at compile time (constant folding): cap them
    for name, arg in (("center", "width"), ("indent", "width"), ("wordwrap", "width")):
        env.filters[name] = _capped_filter(env.filters[name], arg)
    join = env.filters["join"]
    env.filters["join"] = _capped_join(join)
    fmt = env.filters["format"]
    env.filters["format"] = lambda value, *a, **kw: (_check_format(value), fmt(value, *a, **kw))[1]
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    try:
        return _env().from_string(template)
    except TemplateError as e:
        where = f" (line {e.lineno})" if getattr(e, "lineno", None) else ""
        raise ChatTemplateError(f"the chat template does not parse{where}: {e.message}") from None


def _flatten(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI multi-part content [{"type": "text", "text": ...}] -> one string per message."""
    out = []
    for m in messages:
        c = m.get("content")
        if isinstance(c, list):
            text = "".join(p.get("text", "") for p in c
                           if isinstance(p, dict) and p.get("type", "text") == "text")
            m = {**m, "content": text}
        out.append(m)
    return out


def render_chat(template: str, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                bos_token: str = "", eos_token: str = "", flatten_content: bool = True,
                **extra: Any) -> str:
    """Render `messages` with a Hugging Face chat template in the sandbox.

    `extra` is passed to the template as variables (tools, documents, enable_thinking,
    date_string, ...). Raises ChatTemplateError (ChatTemplateSecurityError for escapes).
    """
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise ChatTemplateError("messages must be a list of objects with a role and content")
    tmpl = _compile(template)
    ctx = dict(extra)
    ctx.update(messages=_flatten(messages) if flatten_content else messages,
               add_generation_prompt=add_generation_prompt, bos_token=bos_token,
               eos_token=eos_token)
    budget = _Budget(MAX_RENDER_SECONDS)
    previous = sys.gettrace()
    sys.settrace(budget.global_trace)
    try:
        parts = []
        size = 0
        for chunk in tmpl.generate(**ctx):
            size += len(chunk)
            if size > MAX_OUTPUT_CHARS:
                raise SecurityError("the template output is too large")
            parts.append(chunk)
        return "".join(parts)
    except SecurityError as e:
        raise ChatTemplateSecurityError(f"the chat template was stopped by the sandbox: {e}") \
            from None
    except _TemplateRaised as e:
        raise ChatTemplateError(f"the chat template rejected the conversation: {e}") from None
    except TemplateError as e:
        raise ChatTemplateError(f"the chat template failed: {e}") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError,
            OverflowError, RecursionError) as e:
        raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}") from None
    finally:
        sys.settrace(previous)


# --- built-in fallbacks -----------------------------------------------------------------------

BUILTIN_NAMES = ("gemma", "llama2", "llama3", "chatml", "harmony")


def builtin_template(name: str) -> str:
    """The text of a bundled template (one of BUILTIN_NAMES)."""
    if name not in BUILTIN_NAMES:
        raise ChatTemplateError(f"no built-in chat template named {name!r}")
    return (resources.files("edgeinfer.formats") / "templates" / f"{name}.jinja").read_text("utf-8")


def builtin_name_for(metadata: dict[str, Any], arch: str | None = None) -> str:
    """Which built-in template fits a model that ships none."""
    arch = (arch or metadata.get("general.architecture") or "").lower()
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    vocab = set(tokens) if len(tokens) < 2_000_000 else set()
    if "<|channel|>" in vocab and "<|message|>" in vocab:     # gpt-oss's Harmony
        return "harmony"
    if arch.startswith("gemma"):
        return "gemma"
    if arch.startswith("qwen"):
        return "chatml"
    if "<|start_header_id|>" in vocab and "<|eot_id|>" in vocab:
        return "llama3"
    if "<|im_start|>" in vocab:
        return "chatml"
    if "<start_of_turn>" in vocab:
        return "gemma"
    if arch in ("llama", "mistral") or "[INST]" in vocab or "<s>" in vocab:
        return "llama2"
    return "chatml"


def chat_template_for(metadata: dict[str, Any], arch: str | None = None) -> str:
    """The model's own template (`tokenizer.chat_template`) or the built-in fallback."""
    own = metadata.get("tokenizer.chat_template")
    if isinstance(own, str) and own.strip():
        return own
    return builtin_template(builtin_name_for(metadata, arch))


def special_token_strings(metadata: dict[str, Any]) -> dict[str, str]:
    """bos_token / eos_token texts for render_chat from GGUF metadata."""
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    out = {}
    for key, name in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id")):
        i = metadata.get(f"tokenizer.ggml.{name}")
        out[key] = tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else ""
    return out


def encode_prompt(tokenizer: Any, prompt: str) -> list[int]:
    """Token ids for a rendered chat prompt: specials parsed, BOS added unless the template
    already wrote it (llama.cpp would otherwise start the prompt with two BOS tokens)."""
    ids = tokenizer.encode(prompt, add_special=True, parse_special=True)
    bos = tokenizer.bos_id
    if tokenizer.add_bos and bos is not None and len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
        ids = ids[1:]
    return ids


@dataclass(frozen=True)
class ChatFormat:
    """Everything needed to turn messages into a prompt for one model."""
    template: str
    bos_token: str
    eos_token: str
    builtin: str | None          # the fallback's name when the GGUF has no template

    @classmethod
    def from_gguf(cls, metadata: dict[str, Any], arch: str | None = None) -> "ChatFormat":
        own = metadata.get("tokenizer.chat_template")
        has_own = isinstance(own, str) and bool(own.strip())
        name = None if has_own else builtin_name_for(metadata, arch)
        template = own if has_own else builtin_template(name)  # type: ignore[arg-type]
        tokens = special_token_strings(metadata)
        _compile(template)       # a broken template fails at load, not at the first request
        return cls(template=template, bos_token=tokens["bos_token"],
                   eos_token=tokens["eos_token"], builtin=name)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               **extra: Any) -> str:
        return render_chat(self.template, messages, add_generation_prompt=add_generation_prompt,
                           bos_token=self.bos_token, eos_token=self.eos_token, **extra)

    def encode(self, tokenizer: Any, messages: list[dict[str, Any]],
               add_generation_prompt: bool = True, **extra: Any) -> list[int]:
        """Prompt token ids for `messages` (one BOS, special tokens parsed)."""
        return encode_prompt(tokenizer, self.render(messages, add_generation_prompt, **extra))
