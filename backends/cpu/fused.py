"""A decoder layer's decode-step calls with their arguments bound once (models/qwen3moe.py).

A decode step of a small mixture-of-experts model spends about as long in Python between
kernels as in some of the kernels: every op looks up its matrices' tables, allocates, asks
numba for its thread count, and re-derives per-step choices (parallel or not, heads per work
item) in every layer; and each step's expert kernel streams megabytes through the caches, so
every one of those Python steps runs cold. `FusedLayer` holds a layer's arguments to the
kernels (_layer's fused attention-block kernels, the grouped expert kernel), and
`LayerStep` what all layers of a step share (rope tables, paged attention's choices); the calls
are those the ops make (CpuOps.norm_qkv, out_add_norm, attention, moe), with the same
arguments, so the bits are theirs (tests/test_layer_fused.py).
"""
from __future__ import annotations

import numpy as np

from . import _layer
from . import attention as A
from . import kernels as K
from .packed import SERIAL_MACS, SERIAL_QUANT
from .repack import PackedMatrix


# rope cos/sin rows of single decode tokens: (head dim, base, scale, position) -> (cos, sin)
# [1, D/2] as kernels.rope_tables makes them (read-only to every user: the kernels only read)
_ROPE_ROWS: dict = {}
_ROPE_ROWS_MAX = 1 << 14


class LayerStep:
    """What every layer of one step shares, made once: the rope tables, the thread count,
    and the attention kernels' plan (attention.kernel_plan, parallel from a lower bound than
    CpuOps.attention's: PAR_MIN). `attend` writes a layer's K/V and attends as
    ops.attention does; a step with a sliding window, image rows or a rotated (q8_0) cache
    goes through ops.attention itself."""

    __slots__ = ("ops", "batch", "cos", "sin", "threads", "fast", "tables", "slots",
                 "token_seq", "positions", "scale", "ggml", "plan")

    # work (T x H x keys x D / 16) from which attention runs on the step's threads: a
    # quarter of ops.attention's bound (ops._par). One decode token over ~600 keys of
    # benchmarks/moe.py's model (8 heads of 64): 46 -> 35 us a layer on two threads. The
    # threads change no bits (attention.py).
    PAR_MIN = 1 << 13

    def __init__(self, ops, batch, H: int, KVH: int, D: int, scale: float, rope_base: float,
                 rope_scale: float, freq_factors, threads: int):
        self.ops, self.batch, self.threads = ops, batch, threads
        if batch.num_tokens == 1 and freq_factors is None:
            # a decode token's row, kept by position: the numpy of rope_tables costs ~15-30
            # us a step, and a row depends on its position alone
            key = (D, rope_base, rope_scale, int(batch.positions[0]))
            rows = _ROPE_ROWS.get(key)
            if rows is None:
                if len(_ROPE_ROWS) >= _ROPE_ROWS_MAX:
                    _ROPE_ROWS.clear()
                rows = _ROPE_ROWS[key] = ops._rope_tables(batch, D, rope_base, rope_scale, None)
            self.cos, self.sin = rows
        else:
            self.cos, self.sin = ops._rope_tables(batch, D, rope_base, rope_scale, freq_factors)
        self.scale = scale
        self.fast = (ops.kv_cache_type != "q8_0" and batch.attn_until is None
                     and batch.window_tables is None and D % 16 == 0)
        if not self.fast:
            return
        T = batch.num_tokens
        self.tables, self.slots = batch.block_tables, batch.slot_mapping
        self.token_seq, self.positions = batch.token_seq, batch.positions
        self.scale = np.float32(scale)
        self.ggml = ops.numerics == "ggml"
        longest = batch.cache.get("longest")
        if longest is None:
            longest = batch.cache["longest"] = int(batch.positions.max()) + 1 if T else 0
        par = threads > 1 and T * H * longest * D // 16 >= self.PAR_MIN
        self.plan = A.kernel_plan(T, H, KVH, longest, par, threads)

    def attend(self, q, k, v, cache, layer: int):
        """ops.attention(q, k, v, cache, layer, batch, scale, window=0)."""
        if not self.fast:
            return self.ops.attention(q, k, v, cache, layer, self.batch, self.scale, 0)
        kc, vc = cache.k[layer], cache.v[layer]
        K.kv_write(kc, vc, k, v, self.slots)
        return A.run_plan(self.plan, q, kc, vc, self.tables, self.token_seq, self.positions, 0,
                          self.scale, self.ggml, np.empty_like(q))


