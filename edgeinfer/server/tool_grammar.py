"""Grammars for tool calls (llguidance Lark), forced or lazy.

- `tool_choice` required / a named function: the whole output is one (or, parallel, several)
  `<tool_call>` envelopes calling an allowed tool, arguments by the tool's schema (`%json`).
- auto: a lazy grammar, as llama.cpp's grammar triggers and vLLM's structural tags. The reply
  is free text until a call starts; from the trigger on, the rest must be a valid call of a
  declared tool, so its arguments always parse and validate. The triggers:

      <tool_call>                      anywhere (Hermes / Qwen, and our fallback prompt)
      {"name": "get_weather"           at the start of the reply (bare JSON, Llama 3's)
      [{"name": "get_weather"          at the start (an array of calls)
      ```json\\n{"name": "get_weather"  at the start (a fenced call; ``` without a language)

  The leads end with a declared tool's name and its closing quote, as llama.cpp's trigger
  patterns do: a reply opening with `{"name": "Alice"` is someone's JSON, not a call.

  How: three kinds of lexemes compete from the first byte. FREE is any text that contains no
  `<tool_call>` and does not start with a lead; TEXT_TC is text up to the first
  `<tool_call>` (lazy: it ends right there); the leads are the openings above. They exclude
  each other, so at every byte exactly the alternatives the text so far allows stay alive:
  a reply that never writes a trigger is FREE to the end, untouched; once a trigger
  completes, only the call grammar is left. After the call(s) the grammar is complete and
  only end-of-turn (or a little whitespace) may follow, so the model can always stop.
"""
from __future__ import annotations

import json
import re

from edgeinfer.engine.grammar import GrammarSpec, closed_objects

from .tool_parse import CLOSE, OPEN, Tool

# bounded whitespace: a small model must not be able to loop on newlines inside a call
_W = r"[ \t\r\n]"
_NAME_KEY = rf'\{{{_W}{{0,4}}"name"{_W}{{0,2}}:{_W}{{0,2}}"'          # {"name": "
_OPENINGS = {                     # how a reply may open with a call, up to its first object
    "obj": rf"{_W}{{0,8}}",
    "arr": rf"{_W}{{0,8}}\[{_W}{{0,4}}",
    "fence": rf"{_W}{{0,8}}```(json)?[ \t]{{0,2}}\n{_W}{{0,4}}",
    "fence_arr": rf"{_W}{{0,8}}```(json)?[ \t]{{0,2}}\n{_W}{{0,4}}\[{_W}{{0,4}}",
}
_JSON_OPTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _rx(s: str) -> str:
    """s as a literal inside a /regex/ (Rust regex syntax; '/' ends the Lark regex)."""
    return re.sub(r"([\\.^$|?*+()\[\]{}/\-])", r"\\\1", s)


