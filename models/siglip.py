"""SigLIP vision tower + Gemma 3's multimodal projector (or SmolVLM's: Idefics3), from an
mmproj GGUF (llama.cpp's clip layout: edgeinfer.formats.mmproj), on a backend's ops.

LLaVA 1.5 ("mlp") is a CLIP tower: a class embedding row appended after the patches (as
llama.cpp lays it out), a pre-LayerNorm, quick-GELU feed-forwards, all layers but the last,
then rows 1..n_patches through mm.0 -> GELU -> mm.2.

Idefics3 (SmolVLM) ends differently: after the tower, a pixel shuffle folds each n_merge x
n_merge group of patches into one vector (n_merge^2 x the width), and `mm.model.fc` projects
it to the text width; each tile of the image (and its overview) is one such encode.

  pixels [3, S, S] -> 14x14 (patch_size) conv as one matmul over the flattened patches,
  + bias + learned position embeddings -> N pre-norm blocks (LayerNorm, full attention over
  all patches, LayerNorm, GELU MLP) -> post LayerNorm -> 2-D average pool of n_merge x
  n_merge patches (64x64 -> 16x16 = 256 tokens for 896 px) -> RMSNorm * soft_emb_norm ->
  x @ mm.input_projection [vision width, text width].

The blocks' matrices go through the ops (the same kernels and quant types as the text
model: quantized mmproj files stay quantized); the patch embedding, the pooling and the
projection are small numpy steps at the edges.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from edgeinfer.backends.base import ForwardBatch
from edgeinfer.formats.mmproj import VisionConfig


def blas_one_thread():
    """numpy's BLAS on one thread while the tower runs: OpenBLAS's workers spin after each
    call and starve the numba kernels between them (4.3 s -> 1.2 s for an 86M tower's image
    on 2 cores). threadpoolctl (the vision extra) does it; without it, nothing changes."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        import contextlib
        return contextlib.nullcontext()
    return threadpool_limits(1, user_api="blas")


_POOL = None


def _pool():
    """Worker threads for attention_np's head groups (numpy releases the GIL in BLAS and
    its ufuncs); as many as numba's threads."""
    global _POOL
    if _POOL is None:
        import concurrent.futures
        import numba
        _POOL = concurrent.futures.ThreadPoolExecutor(max(1, numba.get_num_threads()),
                                                      thread_name_prefix="edgeinfer-vit")
    return _POOL


