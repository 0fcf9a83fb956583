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
    When hidden_indices is set, the model also leaves the final hidden states (after the last
    norm) of those rows in `hidden` (float32 numpy [len(hidden_indices), E]): embeddings.
    """
    token_ids: np.ndarray      # int32 [T]
    positions: np.ndarray      # int32 [T]
    slot_mapping: np.ndarray   # int64 [T]
    token_seq: np.ndarray      # int32 [T]
    block_tables: np.ndarray   # int32 [S, max_blocks]
    logits_indices: np.ndarray  # int64 [L]
    # Per-step values a backend derives once and reuses in every layer (rope tables...).
    cache: dict = field(default_factory=dict)
    hidden_indices: np.ndarray | None = None    # int64 [P]: rows whose hidden states to keep
    hidden: np.ndarray | None = None            # out: float32 [P, E]
    # a sliding-window layer group with its own pool (KVPlan.window_layers): its layers
    # (window_layer[layer] True) write through window_slots and read through window_tables
    window_tables: np.ndarray | None = None     # int32 [S, max_blocks]
    window_slots: np.ndarray | None = None      # int64 [T]
    window_layer: tuple[bool, ...] = ()
    # images (edgeinfer/engine/images.py): rows whose input is an embedding, not a token id,
    # and per row the last position it attends to (past its own inside an image; None: all
    # rows causal)
    embd_rows: np.ndarray | None = None         # int64 [R]
    embd_values: np.ndarray | None = None       # float32 [R, E]
    attn_until: np.ndarray | None = None        # int32 [T]

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    def tables_for(self, layer: int) -> np.ndarray:
        """The block tables `layer` reads its K/V through."""
        if self.window_tables is not None and self.window_layer[layer]:
            return self.window_tables
        return self.block_tables

    def slots_for(self, layer: int) -> np.ndarray:
        """The slots `layer` writes this step's K/V to."""
        if self.window_slots is not None and self.window_layer[layer]:
            return self.window_slots
        return self.slot_mapping


