"""Integer-dot matmul kernels: 8-bit activations times repacked weight codes.

A weight matrix repacked by `repack.py` is stored in tiles of 16 output rows. Within a tile,
block b (B = 16 or 32 weight columns sharing one scale) is B/4 "quads"; quad j is four
consecutive unsigned weight codes of each of the 16 rows, 64 codes in all:

    quad j, byte 4 lane + k = code of row 16t + lane, column b*B + 4j + k

so one AVX-512 VNNI instruction (vpdpbusd) multiplies a quad by the matching four int8
activation codes (broadcast to all lanes) and adds the sums into 16 int32 lanes, one per output
row. The codes are stored with as many bits as the GGUF format has (`bits`):

- 8 (Q8_0, Q6_K): q[t, b, j, lane, k] is the code of quad j, one byte each;
- 4 (Q4_0, Q4_1, Q4_K, Q2_K, Q3_K): q[t, b, v, lane, k] holds quad v in its low nibble and quad
  v + B/8 in its high nibble, so one 64-byte load + and / shift-and gives two quads;
- 5 (Q5_0, Q5_1, Q5_K): the low four bits as for 4, and the fifth bit of quad j in a bit plane,
  h[t, b, j] = 8 bytes = one 64-bit mask, bit 4 lane + k (AVX-512BW: a mask register, and a
  masked or of 16 into the bytes);
- 6 (Q6_K): the low four bits as for 4 in vectors 0 .. B/8 - 1, then the two high bits of quad
  j at bits 2 (j % 4) of vector B/8 + j // 4 (a shift and an and put them in place).

Scales: the legacy formats' (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) are IEEE halves in the GGUF and stay
halves (uint16 s, and o for an offset), widened exactly in the kernel (vcvtph2ps). Per block and
activation row the lanes take one float update:

    isum' = sum(q * a) - zb           (exact int32; zb = zero_point * sum(a) over the block,
                                       not subtracted for formats with offsets: no zero point)
    t     = s * float(isum') [+ o * float(sum(a))]
    acc  += da * t

A k-quant's block scale is a half per 256 columns (a super-block) times a small integer per
block: s holds the integers (int8; o the minimums' integers), d and dm the halves [T, K/256,
16], so decode reads about the bytes the GGUF holds. As ggml's k-quant dot products do, the
blocks of a super-block are summed in integers and the floats are touched once per 256
columns (the activations' Q8_K scale da is the super-block's too):

    I     = sum over the blocks of sc * isum'      (exact int32: |I| < 2^28)
    Imn   = sum over the blocks of mn * sum(a)     (exact; formats with minimums, whose zb is
                                                    sum(a): _actquant.block_zb)
    t     = d * float(I) [- dm * float(Imn)]
    acc  += da * t

(a float update per block instead cost a third of a Q4_K or Q6_K prefill matmul.)

Every output element is computed by that fixed sequence of float32 operations over the blocks
(super-blocks) in order, whatever the number of activation rows M, the tile a thread takes or
the machine: a row's result is bit-identical alone or in any batch, and the portable loops
(`_block_generic`, `_superblock_generic`: plain numba, used where no vector kernel runs and by
the tests) do the same operations in the same order, so they give the same bits as the vector
kernels.

A format is one integer, `fmt_code(B, bits, has_o, sub)`. Each format's tile loop is a small
serial kernel of its own (compiled and cached once per format and instruction set), and one
parallel driver, compiled once, runs any one to three matrices of any formats (see "the
matmul" below), so a model with a new mix of formats compiles nothing new but the tile loops
of formats never used before (backends/cpu/warmup.py compiles those ahead).
"""
from __future__ import annotations

import llvmlite.binding as llb
import numpy as np
from llvmlite import ir
from numba import cfunc, njit, prange, types
from numba.extending import intrinsic

from edgeinfer.backends.cpu_plan import (AVX2, AVX512VNNI, AVXVNNI, LANES,  # noqa: F401
                                         NEEDS as _NEEDS, PORTABLE)

from . import _stamp

_DEPS: tuple[str, ...] = ()            # inlines nothing from other modules
_DEPS_HASH = "e3b0c44298fc1c14"

_CACHE = _stamp.current(_DEPS, _DEPS_HASH)
_JIT = dict(nogil=True, cache=_CACHE, fastmath=False)
_PJIT = dict(nogil=True, cache=_CACHE, parallel=True, fastmath=False)

# LANES: rows per tile, 16 (cpu_plan.py, which sizes the layout without numba)
# Blocks ahead of the current one whose codes the 1- and 4-row tiles prefetch. Those tiles
# (decode, small batches) are bound by memory latency: a thread's chunk of tiles is a few KB,
# too short for the hardware prefetcher to ramp up on (16 blocks: 4-8 KB ahead; layer matmuls
# of a Gemma 3 270M decode step 3.2 -> 2.75 ms, /tmp-style A/B in the commit message). The
# 8-row tiles (prefill) reuse each block for 8 rows and are compute-bound: no prefetch there.
PREFETCH_BLOCKS = 16
# Fewer than 8 activation rows (decode): a thread's chunk of tiles holds at least this many
# bytes of codes. Such products are bound by memory, not arithmetic, and one long stream per
# thread beats many short ones (the 72 layer matmuls of a Gemma 3 270M decode step: 2.13-2.45
# -> 1.85-2.07 ms; one chunk per matrix, i.e. one thread, was no slower than 16 per thread).
# Larger products keep 16 chunks per thread, for balance when the OS preempts a thread.
SMALL_M_CHUNK_BYTES = 1 << 17
# Products of at least UNPACK_MIN_ROWS activation rows (prefill) with 5- or 6-bit codes: a
# thread unpacks its chunk's tiles to a byte per code, UNPACKED_BYTES of them at a time (in
# L2), and every 8-row group runs the 8-bit tile loop on them, instead of each group
# unpacking every tile again (a 512-row product unpacked each tile 64 times). Same
# integers, same bits. At 512 rows, against unpacking in the tile loop: Q5_0 1.14x, Q6_K
# 1.07-1.12x; 4-bit codes (one and, or a shift and an and, per two quads) 0.95-0.98x, so
# they keep their loop.
UNPACK_MIN_ROWS = 32
UNPACKED_BYTES = 1 << 18


# Tile kernels by instruction set (each a kernel of its own, compiled for it alone):
# AVX-512 VNNI (vpdpbusd on 16 lanes), AVX-VNNI (vpdpbusd on two 8-lane halves), AVX2
# (vpmaddubsw + vpmaddwd: exact, as the codes below 8 bits are < 128 and 8-bit codes go
# through ggml's sign trick), or none: the portable numba loop. Their codes and the host
# features each needs: cpu_plan.py (the daemon names the host's kernel without numba).
# AVX2, codes below 8 bits: quads whose vpmaddubsw pair sums add up in 16 bits without overflow
# (2 * 15 * 127 = 3810 a pair for 4-bit codes: 8 quads; 7874 for 5-bit: 4; 16002 for 6-bit: 2).
AVX2_GROUP = {4: 8, 5: 4, 6: 2}
ISA_NAMES = {"portable": PORTABLE, "avx2": AVX2, "avxvnni": AVXVNNI, "avx512vnni": AVX512VNNI}


def _host_features() -> dict:
    try:
        return dict(llb.get_host_cpu_features())
    except Exception:          # no feature query on this platform (e.g. some ARM builds)
        return {}


_FEATURES = _host_features()
HOST_ISAS = frozenset([PORTABLE] + [i for i, need in _NEEDS.items()
                                    if all(_FEATURES.get(f, False) for f in need)])
BEST_ISA = max(HOST_ISAS)
HAVE_VNNI = AVX512VNNI in HOST_ISAS       # the AVX-512 kernel (what the repack default weighs)
HAVE_SIMD = BEST_ISA > PORTABLE           # some vector tile kernel for this CPU
# 16-lane float vectors are one register (AVX-512: 32 of them) rather than two of AVX2's 16;
# kernels size their register blocks by it (attention.py)
WIDE_REGISTERS = bool(_FEATURES.get("avx512f", False))


def isa_of(simd) -> int:
    """The kernel a use_vnni/simd argument asks for: True the host's best, False or None the
    portable loop, a name ("avx2", ...) that one (if this CPU has it)."""
    if isinstance(simd, str):
        isa = ISA_NAMES[simd]
        if isa not in HOST_ISAS:
            raise ValueError(f"this CPU cannot run the {simd} tile kernel")
        return isa
    return BEST_ISA if simd else PORTABLE


def fmt_code(B: int, bits: int, has_o: bool, sub: bool) -> int:
    """A kernel format: B columns per scale (16, 32), code bits (4, 5, 6, 8), an offset per
    block or not, k-quant scales (int8 s, o times half d, dm per 256 columns: sub) or IEEE
    halves (uint16 s, o)."""
    assert B in (16, 32) and bits in (4, 5, 6, 8)
    return B | (bits << 6) | (int(bool(has_o)) << 10) | (int(bool(sub)) << 11)


