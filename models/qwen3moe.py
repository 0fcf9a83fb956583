"""Qwen3 MoE (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B): the qwen3 attention block (NeoX rope,
per-head QK-norm) with a routed mixture of SwiGLU experts in place of the dense FFN.

Routing as llama.cpp's build_moe_ffn for qwen3moe: router logits from `ffn_gate_inp`
[E, X], softmax over all X experts, the top `expert_used_count` by probability (ties: the
lower expert index), their probabilities renormalized to sum to 1. Each chosen expert is a
SwiGLU FFN whose matrices are slices of the 3-D `ffn_{gate,up}_exps` [E, F, X] and
`ffn_down_exps` [F, E, X] tensors (one expert = one contiguous run of rows, so a slice of the
file's bytes: nothing is copied unless the backend repacks, as for any matrix). Decode reads
only the chosen experts; a prefill groups its tokens by expert, so each expert's weights
stream once per step for all the tokens routed to it.

Runs on the numba CPU backend (routing and the weighted sum are numpy); other backends are
refused with a clear error.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from edgeinfer.formats.model_config import ModelConfig
from edgeinfer.models.variants import VariantModel


class _ExpertSlices:
    """A GGUF file seen through one 3-D expert tensor: `name[e]` is expert e's 2-D matrix,
    a view of its bytes, so any backend's ops.matrix() takes it like a real tensor."""

    def __init__(self, gf, name: str):
        t = gf.tensors[name]
        K, N, X = (int(d) for d in t.shape)
        self.gf, self.base, self.per = gf, name, t.nbytes // X
        self.path, self.metadata = gf.path, gf.metadata
        self.tensors = {f"{name}[{e}]": dataclasses.replace(
            t, name=f"{name}[{e}]", shape=(K, N), offset=t.offset + e * self.per,
            nbytes=self.per) for e in range(X)}
        self.names = list(self.tensors)

    def raw(self, name: str) -> np.ndarray:
        e = self.names.index(name)
        return self.gf.raw(self.base)[e * self.per:(e + 1) * self.per]

    def release_pages(self, name: str | None = None) -> None:
        if name is None or name == self.names[-1]:      # after the last expert's copy
            self.gf.release_pages(self.base)


class ExpertFFN:
    def __init__(self, cfg: ModelConfig, ops, gf, prefix: str):
        self.k = cfg.n_expert_used
        self.router = ops.matrix(gf, prefix + "ffn_gate_inp.weight")

        def experts(n: str) -> list:
            view = _ExpertSlices(gf, prefix + n + ".weight")
            return [ops.matrix(view, name) for name in view.names]
        self.gate, self.up, self.down = experts("ffn_gate_exps"), experts("ffn_up_exps"), \
            experts("ffn_down_exps")

    def route(self, ops, h) -> tuple[np.ndarray, np.ndarray]:
        """(experts [T, k] int64, weights [T, k] float32) per token."""
        logits = np.asarray(ops.to_numpy(ops.matmul(h, self.router)), np.float32)
        logits = logits.reshape(-1, logits.shape[-1])
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        top = np.argsort(-p, axis=1, kind="stable")[:, :self.k]
        w = np.take_along_axis(p, top, axis=1)
        w /= np.maximum(w.sum(axis=1, keepdims=True), np.float32(6.103515625e-5))
        return top, w.astype(np.float32)

    def __call__(self, ops, h):
        """Tokens grouped by expert (a decode token: its k experts), each chosen expert run
        once for all its rows; the outputs then summed per token in routing order, weights
        applied as llama.cpp does (expert output x weight, added slot by slot), so a token's
        sum is the same whether it was decoded alone or in a prefill."""
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