class Ops(Protocol):
    """The operations a model needs. Arrays are the backend's own type.

    In-place contract (models rely on it, so a backend must not differ): `add`, `scale`,
    `add_bias`, `rope` and `put_rows` write their result into their first argument and return it;
    `geglu` and `swiglu` write into `gate` and return it. Every other op leaves its inputs
    alone and returns a new array (`take_rows` may return its input when it keeps all rows).
    """

    name: str
    kv_bytes_per_value: float   # bytes of one K or V element in this backend's pool
    kv_cache_type: str          # that element's type: f16, q8_0, f32, bf16
    weights_copied: bool        # weights live in the backend's own memory, not the GGUF map
    # attention reads per-layer block tables (ForwardBatch.tables_for), so Gemma 3's
    # sliding-window layers keep their K/V in a pool of their own (runners.base.plan_kv)
    kv_window_group: bool
    # a speculative verify can compute every position with the bits plain decoding gives it
    # (runners/native.py verifies drafts only then)
    exact_drafts: bool
    # every row of any forward gets the bits it would get alone; where not, the runner
    # forwards drafted spans apart with per_row set, which asks for exactly that (see CpuOps)
    rows_exact: bool
    per_row: bool

    @property
    def weights_format(self) -> str:
        """How the loaded weights sit in memory, for `show` and `ps`."""
        ...

    def weights_format_for(self, gguf_file: Any) -> str:
        """The weights_format a model from this file would get, without loading it."""
        ...

    def weights_nbytes(self, gguf_file: Any) -> int:
        """Bytes this backend holds for the file's weights once loaded (repacked, dequantized
        or mapped as they are): what memory budgets count, known before loading."""
        ...

    def fit_kv_budget(self, gguf_file: Any, requested: int) -> int:
        """Before loading: refuse (an error naming the numbers) when the weights cannot fit,
        and return the KV budget in bytes that fits beside them (at most `requested`)."""
        ...

    def begin_step(self) -> None:
        """Called before each forward pass on the thread that runs it (thread counts...)."""
        ...

    def release(self) -> None:
        """The model is unloading: finish background work on its weights (the CPU backend's
        write of its repacked weights to disk)."""
        ...

    def matrix(self, gguf_file: Any, name: str) -> Any: ...
    def table(self, gguf_file: Any, name: str) -> Any: ...
    # ^ a matrix only read through embed() (an untied embedding), kept as cheaply as embed allows
    def vector(self, gguf_file: Any, name: str) -> Any: ...
    def embed(self, table: Any, ids: Any) -> Any: ...
    def matmul(self, x: Any, w: Any) -> Any: ...
    def matmuls(self, x: Any, ws: Any) -> tuple: ...
    # ^ (matmul(x, w) for w in ws), the same values; a backend may share work between them
    #   (the CPU one quantizes x once for all of them)
    def add_bias(self, x: Any, b: Any) -> Any: ...            # in place on x
    def rms_norm(self, x: Any, w: Any, eps: float) -> Any: ...
    def rope(self, x: Any, batch: ForwardBatch, base: float, scale: float, neox: bool,
             freq_factors: Any = None) -> Any: ...           # in place on x
    def norm_rope(self, x: Any, w: Any, eps: float, batch: ForwardBatch, base: float,
                  scale: float, neox: bool, freq_factors: Any = None) -> Any: ...
    # rope(rms_norm(x, w)), in place on x (QK-norm then rope)
    def add_rms_norm(self, x: Any, a: Any, w_a: Any, w_x: Any, eps: float) -> Any: ...
    # x += rms_norm(a, w_a) in place (a may be overwritten); returns rms_norm(x, w_x)
    def geglu(self, gate: Any, up: Any) -> Any: ...           # in place on gate
    def swiglu(self, gate: Any, up: Any) -> Any: ...          # in place on gate
    def swiglu_matmul(self, gate: Any, up: Any, w: Any) -> Any: ...
    # ^ matmul(swiglu(gate, up), w), the same values (gate may be overwritten); the CPU
    #   backend quantizes the SwiGLU straight into w's activation codes
    def add(self, x: Any, y: Any) -> Any: ...                 # in place on x
    def scale(self, x: Any, s: float) -> Any: ...             # in place on x
    def take_rows(self, x: Any, rows: Any) -> Any: ...
    def put_rows(self, x: Any, rows: Any, values: Any) -> Any: ...  # in place: x[rows] = values
    def fused_layer_rows(self, T: int, width: int, mats: Any) -> bool: ...
    # ^ whether a step of T rows (widest activation `width`) with these matrices runs through
    #   the backend's fused attention-block calls (fused_layer, layer_step, fused_head: the CPU
    #   backend's backends/cpu/fused.py); False where there are none
    def decode_graphs(self, model: Any, kv: Any) -> Any: ...
    # ^ an object whose applies(batch) / run(batch) take pure decode steps of a graph_safe
    #   model (backends/torch/graphs.py), or None where decode steps run as any other
    def new_kv_cache(self, n_layers: int, num_blocks: int, block_size: int, n_kv_head: int,
                     head_dim: int, layer_blocks: Any = None) -> Any: ...
    # ^ layer_blocks: blocks per layer when they differ (a sliding-window group's pool)
    def attention(self, q: Any, k: Any, v: Any, cache: Any, layer: int, batch: ForwardBatch,
                  scale: float, window: int, sinks: Any = None) -> Any: ...
    # ^ sinks: per query head a logit in the softmax denominator (gpt-oss; cpu backend only)
    def to_numpy(self, x: Any) -> np.ndarray: ...
    # encoder models (BERT)
    def layer_norm(self, x: Any, w: Any, b: Any, eps: float) -> Any: ...
    def gelu(self, x: Any) -> Any: ...                        # in place on x (tanh approx.)
    def contiguous(self, x: Any) -> Any: ...                  # x, or a dense copy of a view
    def encoder_attention(self, q: Any, k: Any, v: Any, batch: ForwardBatch, scale: float,
                          window: int = 0) -> Any: ...
    # ^ non-causal, within a sequence; window > 0: only |pos_i - pos_j| <= window // 2
