"""Streaming detokenization: token ids in, only complete UTF-8 characters out.

A token can end in the middle of a character (byte-fallback tokens, byte-level BPE pieces of
an emoji). The bytes of an unfinished character are held back until the character completes;
bytes that can never become a character come out as U+FFFD, as a full decode would show them.
"""
from __future__ import annotations

import codecs
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    from .vocab import Tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: "Tokenizer", render_special: bool = False):
        self._tok = tokenizer
        self._render_special = render_special
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._parts: list[str] = []

    def add(self, token_id: int) -> str:
        """Feed one token; return the new complete text (possibly "")."""
        s = self._decoder.decode(self._tok.piece(token_id, self._render_special))
        if s:
            self._parts.append(s)
        return s

    def add_many(self, token_ids: Iterable[int]) -> str:
        return "".join(self.add(t) for t in token_ids)

    def flush(self) -> str:
        """End of stream: held-back bytes of an unfinished character become U+FFFD."""
        s = self._decoder.decode(b"", final=True)
        if s:
            self._parts.append(s)
        return s

    @property
    def pending(self) -> bytes:
        """Bytes held back because they do not form a complete character yet."""
        return self._decoder.getstate()[0]

    @property
    def text(self) -> str:
        """Everything returned so far."""
        return "".join(self._parts)
