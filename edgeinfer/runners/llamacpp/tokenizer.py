"""llama.cpp's own tokenizer behind the methods the engine uses of our `Tokenizer`.

Used only for GGUF vocabularies our tokenizer cannot build (the llama.cpp backend runs
architectures, and so tokenizers, the native engine does not cover).
"""
from __future__ import annotations

from typing import Any, Iterable


class LlamaTokenizer:
    def __init__(self, ctx, metadata: dict[str, Any]):
        import llama_cpp as L
        self._ctx = ctx
        v = ctx.vocab
        self.vocab_size = ctx.n_vocab
        self.model = str(metadata.get("tokenizer.ggml.model", "llama.cpp"))
        self.bos_id = int(L.llama_vocab_bos(v))
        self.eos_id = int(L.llama_vocab_eos(v))
        self.add_bos = bool(L.llama_vocab_get_add_bos(v))
        self.eot_ids = frozenset(t for t in range(self.vocab_size) if L.llama_vocab_is_eog(v, t))
        self._control = L.llama_vocab_is_control
        self._pieces: dict[tuple[int, bool], bytes] = {}

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return self._ctx.tokenize(text.encode("utf-8"), add_special, parse_special)

    def is_eog(self, token_id: int) -> bool:
        return token_id in self.eot_ids

    def is_special(self, token_id: int) -> bool:
        return bool(self._control(self._ctx.vocab, token_id))

    def piece(self, token_id: int, render_special: bool = False) -> bytes:
        key = (token_id, render_special)
        p = self._pieces.get(key)
        if p is None:
            p = self._pieces[key] = self._ctx.piece(token_id, render_special)
        return p

    def decode_bytes(self, ids: Iterable[int], render_special: bool = False) -> bytes:
        return b"".join(self.piece(i, render_special) for i in ids)

    def decode(self, ids: Iterable[int], render_special: bool = False) -> str:
        return self.decode_bytes(ids, render_special).decode("utf-8", errors="replace")