def call_schema(tools: list[Tool]) -> dict:
    alts = [{"type": "object",
             "properties": {"name": {"const": t.name},
                            "arguments": closed_objects(t.parameters)},
             "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    schema = alts[0] if len(alts) == 1 else {"anyOf": alts}
    # one line, with the separators the fallback prompt shows
    return {**schema, "x-guidance": _JSON_OPTS}


def args_schema(t: Tool) -> str:
    return json.dumps({**closed_objects(t.parameters), "x-guidance": _JSON_OPTS})


def _lazy_auto(tools: list[Tool], parallel: bool) -> str:
    """The auto-mode grammar (see the module doc)."""
    names = [_rx(t.name) for t in tools]
    # a lead ends with a declared tool's name and its closing quote (as llama.cpp's trigger
    # patterns do): a reply opening with {"name": "Alice", ...} is someone's JSON, not a call
    lead_any = ("(" + "|".join(_OPENINGS.values()) + ")" + _NAME_KEY + "(" + "|".join(names)
                + ')"')
    more = " (ITEM rest)*" if parallel else ""           # further calls in an array
    rules = [
        "start: FREE | text_tc tc_calls | lead",
        rf"FREE: /(?s:.*)/ & ~/(?s:.*{_rx(OPEN)}.*)/ & ~/{lead_any}(?s:.*)/",
        "text_tc[lazy]: TEXT_TC",
        rf"TEXT_TC: /(?s:.*){_rx(OPEN)}/ & ~/{lead_any}(?s:.*)/",
        "tc_calls: CALL_OPEN rest TC_CLOSE"
        + (" (TC_AGAIN CALL_OPEN rest TC_CLOSE)*" if parallel else "") + " TAIL?",
        "lead: first_obj TAIL? | first_fence FENCE_END TAIL?"
        f" | first_arr{more} ARR_END TAIL? | first_fence_arr{more} ARR_END FENCE_END TAIL?",
        "rest: " + " | ".join(f"NAME{i} args{i}" for i in range(len(tools))),
        rf"CALL_OPEN: /{_W}{{0,4}}{_NAME_KEY}/",
        rf"ITEM: /{_W}{{0,4}},{_W}{{0,4}}{_NAME_KEY}/",
        # "arguments" (or Llama 3's "parameters") after the name
        rf'ARGS_KEY: /{_W}{{0,4}},{_W}{{0,4}}"(arguments|parameters)"{_W}{{0,2}}:{_W}{{0,2}}/',
        rf"TC_CLOSE: /{_W}{{0,4}}{_rx(CLOSE)}/",
        rf"TC_AGAIN: /{_W}{{0,4}}{_rx(OPEN)}/",
        rf"OBJ_END: /{_W}{{0,4}}\}}/",
        rf"ARR_END: /{_W}{{0,4}}\]/",
        rf"FENCE_END: /{_W}{{0,4}}```/",
        rf"TAIL: /{_W}{{1,4}}/",
    ]
    for k, opening in _OPENINGS.items():
        key = k.upper()
        rules.append(f"first_{k}: " + " | ".join(f"{key}{i} args{i}" for i in range(len(tools))))
        rules += [f'{key}{i}: /{opening}{_NAME_KEY}{n}"/' for i, n in enumerate(names)]
    for i, (t, n) in enumerate(zip(tools, names)):
        rules.append(f'NAME{i}: /{n}"/')
        # the arguments by the tool's own schema, then the call object's end
        rules.append(f"args{i}: ARGS_KEY %json {args_schema(t)} OBJ_END")
    return "\n".join(rules) + "\n"


def call_grammar(tools: list[Tool], choice, parallel: bool) -> GrammarSpec:
    """required / named: one (or, parallel, several) envelopes calling the allowed tools.
    auto: the lazy grammar (free text, or text then valid calls only)."""
    if choice.mode == "auto":
        return GrammarSpec("lark", _lazy_auto(tools, parallel))
    allowed = [t for t in tools if choice.mode != "named" or t.name == choice.name]
    schema = json.dumps(call_schema(allowed))
    more = ' ("\\n" call)*' if parallel else ""
    return GrammarSpec("lark", f'start: call{more}\ncall: "{OPEN}\\n" %json {schema} '
                               f'"\\n{CLOSE}"\n')


def template_supports_tools(template: str) -> bool:
    """The template renders tools itself (else the built-in fallback prompt states them)."""
    return bool(re.search(r"\btools\b", template or ""))


def auto_grammar_fits(template: str) -> bool:
    """With tool_choice auto, constrain calls where the model writes the triggers above: the
    built-in fallback prompt (no tools in the template), or a Hermes / Qwen template
    (`<tool_call>`). Other families (Llama 3's `<|python_tag|>`, Mistral's `[TOOL_CALLS]`,
    control tokens the text grammar cannot see) are parsed from free output."""
    return not template_supports_tools(template) or OPEN in (template or "")


def auto_spec(tools: list[Tool], choice, parallel: bool, template: str) -> GrammarSpec | None:
    """The lazy grammar for tool_choice auto where it applies (tools given, a template whose
    calls the grammar can see), else None: the one rule every API follows."""
    if not tools or choice.mode != "auto" or not auto_grammar_fits(template):
        return None
    return call_grammar(tools, choice, parallel)
