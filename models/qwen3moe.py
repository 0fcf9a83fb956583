"""Qwen3 MoE (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B): the qwen3 attention block (NeoX rope,
per-head QK-norm) with a routed mixture of SwiGLU experts in place of the dense FFN.

Routing as llama.cpp's build_moe_ffn for qwen3moe: router logits from `ffn_gate_inp`
[E, X], softmax over all X experts, the top `expert_used_count` by probability (ties: the
lower expert index), their probabilities renormalized to sum to 1. Each chosen expert is a
SwiGLU FFN whose matrices are slices of the 3-D `ffn_{gate,up}_exps` [E, F, X] and
`ffn_down_exps` [F, E, X] tensors. The backend holds them (ops.expert_bank): repacked, as one
grouped bank per tensor whose whole FFN step is one ops.moe_ffn call (decode reads only the
chosen experts' weights; a prefill's tokens are grouped by expert, so each expert's weights
stream once per step for all the tokens routed to it); otherwise one matrix per expert over
its slice of the file's bytes (nothing copied), run expert by expert here. Either way a
token's output is the same whether it was decoded alone or in a prefill.

Runs on the numba CPU backend; other backends are refused with a clear error.
"""
from __future__ import annotations

import numpy as np

from edgeinfer.formats.model_config import ModelConfig
from edgeinfer.models.variants import VariantModel


class ExpertFFN:
    """A layer's routed experts. The backend holds them (ops.expert_bank): grouped, the whole
    FFN of a step is one ops.moe_ffn call over the chosen experts' weights; otherwise one
    matrix per expert (slices of the file's bytes), run here expert by expert. A subclass
    whose experts compute something else (overriding `expert`) always gets the latter."""

    def __init__(self, cfg: ModelConfig, ops, gf, prefix: str):
        self.k = cfg.n_expert_used
        self.bank = ops.expert_bank(gf, prefix, grouped=type(self).expert is ExpertFFN.expert)
        # a subclass routing its own way multiplies the router with ops.matmul: an ordinary
        # matrix then (ops.moe_route reads the bank's, each row the bits it gets alone)
        self.router = (self.bank.router if type(self).route is ExpertFFN.route
                       else ops.matrix(gf, prefix + "ffn_gate_inp.weight"))
        self.gate, self.up, self.down = self.bank.gate, self.bank.up, self.bank.down

    def route(self, ops, h) -> tuple[np.ndarray, np.ndarray]:
        """(experts [T, k] int64, weights [T, k] float32) per token, all tokens in one call."""
        return ops.moe_route(self.bank, h, self.k)

    def __call__(self, ops, h):
        """Tokens grouped by expert (a decode token: its k experts), each chosen expert run
        once for all its rows; the outputs then summed per token in routing order, weights
        applied as llama.cpp does (expert output x weight, added slot by slot), so a token's
        sum is the same whether it was decoded alone or in a prefill."""
        if self.bank.grouped is not None:       # routing and experts in one call
            return ops.moe(self.bank, h, self.k)
        top, w = self.route(ops, h)
        T, k = top.shape
        ys = np.empty((T, k, h.shape[-1]), np.float32)
        order = np.argsort(top, axis=None, kind="stable")   # (token, slot) pairs by expert
        chosen = top.reshape(-1)
        for grp in np.split(order, np.flatnonzero(np.diff(chosen[order])) + 1):
            rows, slot = grp // k, grp % k
            ys[rows, slot] = self.expert(ops, ops.take_rows(h, rows), int(chosen[grp[0]]))
        out = ys[:, 0] * w[:, :1]
        for j in range(1, k):
            out += ys[:, j] * w[:, j:j + 1]
        return out

    def expert(self, ops, x, e: int):
        return ops.matmul(ops.swiglu(*ops.matmuls(x, (self.gate[e], self.up[e]))), self.down[e])


class Qwen3MoeModel(VariantModel):
    def __init__(self, cfg: ModelConfig, ops, gf):
        if ops.name != "cpu":
            raise ValueError(f"the native {cfg.arch} (mixture of experts) runs on the cpu "
                             f"backend only, not {ops.name!r}: use --backend cpu or llamacpp")
        super().__init__(cfg, ops, gf)

    def load_layer(self, gf, i: int):
        w = super().load_layer(gf, i)
        w.moe = ExpertFFN(self.cfg, self.ops, gf, f"blk.{i}.")
        return w

    def ffn(self, w, h):
        return w.moe(self.ops, h)

