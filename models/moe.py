"""Mixtures of experts on the llama block: Mixtral (a `llama` file with experts), qwen2moe
(Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B) and dots1 (dots.llm1), as llama.cpp's build_llama,
build_qwen2moe and build_dots1 graphs build them.

Per layer: x += attn(rms_norm(x)); x += moe(rms_norm(x, ffn_norm)), where attention is the
llama block's (models/llama.attention: optional q/k/v biases, which qwen2moe has, QK-norm,
which dots1 has, and the config's rope: adjacent pairs for llama, NeoX for the others), and
the MoE is llama.cpp's build_moe_ffn (dots1's first `leading_dense_block_count` layers have
a dense SwiGLU FFN instead):

- router logits from `ffn_gate_inp` [E, X] (F32 in llama.cpp's files); probabilities their
  softmax over all X experts, or their sigmoid (dots1's `expert_gating_func` = 2); the top
  `expert_used_count` by probability plus `exp_probs_b` where the file has it (dots1; ties:
  the lower expert index); weights those probabilities (without the bias), divided by their
  sum (clamped below at 2^-14) when the architecture normalizes them (llama: yes; qwen2moe:
  no; dots1: `expert_weights_norm`), times `expert_weights_scale` unless it is 0 or 1;
- experts in llama.cpp's 3-D tensors (`ffn_{gate,up}_exps` [E, F, X], `ffn_down_exps`
  [F, E, X]) held by the backend (ops.expert_bank), each a SwiGLU FFN; outputs weighted and
  added slot by slot;
- shared experts: a SwiGLU FFN (`ffn_{gate,up,down}_shexp`) run on every token and added
  to the routed experts' sum; qwen2moe's output times sigmoid(h . ffn_gate_inp_shexp)
  (llama.cpp computes that sigmoid as silu(x) / x; so do we); dots1's ungated, its width
  `expert_shared_count` x the experts'.

Mixtral's routing is qwen3moe's (softmax, top k, renormalized), so its layers are
qwen3moe's ExpertFFN, routed inside the grouped kernel. Any other routing is done here
(`GatedExperts.route`, from the router's logits, ExpertBank.logits: each row the bits it gets
alone) and the choice handed to the grouped expert FFN (ops.moe_ffn), never the kernel's own
softmax routing. CPU backend only, as qwen3moe.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from edgeinfer.backends.base import ForwardBatch
from edgeinfer.formats.model_config import ModelConfig
from edgeinfer.models.base import ModelBase
from edgeinfer.models.llama import attention, final_head, load_head
from edgeinfer.models.qwen3moe import ExpertFFN, require_cpu, softmax_rows

MIN_WEIGHT_SUM = np.float32(6.103515625e-5)     # ggml_clamp of the weights' sum (2^-14)


def sigmoid(x: np.ndarray) -> np.ndarray:
    """ggml_sigmoid in float32: 1 / (1 + exp(-x))."""
    one = np.float32(1.0)
    return one / (one + np.exp(-x))


def gate(logits: np.ndarray, k: int, gating: str = "softmax", norm: bool = True,
         scale: float = 0.0, bias: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's build_moe_ffn routing of router logits float32[T, E]: (experts int64[T, k],
    weights float32[T, k]). Probabilities the softmax or sigmoid of the logits; the k largest
    of probability + bias (ties: the lower index); weights the chosen probabilities (without
    the bias), divided by their float64 sum rounded to float32 and clamped at 2^-14 when
    `norm`, times `scale` unless it is 0 or 1."""
    logits = np.asarray(logits, np.float32)
    if gating == "softmax":
        probs = softmax_rows(logits)
    elif gating == "sigmoid":
        probs = sigmoid(logits)
    else:
        raise ValueError(f"unknown expert gating {gating!r}")
    sel = probs if bias is None else probs + bias
    top = np.argsort(-sel, axis=1, kind="stable")[:, :k]
    w = np.take_along_axis(probs, top, axis=1)
    if norm:
        s = np.maximum(w.sum(axis=1, dtype=np.float64, keepdims=True).astype(np.float32),
                       MIN_WEIGHT_SUM)
        w = w / s
    if scale not in (0.0, 1.0):
        w = w * np.float32(scale)
    return top.astype(np.int64), np.ascontiguousarray(w, dtype=np.float32)


def plain_routing(cfg: ModelConfig) -> bool:
    """qwen3moe's routing (softmax, top k, renormalized): the grouped kernel's own."""
    return (cfg.expert_gating == "softmax" and cfg.expert_norm and not cfg.expert_bias
            and cfg.expert_scale in (0.0, 1.0))


