"""Gemma 3: interleaved sliding-window (local) and global attention layers, per-head QK-norm,
embeddings scaled by sqrt(hidden), post-attention and post-FFN norms, GeGLU, tied output.

Every `swa_pattern`-th layer (6th) is global with the long rope base; the others attend to the
last `sliding_window` positions with the local rope base (10,000). GGUF norm weights already
include Gemma's (1 + w) offset, so plain RMSNorm applies.
"""
from __future__ import annotations

from edgeinfer.backends.base import ForwardBatch
from edgeinfer.formats.model_config import ModelConfig
from edgeinfer.models.base import ModelBase
from edgeinfer.models.llama import attention, final_head, load_head, load_layers


class Gemma3Model(ModelBase):
    accepts_embeddings = True       # image spans (ForwardBatch.embd_rows)
    graph_safe = True               # its forward reads the batch only through ops

    def __init__(self, cfg: ModelConfig, ops, gf):
        self.cfg, self.ops = cfg, ops
        self.tok_embd, self.output_norm, self.output = load_head(cfg, ops, gf)
        self.layers = load_layers(cfg, ops, gf)

    def forward(self, batch: ForwardBatch, kv):
        cfg, ops = self.cfg, self.ops
        x = ops.scale(ops.embed(self.tok_embd, batch.token_ids), cfg.embed_scale)
        if batch.embd_rows is not None:     # image embeddings: not scaled (as llama.cpp)
            x = ops.put_rows(x, batch.embd_rows, batch.embd_values)
        eps, layers = cfg.rms_eps, self.layers
        h = ops.rms_norm(x, layers[0].attn_norm, eps)
        for i, w in enumerate(layers):
            local = cfg.is_sliding(i)
            a = attention(cfg, ops, w, h, batch, kv, i,
                          cfg.rope_base_local if local else cfg.rope_base,
                          cfg.sliding_window if local else 0)
            # x += post_norm(a); h = the next norm of x: one op (add_rms_norm) each time
            h = ops.add_rms_norm(x, a, w.post_attn_norm, w.ffn_norm, eps)
            f = ops.matmul(ops.geglu(*ops.matmuls(h, (w.w_gate, w.w_up))), w.w_down)
            if i + 1 < len(layers):
                h = ops.add_rms_norm(x, f, w.post_ffw_norm, layers[i + 1].attn_norm, eps)
            else:       # the output norm comes after final_head's choice of rows
                x = ops.add(x, ops.rms_norm(f, w.post_ffw_norm, eps))
        return final_head(cfg, ops, x, batch, self.output_norm, self.output)
