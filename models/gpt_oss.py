"""gpt-oss (gpt-oss-20b, gpt-oss-120b) as llama.cpp builds LLM_ARCH_OPENAI_MOE
(llm_build_openai_moe_iswa).

Per layer: x += attn(rms_norm(x)); x += moe(rms_norm(x, post_attention_norm)), where
- attention has biases on q, k, v and the output, NeoX rope with YaRN (models/variants.py's
  factors and mscale, as mistral3), scale 1/sqrt(head_dim), and a sink logit per query head
  that joins the softmax denominator (`attn_sinks`); layers 0, 2, 4, ... attend to the last
  `sliding_window` positions (their K/V in the window pool, released as for Gemma 3);
- the MoE adds the router bias to the router logits, takes the top k logits (ties: the lower
  index) and their softmax as weights (llama.cpp's SOFTMAX_WEIGHT gating); each chosen
  expert adds its biases to gate, up and down, with the clamped SwiGLU of ggml_swiglu_oai
  between: x = min(gate, 7), y = clamp(up, -7, 7), x / (1 + exp(-1.702 x)) * (y + 1).
Experts are qwen3moe's ExpertFFN (routing and expert hooks, weighted and summed per token
in slot order); MXFP4 experts run grouped, in place, one call per projection for all the
step's (token, slot) rows (CpuOps.expert_matmuls). CPU backend only, as qwen3moe.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from edgeinfer.backends.base import ForwardBatch
from edgeinfer.formats.model_config import ModelConfig
from edgeinfer.models.llama import final_head
from edgeinfer.models.qwen3moe import ExpertFFN, Qwen3MoeModel, softmax_rows

SWIGLU_ALPHA = np.float32(1.702)    # llama.cpp's LLM_FFN_SWIGLU_OAI_MOE constants
SWIGLU_LIMIT = np.float32(7.0)


def swiglu_oai(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """ggml_swiglu_oai in float32, in place on gate."""
    np.minimum(gate, SWIGLU_LIMIT, out=gate)
    y = np.clip(up, -SWIGLU_LIMIT, SWIGLU_LIMIT) + np.float32(1.0)
    glu = gate / (np.float32(1.0) + np.exp(-SWIGLU_ALPHA * gate))
    np.multiply(glu, y, out=gate)
    return gate


class GptOssExperts(ExpertFFN):
    def __init__(self, cfg: ModelConfig, ops, gf, prefix: str):
        super().__init__(cfg, ops, gf, prefix)
        X, F, E = cfg.n_expert, cfg.n_ff_exp, cfg.n_embd
        self.router_bias = np.asarray(ops.vector(gf, prefix + "ffn_gate_inp.bias"), np.float32)
        bias = lambda n, rows: np.asarray(ops.vector(gf, prefix + n + ".bias"),    # noqa: E731
                                          np.float32).reshape(X, rows)
        self.b_gate, self.b_up = bias("ffn_gate_exps", F), bias("ffn_up_exps", F)
        self.b_down = bias("ffn_down_exps", E)
        # MXFP4 experts: one grouped call per projection over the chosen experts (the CPU
        # backend's expert_tensor); None: expert by expert (ExpertFFN.__call__)
        banks = [ops.expert_tensor(gf, prefix + n + ".weight")
                 for n in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")]
        self.banks = banks if all(b is not None for b in banks) else None

    def route(self, ops, h) -> tuple[np.ndarray, np.ndarray]:
        """Top k of the biased router logits, weights the softmax of those k logits."""
        logits = np.asarray(ops.to_numpy(ops.matmul(h, self.router)), np.float32)
        logits = logits.reshape(-1, logits.shape[-1]) + self.router_bias
        top = np.argsort(-logits, axis=1, kind="stable")[:, :self.k]
        return top, softmax_rows(np.take_along_axis(logits, top, axis=1))

    def __call__(self, ops, h):
        """Every (token, slot) pair a row, the rows grouped by expert: gate and up of all of
        them in one grouped call (the activations quantized once), each group's biases and
        clamped SwiGLU, down in one more call, then back in (token, slot) order for
        ExpertFFN's slot-order weighted sum. Each row the bits of the expert-by-expert path
        (tests/test_gpt_oss.py)."""
        if self.banks is None:
            return super().__call__(ops, h)
        top, w = self.route(ops, h)
        T, k = top.shape
        pairs = np.argsort(top, axis=None, kind="stable")    # (token, slot) pairs by expert
        ex = top.reshape(-1)[pairs]
        starts = np.concatenate([[0], np.flatnonzero(np.diff(ex)) + 1, [T * k]])
        experts = ex[starts[:-1]]
        # numpy gathers (take_rows keeps an input whose row count is unchanged)
        g, u = ops.expert_matmuls(h[pairs // k], self.banks[:2], starts, experts)
        groups = list(zip(starts[:-1], starts[1:], experts))
        for lo, hi, e in groups:    # a group at a time: its temporaries stay in cache
            swiglu_oai(ops.add_bias(g[lo:hi], self.b_gate[e]), ops.add_bias(u[lo:hi], self.b_up[e]))
        (y,) = ops.expert_matmuls(g, self.banks[2:], starts, experts)
        for lo, hi, e in groups:
            ops.add_bias(y[lo:hi], self.b_down[e])
        back = np.empty_like(pairs)
        back[pairs] = np.arange(T * k)
        y = y[back].reshape(T, k, -1)
        out = y[:, 0] * w[:, :1]
        for j in range(1, k):
            out += y[:, j] * w[:, j:j + 1]
        return out

    def expert(self, ops, x, e: int):
        g, u = ops.matmuls(x, (self.gate[e], self.up[e]))
        g = swiglu_oai(ops.add_bias(g, self.b_gate[e]), ops.add_bias(u, self.b_up[e]))
        return ops.add_bias(ops.matmul(g, self.down[e]), self.b_down[e])


@dataclass
class GptOssLayer:
    attn_norm: Any
    wq: Any
    wk: Any
    wv: Any
    wo: Any
    bq: Any
    bk: Any
    bv: Any
    bo: Any
    sinks: np.ndarray
    ffn_norm: Any           # the file's post_attention_norm
    moe: GptOssExperts


class GptOssModel(Qwen3MoeModel):
    def load_layer(self, gf, i: int) -> GptOssLayer:
        ops, p = self.ops, f"blk.{i}."
        m = lambda n: ops.matrix(gf, p + n + ".weight")     # noqa: E731
        b = lambda n: ops.vector(gf, p + n + ".bias")       # noqa: E731
        return GptOssLayer(
            attn_norm=ops.vector(gf, p + "attn_norm.weight"), wq=m("attn_q"), wk=m("attn_k"),
            wv=m("attn_v"), wo=m("attn_output"), bq=b("attn_q"), bk=b("attn_k"),
            bv=b("attn_v"), bo=b("attn_output"),
            sinks=np.asarray(ops.vector(gf, p + "attn_sinks.weight"), np.float32),
            ffn_norm=ops.vector(gf, p + "post_attention_norm.weight"),
            moe=GptOssExperts(self.cfg, ops, gf, p))

    def attention(self, w: GptOssLayer, h, batch: ForwardBatch, kv, layer: int):
        cfg, ops = self.cfg, self.ops
        T = batch.num_tokens
        q, k, v = ops.matmuls(h, (w.wq, w.wk, w.wv))
        q, k, v = ops.add_bias(q, w.bq), ops.add_bias(k, w.bk), ops.add_bias(v, w.bv)
        q = self.rope(q.reshape(T, cfg.n_head, cfg.head_dim), batch)
        k = self.rope(k.reshape(T, cfg.n_kv_head, cfg.head_dim), batch)
        v = v.reshape(T, cfg.n_kv_head, cfg.head_dim)
        window = cfg.sliding_window if cfg.is_sliding(layer) else 0
        a = ops.attention(q, k, v, kv, layer, batch, 1.0 / math.sqrt(cfg.head_dim), window,
                          sinks=w.sinks)
        return ops.add_bias(ops.matmul(a.reshape(T, cfg.q_dim), w.wo), w.bo)

    def forward(self, batch: ForwardBatch, kv):
        cfg, ops = self.cfg, self.ops
        x = ops.embed(self.tok_embd, batch.token_ids)
        for i, w in enumerate(self.layers):
            x = ops.add(x, self.attention(w, ops.rms_norm(x, w.attn_norm, cfg.rms_eps),
                                          batch, kv, i))
            x = ops.add(x, w.moe(ops, ops.rms_norm(x, w.ffn_norm, cfg.rms_eps)))
        return final_head(cfg, ops, x, batch, self.output_norm, self.output)
