"""What the native runner asks of an architecture (the Model protocol), and the defaults a
decoder-only text model has (ModelBase); encoders and embedding models override them."""
from __future__ import annotations

from typing import Any, Callable, Protocol

import numpy as np

from edgeinfer.backends.base import ForwardBatch


class Model(Protocol):
    non_causal: bool            # every position of a sequence attends to every other (encoders)
    embedding_only: bool        # no LM head: it can only embed
    accepts_embeddings: bool    # image spans: rows whose input is an embedding (embd_rows)
    has_rank_head: bool         # a classification head for rank pooling (rerankers)
    post_pool: Callable[[np.ndarray], np.ndarray] | None   # a projection after pooling
    # forward reads the batch only through the ops (no host values of positions or ids in
    # Python), so a backend may record it once and replay it (backends/torch/graphs.py)
    graph_safe: bool

    def forward(self, batch: ForwardBatch, kv: Any) -> Any: ...
    def rank_head(self, h: np.ndarray) -> np.ndarray: ...
    def set_context_length(self, n_ctx: int, gguf_file: Any) -> None: ...


class ModelBase:
    """A causal text model: generates, pools only when asked, no rank head, one set of
    positional factors whatever the context."""
    non_causal = False
    embedding_only = False
    accepts_embeddings = False
    has_rank_head = False
    post_pool = None
    graph_safe = False

    def rank_head(self, h: np.ndarray) -> np.ndarray:
        raise RuntimeError("this model has no classification head for rank pooling")

    def set_context_length(self, n_ctx: int, gguf_file: Any) -> None:
        """Phi-3's LongRoPE picks its factors by the context (models/variants.py)."""
