"""The torch backend: the `Ops` interface on torch tensors, for cuda, mps or cpu.

Weights are dequantized once at load to a dense dtype: bf16/fp16 on GPUs, float32 on the CPU
(`weights_format` says which, for `show`/`ps`). Norms, rope and softmax run in float32 for
accuracy whatever the weights' dtype. The KV cache is paged exactly like the CPU backend's
([blocks, block_size, KVH, D] per layer), so the same scheduler, block tables and prefix cache
drive it; K/V are stored in 16 bits (f16 on the CPU, as llama.cpp does).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from edgeinfer.backends.base import ForwardBatch
from edgeinfer.backends.torch import device as dev
from edgeinfer.backends.torch.attention import (StaticLayout, StepLayout, paged_attention,
                                                write_kv)
from edgeinfer.backends.torch.weights import dense_bytes, load_tensor
from edgeinfer.formats.kv_cache_types import check_kv_cache_type


@dataclass
class TorchKVCache:
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    block_size: int
    scratch_block: int      # one block past the pool's: padded decode rows write there (graphs.py)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


class TorchOps:
    name = "torch"
    kv_bytes_per_value = 2
    kv_window_group = False     # attention gathers each window from the one pool (attention.py)
    # matmuls and attention pick kernels by the number of rows (BLAS, cuBLAS, SDPA): a
    # verify row rounds differently from a decode row, and per_row cannot change that
    exact_drafts = False
    rows_exact = False
    per_row = False

    def __init__(self, device: str | None = None, check_memory: bool = True,
                 dtype: str | None = None, kv_cache_type: str | None = None,
                 graphs: bool | None = None):
        if kv_cache_type not in (None, "f16"):
            check_kv_cache_type(kv_cache_type)
            raise ValueError(f"the torch backend keeps its KV cache in f16 (bf16/f32 on some "
                             f"devices) and has no {kv_cache_type} cache: use kv_cache_type f16, "
                             "or the cpu or llamacpp backend for q8_0")
        self.info = dev.detect(device.split(":")[0] if device else None)
        self.device = torch.device(device if device and ":" in device else self.info.torch_device)
        # dtype="bfloat16" (Settings.torch_dtype) halves weight memory and traffic (faster CPU
        # decode, at some accuracy); the default is the device's own choice
        self.dtype = dev.compute_dtype(self.info.kind, dtype)
        # CPU: compute in f32 but keep the cache in f16 (half the memory, llama.cpp's rounding).
        self.kv_dtype = torch.float16 if self.info.kind == "cpu" else self.dtype
        self.kv_bytes_per_value = torch.empty((), dtype=self.kv_dtype).element_size()
        self.weights_format = str(self.dtype).removeprefix("torch.")
        self.weights_copied = True      # dequantized onto the device at load
        self.name = f"torch:{self.info.kind}"
        self.check_memory = check_memory
        self._checked = False
        # decode steps as recorded CUDA graphs (graphs.py): on by default on CUDA; True on
        # another device runs the same padded static steps eagerly (how the CPU tests see it)
        self.graphs = (self.info.kind == "cuda") if graphs is None else graphs
        # made once from the model's tensors, keyed by their ids (_memo keeps them alive):
        # rope's device frequencies, biases cast to the compute dtype, shared GEMM buffers
        self._rope_inv: dict = {}
        self._casts: dict = {}
        self._fused: dict = {}

    @property
    def kv_cache_type(self) -> str:
        return {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}[
            str(self.kv_dtype).removeprefix("torch.")]

    def begin_step(self) -> None:
        """Nothing per step: torch keeps its own thread pool and device queues."""

    def release(self) -> None:
        """The model is unloading: drop the device copies made from its weights."""
        for memo in (self._casts, self._rope_inv, self._fused):
            memo.clear()

    def weights_format_for(self, gguf_file) -> str:
        return self.weights_format

    # -- weights ---------------------------------------------------------------------------
    def _check_model_fits(self, gf) -> None:
        if self._checked or not self.check_memory:
            return
        self._checked = True
        dev.check_fits(self.info, dense_bytes(gf, self.dtype),
                       f"the model as {self.weights_format} weights")

    def weights_nbytes(self, gguf_file) -> int:
        """Every tensor dequantized to the compute dtype."""
        return dense_bytes(gguf_file, self.dtype)

    def fit_kv_budget(self, gguf_file, requested: int) -> int:
        """Before loading: refuse if the weights cannot fit, and cap the KV pool's budget at
        what the device has left after them (the same 10% reserve)."""
        need = dense_bytes(gguf_file, self.dtype)
        if self.check_memory:
            dev.check_fits(self.info, need, f"the model as {self.weights_format} weights")
            self._checked = True
            return max(0, min(requested, int(self.info.free_bytes * 0.9) - need))
        return requested

    def matrix(self, gguf_file, name: str) -> torch.Tensor:
        """[out, in] dense weight (ggml stores rows of `in` values)."""
        self._check_model_fits(gguf_file)
        return load_tensor(gguf_file, name, self.device, self.dtype)

    def table(self, gguf_file, name: str) -> torch.Tensor:
        return self.matrix(gguf_file, name)

    def vector(self, gguf_file, name: str) -> torch.Tensor:
        return load_tensor(gguf_file, name, self.device, torch.float32).reshape(-1)

    # -- per-step tensors ------------------------------------------------------------------
    def _layout(self, batch: ForwardBatch, block_size: int) -> StepLayout | StaticLayout:
        lay = batch.cache.get("torch_layout")
        if lay is None:
            static = batch.cache.get("torch_static")
            lay = batch.cache["torch_layout"] = (
                StaticLayout.of(static) if static is not None
                else StepLayout.build(batch, block_size, self.device))
        return lay

    def fused_layer_rows(self, T: int, width: int, mats) -> bool:
        """False: no fused attention-block calls here (decode_graphs takes their place)."""
        return False

    def decode_graphs(self, model, kv: TorchKVCache):
        """graphs.DecodeGraphs for `model` (whose forward reads the batch only through these
        ops: Model.graph_safe), or None when this backend runs decode steps as any other."""
        if not self.graphs or self.info.kind == "mps":      # MPS: no float64 rope angles
            return None
        from edgeinfer.backends.torch.graphs import DecodeGraphs
        return DecodeGraphs(model, kv, self.device, capture=self.device.type == "cuda")

    # -- element-wise ----------------------------------------------------------------------
    def embed(self, table: torch.Tensor, ids) -> torch.Tensor:
        if isinstance(ids, np.ndarray):
            ids = torch.from_numpy(ids.astype(np.int64)).to(self.device)
        return table[ids]

    def matmul(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(w.dtype), w)

    def matmuls(self, x: torch.Tensor, ws) -> tuple:
        """One GEMM for matrices read together (q/k/v, gate/up): the first call moves them
        into one [sum of rows, in] buffer, each tensor re-pointed at its rows there (no
        second copy), and later calls multiply by the whole buffer and return column views.
        On a GPU a decode step's small GEMMs are launch-bound: this is 3 fewer a layer."""
        shared = _memo(self._fused, tuple(ws), lambda: _shared_buffer(ws))
        if shared is None:
            return tuple(self.matmul(x, w) for w in ws)
        buf, rows = shared
        return F.linear(x.to(buf.dtype), buf).split(rows, dim=-1)

    def add_bias(self, x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        # a float32 bias cast once to x's dtype, not one cast kernel per use
        if b.dtype != x.dtype:
            b = _memo(self._casts, (b,), lambda: b.to(x.dtype), x.dtype)
        return x.add_(b)

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        # one op (a fused kernel where torch has one) in float32 whatever x's dtype
        return F.rms_norm(x.float(), (x.shape[-1],), w, eps).to(x.dtype)

    def add_rms_norm(self, x: torch.Tensor, a: torch.Tensor, w_a: torch.Tensor,
                     w_x: torch.Tensor, eps: float) -> torch.Tensor:
        """x += rms_norm(a, w_a) in place; returns rms_norm(x, w_x) (the CPU backend fuses it)."""
        self.add(x, self.rms_norm(a, w_a, eps))
        return self.rms_norm(x, w_x, eps)

    def norm_rope(self, x: torch.Tensor, w: torch.Tensor, eps: float, batch: ForwardBatch,
                  base: float, scale: float, neox: bool, freq_factors=None) -> torch.Tensor:
        return self.rope(self.rms_norm(x, w, eps), batch, base, scale, neox, freq_factors)

    def rope(self, x: torch.Tensor, batch: ForwardBatch, base: float, scale: float, neox: bool,
             freq_factors=None) -> torch.Tensor:
        D = x.shape[-1]
        key = ("torch_rope", base, scale, D, neox)
        tables = batch.cache.get(key)
        static = batch.cache.get("torch_static")
        if tables is None and static is not None:
            # a graphs.py step: the same float64 angles, from the positions on the device
            inv = _memo(self._rope_inv, (freq_factors,), lambda: torch.from_numpy(
                _inv_freq(base, D, freq_factors)).to(self.device), base, D)
            ang = (static.positions.double() / scale)[:, None] * inv[None, :]
            tables = batch.cache[key] = _rotation(torch.cos(ang).float()[:, None, :],
                                                  torch.sin(ang).float()[:, None, :], neox)
        elif tables is None:  # once per step and rope base, shared by every layer
            # float64 on the host (MPS has no float64), like the CPU backend's tables
            ang = np.outer(batch.positions.astype(np.float64) / scale,
                           _inv_freq(base, D, freq_factors))
            cos, sin = (torch.from_numpy(f(ang).astype(np.float32))[:, None, :].to(self.device)
                        for f in (np.cos, np.sin))
            tables = batch.cache[key] = _rotation(cos, sin, neox)
        cos2, sin2 = tables
        xf = x.float()
        # (a, b) -> (a cos - b sin, b cos + a sin): x * cos2 + swapped(x) * sin2, where sin2
        # carries -sin on the first of each pair; the same products and sums as written out
        if neox:
            half = D // 2
            swapped = torch.cat((xf[..., half:], xf[..., :half]), dim=-1)
        else:
            swapped = xf.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
        return (xf * cos2).add_(swapped.mul_(sin2)).to(x.dtype)

    def geglu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.gelu(gate, approximate="tanh") * up

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up

    def swiglu_matmul(self, gate: torch.Tensor, up: torch.Tensor, w) -> torch.Tensor:
        return self.matmul(self.swiglu(gate, up), w)

    # -- encoder models (BERT) ---------------------------------------------------------------
    def layer_norm(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor,
                   eps: float) -> torch.Tensor:
        y = F.layer_norm(x.float(), (x.shape[-1],), w.float(), b.float(), eps)
        return y.to(x.dtype)

    def contiguous(self, x: torch.Tensor) -> torch.Tensor:
        return x.contiguous()

    def gelu(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x, approximate="tanh")

    def encoder_attention(self, q, k, v, batch: ForwardBatch, scale: float,
                          window: int = 0) -> torch.Tensor:
        """Every token attends to every token of its own sequence (a block-diagonal mask),
        within window // 2 positions either side when window > 0."""
        seq = batch.cache.get(("torch_seq_mask", window))
        if seq is None:
            ts = torch.from_numpy(batch.token_seq.astype(np.int64)).to(self.device)
            seq = ts[:, None] == ts[None, :]
            if window > 0:
                p = torch.from_numpy(batch.positions.astype(np.int64)).to(self.device)
                seq = seq & ((p[:, None] - p[None, :]).abs() <= window // 2)
            batch.cache[("torch_seq_mask", window)] = seq
        group = q.shape[1] // k.shape[1]
        kf, vf = k.float(), v.float()
        if group > 1:
            kf, vf = kf.repeat_interleave(group, dim=1), vf.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q.float().transpose(0, 1), kf.transpose(0, 1),
                                             vf.transpose(0, 1), attn_mask=seq, scale=scale)
        return out.transpose(0, 1).to(q.dtype).contiguous()

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x.add_(y.to(x.dtype))

    def scale(self, x: torch.Tensor, s: float) -> torch.Tensor:
        return x.mul_(s)

    def take_rows(self, x: torch.Tensor, rows) -> torch.Tensor:
        if len(rows) == x.shape[0]:
            return x
        return x[self._ids_raw(rows)]

    def _ids_raw(self, rows) -> torch.Tensor:
        return torch.from_numpy(np.asarray(rows, np.int64)).to(self.device)

    def to_numpy(self, x: torch.Tensor) -> np.ndarray:
        return x.float().cpu().numpy()

    def put_rows(self, x: torch.Tensor, rows: np.ndarray, values: np.ndarray) -> torch.Tensor:
        """x[rows] = values (image embeddings in place of token embeddings), in place; the
        attention reads ForwardBatch.attn_until (torch/attention.py)."""
        x[self._ids_raw(rows)] = torch.from_numpy(np.ascontiguousarray(values)).to(
            self.device, x.dtype)
        return x

    # -- paged KV cache --------------------------------------------------------------------
    def new_kv_cache(self, n_layers: int, num_blocks: int, block_size: int, n_kv_head: int,
                     head_dim: int) -> TorchKVCache:
        shape = (num_blocks + 1, block_size, n_kv_head, head_dim)    # + the scratch block
        if self.check_memory:
            need = 2 * n_layers * (num_blocks + 1) * block_size * n_kv_head * head_dim
            need *= self.kv_bytes_per_value
            dev.check_fits(dev.detect(self.info.kind), need, f"the KV cache ({num_blocks} blocks)")
        mk = lambda: torch.zeros(shape, dtype=self.kv_dtype, device=self.device)  # noqa: E731
        return TorchKVCache([mk() for _ in range(n_layers)], [mk() for _ in range(n_layers)],
                            block_size, scratch_block=num_blocks)

    def attention(self, q, k, v, cache: TorchKVCache, layer: int, batch: ForwardBatch,
                  scale: float, window: int) -> torch.Tensor:
        """Write this step's K/V into the cache, then attend through the block tables."""
        lay = self._layout(batch, cache.block_size)
        write_kv(cache.k[layer], cache.v[layer], k, v, lay.slots)
        return paged_attention(q, cache.k[layer], cache.v[layer], lay, scale, window)


def _memo(table: dict, objs: tuple, make, *extra):
    """table's value for these objects (by identity) and extra key parts, made on first use;
    the entry holds the objects, so their ids stay theirs while it lives."""
    key = (*map(id, objs), *extra)
    hit = table.get(key)
    if hit is None:
        hit = table[key] = (objs, make())
    return hit[1]


def _shared_buffer(ws):
    """Matrices read together moved into one [sum of rows, in] buffer, each tensor re-pointed
    at its rows there (Tensor.set_: no second copy of the weights): (buffer, rows of each);
    None where they cannot share one (views of a larger tensor keep their own storage; one
    matrix needs none)."""
    w0 = ws[0]
    if len(ws) < 2 or not all(
            isinstance(w, torch.Tensor) and w.dim() == 2 and w.is_contiguous()
            and w.storage_offset() == 0 and w.untyped_storage().nbytes() == w.nbytes
            and w.dtype == w0.dtype and w.device == w0.device and w.shape[1] == w0.shape[1]
            for w in ws):
        return None
    buf = torch.cat(ws)
    row = 0
    for w in ws:
        w.set_(buf.untyped_storage(), buf.storage_offset() + row * buf.shape[1], w.shape,
               w.stride())
        row += w.shape[0]
    return buf, [w.shape[0] for w in ws]


def _rotation(cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> tuple:
    """Rope's per-step tables [T, 1, D/2] spread over the whole head [T, 1, D]: cos on both
    members of a pair, -sin on the first and sin on the second (pairs are (i, i + D/2) in
    NeoX order, (2i, 2i + 1) otherwise)."""
    if neox:
        return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)
    return (torch.stack((cos, cos), dim=-1).flatten(-2),
            torch.stack((-sin, sin), dim=-1).flatten(-2))


def _inv_freq(base: float, D: int, freq_factors) -> np.ndarray:
    """Rope's float64 frequencies for a head of D dims, divided by per-pair factors if any
    (rope_freqs tensors, or YaRN's as numpy)."""
    inv = base ** (-np.arange(0, D, 2, dtype=np.float64) / D)
    if freq_factors is not None:
        ff = freq_factors if isinstance(freq_factors, np.ndarray) else \
            freq_factors.detach().cpu().numpy()
        inv = inv / ff.astype(np.float64)
    return inv
