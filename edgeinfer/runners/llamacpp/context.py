"""A thin owner of one llama.cpp model + context through llama-cpp-python's C API.

Only what the runner needs: decode a batch of (token, position, seq id, wants logits) rows,
read logits, and edit sequences in the KV memory (seq_rm / seq_cp). Freed on close().
"""
from __future__ import annotations

import ctypes
import logging
import os

import numpy as np


_LOG_CB = None


def _quiet() -> None:
    """llama.cpp logs every tensor and cache at load: silence it unless debugging (the
    callback must stay referenced while llama.cpp may call it)."""
    global _LOG_CB
    if _LOG_CB is not None or logging.getLogger("edgeinfer").isEnabledFor(logging.DEBUG):
        return
    import llama_cpp as L
    _LOG_CB = L.llama_log_callback(lambda level, text, user: None)
    L.llama_log_set(_LOG_CB, ctypes.c_void_p(0))


class LlamaError(RuntimeError):
    pass


GGML_TYPES = {"f16": 1, "q8_0": 8}      # enum ggml_type values of the KV cache types


class LlamaContext:
    def __init__(self, path: str, n_ctx: int, n_seq_max: int, n_batch: int,
                 n_threads: int | None = None, n_gpu_layers: int = 0,
                 kv_cache_type: str | None = None):
        import llama_cpp as L
        _quiet()
        self.L = L
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        mp.n_gpu_layers = n_gpu_layers
        self.model = L.llama_model_load_from_file(os.fsencode(path), mp)
        if not self.model:
            raise LlamaError(f"llama.cpp could not load {path}")
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = int(L.llama_vocab_n_tokens(self.vocab))
        cp = L.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = cp.n_ubatch = n_batch
        cp.n_seq_max = n_seq_max
        # one cell pool shared by all sequences: seq_cp shares cells instead of copying, and a
        # sequence may use any number of cells (the scheduler bounds the total)
        cp.kv_unified = True
        # keep all positions in sliding-window layers too, so seq_rm/seq_cp work at any position
        cp.swa_full = True
        if kv_cache_type not in (None, "f16"):
            # llama.cpp's --cache-type-k/v; a quantized V cache needs flash attention
            cp.type_k = cp.type_v = GGML_TYPES[kv_cache_type]
            cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED
        threads = n_threads or max(1, os.cpu_count() or 1)
        cp.n_threads = cp.n_threads_batch = threads
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            L.llama_model_free(self.model)
            raise LlamaError(f"llama.cpp could not create a context of {n_ctx} tokens")
        self.mem = L.llama_get_memory(self.ctx)
        self.n_ctx = int(L.llama_n_ctx(self.ctx))
        self.n_batch = n_batch
        self.n_threads = threads
        self._batch = L.llama_batch_init(n_batch, 0, 1)
        self._ebatch = None         # an embeddings batch, made on the first image
        self.n_embd = int(L.llama_model_n_embd(self.model))

    # -- model facts -----------------------------------------------------------------------
    def model_int(self, fn: str) -> int:
        return int(getattr(self.L, fn)(self.model))

    # -- memory ----------------------------------------------------------------------------
    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> bool:
        return bool(self.L.llama_memory_seq_rm(self.mem, seq, p0, p1))

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        self.L.llama_memory_seq_cp(self.mem, src, dst, p0, p1)

    def seq_pos_max(self, seq: int) -> int:
        return int(self.L.llama_memory_seq_pos_max(self.mem, seq))

    # -- compute ---------------------------------------------------------------------------
    def set_threads(self, n: int) -> None:
        """Threads for the next decodes (the process's governor hands out its share)."""
        if n != self.n_threads:
            self.L.llama_set_n_threads(self.ctx, n, n)
            self.n_threads = n

    def decode(self, tokens: list[int], positions: list[int], seqs: list[int],
               want: list[bool]) -> int:
        """One llama_decode of at most n_batch rows; returns llama.cpp's status (0 = ok)."""
        b = self._batch
        n = len(tokens)
        assert n <= self.n_batch
        for i in range(n):
            b.token[i] = tokens[i]
            b.pos[i] = positions[i]
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seqs[i]
            b.logits[i] = want[i]
        b.n_tokens = n
        return int(self.L.llama_decode(self.ctx, b))

    def decode_embd(self, embd: np.ndarray, positions: list[int], seq: int,
                    want_last: bool, causal: bool = False) -> int:
        """One llama_decode of embedding rows (an image) of one sequence, non-causal unless
        `causal` (the rows attend to one another, as libmtmd decodes Gemma 3's images)."""
        L = self.L
        n = int(embd.shape[0])
        assert n <= self.n_batch and embd.shape[1] == self.n_embd
        if self._ebatch is None:
            self._ebatch = L.llama_batch_init(self.n_batch, self.n_embd, 1)
        b = self._ebatch
        flat = np.ascontiguousarray(embd, np.float32).reshape(-1)
        ctypes.memmove(b.embd, flat.ctypes.data, flat.nbytes)
        for i in range(n):
            b.pos[i] = positions[i]
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = want_last and i == n - 1
        b.n_tokens = n
        if causal:
            return int(L.llama_decode(self.ctx, b))
        L.llama_set_causal_attn(self.ctx, False)
        try:
            return int(L.llama_decode(self.ctx, b))
        finally:
            L.llama_set_causal_attn(self.ctx, True)

    def logits(self, i: int) -> np.ndarray:
        ptr = self.L.llama_get_logits_ith(self.ctx, i)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()

    # -- vocabulary (used only when our own tokenizer cannot read the GGUF's) -------------
    def tokenize(self, text: bytes, add_special: bool, parse_special: bool) -> list[int]:
        L = self.L
        cap = len(text) + 16
        buf = (L.llama_token * cap)()
        n = L.llama_tokenize(self.vocab, text, len(text), buf, cap, add_special, parse_special)
        if n < 0:
            buf = (L.llama_token * -n)()
            n = L.llama_tokenize(self.vocab, text, len(text), buf, -n, add_special, parse_special)
        return list(buf[:n])

    def piece(self, token: int, special: bool) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = self.L.llama_token_to_piece(self.vocab, token, buf, 64, 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = self.L.llama_token_to_piece(self.vocab, token, buf, -n, 0, special)
        return buf.raw[:n]

    def close(self) -> None:
        if getattr(self, "ctx", None):
            self.L.llama_batch_free(self._batch)
            if self._ebatch is not None:
                self.L.llama_batch_free(self._ebatch)
            self.L.llama_free(self.ctx)
            self.L.llama_model_free(self.model)
            self.ctx = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
