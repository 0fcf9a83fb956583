"""Integer-dot matmul kernels: 8-bit activations times repacked 8-bit weights.

A weight matrix repacked by `repack.py` is stored in tiles of 16 output rows. Within a tile,
block b (B = 16 or 32 weight columns sharing one scale) is B/4 "quads"; quad j holds 64 bytes,
four consecutive uint8 weight codes of each of the 16 rows:

    q[t, b, j, lane, 0:4] = codes of row 16t + lane, columns b*B + 4j .. b*B + 4j + 3

so one AVX-512 VNNI instruction (vpdpbusd) multiplies a quad by the matching four int8
activation codes (broadcast to all lanes) and adds the sums into 16 int32 lanes, one per output
row. Per block and activation row the lanes then take one float update:

    isum' = sum(q * a) - zb           (exact int32; zb = zero_point * sum(a) over the block)
    t     = s * float(isum') [+ o * float(sum(a))]
    acc  += da * t

Every output element is computed by that fixed sequence of float32 operations over the blocks
in order, whatever the number of activation rows M, the tile a thread takes or the machine:
a row's result is bit-identical alone or in any batch, and `_block_generic` (plain numba, used
where VNNI is missing and by the tests) does the same operations in the same order, so it
gives the same bits as the VNNI version.
"""
from __future__ import annotations

import llvmlite.binding as llb
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from . import _stamp

_DEPS: tuple[str, ...] = ()            # inlines nothing from other modules
_DEPS_HASH = "e3b0c44298fc1c14"

_CACHE = _stamp.current(_DEPS, _DEPS_HASH)
_JIT = dict(nogil=True, cache=_CACHE, fastmath=False)
_PJIT = dict(nogil=True, cache=_CACHE, parallel=True, fastmath=False)

LANES = 16


def _host_has_vnni() -> bool:
    try:
        f = llb.get_host_cpu_features()
        return bool(f.get("avx512vnni", False) and f.get("avx512bw", False))
    except Exception:          # no feature query on this platform (e.g. some ARM builds)
        return False


HAVE_VNNI = _host_has_vnni()


# -- one tile, as one LLVM IR loop ----------------------------------------------------------

