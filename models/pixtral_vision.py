"""Pixtral's vision tower (Mistral Small 3.1, Pixtral 12B) from an mmproj GGUF in llama.cpp's
clip layout, on a backend's ops.

Any image size (sides multiples of patch x merge): patch conv as one matmul, an optional
RMSNorm, blocks of RMSNorm -> attention with 2-D RoPE (the first half of each head rotated
by the patch's row, the second half by its column, at interleaved frequencies, adjacent
pairs as ggml's normal rope) -> RMSNorm -> SwiGLU; then Mistral Small 3.1's patch merger
(RMSNorm, each merge x merge group unfolded channel-major, one matmul), mm.1 -> GELU -> mm.2,
and the [IMG_BREAK] embedding after every row of tokens but the last.
"""
from __future__ import annotations

import math

import numpy as np

from edgeinfer.formats.mmproj import VisionConfig
from edgeinfer.models.siglip import _dense, attention_np, blas_one_thread


def _rms(x: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps))
    return y * w if w is not None else y


def rope_2d(x: np.ndarray, pos_h: np.ndarray, pos_w: np.ndarray, base: float) -> np.ndarray:
    """x [T, H, D]: dims [0, D/2) rotated by pos_h, [D/2, D) by pos_w (adjacent pairs)."""
    T, H, D = x.shape
    half = D // 2
    j = np.arange(half // 2, dtype=np.float64)
    inv = base ** (-4.0 * j / D)                                 # first half
    inv_w = inv * base ** (-2.0 / D)                             # second half (odd freqs)
    out = x.copy()
    for off, pos, f in ((0, pos_h, inv), (half, pos_w, inv_w)):
        theta = pos[:, None].astype(np.float64) * f[None, :]     # [T, half/2]
        c = np.cos(theta).astype(np.float32)[:, None, :]
        s = np.sin(theta).astype(np.float32)[:, None, :]
        x0 = x[:, :, off:off + half:2]
        x1 = x[:, :, off + 1:off + half:2]
        out[:, :, off:off + half:2] = x0 * c - x1 * s
        out[:, :, off + 1:off + half:2] = x0 * s + x1 * c
    return out


class PixtralVision:
    """encode(pixels float32 [3, H, W]) -> float32 [tokens incl. [IMG_BREAK] rows, text]."""

    def __init__(self, cfg: VisionConfig, ops, gf):
        self.cfg, self.ops = cfg, ops
        e, p = cfg.n_embd, cfg.patch_size
        t = gf.tensors["v.patch_embd.weight"]
        self.patch_f16 = int(t.ggml_type) == 1
        self.patch_w = np.ascontiguousarray(
            _dense(gf, "v.patch_embd.weight").reshape(e, 3 * p * p).T)
        self.patch_b = (_dense(gf, "v.patch_embd.bias").reshape(e)
                        if "v.patch_embd.bias" in gf.tensors else None)

        def vec(name):
            return _dense(gf, name).reshape(-1) if name in gf.tensors else None
        self.pre = vec("v.pre_ln.weight")
        self.post = vec("v.post_ln.weight")
        self.blocks = []
        for i in range(cfg.n_layers):
            b = f"v.blk.{i}."
            self.blocks.append({
                "ln1": vec(b + "ln1.weight"), "ln2": vec(b + "ln2.weight"),
                **{n: ops.matrix(gf, b + n + ".weight") for n in
                   ("attn_q", "attn_k", "attn_v", "attn_out", "ffn_gate", "ffn_up", "ffn_down")},
                **{n + "_b": vec(b + n + ".bias") for n in
                   ("attn_q", "attn_k", "attn_v", "attn_out", "ffn_gate", "ffn_up", "ffn_down")}})
        m = cfg.n_merge
        self.merge_norm = vec("mm.input_norm.weight") if m > 1 else None
        self.merger = ops.matrix(gf, "mm.patch_merger.weight") if m > 1 else None
        self.mm1, self.mm1_b = ops.matrix(gf, "mm.1.weight"), vec("mm.1.bias")
        self.mm2, self.mm2_b = ops.matrix(gf, "mm.2.weight"), vec("mm.2.bias")
        self.img_break = _dense(gf, "v.token_embd.img_break").reshape(-1)

    def _mm(self, x: np.ndarray, w, b) -> np.ndarray:
        y = self.ops.to_numpy(self.ops.matmul(self._to_ops(x), w))
        return y + b if b is not None else y

    def _to_ops(self, x: np.ndarray):
        x = np.ascontiguousarray(x, np.float32)
        if self.ops.name.startswith("torch"):
            import torch
            return torch.from_numpy(x).to(self.ops.device, self.ops.dtype)
        return x

    def encode(self, pixels: np.ndarray) -> np.ndarray:
        with blas_one_thread():
            return self._encode(np.asarray(pixels, np.float32))

    def _encode(self, pixels: np.ndarray) -> np.ndarray:
        cfg = self.cfg
        p, m, e = cfg.patch_size, cfg.n_merge, cfg.n_embd
        _, Hp, Wp = pixels.shape
        ny, nx = Hp // p, Wp // p
        if Hp % (p * m) or Wp % (p * m):
            raise ValueError(f"pixels {Hp}x{Wp} are not multiples of {p * m}")
        self.ops.begin_step()
        patches = pixels.reshape(3, ny, p, nx, p).transpose(1, 3, 0, 2, 4).reshape(ny * nx, -1)
        if self.patch_f16:
            patches = patches.astype(np.float16).astype(np.float32)
        x = patches @ self.patch_w
        if self.patch_b is not None:
            x += self.patch_b
        if self.pre is not None:
            x = _rms(x, self.pre, cfg.eps)
        T, H, D = x.shape[0], cfg.n_head, cfg.head_dim
        idx = np.arange(T)
        pos_h, pos_w = idx // nx, idx % nx
        scale = 1.0 / math.sqrt(D)
        for w in self.blocks:
            h = _rms(x, w["ln1"], cfg.eps)
            q = self._mm(h, w["attn_q"], w["attn_q_b"]).reshape(T, H, D)
            k = self._mm(h, w["attn_k"], w["attn_k_b"]).reshape(T, H, D)
            v = self._mm(h, w["attn_v"], w["attn_v_b"]).reshape(T, H, D)
            q, k = rope_2d(q, pos_h, pos_w, cfg.rope_theta), rope_2d(k, pos_h, pos_w, cfg.rope_theta)
            a = attention_np(q, k, v, scale).reshape(T, H * D)
            x = x + self._mm(a, w["attn_out"], w["attn_out_b"])
            h = _rms(x, w["ln2"], cfg.eps)
            g = self._mm(h, w["ffn_gate"], w["ffn_gate_b"])
            u = self._mm(h, w["ffn_up"], w["ffn_up_b"])
            x = x + self._mm(g / (np.float32(1) + np.exp(-g)) * u, w["ffn_down"], w["ffn_down_b"])
        if self.post is not None:
            x = _rms(x, self.post, cfg.eps)
        py, px = ny // m, nx // m
        if m > 1:
            y = _rms(x, self.merge_norm, cfg.eps)
            y = y.reshape(py, m, px, m, e).transpose(0, 2, 4, 1, 3).reshape(py * px, e * m * m)
            x = self._mm(y, self.merger, None)
        y = self._mm(x, self.mm1, self.mm1_b)
        y = self.ops.to_numpy(self.ops.gelu(self._to_ops(y)))
        y = self._mm(y, self.mm2, self.mm2_b)
        rows = y.reshape(py, px, -1)
        out = []
        for r in range(py):
            out.append(rows[r])
            if r != py - 1:
                out.append(self.img_break[None, :])
        return np.ascontiguousarray(np.concatenate(out), np.float32)
