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
from edgeinfer.models.llama import final_head, fusable, fused_parts, fused_step
from edgeinfer.models.variants import VariantModel


def softmax_rows(x: np.ndarray) -> np.ndarray:
    """ggml_soft_max of each row: exp(x - max) in float32, summed in float64, times the
    float32 of 1 / sum."""
    e = np.exp(x - x.max(axis=1, keepdims=True))
    inv = (1.0 / e.sum(axis=1, dtype=np.float64, keepdims=True)).astype(np.float32)
    return e * inv


def require_cpu(cfg: ModelConfig, ops) -> None:
    """The native mixtures of experts run on the numba CPU backend only."""
    if ops.name != "cpu":
        raise ValueError(f"the native {cfg.arch} (mixture of experts) runs on the cpu "
                         f"backend only, not {ops.name!r}: use --backend cpu or llamacpp")


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
        return ops.swiglu_matmul(*ops.matmuls(x, (self.gate[e], self.up[e])), self.down[e])


class Qwen3MoeModel(VariantModel):
    def __init__(self, cfg: ModelConfig, ops, gf):
        require_cpu(cfg, ops)
        super().__init__(cfg, ops, gf)
        self._load_fused_kernels()

    def load_layer(self, gf, i: int):
        w = super().load_layer(gf, i)
        w.moe = ExpertFFN(self.cfg, self.ops, gf, f"blk.{i}.")
        return w

    def ffn(self, w, h):
        return w.moe(self.ops, h)

    # -- a step of a few tokens: the attention block's small ops fused ------------------------
    def _fused_model(self) -> bool:
        """Whether this model can take the fused layers (ops.fused_layer, backends/cpu/
        fused.py and _layer.py): every layer the plain qwen3moe block (separate q/k/v,
        QK-norm, full rope, no temperature) with repacked matrices. Decided once."""
        ok = self.__dict__.get("_fused_ok")
        if ok is None:
            cfg, ops = self.cfg, self.ops
            width = max(cfg.n_embd, cfg.q_dim)
            plain = (not cfg.n_rot and self.mscale == 1.0     # (ops: CpuOps, see __init__)
                     and not cfg.attn_temp_scale
                     and type(self).attention is VariantModel.attention)  # no subclass's own
            ok = self._fused_ok = plain and all(
                w.wqkv is None and w.q_norm is not None and w.k_norm is not None
                and cfg.uses_rope(i) and ops.fused_layer_rows(1, width, (w.wq, w.wk, w.wv, w.wo))
                for i, w in enumerate(self.layers))
        return ok

    def _fusable(self, batch) -> bool:
        return fusable(self, batch)

    def _fused_parts(self) -> tuple:
        """(the layers' ops.fused_layer, the ops.fused_head or None), made once."""
        return fused_parts(self, lambda w: w.moe.bank if type(w.moe) is ExpertFFN else None)

    def _load_fused_kernels(self) -> None:
        """Load the fused kernels that decode steps take and a prefill does not (from numba's
        disk cache, which install's warm-up fills) with the model, not inside the first
        decode step (~25 ms there): one call of each on zeros, on this thread alone (a
        parallel region here would start an OpenMP team for the loading thread)."""
        if not self._fused_model():
            return
        cfg = self.cfg
        layers, head = self._fused_parts()
        x = np.zeros((1, cfg.n_embd), np.float32)
        cos = sin = np.zeros((1, cfg.head_dim // 2), np.float32)
        layers[0].attn_in(x, x.copy(), cos, sin, 1)
        layers[0].attn_out(np.zeros((1, cfg.q_dim), np.float32), x, 1)
        if head is not None:
            head(x, x.copy(), 1)
        self.ops.embed(self.tok_embd, np.zeros(1, np.int32))

    def forward(self, batch, kv):
        """VariantModel.forward's ops, the same bits; with _fusable, each layer's residual add,
        norm, q/k/v, QK-norm and rope are one kernel call (norm_qkv), and its output
        projection, residual add and FFN norm another (out_add_norm): with attention and the
        experts four calls a layer where there were eleven, their arguments bound once per
        model (ops.fused_layer) and the per-step choices made once per step (ops.layer_step)."""
        if not self._fusable(batch):
            return super().forward(batch, kv)
        cfg, ops = self.cfg, self.ops
        fused, head, step = fused_step(self, batch)
        T = batch.num_tokens
        threads, cos, sin = step.threads, step.cos, step.sin
        own_ffn = "ffn" not in self.__dict__        # not replaced on the instance (tests)
        x = ops.embed(self.tok_embd, batch.token_ids)
        f = None                # the previous layer's FFN output, added by the next attn_in
        for i, (w, fl) in enumerate(zip(self.layers, fused)):
            q, k, v = fl.attn_in(x, f, cos, sin, threads)
            a = step.attend(q, k, v, kv, i)
            h = fl.attn_out(a.reshape(T, cfg.q_dim), x, threads)
            f = fl.moe(h, w.moe.k, threads) if own_ffn and fl.bank is not None else self.ffn(w, h)
        if head is not None and batch.hidden_indices is None and len(batch.logits_indices) == T:
            return head(x, f, threads)      # final_head's bits: every row is a logits row
        if f is not None:
            x = ops.add(x, f)
        return final_head(cfg, ops, x, batch, self.output_norm, self.output)
