"""GPT-2 byte-level BPE as llama.cpp's llm_tokenizer_bpe does it.

Each pre-tokenizer word is mapped byte by byte to the GPT-2 printable alphabet, then the
adjacent pair with the lowest merge rank is merged first (ties: leftmost) until no pair has a
rank. Final symbols that are not tokens fall back to one token per byte where one exists.
Words repeat a lot in real text, so results are cached per word.
"""
from __future__ import annotations

import heapq

from . import pretokenize

_CACHE_LIMIT = 200_000


def _byte_alphabet() -> list[str]:
    """GPT-2's reversible byte -> printable character map (bytes_to_unicode)."""
    keep = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table = [""] * 256
    for b in keep:
        table[b] = chr(b)
    n = 0
    for b in range(256):
        if not table[b]:
            table[b] = chr(256 + n)
            n += 1
    return table


BYTE_TO_CHAR = _byte_alphabet()
CHAR_TO_BYTE = {c: b for b, c in enumerate(BYTE_TO_CHAR)}
# latin-1 character b -> GPT-2 character for byte b, for str.translate
_LATIN1_TO_GPT2 = {b: c for b, c in enumerate(BYTE_TO_CHAR)}


class BpeEncoder:
    def __init__(self, token_to_id: dict[str, int], merges: list[str], pre: str,
                 byte_encode: bool = True):
        self._tok = token_to_id
        # byte_encode=False: SentencePiece-style BPE (gemma4) merging raw characters, with
        # <0xNN> byte tokens as fallback
        self._byte_encode = byte_encode
        self._ranks: dict[str, int] = dict(zip(merges, range(len(merges))))
        # llama.cpp splits "a b" at the first space after position 0; a key built as
        # left + " " + right is only ambiguous when some merge holds two such spaces. Byte-
        # level symbols never hold a space (byte 0x20 is "Ġ" in the GPT-2 alphabet), so only
        # raw-character BPE needs the pass over the merges (~17 ms for 150k of them).
        self._ambiguous = (not byte_encode) and any(m.count(" ", 1) > 1 for m in merges)
        self._pre = pre
        self._ignore_merges = pre in pretokenize.IGNORE_MERGES
        self._cache: dict[str, list[int]] = {}

    def encode(self, text: str, out: list[int]) -> None:
        cache = self._cache
        for word in pretokenize.split(text, self._pre):
            ids = cache.get(word)
            if ids is None:
                ids = self._encode_word(word)
                if len(word) < 256:
                    if len(cache) >= _CACHE_LIMIT:
                        cache.clear()
                    cache[word] = ids
            out.extend(ids)

    def _rank(self, left: str, right: str) -> int | None:
        if self._ambiguous and " " in left[1:]:
            return None
        return self._ranks.get(left + " " + right)

    def _encode_word(self, word: str) -> list[int]:
        tok = self._tok
        if self._byte_encode:
            # the word's UTF-8 bytes in the GPT-2 alphabet
            w = word.encode("utf-8", "surrogatepass").decode("latin-1").translate(_LATIN1_TO_GPT2)
        else:
            w = word
        if self._ignore_merges or (not self._byte_encode and not w.strip("\n")):
            # llama.cpp: whole-word tokens skip the merges (and gemma4's newline runs)
            tid = tok.get(w)
            if tid is not None:
                return [tid]
        syms = list(w)
        n = len(syms)
        if n > 1:
            prev = list(range(-1, n - 1))
            nxt = list(range(1, n + 1))
            nxt[-1] = -1
            heap: list[tuple[int, int, int, str]] = []
            rank = self._rank
            for i in range(1, n):
                r = rank(syms[i - 1], syms[i])
                if r is not None:
                    heap.append((r, i - 1, i, syms[i - 1] + syms[i]))
            heapq.heapify(heap)
            while heap:
                _, left, right, merged = heapq.heappop(heap)
                ls, rs = syms[left], syms[right]
                if not ls or not rs or ls + rs != merged:
                    continue                       # outdated pair
                syms[left] = merged
                syms[right] = ""
                nxt[left] = nxt[right]
                if nxt[right] >= 0:
                    prev[nxt[right]] = left
                p = prev[left]
                if p >= 0:
                    r = rank(syms[p], merged)
                    if r is not None:
                        heapq.heappush(heap, (r, p, left, syms[p] + merged))
                q = nxt[left]
                if q >= 0:
                    r = rank(merged, syms[q])
                    if r is not None:
                        heapq.heappush(heap, (r, left, q, merged + syms[q]))
        out: list[int] = []
        for s in syms:
            if not s:
                continue
            tid = tok.get(s)
            if tid is not None:
                out.append(tid)
                continue
            # llama.cpp: look up each UTF-8 byte of the symbol as a one-byte token, drop misses
            for b in s.encode("utf-8", "surrogatepass"):
                if self._byte_encode:
                    bid = tok.get(chr(b) if b < 0x80 else chr(0xDC00 + b))
                else:
                    bid = tok.get(f"<0x{b:02X}>")
                if bid is not None:
                    out.append(bid)
        return out
