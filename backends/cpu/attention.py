"""Paged causal attention for the CPU backend (numba, GIL released).

One kernel serves prefill chunks, decode tokens and mixed batches. The work is cut into
tiles: a run of up to TILE consecutive query tokens of one sequence, times the query heads
of one KV head that a work item takes (`heads_per_item`). A tile reads the K and V rows of
its keys through the block table, and

1. scores every (query row, key) pair in blocks of 4 rows x 2 keys (2 or 1 rows at the
   end), so each widened K chunk feeds four dot products and eight accumulators stay in
   registers;
2. takes each row's softmax over that row's own keys (its causal / sliding-window range);
3. sums the V rows in blocks of 4 (or 2, 1) rows x 64 columns held in registers across
   all keys, so the output row is stored once, not loaded and stored again for every key;
   the keys every token of the tile sees go through all its rows at once (4-row blocks even
   where a token has 7 heads, Qwen2.5's group), then each token's own last keys.

Every query row's numbers come from one fixed sequence of operations, whatever tile, block or
batch it lands in, so a token's output is the same bits alone (decode), in a prefill chunk of
any length or in a mixed batch:
- q.k: 16 float32 partial sums over d (d, d + 16, ... with FMA), then a fixed pairwise tree
  over the 16 lanes (vhsum), then times `scale`;
- softmax: the max over the row's keys; exp in float64 of (score - max), rounded to float32,
  and summed in float64 in key order; weights = e * float32(1 / sum), rounded to f16 with
  ggml_rounding (llama.cpp's f16-cache matmul rounds them so);
- output: per column, 0 + w0 * v0 + w1 * v1 + ... in key order (a multiply and an add,
  two roundings).
With attention sinks (gpt-oss: one logit per query head that joins the softmax denominator,
ggml_soft_max_add_sinks), the max also covers the sink and exp(sink - max) (float32 expf) is
added to the float64 sum after the keys; without them (an empty `sinks` array) those two
steps are skipped, so the other models' numbers and work are unchanged.
These are the operations of the per-token kernel this replaces (kept below as
`_attend_heads`, for head sizes that are not a multiple of 16 and as the reference in tests),
so the result is also the same bits as before.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from . import _stamp
from ._int8 import WIDE_REGISTERS
from ._simd import f16x, vadd, vfma, vhsum, vload, vmul, vsplat, vstore, vsub, vzero
from .kernels import kv_scalar, kv_vec, round_f16

_DEPS = ("_simd.py", "kernels.py")        # inlined here: see _stamp.py
_DEPS_HASH = "3983f1adddb50217"

_CACHE = _stamp.current(_DEPS, _DEPS_HASH)

# No fastmath: with reassociation LLVM may order a sum differently in two copies of a loop,
# and a token's result would depend on its batch.
_JIT = dict(nogil=True, cache=_CACHE, fastmath=False)
_PJIT = dict(nogil=True, cache=_CACHE, parallel=True, fastmath=False)

TILE = 16           # query tokens per tile (consecutive positions of one sequence)
VBLOCK = 64         # keys per block of the V sums
PREFETCH = 16       # K rows asked for this many keys ahead of the scores
SPLIT_MIN_KEYS = 2048   # a lone token's keys from which its work is split over the threads
WIDE_BYTES = 16 * 1024  # K or V widened to float32 this much at a time in a tile of many rows
WIDE_MIN_KEYS = 16      # (wide_keys: a chunk stays in L1 across the tile's row groups)
WIDE_MIN_ROWS = 16      # rows (tokens x heads) from which a tile widens its K and V first


@njit(inline="always", nogil=True)
def wide_keys(D):
    """Keys per widened chunk: WIDE_BYTES of float32 rows (64 keys at D = 64, 32 at 128, 16 at
    256), so the scores' passes over a chunk, one per four rows, read it from L1 beside the
    rows' q and scores. 128 keys at every D (64 KB at D = 128) came from L2 on every pass:
    benchmarks/attention_ab.py at 2K keys, 32 KB chunks 1.105x at D = 128, 16 KB a further
    1.01-1.02x (1.05x at D = 256), 8 KB 0.98x. The chunking changes no result (scores are
    per key, and the V sums add keys in order across chunks)."""
    return max(WIDE_MIN_KEYS, WIDE_BYTES // (4 * D)) // 16 * 16


# -- softmax in 16 lanes ----------------------------------------------------------------------

_F = ir.FloatType()
_I32 = ir.IntType(32)
_VF = ir.VectorType(_F, 16)
_VI = ir.VectorType(_I32, 16)


def _vconst(x):
    return ir.Constant(_VF, [float(x)] * 16)


def _fma(builder, a, b, c):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VF, [_VF] * 3),
                                        "llvm.fma.v16f32")
    return builder.call(fn, [a, b, c])


def _vmax_ir(builder, a, b):
    return builder.select(builder.fcmp_ordered(">", a, b), a, b)


@intrinsic
def vexp(typingctx, v):
    """exp of 16 float32 lanes: Cephes' expf (x = n ln2 + r, |r| <= ln2/2, a degree-6
    polynomial in r with FMA, times 2^n), about 1 ulp. Inputs below -88 give 0 (and so does
    -inf). Fixed IEEE operations only: the same bits on every call, whatever the lane."""
    def codegen(context, builder, sig, args):
        x = args[0]
        lo = _vconst(-88.0)
        x = builder.select(builder.fcmp_ordered("<", x, lo), lo, x)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VF, [_VF]),
                                            "llvm.rint.v16f32")
        n = builder.call(fn, [builder.fmul(x, _vconst(1.44269504088896341))])
        r = _fma(builder, n, _vconst(-0.693359375), x)
        r = _fma(builder, n, _vconst(2.12194440e-4), r)
        y = _vconst(1.9875691500e-4)
        for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1,
                  5.0000001201e-1):
            y = _fma(builder, y, r, _vconst(c))
        y = _fma(builder, y, builder.fmul(r, r), r)
        y = builder.fadd(y, _vconst(1.0))
        e = builder.fptosi(n, _VI)
        bits = builder.shl(builder.add(e, ir.Constant(_VI, [127] * 16)),
                           ir.Constant(_VI, [23] * 16))
        return builder.fmul(y, builder.bitcast(bits, _VF))
    return f16x(v), codegen


@intrinsic
def vmax(typingctx, a, b):
    def codegen(context, builder, sig, args):
        return _vmax_ir(builder, args[0], args[1])
    return f16x(a, b), codegen


@intrinsic
def vhmax(typingctx, v):
    """The largest of the 16 lanes, as float32."""
    def codegen(context, builder, sig, args):
        x = args[0]
        u = ir.Constant(_VF, ir.Undefined)
        for width in (8, 4, 2, 1):
            hi = builder.shuffle_vector(
                x, u, ir.Constant(_VI, list(range(width, 2 * width)) + [0] * (16 - width)))
            x = _vmax_ir(builder, x, hi)
        return builder.extract_element(x, ir.Constant(_I32, 0))
    return types.float32(v), codegen


@intrinsic
def vround_f16(typingctx, v):
    """Each lane to the nearest float16 (ties to even), widened back: as round_f16."""
    def codegen(context, builder, sig, args):
        return builder.fpext(builder.fptrunc(args[0], ir.VectorType(ir.HalfType(), 16)), _VF)
    return f16x(v), codegen


@intrinsic
def _prefetch(typingctx, arr, off):
    """Ask for the cache line at byte offset off of arr's data (llvm.prefetch: read, keep)."""
    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        p = builder.gep(builder.bitcast(ary.data, ir.IntType(8).as_pointer()), [args[1]])
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer(), _I32,
                                                             _I32, _I32]), "llvm.prefetch.p0i8")
        builder.call(fn, [p, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])
        return context.get_dummy_value()
    return types.none(arr, off), codegen


def kv_row_prefetch(arr, i, n):
    """Prefetch the n K/V values from flat element offset i of a cache (any pool layout)."""


@overload(kv_row_prefetch, inline="always")
def _kv_row_prefetch(arr, i, n):
    if arr.dtype == types.uint8:            # q8_0: 34 bytes per 32 values
        def q8(arr, i, n):
            for b in range((i >> 5) * 34, ((i + n) >> 5) * 34, 64):
                _prefetch(arr, b)
        return q8
    size = arr.dtype.bitwidth // 8

    def plain(arr, i, n):
        for b in range(i * size, (i + n) * size, 64):
            _prefetch(arr, b)
    return plain


@njit(inline="always", nogil=True)
def _sink(sinks, h):
    """Head h's sink logit, -inf when there are none (sinks empty)."""
    return sinks[h] if sinks.shape[0] else np.float32(-np.inf)


