"""The Jinja side of chat templates (edgeinfer/formats/chat_template.py): the immutable
sandbox with its size caps and time budget, compiling, rendering. Imported on a template's
first compile, so that a process that renders none (an engine process, a raw completion)
does not load Jinja (~15 ms)."""
from __future__ import annotations

import json
import operator
import re
import sys
import time
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2 import nodes, pass_eval_context
from jinja2.compiler import CodeGenerator, Frame, optimizeconst
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .chat_errors import ChatTemplateError, ChatTemplateSecurityError

MAX_OUTPUT_CHARS = 4_000_000     # a prompt far larger than any context window
MAX_REPEAT = 1_000_000           # 'x' * n, [..] * n, widths
MAX_VALUE_CHARS = 16_000_000     # any one string or list the template builds
MAX_RENDER_SECONDS = 2.0         # real templates render in milliseconds


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
def compile_template(template: str) -> jinja2.Template:
    try:
        return _env().from_string(template)
    except TemplateError as e:
        where = f" (line {e.lineno})" if getattr(e, "lineno", None) else ""
        raise ChatTemplateError(f"the chat template does not parse{where}: {e.message}") from None


def render(template: str, ctx: dict[str, Any]) -> str:
    """The template rendered with these variables, in the sandbox (chat_template.render_chat)."""
    tmpl = compile_template(template)
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