class GatedExperts(ExpertFFN):
    """Routed experts whose routing is not the kernel's: routed here from the router's
    logits (`gate`), the experts then run grouped on that choice (ops.moe_ffn) or, not
    repacked, expert by expert (ExpertFFN.__call__ with this route)."""

    def __init__(self, cfg: ModelConfig, ops, gf, prefix: str):
        # not ExpertFFN.__init__: that would load an F32 router as an ordinary matrix for a
        # subclass that routes itself; the bank's own router gives each row's logits alone
        self.k = cfg.n_expert_used
        self.bank = ops.expert_bank(gf, prefix, grouped=type(self).expert is ExpertFFN.expert)
        self.gate, self.up, self.down = self.bank.gate, self.bank.up, self.bank.down
        self.f32_router = self.bank.router_f32 is not None
        self.router = (self.bank.router if self.f32_router
                       else ops.matrix(gf, prefix + "ffn_gate_inp.weight"))
        self.gating, self.norm, self.scale = cfg.expert_gating, cfg.expert_norm, cfg.expert_scale
        self.bias = (np.asarray(ops.vector(gf, prefix + "exp_probs_b.bias"), np.float32)
                     if cfg.expert_bias else None)

    def logits(self, ops, h) -> np.ndarray:
        if self.f32_router:
            return self.bank.logits(h)
        logits = np.asarray(ops.to_numpy(ops.matmul(h, self.router)), np.float32)
        return logits.reshape(-1, logits.shape[-1])

    def route(self, ops, h) -> tuple[np.ndarray, np.ndarray]:
        return gate(self.logits(ops, h), self.k, self.gating, self.norm, self.scale, self.bias)

    def __call__(self, ops, h):
        if self.bank.grouped is not None:
            return ops.moe_ffn(self.bank, h, *self.route(ops, h))
        return super().__call__(ops, h)         # grouped is None: routes with self.route


class SharedExpert:
    """A dense SwiGLU FFN every token runs (`ffn_{gate,up,down}_shexp`); qwen2moe multiplies
    its output by sigmoid(h . ffn_gate_inp_shexp), computed as llama.cpp does: silu(x) / x."""

    def __init__(self, cfg: ModelConfig, ops, gf, prefix: str):
        m = lambda n: ops.matrix(gf, prefix + n + ".weight")     # noqa: E731
        self.w_gate, self.w_up, self.w_down = m("ffn_gate_shexp"), m("ffn_up_shexp"), m("ffn_down_shexp")
        self.gate_inp = (np.asarray(ops.vector(gf, prefix + "ffn_gate_inp_shexp.weight"), np.float32)
                         if cfg.shexp_gate else None)

    def __call__(self, ops, h):
        y = ops.swiglu_matmul(*ops.matmuls(h, (self.w_gate, self.w_up)), self.w_down)
        if self.gate_inp is not None:
            # each row's dot product on its own (numpy's pairwise sum along the row), so a
            # token's gate does not depend on the rows beside it
            x = np.multiply(h.reshape(-1, h.shape[-1]), self.gate_inp).sum(axis=1, dtype=np.float32)
            g = (x / (np.float32(1.0) + np.exp(-x))) / x
            y = y * g.reshape(-1, 1)
        return y


@dataclass
class MoeLayer:
    attn_norm: Any
    wq: Any
    wk: Any
    wv: Any
    wo: Any
    ffn_norm: Any
    moe: ExpertFFN | None = None      # None: a dense layer (dots1's leading ones)
    shared: SharedExpert | None = None
    w_gate: Any = None
    w_up: Any = None
    w_down: Any = None
    q_norm: Any = None
    k_norm: Any = None
    bq: Any = None
    bk: Any = None
    bv: Any = None


class MoeModel(ModelBase):
    def __init__(self, cfg: ModelConfig, ops, gf):
        require_cpu(cfg, ops)
        self.cfg, self.ops = cfg, ops
        self.tok_embd, self.output_norm, self.output = load_head(cfg, ops, gf)
        self.rope_freqs = ops.vector(gf, "rope_freqs.weight") if cfg.has_rope_freqs else None
        self.layers = [self.load_layer(gf, i) for i in range(cfg.n_layers)]

    def load_layer(self, gf, i: int) -> MoeLayer:
        cfg, ops, p = self.cfg, self.ops, f"blk.{i}."
        m = lambda n: ops.matrix(gf, p + n + ".weight")                         # noqa: E731
        opt = lambda n: ops.vector(gf, p + n) if p + n in gf.tensors else None  # noqa: E731
        w = MoeLayer(
            attn_norm=ops.vector(gf, p + "attn_norm.weight"), wq=m("attn_q"), wk=m("attn_k"),
            wv=m("attn_v"), wo=m("attn_output"), ffn_norm=ops.vector(gf, p + "ffn_norm.weight"),
            q_norm=opt("attn_q_norm.weight"), k_norm=opt("attn_k_norm.weight"),
            bq=opt("attn_q.bias"), bk=opt("attn_k.bias"), bv=opt("attn_v.bias"))
        if i < cfg.n_dense_lead:
            w.w_gate, w.w_up, w.w_down = m("ffn_gate"), m("ffn_up"), m("ffn_down")
            return w
        w.moe = (ExpertFFN if plain_routing(cfg) else GatedExperts)(cfg, ops, gf, p)
        w.shared = SharedExpert(cfg, ops, gf, p) if cfg.n_ff_shexp else None
        return w

    def ffn(self, w: MoeLayer, h):
        ops = self.ops
        if w.moe is None:
            return ops.swiglu_matmul(*ops.matmuls(h, (w.w_gate, w.w_up)), w.w_down)
        y = w.moe(self.ops, h)
        if w.shared is not None:
            y = self.ops.add(y, w.shared(self.ops, h))
        return y

    def forward(self, batch: ForwardBatch, kv):
        cfg, ops = self.cfg, self.ops
        x = ops.embed(self.tok_embd, batch.token_ids)
        for i, w in enumerate(self.layers):
            h = ops.rms_norm(x, w.attn_norm, cfg.rms_eps)
            x = ops.add(x, attention(cfg, ops, w, h, batch, kv, i, cfg.rope_base, 0,
                                     self.rope_freqs))
            x = ops.add(x, self.ffn(w, ops.rms_norm(x, w.ffn_norm, cfg.rms_eps)))
        return final_head(cfg, ops, x, batch, self.output_norm, self.output)
