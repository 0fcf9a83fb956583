"""Images through llama.cpp's libmtmd (llama-cpp-python's mtmd_cpp) for the llama.cpp
runner: the projector loaded against the runner's own llama model, images encoded by
libmtmd's preprocessing and tower. Embeddings come back as float32 [tokens, width] and enter
the sequence as the native runners' do (LlamaContext.decode_embd, non-causal)."""
from __future__ import annotations

import ctypes
import threading

import numpy as np

from edgeinfer.runners.llamacpp.context import LlamaError


class MtmdEncoder:
    def __init__(self, mmproj: str, ctx, n_threads: int):
        from llama_cpp import mtmd_cpp as M
        self.M, self.lctx = M, ctx
        p = M.mtmd_context_params_default()
        p.use_gpu = False
        p.n_threads = n_threads
        p.print_timings = False
        p.warmup = False
        self.ctx = M.mtmd_init_from_file(str(mmproj).encode(), ctx.model, p)
        if not self.ctx:
            raise LlamaError(f"libmtmd could not load the projector {mmproj}")
        self.marker = M.mtmd_default_marker()
        self._lock = threading.Lock()

    def __call__(self, rgb: np.ndarray) -> list[np.ndarray]:
        """The image's embeddings, one array per image chunk in libmtmd's order (Idefics3:
        tiles row by row, then the overview)."""
        M = self.M
        rgb = np.ascontiguousarray(rgb, np.uint8)
        h, w, _ = rgb.shape
        with self._lock:
            bm = M.mtmd_bitmap_init(w, h, (ctypes.c_uint8 * rgb.size).from_buffer_copy(
                rgb.tobytes()))
            chunks = M.mtmd_input_chunks_init()
            try:
                arr = (M.mtmd_bitmap_p_ctypes * 1)(bm)
                inp = M.mtmd_input_text(self.marker, len(self.marker), False, True)
                if M.mtmd_tokenize(self.ctx, chunks, ctypes.byref(inp), arr, 1) != 0:
                    raise LlamaError("libmtmd could not tokenize the image")
                parts = []
                for i in range(M.mtmd_input_chunks_size(chunks)):
                    ch = M.mtmd_input_chunks_get(chunks, i)
                    if M.mtmd_input_chunk_get_type(ch) != 1:     # MTMD_INPUT_CHUNK_TYPE_IMAGE
                        continue
                    n = M.mtmd_input_chunk_get_n_tokens(ch)
                    if M.mtmd_encode_chunk(self.ctx, ch) != 0:
                        raise LlamaError("libmtmd could not encode the image")
                    out = M.mtmd_get_output_embd(self.ctx)
                    e = self.lctx.n_embd
                    parts.append(np.ctypeslib.as_array(out, shape=(n * e,)).reshape(n, e).copy())
                if not parts:
                    raise LlamaError("libmtmd made no image chunk")
                return parts
            finally:
                M.mtmd_input_chunks_free(chunks)
                M.mtmd_bitmap_free(bm)

    def close(self) -> None:
        if self.ctx:
            self.M.mtmd_free(self.ctx)
            self.ctx = None
