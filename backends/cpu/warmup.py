"""The CPU backend's kernels as compile steps: each step compiles (or loads from numba's disk
cache) one group of kernels by calling it on tiny inputs of exactly the array types real calls
use. edgeinfer.engine.warmup runs them, in child processes, with progress: at install for
all of them, at pull and load for what a model needs that is not compiled yet.

Step keys:
- "int8:TYPE": the int8 tile kernel of one repackable weight type on this CPU's vector
  instruction set (its first use also compiles the one parallel driver and the activation
  quantizer); about a second each.
- "float:TYPE": the GGUF-block kernels of one type (decode rows, row dots; the three
  parallel drivers on first use): weights the int8 path does not take (F32, F16, BF16), and
  every type when repacking is off.
- "attention:KV": paged attention over a KV cache of type KV (f16, q8_0): the tiled kernel
  and the one that splits a lone token's long context over the threads.
- "ops": what a decoder model's forward does not reach with the default settings: f32
  numerics' and encoder (BERT) kernels, and on CPUs with AMX-BF16 the vision towers'
  split-precision products and attention (_amx_bf16.py).
- "mxfp4": the MXFP4 kernels (mxfp4.py: gpt-oss's experts, read in place, never repacked).
- "moe": the grouped expert kernels of repacked mixture-of-experts layers (experts.py:
  _moe's one call per layer, _router's routing), and the fused attention-block kernels
  qwen3moe's and the llama family's decode steps take (_layer.py: ops.norm_qkv,
  norm_qkv_rope, ops.out_add_norm).
"""
from __future__ import annotations

import numpy as np

from edgeinfer.formats.ggml_types import GGMLQuantizationType as Q

from . import _int8
from .repack import REPACKABLE


def type_name(code: int) -> str:
    return Q(code).name


def int8_types() -> list[int]:
    """Weight types with an int8 tile kernel on this CPU (none without a vector kernel: the
    default then keeps weights in their GGUF blocks)."""
    return sorted(REPACKABLE) if _int8.HAVE_SIMD else []


def float_types() -> list[int]:
    from .quants import SUPPORTED_TYPES
    return [int(t) for t in SUPPORTED_TYPES]


def all_keys() -> list[str]:
    """Every step: the attention over a q8_0 KV cache too (an opt-in setting, ~1 min of a
    2-core install, which would otherwise fall on the first load that asks for it)."""
    return ([f"int8:{type_name(c)}" for c in int8_types()]
            + [f"float:{type_name(c)}" for c in float_types()]
            + ["attention:f16", "attention:q8_0", "ops", "mxfp4"]
            + (["moe"] if int8_types() else []))


def label(key: str) -> str:
    kind, _, arg = key.partition(":")
    return {"int8": f"int8 tile kernel {arg}", "float": f"GGUF block kernels {arg}",
            "attention": f"attention, {arg} KV cache",
            "ops": "f32 and encoder kernels", "mxfp4": "MXFP4 kernels",
            "moe": "grouped expert kernels"}.get(kind, key)


def keys_for_model(gguf_file, ops) -> list[str]:
    """The matmul steps a model's weights need on `ops` (a CpuOps): int8 for the matrices it
    repacks, float for the others (2-D tensors; 1-D ones are read with numpy)."""
    from .mxfp4 import MXFP4
    repack = ops.would_repack(gguf_file)
    int8, flt = set(), set()
    mx = ["mxfp4"] if any(int(t.ggml_type) == MXFP4 for t in gguf_file.tensors.values()) else []
    for t in gguf_file.tensors.values():
        code = int(t.ggml_type)
        if len(t.shape) != 2 or code == MXFP4:
            continue
        (int8 if repack and code in REPACKABLE else flt).add(code)
    if not repack:
        return [f"float:{type_name(c)}" for c in sorted(flt)] + ["ops"] + mx
    moe = ["moe"] if any(len(t.shape) == 3 and int(t.ggml_type) in REPACKABLE
                         for t in gguf_file.tensors.values()) else []
    return ([f"int8:{type_name(c)}" for c in sorted(int8)]
            + [f"float:{type_name(c)}" for c in sorted(flt)] + mx + moe)


def run(key: str) -> None:
    kind, _, arg = key.partition(":")
    if kind == "int8":
        _int8_step(int(Q[arg]))
    elif kind == "float":
        _float_step(int(Q[arg]))
    elif kind == "attention":
        _attention_step(arg)
    elif kind == "ops":
        _ops_step()
    elif kind == "mxfp4":
        _mxfp4_step()
    elif kind == "moe":
        _moe_step()
    else:
        raise KeyError(f"no kernel step {key!r}")