def attention_np(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float,
                 rows: int = 256) -> np.ndarray:
    """Full (non-causal) attention over all T positions, [T, H, D] float32, through BLAS
    (np.matmul per head; heads split over worker threads, each BLAS call single-threaded),
    in chunks of `rows` queries so each score block stays heads x rows x T floats. About
    10x the numba encoder kernel at SigLIP's T = 1024-4096."""
    T, H, D = q.shape
    qh = np.ascontiguousarray(q.transpose(1, 0, 2))
    kt = np.ascontiguousarray(k.transpose(1, 2, 0))          # [H, D, T]
    vh = np.ascontiguousarray(v.transpose(1, 0, 2))
    out = np.empty((H, T, D), np.float32)

    def heads(h0: int, h1: int) -> None:
        for r0 in range(0, T, rows):
            s = np.matmul(qh[h0:h1, r0:r0 + rows], kt[h0:h1])    # [h, R, T]
            s *= np.float32(scale)
            s -= s.max(axis=2, keepdims=True)
            np.exp(s, out=s)
            s /= s.sum(axis=2, keepdims=True)
            np.matmul(s, vh[h0:h1], out=out[h0:h1, r0:r0 + rows])
    pool = _pool()
    n = min(pool._max_workers, H)
    cuts = [H * i // n for i in range(n + 1)]
    if n <= 1:
        heads(0, H)
    else:
        for f in [pool.submit(heads, cuts[i], cuts[i + 1]) for i in range(n)]:
            f.result()
    return np.ascontiguousarray(out.transpose(1, 0, 2))


def _dense(gf, name: str) -> np.ndarray:
    """A tensor as float32 numpy in numpy order (ggml shape reversed)."""
    from edgeinfer.formats.ggml_types import GGMLQuantizationType, dequantize
    t = gf.tensors[name]
    raw = gf.raw(name)
    if t.ggml_type == GGMLQuantizationType.F32:
        a = np.frombuffer(raw, np.float32)
    elif t.ggml_type == GGMLQuantizationType.F16:
        a = np.frombuffer(raw, np.float16).astype(np.float32)
    else:
        a = dequantize(raw, t.ggml_type)
    return np.asarray(a, np.float32).reshape(tuple(reversed([int(d) for d in t.shape])))


@dataclass
class _Block:
    wq: Any
    wk: Any
    wv: Any
    wo: Any
    bq: Any
    bk: Any
    bv: Any
    bo: Any
    ln1_w: Any
    ln1_b: Any
    ln2_w: Any
    ln2_b: Any
    w_up: Any
    b_up: Any
    w_down: Any
    b_down: Any
    amx: Any = None         # _AmxBlock: the matrices split for the AMX-BF16 kernel


@dataclass
class _AmxBlock:
    """A block's matrices for backends/cpu/_amx_bf16.py: q, k and v as one [3 e, e] matrix
    (one product, its input split once), their biases added by the kernel."""
    wqkv: Any
    bqkv: Any
    wo: Any
    w_up: Any
    w_down: Any
    f16: tuple[bool, ...]   # per product (qkv, out, up, down): activations rounded to f16
                            # first, as ggml does for an f16 matrix


def _amx_tower(ops, gf, names) -> bool:
    """Whether the tower's matrices take the AMX-BF16 split-precision kernel: numpy CPU ops,
    float32 / f16 matrices (quantized ones keep their kernels), and a CPU and OS with
    AMX-BF16 (EDGEINFER_NO_AMX=1 keeps the float32 path)."""
    if ops.name != "cpu":
        return False
    kinds = {int(gf.tensors[n].ggml_type) for n in names}
    if not kinds or not kinds <= {0, 1} or len(kinds) > 1:      # all F32 or all F16
        return False
    from edgeinfer.backends.cpu import _amx_bf16
    return _amx_bf16.available()


class SiglipVision:
    """encode(pixels float32 [3, S, S]) -> float32 [tokens_per_image, text width]."""

    def __init__(self, cfg: VisionConfig, ops, gf):
        self.cfg, self.ops = cfg, ops
        e, p = cfg.n_embd, cfg.patch_size
        t = gf.tensors["v.patch_embd.weight"]
        self.patch_f16 = int(t.ggml_type) == 1       # ggml's im2col rounds the pixels to f16
        self.patch_w = np.ascontiguousarray(_dense(gf, "v.patch_embd.weight").reshape(e, 3 * p * p).T)
        self.patch_b = (_dense(gf, "v.patch_embd.bias").reshape(e)
                        if "v.patch_embd.bias" in gf.tensors else None)
        n_pos = cfg.n_patches + int(cfg.class_embd)
        self.pos = _dense(gf, "v.position_embd.weight").reshape(n_pos, e)
        self.cls = _dense(gf, "v.class_embd").reshape(1, e) if cfg.class_embd else None
        self.pre = ((ops.vector(gf, "v.pre_ln.weight"), ops.vector(gf, "v.pre_ln.bias"))
                    if cfg.pre_ln else None)
        self.blocks = []
        n_run = cfg.layers_run or cfg.n_layers
        mats = [f"v.blk.{i}.{m}.weight" for i in range(n_run)
                for m in ("attn_q", "attn_k", "attn_v", "attn_out", cfg.ffn_up_name,
                          cfg.ffn_down_name)]
        if _amx_tower(ops, gf, mats):
            self._load_amx(gf, n_run)
            return self._load_tail(gf)
        for i in range(n_run):
            b = f"v.blk.{i}."
            self.blocks.append(_Block(
                wq=ops.matrix(gf, b + "attn_q.weight"), wk=ops.matrix(gf, b + "attn_k.weight"),
                wv=ops.matrix(gf, b + "attn_v.weight"), wo=ops.matrix(gf, b + "attn_out.weight"),
                bq=ops.vector(gf, b + "attn_q.bias"), bk=ops.vector(gf, b + "attn_k.bias"),
                bv=ops.vector(gf, b + "attn_v.bias"), bo=ops.vector(gf, b + "attn_out.bias"),
                ln1_w=ops.vector(gf, b + "ln1.weight"), ln1_b=ops.vector(gf, b + "ln1.bias"),
                ln2_w=ops.vector(gf, b + "ln2.weight"), ln2_b=ops.vector(gf, b + "ln2.bias"),
                w_up=ops.matrix(gf, b + cfg.ffn_up_name + ".weight"),
                b_up=ops.vector(gf, b + cfg.ffn_up_name + ".bias"),
                w_down=ops.matrix(gf, b + cfg.ffn_down_name + ".weight"),
                b_down=ops.vector(gf, b + cfg.ffn_down_name + ".bias")))
        self._load_tail(gf)

    def _load_amx(self, gf, n_run: int) -> None:
        """The blocks' matrices split for the AMX-BF16 kernel (see _AmxBlock)."""
        from edgeinfer.backends.cpu._amx_bf16 import AmxMatrix
        cfg, ops = self.cfg, self.ops
        ggml_numerics = ops.numerics == "ggml"      # CpuOps: _amx_tower checked
        up, down = cfg.ffn_up_name, cfg.ffn_down_name
        names = ("attn_q", "attn_k", "attn_v", "attn_out", up, down)
        for i in range(n_run):
            b = f"v.blk.{i}."

            def f16(name):
                return ggml_numerics and int(gf.tensors[b + name + ".weight"].ggml_type) == 1
            amx = _AmxBlock(
                wqkv=AmxMatrix(np.concatenate([_dense(gf, b + n + ".weight") for n in names[:3]])),
                bqkv=np.concatenate([ops.vector(gf, b + n + ".bias") for n in names[:3]]),
                wo=AmxMatrix(_dense(gf, b + "attn_out.weight")),
                w_up=AmxMatrix(_dense(gf, b + up + ".weight")),
                w_down=AmxMatrix(_dense(gf, b + down + ".weight")),
                f16=(f16("attn_q"), f16("attn_out"), f16(up), f16(down)))
            self.blocks.append(_Block(
                wq=None, wk=None, wv=None, wo=None, bq=None, bk=None, bv=None,
                bo=ops.vector(gf, b + "attn_out.bias"),
                ln1_w=ops.vector(gf, b + "ln1.weight"), ln1_b=ops.vector(gf, b + "ln1.bias"),
                ln2_w=ops.vector(gf, b + "ln2.weight"), ln2_b=ops.vector(gf, b + "ln2.bias"),
                w_up=None, b_up=ops.vector(gf, b + up + ".bias"),
                w_down=None, b_down=ops.vector(gf, b + down + ".bias"), amx=amx))

    def _load_tail(self, gf) -> None:
        cfg, ops = self.cfg, self.ops
        e = cfg.n_embd
        self.post_w = ops.vector(gf, "v.post_ln.weight") if cfg.post_ln else None
        self.post_b = ops.vector(gf, "v.post_ln.bias") if cfg.post_ln else None
        if cfg.projector == "mlp":
            self.mm = [(ops.matrix(gf, f"mm.{i}.weight"), ops.vector(gf, f"mm.{i}.bias"))
                       for i in (0, 2)]
        elif cfg.projector == "idefics3":
            self.fc = ops.matrix(gf, "mm.model.fc.weight")          # [text, e * n_merge^2]
        else:
            self.soft_norm = _dense(gf, "mm.soft_emb_norm.weight").reshape(e)
            self.proj = np.ascontiguousarray(_dense(gf, "mm.input_projection.weight"))

    def _patches(self, pixels: np.ndarray) -> np.ndarray:
        """[n_patches, 3 * p * p] in row-major patch order, each patch (channel, y, x)."""
        cfg = self.cfg
        n, p = cfg.patches_per_side, cfg.patch_size
        x = pixels.reshape(3, n, p, n, p).transpose(1, 3, 0, 2, 4).reshape(n * n, 3 * p * p)
        if self.patch_f16:
            x = x.astype(np.float16).astype(np.float32)
        return np.ascontiguousarray(x)

    def _to_ops(self, x: np.ndarray):
        ops = self.ops
        if ops.name.startswith("torch"):
            import torch
            return torch.from_numpy(x).to(ops.device, ops.dtype)
        return x

    def encode(self, pixels: np.ndarray) -> np.ndarray:
        with blas_one_thread():
            return self._encode(pixels)

    def _encode(self, pixels: np.ndarray) -> np.ndarray:
        cfg, ops = self.cfg, self.ops
        S = cfg.image_size
        if pixels.shape != (3, S, S):
            raise ValueError(f"pixels of shape {pixels.shape}, expected (3, {S}, {S})")
        ops.begin_step()
        x = self._patches(np.asarray(pixels, np.float32)) @ self.patch_w
        if self.patch_b is not None:
            x += self.patch_b
        if self.cls is not None:            # after the patches, as llama.cpp concatenates it
            x = np.concatenate([x, self.cls])
        x += self.pos
        T, H, D = x.shape[0], cfg.n_head, cfg.head_dim
        batch = ForwardBatch(np.zeros(T, np.int32), np.arange(T, dtype=np.int32),
                             np.zeros(T, np.int64), np.zeros(T, np.int32),
                             np.zeros((1, 1), np.int32), np.zeros(0, np.int64))
        x = self._to_ops(np.ascontiguousarray(x, np.float32))
        if self.pre is not None:
            x = ops.layer_norm(x, self.pre[0], self.pre[1], cfg.eps)
        scale = 1.0 / math.sqrt(D)
        for w in self.blocks:
            if w.amx is not None:
                x = self._amx_block(x, w, T, H, D, scale)
                continue
            h = ops.layer_norm(x, w.ln1_w, w.ln1_b, cfg.eps)
            q, k, v = ops.matmuls(h, (w.wq, w.wk, w.wv))
            q, k, v = ops.add_bias(q, w.bq), ops.add_bias(k, w.bk), ops.add_bias(v, w.bv)
            if isinstance(q, np.ndarray):       # numpy-array backends: BLAS per head
                a = attention_np(q.reshape(T, H, D), k.reshape(T, H, D), v.reshape(T, H, D),
                                 scale)
            else:
                a = ops.encoder_attention(ops.contiguous(q.reshape(T, H, D)),
                                          ops.contiguous(k.reshape(T, H, D)),
                                          ops.contiguous(v.reshape(T, H, D)), batch, scale)
            a = ops.add_bias(ops.matmul(a.reshape(T, H * D), w.wo), w.bo)
            x = ops.add(x, a)
            h = ops.layer_norm(x, w.ln2_w, w.ln2_b, cfg.eps)
            f = self._act(ops.add_bias(ops.matmul(h, w.w_up), w.b_up))
            f = ops.add_bias(ops.matmul(f, w.w_down), w.b_down)
            x = ops.add(x, f)
        if self.post_w is not None:
            x = ops.layer_norm(x, self.post_w, self.post_b, cfg.eps)
        return self.project(ops.to_numpy(x))

    def _amx_block(self, x, w: _Block, T: int, H: int, D: int, scale: float):
        """One block with its matrices on the AMX-BF16 kernel (biases added in the kernel)."""
        from edgeinfer.backends.cpu import _amx_bf16
        ops, cfg, m = self.ops, self.cfg, w.amx
        h = ops.layer_norm(x, w.ln1_w, w.ln1_b, cfg.eps)
        qkv = m.wqkv.matmul(h, m.bqkv, f16=m.f16[0])
        a = _amx_bf16.attention(qkv, T, H, D, scale)          # [T, H D], on the tiles too
        x = ops.add(x, m.wo.matmul(a, w.bo, f16=m.f16[1]))
        h = ops.layer_norm(x, w.ln2_w, w.ln2_b, cfg.eps)
        f = m.w_up.matmul(h, w.b_up, f16=m.f16[2])
        if cfg.ffn_op == "gelu" and ops.numerics == "ggml":
            # ggml's table GELU (ops.gelu's values) applied as the down product splits f
            from edgeinfer.backends.cpu.kernels import gelu_f16_table
            return ops.add(x, m.w_down.matmul(f, w.b_down, f16=m.f16[3],
                                              gelu=gelu_f16_table()))
        return ops.add(x, m.w_down.matmul(self._act(f), w.b_down, f16=m.f16[3]))

    def _act(self, x):
        """The feed-forward's activation: GELU (tanh) through the ops, or CLIP's quick GELU
        x * sigmoid(1.702 x)."""
        if self.cfg.ffn_op == "gelu":
            return self.ops.gelu(x)
        if isinstance(x, np.ndarray):
            return x / (np.float32(1.0) + np.exp(np.float32(-1.702) * x))
        import torch
        return x * torch.sigmoid(1.702 * x)

    def project(self, x: np.ndarray) -> np.ndarray:
        """The projector over the tower's output [n_patches (+ the class row), e]."""
        cfg = self.cfg
        n, k, e = cfg.patches_per_side, cfg.n_merge, cfg.n_embd
        m = n // k
        if cfg.projector == "mlp":
            # llama.cpp takes rows 1..n_patches when there is a class row (its "patches"
            # input skips row 0), else rows 0..n_patches-1
            off = int(cfg.class_embd)
            y = self._to_ops(np.ascontiguousarray(x[off:off + cfg.n_patches], np.float32))
            (w0, b0), (w2, b2) = self.mm
            y = self.ops.gelu(self.ops.add_bias(self.ops.matmul(y, w0), b0))
            y = self.ops.add_bias(self.ops.matmul(y, w2), b2)
            return np.ascontiguousarray(self.ops.to_numpy(y), np.float32)
        if cfg.projector == "idefics3":
            # token (Y, X) = patches (Y*k + i, X*k + j) for i, j < k, in that order (ggml's
            # build_patch_merge_permute)
            shuffled = x.reshape(m, k, m, k, e).transpose(0, 2, 1, 3, 4).reshape(m * m, k * k * e)
            y = self.ops.matmul(self._to_ops(np.ascontiguousarray(shuffled, np.float32)), self.fc)
            return np.ascontiguousarray(self.ops.to_numpy(y), np.float32)
        pooled = x.reshape(m, k, m, k, e).mean(axis=(1, 3), dtype=np.float32).reshape(m * m, e)
        rms = np.sqrt(np.mean(pooled * pooled, axis=1, keepdims=True) + np.float32(cfg.eps))
        normed = pooled / rms * self.soft_norm
        return np.ascontiguousarray(normed @ self.proj, np.float32)
