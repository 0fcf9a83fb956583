"""SentencePiece-style tokenization as llama.cpp's llm_tokenizer_spm does it.

The text (spaces already escaped to U+2581) starts as one symbol per character. The adjacent
pair whose concatenation is a vocabulary token with the highest score is merged first (ties:
leftmost), until no adjacent pair forms a token. Symbols that are not tokens become byte
tokens (<0xNN>).

Speed: the algorithm is run per segment with a bounded cache. A segment starts at each run of
U+2581 that follows another character; merges can only cross such a boundary through a token
with an inner "x▁" (rare: gemma3 has one), so boundaries covered by an occurrence of such a
token are not cut. Segments never interact, so the result equals one run over the whole text.
"""
from __future__ import annotations

import heapq
import re

SPACE = "\u2581"


class TokenizerError(ValueError):
    """A vocabulary we cannot build a tokenizer from, or text it cannot encode."""
_CACHE_LIMIT = 200_000


class SpmEncoder:
    def __init__(self, token_to_id: dict[str, int], scores: list[float],
                 byte_ids: list[int | None], n_vocab: int):
        self._tok = token_to_id
        self._scores = scores
        self._byte_ids = byte_ids          # byte value -> token id (<0xNN> or the 1-char token)
        self._n_vocab = n_vocab
        # Tokens with a U+2581 after some other character can merge across our cut points.
        inner = [t for t in token_to_id if SPACE in t[1:] and t.strip(SPACE) and
                 re.search(r"[^\u2581]\u2581", t)]
        self._inner = inner if len(inner) <= 256 else None   # None: too many, never cut
        self._cache: dict[str, list[int]] = {}

    # --- public ----------------------------------------------------------------------------
    def encode(self, text: str, out: list[int]) -> None:
        """Append the ids of `text` (spaces already escaped) to `out`."""
        if not text:
            return
        cache = self._cache
        for seg in self._segments(text):
            ids = cache.get(seg)
            if ids is None:
                ids = self._encode_segment(seg)
                if len(seg) < 256:
                    if len(cache) >= _CACHE_LIMIT:
                        cache.clear()
                    cache[seg] = ids
            out.extend(ids)

    # --- internals -------------------------------------------------------------------------
    def _segments(self, text: str) -> list[str]:
        if self._inner is None:
            return [text]
        cuts = [m.start() for m in _RUN_START.finditer(text)]
        if not cuts:
            return [text]
        if self._inner:
            blocked: set[int] = set()
            for t in self._inner:
                i = text.find(t)
                while i >= 0:
                    blocked.update(range(i + 1, i + len(t)))
                    i = text.find(t, i + 1)
            if blocked:
                cuts = [c for c in cuts if c not in blocked]
        segs = []
        prev = 0
        for c in cuts:
            segs.append(text[prev:c])
            prev = c
        segs.append(text[prev:])
        return segs

    def _encode_segment(self, text: str) -> list[int]:
        tok = self._tok
        scores = self._scores
        n = len(text)
        start = list(range(n))            # symbol i covers text[start[i]:start[i]+size[i]]
        size = [1] * n
        prev = list(range(-1, n - 1))
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        heap: list[tuple[float, int, int, int]] = []
        n_vocab = self._n_vocab

        def add(left: int, right: int) -> None:
            if left < 0 or right < 0:
                return
            s = start[left]
            ln = size[left] + size[right]
            tid = tok.get(text[s:s + ln])
            if tid is None or tid >= n_vocab:
                return
            # max-heap on score, then the leftmost pair (llama.cpp's comparator)
            heapq.heappush(heap, (-scores[tid], left, right, ln))

        for i in range(1, n):
            add(i - 1, i)
        while heap:
            _, left, right, ln = heapq.heappop(heap)
            if size[left] == 0 or size[right] == 0 or size[left] + size[right] != ln:
                continue
            size[left] = ln
            size[right] = 0
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            add(prev[left], left)
            add(left, nxt[left])

        out: list[int] = []
        i = 0
        byte_ids = self._byte_ids
        while i != -1:
            piece = text[start[i]:start[i] + size[i]]
            tid = tok.get(piece)
            if tid is not None:
                out.append(tid)
            else:
                # Merged symbols are always tokens, so this is one character: byte fallback.
                for b in piece.encode("utf-8", "surrogatepass"):
                    bid = byte_ids[b]
                    if bid is None:
                        raise TokenizerError(f"the vocabulary has no token for byte 0x{b:02X}, "
                                             f"so this text cannot be encoded")
                    out.append(bid)
            i = nxt[i]
        return out


# A cut point: the first U+2581 of a run that follows some other character.
_RUN_START = re.compile(r"(?<=[^\u2581])\u2581")