def fmt_parts(fmt: int) -> tuple[int, int, bool, bool]:
    """(B, bits, has_o, sub) of a format."""
    return fmt & 63, (fmt >> 6) & 15, bool((fmt >> 10) & 1), bool((fmt >> 11) & 1)


def code_planes(B: int, bits: int) -> int:
    """64-byte code vectors per block of one tile: B/4 quads; two a vector below 8 bits, and
    the high two bits of four quads a vector for 6."""
    if bits == 8:
        return B // 4
    return B // 8 + (B // 16 if bits == 6 else 0)


# -- one tile, as one LLVM IR loop ----------------------------------------------------------

def _make_tile(rows: int):
    """(tile, unpack_tile): intrinsics computing `rows` activation rows x one 16-row weight
    tile, all blocks, and unpacking a tile's codes (see _unpack_tile below).

    tile's arguments (intp, then the format literal): out (float32, row r at out + r *
    out_stride bytes), w, h, s, o (the tile's first block: codes, fifth-bit plane, scales,
    offsets), a (int8 codes of the first row, rows K bytes apart), K, nb, da, bsf, zb (the
    first row's entries of the [nb, S] arrays), S (their row stride in entries), fmt, isa
    (literals). The accumulators stay in registers for the whole row of blocks and each
    block's weights are loaded (and unpacked) once for all the rows. Everything is 16-lane
    LLVM vector code but the integer dot (`dot`), which is the instruction set's own.
    """
    i1 = ir.IntType(1)
    i8 = ir.IntType(8)
    i32 = ir.IntType(32)
    i64 = ir.IntType(64)
    f32 = ir.FloatType()
    v16i32 = ir.VectorType(i32, LANES)
    v16f32 = ir.VectorType(f32, LANES)
    v16f16 = ir.VectorType(ir.HalfType(), LANES)
    v64i8 = ir.VectorType(i8, 64)
    v64i1 = ir.VectorType(i1, 64)
    v16i8 = ir.VectorType(i8, LANES)
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

    def halves(builder, base, i):
        hv = builder.load(ptr(builder, base, builder.mul(i, ir.Constant(i64, 32)), v16f16), align=1)
        return builder.fpext(hv, v16f32)

    v8i32 = ir.VectorType(i32, 8)
    v32i8 = ir.VectorType(i8, 32)
    v16i16 = ir.VectorType(ir.IntType(16), 16)

    def intrinsic_fn(mod, name, ret, argtys):
        fn = mod.globals.get(name)
        if fn is None:
            fn = ir.Function(mod, ir.FunctionType(ret, argtys), name=name)
        return fn

    def split(builder, v):
        u = ir.Constant(v.type, ir.Undefined)
        return (builder.shuffle_vector(v, u, ir.Constant(ir.VectorType(i32, 8), list(range(8)))),
                builder.shuffle_vector(v, u, ir.Constant(ir.VectorType(i32, 8), list(range(8, 16)))))

    def join(builder, lo, hi):
        return builder.shuffle_vector(lo, hi, ir.Constant(v16i32, list(range(16))))

    def vnni(builder, isa, op, chain, x, y, avx2):
        """chain + x . y per 32-bit lane by the VNNI instruction op (vpdpbusd, vpdpwssd): its
        512-bit form (AVX-512 VNNI), its 256-bit form on each half (AVX-VNNI), or
        avx2(builder, chain half, x half, y half) on each half."""
        mod = builder.module
        if isa == AVX512VNNI:
            fn = intrinsic_fn(mod, f"llvm.x86.avx512.{op}.512", v16i32, [v16i32] * 3)
            return builder.call(fn, [chain, x, y])
        parts = []
        for c_h, x_h, y_h in zip(split(builder, chain), split(builder, x), split(builder, y)):
            if isa == AVXVNNI:
                fn = intrinsic_fn(mod, f"llvm.x86.avx512.{op}.256", v8i32, [v8i32] * 3)
                parts.append(builder.call(fn, [c_h, x_h, y_h]))
            else:
                parts.append(avx2(builder, c_h, x_h, y_h))
        return join(builder, *parts)

    def dot(builder, isa, chain, w, a, signed8):
        """chain + per lane, sum of 4 byte products of w (unsigned) and a (signed); signed8
        (AVX2, 8-bit codes): the sum of (w - 128) * a instead (the caller skips zb)."""
        def avx2(builder, c_h, w_h, a_h):
            mod = builder.module
            w8, a8 = builder.bitcast(w_h, v32i8), builder.bitcast(a_h, v32i8)
            # ggml's sign trick for 8-bit codes: |w - 128| * (a with the sign of w - 128)
            ws = builder.xor(w8, ir.Constant(v32i8, [0x80] * 32)) if signed8 else None
            if signed8 and rows > 1:
                absb = intrinsic_fn(mod, "llvm.abs.v32i8", v32i8, [v32i8, i1])
                psign = intrinsic_fn(mod, "llvm.x86.avx2.psign.b", v32i8, [v32i8, v32i8])
                w8 = builder.call(absb, [ws, ir.Constant(i1, 0)])   # |-128| = 0x80: 128 unsigned
                a8 = builder.call(psign, [a8, ws])
            elif signed8:        # the same integers by compares and selects: 1.06x at one row
                zero = ir.Constant(v32i8, [0] * 32)
                neg = builder.icmp_signed("<", ws, zero)
                w8 = builder.select(neg, builder.sub(zero, ws), ws)
                a8 = builder.select(neg, builder.sub(zero, a8),
                                    builder.select(builder.icmp_signed("==", ws, zero), zero, a8))
            maddubs = intrinsic_fn(mod, "llvm.x86.avx2.pmadd.ub.sw", v16i16, [v32i8, v32i8])
            maddwd = intrinsic_fn(mod, "llvm.x86.avx2.pmadd.wd", v8i32, [v16i16, v16i16])
            p16 = builder.call(maddubs, [w8, a8])   # pairs: |sum| <= 2 * 127 * 128, no saturation
            p32 = builder.call(maddwd, [p16, ir.Constant(v16i16, [1] * 16)])
            return builder.add(c_h, p32)
        return vnni(builder, isa, "vpdpbusd", chain, w, a, avx2)

    def avx2_grouped(builder, start, wv, aqs, bits):
        """start + per lane, the sum over the block's quads of 4 byte products, on AVX2 with
        codes below 8 bits: vpmaddubsw's 16-bit pair sums of up to AVX2_GROUP[bits] quads are
        added in 16 bits before one vpmaddwd widens them (|pair| <= 2 (2^bits - 1) 127, so the
        group's sum stays below 2^15: exact, the same integer as quad by quad, one vpmaddwd and
        one add per group instead of per quad)."""
        mod = builder.module
        maddubs = intrinsic_fn(mod, "llvm.x86.avx2.pmadd.ub.sw", v16i16, [v32i8, v32i8])
        maddwd = intrinsic_fn(mod, "llvm.x86.avx2.pmadd.wd", v8i32, [v16i16, v16i16])
        ones = ir.Constant(v16i16, [1] * 16)
        g = AVX2_GROUP[bits]
        ws = [split(builder, w) for w in wv]
        acts = [split(builder, splat(builder, aq, v16i32))[0] for aq in aqs]  # both halves alike
        chains = list(split(builder, start))
        for h in range(2):
            for g0 in range(0, len(wv), g):
                ps = [builder.call(maddubs, [builder.bitcast(ws[j][h], v32i8),
                                             builder.bitcast(acts[j], v32i8)])
                      for j in range(g0, min(len(wv), g0 + g))]
                while len(ps) > 1:       # a tree, not a chain: a 1-row tile is latency-bound
                    ps = [builder.add(a, b) for a, b in zip(ps[0::2], ps[1::2])] + ps[len(ps) // 2 * 2:]
                chains[h] = builder.add(chains[h], builder.call(maddwd, [ps[0], ones]))
        return join(builder, *chains)

    def prefetch_ahead(builder, streams):
        """Prefetch PREFETCH_BLOCKS blocks ahead in each (base, offset of this block, bytes a
        block) stream: the 1- and 4-row tiles read a tile's scales (and super-block scales)
        from arrays of their own beside the codes, more concurrent streams per thread than
        the hardware prefetcher follows (a Qwen2.5 1.5B's layer products at one row: 3-5%
        faster)."""
        pf = intrinsic_fn(builder.module, "llvm.prefetch.p0", ir.VoidType(),
                          [i8.as_pointer(), i32, i32, i32])
        for base, off, per_block in streams:
            at = ptr(builder, builder.add(base, off), PREFETCH_BLOCKS * per_block, i8)
            builder.call(pf, [at, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])

    def block_weights(builder, w_a, h_a, b, B, bits, nv, isa):
        """Block b's B/4 quads of codes, unpacked to one byte per code (v16i32 each)."""
        nquads = B // 4
        w_b = builder.add(w_a, builder.mul(b, ir.Constant(i64, 64 * nv)))
        if rows < 8:
            pf = intrinsic_fn(builder.module, "llvm.prefetch.p0", ir.VoidType(),
                              [i8.as_pointer(), i32, i32, i32])
            for off in range(0, 64 * nv, 64):
                builder.call(pf, [ptr(builder, w_b, PREFETCH_BLOCKS * 64 * nv + off, i8),
                                  ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
            if bits == 5:
                hp = builder.add(h_a, builder.mul(b, ir.Constant(i64, 8 * nquads)))
                builder.call(pf, [ptr(builder, hp, PREFETCH_BLOCKS * 8 * nquads, i8),
                                  ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        raw = [builder.load(ptr(builder, w_b, 64 * v, v16i32), align=1) for v in range(nv)]
        if bits == 8:
            return raw
        m4 = ir.Constant(v16i32, [0x0F0F0F0F] * LANES)
        four = ir.Constant(v16i32, [4] * LANES)
        nib = raw[:nquads // 2]
        wv = ([builder.and_(r_, m4) for r_ in nib]
              + [builder.and_(builder.lshr(r_, four), m4) for r_ in nib])
        if bits == 6:
            m30 = ir.Constant(v16i32, [0x30303030] * LANES)
            for j in range(nquads):
                hv = raw[nquads // 2 + j // 4]
                sh = 2 * (j % 4)             # the two bits go to bits 4, 5 of each byte
                if sh < 4:
                    hv = builder.shl(hv, ir.Constant(v16i32, [4 - sh] * LANES))
                elif sh > 4:
                    hv = builder.lshr(hv, ir.Constant(v16i32, [sh - 4] * LANES))
                wv[j] = builder.or_(wv[j], builder.and_(hv, m30))
        if bits == 5:
            h_b = builder.add(h_a, builder.mul(b, ir.Constant(i64, 8 * nquads)))
            sixteen = ir.Constant(v64i8, [16] * 64)
            nothing = ir.Constant(v64i8, [0] * 64)
            for j in range(nquads):
                word = builder.load(ptr(builder, h_b, 8 * j, i64), align=1)
                mask = builder.bitcast(word, v64i1)
                add = builder.select(mask, sixteen, nothing)
                wv[j] = builder.bitcast(builder.or_(builder.bitcast(wv[j], v64i8), add), v16i32)
        return wv

    def row_isum(builder, a_r, zb_p, wv, B, bits, isa, signed8, has_o):
        """Per lane, sum(q * a) - zb over one block of one activation row (exact int32);
        formats with minimums have no zero point (zb = 0) and skip it."""
        # Two independent chains for 32-column blocks (vpdpbusd's latency: one chain a row
        # was ~10% slower even with eight rows in flight), one for 16-column blocks (two of
        # two and their add: Q6_K 5% slower); the first chain starts at -zb rather than
        # subtracting zb at the end (one vector op less per row and block: Q8_0, Q6_K 4-7%
        # faster). Integer sums are exact, so none of this changes a bit. signed8 summed
        # (w - 128) * a: zb is already off.
        start = ir.Constant(v16i32, None)
        if not (signed8 or has_o):
            zb = builder.load(ptr(builder, zb_p, 0, i32), align=1)
            start = splat(builder, builder.neg(zb), v16i32)
        aqs = [builder.load(ptr(builder, a_r, 4 * j, i32), align=1) for j in range(B // 4)]
        if isa == AVX2 and bits < 8:
            return avx2_grouped(builder, start, wv, aqs, bits)
        nch = 1 if B == 16 else 2
        chains = [start] + [ir.Constant(v16i32, None)] * (nch - 1)
        for j in range(B // 4):
            chains[j % nch] = dot(builder, isa, chains[j % nch], wv[j],
                                  splat(builder, aqs[j], v16i32), signed8)
        return chains[0] if nch == 1 else builder.add(chains[0], chains[1])

    def row_offsets(builder, a_a, K, M, b, B):
        """Per activation row r of the tile: (address of its block b codes, byte offset of
        its [b, r] entry in the [nb, S] arrays; M is S here)."""
        ent = builder.mul(b, builder.mul(M, ir.Constant(i64, 4)))      # [b, row 0]
        a_b = builder.add(a_a, builder.mul(b, ir.Constant(i64, B)))
        return [(builder.add(a_b, builder.mul(K, ir.Constant(i64, r))),
                 builder.add(ent, ir.Constant(i64, 4 * r))) for r in range(rows)]

    def block_loop(builder, *names):
        """(entry, the named blocks, b): a loop over the blocks begins at the first of them,
        b its block index from 0 (a phi: the caller adds the back edge)."""
        entry = builder.basic_block
        blocks = [builder.append_basic_block(n) for n in names]
        builder.branch(blocks[0])
        builder.position_at_end(blocks[0])
        b = builder.phi(i64)
        b.add_incoming(ir.Constant(i64, 0), entry)
        return entry, blocks, b

    def codegen(context, builder, sig, args):
        B, bits, has_o, sub = fmt_parts(sig.args[-2].literal_value)
        isa = sig.args[-1].literal_value
        if isa == PORTABLE:          # never called: the portable kernel takes no vector path
            return context.get_dummy_value()
        if sub:
            return superblock_codegen(context, builder, args, B, bits, has_o, isa)
        signed8 = isa == AVX2 and bits == 8
        (out_a, out_stride, w_a, h_a, s_a, o_a, d_a, dm_a, a_a, K, nb, da_a, bsf_a, zb_a,
         M) = args[:15]
        entry, (loop, done), b = block_loop(builder, "tile_loop", "tile_done")
        accs = []
        for r in range(rows):
            phi = builder.phi(v16f32)
            phi.add_incoming(ir.Constant(v16f32, None), entry)
            accs.append(phi)
        wv = block_weights(builder, w_a, h_a, b, B, bits, code_planes(B, bits), isa)
        if rows < 8:        # the scales' streams too (halves: 32 bytes a block)
            boff = builder.mul(b, ir.Constant(i64, 32))
            prefetch_ahead(builder, [(s_a, boff, 32)] + ([(o_a, boff, 32)] if has_o else []))
        sv = halves(builder, s_a, b)
        if has_o:
            ov = halves(builder, o_a, b)
        new_accs = []
        for r, (a_r, off) in enumerate(row_offsets(builder, a_a, K, M, b, B)):
            isum = row_isum(builder, a_r, builder.add(zb_a, off), wv, B, bits, isa, signed8,
                            has_o)
            t = builder.fmul(sv, builder.sitofp(isum, v16f32))
            if has_o:
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
        return context.get_dummy_value()

    def dot_pairs(builder, isa, chain, x, y):
        """chain + per 32-bit lane, x.lo * y.lo + x.hi * y.hi of its int16 halves (exact)."""
        def avx2(builder, c_h, x_h, y_h):
            fn = intrinsic_fn(builder.module, "llvm.x86.avx2.pmadd.wd", v8i32, [v16i16, v16i16])
            return builder.add(c_h, builder.call(fn, [builder.bitcast(x_h, v16i16),
                                                      builder.bitcast(y_h, v16i16)]))
        return vnni(builder, isa, "vpdpwssd", chain, x, y, avx2)

    def minimums_at_flush(builder, isa, o_a, pairs_a, S, b0, per):
        """Per row, the super-block's sum of minimum * block sum over blocks b0 .. b0 +
        per - 1, two blocks a step: vpdpwssd on the two blocks' minimums (int16, lane by
        lane) and the row's pair of block sums (_pair_sums: |sum| <= 32 * 127 fits 16 bits).
        The same int32 as a multiply and an add a block and row in the loop, where the
        eight rows' sums held eight registers (a Qwen2.5 1.5B's Q4_K products at 512 rows,
        two threads: 1.03x)."""
        v32i16 = ir.VectorType(ir.IntType(16), 32)
        interleave = ir.Constant(ir.VectorType(i32, 32), [j // 2 + 16 * (j % 2) for j in range(32)])
        sums = [ir.Constant(v16i32, None)] * rows
        for p in range(per // 2):
            b = builder.add(b0, ir.Constant(i64, 2 * p))
            # int8 minimums of blocks b, b + 1 ([2, 16] at o) -> lane l: (mn[b, l], mn[b+1, l])
            m8 = builder.load(ptr(builder, o_a, builder.mul(b, ir.Constant(i64, LANES)), v32i8),
                              align=1)
            mp = builder.bitcast(builder.shuffle_vector(builder.sext(m8, v32i16),
                                                        ir.Constant(v32i16, ir.Undefined),
                                                        interleave), v16i32)
            e = builder.mul(builder.udiv(b, ir.Constant(i64, 2)), builder.mul(S, ir.Constant(i64, 4)))
            for r in range(rows):
                pr = builder.load(ptr(builder, pairs_a, builder.add(e, ir.Constant(i64, 4 * r)), i32),
                                  align=1)
                sums[r] = dot_pairs(builder, isa, sums[r], mp, splat(builder, pr, v16i32))
        return sums

    def superblock_codegen(context, builder, args, B, bits, has_o, isa):
        """The k-quants: a super-block's (256 columns') integer sums scaled by the blocks'
        integer scales, summed exactly in int32, and one float update per super-block (see
        the module doc). The float accumulators live in the output rows (stored zero first,
        then loaded, updated and stored once per super-block): with eight rows, the int32
        sums of scales and of minimums take the registers.

        Eight rows with minimums (at_flush): the minimums' sums are formed at each flush
        from the pairs of block sums the tile kernel passes in the bsf slot (_pair_sums),
        not carried through the block loop."""
        (out_a, out_stride, w_a, h_a, s_a, o_a, d_a, dm_a, a_a, K, nb, da_a, bsf_a, zb_a,
         M) = args[:15]
        per = 256 // B
        at_flush = has_o and rows == 8
        out_rows = [ptr(builder, out_a, builder.mul(out_stride, ir.Constant(i64, r)), v16f32)
                    for r in range(rows)]
        for op_ in out_rows:
            builder.store(ir.Constant(v16f32, None), op_, align=1)
        entry, (loop, flush, latch, done), b = block_loop(builder, "sb_loop", "sb_flush",
                                                          "sb_latch", "sb_done")
        zero = ir.Constant(v16i32, None)
        isums, msums = [], []
        for r in range(rows):
            isums.append(builder.phi(v16i32))
            isums[-1].add_incoming(zero, entry)
            if has_o and not at_flush:
                msums.append(builder.phi(v16i32))
                msums[-1].add_incoming(zero, entry)
        wv = block_weights(builder, w_a, h_a, b, B, bits, code_planes(B, bits), isa)
        boff = builder.mul(b, ir.Constant(i64, LANES))
        if rows < 8:        # the scales' streams too (d, dm: 32 bytes a super-block)
            sboff = builder.mul(builder.udiv(b, ir.Constant(i64, per)), ir.Constant(i64, 32))
            prefetch_ahead(builder, [(s_a, boff, LANES), (d_a, sboff, 32 // per)]
                           + ([(o_a, boff, LANES), (dm_a, sboff, 32 // per)] if has_o else []))
        sc = builder.sext(builder.load(ptr(builder, s_a, boff, v16i8), align=1), v16i32)
        if has_o and not at_flush:
            mn = builder.sext(builder.load(ptr(builder, o_a, boff, v16i8), align=1), v16i32)
        new_i, new_m = [], []
        rows_at = row_offsets(builder, a_a, K, M, b, B)
        for r, (a_r, off) in enumerate(rows_at):
            isum = row_isum(builder, a_r, builder.add(zb_a, off), wv, B, bits, isa, False, has_o)
            new_i.append(builder.add(isums[r], builder.mul(isum, sc)))
            if has_o and not at_flush:     # with minimums zb is the block's sum of codes
                bsum = builder.load(ptr(builder, zb_a, off, i32), align=1)
                new_m.append(builder.add(msums[r], builder.mul(mn, splat(builder, bsum, v16i32))))
        b_next = builder.add(b, ir.Constant(i64, 1))
        body_end = builder.basic_block
        at_end = builder.icmp_signed("==", builder.and_(b_next, ir.Constant(i64, per - 1)),
                                     ir.Constant(i64, 0))
        builder.cbranch(at_end, flush, latch)

        builder.position_at_end(flush)
        sb = builder.udiv(b, ir.Constant(i64, per))
        dv = halves(builder, d_a, sb)
        if has_o:
            dmv = halves(builder, dm_a, sb)
        if at_flush:
            new_m = minimums_at_flush(builder, isa, o_a, bsf_a, M,
                                      builder.mul(sb, ir.Constant(i64, per)), per)
        for r in range(rows):
            t = builder.fmul(dv, builder.sitofp(new_i[r], v16f32))
            if has_o:
                t = builder.fsub(t, builder.fmul(dmv, builder.sitofp(new_m[r], v16f32)))
            da = builder.load(ptr(builder, da_a, rows_at[r][1], f32), align=1)
            acc = builder.load(out_rows[r], align=1)
            builder.store(builder.fadd(acc, builder.fmul(splat(builder, da, v16f32), t)),
                          out_rows[r], align=1)
        builder.branch(latch)

        builder.position_at_end(latch)
        b.add_incoming(b_next, latch)
        for r in range(rows):
            phi = builder.phi(v16i32)
            phi.add_incoming(new_i[r], body_end)
            phi.add_incoming(zero, flush)
            isums[r].add_incoming(phi, latch)
            if has_o and not at_flush:
                phi = builder.phi(v16i32)
                phi.add_incoming(new_m[r], body_end)
                phi.add_incoming(zero, flush)
                msums[r].add_incoming(phi, latch)
        builder.cbranch(builder.icmp_signed("<", b_next, nb), loop, done)

        builder.position_at_end(done)
        return context.get_dummy_value()

    @intrinsic
    def tile(typingctx, out, out_stride, w, h, s, o, d, dm, a, K, nb, da, bsf, zb, M, fmt, isa):
        if not (isinstance(fmt, types.IntegerLiteral) and isinstance(isa, types.IntegerLiteral)):
            return None
        return types.void(*([types.intp] * 15), fmt, isa), codegen

    def unpack_codegen(context, builder, sig, args):
        B, bits, _, _ = fmt_parts(sig.args[-2].literal_value)
        isa = sig.args[-1].literal_value
        dst, w_a, h_a, nb = args[:4]
        _, (loop, done), b = block_loop(builder, "unpack_loop", "unpack_done")
        wv = block_weights(builder, w_a, h_a, b, B, bits, code_planes(B, bits), isa)
        d_b = builder.add(dst, builder.mul(b, ir.Constant(i64, 64 * (B // 4))))
        for j, v in enumerate(wv):
            builder.store(v, ptr(builder, d_b, 64 * j, v16i32), align=64)
        b_next = builder.add(b, ir.Constant(i64, 1))
        b.add_incoming(b_next, builder.basic_block)
        builder.cbranch(builder.icmp_signed("<", b_next, nb), loop, done)
        builder.position_at_end(done)
        return context.get_dummy_value()

    @intrinsic
    def unpack_tile(typingctx, dst, w, h, nb, fmt, isa):
        if not (isinstance(fmt, types.IntegerLiteral) and isinstance(isa, types.IntegerLiteral)):
            return None
        return types.void(*([types.intp] * 4), fmt, isa), unpack_codegen

    return tile, unpack_tile


(_tile1, _), (_tile4, _) = _make_tile(1), _make_tile(4)
# One tile's codes (nb blocks, w and h as the tiles take them) unpacked to one byte per code
# at dst (64-byte aligned): the 8-bit layout (quad j of block b at dst + 64 (b B/4 + j)),
# the same integers the tile loop of the format would unpack.
_tile8, _unpack_tile = _make_tile(8)


@njit(inline="always", nogil=True)
def _simd_tile(R, fmt, isa, out, ostride, w, h, s, o, d, dm, a, K, nb, da, bsf, zb, M):
    if R == 8:
        _tile8(out, ostride, w, h, s, o, d, dm, a, K, nb, da, bsf, zb, M, fmt, isa)
    elif R == 4:
        _tile4(out, ostride, w, h, s, o, d, dm, a, K, nb, da, bsf, zb, M, fmt, isa)
    else:
        _tile1(out, ostride, w, h, s, o, d, dm, a, K, nb, da, bsf, zb, M, fmt, isa)


# -- the portable path ----------------------------------------------------------------------

@intrinsic
def _bits_f32(typingctx, u):
    """The float32 whose bits are the uint32 u."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.uint32), codegen


@intrinsic
def _f32_bits(typingctx, f):
    """The bits of the float32 f as uint32."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(f), codegen


@njit(inline="always", nogil=True)
def widen(x):
    """The IEEE half with bits x as float32, exactly."""
    h = np.uint32(x)
    sign = (h >> np.uint32(15)) << np.uint32(31)
    e = (h >> np.uint32(10)) & np.uint32(31)
    m = h & np.uint32(1023)
    if e == 0:              # zero and subnormals: m * 2^-24, exact in float32
        bits = _f32_bits(np.float32(m) * np.float32(5.960464477539063e-08)) | sign
    elif e == 31:           # inf, nan
        bits = sign | np.uint32(0x7F800000) | (m << np.uint32(13))
    else:
        bits = sign | ((e + np.uint32(112)) << np.uint32(23)) | (m << np.uint32(13))
    return _bits_f32(bits)


# Typed loads and stores at byte addresses: the kernels below take the arrays as addresses, so
# one compiled driver serves every format (see "the matmul").

def _make_load(nbty):
    def codegen(context, builder, sig, args):
        ty = context.get_value_type(nbty)
        return builder.load(builder.inttoptr(args[0], ty.as_pointer()), align=1)

    @intrinsic
    def load(typingctx, addr):
        return nbty(types.intp), codegen
    return load


_ld_u8, _ld_i8, _ld_u16 = _make_load(types.uint8), _make_load(types.int8), _make_load(types.uint16)
_ld_i32, _ld_f32, _ld_i64 = _make_load(types.int32), _make_load(types.float32), _make_load(types.int64)


def _make_store(nbty):
    def codegen(context, builder, sig, args):
        ty = context.get_value_type(nbty)
        builder.store(args[1], builder.inttoptr(args[0], ty.as_pointer()), align=1)
        return context.get_dummy_value()

    @intrinsic
    def store(typingctx, addr, value):
        return types.void(types.intp, nbty), codegen
    return store


_st_f32, _st_i32 = _make_store(types.float32), _make_store(types.int32)


@njit(inline="always", nogil=True)
def code_at(qp, hp, t, b, j, lane, k, nb, nv, nq, bits):
    """The code of quad j, lane, byte k of block b of tile t (see the module doc); qp, hp: the
    addresses of q uint8[T, nb, nv, 16, 4] and h uint8[T, nb, nq, 8]."""
    tb = t * nb + b
    if bits == 8:
        return np.int32(_ld_u8(qp + (tb * nv + j) * 64 + lane * 4 + k))
    half = nq // 2
    byte = np.int32(_ld_u8(qp + (tb * nv + j % half) * 64 + lane * 4 + k))
    c = (byte & 15) if j < half else (byte >> 4)
    if bits == 5:
        i = lane * 4 + k
        c |= ((np.int32(_ld_u8(hp + (tb * nq + j) * 8 + (i >> 3))) >> (i & 7)) & 1) << 4
    elif bits == 6:
        c |= ((np.int32(_ld_u8(qp + (tb * nv + half + j // 4) * 64 + lane * 4 + k))
               >> (2 * (j % 4))) & 3) << 4
    return c


@njit(inline="always", nogil=True)
def _block_isum(qp, hp, t, b, lane, nb, nv, nq, bits, ap):
    """sum(q * a) over block b of one lane (output row) of tile t; ap: the block's first
    activation code."""
    isum = np.int32(0)
    for j in range(nq):
        for k in range(4):
            isum += (code_at(qp, hp, t, b, j, lane, k, nb, nv, nq, bits)
                     * np.int32(_ld_i8(ap + 4 * j + k)))
    return isum


@njit(inline="always", nogil=True)
def _block_generic(acc, m, qp, hp, t, b, sp, op, nb, nv, fmt, ap, da, bsf, zb):
    """A legacy format's block update of the vector tile, lane by lane, same float
    operations in order."""
    B = fmt & 63
    bits = (fmt >> 6) & 15
    has_o = (fmt >> 10) & 1
    for lane in range(LANES):
        isum = _block_isum(qp, hp, t, b, lane, nb, nv, B // 4, bits, ap)
        if not has_o:                   # (with minimums, zb is the block sum: block_zb)
            isum -= zb
        e = ((t * nb + b) * LANES + lane) * 2          # [t, b, lane] of s and o (halves)
        tv = widen(_ld_u16(sp + e)) * np.float32(isum)
        if has_o:
            tv = tv + widen(_ld_u16(op + e)) * bsf
        acc[m, lane] = acc[m, lane] + da * tv


@njit(inline="always", nogil=True)
def _superblock_generic(acc, m, qp, hp, t, sb, sp, op, dp, dmp, nb, nv, nsb, fmt, qap, K, S,
                        dap, bsfp, zbp):
    """A k-quant's super-block update of the vector tile, lane by lane: the same int32 sums
    and float operations in order."""
    B = fmt & 63
    bits = (fmt >> 6) & 15
    has_o = (fmt >> 10) & 1
    per = 256 // B
    for lane in range(LANES):
        isc = np.int32(0)
        imn = np.int32(0)
        for b in range(sb * per, sb * per + per):
            e = (b * S + m) * 4             # [b, m] of the [nb, S] arrays
            i = (t * nb + b) * LANES + lane             # [t, b, lane] of s and o (int8)
            isum = _block_isum(qp, hp, t, b, lane, nb, nv, B // 4, bits, qap + m * K + b * B)
            if has_o:                   # zb: the block sum (block_zb)
                imn += np.int32(_ld_i8(op + i)) * _ld_i32(zbp + e)
            else:
                isum -= _ld_i32(zbp + e)
            isc += isum * np.int32(_ld_i8(sp + i))
        dsb = ((t * nsb + sb) * LANES + lane) * 2
        tv = widen(_ld_u16(dp + dsb)) * np.float32(isc)
        if has_o:
            tv = tv - widen(_ld_u16(dmp + dsb)) * np.float32(imn)
        acc[m, lane] = acc[m, lane] + _ld_f32(dap + sb * per * S * 4 + m * 4) * tv


# -- the matmul ----------------------------------------------------------------------------
#
# Two levels, so that what a model needs compiles once per format and not once per model:
# - a tile kernel per (format, instruction set): a C function (numba cfunc) computing tiles
#   t0 .. t1 - 1 of one matrix, serial, with the format a constant of its closure (the tile
#   intrinsics see it as a literal and emit that format's loop only; cached per pair);
# - one parallel driver for every format and any one to three matrices (q/k/v, gate/up),
#   which deals chunks of tiles to the threads and calls each matrix's tile kernel through
#   its address. The driver's argument types never depend on the format, so it compiles
#   once; before, one parallel kernel per format tuple (q/k/v of Q4_K, Q4_K, Q6_K; gate/up
#   of Q4_1, Q4_1; ...) compiled for minutes when a model with a new mix came along.
#
# A matrix is passed as W, int64[W_FIELDS]: the addresses of q, h, s, o, d, dm and T, nb, nv
# (code planes), nsb (k-quant super-blocks per row, d's second axis).

W_FIELDS = 10


@intrinsic
def _fetch_add(typingctx, addr, value):
    """Atomically add value to the int64 at addr; returns the previous value."""
    def codegen(context, builder, sig, args):
        ptr = builder.inttoptr(args[0], ir.IntType(64).as_pointer())
        return builder.atomic_rmw("add", ptr, args[1], "monotonic")
    return types.int64(types.intp, types.int64), codegen


_TILES_ARGS = 12     # t0, t1, w, qa, da, bsf, zb, out (addresses), M, K, N, S


@intrinsic
def _call_tiles(typingctx, fn, t0, t1, w, qa, da, bsf, zb, out, M, K, N, S):
    """Call the tile kernel at address fn (see _make_tiles)."""
    def codegen(context, builder, sig, args):
        i64 = ir.IntType(64)
        fty = ir.FunctionType(ir.VoidType(), [i64] * _TILES_ARGS)
        builder.call(builder.inttoptr(args[0], fty.as_pointer()), args[1:])
        return context.get_dummy_value()
    return types.void(*([types.intp] * (_TILES_ARGS + 1))), codegen


@njit(inline="always", nogil=True)
def _w_fields(wp):
    """(q, h, s, o, d, dm, nb, nv, nsb) of the matrix whose W is at address wp."""
    return (_ld_i64(wp), _ld_i64(wp + 8), _ld_i64(wp + 16), _ld_i64(wp + 24), _ld_i64(wp + 32),
            _ld_i64(wp + 40), _ld_i64(wp + 56), _ld_i64(wp + 64), _ld_i64(wp + 72))


@njit(inline="always", nogil=True)
def _group_rows(left):
    """Rows of the next tile call (8, 4 or 1) with `left` rows to go."""
    return 8 if left >= 8 else (4 if left >= 4 else 1)


@njit(inline="always", nogil=True)
def _tile_codes(wp, t, fmt):
    """(codes, fifth-bit plane) addresses of tile t of the matrix whose W is at wp."""
    qp, hp, _s, _o, _d, _dm, nb, nv, _nsb = _w_fields(wp)
    nq = (fmt & 63) // 4
    return qp + t * nb * nv * 64, hp + (t * nb * nq * 8 if (fmt >> 6) & 15 == 5 else 0)


@njit(inline="always", nogil=True)
def _row_groups(t0, t1, M, wp, qap, dap, bsfp, zbp, outp, S, K, N, fmt, isa, tmpp, codes,
                tile_bytes):
    """Every 8-row group (then 4, then 1) of the M rows across tiles t0 .. t1 - 1: a group's
    codes stay in L1 across the tiles. codes: 0 (the packed tiles), or tile t0's unpacked
    codes, tile_bytes apart (_unpack_tile; fmt then the 8-bit format)."""
    m = 0
    while m < M:
        R = _group_rows(M - m)
        for t in range(t0, t1):
            _tile_rows(t, m, R, wp, qap, dap, bsfp, zbp, outp, S, K, N, fmt, isa, tmpp,
                       codes + (t - t0) * tile_bytes if codes else 0)
        m += R


@njit(inline="always", nogil=True)
def _tile_rows(t, m, R, wp, qap, dap, bsfp, zbp, outp, S, K, N, fmt, isa, tmpp, codes):
    """Rows m .. m+R-1 of output columns 16t .. 16t+15 by the vector tile loop of
    instruction set isa (> 0); wp: the address of the matrix's W; codes: 0, or the address
    of the tile's codes unpacked by _unpack_tile (fmt then the 8-bit format of the same
    scales). A partial last tile (N not a multiple of 16) goes through the same loop into
    the scratch rows at tmpp (float32[R, 16]): the repacked arrays hold whole tiles (the
    padding rows zero)."""
    sub = (fmt >> 11) & 1
    _q, _h, sp, op, dp, dmp, nb, _nv, nsb = _w_fields(wp)
    n0 = t * LANES
    full = n0 + LANES <= N
    dst = outp + (m * N + n0) * 4 if full else tmpp
    stride = N * 4 if full else LANES * 4
    w, hb = _tile_codes(wp, t, fmt)
    if codes:
        w = codes
    ssz = 1 if sub else 2
    sb = sp + t * nb * LANES * ssz
    ob = op + t * nb * LANES * ssz
    db = dp + (t * nsb * LANES * 2 if sub else 0)
    dmb = dmp + (t * nsb * LANES * 2 if sub else 0)
    _simd_tile(R, fmt, isa, dst, stride, w, hb, sb, ob, db, dmb,
               qap + m * K, K, nb, dap + m * 4, bsfp + m * 4, zbp + m * 4, S)
    if not full:
        for r in range(R):
            for lane in range(N - n0):
                _st_f32(outp + ((m + r) * N + n0 + lane) * 4,
                        _ld_f32(tmpp + (r * LANES + lane) * 4))


@njit(inline="always", nogil=True)
def _one_tile_portable(t, wp, qap, dap, bsfp, zbp, outp, M, K, N, S, fmt):
    """_tile_rows' bits by the portable loop (CPUs without a vector kernel; the tests'
    reference): results go through acc."""
    B = fmt & 63
    qp, hp, sp, op, dp, dmp, nb, nv, nsb = _w_fields(wp)
    n0 = t * LANES
    acc = np.zeros((M, LANES), np.float32)
    if (fmt >> 11) & 1:
        for sb in range(nb * B // 256):
            for m in range(M):
                _superblock_generic(acc, m, qp, hp, t, sb, sp, op, dp, dmp, nb, nv, nsb, fmt,
                                    qap, K, S, dap, bsfp, zbp)
    else:
        for b in range(nb):
            for m in range(M):
                e = (b * S + m) * 4             # [b, m] of the [nb, S] arrays
                _block_generic(acc, m, qp, hp, t, b, sp, op, nb, nv, fmt, qap + m * K + b * B,
                               _ld_f32(dap + e), _ld_f32(bsfp + e), _ld_i32(zbp + e))
    for m in range(M):
        for lane in range(min(LANES, N - n0)):
            _st_f32(outp + (m * N + n0 + lane) * 4, acc[m, lane])


@intrinsic
def _pair16(typingctx, lo, hi, dst):
    """16 int32 at dst = (lo & 0xFFFF) | (hi << 16) of the 16 int32 at lo and at hi."""
    def codegen(context, builder, sig, args):
        v = ir.VectorType(ir.IntType(32), LANES)
        a, b = (builder.load(builder.inttoptr(x, v.as_pointer()), align=4) for x in args[:2])
        pair = builder.or_(builder.and_(a, ir.Constant(v, [0xFFFF] * LANES)),
                           builder.shl(b, ir.Constant(v, [16] * LANES)))
        builder.store(pair, builder.inttoptr(args[2], v.as_pointer()), align=4)
        return context.get_dummy_value()
    return types.void(types.intp, types.intp, types.intp), codegen


@njit(inline="always", nogil=True)
def _pair_sums(zbp, nb, M, S, pp):
    """At pp, int32[nb / 2, S]: [i, r] = the block sums of blocks 2i and 2i + 1 of row r as
    two int16 halves (low: 2i), from zb ([nb, S] at zbp: for the formats with minimums the
    sums themselves, block_zb): the 8-row k-quant tiles' operand for the minimums
    (minimums_at_flush). Made once per chunk of tiles, for all its rows, 16 at a time (the
    entries past M: whatever, never read)."""
    n16 = M // LANES * LANES if S % LANES else S
    for i in range(nb // 2):
        lo = zbp + 2 * i * S * 4
        hi = lo + S * 4
        dst = pp + i * S * 4
        for r in range(0, n16, LANES):
            _pair16(lo + 4 * r, hi + 4 * r, dst + 4 * r)
        for r in range(n16, M):
            _st_i32(dst + 4 * r, (_ld_i32(lo + 4 * r) & 0xFFFF) | (_ld_i32(hi + 4 * r) << 16))


_TILES_SIG = types.void(*([types.intp] * _TILES_ARGS))


def _make_tiles(fmt: int, isa: int):
    """The tile kernel of one format on one instruction set (see above): fmt and isa are
    constants of the closure, so its cache entry is its own."""
    if isa == PORTABLE:
        @cfunc(_TILES_SIG, cache=_CACHE)
        def tiles_portable(t0, t1, wp, qap, dap, bsfp, zbp, outp, M, K, N, S):
            for t in range(t0, t1):
                _one_tile_portable(t, wp, qap, dap, bsfp, zbp, outp, M, K, N, S, fmt)
        return tiles_portable

    B, bits, has_o, sub = fmt_parts(fmt)
    # k-quants with minimums: the 8-row tiles take pairs of block sums in the bsf slot,
    # which those formats do not read otherwise (minimums_at_flush)
    pairs_for_flush = has_o and sub
    # prefill of 5- and 6-bit codes: unpacked once per few tiles (see UNPACK_MIN_ROWS)
    unpack = bits in (5, 6) and isa in (AVXVNNI, AVX512VNNI)
    fmt8 = fmt_code(B, 8, has_o, sub)
    quads = B // 4

    @cfunc(_TILES_SIG, cache=_CACHE)
    def tiles(t0, t1, wp, qap, dap, bsfp, zbp, outp, M, K, N, S):
        # scratch for a partial last tile's rows: used by address only, so the kernel's end
        # stores into it once more, or numba would free it after the last use of its name
        tmp = np.empty((8, LANES), np.float32)
        tp = tmp.ctypes.data
        with_pairs = pairs_for_flush and M >= 8         # 8-row groups: minimums_at_flush
        pairs = np.empty((K // B) // 2 * S if with_pairs else 1, np.int32)  # kept as tmp is
        if with_pairs:
            bsfp = pairs.ctypes.data
            _pair_sums(zbp, K // B, M, S, bsfp)
        if M < 8:
            # decode and small batches, bound by the weights' bytes: each tile's codes are
            # read from memory once, for every row
            for t in range(t0, t1):
                m = 0
                while m < M:
                    R = _group_rows(M - m)
                    _tile_rows(t, m, R, wp, qap, dap, bsfp, zbp, outp, S, K, N, fmt, isa, tp,
                               0)
                    m += R
        elif not unpack or M < UNPACK_MIN_ROWS:
            # prefill, bound by the integer dot's rate: an 8-row group's codes are reused
            # from L1 across the chunk's tiles, whose codes come from L2 (a Qwen2.5 1.5B's
            # matmuls at 512 rows: 7-9% faster than every row group for each tile in turn,
            # which read the codes of all the rows from L2 or L3 once per tile)
            _row_groups(t0, t1, M, wp, qap, dap, bsfp, zbp, outp, S, K, N, fmt, isa, tp, 0, 0)
        else:
            # the same, on the tiles' codes unpacked UNPACKED_BYTES at a time
            tile_bytes = (K // B) * quads * 64          # one tile's codes at a byte each
            per = max(1, UNPACKED_BYTES // tile_bytes)
            buf = np.empty(min(per, t1 - t0) * tile_bytes + 64, np.uint8)   # kept as tmp is
            bp = (buf.ctypes.data + 63) & ~63
            nb = K // B
            for c0 in range(t0, t1, per):
                c1 = min(t1, c0 + per)
                for t in range(c0, c1):
                    w, hb = _tile_codes(wp, t, fmt)
                    _unpack_tile(bp + (t - c0) * tile_bytes, w, hb, nb, fmt, isa)
                _row_groups(c0, c1, M, wp, qap, dap, bsfp, zbp, outp, S, K, N, fmt8, isa, tp,
                            bp, tile_bytes)
            buf[0] = 0
        tmp[0, 0] = 0.0
        pairs[0] = 0
    return tiles


@njit(inline="always", nogil=True)
def _chunk_tiles(T, nw, M, tile_bytes):
    """Tiles per chunk of the shared counter: 16 chunks per thread, and with M < 8 rows at
    least SMALL_M_CHUNK_BYTES of codes (tile_bytes: the codes of one tile)."""
    per = max(1, T // (nw * 16))
    if M < 8:
        per = max(per, SMALL_M_CHUNK_BYTES // tile_bytes)
    return per


@njit(inline="always", nogil=True)
def _tiles_of(f, w, qa, da, bsf, zb, out, t0, t1):
    _call_tiles(f, t0, t1, w.ctypes.data, qa.ctypes.data, da.ctypes.data, bsf.ctypes.data,
                zb.ctypes.data, out.ctypes.data, qa.shape[0], qa.shape[1], out.shape[1],
                da.shape[1])


@njit(**_PJIT)
def _drive(f0, w0, qa0, da0, bsf0, zb0, out0, f1, w1, qa1, da1, bsf1, zb1, out1,
           f2, w2, qa2, da2, bsf2, zb2, out2, n, nw, counter):
    """Matrices 0 .. n-1 (one to three): out_i = the product of the codes qa_i (with da_i,
    bsf_i, zb_i) and the matrix w_i, whose tile kernel is at address f_i. The tiles of all of
    them are chunks of one shared counter, dealt to nw threads (<= 1: the calling thread)."""
    T0 = w0[6]
    T1 = w1[6] if n > 1 else 0
    T2 = w2[6] if n > 2 else 0
    if nw <= 1:         # on the calling thread: products too small to pay a parallel region
        _tiles_of(f0, w0, qa0, da0, bsf0, zb0, out0, 0, T0)
        if n > 1:
            _tiles_of(f1, w1, qa1, da1, bsf1, zb1, out1, 0, T1)
        if n > 2:
            _tiles_of(f2, w2, qa2, da2, bsf2, zb2, out2, 0, T2)
        return
    # Dynamic scheduling: each thread takes the next chunk of tiles from a shared counter,
    # so a thread the OS preempts (other work on the machine) delays only its current chunk
    # instead of a fixed half of the matrix. Which thread computes a tile changes no bits.
    per = _chunk_tiles(T0 + T1 + T2, nw, qa0.shape[0], w0[7] * w0[8] * 64)
    c0 = (T0 + per - 1) // per
    c1 = (T1 + per - 1) // per
    c2 = (T2 + per - 1) // per
    c_addr = counter.ctypes.data
    for _w in prange(nw):
        while True:
            c = _fetch_add(c_addr, np.int64(1))
            if c >= c0 + c1 + c2:
                break
            if c < c0:
                _tiles_of(f0, w0, qa0, da0, bsf0, zb0, out0, c * per, min(T0, (c + 1) * per))
            elif c < c0 + c1:
                c -= c0
                _tiles_of(f1, w1, qa1, da1, bsf1, zb1, out1, c * per, min(T1, (c + 1) * per))
            else:
                c -= c0 + c1
                _tiles_of(f2, w2, qa2, da2, bsf2, zb2, out2, c * per, min(T2, (c + 1) * per))


_TILES: dict[tuple[int, int], object] = {}
_ADDR: dict[tuple[int, int], int] = {}


def kernel_for(fmt: int, isa: int):
    """The compiled tile kernel (a numba cfunc) of one format on one instruction set:
    compiled, or loaded from numba's disk cache, on first use."""
    fn = _TILES.get((fmt, isa))
    if fn is None:
        from edgeinfer.formats.numba_setup import cache_lock
        # one process compiles a kernel while any other that wants the same one waits, then
        # loads it; kernels of other formats compile and load meanwhile (their saves to the
        # one index file all these closures share are one at a time under numba_setup's
        # directory lock)
        with cache_lock(f"int8-tiles-{fmt}-{isa}"):
            fn = _make_tiles(fmt, isa)
        _TILES[(fmt, isa)] = fn
        _ADDR[(fmt, isa)] = fn.address
    return fn


def kernel_address(fmt: int, isa: int) -> int:
    a = _ADDR.get((fmt, isa))
    if a is None:
        kernel_for(fmt, isa)
        a = _ADDR[(fmt, isa)]
    return a


def weight_fields(q, h, s, o, d, dm) -> np.ndarray:
    """W (see above) of a repacked matrix's arrays, which must outlive every use of it."""
    for a in (q, h, s, o, d, dm):
        if not a.flags.c_contiguous:
            raise ValueError("repacked weight arrays must be C-contiguous")
    return np.array([q.ctypes.data, h.ctypes.data, s.ctypes.data, o.ctypes.data,
                     d.ctypes.data, dm.ctypes.data, q.shape[0], q.shape[1], q.shape[2],
                     d.shape[1]], np.int64)


def _acts(qa, da, bsf, zb, out):
    """The activation arrays as the driver's one signature takes them."""
    c = np.ascontiguousarray
    acts = (c(qa, dtype=np.int8), c(da, dtype=np.float32), c(bsf, dtype=np.float32),
            c(zb, dtype=np.int32), out)
    if not (acts[1].shape == acts[2].shape == acts[3].shape
            and acts[1].shape[1] >= acts[0].shape[0]):
        raise ValueError("int8_matmul: da, bsf and zb must be [nb, S] with S >= M")
    return acts


def run_matmuls(jobs, isa: int, nw: int, counter) -> None:
    """One to three products in one parallel region. jobs: tuples (fmt, W, qa, da, bsf, zb,
    out) with C-contiguous arrays of int8_matmul's types (W from weight_fields); out
    float32[M, N] C-contiguous."""
    n = len(jobs)
    f0, w0, *a0 = jobs[0]
    args = [kernel_address(f0, isa), w0, *a0]
    for i in (1, 2):
        if i < n:
            f, w, *a = jobs[i]
            args += [kernel_address(f, isa), w, *a]
        else:
            args += args[:7]         # typed but never run
    _drive(*args, n, nw, counter)


def _check_out(out, M: int):
    if out.dtype != np.float32 or out.ndim != 2 or not out.flags.c_contiguous or \
            not out.flags.writeable or out.shape[0] != M:
        raise ValueError("int8_matmul: out must be a writable C-contiguous float32[M, N]")


def int8_matmul(q, h, s, o, d, dm, fmt, qa, da, bsf, zb, out, use_vnni, nw, counter):
    """out[M, N] = dequant(x) @ W^T from the repacked weight (q, h, s, o, d, dm of format fmt,
    see PackedMatrix) and the activation codes.

    q uint8[T, nb, code_planes(B, bits), 16, 4]; h uint8[T, nb, B/4, 8] (the fifth bits; any
    uint8 4-d array otherwise); s, o uint16 halves, or int8 with d, dm uint16[T, K/256, 16]
    (k-quants; any uint16 3-d arrays otherwise); qa int8[M, K]; da, bsf float32[nb, S]; zb
    int32[nb, S] (S >= M: rows of the product are their first M columns, see
    _actquant.entry_stride); out float32[M, N] with N <= 16 T; use_vnni: the tile kernel
    (isa_of: True the host's best vector kernel, False the portable loop, or a name); nw: threads to use
    (<= 1: the calling thread only); counter: int64[1] of zero, owned by the caller (an array made here could be
    freed after its last use by name while the threads still add to its address).
    """
    isa = BEST_ISA if use_vnni is True else isa_of(use_vnni)
    acts = _acts(qa, da, bsf, zb, out)
    _check_out(out, acts[0].shape[0])
    run_matmuls([(int(fmt), weight_fields(q, h, s, o, d, dm), *acts)], isa, nw, counter)
    return out


def int8_matmul_many(jobs, use_vnni, nw, counter):
    """Several int8_matmuls in one parallel region (q/k/v, gate/up: one wake-up of the
    threads instead of one per matrix, and small matrices parallel too). jobs: one to three
    tuples (q, h, s, o, d, dm, fmt, qa, da, bsf, zb, out), int8_matmul's arguments; each out
    gets the same bits as int8_matmul gives it. counter: int64[1] of zero, as int8_matmul's.
    """
    if not 1 <= len(jobs) <= 3:
        raise ValueError("int8_matmul_many takes one to three matrices")
    isa = isa_of(use_vnni)
    run = []
    for q, h, s, o, d, dm, fmt, qa, da, bsf, zb, out in jobs:
        acts = _acts(qa, da, bsf, zb, out)
        _check_out(out, acts[0].shape[0])
        run.append((int(fmt), weight_fields(q, h, s, o, d, dm), *acts))
    run_matmuls(run, isa, nw, counter)


# -- repacking (see repack.py) --------------------------------------------------------------
# The one-pass repacks below (tile_legacy, tile_q8_0, tile_q4_k, tile_q6_k) run on every thread.
# That is safe because the engine's loop runs on the thread that loaded the model: every
# thread that starts a parallel region gets an OpenMP team of its own that lives on, and once
# libgomp manages more threads than there are cores each region pays a futex wake-up (a
# repack on a loader thread of its own made a decode step 18-19 ms instead of 12-13 on 2
# cores). tile_codes, the generic path from unpacked codes, is serial.

@njit(**_JIT)
def tile_codes(codes, bits, q, h):
    """codes uint8[16 T, K] -> q, h in the tile layout for `bits` (both zero on entry)."""
    T, nb = q.shape[0], q.shape[1]
    B = codes.shape[1] // nb
    nq = B // 4
    half = nq // 2
    for t in range(T):
        for b in range(nb):
            for j in range(nq):
                for lane in range(LANES):
                    for k in range(4):
                        c = codes[t * LANES + lane, b * B + 4 * j + k]
                        if bits == 8:
                            q[t, b, j, lane, k] = c
                            continue
                        if j < half:
                            q[t, b, j, lane, k] |= c & np.uint8(15)
                        else:
                            q[t, b, j - half, lane, k] |= (c & np.uint8(15)) << np.uint8(4)
                        if bits == 5:      # no branch on the bit: it is random data
                            i = lane * 4 + k
                            h[t, b, j, i >> 3] |= ((c >> np.uint8(4)) & np.uint8(1)) << np.uint8(i & 7)
                        elif bits == 6:
                            q[t, b, half + j // 4, lane, k] |= ((c >> np.uint8(4)) & np.uint8(3)) << np.uint8(2 * (j % 4))


@njit(inline="always", nogil=True)
def _half_bits(blocks, r, b, off):
    """The little-endian half at byte `off` of block b of row r, as its uint16 bits."""
    return np.uint16(blocks[r, b, off]) | (np.uint16(blocks[r, b, off + 1]) << np.uint16(8))


@njit(**_PJIT)
def tile_legacy(blocks, qs_off, qh_off, has_min, q, h, s, o):
    """Q4_0, Q4_1, Q5_0, Q5_1 blocks uint8[16 T, nb, bytes] -> the tile layout in one pass,
    the same bytes as tile_codes on unpack_parts' codes: in a 32-column block the low nibbles
    are columns 0-15 and the high ones 16-31, as the GGUF's qs bytes already hold them, so a
    code plane is those bytes; the fifth bits (qh, bit c of column c) go to h in groups of
    four columns, two lanes a byte. The half scales (and minimums) are copied as they are."""
    T, nb = q.shape[0], q.shape[1]
    for t in prange(T):         # tiles are independent: repack on every thread
        for b in range(nb):
            for lane in range(LANES):
                r = t * LANES + lane
                s[t, b, lane] = _half_bits(blocks, r, b, 0)
                if has_min:
                    o[t, b, lane] = _half_bits(blocks, r, b, 2)
            for j in range(4):
                for lane in range(LANES):
                    for k in range(4):
                        q[t, b, j, lane, k] = blocks[t * LANES + lane, b, qs_off + 4 * j + k]
            if qh_off >= 0:
                for lane in range(LANES):
                    r = t * LANES + lane
                    qh = (np.uint32(blocks[r, b, qh_off]) | (np.uint32(blocks[r, b, qh_off + 1]) << np.uint32(8))
                          | (np.uint32(blocks[r, b, qh_off + 2]) << np.uint32(16))
                          | (np.uint32(blocks[r, b, qh_off + 3]) << np.uint32(24)))
                    shift = np.uint32(4 * (lane & 1))
                    for j in range(8):
                        h[t, b, j, lane >> 1] |= np.uint8(((qh >> np.uint32(4 * j)) & np.uint32(15)) << shift)


@njit(**_PJIT)
def tile_q8_0(blocks, q, s):
    """Q8_0 blocks uint8[16 T, nb, 34] -> codes q + 128 and the half scales (uint16 s) in
    the tile layout, in one pass."""
    T, nb = q.shape[0], q.shape[1]
    for t in prange(T):         # tiles are independent: repack on every thread
        for b in range(nb):
            for lane in range(LANES):
                s[t, b, lane] = _half_bits(blocks, t * LANES + lane, b, 0)
            for j in range(8):
                for lane in range(LANES):
                    for k in range(4):
                        q[t, b, j, lane, k] = blocks[t * LANES + lane, b, 2 + 4 * j + k] ^ np.uint8(0x80)


@njit(inline="always", nogil=True)
def _put_code(q, h, t, b, lane, col, c, bits, B):
    """Code c of column `col` of block b, row `lane` of tile t, into the tile layout: the
    bytes tile_codes writes (q and h zero on entry)."""
    nq = B // 4
    half = nq // 2
    j, k = col // 4, col % 4
    if j < half:
        q[t, b, j, lane, k] |= c & np.uint8(15)
    else:
        q[t, b, j - half, lane, k] |= (c & np.uint8(15)) << np.uint8(4)
    if bits == 5:
        i = lane * 4 + k
        h[t, b, j, i >> 3] |= ((c >> np.uint8(4)) & np.uint8(1)) << np.uint8(i & 7)
    elif bits == 6:
        q[t, b, half + j // 4, lane, k] |= ((c >> np.uint8(4)) & np.uint8(3)) << np.uint8(2 * (j % 4))


@njit(**_PJIT)
def tile_q4_k(blocks, q, s, o, d, dm):
    """Q4_K super-blocks uint8[16 T, K/256, 144] -> the tile layout in one pass: the bytes
    unpack_parts + tile_codes give (codes, 6-bit scales and minimums as int8, the two halves
    d and dmin copied as they are). In a super-block, qs byte 32 c + i holds column 64 c + i
    in its low nibble and 64 c + 32 + i in its high one."""
    T, nsb = d.shape[0], d.shape[1]
    for t in prange(T):         # tiles are independent: repack on every thread
        for sb in range(nsb):
            for lane in range(LANES):
                r = t * LANES + lane
                d[t, sb, lane] = _half_bits(blocks, r, sb, 0)
                dm[t, sb, lane] = _half_bits(blocks, r, sb, 2)
                for j in range(8):          # llama.cpp's get_scale_min_k4
                    if j < 4:
                        sc = blocks[r, sb, 4 + j] & np.uint8(63)
                        mn = blocks[r, sb, 8 + j] & np.uint8(63)
                    else:
                        sc = (blocks[r, sb, 12 + j - 4] & np.uint8(15)) | ((blocks[r, sb, 4 + j - 4] >> np.uint8(6)) << np.uint8(4))
                        mn = (blocks[r, sb, 12 + j - 4] >> np.uint8(4)) | ((blocks[r, sb, 8 + j - 4] >> np.uint8(6)) << np.uint8(4))
                    s[t, 8 * sb + j, lane] = np.int8(sc)
                    o[t, 8 * sb + j, lane] = np.int8(mn)
                for c in range(4):
                    for i in range(32):
                        byte = blocks[r, sb, 16 + 32 * c + i]
                        _put_code(q, q, t, 8 * sb + 2 * c, lane, i, byte & np.uint8(15), 4, 32)
                        _put_code(q, q, t, 8 * sb + 2 * c + 1, lane, i, byte >> np.uint8(4), 4, 32)


@njit(**_PJIT)
def tile_q6_k(blocks, q, s, d):
    """Q6_K super-blocks uint8[16 T, K/256, 210] -> the tile layout in one pass, the bytes
    unpack_parts + tile_codes give (6-bit codes q + 32 in 16-column blocks, int8 scales, the
    half d). Per 128-column half n: ql byte l (l < 64) holds columns 128 n + l (low nibble)
    and 128 n + 64 + l (high), the bits of qh byte l (l < 32) columns l, l + 32, l + 64,
    l + 96 of that half, two each."""
    T, nsb = d.shape[0], d.shape[1]
    for t in prange(T):         # tiles are independent: repack on every thread
        for sb in range(nsb):
            for lane in range(LANES):
                r = t * LANES + lane
                d[t, sb, lane] = _half_bits(blocks, r, sb, 208)
                for j in range(16):
                    s[t, 16 * sb + j, lane] = np.int8(blocks[r, sb, 192 + j])
                for n in range(2):
                    for l in range(32):
                        hb = blocks[r, sb, 128 + 32 * n + l]
                        lo = blocks[r, sb, 64 * n + l]
                        hi = blocks[r, sb, 64 * n + 32 + l]
                        for m in range(4):
                            nib = (lo if m % 2 == 0 else hi)
                            nib = (nib & np.uint8(15)) if m < 2 else (nib >> np.uint8(4))
                            c = nib | (((hb >> np.uint8(2 * m)) & np.uint8(3)) << np.uint8(4))
                            col = 128 * n + 32 * m + l       # column in the super-block
                            _put_code(q, q, t, 16 * sb + col // 16, lane, col % 16, c, 6, 16)
