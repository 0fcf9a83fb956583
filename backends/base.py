"""What a backend provides to the model files: the ops interface and its KV cache.

A model file is written once against `Ops`; each backend (numba CPU, torch, ...) implements it
on its own array type. Shapes use the field's names: T tokens in the flat batch, H query heads,
KVH key/value heads, D head dim, E hidden size.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np


@dataclass
class ForwardBatch:
    """One engine step, flattened: every scheduled token of every sequence in one batch.

    Token t belongs to sequence row token_seq[t] of block_tables and sits at positions[t];
    its K/V go to slot_mapping[t] (= block * block_size + offset). Logits are computed only
    for the rows in logits_indices (the last token of each chunk that needs a sample).
    """
    token_ids: np.ndarray      # int32 [T]
    positions: np.ndarray      # int32 [T]
    slot_mapping: np.ndarray   # int64 [T]
    token_seq: np.ndarray      # int32 [T]
    block_tables: np.ndarray   # int32 [S, max_blocks]
    logits_indices: np.ndarray  # int64 [L]
    # Per-step values a backend derives once and reuses in every layer (rope tables...).
    cache: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])


class Ops(Protocol):
    """The operations a model needs. Arrays are the backend's own type."""

    name: str

    def matrix(self, gguf_file: Any, name: str) -> Any: ...
    def vector(self, gguf_file: Any, name: str) -> Any: ...
    def embed(self, table: Any, ids: Any) -> Any: ...
    def matmul(self, x: Any, w: Any) -> Any: ...
    def add_bias(self, x: Any, b: Any) -> Any: ...
    def rms_norm(self, x: Any, w: Any, eps: float) -> Any: ...
    def rope(self, x: Any, batch: ForwardBatch, base: float, scale: float, neox: bool,
             freq_factors: Any = None) -> Any: ...
    def geglu(self, gate: Any, up: Any) -> Any: ...
    def swiglu(self, gate: Any, up: Any) -> Any: ...
    def add(self, x: Any, y: Any) -> Any: ...
    def scale(self, x: Any, s: float) -> Any: ...
    def take_rows(self, x: Any, rows: Any) -> Any: ...
    def new_kv_cache(self, n_layers: int, num_blocks: int, block_size: int, n_kv_head: int,
                     head_dim: int) -> Any: ...
    def attention(self, q: Any, k: Any, v: Any, cache: Any, layer: int, batch: ForwardBatch,
                  scale: float, window: int) -> Any: ...
    def copy_blocks(self, cache: Any, pairs: list[tuple[int, int]]) -> None: ...
    def to_numpy(self, x: Any) -> np.ndarray: ...