def _int8_step(code: int) -> None:
    """The type's repacking and tile kernel, and its row decoder, through a product of 1 and 260 rows (serial and parallel
    activation quantization, the driver's serial path; no parallel region starts), then a
    two-matrix product (the driver takes one to three)."""
    from .packed import packed_matmul, packed_matmuls
    from .quants import QuantMatrix, get_rows, random_quant_rows
    from .repack import PackedMatrix
    rng = np.random.default_rng(0)
    for N in (40, 32):       # a partial last tile (tile_codes), whole tiles (the direct paths)
        w = QuantMatrix.from_bytes(random_quant_rows(code, N, 256, rng), code, 256, N)
        p = PackedMatrix.from_quant(w)
    get_rows(w, np.arange(2, dtype=np.int64))    # the row decoder: untied embedding tables
    get_rows(w, np.arange(N, dtype=np.int64))    # (a few rows serial, a prompt's in parallel)
    packed_matmul(np.zeros((1, 256), np.float32), p)
    packed_matmul(np.zeros((260, 256), np.float32), p)
    packed_matmuls(np.zeros((2, 256), np.float32), [p, p])


def _float_step(code: int) -> None:
    """The type's kernels as CpuOps runs them on weights kept in GGUF blocks: ggml's
    activation rounding for the type (F16: halves, quants: 8-bit blocks), then the matvec,
    the few-row matvec and the multi-row kernel, and the embedding rows."""
    from .matmul import FEW_ROWS
    from .ops import CpuOps
    from .quants import QuantMatrix, get_rows, random_quant_rows
    rng = np.random.default_rng(0)
    K = 256
    w = QuantMatrix.from_bytes(random_quant_rows(code, 4, K, rng), code, K, 4)
    ops = CpuOps(repack=False)
    x = np.zeros((FEW_ROWS + 1, K), np.float32)
    ops.matmul(x[0], w)             # matvec
    ops.matmul(x[:2], w)            # few-row matvec
    ops.matmul(x, w)                # register-blocked multi-row
    get_rows(w, [0])


def _mxfp4_step() -> None:
    """MXFP4 products as CpuOps runs them: one row and several (Q8_0 activations), float32
    activations (numerics="f32"), and the grouped expert kernel."""
    from . import mxfp4 as MX
    data = np.zeros((4, MX.row_bytes(256)), np.uint8)
    data[:, ::MX.BLOCK_BYTES] = 127
    w = MX.Mxfp4Matrix(data, 256, 4)
    x = np.zeros((3, 256), np.float32)
    MX.matmul(x[0], w)
    MX.matmul(x, w)
    MX.matmul(x, w, q8=False)
    bank = MX.Mxfp4Experts(data.reshape(2, 2, -1), 256, 2, 2)
    MX.grouped_matmuls(x, [bank], np.array([0, 1, 3]), np.array([1, 0]))


def _moe_step() -> None:
    """A grouped expert layer as CpuOps runs it: routed in the call from a read-only F32
    router (as the map gives it) for one token and for a prefill's (the parallel paths),
    then given routing; the router kernels on their own."""
    from . import _router
    from .experts import GroupedExperts, Workspace
    from .quants import QuantMatrix, random_quant_rows
    from .repack import PackedMatrix
    rng = np.random.default_rng(0)
    E, N, K = 2, 32, 256
    mats = [PackedMatrix.from_quant(QuantMatrix.from_bytes(
        random_quant_rows(Q.Q8_0, E * N if m < 2 else E * K, K if m < 2 else N, rng), Q.Q8_0,
        K if m < 2 else N, E * N if m < 2 else E * K)) for m in range(3)]
    g = GroupedExperts(mats, E, _int8.BEST_ISA if _int8.HAVE_SIMD else _int8.PORTABLE,
                       Workspace())
    router = np.zeros((E, K), np.float32)
    router.setflags(write=False)
    for T in (1, 300):
        x = np.zeros((T, K), np.float32)
        ids, w = np.empty((T, 1), np.int64), np.empty((T, 1), np.float32)
        g(x, ids, w, router)
        g(x, ids, w)
        _router.route(x, router, 1, np.empty((T, E), np.float32), ids, w, 2, T > 1)
    _router.route_logits(np.zeros((1, E), np.float32), 1, ids[:1], w[:1])
    _layer_step(mats[0])


