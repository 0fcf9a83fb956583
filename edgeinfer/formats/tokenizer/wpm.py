"""WordPiece (`tokenizer.ggml.model = bert`) as llama.cpp's llm_tokenizer_wpm_session.

The GGUF vocabulary spells word-initial pieces with a leading U+2581 ("▁the") and
continuation pieces bare ("ing", HF's "##ing"). Text is split into words at whitespace and
around every punctuation mark, ASCII symbol and CJK character (each its own word); with the
vocabulary's normalizer options it is lower-cased and NFD-decomposed with accent marks
dropped. Each word, prefixed with U+2581, is cut greedily into the longest pieces in the
vocabulary (compared as UTF-8 bytes, as llama.cpp does); a word with any position that
matches nothing becomes one [UNK].
"""
from __future__ import annotations

import unicodedata

SPACE = "\u2581"

# llama.cpp's whitespace table (unicode.cpp: unicode_set_whitespace)
_WHITESPACE = frozenset([0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x20, 0x85, 0xA0, 0x1680,
                         *range(0x2000, 0x200B), 0x2028, 0x2029, 0x202F, 0x205F, 0x3000])


def _is_chinese(c: int) -> bool:
    return (0x4E00 <= c <= 0x9FFF or 0x3400 <= c <= 0x4DBF or 0x20000 <= c <= 0x2A6DF
            or 0x2A700 <= c <= 0x2B73F or 0x2B740 <= c <= 0x2B81F or 0x2B920 <= c <= 0x2CEAF
            or 0xF900 <= c <= 0xFAFF or 0x2F800 <= c <= 0x2FA1F)


def _lower(ch: str) -> str:
    lo = ch.lower()
    return lo if len(lo) == 1 else ch          # llama.cpp maps one code point to one


def preprocess(text: str, lowercase: bool, strip_accents: bool) -> list[str]:
    """Words as llama.cpp's llm_tokenizer_wpm_session::preprocess."""
    if strip_accents:
        text = unicodedata.normalize("NFD", text)
    words = [""]
    for ch in text:
        c = ord(ch)
        if c in _WHITESPACE:
            if words[-1]:
                words.append("")
            continue
        cat = unicodedata.category(ch)
        if c == 0 or c == 0xFFFD or cat[0] == "C":
            continue
        if strip_accents and cat[0] == "M":
            continue
        s = _lower(ch) if lowercase else ch
        if cat[0] == "P" or (c < 0x7F and cat[0] == "S") or _is_chinese(c):
            if words[-1]:
                words.append("")
            words[-1] = s
            words.append("")
        else:
            words[-1] += s
    if not words[-1]:
        words.pop()
    return words


class WpmEncoder:
    def __init__(self, token_to_id: dict[str, int], unk_id: int | None, lowercase: bool,
                 strip_accents: bool):
        self.ids = {t.encode("utf-8", "surrogateescape"): i for t, i in token_to_id.items()}
        self.max_len = max((len(b) for b in self.ids), default=1)
        self.unk_id = unk_id
        self.lowercase, self.strip_accents = lowercase, strip_accents
        self._memo: dict[str, tuple[int, ...]] = {}

    def _word(self, word: str) -> tuple[int, ...]:
        hit = self._memo.get(word)
        if hit is not None:
            return hit
        b = (SPACE + word).encode("utf-8", "surrogateescape")
        n, out, i = len(b), [], 0
        ids, m = self.ids, self.max_len
        while i < n:
            for j in range(min(n, i + m + 1), i, -1):
                t = ids.get(b[i:j])
                if t is not None:
                    out.append(t)
                    i = j
                    break
            else:
                out = []
                break
        if not out and self.unk_id is not None:
            out = [self.unk_id]
        res = tuple(out)
        if len(self._memo) < 100_000:
            self._memo[word] = res
        return res

    def encode(self, text: str, out: list[int]) -> None:
        for w in preprocess(text, self.lowercase, self.strip_accents):
            out.extend(self._word(w))