@njit(inline="always", nogil=True)
def _softmax_row(sc, r, jlo, jhi, ggml_rounding, sink):
    """Softmax of sc[r, jlo..jhi] in place. The lanes are keys jlo + 16c + l, counted from
    the row's own first key; the row's storage must extend 15 floats past jhi (they are
    overwritten). max over the keys; e = exp(s - max) in float32 (vexp); sum: each 16-key
    chunk's lanes in vhsum's tree, the chunks added in float64 in key order; weights
    e * float32(1 / sum), rounded to f16 with ggml_rounding. A finite `sink` (the head's
    sink logit) joins the max, and exp(sink - max) the sum after the keys."""
    W = sc.shape[1]
    for j in range(jhi + 1, jhi + 16):
        sc[r, j] = -np.inf
    base = r * W + jlo
    nc = (jhi - jlo + 16) // 16
    mv = vsplat(-np.inf)
    for c in range(nc):
        mv = vmax(mv, vload(sc, base + 16 * c))
    ms = vhmax(mv)
    has_sink = sink > -np.inf
    if has_sink and sink > ms:
        ms = sink
    m = vsplat(ms)
    total = 0.0             # float64
    for c in range(nc):
        e = vexp(vsub(vload(sc, base + 16 * c), m))
        vstore(sc, base + 16 * c, e)
        total += vhsum(e)
    if has_sink:
        total += np.exp(np.float32(sink - ms))
    inv = vsplat(np.float32(1.0 / total))
    for c in range(nc):
        w = vmul(vload(sc, base + 16 * c), inv)
        vstore(sc, base + 16 * c, vround_f16(w) if ggml_rounding else w)


@njit(inline="always", nogil=True)
def _window_start(pos, window):
    if window > 0 and pos - window + 1 > 0:
        return pos - window + 1
    return 0


# -- the reference: one query token per work item -------------------------------------------

