"""Element-wise kernels and the K/V pools for the CPU backend (numba, GIL released).

The quantized matmuls live in matmul.py and attention in attention.py; these are the small
ops between them. Each kernel takes preallocated float32 arrays and works over a whole batch
of tokens per call, so the per-token Python cost is a fixed number of calls per layer,
independent of hidden size.
"""
from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

from . import _stamp
from ._simd import bload_f16, hload, iload_i8, itof, vload, vmul, vsplat

_DEPS = ("_simd.py",)        # inlined here: see _stamp.py
_DEPS_HASH = "87956b1a768fad6f"

_CACHE = _stamp.current(_DEPS, _DEPS_HASH)

_JIT = dict(nogil=True, cache=_CACHE, fastmath=False)
_PJIT = dict(nogil=True, cache=_CACHE, parallel=True, fastmath=False)


@intrinsic
def _f16_round(typingctx, x):
    """float32 -> nearest float16 (ties to even) -> float32: LLVM's fptrunc/fpext, one
    vcvtps2ph/vcvtph2ps pair on x86 (F16C) and native on ARM64."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.fpext(builder.fptrunc(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.float32), codegen


@intrinsic
def _f16_bits(typingctx, x):
    """float32 -> the bit pattern of the nearest float16 (ties to even), as uint16."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
    return types.uint16(types.float32), codegen


@intrinsic
def _f16_from_bits(typingctx, x):
    """The float16 whose bit pattern is x (uint16), widened exactly to float32."""
    if x != types.uint16:
        return None

    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.uint16), codegen


@njit(inline="always", nogil=True)
def round_f16(v):
    """Round to the nearest float16 value, returned as float32."""
    return _f16_round(np.float32(v))


# Each kernel takes `par`: False runs it on the calling thread. A parallel region costs a few
# microseconds to start, and tens when the workers went to sleep since the last one (the
# engine runs small serial matmuls between them), so small inputs skip it (ops.py decides).

@njit(inline="always", nogil=True)
def _rms_row(x, w, eps, out, r):
    n = x.shape[1]
    acc = 0.0  # float64 sum, as ggml does, so long rows don't lose precision
    for i in range(n):
        v = x[r, i]
        acc += v * v
    scale = np.float32(1.0 / math.sqrt(acc / n + eps))
    for i in range(n):
        out[r, i] = x[r, i] * scale * w[i]


@njit(**_PJIT)
def rms_norm(x, w, eps, out, par):
    """out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w, for each row r of a 2-D array."""
    if par:
        for r in prange(x.shape[0]):
            _rms_row(x, w, eps, out, r)
    else:
        for r in range(x.shape[0]):
            _rms_row(x, w, eps, out, r)
    return out


@njit(inline="always", nogil=True)
def _rope_head(x, cos, sin, neox, t, h):
    D = x.shape[2]
    half = D // 2
    if neox:
        for i in range(half):
            a = x[t, h, i]
            b = x[t, h, i + half]
            c = cos[t, i]
            s = sin[t, i]
            x[t, h, i] = a * c - b * s
            x[t, h, i + half] = b * c + a * s
    else:
        for i in range(half):
            a = x[t, h, 2 * i]
            b = x[t, h, 2 * i + 1]
            c = cos[t, i]
            s = sin[t, i]
            x[t, h, 2 * i] = a * c - b * s
            x[t, h, 2 * i + 1] = b * c + a * s


