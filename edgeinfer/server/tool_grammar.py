"""Grammars for tool calls (llguidance Lark), forced or lazy.

- `tool_choice` required / a named function: the whole output is one (or, parallel, several)
  `<tool_call>` envelopes calling an allowed tool, arguments by the tool's schema (`%json`).
- auto: a lazy grammar, as llama.cpp's grammar triggers and vLLM's structural tags. The reply
  is free text until a call starts; from the trigger on, the rest must be a valid call of a
  declared tool, so its arguments always parse and validate. The triggers:

      <tool_call>                  anywhere (Hermes / Qwen, and our fallback prompt)
      {"name": "                   at the start of the reply (bare JSON, Llama 3's form)
      [{"name": "                  at the start (an array of calls)
      ```json\\n{"name": "          at the start (a fenced call; ``` without a language too)

  How: three kinds of lexemes compete from the first byte. FREE is any text that contains no
  `<tool_call>` and does not start with a lead; TEXT_TC is text up to the first
  `<tool_call>` (lazy: it ends right there); LEAD_* are the start-of-reply openings up to the
  name's opening quote. They exclude each other, so at every byte exactly the alternatives
  the text so far allows stay alive: a reply that never writes a trigger is FREE to the end,
  untouched; once a trigger completes, only the call grammar is left. After the call(s) the
  grammar is complete and only end-of-turn may follow, so the model can always stop.
"""
from __future__ import annotations

import json
import re

from edgeinfer.engine.grammar import GrammarSpec, closed_objects

from .tool_parse import CLOSE, OPEN, Tool

# bounded whitespace: a small model must not be able to loop on newlines inside a call
_W = r"[ \t\r\n]"
_NAME_KEY = rf'\{{{_W}{{0,4}}"name"{_W}{{0,2}}:{_W}{{0,2}}"'          # {"name": "
_LEADS = {                                      # opening -> its lexeme's regex
    "obj": rf"{_W}{{0,8}}{_NAME_KEY}",
    "arr": rf"{_W}{{0,8}}\[{_W}{{0,4}}{_NAME_KEY}",
    "fence": rf"{_W}{{0,8}}```(json)?[ \t]{{0,2}}\n{_W}{{0,4}}{_NAME_KEY}",
    "fence_arr": rf"{_W}{{0,8}}```(json)?[ \t]{{0,2}}\n{_W}{{0,4}}\[{_W}{{0,4}}{_NAME_KEY}",
}
_LEAD_ANY = "(" + "|".join(_LEADS.values()) + ")"
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


def _args_schema(t: Tool) -> str:
    return json.dumps({**closed_objects(t.parameters), "x-guidance": _JSON_OPTS})


def _lazy_auto(tools: list[Tool], parallel: bool) -> str:
    """The auto-mode grammar (see the module doc)."""
    more = " (ITEM rest)*" if parallel else ""           # further calls in an array
    rules = [
        "start: FREE | text_tc tc_calls | lead",
        rf"FREE: /(?s:.*)/ & ~/(?s:.*{_rx(OPEN)}.*)/ & ~/{_LEAD_ANY}(?s:.*)/",
        "text_tc[lazy]: TEXT_TC",
        rf"TEXT_TC: /(?s:.*){_rx(OPEN)}/ & ~/{_LEAD_ANY}(?s:.*)/",
        "tc_calls: CALL_OPEN rest TC_CLOSE"
        + (" (TC_AGAIN CALL_OPEN rest TC_CLOSE)*" if parallel else "") + " TAIL?",
        "lead: LEAD_OBJ rest TAIL? | LEAD_FENCE rest FENCE_END TAIL?"
        f" | LEAD_ARR rest{more} ARR_END TAIL?"
        f" | LEAD_FENCE_ARR rest{more} ARR_END FENCE_END TAIL?",
        f"LEAD_OBJ: /{_LEADS['obj']}/",
        f"LEAD_ARR: /{_LEADS['arr']}/",
        f"LEAD_FENCE: /{_LEADS['fence']}/",
        f"LEAD_FENCE_ARR: /{_LEADS['fence_arr']}/",
        rf"CALL_OPEN: /{_W}{{0,4}}{_NAME_KEY}/",
        rf"ITEM: /{_W}{{0,4}},{_W}{{0,4}}{_NAME_KEY}/",
        rf"TC_CLOSE: /{_W}{{0,4}}{_rx(CLOSE)}/",
        rf"TC_AGAIN: /{_W}{{0,4}}{_rx(OPEN)}/",
        rf"OBJ_END: /{_W}{{0,4}}\}}/",
        rf"ARR_END: /{_W}{{0,4}}\]/",
        rf"FENCE_END: /{_W}{{0,4}}```/",
        rf"TAIL: /{_W}{{1,4}}/",
        "rest: " + " | ".join(f"call{i}" for i in range(len(tools))),
    ]
    for i, t in enumerate(tools):
        # the name (its opening quote is in the lead), then "arguments" (or Llama 3's
        # "parameters"), then the arguments by the tool's own schema, then the object's end
        rules.append(rf'CALL{i}: /{_rx(t.name)}"{_W}{{0,4}},{_W}{{0,4}}"(arguments|parameters)"'
                     rf"{_W}{{0,2}}:{_W}{{0,2}}/")
        rules.append(f"call{i}: CALL{i} %json {_args_schema(t)} OBJ_END")
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


def auto_grammar_fits(template: str) -> bool:
    """With tool_choice auto, constrain calls where the model writes the triggers above: the
    built-in fallback prompt (no tools in the template), or a Hermes / Qwen template
    (`<tool_call>`). Other families (Llama 3's `<|python_tag|>`, Mistral's `[TOOL_CALLS]`,
    control tokens the text grammar cannot see) are parsed from free output."""
    template = template or ""
    return not re.search(r"\btools\b", template) or OPEN in template