@njit(inline="always", nogil=True)
def _attend_heads(q, k_cache, v_cache, block_tables, token_seq, positions, window, scale,
                  ggml_rounding, out, t, h0, nh, sinks):
    """Attention of query token t for heads h0..h0+nh-1, which share one KV head: each K and
    V row is read once for all of them (grouped-query attention). The operations per head
    are those listed in the module docstring."""
    T, H, D = q.shape
    bs = k_cache.shape[1]
    KVH = k_cache.shape[2]
    kvh = h0 // (H // KVH)
    s = token_seq[t]
    pos = positions[t]
    start = _window_start(pos, window)
    n = pos - start + 1
    scores = np.empty((nh, n + 16), np.float32)
    qv = np.empty((nh, D), np.float32)
    for i in range(nh):
        for d in range(D):
            qv[i, d] = round_f16(q[t, h0 + i, d]) if ggml_rounding else q[t, h0 + i, d]
    for j in range(n):
        p = start + j
        blk = block_tables[s, p // bs]
        for i in range(nh):
            if D % 16 == 0:
                kbase = ((blk * bs + p % bs) * KVH + kvh) * D
                accv = vzero()
                for d in range(0, D, 16):
                    accv = vfma(vload(qv[i], d), kv_vec(k_cache, kbase + d), accv)
                acc = vhsum(accv)
            else:
                acc = np.float32(0.0)
                for d in range(D):
                    acc += qv[i, d] * kv_scalar(k_cache, (blk, p % bs, kvh, d))
            acc *= scale
            scores[i, j] = acc
    for i in range(nh):
        _softmax_row(scores, i, 0, n - 1, ggml_rounding, _sink(sinks, h0 + i))
        o = out[t, h0 + i]
        for d in range(D):
            o[d] = 0.0
    for j in range(n):
        p = start + j
        blk = block_tables[s, p // bs]
        if D % 16 == 0:
            # a multiply and an add per lane: the same two roundings as the scalar loop
            vbase = ((blk * bs + p % bs) * KVH + kvh) * D
            for i in range(nh):
                o = out[t, h0 + i]
                wv = vsplat(scores[i, j])
                for d in range(0, D, 16):
                    vstore(o, d, vadd(vload(o, d), vmul(wv, kv_vec(v_cache, vbase + d))))
        else:
            for i in range(nh):
                o = out[t, h0 + i]
                w = scores[i, j]
                for d in range(D):
                    o[d] += w * kv_scalar(v_cache, (blk, p % bs, kvh, d))


_NO_SINKS = np.empty(0, np.float32)


def _sinks(sinks) -> np.ndarray:
    """float32[H] sink logits, or the empty array that stands for none."""
    if sinks is None:
        return _NO_SINKS
    return np.ascontiguousarray(sinks, dtype=np.float32)


def paged_attention_ref(q, k_cache, v_cache, block_tables, token_seq, positions, window, scale,
                        ggml_rounding, out, par, heads_per_item=1, sinks=None):
    """The per-token kernel (one token x nh heads per work item): the reference the tiled
    kernel must equal bit for bit, and a baseline for benchmarks/kernels.py."""
    return _ref_kernel(q, k_cache, v_cache, block_tables, token_seq, positions, window, scale,
                       ggml_rounding, out, par, heads_per_item, _sinks(sinks))


@njit(**_PJIT)
def _ref_kernel(q, k_cache, v_cache, block_tables, token_seq, positions, window, scale,
                ggml_rounding, out, par, heads_per_item, sinks):
    T, H = q.shape[0], q.shape[1]
    nh = heads_per_item
    items = T * (H // nh)
    if par:
        for it in prange(items):
            _attend_heads(q, k_cache, v_cache, block_tables, token_seq, positions, window,
                          scale, ggml_rounding, out, it // (H // nh), (it % (H // nh)) * nh, nh,
                          sinks)
    else:
        for it in range(items):
            _attend_heads(q, k_cache, v_cache, block_tables, token_seq, positions, window,
                          scale, ggml_rounding, out, it // (H // nh), (it % (H // nh)) * nh, nh,
                          sinks)
    return out


# -- the tiled kernel --------------------------------------------------------------------------

def _tree_sums(builder, vs, n=16):
    """16 <16 x float> -> one vector whose lane k is vhsum(vs[k]), each sum formed from
    exactly vhsum's additions (lane i + lane i + w for w = 8, 4, 2, 1), but for all sixteen
    at once: at each level two vectors' halves are shuffled side by side and added, so 16
    sums take 30 shuffles and 15 adds instead of 16 x (4 shuffles, 4 adds, an extract).
    n = 8: 8 <8 x float>, vhsum's levels 4, 2, 1 (_qk_4x2_h's halves already added)."""
    idx = ir.VectorType(_I32, n)
    width = n // 2
    while len(vs) > 1:
        G = 2 * width           # lanes per group: one source vector's partial sums
        lo = [g * G + i for g in range(n // G) for i in range(width)]
        hi = [g * G + width + i for g in range(n // G) for i in range(width)]
        lo, hi = lo + [n + x for x in lo], hi + [n + x for x in hi]
        vs = [builder.fadd(builder.shuffle_vector(a, b, ir.Constant(idx, lo)),
                           builder.shuffle_vector(a, b, ir.Constant(idx, hi)))
              for a, b in zip(vs[0::2], vs[1::2])]
        width //= 2
    return vs[0]


@intrinsic
def vhsum16(typingctx, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15):
    """Lane k: vhsum of the k-th argument, the same bits (see _tree_sums)."""
    def codegen(context, builder, sig, args):
        return _tree_sums(builder, list(args))
    return f16x(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15), codegen


def _store4(lane0: int):
    @intrinsic
    def store4(typingctx, arr, off, v):
        """Lanes lane0..lane0+3 of v at flat offset off of a float32 array."""
        def codegen(context, builder, sig, args):
            ary = context.make_array(sig.args[0])(context, builder, args[0])
            v4 = ir.VectorType(_F, 4)
            ptr = builder.bitcast(builder.gep(ary.data, [args[1]]), v4.as_pointer())
            lanes = builder.shuffle_vector(args[2], ir.Constant(_VF, ir.Undefined),
                                           ir.Constant(ir.VectorType(_I32, 4),
                                                       [lane0 + i for i in range(4)]))
            builder.store(lanes, ptr, align=4)
            return context.get_dummy_value()
        return types.none(arr, off, v), codegen
    return store4


vstore4_0, vstore4_1, vstore4_2, vstore4_3 = (_store4(4 * i) for i in range(4))


@intrinsic
def vhsum8(typingctx, a0, a1, a2, a3, a4, a5, a6, a7):
    """Lanes k and k + 8: vhsum of the k-th argument, the same bits (_tree_sums on the eight
    twice: LLVM folds the repeated half, which computes the same values)."""
    def codegen(context, builder, sig, args):
        return _tree_sums(builder, list(args) * 2)
    return f16x(a0, a1, a2, a3, a4, a5, a6, a7), codegen


@njit(inline="always", nogil=True)
def _qk_nx4(qv, r, n, kc, kb, j, D, sc, scale):
    """Scores of rows r..r+n-1 against keys j..j+3, n = 4 or 6 (a literal at each call, so
    the other rows' code folds away): an accumulator per (row, key), each widened K chunk
    feeding every row and each q chunk four keys, then vhsum16 (rows r..r+3) and vhsum8
    (r+4, r+5) reduce them with vhsum's tree. The bits of _qk_4x2 (the test compares them),
    about twice as fast. Six rows (24 accumulators: AVX-512's 32 registers only) read and
    widen a group of six heads' keys once (a Qwen2.5 1.5B token's, a decode token's group),
    not in a 4-row and a 2-row pass."""
    six = n == 6
    a00 = vzero()
    a01 = vzero()
    a02 = vzero()
    a03 = vzero()
    a10 = vzero()
    a11 = vzero()
    a12 = vzero()
    a13 = vzero()
    a20 = vzero()
    a21 = vzero()
    a22 = vzero()
    a23 = vzero()
    a30 = vzero()
    a31 = vzero()
    a32 = vzero()
    a33 = vzero()
    a40 = vzero()
    a41 = vzero()
    a42 = vzero()
    a43 = vzero()
    a50 = vzero()
    a51 = vzero()
    a52 = vzero()
    a53 = vzero()
    q0 = r * D
    k0, k1, k2, k3 = kb[j], kb[j + 1], kb[j + 2], kb[j + 3]
    for d in range(0, D, 16):
        y0 = vload(qv, q0 + d)
        y1 = vload(qv, q0 + 1 * D + d)
        y2 = vload(qv, q0 + 2 * D + d)
        y3 = vload(qv, q0 + 3 * D + d)
        y4 = vload(qv, q0 + 4 * D + d) if six else y0
        y5 = vload(qv, q0 + 5 * D + d) if six else y0
        x = kv_vec(kc, k0 + d)
        a00 = vfma(y0, x, a00)
        a10 = vfma(y1, x, a10)
        a20 = vfma(y2, x, a20)
        a30 = vfma(y3, x, a30)
        if six:
            a40 = vfma(y4, x, a40)
            a50 = vfma(y5, x, a50)
        x = kv_vec(kc, k1 + d)
        a01 = vfma(y0, x, a01)
        a11 = vfma(y1, x, a11)
        a21 = vfma(y2, x, a21)
        a31 = vfma(y3, x, a31)
        if six:
            a41 = vfma(y4, x, a41)
            a51 = vfma(y5, x, a51)
        x = kv_vec(kc, k2 + d)
        a02 = vfma(y0, x, a02)
        a12 = vfma(y1, x, a12)
        a22 = vfma(y2, x, a22)
        a32 = vfma(y3, x, a32)
        if six:
            a42 = vfma(y4, x, a42)
            a52 = vfma(y5, x, a52)
        x = kv_vec(kc, k3 + d)
        a03 = vfma(y0, x, a03)
        a13 = vfma(y1, x, a13)
        a23 = vfma(y2, x, a23)
        a33 = vfma(y3, x, a33)
        if six:
            a43 = vfma(y4, x, a43)
            a53 = vfma(y5, x, a53)
    s = vmul(vhsum16(a00, a01, a02, a03, a10, a11, a12, a13, a20, a21, a22, a23, a30, a31, a32, a33), vsplat(scale))
    W = sc.shape[1]
    o = r * W + j
    vstore4_0(sc, o, s)
    vstore4_1(sc, o + W, s)
    vstore4_2(sc, o + 2 * W, s)
    vstore4_3(sc, o + 3 * W, s)
    if six:
        t = vmul(vhsum8(a40, a41, a42, a43, a50, a51, a52, a53), vsplat(scale))
        vstore4_0(sc, o + 4 * W, t)
        vstore4_1(sc, o + 5 * W, t)

# AVX2 (16 ymm registers, 8 lanes): _qk_nx4's sixteen 16-lane accumulators are 32 registers
# there, and LLVM spilled them every step. _qk_4x2_h keeps each score's 16 partial sums as two
# 8-lane halves and runs the halves one after the other (8 accumulators, 4 q rows and a K
# chunk live at a time); the halves' sum is vhsum's first level (lane i + lane i + 8), the
# rest of its tree follows on 8 lanes: every score is the same operations, the same bits.
_SPLIT_HALVES = not WIDE_REGISTERS
_V8 = ir.VectorType(_F, 8)
_I32x8 = ir.VectorType(_I32, 8)


def _fma8(builder):
    """llvm.fma on 8 float lanes, declared in the builder's module."""
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V8, [_V8] * 3),
                                          "llvm.fma.v8f32")


def _v8_at(builder, base, off):
    """base + off (a float pointer and an element offset) as a pointer to 8 floats."""
    return builder.bitcast(builder.gep(base, [off]), _V8.as_pointer())


def _splat8(builder, x):
    """8 lanes of the float x."""
    undef = ir.Constant(_V8, ir.Undefined)
    return builder.shuffle_vector(builder.insert_element(undef, x, ir.Constant(_I32, 0)),
                                  undef, ir.Constant(_I32x8, [0] * 8))


@intrinsic
def _qk_4x2_h(typingctx, qv, q0, kc, k0, k1, D, sc, o, W, scale):
    """Scores of the four q rows at flat offset q0 (rows D apart) of qv against the float32 K
    rows at offsets k0 and k1 of kc, times scale, into sc at flat offsets o + i W (key k0)
    and o + i W + 1 (key k1), rows i = 0..3: _qk_4x2's bits with k1 = k0 + 1."""
    def codegen(context, builder, sig, args):
        qa, q0_, ka, k0_, k1_, D_, sa, o_, W_, sc_ = args
        i64 = ir.IntType(64)
        fma = _fma8(builder)
        qp = context.make_array(sig.args[0])(context, builder, qa).data
        kp = context.make_array(sig.args[2])(context, builder, ka).data
        sp = context.make_array(sig.args[6])(context, builder, sa).data

        def at(base, off):
            return _v8_at(builder, base, off)

        zero = ir.Constant(_V8, None)
        halves = []
        for h in range(2):               # lanes 0-7 of every 16-column chunk, then 8-15
            entry = builder.basic_block
            loop = builder.append_basic_block(f"qk_half{h}")
            done = builder.append_basic_block(f"qk_half{h}_done")
            builder.branch(loop)
            builder.position_at_end(loop)
            d = builder.phi(i64)
            d.add_incoming(ir.Constant(i64, 0), entry)
            accs = []
            for _ in range(8):
                phi = builder.phi(_V8)
                phi.add_incoming(zero, entry)
                accs.append(phi)
            dh = builder.add(d, ir.Constant(i64, 8 * h))
            x0 = builder.load(at(kp, builder.add(k0_, dh)), align=4)
            x1 = builder.load(at(kp, builder.add(k1_, dh)), align=4)
            new = []
            for i in range(4):
                qo = builder.add(builder.add(q0_, builder.mul(D_, ir.Constant(i64, i))), dh)
                y = builder.load(at(qp, qo), align=4)
                new.append(builder.call(fma, [y, x0, accs[2 * i]]))
                new.append(builder.call(fma, [y, x1, accs[2 * i + 1]]))
            d_next = builder.add(d, ir.Constant(i64, 16))
            tail = builder.basic_block
            d.add_incoming(d_next, tail)
            for phi, v in zip(accs, new):
                phi.add_incoming(v, tail)
            builder.cbranch(builder.icmp_signed("<", d_next, D_), loop, done)
            builder.position_at_end(done)
            halves.append(new)
        pairs = [builder.fadd(a, b) for a, b in zip(*halves)]    # vhsum's level 8
        s = builder.fmul(_tree_sums(builder, pairs, 8),     # its levels 4, 2, 1
                         _splat8(builder, sc_))
        for i in range(4):            # lanes 2i, 2i+1: row i against k0, k1
            for k in range(2):
                off = builder.add(o_, builder.add(builder.mul(W_, ir.Constant(i64, i)),
                                                  ir.Constant(i64, k)))
                builder.store(builder.extract_element(s, ir.Constant(_I32, 2 * i + k)),
                              builder.gep(sp, [off]))
        return context.get_dummy_value()
    sig = types.void(qv, types.intp, kc, types.intp, types.intp, types.intp, sc, types.intp,
                     types.intp, types.float32)
    return sig, codegen


@intrinsic
def _qk_t8(typingctx, qv, q0, q1, wt, b0, b1, D, sc, o0, o1, ob1, scale):
    """Scores of two q rows, at flat offsets q0 and q1 of qv, against two blocks of eight
    keys, transposed, at flat offsets b0 and b1 of wt (value d of key i at b0 + 8 d + i:
    _transpose8), times scale: row 0's into sc at flat offsets o0 .. o0 + 7 (block 0) and
    o0 + ob1 .. (block 1), row 1's from o1 likewise. D (a multiple of 16) is a literal. A
    lone row or block is passed twice (q1 = q0 and o1 = o0; b1 = b0 and ob1 = 0): the same
    values are stored twice in the same place.

    AVX2 (_SPLIT_HALVES): the keys are the lanes. A score's partial sum l (l = 0..15) is
    q[l] k[l] + q[16 + l] k[16 + l] + ... by FMA from 0, as in _qk_4x2's lane l, and vhsum's
    tree over l (l + 8, then + 4, + 2, + 1) becomes adds between whole vectors: no
    shuffles, no horizontal sums, one store per row and block, and the same operations for
    every score as _qk_4x2's, so the same bits. Each K vector feeds both rows and each q
    value both blocks."""
    if not isinstance(D, types.IntegerLiteral):
        return None
    dim = D.literal_value

    def codegen(context, builder, sig, args):
        qa, q0_, q1_, wa, b0_, b1_, _D, sa, o0_, o1_, ob1_, sc_ = args
        i64 = ir.IntType(64)
        fma = _fma8(builder)
        qp = context.make_array(sig.args[0])(context, builder, qa).data
        wp = context.make_array(sig.args[3])(context, builder, wa).data
        sp = context.make_array(sig.args[7])(context, builder, sa).data
        rows, blocks = (q0_, q1_), (b0_, b1_)

        def splat(x):
            return _splat8(builder, x)

        def at(base, off):
            return _v8_at(builder, base, off)

        def pair(l):
            """p_l + p_(l+8) of each (row, block): vhsum's first level, after both chains."""
            accs = {}
            for s in range(0, dim, 16):
                for h in (l, l + 8):
                    xs = [builder.load(at(wp, builder.add(b, ir.Constant(i64, 8 * (s + h)))),
                                       align=4) for b in blocks]
                    for r, q in enumerate(rows):
                        y = splat(builder.load(builder.gep(qp, [builder.add(q, ir.Constant(i64, s + h))])))
                        for k, x in enumerate(xs):
                            acc = accs.get((r, k, h), ir.Constant(_V8, None))
                            accs[(r, k, h)] = builder.call(fma, [y, x, acc])
            return {(r, k): builder.fadd(accs[(r, k, l)], accs[(r, k, l + 8)])
                    for r in range(2) for k in range(2)}

        def add(a, b):
            return {rk: builder.fadd(a[rk], b[rk]) for rk in a}

        # ((u0 + u4) + (u2 + u6)) + ((u1 + u5) + (u3 + u7)), u_l = p_l + p_(l+8): vhsum's
        # levels 4, 2, 1, in an order that keeps few partial sums live
        w0 = add(add(pair(0), pair(4)), add(pair(2), pair(6)))
        w1 = add(add(pair(1), pair(5)), add(pair(3), pair(7)))
        s = add(w0, w1)
        scv = splat(sc_)
        for (r, k), v in s.items():
            off = (o0_, o1_)[r]
            builder.store(builder.fmul(v, scv), at(sp, builder.add(off, ob1_) if k else off),
                          align=4)
        return context.get_dummy_value()
    sig = types.void(qv, types.intp, types.intp, wt, types.intp, types.intp, D, sc,
                     types.intp, types.intp, types.intp, types.float32)
    return sig, codegen


@njit(inline="always", nogil=True)
def _transpose8(wf, n, D, wt):
    """The n widened rows of wf (row i at i D) in blocks of eight keys, keys in the lanes:
    value d of row i at ((i // 8) D + d) 8 + i % 8 (_qk_t8's layout); a last block's
    missing keys are 0."""
    for b in range((n + 7) // 8):
        for i in range(8):
            j = 8 * b + i
            base = 8 * b * D + i
            if j < n:
                for d in range(D):
                    wt[base + 8 * d] = wf[j * D + d]
            else:
                for d in range(D):
                    wt[base + 8 * d] = 0.0


@njit(nogil=True, cache=_CACHE, fastmath=False)
def _scores_t(qv, R, nh, t0, positions, window, lo, wt, D, sc, scale, j0, j1):
    """_scores over keys j0..j1 from their transposed blocks (_transpose8 of the rows of key
    j0 onwards), by _qk_t8: rows in pairs, keys in pairs of 8-key blocks from j0. A
    block may write scores of keys outside a row's range (up to 15 either side, within the
    chunk or sc's 16 spare columns at the end, which the softmax overwrites); the softmax
    never reads them."""
    W = sc.shape[1]
    r = 0
    scale = np.float32(scale)
    while r < R:
        rows = 2 if R - r >= 2 else 1
        jlo = max(j0, _window_start(positions[t0 + r // nh], window) - lo)
        jhi = min(j1, positions[t0 + (r + rows - 1) // nh] - lo)
        r1 = r + rows - 1                   # a lone last row: row r twice
        j = j0 + (jlo - j0) // 8 * 8
        while j <= jhi:
            b0 = (j - j0) * D
            b1, ob1 = (b0 + 8 * D, 8) if j + 8 <= jhi else (b0, 0)    # or block j twice
            if D == 64:
                _qk_t8(qv, r * D, r1 * D, wt, b0, b1, 64, sc, r * W + j, r1 * W + j, ob1, scale)
            elif D == 128:
                _qk_t8(qv, r * D, r1 * D, wt, b0, b1, 128, sc, r * W + j, r1 * W + j, ob1, scale)
            else:
                _qk_t8(qv, r * D, r1 * D, wt, b0, b1, 256, sc, r * W + j, r1 * W + j, ob1, scale)
            j += 8 + ob1
        r += rows


@njit(inline="always", nogil=True)
def _qk_4x2(qv, r, kc, kb, j0, j1, D, sc, scale):
    """Scores of rows r..r+3 against keys j0 and j1 (j1 may equal j0)."""
    a0 = vzero()
    a1 = vzero()
    a2 = vzero()
    a3 = vzero()
    b0 = vzero()
    b1 = vzero()
    b2 = vzero()
    b3 = vzero()
    q0 = r * D
    k0 = kb[j0]
    k1 = kb[j1]
    for d in range(0, D, 16):
        x0 = kv_vec(kc, k0 + d)
        x1 = kv_vec(kc, k1 + d)
        y = vload(qv, q0 + d)
        a0 = vfma(y, x0, a0)
        b0 = vfma(y, x1, b0)
        y = vload(qv, q0 + D + d)
        a1 = vfma(y, x0, a1)
        b1 = vfma(y, x1, b1)
        y = vload(qv, q0 + 2 * D + d)
        a2 = vfma(y, x0, a2)
        b2 = vfma(y, x1, b2)
        y = vload(qv, q0 + 3 * D + d)
        a3 = vfma(y, x0, a3)
        b3 = vfma(y, x1, b3)
    sc[r, j0] = vhsum(a0) * scale
    sc[r + 1, j0] = vhsum(a1) * scale
    sc[r + 2, j0] = vhsum(a2) * scale
    sc[r + 3, j0] = vhsum(a3) * scale
    sc[r, j1] = vhsum(b0) * scale
    sc[r + 1, j1] = vhsum(b1) * scale
    sc[r + 2, j1] = vhsum(b2) * scale
    sc[r + 3, j1] = vhsum(b3) * scale


@njit(inline="always", nogil=True)
def _qk_2x2(qv, r, kc, kb, j0, j1, D, sc, scale):
    """Scores of rows r, r+1 against keys j0 and j1 (j1 may equal j0)."""
    a0 = vzero()
    a1 = vzero()
    b0 = vzero()
    b1 = vzero()
    q0 = r * D
    k0 = kb[j0]
    k1 = kb[j1]
    for d in range(0, D, 16):
        x0 = kv_vec(kc, k0 + d)
        x1 = kv_vec(kc, k1 + d)
        y = vload(qv, q0 + d)
        a0 = vfma(y, x0, a0)
        b0 = vfma(y, x1, b0)
        y = vload(qv, q0 + D + d)
        a1 = vfma(y, x0, a1)
        b1 = vfma(y, x1, b1)
    sc[r, j0] = vhsum(a0) * scale
    sc[r + 1, j0] = vhsum(a1) * scale
    sc[r, j1] = vhsum(b0) * scale
    sc[r + 1, j1] = vhsum(b1) * scale


@njit(inline="always", nogil=True)
def _qk_1x2(qv, r, kc, kb, j0, j1, D, sc, scale):
    """Scores of row r against keys j0 and j1 (j1 may equal j0)."""
    a0 = vzero()
    b0 = vzero()
    q0 = r * D
    k0 = kb[j0]
    k1 = kb[j1]
    for d in range(0, D, 16):
        y = vload(qv, q0 + d)
        a0 = vfma(y, kv_vec(kc, k0 + d), a0)
        b0 = vfma(y, kv_vec(kc, k1 + d), b0)
    sc[r, j0] = vhsum(a0) * scale
    sc[r, j1] = vhsum(b0) * scale


def f16_pool(arr):
    """Whether a K/V pool holds halves (compile-time: its dtype)."""


@overload(f16_pool, inline="always")
def _f16_pool(arr):
    is_f16 = arr.dtype == types.uint16
    return lambda arr: is_f16


def f32_rows(arr):
    """Whether an array holds float32 (compile-time: its dtype)."""


@overload(f32_rows, inline="always")
def _f32_rows(arr):
    is_f32 = arr.dtype == types.float32
    return lambda arr: is_f32


@njit(inline="always", nogil=True)
def _wadd(a, w, x, exact):
    """a + w * x. With `exact` (w and x both halves: f16-rounded weights, an f16 pool) the
    product is exact in float32 (11 x 11 significand bits), so one FMA gives the bits of the
    multiply and the add, at half the instructions. `exact` is a literal at every call."""
    if exact:
        return vfma(w, x, a)
    return vadd(a, vmul(w, x))


@njit(inline="always", nogil=True)
def _pv_nx4(sc, r, n, vc, kb, jlo, jhi, c, out, o0, D, first, exact):
    """Output columns c..c+63 of rows r..r+n-1, n = 4 or 6 (a literal at each call, so the
    other rows' code folds away), which share their keys jlo..jhi: the weighted sum of V in
    key order, held in 4n registers (six rows: AVX-512 only, each V chunk widened once for a
    group of six heads, see _qk_nx4); stored at flat offsets o0 + row * D."""
    six = n == 6
    v00 = vzero() if first else vload(out, o0 + c)
    v01 = vzero() if first else vload(out, o0 + c + 16)
    v02 = vzero() if first else vload(out, o0 + c + 32)
    v03 = vzero() if first else vload(out, o0 + c + 48)
    v10 = vzero() if first else vload(out, o0 + c + 1 * D + 0)
    v11 = vzero() if first else vload(out, o0 + c + 1 * D + 16)
    v12 = vzero() if first else vload(out, o0 + c + 1 * D + 32)
    v13 = vzero() if first else vload(out, o0 + c + 1 * D + 48)
    v20 = vzero() if first else vload(out, o0 + c + 2 * D + 0)
    v21 = vzero() if first else vload(out, o0 + c + 2 * D + 16)
    v22 = vzero() if first else vload(out, o0 + c + 2 * D + 32)
    v23 = vzero() if first else vload(out, o0 + c + 2 * D + 48)
    v30 = vzero() if first else vload(out, o0 + c + 3 * D + 0)
    v31 = vzero() if first else vload(out, o0 + c + 3 * D + 16)
    v32 = vzero() if first else vload(out, o0 + c + 3 * D + 32)
    v33 = vzero() if first else vload(out, o0 + c + 3 * D + 48)
    v40 = vzero() if first or not six else vload(out, o0 + c + 4 * D + 0)
    v41 = vzero() if first or not six else vload(out, o0 + c + 4 * D + 16)
    v42 = vzero() if first or not six else vload(out, o0 + c + 4 * D + 32)
    v43 = vzero() if first or not six else vload(out, o0 + c + 4 * D + 48)
    v50 = vzero() if first or not six else vload(out, o0 + c + 5 * D + 0)
    v51 = vzero() if first or not six else vload(out, o0 + c + 5 * D + 16)
    v52 = vzero() if first or not six else vload(out, o0 + c + 5 * D + 32)
    v53 = vzero() if first or not six else vload(out, o0 + c + 5 * D + 48)
    for j in range(jlo, jhi + 1):
        base = kb[j] + c
        x0 = kv_vec(vc, base)
        x1 = kv_vec(vc, base + 16)
        x2 = kv_vec(vc, base + 32)
        x3 = kv_vec(vc, base + 48)
        w = vsplat(sc[r, j])
        v00 = _wadd(v00, w, x0, exact)
        v01 = _wadd(v01, w, x1, exact)
        v02 = _wadd(v02, w, x2, exact)
        v03 = _wadd(v03, w, x3, exact)
        w = vsplat(sc[r + 1, j])
        v10 = _wadd(v10, w, x0, exact)
        v11 = _wadd(v11, w, x1, exact)
        v12 = _wadd(v12, w, x2, exact)
        v13 = _wadd(v13, w, x3, exact)
        w = vsplat(sc[r + 2, j])
        v20 = _wadd(v20, w, x0, exact)
        v21 = _wadd(v21, w, x1, exact)
        v22 = _wadd(v22, w, x2, exact)
        v23 = _wadd(v23, w, x3, exact)
        w = vsplat(sc[r + 3, j])
        v30 = _wadd(v30, w, x0, exact)
        v31 = _wadd(v31, w, x1, exact)
        v32 = _wadd(v32, w, x2, exact)
        v33 = _wadd(v33, w, x3, exact)
        if six:
            w = vsplat(sc[r + 4, j])
            v40 = _wadd(v40, w, x0, exact)
            v41 = _wadd(v41, w, x1, exact)
            v42 = _wadd(v42, w, x2, exact)
            v43 = _wadd(v43, w, x3, exact)
            w = vsplat(sc[r + 5, j])
            v50 = _wadd(v50, w, x0, exact)
            v51 = _wadd(v51, w, x1, exact)
            v52 = _wadd(v52, w, x2, exact)
            v53 = _wadd(v53, w, x3, exact)
    o = o0 + c
    vstore(out, o, v00)
    vstore(out, o + 16, v01)
    vstore(out, o + 32, v02)
    vstore(out, o + 48, v03)
    o += D
    vstore(out, o, v10)
    vstore(out, o + 16, v11)
    vstore(out, o + 32, v12)
    vstore(out, o + 48, v13)
    o += D
    vstore(out, o, v20)
    vstore(out, o + 16, v21)
    vstore(out, o + 32, v22)
    vstore(out, o + 48, v23)
    o += D
    vstore(out, o, v30)
    vstore(out, o + 16, v31)
    vstore(out, o + 32, v32)
    vstore(out, o + 48, v33)
    if six:
        o += D
        vstore(out, o, v40)
        vstore(out, o + 16, v41)
        vstore(out, o + 32, v42)
        vstore(out, o + 48, v43)
        o += D
        vstore(out, o, v50)
        vstore(out, o + 16, v51)
        vstore(out, o + 32, v52)
        vstore(out, o + 48, v53)

@njit(inline="always", nogil=True)
def _pv_2x4(sc, r, vc, kb, jlo, jhi, c, out, o0, D, first, exact):
    """Output columns c..c+63 of rows r, r+1 (see _pv_nx4)."""
    a0 = vzero() if first else vload(out, o0 + c)
    a1 = vzero() if first else vload(out, o0 + c + 16)
    a2 = vzero() if first else vload(out, o0 + c + 32)
    a3 = vzero() if first else vload(out, o0 + c + 48)
    b0 = vzero() if first else vload(out, o0 + c + 1 * D)
    b1 = vzero() if first else vload(out, o0 + c + 1 * D + 16)
    b2 = vzero() if first else vload(out, o0 + c + 1 * D + 32)
    b3 = vzero() if first else vload(out, o0 + c + 1 * D + 48)
    for j in range(jlo, jhi + 1):
        base = kb[j] + c
        x0 = kv_vec(vc, base)
        x1 = kv_vec(vc, base + 16)
        x2 = kv_vec(vc, base + 32)
        x3 = kv_vec(vc, base + 48)
        w = vsplat(sc[r, j])
        a0 = _wadd(a0, w, x0, exact)
        a1 = _wadd(a1, w, x1, exact)
        a2 = _wadd(a2, w, x2, exact)
        a3 = _wadd(a3, w, x3, exact)
        w = vsplat(sc[r + 1, j])
        b0 = _wadd(b0, w, x0, exact)
        b1 = _wadd(b1, w, x1, exact)
        b2 = _wadd(b2, w, x2, exact)
        b3 = _wadd(b3, w, x3, exact)
    o = o0 + c
    vstore(out, o, a0)
    vstore(out, o + 16, a1)
    vstore(out, o + 32, a2)
    vstore(out, o + 48, a3)
    o += D
    vstore(out, o, b0)
    vstore(out, o + 16, b1)
    vstore(out, o + 32, b2)
    vstore(out, o + 48, b3)


@njit(inline="always", nogil=True)
def _pv_1x4(sc, r, vc, kb, jlo, jhi, c, out, o0, first, exact):
    """Output columns c..c+63 of row r (see _pv_nx4)."""
    a0 = vzero() if first else vload(out, o0 + c)
    a1 = vzero() if first else vload(out, o0 + c + 16)
    a2 = vzero() if first else vload(out, o0 + c + 32)
    a3 = vzero() if first else vload(out, o0 + c + 48)
    for j in range(jlo, jhi + 1):
        base = kb[j] + c
        w = vsplat(sc[r, j])
        a0 = _wadd(a0, w, kv_vec(vc, base), exact)
        a1 = _wadd(a1, w, kv_vec(vc, base + 16), exact)
        a2 = _wadd(a2, w, kv_vec(vc, base + 32), exact)
        a3 = _wadd(a3, w, kv_vec(vc, base + 48), exact)
    o = o0 + c
    vstore(out, o, a0)
    vstore(out, o + 16, a1)
    vstore(out, o + 32, a2)
    vstore(out, o + 48, a3)


@njit(inline="always", nogil=True)
def _pv_nx1(sc, r, n, vc, kb, jlo, jhi, c, out, o0, D, first, exact):
    """Output columns c..c+15 of rows r..r+n-1, n = 4 or 6 (a constant at each call, so
    the other rows' code folds away): _pv_nx4's sums for one 16-column group. On AVX2
    (_SPLIT_HALVES) _pv_nx4's sixteen 16-lane accumulators are 32 ymm registers of 16;
    these are 2n: six rows make twelve independent FMA chains over the keys (four rows'
    eight just cover the FMA latency), and each V chunk feeds every row. Each column adds
    its keys in the same order: the same bits."""
    six = n == 6
    a = vzero() if first else vload(out, o0 + c)
    b = vzero() if first else vload(out, o0 + c + D)
    e = vzero() if first else vload(out, o0 + c + 2 * D)
    f = vzero() if first else vload(out, o0 + c + 3 * D)
    g = vzero() if first or not six else vload(out, o0 + c + 4 * D)
    h = vzero() if first or not six else vload(out, o0 + c + 5 * D)
    for j in range(jlo, jhi + 1):
        x = kv_vec(vc, kb[j] + c)
        a = _wadd(a, vsplat(sc[r, j]), x, exact)
        b = _wadd(b, vsplat(sc[r + 1, j]), x, exact)
        e = _wadd(e, vsplat(sc[r + 2, j]), x, exact)
        f = _wadd(f, vsplat(sc[r + 3, j]), x, exact)
        if six:
            g = _wadd(g, vsplat(sc[r + 4, j]), x, exact)
            h = _wadd(h, vsplat(sc[r + 5, j]), x, exact)
    vstore(out, o0 + c, a)
    vstore(out, o0 + c + D, b)
    vstore(out, o0 + c + 2 * D, e)
    vstore(out, o0 + c + 3 * D, f)
    if six:
        vstore(out, o0 + c + 4 * D, g)
        vstore(out, o0 + c + 5 * D, h)


@njit(inline="always", nogil=True)
def _pv_1x1(sc, r, vc, kb, jlo, jhi, c, out, o0, first, exact):
    """Output columns c..c+15 of row r (the last columns when D is not a multiple of 64)."""
    a0 = vzero() if first else vload(out, o0 + c)
    for j in range(jlo, jhi + 1):
        a0 = _wadd(a0, vsplat(sc[r, j]), kv_vec(vc, kb[j] + c), exact)
    vstore(out, o0 + c, a0)


@njit(inline="always", nogil=True)
def _key_bases(block_tables, s, lo, hi, bs, KVH, kvh, D, kb):
    """kb[j] = flat offset of position lo + j's K (and V) row of KV head kvh, j <= hi - lo:
    one block-table lookup per block."""
    p = lo
    j = 0
    while p <= hi:
        b = p // bs
        base = block_tables[s, b] * bs - b * bs
        e = min(hi, (b + 1) * bs - 1)
        for pp in range(p, e + 1):
            kb[j] = ((base + pp) * KVH + kvh) * D
            j += 1
        p = e + 1


@njit(inline="always", nogil=True)
def _load_q(q, t0, h0, nh, R, ggml_rounding, qv):
    D = q.shape[2]
    for r in range(R):
        t = t0 + r // nh
        h = h0 + r % nh
        for d in range(D):
            x = q[t, h, d]
            qv[r, d] = round_f16(x) if ggml_rounding else x


# _scores and _vsums are functions of their own, not inlined: _tile calls each with the pool
# and with the widened rows, and inlining all four bodies made _tile's compile 10x longer.
@njit(nogil=True, cache=_CACHE, fastmath=False)
def _scores(qv, R, nh, t0, positions, window, lo, kc, kb, D, sc, scale, jmin, jmax):
    """Scores of rows 0..R-1 (row r: token t0 + r // nh), over the keys of the rows' tokens
    together (a row's own are a subrange), limited to keys jmin..jmax."""
    r = 0
    while r < R:
        rows = 4 if R - r >= 4 else (2 if R - r >= 2 else 1)
        if not _SPLIT_HALVES and R - r >= 6:
            rows = 6                        # _qk_nx4's six (AVX-512's 32 registers)
        jlo = max(jmin, _window_start(positions[t0 + r // nh], window) - lo)
        jhi = min(jmax, positions[t0 + (r + rows - 1) // nh] - lo)
        j = jlo
        if rows == 4 and D % 16 == 0 and _SPLIT_HALVES and f32_rows(kc):
            W = sc.shape[1]
            while j + 1 <= jhi:             # two keys at a time in 8-lane halves (AVX2)
                if j + PREFETCH + 1 <= jhi:
                    kv_row_prefetch(kc, kb[j + PREFETCH], D)
                    kv_row_prefetch(kc, kb[j + PREFETCH + 1], D)
                _qk_4x2_h(qv, r * D, kc, kb[j], kb[j + 1], D, sc, r * W + j, W, np.float32(scale))
                j += 2
        if (rows == 4 or rows == 6) and D % 16 == 0:      # four keys at a time, the rest below
            while j + 3 <= jhi:
                if j + PREFETCH + 3 <= jhi:
                    for i in range(4):
                        kv_row_prefetch(kc, kb[j + PREFETCH + i], D)
                if rows == 6:
                    _qk_nx4(qv, r, 6, kc, kb, j, D, sc, scale)
                else:
                    _qk_nx4(qv, r, 4, kc, kb, j, D, sc, scale)
                j += 4
        for j in range(j, jhi + 1, 2):
            j1 = j + 1 if j < jhi else j
            if j + PREFETCH + 1 <= jhi:
                kv_row_prefetch(kc, kb[j + PREFETCH], D)
                kv_row_prefetch(kc, kb[j + PREFETCH + 1], D)
            if rows == 6:
                _qk_4x2(qv, r, kc, kb, j, j1, D, sc, scale)
                _qk_2x2(qv, r + 4, kc, kb, j, j1, D, sc, scale)
            elif rows == 4:
                _qk_4x2(qv, r, kc, kb, j, j1, D, sc, scale)
            elif rows == 2:
                _qk_2x2(qv, r, kc, kb, j, j1, D, sc, scale)
            else:
                _qk_1x2(qv, r, kc, kb, j, j1, D, sc, scale)
        r += rows


@njit(nogil=True, cache=_CACHE, fastmath=False)
def _vsums(sc, r0, n, vc, kb, jlo, jhi, c0, c1, out, o0, D, exact, fresh):
    """_vsums_of with `exact` (the weights and the pool's V are halves: _wadd) as a literal,
    so each copy of the loops has one kind of add."""
    if exact:
        _vsums_of(sc, r0, n, vc, kb, jlo, jhi, c0, c1, out, o0, D, True, fresh)
    else:
        _vsums_of(sc, r0, n, vc, kb, jlo, jhi, c0, c1, out, o0, D, False, fresh)


@njit(inline="always", nogil=True)
def _vsums_of(sc, r0, n, vc, kb, jlo, jhi, c0, c1, out, o0, D, exact, fresh):
    """Output columns c0..c1-1 (c0 a multiple of 64) of rows r0..r0+n-1, which share the
    keys jlo..jhi; row r0 + i is stored at flat offset o0 + i * D. Keys go in blocks of
    VBLOCK (their V rows stay in L1 across the column groups); between blocks the partial
    sums wait in `out`, which changes no rounding: each column still adds its keys in order.
    fresh: jlo is the rows' first key (else their sums so far are in `out`)."""
    i = 0
    while i < n:
        r = r0 + i
        o = o0 + i * D
        rows = 4 if n - i >= 4 else (2 if n - i >= 2 else 1)
        if n - i >= 6:
            rows = 6
        for jb in range(jlo, jhi + 1, VBLOCK):
            je = min(jhi, jb + VBLOCK - 1)
            first = fresh and jb == jlo
            if c0 == 0 and i == 0:
                for j in range(je + 1, min(jhi, je + VBLOCK) + 1):
                    kv_row_prefetch(vc, kb[j], D)
            c = c0
            while c + 64 <= c1:
                if rows == 6 and not _SPLIT_HALVES:
                    _pv_nx4(sc, r, 6, vc, kb, jb, je, c, out, o, D, first, exact)
                elif rows == 6:
                    for cc in range(c, c + 64, 16):
                        _pv_nx1(sc, r, 6, vc, kb, jb, je, cc, out, o, D, first, exact)
                elif rows == 4 and _SPLIT_HALVES:
                    for cc in range(c, c + 64, 16):
                        _pv_nx1(sc, r, 4, vc, kb, jb, je, cc, out, o, D, first, exact)
                elif rows == 4:
                    _pv_nx4(sc, r, 4, vc, kb, jb, je, c, out, o, D, first, exact)
                elif rows == 2:
                    _pv_2x4(sc, r, vc, kb, jb, je, c, out, o, D, first, exact)
                else:
                    _pv_1x4(sc, r, vc, kb, jb, je, c, out, o, first, exact)
                c += 64
            for k in range(rows):
                for cc in range(c, c1, 16):
                    _pv_1x1(sc, r + k, vc, kb, jb, je, cc, out, o + k * D, first, exact)
        i += rows


@njit(inline="always", nogil=True)
def _widen(cache, kb, j0, j1, D, wf, kw):
    """Keys j0..j1's rows of a K or V pool into wf as float32, one after another (kw[j]: a
    row's offset there). kv_vec's values are exact in float32, so the kernels compute the
    same bits from wf, without widening each row again for every four query rows."""
    for j in range(j0, j1 + 1):
        kw[j] = (j - j0) * D
        for d in range(0, D, 16):
            vstore(wf, kw[j] + d, kv_vec(cache, kb[j] + d))


@njit(nogil=True, cache=_CACHE, fastmath=False)
def _tile(q, kc, vc, block_tables, token_seq, positions, window, scale, ggml_rounding, out,
          t0, nt, h0, nh, qv, sc, kb, sinks, wf, kw):
    """Tokens t0..t0+nt-1 (consecutive positions of one sequence) x heads h0..h0+nh-1 (one
    KV head). qv, sc, kb, kw: scratch of at least nt*nh x D, nt*nh x (keys + 16), keys,
    keys; wf: _wide_floats (or fewer: then K and V are read from the pool)."""
    T, H, D = q.shape
    KVH = kc.shape[2]
    lo = _window_start(positions[t0], window)
    hi = positions[t0 + nt - 1]
    _key_bases(block_tables, token_seq[t0], lo, hi, kc.shape[1], KVH, h0 // (H // KVH), D, kb)
    R = nt * nh
    _load_q(q, t0, h0, nh, R, ggml_rounding, qv)
    exact = ggml_rounding and f16_pool(vc)
    # Many rows: K and V widened to float32 once, wide_keys(D) keys at a time, instead of per
    # four rows (a third of the vector work at 2K keys); a few rows read the pool directly.
    WK = wide_keys(D)
    wide = R >= WIDE_MIN_ROWS and wf.shape[0] >= WK * D
    # AVX2: scores with the keys in the lanes (_qk_t8), from a transposed copy of each
    # widened chunk at wf's end (_wide_floats leaves room for it past the output rows)
    keys_in_lanes = wide and _SPLIT_HALVES and (D == 64 or D == 128 or D == 256) and \
        wf.shape[0] >= (2 * WK + R) * D
    wt = wf[wf.shape[0] - WK * D:]
    nk = hi - lo + 1
    # 1. scores
    if wide:
        for j0 in range(0, nk, WK):
            j1 = min(nk, j0 + WK) - 1
            _widen(kc, kb, j0, j1, D, wf, kw)
            if keys_in_lanes:
                _transpose8(wf, j1 - j0 + 1, D, wt)
                _scores_t(qv, R, nh, t0, positions, window, lo, wt, D, sc, scale, j0, j1)
            else:
                _scores(qv, R, nh, t0, positions, window, lo, wf, kw, D, sc, scale, j0, j1)
    else:
        _scores(qv, R, nh, t0, positions, window, lo, kc, kb, D, sc, scale, 0, hi - lo)
    # 2. softmax of each row over its own keys
    for r in range(R):
        pos = positions[t0 + r // nh]
        _softmax_row(sc, r, _window_start(pos, window) - lo, pos - lo, ggml_rounding,
                     _sink(sinks, h0 + r % nh))
    # 3. weighted V sums, per token (its heads share the keys)
    if wide and _window_start(positions[t0 + nt - 1], window) == lo and \
            wf.shape[0] >= (WK + R) * D:
        # every token's keys start at key 0: the keys all tokens see (up to the first
        # token's position) go through all R rows in 4-row blocks at once, into ob (rows
        # in sc's order), then each token's own last keys; each row still adds its keys in
        # order, so the bits are those of the per-token sums below
        ob = wf[WK * D:]
        shared = positions[t0] - lo
        for j0 in range(0, nk, WK):
            j1 = min(nk, j0 + WK) - 1
            _widen(vc, kb, j0, j1, D, wf, kw)
            if j0 <= shared:
                _vsums(sc, 0, R, wf, kw, j0, min(shared, j1), 0, D, ob, 0, D, exact, j0 == 0)
            for ti in range(nt):
                a, b = max(j0, shared + 1), min(positions[t0 + ti] - lo, j1)
                if a <= b:
                    _vsums(sc, ti * nh, nh, wf, kw, a, b, 0, D, ob, ti * nh * D, D, exact,
                           False)
        for r in range(R):
            for d in range(D):
                out[t0 + r // nh, h0 + r % nh, d] = ob[r * D + d]
    elif wide:
        for j0 in range(0, nk, WK):
            j1 = min(nk, j0 + WK) - 1
            _widen(vc, kb, j0, j1, D, wf, kw)
            for ti in range(nt):
                t = t0 + ti
                pos = positions[t]
                jlo = _window_start(pos, window) - lo
                a, b = max(jlo, j0), min(pos - lo, j1)
                if a <= b:
                    _vsums(sc, ti * nh, nh, wf, kw, a, b, 0, D, out, (t * H + h0) * D, D,
                           exact, a == jlo)
    else:
        for ti in range(nt):
            t = t0 + ti
            pos = positions[t]
            _vsums(sc, ti * nh, nh, vc, kb, _window_start(pos, window) - lo, pos - lo, 0, D,
                   out, (t * H + h0) * D, D, exact, True)


def _run_split(q, kc, vc, block_tables, token_seq, positions, window, scale, ggml_rounding,
               out, parts, sinks=None):
    return _split_kernel(q, kc, vc, block_tables, token_seq, positions, window, scale,
                         ggml_rounding, out, parts, _sinks(sinks))


@njit(**_PJIT)
def _split_kernel(q, kc, vc, block_tables, token_seq, positions, window, scale, ggml_rounding,
                  out, parts, sinks):
    """A few tokens on many threads (a lone decode token): each token x KV head is one tile
    of all the head's query heads, and the threads split its work instead of taking whole
    tiles: the scores by ranges of keys, the V sums by 64-column groups (the softmax between
    them runs on the calling thread).
    Every thread reads its share of K and V (not all of it, as whole tiles on each would).
    Each number comes from the same operations as in _tile: the same bits."""
    T, H, D = q.shape
    KVH = kc.shape[2]
    G = H // KVH
    max_keys = 1
    for t in range(T):
        max_keys = max(max_keys, positions[t] - _window_start(positions[t], window) + 1)
    qv = np.empty((G, D), np.float32)
    sc = np.empty((G, max_keys + 16), np.float32)
    kb = np.empty(max_keys, np.int64)
    groups = (D + 63) // 64
    for t in range(T):
        pos = positions[t]
        lo = _window_start(pos, window)
        n = pos - lo + 1
        step = ((n + parts - 1) // parts + 1) // 2 * 2
        for g in range(KVH):
            _key_bases(block_tables, token_seq[t], lo, pos, kc.shape[1], KVH, g, D, kb)
            _load_q(q, t, g * G, G, G, ggml_rounding, qv)
            for p in prange(parts):
                _scores(qv, G, G, t, positions, window, lo, kc, kb, D, sc, scale, p * step,
                        min(n, (p + 1) * step) - 1)
            for r in range(G):          # on the calling thread: one region fewer to wait for
                _softmax_row(sc, r, 0, n - 1, ggml_rounding, _sink(sinks, g * G + r))
            for c in prange(groups):
                _vsums(sc, 0, G, vc, kb, 0, n - 1, c * 64, min(D, c * 64 + 64), out,
                       (t * H + g * G) * D, D, ggml_rounding and f16_pool(vc), True)
    return out


@njit(nogil=True, cache=_CACHE)
def _plan(token_seq, positions, window, H, nh, tile, parts):
    """Cut the batch into tiles (runs of up to `tile` consecutive positions of one sequence)
    and deal the (tile, head group) items to `parts` lists of about equal cost (rows x keys,
    largest first to the least loaded). Returns the items' first token, token count, first
    head and part, ordered by part, with each part's first item, and the scratch sizes."""
    T = token_seq.shape[0]
    starts = np.empty(T, np.int64)
    counts = np.empty(T, np.int64)
    n = 0
    t = 0
    while t < T:
        c = 1
        while (c < tile and t + c < T and token_seq[t + c] == token_seq[t]
               and positions[t + c] == positions[t + c - 1] + 1):
            c += 1
        starts[n] = t
        counts[n] = c
        n += 1
        t += c
    groups = H // nh
    items = n * groups
    cost = np.empty(items, np.float64)
    max_keys = 1
    max_rows = 1
    for i in range(n):
        t0 = starts[i]
        keys = positions[t0 + counts[i] - 1] - _window_start(positions[t0], window) + 1
        max_keys = max(max_keys, keys)
        max_rows = max(max_rows, counts[i] * nh)
        for g in range(groups):
            cost[i * groups + g] = counts[i] * nh * (keys + 64.0)
    order = np.argsort(-cost, kind="mergesort")
    load = np.zeros(parts, np.float64)
    part = np.empty(items, np.int64)
    for it in order:
        best = 0
        for p in range(1, parts):
            if load[p] < load[best]:
                best = p
        part[it] = best
        load[best] += cost[it]
    first = np.zeros(parts + 1, np.int64)
    for it in range(items):
        first[part[it] + 1] += 1
    for p in range(parts):
        first[p + 1] += first[p]
    fill = first[:parts].copy()
    it_t0 = np.empty(items, np.int64)
    it_nt = np.empty(items, np.int64)
    it_h0 = np.empty(items, np.int64)
    for it in range(items):
        k = fill[part[it]]
        fill[part[it]] += 1
        it_t0[k] = starts[it // groups]
        it_nt[k] = counts[it // groups]
        it_h0[k] = (it % groups) * nh
    return it_t0, it_nt, it_h0, first, max_rows, max_keys


@njit(inline="always", nogil=True)
def _wide_floats(max_rows, D):
    """_tile's wf: wide_keys(D) widened K or V rows, then max_rows output rows, then as many
    transposed K rows on AVX2 (_transpose8; or a stub)."""
    chunks = 2 if _SPLIT_HALVES else 1       # the transposed chunk: AVX2 only (_tile)
    return (chunks * wide_keys(D) + max_rows) * D if max_rows >= WIDE_MIN_ROWS else 16


@njit(**_PJIT)
def _run(q, k_cache, v_cache, block_tables, token_seq, positions, window, scale,
         ggml_rounding, out, par, nh, tile, parts, sinks):
    T, H, D = q.shape
    it_t0, it_nt, it_h0, first, max_rows, max_keys = _plan(token_seq, positions, window, H, nh,
                                                           tile, parts)
    if par:
        for p in prange(parts):
            qv = np.empty((max_rows, D), np.float32)
            sc = np.empty((max_rows, max_keys + 16), np.float32)
            kb = np.empty(max_keys, np.int64)
            kw = np.empty(max_keys, np.int64)
            wf = np.empty(_wide_floats(max_rows, D), np.float32)
            for k in range(first[p], first[p + 1]):
                _tile(q, k_cache, v_cache, block_tables, token_seq, positions, window, scale,
                      ggml_rounding, out, it_t0[k], it_nt[k], it_h0[k], nh, qv, sc, kb, sinks,
                      wf, kw)
    else:
        qv = np.empty((max_rows, D), np.float32)
        sc = np.empty((max_rows, max_keys + 16), np.float32)
        kb = np.empty(max_keys, np.int64)
        kw = np.empty(max_keys, np.int64)
        wf = np.empty(_wide_floats(max_rows, D), np.float32)
        for k in range(first[0], first[parts]):
            _tile(q, k_cache, v_cache, block_tables, token_seq, positions, window, scale,
                  ggml_rounding, out, it_t0[k], it_nt[k], it_h0[k], nh, qv, sc, kb, sinks,
                  wf, kw)
    return out


@dataclass(frozen=True)
class KernelPlan:
    """How one call runs, chosen once per step (a fused layer step makes it for all its
    layers): parallel or not, query heads per work item, how many lists of work the
    parallel loop deals, and whether the threads split each token's work (_run_split)
    instead of taking whole tiles. None of it changes the result."""
    par: bool
    nh: int
    parts: int
    split: bool


def kernel_plan(T: int, H: int, KVH: int, keys: int, par: bool, threads: int,
                nh: int | None = None) -> KernelPlan:
    """The plan for T query tokens of H heads (KVH KV heads) over at most `keys` keys.
    nh: heads per work item (heads_per_item's choice when None). With fewer (token, KV
    head) pairs than threads (a lone decode token) and at least SPLIT_MIN_KEYS keys, the
    threads share each pair's work."""
    parts = max(1, int(threads)) if par else 1
    if nh is None:
        nh = heads_per_item(T, H, KVH, parts)
    return KernelPlan(par, nh, parts, parts > 1 and T * KVH < parts and keys >= SPLIT_MIN_KEYS)


def run_plan(plan: KernelPlan, q, k_cache, v_cache, block_tables, token_seq, positions, window,
             scale, ggml_rounding, out, sinks=None, tile=TILE):
    """paged_attention's kernels as `plan` says (D a multiple of 16)."""
    if plan.split:
        return _run_split(q, k_cache, v_cache, block_tables, token_seq, positions, window,
                          scale, ggml_rounding, out, plan.parts, sinks)
    return _run(q, k_cache, v_cache, block_tables, token_seq, positions, window, scale,
                ggml_rounding, out, plan.par, plan.nh, tile, plan.parts, _sinks(sinks))


def paged_attention(q, k_cache, v_cache, block_tables, token_seq, positions, window, scale,
                    ggml_rounding, out, par, heads_per_item=1, threads=None, tile=TILE,
                    sinks=None, keys=None):
    """Causal attention for a flat batch of query tokens, reading K/V through block tables.

    q[T, H, D]; k_cache/v_cache[num_blocks, block_size, KVH, D]; token t belongs to sequence
    row token_seq[t] of block_tables[S, max_blocks] and sits at positions[t]; it attends to
    that sequence's positions [pos - window + 1, pos] (window <= 0: all of [0, pos]).
    Mixed prefill chunks and decode tokens of many sequences go in one call; a token's
    result is the same bits in any batch (see the module docstring).
    ggml_rounding: round q and the softmax weights to f16 as llama.cpp's f16-cache matmuls do.
    heads_per_item: query heads of one KV head handled together (a divisor of H / KVH): more
    reads each K/V row once for more heads, fewer leaves more work items for the threads
    (None: heads_per_item's choice for the threads).
    threads: how many lists of work the parallel loop deals (numba's thread count by
    default); tile: query tokens per tile. Neither changes the result.
    sinks: float32[H], per query head a logit that joins its softmax's denominator (gpt-oss's
    attention sinks); None: no sinks. See kernel_plan for when the threads split a token's
    work instead (_run_split), whatever heads_per_item says.
    keys: the most keys a token sees (the caller's, once per step), else from positions.
    """
    T, H, D = q.shape
    if D % 16:
        return paged_attention_ref(q, k_cache, v_cache, block_tables, token_seq, positions,
                                   window, scale, ggml_rounding, out, par, heads_per_item, sinks)
    if threads is None:
        import numba
        threads = numba.get_num_threads()
    if keys is None:
        top = int(positions.max()) + 1 if T else 0
        keys = min(top, window) if window > 0 else top
    plan = kernel_plan(T, H, k_cache.shape[2], keys, par, threads, heads_per_item)
    return run_plan(plan, q, k_cache, v_cache, block_tables, token_seq, positions, window,
                    scale, ggml_rounding, out, sinks, tile)


def heads_per_item(T: int, H: int, KVH: int, threads: int) -> int:
    """The most heads of a group per work item that still leaves an item for every thread
    (the whole group on one thread when it runs serially)."""
    group = H // KVH
    nh = group
    while nh > 1 and T * (H // nh) < threads and group % (nh // 2) == 0:
        nh //= 2
    return nh
