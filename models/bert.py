"""BERT encoders (all-MiniLM, bge, bge-reranker): absolute position embeddings, token type
embeddings (type 0 for every token, as llama.cpp), layer norm with bias after each residual
(post-norm), GELU feed-forward, and non-causal attention within each sequence.

nomic-bert (nomic-embed-text) is the same block with rotary positions (NeoX, full head) in
place of position embeddings, a fused attn_qkv matrix, and a SwiGLU feed-forward.

It is embedding-only: the forward pass leaves the last layer's hidden states of the requested
rows in batch.hidden and computes no logits. The runner computes a prompt only once all of it
is scheduled (`non_causal`), because every token attends to the tokens after it too. A
reranker's classification head (cls.weight/bias, tanh, cls.output.weight/bias) scores the
first token's state (`rank_head`), as llama.cpp's rank pooling does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from edgeinfer.backends.base import ForwardBatch
from edgeinfer.formats.model_config import ModelConfig
from edgeinfer.models.base import ModelBase


@dataclass
class BertLayer:
    wq: Any
    wk: Any
    wv: Any
    wo: Any
    bq: Any
    bk: Any
    bv: Any
    bo: Any
    attn_norm_w: Any
    attn_norm_b: Any
    w_up: Any
    b_up: Any
    w_gate: Any
    w_down: Any
    b_down: Any
    out_norm_w: Any
    out_norm_b: Any


_LEGACY = {2, 3, 6, 7, 8, 9}        # Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1: Q8_0 activations
_KQUANT = {10, 11, 12, 13, 14}      # Q2_K .. Q6_K: Q8_K activations


def act_round(x: np.ndarray, ggml_type: int) -> np.ndarray:
    """The activation rounding ggml's CPU matmul applies before a dot with a weight of this
    type (8-bit blocks of 32 or 256, or f16), so a small head computed here in numpy gives
    llama.cpp's numbers, not float32 ones."""
    x = np.asarray(x, np.float32).reshape(-1)
    if ggml_type == 1:
        return x.astype(np.float16).astype(np.float32)
    A = 32 if ggml_type in _LEGACY else 256 if ggml_type in _KQUANT else 0
    if not A or x.size % A:
        return x
    b = x.reshape(-1, A)
    if A == 32:
        amax = np.abs(b).max(axis=1, keepdims=True)
        safe = np.where(amax > 0, amax, 1)
        q = np.rint(b * (np.float32(127) / safe))
        d = (amax / np.float32(127)).astype(np.float16).astype(np.float32)
        return (q * d).astype(np.float32).reshape(-1)
    idx = np.abs(b).argmax(axis=1)
    mx = b[np.arange(len(b)), idx][:, None]
    safe = np.where(mx != 0, mx, 1)
    iscale = np.float32(-127) / safe
    q = np.minimum(np.rint(iscale * b), 127)
    return np.where(mx != 0, q / iscale, 0).astype(np.float32).reshape(-1)


def _type(gf, name: str) -> int:
    t = gf.tensors.get(name)
    return int(t.ggml_type) if t is not None else 0


def _dense(gf, name: str) -> np.ndarray | None:
    """A small tensor (the classification head) as float32 numpy, ggml shape reversed."""
    t = gf.tensors.get(name)
    if t is None:
        return None
    from edgeinfer.formats.ggml_types import GGMLQuantizationType, dequantize
    raw = gf.raw(name)
    if t.ggml_type == GGMLQuantizationType.F32:
        a = np.frombuffer(raw, np.float32)
    else:
        a = dequantize(raw, t.ggml_type)
    return np.asarray(a, np.float32).reshape(tuple(reversed([int(d) for d in t.shape])))