@njit(**_PJIT)
def rope_inplace(x, cos, sin, neox, par):
    """Rotary embedding in place on x[T, H, D] with per-token tables cos/sin[T, D/2].

    neox=True rotates (x[i], x[i + D/2]) pairs (NeoX/HF order); False rotates adjacent pairs
    (x[2i], x[2i+1]), the original llama layout that GGUF llama weights are permuted for.
    """
    T, H = x.shape[0], x.shape[1]
    if par:
        for th in prange(T * H):
            _rope_head(x, cos, sin, neox, th // H, th % H)
    else:
        for th in range(T * H):
            _rope_head(x, cos, sin, neox, th // H, th % H)


@njit(inline="always", nogil=True)
def _gelu_row(gate, up, out, r):
    k = np.float32(math.sqrt(2.0 / math.pi))
    for i in range(gate.shape[1]):
        g = gate[r, i]
        out[r, i] = np.float32(0.5) * g * (np.float32(1.0) + np.tanh(k * (g + np.float32(0.044715) * g * g * g))) * up[r, i]


@njit(**_PJIT)
def gelu_tanh_mul(gate, up, out, par):
    """GeGLU: gelu_tanh(gate) * up (Gemma's feed-forward)."""
    if par:
        for r in prange(gate.shape[0]):
            _gelu_row(gate, up, out, r)
    else:
        for r in range(gate.shape[0]):
            _gelu_row(gate, up, out, r)
    return out


# -- KV pools ------------------------------------------------------------------------------
# Three pool layouts, told apart by dtype, each [num_blocks, block_size, KVH, row]:
#   float32: the values (numerics "f32");
#   uint16:  IEEE half bit patterns, row = head_dim (llama.cpp's default f16 cache);
#   uint8:   ggml block_q8_0 bytes, row = head_dim / 32 * 34: per 32 values an f16 scale
#            d = amax / 127 then 32 int8 codes round(x / d) (llama.cpp's q8_0 cache).
# Attention kernels read through kv_vec / kv_scalar and write through kv_write only, so they
# work on every layout.

Q8_BLOCK = 32           # values per q8_0 block
Q8_BYTES = 34           # bytes per q8_0 block: f16 scale + 32 int8 codes


def kv_vec(arr, i):
    """16 K/V values from flat element offset i (a multiple of 16) of a cache, as float32:
    the f16 pool widens its halves exactly; the q8_0 pool widens codes times their block's
    scale (exact in float32); the f32 pool is read as it is."""


@overload(kv_vec, inline="always")
def _kv_vec(arr, i):
    if arr.dtype == types.uint16:
        return lambda arr, i: bload_f16(arr, i * 2)
    if arr.dtype == types.uint8:
        def q8(arr, i):
            b = (i >> 5) * Q8_BYTES
            return vmul(itof(iload_i8(arr, b + 2 + (i & 31))), vsplat(hload(arr, b)))
        return q8
    return lambda arr, i: vload(arr, i)


def kv_scalar(arr, idx):
    """One K/V value of a cache as float32; idx = (block, offset, kv head, d)."""


@njit(inline="always", nogil=True)
def _q8_scale(arr, blk, off, h, o):
    bits = np.int32(arr[blk, off, h, o]) | (np.int32(arr[blk, off, h, o + 1]) << 8)
    return _f16_from_bits(np.uint16(bits))


@overload(kv_scalar, inline="always")
def _kv_scalar(arr, idx):
    if arr.dtype == types.uint16:
        return lambda arr, idx: _f16_from_bits(arr[idx])
    if arr.dtype == types.uint8:
        def q8(arr, idx):
            blk, off, h, d = idx
            o = (d >> 5) * Q8_BYTES
            code = np.int32(arr[blk, off, h, o + 2 + (d & 31)])
            if code > 127:
                code -= 256
            return np.float32(code) * _q8_scale(arr, blk, off, h, o)
        return q8
    return lambda arr, idx: arr[idx]


def kv_store(arr, idx, x):
    """Store one float32 into an f16 or f32 K/V cache (a q8_0 pool stores whole rows:
    kv_store_row)."""


@overload(kv_store, inline="always")
def _kv_store(arr, idx, x):
    if arr.dtype == types.uint16:
        def f16(arr, idx, x):
            arr[idx] = _f16_bits(np.float32(x))
        return f16
    if arr.dtype == types.uint8:
        return None             # a q8_0 value has no place of its own: see kv_store_row

    def f32(arr, idx, x):
        arr[idx] = x
    return f32


def kv_store_row(arr, blk, off, h, x, t):
    """Store the row x[t, h, :] into cache slot (blk, off) of KV head h."""


@overload(kv_store_row, inline="always")
def _kv_store_row(arr, blk, off, h, x, t):
    if arr.dtype == types.uint8:
        def q8(arr, blk, off, h, x, t):
            # ggml's quantize_row_q8_0 (x86 form): d = amax / 127 stored in f16, codes
            # round-half-even(x * (127 / amax)) with the unrounded scale
            D = x.shape[2]
            for b in range(D // Q8_BLOCK):
                x0 = b * Q8_BLOCK
                o = b * Q8_BYTES
                amax = np.float32(0.0)
                for j in range(Q8_BLOCK):
                    a = abs(np.float32(x[t, h, x0 + j]))
                    if a > amax:
                        amax = a
                bits = _f16_bits(amax / np.float32(127.0))
                arr[blk, off, h, o] = np.uint8(bits & np.uint16(0xFF))
                arr[blk, off, h, o + 1] = np.uint8(bits >> np.uint16(8))
                idv = np.float32(0.0)
                if amax != 0.0:
                    idv = np.float32(127.0) / amax
                for j in range(Q8_BLOCK):
                    c = np.int32(np.rint(np.float32(x[t, h, x0 + j]) * idv))
                    arr[blk, off, h, o + 2 + j] = np.uint8(c & 0xFF)
        return q8

    def each(arr, blk, off, h, x, t):
        for d in range(x.shape[2]):
            kv_store(arr, (blk, off, h, d), x[t, h, d])
    return each


@njit(**_JIT)
def kv_write(k_cache, v_cache, k, v, slots):
    """Store K/V rows [T, KVH, D] at flat slots (block * block_size + offset)."""
    T = k.shape[0]
    bs = k_cache.shape[1]
    for t in range(T):
        blk = slots[t] // bs
        off = slots[t] % bs
        for h in range(k.shape[1]):
            kv_store_row(k_cache, blk, off, h, k, t)
            kv_store_row(v_cache, blk, off, h, v, t)


def kv_row_width(kv_type: str, head_dim: int) -> int:
    """Elements of a pool row for one KV head (bytes for q8_0)."""
    if kv_type == "q8_0":
        if head_dim % Q8_BLOCK:
            raise ValueError(f"a q8_0 KV cache needs a head dimension that is a multiple of "
                             f"{Q8_BLOCK}; this model's is {head_dim}")
        return head_dim // Q8_BLOCK * Q8_BYTES
    return head_dim


def kv_dtype(kv_type: str):
    """The numpy dtype of a pool of this KV type (f32, f16 or q8_0)."""
    return {"f32": np.float32, "f16": np.uint16, "q8_0": np.uint8}[kv_type]


def rope_tables(positions: np.ndarray, head_dim: int, base: float, scale: float = 1.0,
                freq_factors: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin[T, head_dim/2] for the given positions (numpy: T x D/2 work per forward)."""
    inv = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if freq_factors is not None:
        inv = inv / freq_factors.astype(np.float64)
    ang = np.outer(positions.astype(np.float64) / scale, inv)
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


# -- llama.cpp-compatible numerics ---------------------------------------------------------
# ggml's CPU matmuls quantize the activation row to 8 bits (Q8_0 blocks of 32 for the legacy
# quants, Q8_K blocks of 256 for the k-quants, f16 for f16 weights) and tabulate GELU in f16.
# Rounding our activations the same way makes our logits match llama.cpp's to float
# summation order, so greedy text agrees token for token instead of drifting at near-ties.

@njit(inline="always", nogil=True)
def quantize_act_block(x, r, b0, A, qa):
    """ggml's 8-bit activation block x[r, b0:b0+A]: writes the int8 codes to qa[r, b0:b0+A] and
    returns the scale. A = 32: Q8_0 (d = amax/127 stored in f16); A = 256: Q8_K (scale from the
    signed max, -127/max, float32)."""
    amax = np.float32(0.0)
    mx = np.float32(0.0)
    for j in range(A):
        v = x[r, b0 + j]
        if abs(v) > amax:
            amax = abs(v)
            mx = v
    if amax == 0.0:
        for j in range(A):
            qa[r, b0 + j] = 0
        return np.float32(0.0)
    if A == 32:
        idv = np.float32(127.0) / amax
        for j in range(A):
            qa[r, b0 + j] = np.int8(np.rint(x[r, b0 + j] * idv))
        return round_f16(amax / np.float32(127.0))
    iscale = np.float32(-127.0) / mx
    for j in range(A):
        v = np.rint(iscale * x[r, b0 + j])
        if v > 127.0:
            v = 127.0
        qa[r, b0 + j] = np.int8(v)
    return np.float32(1.0) / iscale


@njit(inline="always", nogil=True)
def _act_round(x, out, A):
    """x -> the values of its A-column activation blocks (codes times scale)."""
    rows, n = x.shape
    nb = n // A
    qa = np.empty((rows, n), np.int8)
    for rb in prange(rows * nb):
        r = rb // nb
        b0 = (rb % nb) * A
        d = quantize_act_block(x, r, b0, A, qa)
        for j in range(A):
            out[r, b0 + j] = np.float32(qa[r, b0 + j]) * d
    return out


@njit(**_PJIT)
def act_round_q8_0(x, out):
    """x -> the values of its Q8_0 quantization (d = amax/127 stored in f16)."""
    return _act_round(x, out, 32)


@njit(**_PJIT)
def act_round_q8_k(x, out):
    """x -> the values of its Q8_K quantization (scale from the signed max, -127/max)."""
    return _act_round(x, out, 256)


@njit(**_PJIT)
def act_round_f16(x, out):
    rows, n = x.shape
    for r in prange(rows):
        for i in range(n):
            out[r, i] = round_f16(x[r, i])
    return out


@njit(**_PJIT)
def gelu_f16_values(h, out):
    """GELU of f16 values h, rounded to f16: the table gelu_tanh_mul_f16 looks up."""
    k = np.float32(math.sqrt(2.0 / math.pi))
    for i in prange(h.shape[0]):
        x = h[i]
        out[i] = round_f16(np.float32(0.5) * x * (np.float32(1.0) + np.tanh(
            k * x * (np.float32(1.0) + np.float32(0.044715) * x * x))))
    return out


_GELU_TABLE: list = []


def gelu_f16_table() -> np.ndarray:
    """float32[65536]: GELU at every float16 value (indexed by its bit pattern), as ggml keeps
    it, so a GELU is one table lookup instead of a tanh."""
    if not _GELU_TABLE:
        h = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
        _GELU_TABLE.append(gelu_f16_values(h, np.empty_like(h)))
    return _GELU_TABLE[0]


@njit(inline="always", nogil=True)
def gelu_f16_at(g, table):
    """ggml's GELU of one value: its shortcuts beyond +-10, else the f16 table entry."""
    if g <= -10.0:
        return np.float32(0.0)
    if g >= 10.0:
        return g
    return table[_f16_bits(g)]


@njit(inline="always", nogil=True)
def _gelu_f16_row(gate, up, out, table, r):
    for i in range(gate.shape[1]):
        out[r, i] = gelu_f16_at(gate[r, i], table) * up[r, i]


@njit(**_PJIT)
def gelu_tanh_mul_f16(gate, up, out, table, par):
    """GeGLU as ggml computes it: GELU of the f16-rounded input, result rounded to f16, read
    from `table` (gelu_f16_table); inputs beyond +-10 take ggml's shortcuts."""
    if par:
        for r in prange(gate.shape[0]):
            _gelu_f16_row(gate, up, out, table, r)
    else:
        for r in range(gate.shape[0]):
            _gelu_f16_row(gate, up, out, table, r)
    return out