_NO_BIAS = np.zeros(1, np.float32)


def _threads(T: int, cols: int, threads: int) -> int:
    """Threads for a product of T rows by matrices of `cols` weights in all: packed.py's
    rule (below SERIAL_MACS multiply-adds, the calling thread)."""
    return 1 if T * cols < SERIAL_MACS else threads


class FusedQKV:
    """ops.norm_qkv with its arguments bound: x += f (when f is given), rms_norm, the q/k/v
    matrices, QK-norm and rope in one _layer.norm_qkv call; without QK-norm (q_norm None:
    llama, qwen2) _layer.norm_qkv_rope, with the q/k/v biases when given."""

    __slots__ = ("wn", "eps", "P", "Wt", "N", "cols", "H", "KVH", "D", "qn", "kn", "neox",
                 "biases", "counter")

    def __init__(self, ops, attn_norm, eps: float, qkv, heads: tuple[int, int], q_norm,
                 k_norm, neox: bool, head_dim: int | None = None, biases=None):
        self.wn, self.eps = attn_norm, eps
        self.P, self.Wt, _ = ops._fused_mats(qkv)
        self.N = tuple(w.N for w in qkv)
        self.cols = qkv[0].K * sum(self.N)
        self.H, self.KVH = heads
        self.D = head_dim or q_norm.shape[0]
        self.qn, self.kn, self.neox = q_norm, k_norm, neox
        self.biases = biases                    # (bq, bk, bv) or None
        self.counter = np.zeros(1, np.int64)    # the tile region's (the kernel resets it)

    def __call__(self, x, f, cos, sin, threads: int) -> tuple:
        """(q [T, H * D], k, v [T, KVH * D])."""
        T = x.shape[0]
        q, k, v = (np.empty((T, n), np.float32) for n in self.N)
        nw = _threads(T, self.cols, threads)
        y = x if f is None else f
        if self.qn is None:
            bq, bk, bv = self.biases or (_NO_BIAS,) * 3
            _layer.norm_qkv_rope(x, y, f is not None, self.wn, self.eps, self.P, self.Wt,
                                 q, k, v, self.H, self.KVH, bq, bk, bv, self.biases is not None,
                                 cos, sin, self.neox, nw, self.counter)
        else:
            _layer.norm_qkv(x, y, f is not None, self.wn, self.eps, self.P, self.Wt, q, k, v,
                            self.H, self.KVH, self.qn, self.kn, cos, sin, self.neox, nw,
                            self.counter)
        return q, k, v


class FusedOut:
    """ops.out_add_norm with its arguments bound: x += a times wo, then rms_norm(x)."""

    __slots__ = ("P", "Wt", "cols", "wn", "eps", "counter")

    def __init__(self, ops, wo, ffn_norm, eps: float):
        self.P, self.Wt, _ = ops._fused_mats((wo,))
        self.cols = wo.K * wo.N
        self.wn, self.eps = ffn_norm, eps
        self.counter = np.zeros(1, np.int64)

    def __call__(self, a, x, threads: int):
        nw = _threads(x.shape[0], self.cols, threads)
        return _layer.out_add_norm(a, self.P, self.Wt, x, self.wn, self.eps, np.empty_like(x),
                                   nw, self.counter)


class FusedFFN:
    """A SwiGLU FFN's matrices bound for _layer.out_add_norm_ffn: gate and up (P, Wt) and
    down (Pd, Wtd), all repacked."""

    __slots__ = ("P", "Wt", "Pd", "Wtd", "gu_cols", "d_cols", "width")

    def __init__(self, ops, gate, up, down):
        self.P, self.Wt, _ = ops._fused_mats((gate, up))
        self.Pd, self.Wtd, _ = ops._fused_mats((down,))
        self.gu_cols, self.d_cols = gate.K * (gate.N + up.N), down.K * down.N
        self.width = down.K

    @staticmethod
    def fits(gate, up, down) -> bool:
        return (all(isinstance(w, PackedMatrix) for w in (gate, up, down))
                and gate.K == up.K and gate.N == up.N == down.K)

    def takes(self, T: int) -> bool:
        """A step whose SwiGLU activations the separate ops would quantize on the calling
        thread too (the fused kernel runs everything but the tiles there)."""
        return T * self.width < SERIAL_QUANT


