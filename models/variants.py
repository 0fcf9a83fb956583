"""Llama-block variants that differ from llama only in projections and rope: phi3, smollm3,
mistral3 (each file of the family subclasses `VariantModel`), and qwen3moe's attention.

What a config switches on, as llama.cpp builds each graph:
- fused projections (phi3): one `attn_qkv` matrix whose output rows are q, k, v in order, and
  one `ffn_up` of 2 x n_ff rows, gate then up (ggml_swiglu: silu(first half) * second half);
- partial rotary (`n_rot` < head_dim, Phi-4-mini): only the first n_rot dims of a head rotate;
- rope cos/sin multiplied by `rope_mscale` (phi3's rope.scaling.attn_factor), per-dimension
  frequency factors (phi3's rope_factors_short, llama3-style rope_freqs, and YaRN's ramp
  between interpolated and extrapolated frequencies folded into factors the same way);
- no rope on every `no_rope_step`-th layer (smollm3: llama.cpp hard-codes 4);
- Llama 4 style attention temperature (mistral3): q scaled by
  1 + temp_scale * log(floor(pos / original context) + 1) (Ministral 3's form: pos, not
  pos + 1 as Llama 4), so 1 below the original context.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from edgeinfer.backends.base import ForwardBatch
from edgeinfer.formats.model_config import ModelConfig
from edgeinfer.models.base import ModelBase
from edgeinfer.models.llama import final_head, load_head


@dataclass
class VariantLayer:
    attn_norm: Any
    wo: Any
    ffn_norm: Any
    wqkv: Any = None
    wq: Any = None
    wk: Any = None
    wv: Any = None
    q_norm: Any = None
    k_norm: Any = None
    w_gate: Any = None
    w_up: Any = None          # phi3: gate and up rows in one matrix
    w_down: Any = None
    moe: Any = None           # qwen3moe: its ExpertFFN


def yarn_factors(cfg: ModelConfig) -> np.ndarray:
    """ggml's rope_yarn as per-pair frequency divisors: theta = theta_extrap * (fs * (1 - mix)
    + mix), mix the ramp between the correction dims of beta_fast and beta_slow."""
    n = cfg.rot_dim
    fs = 1.0 / cfg.yarn_factor

    def corr_dim(n_rot: float) -> float:
        return n * math.log(cfg.yarn_orig_ctx / (n_rot * 2 * math.pi)) / (2 * math.log(cfg.rope_base))

    low = max(0.0, math.floor(corr_dim(cfg.yarn_beta_fast)))
    high = min(n - 1.0, math.ceil(corr_dim(cfg.yarn_beta_slow)))
    y = (np.arange(n // 2, dtype=np.float64) - low) / max(0.001, high - low)
    mix = 1.0 - np.clip(y, 0.0, 1.0)
    return (1.0 / (fs * (1.0 - mix) + mix)).astype(np.float32)


def yarn_mscale(cfg: ModelConfig) -> float:
    """The cos/sin multiplier for YaRN, as the vendored libllama ends with it (measured on
    synthetic mistral3 files; the other choice is off by ~1.5 logits): ggml's kernel's
    1 + 0.1 ln(factor) alone; with a log multiplier (mscale_all_dim), get_mscale(factor, 1) /
    get_mscale(factor, mul) instead (1 for Ministral 3's mul = 1)."""
    lf = math.log(cfg.yarn_factor)
    if cfg.yarn_log_mul:
        return (1.0 + 0.1 * lf) / (1.0 + 0.1 * cfg.yarn_log_mul * lf)
    return 1.0 + 0.1 * lf


class VariantModel(ModelBase):
    def __init__(self, cfg: ModelConfig, ops, gf):
        self.cfg, self.ops = cfg, ops
        self.tok_embd, self.output_norm, self.output = load_head(cfg, ops, gf)
        factors = None
        if cfg.rope_factors:
            factors = ops.vector(gf, f"rope_factors_{cfg.rope_factors}.weight")
        elif cfg.has_rope_freqs:
            factors = ops.vector(gf, "rope_freqs.weight")
        self.mscale = cfg.rope_mscale
        if cfg.yarn_factor:
            y = yarn_factors(cfg)
            factors = y if factors is None else (np.asarray(ops.to_numpy(factors)) * y)
            self.mscale *= yarn_mscale(cfg)
        self.rope_freqs = factors
        self.layers = [self.load_layer(gf, i) for i in range(cfg.n_layers)]

    def set_context_length(self, n_ctx: int, gf) -> None:
        """Called by the engine before any token, with its context per sequence: phi3 takes
        the LongRoPE long factors when it exceeds the original context, as llama.cpp does
        (llama_model::get_rope_factors: n_ctx_per_seq > n_ctx_orig_yarn)."""
        cfg = self.cfg
        if cfg.rope_factors:
            which = "long" if n_ctx > cfg.rope_orig_ctx else "short"
            self.rope_freqs = self.ops.vector(gf, f"rope_factors_{which}.weight")

    def load_layer(self, gf, i: int) -> VariantLayer:
        cfg, ops, p = self.cfg, self.ops, f"blk.{i}."
        m = lambda n: ops.matrix(gf, p + n + ".weight")      # noqa: E731
        opt = lambda n: ops.vector(gf, p + n) if p + n in gf.tensors else None  # noqa: E731
        w = VariantLayer(attn_norm=ops.vector(gf, p + "attn_norm.weight"), wo=m("attn_output"),
                         ffn_norm=ops.vector(gf, p + "ffn_norm.weight"),
                         q_norm=opt("attn_q_norm.weight"), k_norm=opt("attn_k_norm.weight"))
        if cfg.fused_qkv:
            w.wqkv = m("attn_qkv")
        else:
            w.wq, w.wk, w.wv = m("attn_q"), m("attn_k"), m("attn_v")
        if not cfg.n_expert:
            w.w_up, w.w_down = m("ffn_up"), m("ffn_down")
            if not cfg.fused_up:
                w.w_gate = m("ffn_gate")
        return w

    # -- the block ---------------------------------------------------------------------------
    def rope(self, x, batch: ForwardBatch):
        cfg, ops = self.cfg, self.ops
        if cfg.n_rot:           # partial rotary: the rest of each head passes through
            r = ops.rope(ops.contiguous(x[..., :cfg.n_rot]), batch, cfg.rope_base, cfg.rope_scale,
                         cfg.rope_neox, self.rope_freqs)
            if self.mscale != 1.0:
                r = ops.scale(r, self.mscale)
            x[..., :cfg.n_rot] = r
            return x
        x = ops.rope(x, batch, cfg.rope_base, cfg.rope_scale, cfg.rope_neox, self.rope_freqs)
        return ops.scale(x, self.mscale) if self.mscale != 1.0 else x

    def attention(self, w: VariantLayer, h, batch: ForwardBatch, kv, layer: int):
        cfg, ops = self.cfg, self.ops
        T, qd, kvd = batch.num_tokens, cfg.q_dim, cfg.kv_dim
        if w.wqkv is not None:
            qkv = ops.matmul(h, w.wqkv)
            q, k, v = (ops.contiguous(qkv[:, a:b]) for a, b in
                       ((0, qd), (qd, qd + kvd), (qd + kvd, qd + 2 * kvd)))
        else:
            q, k, v = ops.matmuls(h, (w.wq, w.wk, w.wv))
        q = q.reshape(T, cfg.n_head, cfg.head_dim)
        k = k.reshape(T, cfg.n_kv_head, cfg.head_dim)
        v = v.reshape(T, cfg.n_kv_head, cfg.head_dim)
        rope = cfg.uses_rope(layer)
        if w.q_norm is not None and rope and not cfg.n_rot and self.mscale == 1.0:
            # QK-norm then rope, one op each (qwen3moe): the bits of the two ops
            q, k = (ops.norm_rope(x, n, cfg.rms_eps, batch, cfg.rope_base, cfg.rope_scale,
                                  cfg.rope_neox, self.rope_freqs)
                    for x, n in ((q, w.q_norm), (k, w.k_norm)))
        else:
            if w.q_norm is not None:
                q, k = ops.rms_norm(q, w.q_norm, cfg.rms_eps), ops.rms_norm(k, w.k_norm, cfg.rms_eps)
            if rope:
                q, k = self.rope(q, batch), self.rope(k, batch)
        if cfg.attn_temp_scale:
            self.temperature(q, batch)
        a = ops.attention(q, k, v, kv, layer, batch, 1.0 / math.sqrt(cfg.head_dim), 0)
        return ops.matmul(a.reshape(T, qd), w.wo)

    def temperature(self, q, batch: ForwardBatch) -> None:
        cfg = self.cfg
        pos = batch.positions.astype(np.float64)
        s = np.log(np.floor(pos / cfg.attn_temp_floor) + 1.0) * cfg.attn_temp_scale + 1.0
        for t in np.nonzero(s != 1.0)[0]:       # only past the original context
            self.ops.scale(q[int(t)], float(s[t]))

    def ffn(self, w: VariantLayer, h):
        ops = self.ops
        if w.w_gate is None:        # fused gate/up rows (phi3)
            gu = ops.matmul(h, w.w_up)
            n = gu.shape[-1] // 2
            return ops.swiglu_matmul(ops.contiguous(gu[:, :n]), ops.contiguous(gu[:, n:]),
                                     w.w_down)
        return ops.swiglu_matmul(*ops.matmuls(h, (w.w_gate, w.w_up)), w.w_down)

    def forward(self, batch: ForwardBatch, kv):
        cfg, ops = self.cfg, self.ops
        x = ops.embed(self.tok_embd, batch.token_ids)
        for i, w in enumerate(self.layers):
            h = ops.rms_norm(x, w.attn_norm, cfg.rms_eps)
            x = ops.add(x, self.attention(w, h, batch, kv, i))
            h = ops.rms_norm(x, w.ffn_norm, cfg.rms_eps)
            x = ops.add(x, self.ffn(w, h))
        return final_head(cfg, ops, x, batch, self.output_norm, self.output)