def _make_vnni_tile(rows: int):
    """An intrinsic computing `rows` activation rows x one 16-row weight tile, all blocks.

    Arguments (all intp): out (float32, row r at out + r * out_stride bytes), w, s, o (the tile's
    first block), a (int8 codes of the first row, rows K bytes apart), K, nb, da, bsf, zb (the
    first row's entries of the [nb, M] arrays), M, then B (16 or 32) and has_o. The
    accumulators stay in registers for the whole row of blocks and each block's weights are
    loaded once for all the rows. B and has_o pick one of four loops, each fully unrolled.
    """
    i32 = ir.IntType(32)
    i64 = ir.IntType(64)
    f32 = ir.FloatType()
    v16i32 = ir.VectorType(i32, LANES)
    v16f32 = ir.VectorType(f32, LANES)
    zeros = ir.Constant(ir.VectorType(i32, LANES), [0] * LANES)

    def splat(builder, value, vty):
        undef = ir.Constant(vty, ir.Undefined)
        return builder.shuffle_vector(builder.insert_element(undef, value, ir.Constant(i32, 0)),
                                      undef, zeros)

    def ptr(builder, addr, offset, ty):
        """addr + offset (an IR value, or a Python int byte count) as a pointer to ty."""
        if isinstance(offset, int):
            offset = ir.Constant(i64, offset) if offset else None
        if offset is not None:
            addr = builder.add(addr, offset)
        return builder.inttoptr(addr, ty.as_pointer())

    def codegen(context, builder, sig, args):
        B, has_o = args[12], args[13]
        is32 = builder.icmp_signed("==", B, ir.Constant(i64, 32))
        off = builder.icmp_signed("!=", has_o, ir.Constant(i64, 0))
        with builder.if_else(is32) as (b32, b16):
            for arm, nquads in ((b32, 8), (b16, 4)):
                with arm:
                    with builder.if_else(off) as (with_o, without_o):
                        with with_o:
                            emit(builder, args, nquads, True)
                        with without_o:
                            emit(builder, args, nquads, False)
        return context.get_dummy_value()

    def emit(builder, args, nquads, with_offset):
        out_a, out_stride, w_a, s_a, o_a, a_a, K, nb, da_a, bsf_a, zb_a, M = args[:12]
        bbytes = nquads * 4          # columns (= activation bytes) per block
        mod = builder.module
        dp = mod.globals.get("llvm.x86.avx512.vpdpbusd.512")
        if dp is None:
            dp = ir.Function(mod, ir.FunctionType(v16i32, [v16i32] * 3),
                             name="llvm.x86.avx512.vpdpbusd.512")
        entry = builder.basic_block
        loop = builder.append_basic_block("tile_loop")
        done = builder.append_basic_block("tile_done")
        builder.branch(loop)

        builder.position_at_end(loop)
        b = builder.phi(i64)
        b.add_incoming(ir.Constant(i64, 0), entry)
        accs = []
        for r in range(rows):
            phi = builder.phi(v16f32)
            phi.add_incoming(ir.Constant(v16f32, None), entry)
            accs.append(phi)
        w_b = builder.add(w_a, builder.mul(b, ir.Constant(i64, 64 * nquads)))
        wv = [builder.load(ptr(builder, w_b, 64 * j, v16i32), align=1) for j in range(nquads)]
        sv = builder.load(ptr(builder, s_a, builder.mul(b, ir.Constant(i64, 64)), v16f32), align=1)
        if with_offset:
            ov = builder.load(ptr(builder, o_a, builder.mul(b, ir.Constant(i64, 64)), v16f32), align=1)
        ent = builder.mul(b, builder.mul(M, ir.Constant(i64, 4)))      # [b, row 0] of [nb, M]
        new_accs = []
        for r in range(rows):
            a_r = builder.add(a_a, builder.add(builder.mul(K, ir.Constant(i64, r)),
                                               builder.mul(b, ir.Constant(i64, bbytes))))
            # two independent chains (exact integer sums, so the split changes nothing)
            chains = [ir.Constant(v16i32, None), ir.Constant(v16i32, None)]
            for j in range(nquads):
                aq = builder.load(ptr(builder, a_r, 4 * j, i32), align=1)
                chains[j % 2] = builder.call(dp, [chains[j % 2], wv[j], splat(builder, aq, v16i32)])
            isum = builder.add(chains[0], chains[1])
            off = builder.add(ent, ir.Constant(i64, 4 * r))
            zb = builder.load(ptr(builder, zb_a, off, i32), align=1)
            isum = builder.sub(isum, splat(builder, zb, v16i32))
            t = builder.fmul(sv, builder.sitofp(isum, v16f32))
            if with_offset:
                bsf = builder.load(ptr(builder, bsf_a, off, f32), align=1)
                t = builder.fadd(t, builder.fmul(ov, splat(builder, bsf, v16f32)))
            da = builder.load(ptr(builder, da_a, off, f32), align=1)
            new_accs.append(builder.fadd(accs[r], builder.fmul(splat(builder, da, v16f32), t)))
        b_next = builder.add(b, ir.Constant(i64, 1))
        tail = builder.basic_block
        b.add_incoming(b_next, tail)
        for r in range(rows):
            accs[r].add_incoming(new_accs[r], tail)
        builder.cbranch(builder.icmp_signed("<", b_next, nb), loop, done)

        builder.position_at_end(done)
        for r in range(rows):
            builder.store(new_accs[r], ptr(builder, out_a, builder.mul(out_stride, ir.Constant(i64, r)),
                                           v16f32), align=1)

    @intrinsic
    def tile(typingctx, out, out_stride, w, s, o, a, K, nb, da, bsf, zb, M, B, has_o):
        return types.void(*([types.intp] * 14)), codegen

    return tile


_tile1, _tile4, _tile8 = _make_vnni_tile(1), _make_vnni_tile(4), _make_vnni_tile(8)


@njit(inline="always", nogil=True)
def _vnni_tile(R, B, has_o, out, ostride, w, s, o, a, K, nb, da, bsf, zb, M):
    ho = 1 if has_o else 0
    if R == 8:
        _tile8(out, ostride, w, s, o, a, K, nb, da, bsf, zb, M, B, ho)
    elif R == 4:
        _tile4(out, ostride, w, s, o, a, K, nb, da, bsf, zb, M, B, ho)
    else:
        _tile1(out, ostride, w, s, o, a, K, nb, da, bsf, zb, M, B, ho)


