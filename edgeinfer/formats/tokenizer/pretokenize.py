"""Pre-tokenizer regexes for byte-level BPE vocabularies, keyed by GGUF `tokenizer.ggml.pre`.

llama.cpp splits text with a list of regexes applied in turn: each regex cuts every current
piece into its matches and the gaps between them. Its regex engine (custom code, or std::regex
over text whose non-ASCII characters are collapsed to one byte per Unicode category) treats
`\\s` as a fixed whitespace set, `\\d` as ASCII digits and `\\p{Lu}`-like sub-categories as all
letters. We run the same expressions with the `regex` package after rewriting exactly those
escapes, so the split matches llama.cpp's.
"""
from __future__ import annotations

import logging
from functools import lru_cache

import regex

log = logging.getLogger(__name__)

# llama.cpp's whitespace set (unicode_set_whitespace).
_WS = "\\t\\n\\x0b\\x0c\\r \\x85\\xa0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f\\u205f\\u3000"

_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"
_LLAMA3 = (_CONTRACTIONS + "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
           "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
_QWEN2 = (_CONTRACTIONS + "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
          "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
_QWEN35 = (_CONTRACTIONS + "|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}"
           "| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
_TEKKEN = ("[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+"
           "|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))+((?=[\\p{L}])([^A-Z]))*"
           "|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
_GPT4O = ("[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+" + _CONTRACTIONS + "?"
          "|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))+((?=[\\p{L}])([^A-Z]))*" + _CONTRACTIONS + "?"
          "|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
_PORO = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"
# Non-ASCII literals are written as escapes: editors NFC-normalize some of them (U+1F7D).
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_DEEPSEEK_LLM = [
    "[\r\n]",
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1"
    "\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd"
    "\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d"
    "\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4"
    "\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec"
    "\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128"
    "\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b"
    "\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787"
    "\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a"
    "\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
    "\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+",
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    "\\s+$",
    _CJK,
    "\\p{N}+",
]
_DEEPSEEK_V3 = [
    "\\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
    "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
]
_DEFAULT = [
    "[\\p{P}\\$\\+<=>\\^~\\|]+",
    _GPT2,
    "\\p{N}+",
    "[0-9][0-9][0-9]",
]

# pre name -> (regex list, clean_spaces); only what changes tokenization is kept here.
_BY_PRE: dict[str, list[str]] = {}


def _reg(names: tuple[str, ...], exprs: list[str]) -> None:
    for n in names:
        _BY_PRE[n] = exprs


_reg(("default",), _DEFAULT)
_reg(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
      "jina-v5-nano", "dbrx", "smaug-bpe"), [_LLAMA3])
_reg(("deepseek-llm",), _DEEPSEEK_LLM)
_reg(("deepseek-coder",), ["[\r\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", _CJK, "\\p{N}"])
_reg(("deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"), _DEEPSEEK_V3)
_reg(("falcon",), ["[\\p{P}\\$\\+<=>\\^~\\|`]+",
                   "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
                   "[0-9][0-9][0-9]"])
_reg(("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b",
      "mellum2"), ["\\p{N}", _GPT2])
_reg(("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0",
      "mellum", "modern-bert", "mpt", "olmo", "jais", "trillion", "granite-docling", "exaone4",
      "jina-v1-en", "jina-v2-code", "roberta-bpe"), [_GPT2])
_reg(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "stablelm2", "hunyuan", "solar-open",
      "megrez", "grok-2"), [_QWEN2])
_reg(("qwen35",), [_QWEN35])
_reg(("poro-chat", "bloom", "gpt3-finnish"), [_PORO])
_reg(("viking",), [_PORO, "\\p{N}"])
_reg(("chatglm-bpe", "glm4", "glm5"), [_LLAMA3])
_reg(("tekken",), [_TEKKEN])
_reg(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), [_GPT4O])
_reg(("seed-coder",), [_CONTRACTIONS + "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1}"
                       "| ?[^\\s\\p{L}\\p{N}\\r\\n]+|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"])
_reg(("bailingmoe", "bailingmoe2", "llada-moe"),
     ["'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}"
      "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+"])
_reg(("ufakzeka",), ["[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
                     "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"])
_reg(("minicpm5",), ["\\p{N}{1,3}", _CONTRACTIONS + "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}+"
                     "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"])
_reg(("laguna",), ["[^\\n]+|[\\n]+", _QWEN2])
_reg(("gemma4", "granite-embed-multi-311m"), ["[^\\n]+|[\\n]+"])

# llama.cpp turns these on per pre-tokenizer: a whole word that is a token skips the merges.
IGNORE_MERGES = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
                 "lfm2", "jina-v5-nano", "minicpm5", "youtu", "glm4", "glm5", "tekken",
                 "granite-embed-multi-97m"}


def _translate(expr: str) -> str:
    """Rewrite one llama.cpp expression for the `regex` package with llama.cpp's semantics."""
    out = []
    i = 0
    inside = False
    while i < len(expr):
        c = expr[i]
        if c == "\\" and i + 1 < len(expr):
            e = expr[i + 1]
            if e == "s":
                out.append(_WS if inside else "[" + _WS + "]")
            elif e == "S":
                out.append("[^" + _WS + "]")   # never used inside a class by llama.cpp
            elif e == "d":
                out.append("0-9" if inside else "[0-9]")
            elif e == "p" and expr.startswith("{L", i + 2) and expr[i + 4] in "ultmo" \
                    and expr[i + 5] == "}":
                out.append("\\p{L}")        # collapsed: every letter sub-category is \p{L}
                i += 6
                continue
            else:
                out.append(c + e)
            i += 2
            continue
        if c == "[" and not inside:
            inside = True
        elif c == "]" and inside:
            inside = False
        elif c == "$" and not inside:
            out.append("\\Z")               # ECMAScript: end of the piece only
            i += 1
            continue
        out.append(c)
        i += 1
    return "".join(out)


@lru_cache(maxsize=None)
def _compiled(pre: str) -> tuple[regex.Pattern, ...]:
    exprs = _BY_PRE.get(pre)
    if exprs is None:
        log.warning("unknown pre-tokenizer %r: using the gpt-2 split, tokenization may differ "
                    "from the model's own", pre)
        exprs = [_GPT2]
    return tuple(regex.compile(_translate(e), regex.V0) for e in exprs)


def is_known(pre: str) -> bool:
    return pre in _BY_PRE


def split(text: str, pre: str) -> list[str]:
    """Split `text` into pre-tokenizer words exactly as llama.cpp's unicode_regex_split."""
    pats = _compiled(pre)
    pieces = [text]
    for pat in pats:
        new: list[str] = []
        for piece in pieces:
            last = 0
            for m in pat.finditer(piece):
                s, e = m.span()
                if s == e:
                    continue
                if s > last:
                    new.append(piece[last:s])
                new.append(piece[s:e])
                last = e
            if last < len(piece):
                new.append(piece[last:])
        pieces = new
    return pieces
