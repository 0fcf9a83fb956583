"""EmbeddingGemma (`gemma-embedding`): the Gemma 3 block (scaled embeddings, QK-norm, post
norms, GeGLU, local rope base on sliding layers) with bidirectional attention. Global layers
see the whole sequence; local (sliding) layers see the tokens within window // 2 positions on
either side (llama.cpp's LLAMA_SWA_TYPE_SYMMETRIC). The final norm's output is the hidden
state that pooling (mean) reads; the optional sentence-transformers dense projections
(dense_2, dense_3) apply after pooling (`post_pool`), as llama.cpp's build_dense_out.

Embedding-only and non-causal: the runner computes a prompt once all of it is scheduled.
"""
from __future__ import annotations

import math

import numpy as np

from edgeinfer.backends.base import ForwardBatch
from edgeinfer.formats.model_config import ModelConfig
from edgeinfer.models.base import ModelBase
from edgeinfer.models.bert import _dense
from edgeinfer.models.llama import load_head, load_layers


class GemmaEmbeddingModel(ModelBase):
    non_causal = True
    embedding_only = True

    def __init__(self, cfg: ModelConfig, ops, gf):
        self.cfg, self.ops = cfg, ops
        self.tok_embd, self.output_norm, _ = load_head(cfg, ops, gf)
        self.layers = load_layers(cfg, ops, gf)
        self.dense_2 = _dense(gf, "dense_2.weight")      # [feat_out, n_embd]
        self.dense_2_b = _dense(gf, "dense_2.bias")
        self.dense_3 = _dense(gf, "dense_3.weight")      # [n_embd, feat_in]

    def _attention(self, w, h, batch: ForwardBatch, rope_base: float, window: int):
        cfg, ops = self.cfg, self.ops
        T = batch.num_tokens
        q, k, v = ops.matmuls(h, (w.wq, w.wk, w.wv))
        q = q.reshape(T, cfg.n_head, cfg.head_dim)
        k = k.reshape(T, cfg.n_kv_head, cfg.head_dim)
        v = v.reshape(T, cfg.n_kv_head, cfg.head_dim)
        q, k = ops.rms_norm(q, w.q_norm, cfg.rms_eps), ops.rms_norm(k, w.k_norm, cfg.rms_eps)
        q = ops.rope(q, batch, rope_base, cfg.rope_scale, cfg.rope_neox)
        k = ops.rope(k, batch, rope_base, cfg.rope_scale, cfg.rope_neox)
        a = ops.encoder_attention(q, k, v, batch, 1.0 / math.sqrt(cfg.head_dim), window)
        return ops.matmul(a.reshape(T, cfg.q_dim), w.wo)

    def forward(self, batch: ForwardBatch, kv=None):
        cfg, ops = self.cfg, self.ops
        x = ops.scale(ops.embed(self.tok_embd, batch.token_ids), cfg.embed_scale)
        for i, w in enumerate(self.layers):
            local = cfg.is_sliding(i)
            h = ops.rms_norm(x, w.attn_norm, cfg.rms_eps)
            a = self._attention(w, h, batch, cfg.rope_base_local if local else cfg.rope_base,
                                cfg.sliding_window if local else 0)
            x = ops.add(x, ops.rms_norm(a, w.post_attn_norm, cfg.rms_eps))
            h = ops.rms_norm(x, w.ffn_norm, cfg.rms_eps)
            f = ops.matmul(ops.geglu(*ops.matmuls(h, (w.w_gate, w.w_up))), w.w_down)
            x = ops.add(x, ops.rms_norm(f, w.post_ffw_norm, cfg.rms_eps))
        if batch.hidden_indices is not None:
            h = ops.rms_norm(ops.take_rows(x, batch.hidden_indices), self.output_norm,
                             cfg.rms_eps)
            batch.hidden = ops.to_numpy(h)
        return None

    @property
    def post_pool(self):
        if self.dense_2 is None and self.dense_3 is None:
            return None
        return self._dense_out

    def _dense_out(self, vec: np.ndarray) -> np.ndarray:
        """dense_2 (+ bias), then dense_3, over the pooled vector (or each row of one)."""
        y = np.asarray(vec, np.float32)
        rows = y.reshape(-1, y.shape[-1])
        if self.dense_2 is not None:
            rows = rows @ self.dense_2.T
        if self.dense_2_b is not None:
            rows = rows + self.dense_2_b.reshape(-1)
        if self.dense_3 is not None:
            rows = rows @ self.dense_3.T
        return rows.astype(np.float32).reshape(y.shape[:-1] + (rows.shape[-1],))