@njit(inline="always", nogil=True)
def _block_generic(acc, m, q, t, b, s, o, has_o, qa, a0, B, da, bsf, zb):
    """The same update as the VNNI intrinsic, lane by lane, same float operations in order."""
    for lane in range(LANES):
        isum = np.int32(0)
        for j in range(B // 4):
            for k in range(4):
                isum += np.int32(q[t, b, j, lane, k]) * np.int32(qa[m, a0 + 4 * j + k])
        isum -= zb
        tv = s[t, b, lane] * np.float32(isum)
        if has_o:
            tv = tv + o[t, b, lane] * bsf
        acc[m, lane] = acc[m, lane] + da * tv


# -- the matmul ----------------------------------------------------------------------------

@intrinsic
def _fetch_add(typingctx, addr, value):
    """Atomically add value to the int64 at addr; returns the previous value."""
    def codegen(context, builder, sig, args):
        ptr = builder.inttoptr(args[0], ir.IntType(64).as_pointer())
        return builder.atomic_rmw("add", ptr, args[1], "monotonic")
    return types.int64(types.intp, types.int64), codegen


@njit(inline="always", nogil=True)
def _one_tile(t, q, s, o, has_o, qa, da, bsf, zb, out, use_vnni):
    """Output columns 16t .. 16t+15 of every row."""
    nb, nq = q.shape[1], q.shape[2]
    B = nq * 4
    M, K = qa.shape
    N = out.shape[1]
    n0 = t * LANES
    if use_vnni and n0 + LANES <= N:
        w = q.ctypes.data + t * nb * B * LANES
        sb = s.ctypes.data + t * nb * LANES * 4
        ob = o.ctypes.data + t * nb * LANES * 4
        dst = out.ctypes.data + n0 * 4
        m = 0
        while m < M:
            R = 8 if M - m >= 8 else (4 if M - m >= 4 else 1)
            _vnni_tile(R, B, has_o, dst + m * N * 4, N * 4, w, sb, ob, qa.ctypes.data + m * K,
                       K, nb, da.ctypes.data + m * 4, bsf.ctypes.data + m * 4,
                       zb.ctypes.data + m * 4, M)
            m += R
    else:
        # the portable path, also for a partial last tile: results go through acc
        acc = np.zeros((M, LANES), np.float32)
        for b in range(nb):
            for m in range(M):
                _block_generic(acc, m, q, t, b, s, o, has_o, qa, b * B, B, da[b, m], bsf[b, m],
                               zb[b, m])
        for m in range(M):
            for lane in range(min(LANES, N - n0)):
                out[m, n0 + lane] = acc[m, lane]


@njit(**_PJIT)
def int8_matmul(q, s, o, has_o, qa, da, bsf, zb, out, use_vnni, nw, counter):
    """out[M, N] = dequant(x) @ W^T from the repacked weight (q, s, o) and the activation codes.

    q uint8[T, nb, B/4, 16, 4]; s, o float32[T, nb, 16]; qa int8[M, K]; da, bsf float32[nb, M];
    zb int32[nb, M]; out float32[M, N] with N <= 16 T; nw: threads to use (<= 1: the calling
    thread only); counter: int64[1] of zero, owned by the caller (an array made here could be
    freed after its last use by name while the threads still add to its address).
    """
    T = q.shape[0]
    if nw <= 1:             # on the calling thread: products too small to pay a parallel region
        for t in range(T):
            _one_tile(t, q, s, o, has_o, qa, da, bsf, zb, out, use_vnni)
        return out
    # Dynamic scheduling: each thread takes the next chunk of tiles from a shared counter, so
    # a thread the OS preempts (other work on the machine) delays only its current chunk
    # instead of a fixed half of the matrix. Which thread computes a tile changes no bits.
    per = max(1, T // (nw * 16))
    nchunks = (T + per - 1) // per
    c_addr = counter.ctypes.data
    for _w in prange(nw):
        while True:
            c = _fetch_add(c_addr, np.int64(1))
            if c >= nchunks:
                break
            for t in range(c * per, min(T, (c + 1) * per)):
                _one_tile(t, q, s, o, has_o, qa, da, bsf, zb, out, use_vnni)
    return out


# -- repacking (see repack.py) --------------------------------------------------------------
# Serial on purpose: a model loads on one thread (the daemon's loader) and runs on another (the
# engine's). Every thread that starts a parallel region gets an OpenMP team of its own that
# lives on, and once libgomp manages more threads than there are cores it throttles their
# spin-waiting, so each of the engine's regions pays a futex wake-up: a parallel repack made
# the engine's decode step 18-19 ms instead of 12-13 (2 cores).

@njit(**_JIT)
def tile_codes(codes, out):
    """codes uint8[16 T, K] -> out uint8[T, nb, B/4, 16, 4] (the tile layout)."""
    T, nb, nq = out.shape[0], out.shape[1], out.shape[2]
    B = nq * 4
    for t in range(T):
        for b in range(nb):
            for j in range(nq):
                for lane in range(LANES):
                    for k in range(4):
                        out[t, b, j, lane, k] = codes[t * LANES + lane, b * B + 4 * j + k]


@njit(**_JIT)
def tile_q8_0(blocks, out):
    """Q8_0 blocks uint8[16 T, nb, 34] -> codes q + 128 in the tile layout, in one pass."""
    T, nb = out.shape[0], out.shape[1]
    for t in range(T):
        for b in range(nb):
            for j in range(8):
                for lane in range(LANES):
                    for k in range(4):
                        out[t, b, j, lane, k] = blocks[t * LANES + lane, b, 2 + 4 * j + k] ^ np.uint8(0x80)
