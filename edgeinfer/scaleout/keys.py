"""Routing keys: the chained hashes of a prompt's full token blocks.

The prefix cache (edgeinfer.engine.prefix_cache) shares K/V by full blocks of
`block_size` token ids, each block meaningful only after all the blocks before it. The
hash of block i here covers the model name and blocks 0..i, so two prompts share block
hash i exactly when the engine could share their first i+1 blocks. The router keeps which
replica last computed which hash; it never needs the tokens themselves.

The ingress produces the token ids with the model's own tokenizer and chat template read
from the GGUF metadata (no weights are loaded), the way the engine renders a plain chat.
Requests the handlers render differently (tools, reasoning switches) get slightly
different tokens near the end: the shared leading blocks, which are what routing is for,
are the same.
"""
from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from typing import Any

from edgeinfer.formats.chat_template import ChatFormat
from edgeinfer.formats.gguf_file import read_gguf
from edgeinfer.formats.tokenizer import Tokenizer
from edgeinfer.store.model_store import Store

BLOCK_SIZE = 16
MAX_ROUTING_BLOCKS = 512          # 8k tokens: longer prompts are routed on their head


def block_hashes(model: str, token_ids: list[int], block_size: int = BLOCK_SIZE,
                 limit: int = MAX_ROUTING_BLOCKS) -> list[int]:
    """64-bit chained hashes of the full blocks of `token_ids` (the last token never counts,
    as the engine always recomputes it: see PrefixCache.match_nodes)."""
    n = min((len(token_ids) - 1) // block_size, limit) if token_ids else 0
    h = hashlib.blake2b(model.encode(), digest_size=8).digest()
    out = []
    for i in range(n):
        block = token_ids[i * block_size:(i + 1) * block_size]
        d = hashlib.blake2b(h, digest_size=8)
        d.update(b"".join(int(t).to_bytes(4, "little", signed=True) for t in block))
        h = d.digest()
        out.append(int.from_bytes(h, "little"))
    return out


def text_block_hashes(model: str, text: str, chars_per_block: int = 64,
                      limit: int = MAX_ROUTING_BLOCKS) -> list[int]:
    """The fallback when a model's tokenizer cannot be read at the ingress: blocks of
    characters instead of tokens (Ray's own PrefixCacheAffinityRouter works on text)."""
    data = text.encode("utf-8", "surrogatepass")
    ids = list(data[:chars_per_block * limit + 1])
    return block_hashes("text:" + model, ids, chars_per_block, limit)


def request_messages(path: str, body: dict[str, Any]) -> tuple[list[dict] | None, str | None]:
    """(chat messages, raw prompt) of an API request body: one of the two is set, or neither
    (a request that does not generate from a prompt)."""
    if path in ("/v1/chat/completions", "/api/chat"):
        msgs = body.get("messages")
        if isinstance(msgs, list):
            return [_plain(m) for m in msgs if isinstance(m, dict)], None
        return None, None
    if path in ("/v1/completions",):
        p = body.get("prompt")
        if isinstance(p, list) and p and isinstance(p[0], str):
            p = p[0]
        return (None, p) if isinstance(p, str) else (None, None)
    if path == "/api/generate":
        p = body.get("prompt")
        if not isinstance(p, str) or not p:
            return None, None
        if body.get("raw"):
            return None, p
        msgs = []
        if isinstance(body.get("system"), str):
            msgs.append({"role": "system", "content": body["system"]})
        msgs.append({"role": "user", "content": p})
        return msgs, None
    return None, None


def _plain(m: dict) -> dict:
    content = m.get("content")
    if isinstance(content, list):           # OpenAI content parts: the text parts
        content = "".join(p.get("text", "") for p in content
                          if isinstance(p, dict) and isinstance(p.get("text"), str))
    return {"role": str(m.get("role", "user")), "content": content if content is not None else ""}


class PromptEncoder:
    """Tokenizer + chat template of one model file, without its weights."""

    def __init__(self, path: str):
        f = read_gguf(path)
        try:
            md = dict(f.metadata)
        finally:
            f.close()
        arch = md.get("general.architecture")
        self.tokenizer = Tokenizer.from_gguf(md)
        self.chat = ChatFormat.from_gguf(md, arch if isinstance(arch, str) else None)

    def encode(self, messages: list[dict] | None, raw: str | None) -> list[int]:
        if messages is not None:
            return self.chat.encode(self.tokenizer, messages)
        return self.tokenizer.encode(raw or "", add_special=True, parse_special=False)


class Keyer:
    """Routing keys for requests at the ingress: one PromptEncoder per model, loaded on first
    use (a few hundred ms for a large vocabulary), the most recently used few kept."""

    def __init__(self, store=None, block_size: int = BLOCK_SIZE, keep: int = 4):
        self._store, self.block_size, self.keep = store, block_size, keep
        self._encoders: OrderedDict[str, PromptEncoder | None] = OrderedDict()
        self._lock = threading.Lock()

    def _encoder(self, model: str) -> PromptEncoder | None:
        with self._lock:
            if model in self._encoders:
                self._encoders.move_to_end(model)
                return self._encoders[model]
        enc = None
        try:
            if self._store is None:
                self._store = Store()
            ref = self._store.resolve(model, allow_path=False)
            enc = PromptEncoder(str(ref.path))
        except Exception:       # unknown model or odd vocabulary: the replica will say so
            enc = None
        with self._lock:
            self._encoders[model] = enc
            while len(self._encoders) > self.keep:
                self._encoders.popitem(last=False)
        return enc

    def keys(self, path: str, body: Any) -> list[int]:
        """Block hashes for an API request (empty when it has no prompt to route on)."""
        if not isinstance(body, dict) or not isinstance(body.get("model"), str):
            return []
        model = body["model"]
        messages, raw = request_messages(path, body)
        if messages is None and raw is None:
            return []
        enc = self._encoder(model)
        if enc is not None:
            try:
                return block_hashes(model, enc.encode(messages, raw), self.block_size)
            except Exception:
                pass
        text = raw if raw is not None else "".join(
            f"{m['role']}\n{m['content']}\n" for m in messages or [] if isinstance(m["content"], str))
        return text_block_hashes(model, text)