class BertModel(ModelBase):
    non_causal = True
    embedding_only = True

    def __init__(self, cfg: ModelConfig, ops, gf):
        self.cfg, self.ops = cfg, ops

        def opt(name):
            return ops.vector(gf, name) if name in gf.tensors else None
        self.nomic = cfg.arch == "nomic-bert"
        self.tok_embd = ops.matrix(gf, "token_embd.weight")
        self.pos_embd = None if self.nomic else ops.matrix(gf, "position_embd.weight")

        def mat(name):
            return ops.matrix(gf, name) if name in gf.tensors else None
        types = opt("token_types.weight")
        self.type0 = types[:cfg.n_embd] if types is not None else None    # "sentence A"
        self.norm_w = ops.vector(gf, "token_embd_norm.weight")
        self.norm_b = ops.vector(gf, "token_embd_norm.bias")
        self.layers = []
        for i in range(cfg.n_layers):
            p = f"blk.{i}."
            fused = cfg.fused_qkv
            self.layers.append(BertLayer(
                # fused (nomic): wq holds attn_qkv, wk/wv are None
                wq=ops.matrix(gf, p + ("attn_qkv.weight" if fused else "attn_q.weight")),
                wk=None if fused else ops.matrix(gf, p + "attn_k.weight"),
                wv=None if fused else ops.matrix(gf, p + "attn_v.weight"),
                wo=ops.matrix(gf, p + "attn_output.weight"),
                bq=opt(p + ("attn_qkv.bias" if fused else "attn_q.bias")),
                bk=opt(p + "attn_k.bias"), bv=opt(p + "attn_v.bias"),
                bo=opt(p + "attn_output.bias"),
                attn_norm_w=ops.vector(gf, p + "attn_output_norm.weight"),
                attn_norm_b=ops.vector(gf, p + "attn_output_norm.bias"),
                w_up=ops.matrix(gf, p + "ffn_up.weight"), b_up=opt(p + "ffn_up.bias"),
                w_gate=mat(p + "ffn_gate.weight"),
                w_down=ops.matrix(gf, p + "ffn_down.weight"), b_down=opt(p + "ffn_down.bias"),
                out_norm_w=ops.vector(gf, p + "layer_output_norm.weight"),
                out_norm_b=ops.vector(gf, p + "layer_output_norm.bias")))
        # reranker head: small, kept as float32 numpy
        self.cls_w, self.cls_b = _dense(gf, "cls.weight"), _dense(gf, "cls.bias")
        self.cls_out_w, self.cls_out_b = _dense(gf, "cls.output.weight"), _dense(gf, "cls.output.bias")
        self.cls_types = (_type(gf, "cls.weight"), _type(gf, "cls.output.weight"))

    @property
    def has_rank_head(self) -> bool:
        return self.cls_w is not None or self.cls_out_w is not None

    def _linear(self, x, w, b):
        y = self.ops.matmul(x, w)
        return self.ops.add_bias(y, b) if b is not None else y

    def forward(self, batch: ForwardBatch, kv=None):
        cfg, ops = self.cfg, self.ops
        T, eps = batch.num_tokens, cfg.rms_eps
        x = ops.embed(self.tok_embd, batch.token_ids)
        if self.type0 is not None:
            x = ops.add(x, self.type0)
        if self.pos_embd is not None:
            x = ops.add(x, ops.embed(self.pos_embd, batch.positions))
        x = ops.layer_norm(x, self.norm_w, self.norm_b, eps)
        scale = 1.0 / math.sqrt(cfg.head_dim)
        H, KVH, D = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        for w in self.layers:
            if w.wk is None:        # fused q|k|v columns
                qkv = self._linear(x, w.wq, w.bq)
                q = ops.contiguous(qkv[:, :H * D]).reshape(T, H, D)
                k = ops.contiguous(qkv[:, H * D:(H + KVH) * D]).reshape(T, KVH, D)
                v = ops.contiguous(qkv[:, (H + KVH) * D:]).reshape(T, KVH, D)
            else:
                q = self._linear(x, w.wq, w.bq).reshape(T, H, D)
                k = self._linear(x, w.wk, w.bk).reshape(T, KVH, D)
                v = self._linear(x, w.wv, w.bv).reshape(T, KVH, D)
            if self.nomic:
                q = ops.rope(q, batch, cfg.rope_base, cfg.rope_scale, True)
                k = ops.rope(k, batch, cfg.rope_base, cfg.rope_scale, True)
            a = ops.encoder_attention(q, k, v, batch, scale).reshape(T, cfg.q_dim)
            cur = ops.add(self._linear(a, w.wo, w.bo), x)
            cur = ops.layer_norm(cur, w.attn_norm_w, w.attn_norm_b, eps)
            if w.w_gate is not None:        # SwiGLU (nomic): silu(gate) * up
                h = ops.swiglu(ops.matmul(cur, w.w_gate), self._linear(cur, w.w_up, w.b_up))
            else:
                h = ops.gelu(self._linear(cur, w.w_up, w.b_up))
            f = self._linear(h, w.w_down, w.b_down)
            x = ops.layer_norm(ops.add(f, cur), w.out_norm_w, w.out_norm_b, eps)
        if batch.hidden_indices is not None:
            batch.hidden = ops.to_numpy(ops.take_rows(x, batch.hidden_indices))
        return None

    def rank_head(self, h: np.ndarray) -> np.ndarray:
        """Classification head over the first token's state: [classes] raw scores."""
        if not self.has_rank_head:
            raise RuntimeError("this model has no classification head (cls.weight / "
                               "cls.output.weight) for rank pooling")
        y = np.asarray(h, np.float32).reshape(-1)
        if self.cls_w is not None:
            y = self.cls_w @ act_round(y, self.cls_types[0])
            if self.cls_b is not None:
                y = y + self.cls_b.reshape(-1)
            y = np.tanh(y)
        if self.cls_out_w is not None:
            y = self.cls_out_w.reshape(-1, y.shape[0]) @ act_round(y, self.cls_types[1])
            if self.cls_out_b is not None:
                y = y + self.cls_out_b.reshape(-1)
        return y.astype(np.float32).reshape(-1)