def _layer_step(p) -> None:
    """_layer's fused kernels as qwen3moe's decode steps call them (ops.norm_qkv with and
    without the residual to add, ops.out_add_norm, the bound layer's and the fused head's
    calls) on a repacked [N, K] matrix p."""
    from types import SimpleNamespace
    from .ops import CpuOps
    ops = CpuOps(repack=True)
    K, N = p.K, p.N
    x = np.zeros((1, K), np.float32)
    wn, qn = np.ones(K, np.float32), np.ones(N // 2, np.float32)
    batch = SimpleNamespace(positions=np.zeros(1, np.int32), cache={})
    for y in (None, np.zeros((1, K), np.float32)):
        ops.norm_qkv(x, y, wn, 1e-6, (p, p, p), (2, 2), qn, qn, batch, 1e4, 1.0, True, None, 1)
    a = np.zeros((1, N), np.float32)
    # p is [N, K]: its output width N is the residual's here
    ops.out_add_norm(np.zeros((1, K), np.float32), p, a, np.ones(N, np.float32), 1e-6, 1)
    layer = ops.fused_layer(wn, 1e-6, (p, p, p), (2, 2), qn, qn, True, p, wn)
    layer.attn_in(x, x.copy(), batch.cache[("rope", 1e4, 1.0, N // 2)][0],
                  batch.cache[("rope", 1e4, 1.0, N // 2)][1], 1)
    layer.attn_out(np.zeros((1, K), np.float32), a, 1)
    # the llama/qwen2 block's variant (no QK-norm; biases or not: one signature)
    plain = ops.fused_layer(wn, 1e-6, (p, p, p), (2, 2), None, None, True, p, wn,
                            head_dim=N // 2, biases=(qn.repeat(2),) * 3)
    plain.attn_in(x, x.copy(), batch.cache[("rope", 1e4, 1.0, N // 2)][0],
                  batch.cache[("rope", 1e4, 1.0, N // 2)][1], 1)
    head = ops.fused_head(wn, 1e-6, p)
    for f in (None, x.copy()):
        head(x, f, 1)


def _attention_step(kv: str) -> None:
    """ops.attention's kernels for this KV cache type (f32: the f32 numerics' pool): the K/V
    write (and a q8_0 cache's rotation), tiles of query tokens (attention._run) and a lone decode token over many keys split over the
    threads (_run_split, which long contexts of models with few KV heads reach), the latter
    with attention sinks too on the default f16 pool (gpt-oss)."""
    from . import _rotate as _rot
    from . import attention as A
    from . import kernels as K
    from .ops import CpuOps
    ops = CpuOps(numerics="f32") if kv == "f32" else CpuOps(kv_cache_type=kv)
    H, D, blocks = 4, 64, 132
    keys = A.SPLIT_MIN_KEYS + 16
    cache = ops.new_kv_cache(1, blocks, 16, 1, D)
    tables = np.arange(blocks, dtype=np.int32).reshape(1, blocks)
    rounding = kv == "f16"           # ggml rounding: f16 caches; a q8_0 one rounds q instead
    q = np.zeros((2, H, D), np.float32)
    rows = np.zeros((2, 1, D), np.float32)
    K.kv_write(cache.k[0], cache.v[0], rows, rows, np.arange(2, dtype=np.int64))
    if ops.kv_cache_type == "q8_0":              # llama.cpp's rotation around a q8_0 cache
        _rot.rotate(q, False)
    A.paged_attention(q, cache.k[0], cache.v[0], tables, np.zeros(2, np.int32),
                      np.arange(2, dtype=np.int32), 0, np.float32(0.125), rounding,
                      np.empty_like(q), False, 1)
    q = np.zeros((1, H, D), np.float32)
    for sinks in (None, np.zeros(H, np.float32)) if kv == "f16" else (None,):
        A.paged_attention(q, cache.k[0], cache.v[0], tables, np.zeros(1, np.int32),
                          np.array([keys - 1], np.int32), 0, np.float32(0.125), rounding,
                          np.empty_like(q), True, 1, threads=2, sinks=sinks)


def _ops_step() -> None:
    """Kernels a default decoder forward does not reach: f32 numerics' (their attention over
    an f32 KV pool included) and encoder models' (BERT, EmbeddingGemma) norms, activations
    and attention; the GGUF reader's walk of a vocabulary (no tiny test model has one long
    enough to take it); the vision towers' AMX-BF16 kernels where the CPU has them."""
    from . import kernels as K
    from .encoder import encoder_attention, layer_norm, sequence_bounds
    x = np.zeros((3, 64), np.float32)
    K.gelu_tanh_mul(x, x.copy(), np.empty_like(x), False)
    K.gelu_tanh_mul_f16(x, x.copy(), np.empty_like(x), K.gelu_f16_table(), False)
    layer_norm(x, np.ones(64, np.float32), np.zeros(64, np.float32), 1e-6, np.empty_like(x),
               False)
    lo, hi = sequence_bounds(np.zeros(3, np.int32))
    q = np.zeros((3, 2, 32), np.float32)
    encoder_attention(q, q, q, lo, hi, np.arange(3, dtype=np.int32), 0, np.float32(0.1),
                      np.empty_like(q), False)
    _attention_step("f32")           # the f32 numerics' KV pool
    from edgeinfer.formats._string_heads import string_heads
    raw = np.zeros(64, np.uint8)
    raw.flags.writeable = False      # as a read-only map gives it
    string_heads(raw, 0, 4, 1 << 30, np.empty(4, np.int64))    # a vocabulary's GGUF walk
    from . import _amx_bf16
    if _amx_bf16.available():        # vision towers' split-precision products (AMX-BF16 CPUs)
        w = _amx_bf16.AmxMatrix(np.zeros((32, 32), np.float32))
        x = np.zeros((3, 32), np.float32)
        w.matmul(x, np.zeros(32, np.float32))
        w.matmul(x, f16=True)
        from .kernels import gelu_f16_table
        w.matmul(x, gelu=gelu_f16_table())
        _amx_bf16.attention(np.zeros((3, 96), np.float32), 3, 1, 32, 0.1)
