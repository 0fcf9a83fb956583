"""Llama-family decoder: Llama 2/3, Mistral, TinyLlama, SmolLM; qwen2/qwen3 reuse it.

Pre-norm blocks: x += attn(rms_norm(x)); x += swiglu_ffn(rms_norm(x)). Optional q/k/v biases
(qwen2) and per-head q/k RMSNorm (qwen3) are switched on by the config.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from edgeinfer.backends.base import ForwardBatch
from edgeinfer.formats.model_config import ModelConfig
from edgeinfer.models.base import ModelBase


@dataclass
class LayerWeights:
    attn_norm: Any
    wq: Any
    wk: Any
    wv: Any
    wo: Any
    ffn_norm: Any
    w_gate: Any
    w_up: Any
    w_down: Any
    q_norm: Any = None
    k_norm: Any = None
    bq: Any = None
    bk: Any = None
    bv: Any = None
    post_attn_norm: Any = None
    post_ffw_norm: Any = None


def load_layers(cfg: ModelConfig, ops, gf) -> list[LayerWeights]:
    layers = []
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        opt = (lambda n: ops.vector(gf, p + n) if p + n in gf.tensors else None)
        layers.append(LayerWeights(
            attn_norm=ops.vector(gf, p + "attn_norm.weight"),
            wq=ops.matrix(gf, p + "attn_q.weight"), wk=ops.matrix(gf, p + "attn_k.weight"),
            wv=ops.matrix(gf, p + "attn_v.weight"), wo=ops.matrix(gf, p + "attn_output.weight"),
            ffn_norm=ops.vector(gf, p + "ffn_norm.weight"),
            w_gate=ops.matrix(gf, p + "ffn_gate.weight"), w_up=ops.matrix(gf, p + "ffn_up.weight"),
            w_down=ops.matrix(gf, p + "ffn_down.weight"),
            q_norm=opt("attn_q_norm.weight"), k_norm=opt("attn_k_norm.weight"),
            bq=opt("attn_q.bias"), bk=opt("attn_k.bias"), bv=opt("attn_v.bias"),
            post_attn_norm=opt("post_attention_norm.weight"),
            post_ffw_norm=opt("post_ffw_norm.weight")))
    return layers


def attention(cfg: ModelConfig, ops, w: LayerWeights, h, batch: ForwardBatch, kv, layer: int,
              rope_base: float, window: int = 0, rope_freqs=None):
    """Projections, optional bias and QK-norm, rope, paged attention, output projection."""
    T = batch.num_tokens
    q, k, v = ops.matmuls(h, (w.wq, w.wk, w.wv))
    if w.bq is not None:
        q, k, v = ops.add_bias(q, w.bq), ops.add_bias(k, w.bk), ops.add_bias(v, w.bv)
    q = q.reshape(T, cfg.n_head, cfg.head_dim)
    k = k.reshape(T, cfg.n_kv_head, cfg.head_dim)
    v = v.reshape(T, cfg.n_kv_head, cfg.head_dim)
    if w.q_norm is not None:      # QK-norm, then rope: one op each for q and k
        q = ops.norm_rope(q, w.q_norm, cfg.rms_eps, batch, rope_base, cfg.rope_scale,
                          cfg.rope_neox, rope_freqs)
        k = ops.norm_rope(k, w.k_norm, cfg.rms_eps, batch, rope_base, cfg.rope_scale,
                          cfg.rope_neox, rope_freqs)
    else:
        q = ops.rope(q, batch, rope_base, cfg.rope_scale, cfg.rope_neox, rope_freqs)
        k = ops.rope(k, batch, rope_base, cfg.rope_scale, cfg.rope_neox, rope_freqs)
    a = ops.attention(q, k, v, kv, layer, batch, 1.0 / math.sqrt(cfg.head_dim), window)
    return ops.matmul(a.reshape(T, cfg.q_dim), w.wo)


def load_head(cfg: ModelConfig, ops, gf):
    """Token embedding, final norm and output projection (the embedding when tied)."""
    if cfg.tied_output:
        tok_embd = output = ops.matrix(gf, "token_embd.weight")
    else:       # only ever read by rows: the backend need not make it a matmul weight
        tok_embd, output = ops.table(gf, "token_embd.weight"), ops.matrix(gf, "output.weight")
    return tok_embd, ops.vector(gf, "output_norm.weight"), output


class LlamaModel(ModelBase):
    accepts_embeddings = True       # image spans (ForwardBatch.embd_rows): SmolVLM's text model
    graph_safe = True               # its forward reads the batch only through ops

    def __init__(self, cfg: ModelConfig, ops, gf):
        self.cfg, self.ops = cfg, ops
        self.tok_embd, self.output_norm, self.output = load_head(cfg, ops, gf)
        self.rope_freqs = ops.vector(gf, "rope_freqs.weight") if cfg.has_rope_freqs else None
        self.layers = load_layers(cfg, ops, gf)

    # -- a step of a few tokens on the CPU: the attention block's small ops fused ------------
    def _fused_model(self) -> bool:
        """Whether every layer can take the CPU backend's fused attention block (ops.fused_layer:
        backends/cpu/fused.py, _layer.py): repacked q/k/v/o matrices, QK-norm on both q and k
        or on neither, biases on all of q/k/v or none, no post-norms. Decided once."""
        ok = self.__dict__.get("_fused_ok")
        if ok is None:
            cfg, ops = self.cfg, self.ops
            width = max(cfg.n_embd, cfg.q_dim)
            ok = self._fused_ok = all(
                (w.q_norm is None) == (w.k_norm is None)
                and (w.bq is None) == (w.bk is None) == (w.bv is None)
                and (w.q_norm is None or w.bq is None)
                and w.post_attn_norm is None and w.post_ffw_norm is None
                and ops.fused_layer_rows(1, width, (w.wq, w.wk, w.wv, w.wo))
                for w in self.layers)
        return ok

    def _fused_parts(self) -> tuple:
        return fused_parts(self, swiglu=True)

    def _forward_fused(self, batch: ForwardBatch, kv):
        """forward's ops with the same bits, for a few rows: each layer's residual add, norm,
        q/k/v, biases or QK-norm and rope are one kernel call, its output projection,
        residual add and FFN norm another (ops.fused_layer), the step's shared choices made
        once (ops.layer_step): ~6 calls a layer where there were ~14."""
        cfg, ops = self.cfg, self.ops
        fused, head, step = fused_step(self, batch)
        T = batch.num_tokens
        threads, cos, sin = step.threads, step.cos, step.sin
        x = ops.embed(self.tok_embd, batch.token_ids)
        f = None                # the previous layer's FFN output, added by the next attn_in
        for i, (w, fl) in enumerate(zip(self.layers, fused)):
            q, k, v = fl.attn_in(x, f, cos, sin, threads)
            a = step.attend(q, k, v, kv, i).reshape(T, cfg.q_dim)
            if fl.ffn is not None and fl.ffn.takes(T):
                f = fl.attn_out_ffn(a, x, threads)      # the same calls' bits, in one
                continue
            h = fl.attn_out(a, x, threads)
            f = ops.swiglu_matmul(*ops.matmuls(h, (w.w_gate, w.w_up)), w.w_down)
        if head is not None and batch.hidden_indices is None and len(batch.logits_indices) == T:
            return head(x, f, threads)      # final_head's bits: every row is a logits row
        return self.logits(ops.add(x, f), batch)

    def _fusable(self, batch: ForwardBatch) -> bool:
        return fusable(self, batch)

    def forward(self, batch: ForwardBatch, kv):
        cfg, ops = self.cfg, self.ops
        if self._fusable(batch):
            return self._forward_fused(batch, kv)
        x = ops.embed(self.tok_embd, batch.token_ids)
        if batch.embd_rows is not None:
            x = ops.put_rows(x, batch.embd_rows, batch.embd_values)
        for i, w in enumerate(self.layers):
            h = ops.rms_norm(x, w.attn_norm, cfg.rms_eps)
            x = ops.add(x, attention(cfg, ops, w, h, batch, kv, i, cfg.rope_base, 0, self.rope_freqs))
            h = ops.rms_norm(x, w.ffn_norm, cfg.rms_eps)
            x = ops.add(x, ops.swiglu_matmul(*ops.matmuls(h, (w.w_gate, w.w_up)), w.w_down))
        return self.logits(x, batch)

    def logits(self, x, batch: ForwardBatch):
        return final_head(self.cfg, self.ops, x, batch, self.output_norm, self.output)


def fusable(model, batch: ForwardBatch) -> bool:
    """Whether this step runs through the model's fused layers: every layer qualifies
    (model._fused_model), no image rows, and few enough tokens (ops.fused_layer_rows)."""
    cfg = model.cfg
    return (batch.embd_rows is None and model._fused_model()
            and model.ops.fused_layer_rows(batch.num_tokens, max(cfg.n_embd, cfg.q_dim), ()))


def fused_parts(model, bank_of=lambda w: None, swiglu: bool = False) -> tuple:
    """(each layer's ops.fused_layer, the ops.fused_head or None) of a model whose layers are
    llama blocks (wq/wk/wv/wo, attention and FFN norms, QK-norm or q/k/v biases or neither),
    made once; `bank_of(layer)` is a layer's grouped expert bank for ops.fused_layer
    (qwen3moe); swiglu: every layer's FFN is w_gate/w_up/w_down with SwiGLU, bound too."""
    parts = model.__dict__.get("_fused_parts_")
    if parts is None:
        cfg, ops = model.cfg, model.ops
        layers = [ops.fused_layer(w.attn_norm, cfg.rms_eps, (w.wq, w.wk, w.wv),
                                  (cfg.n_head, cfg.n_kv_head), w.q_norm, w.k_norm, cfg.rope_neox,
                                  w.wo, w.ffn_norm, bank_of(w), head_dim=cfg.head_dim,
                                  biases=None if getattr(w, "bq", None) is None
                                  else (w.bq, w.bk, w.bv),
                                  ffn=(w.w_gate, w.w_up, w.w_down) if swiglu else None)
                  for w in model.layers]
        head = ops.fused_head(model.output_norm, cfg.rms_eps, model.output)
        parts = model._fused_parts_ = (layers, head)
    return parts


def fused_step(model, batch: ForwardBatch) -> tuple:
    """(the model's fused layers, its fused head or None: fused_parts) and this step's
    ops.layer_step (rope tables, threads, attention plan), for a fused forward."""
    cfg = model.cfg
    fused, head = model._fused_parts()
    step = model.ops.layer_step(batch, cfg.n_head, cfg.n_kv_head, cfg.head_dim,
                                1.0 / math.sqrt(cfg.head_dim), cfg.rope_base, cfg.rope_scale,
                                model.rope_freqs)
    return fused, head, step


def final_head(cfg: ModelConfig, ops, x, batch: ForwardBatch, norm, output):
    """The last norm and the output projection for the rows in batch.logits_indices; the
    normed hidden states of batch.hidden_indices go to batch.hidden (embeddings). None when
    no row wants logits."""
    if batch.hidden_indices is not None:
        h = ops.rms_norm(ops.take_rows(x, batch.hidden_indices), norm, cfg.rms_eps)
        batch.hidden = ops.to_numpy(h)
    if not len(batch.logits_indices):
        return None
    x = ops.take_rows(x, batch.logits_indices)
    return ops.matmul(ops.rms_norm(x, norm, cfg.rms_eps), output)