class FusedLayer:
    """One layer's bound calls: `qkv` (ops.norm_qkv), `out` (ops.out_add_norm), `ffn`
    (with it, ops.out_add_norm then a SwiGLU FFN in one call: attn_out_ffn) and `moe`
    (ops.moe of a grouped bank with an F32 router: routing and experts in one call)."""

    __slots__ = ("qkv", "out", "ffn", "bank")

    def __init__(self, ops, attn_norm, eps: float, qkv, heads: tuple[int, int], q_norm,
                 k_norm, neox: bool, wo, ffn_norm, bank=None, head_dim: int | None = None,
                 biases=None, ffn=None):
        self.qkv = FusedQKV(ops, attn_norm, eps, qkv, heads, q_norm, k_norm, neox, head_dim,
                            biases)
        self.out = FusedOut(ops, wo, ffn_norm, eps)
        # (gate, up, down) of a SwiGLU FFN, when every one is repacked; else None
        self.ffn = FusedFFN(ops, *ffn) if ffn is not None and FusedFFN.fits(*ffn) else None
        # a grouped bank with an F32 router (else None: the model runs its FFN itself)
        self.bank = bank if bank is not None and bank.grouped is not None \
            and bank.router_f32 is not None else None

    def attn_in(self, x, f, cos, sin, threads: int) -> tuple:
        """(q [T, H, D], k, v [T, KVH, D]) as ops.norm_qkv; x += f first when f is given."""
        q, k, v = self.qkv(x, f, cos, sin, threads)
        T, c = x.shape[0], self.qkv
        return (q.reshape(T, c.H, c.D), k.reshape(T, c.KVH, c.D), v.reshape(T, c.KVH, c.D))

    def attn_out(self, a, x, threads: int):
        """x += a times wo; rms_norm(x, ffn_norm), as ops.out_add_norm."""
        return self.out(a, x, threads)

    def attn_out_ffn(self, a, x, threads: int):
        """x += a times wo, then the FFN of rms_norm(x, ffn_norm):
        ops.swiglu_matmul(*ops.matmuls(attn_out(a, x), (gate, up)), down), in one call
        (self.ffn, for steps it takes)."""
        o, f = self.out, self.ffn
        T = x.shape[0]
        return _layer.out_add_norm_ffn(a, o.P, o.Wt, x, o.wn, o.eps, f.P, f.Wt, f.Pd, f.Wtd,
                                       _threads(T, o.cols, threads),
                                       _threads(T, f.gu_cols, threads),
                                       _threads(T, f.d_cols, threads), o.counter)

    def moe(self, h, k: int, threads: int):
        """ops.moe(bank, h, k) of the grouped bank with an F32 router: routing and experts in
        GroupedExperts' one kernel call, on the step's threads."""
        T = h.shape[0]
        return self.bank.grouped(h, np.empty((T, k), np.int64), np.empty((T, k), np.float32),
                                 self.bank.router_f32, threads)


class FusedHead:
    """The end of a step whose every row wants logits (a decode step): the last layer's
    FFN output added to the residual, the final norm and the output matrix in one call
    (_layer.add_norm_matmul): the bits of ops.add, ops.rms_norm and ops.matmul."""

    __slots__ = ("wn", "eps", "P", "Wt", "N", "cols", "counter")

    def __init__(self, ops, norm, eps: float, output):
        self.wn, self.eps = norm, eps
        self.P, self.Wt, _ = ops._fused_mats((output,))
        self.N, self.cols = output.N, output.K * output.N
        self.counter = np.zeros(1, np.int64)

    def __call__(self, x, f, threads: int):
        T = x.shape[0]
        out = np.empty((T, self.N), np.float32)
        nw = _threads(T, self.cols, threads)
        return _layer.add_norm_matmul(x, x if f is None else f, f is not None, self.wn,
                                      self.eps, self.P, self.Wt, out, nw, self.counter)
