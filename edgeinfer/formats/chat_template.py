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

from dataclasses import dataclass
from importlib import resources
from typing import Any

# the errors, for this module's users too (they raise from the sandbox as well)
from .chat_errors import ChatTemplateError, ChatTemplateSecurityError  # noqa: F401


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
    from .chat_sandbox import render           # lazy: Jinja loads with the first render
    ctx = dict(extra)
    ctx.update(messages=_flatten(messages) if flatten_content else messages,
               add_generation_prompt=add_generation_prompt, bos_token=bos_token,
               eos_token=eos_token)
    return render(template, ctx)


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
        from .chat_sandbox import compile_template
        compile_template(template)  # a broken template fails at load, not at the first request
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
