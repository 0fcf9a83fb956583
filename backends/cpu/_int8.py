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
halves (uint16 s, and o for an offset), widened exactly in the kernel (vcvtph2ps). A k-quant's
block scale is a half per 256 columns times a small integer per block: s holds the integers
(int8), d the halves [T, K/256, 16], and the kernel forms s = d * float(sc) (o = -(dm *
float(mn)) for the formats with minimums), the same float32 product the GGUF decoding makes,
exact. So decode reads about the bytes the GGUF holds. Per block and activation row the lanes
then take one float update:

    isum' = sum(q * a) - zb           (exact int32; zb = zero_point * sum(a) over the block)
    t     = s * float(isum') [+ o * float(sum(a))]
    acc  += da * t

Every output element is computed by that fixed sequence of float32 operations over the blocks
in order, whatever the number of activation rows M, the tile a thread takes or the machine:
a row's result is bit-identical alone or in any batch, and `_block_generic` (plain numba, used
where VNNI is missing and by the tests) does the same operations in the same order, so it
gives the same bits as the VNNI version.

A format is one integer, `fmt_code(B, bits, has_o, sub)`; `int8_matmul` runs a kernel compiled
for it alone (a closure over the constant: each format compiles and caches only its own loop).
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


# Tile kernels by instruction set (each a kernel of its own, compiled for it alone):
# AVX-512 VNNI (vpdpbusd on 16 lanes), AVX-VNNI (vpdpbusd on two 8-lane halves), AVX2
# (vpmaddubsw + vpmaddwd: exact, as the codes below 8 bits are < 128 and 8-bit codes go
# through ggml's sign trick), or none: the portable numba loop.
PORTABLE, AVX2, AVXVNNI, AVX512VNNI = 0, 1, 2, 3
ISA_NAMES = {"portable": PORTABLE, "avx2": AVX2, "avxvnni": AVXVNNI, "avx512vnni": AVX512VNNI}
_NEEDS = {AVX2: ("avx2", "f16c"), AVXVNNI: ("avx2", "f16c", "avxvnni"),
          AVX512VNNI: ("avx512f", "avx512bw", "avx512vnni", "f16c")}


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
    """An intrinsic computing `rows` activation rows x one 16-row weight tile, all blocks.

    Arguments (intp, then the format literal): out (float32, row r at out + r * out_stride
    bytes), w, h, s, o (the tile's first block: codes, fifth-bit plane, scales, offsets), a
    (int8 codes of the first row, rows K bytes apart), K, nb, da, bsf, zb (the first row's
    entries of the [nb, M] arrays), M, fmt, isa (literals). The accumulators stay in
    registers for the whole row of blocks and each block's weights are loaded (and unpacked)
    once for all the rows. Everything is 16-lane LLVM vector code but the integer dot
    (`dot`), which is the instruction set's own.
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

    def scales(builder, base, dbase, b, sub, per):
        """The block's 16 scales: halves, or half d (per 256 columns) * float(int8)."""
        if not sub:
            return halves(builder, base, b)
        sc = builder.load(ptr(builder, base, builder.mul(b, ir.Constant(i64, 16)), v16i8), align=1)
        d = halves(builder, dbase, builder.udiv(b, ir.Constant(i64, per)))
        return builder.fmul(d, builder.sitofp(builder.sext(sc, v16i32), v16f32))

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

    def dot(builder, isa, chain, w, a, signed8):
        """chain + per lane, sum of 4 byte products of w (unsigned) and a (signed); signed8
        (AVX2, 8-bit codes): the sum of (w - 128) * a instead (the caller skips zb)."""
        mod = builder.module
        if isa == AVX512VNNI:
            fn = intrinsic_fn(mod, "llvm.x86.avx512.vpdpbusd.512", v16i32, [v16i32] * 3)
            return builder.call(fn, [chain, w, a])
        parts = []
        for c_h, w_h, a_h in zip(split(builder, chain), split(builder, w), split(builder, a)):
            if isa == AVXVNNI:
                fn = intrinsic_fn(mod, "llvm.x86.avx512.vpdpbusd.256", v8i32, [v8i32] * 3)
                parts.append(builder.call(fn, [c_h, w_h, a_h]))
                continue
            w8, a8 = builder.bitcast(w_h, v32i8), builder.bitcast(a_h, v32i8)
            if signed8:          # ggml's sign trick: |w - 128| * (a with the sign of w - 128)
                ws = builder.xor(w8, ir.Constant(v32i8, [0x80] * 32))
                zero = ir.Constant(v32i8, [0] * 32)
                neg = builder.icmp_signed("<", ws, zero)
                w8 = builder.select(neg, builder.sub(zero, ws), ws)
                a8 = builder.select(neg, builder.sub(zero, a8),
                                    builder.select(builder.icmp_signed("==", ws, zero), zero, a8))
            maddubs = intrinsic_fn(mod, "llvm.x86.avx2.pmadd.ub.sw", v16i16, [v32i8, v32i8])
            maddwd = intrinsic_fn(mod, "llvm.x86.avx2.pmadd.wd", v8i32, [v16i16, v16i16])
            p16 = builder.call(maddubs, [w8, a8])   # pairs: |sum| <= 2 * 127 * 128, no saturation
            p32 = builder.call(maddwd, [p16, ir.Constant(v16i16, [1] * 16)])
            parts.append(builder.add(c_h, p32))
        return join(builder, *parts)

    def codegen(context, builder, sig, args):
        B, bits, has_o, sub = fmt_parts(sig.args[-2].literal_value)
        isa = sig.args[-1].literal_value
        if isa == PORTABLE:          # never called: the portable kernel takes no vector path
            return context.get_dummy_value()
        signed8 = isa == AVX2 and bits == 8
        (out_a, out_stride, w_a, h_a, s_a, o_a, d_a, dm_a, a_a, K, nb, da_a, bsf_a, zb_a,
         M) = args[:15]
        per = 256 // B               # blocks per k-quant super-block
        nquads = B // 4
        nv = code_planes(B, bits)
        bbytes = nquads * 4          # columns (= activation bytes) per block
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
            wv = raw
        else:
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
        sv = scales(builder, s_a, d_a, b, sub, per)
        if has_o:
            ov = scales(builder, o_a, dm_a, b, sub, per)
            if sub:
                ov = builder.fneg(ov)                        # o = -(dm * mn)
        ent = builder.mul(b, builder.mul(M, ir.Constant(i64, 4)))      # [b, row 0] of [nb, M]
        new_accs = []
        for r in range(rows):
            a_r = builder.add(a_a, builder.add(builder.mul(K, ir.Constant(i64, r)),
                                               builder.mul(b, ir.Constant(i64, bbytes))))
            # two independent chains (exact integer sums, so the split changes nothing)
            chains = [ir.Constant(v16i32, None), ir.Constant(v16i32, None)]
            for j in range(nquads):
                aq = builder.load(ptr(builder, a_r, 4 * j, i32), align=1)
                chains[j % 2] = dot(builder, isa, chains[j % 2], wv[j], splat(builder, aq, v16i32),
                                    signed8)
            isum = builder.add(chains[0], chains[1])
            off = builder.add(ent, ir.Constant(i64, 4 * r))
            if not signed8:          # (signed8 summed (w - 128) * a: zb is already off)
                zb = builder.load(ptr(builder, zb_a, off, i32), align=1)
                isum = builder.sub(isum, splat(builder, zb, v16i32))
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

    @intrinsic
    def tile(typingctx, out, out_stride, w, h, s, o, d, dm, a, K, nb, da, bsf, zb, M, fmt, isa):
        if not (isinstance(fmt, types.IntegerLiteral) and isinstance(isa, types.IntegerLiteral)):
            return None
        return types.void(*([types.intp] * 15), fmt, isa), codegen

    return tile


_tile1, _tile4, _tile8 = _make_tile(1), _make_tile(4), _make_tile(8)


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


@njit(inline="always", nogil=True)
def code_at(q, h, t, b, j, lane, k, nq, bits):
    """The code of quad j, lane, byte k of block b of tile t (see the module doc)."""
    if bits == 8:
        return np.int32(q[t, b, j, lane, k])
    half = nq // 2
    byte = np.int32(q[t, b, j % half, lane, k])
    c = (byte & 15) if j < half else (byte >> 4)
    if bits == 5:
        i = lane * 4 + k
        c |= ((np.int32(h[t, b, j, i >> 3]) >> (i & 7)) & 1) << 4
    elif bits == 6:
        c |= ((np.int32(q[t, b, half + j // 4, lane, k]) >> (2 * (j % 4))) & 3) << 4
    return c


@njit(inline="always", nogil=True)
def scale_at(s, d, t, b, lane, sub, per):
    """A block's scale (or offset magnitude) as float32: see the module doc."""
    if sub:
        return widen(d[t, b // per, lane]) * np.float32(s[t, b, lane])
    return widen(s[t, b, lane])


@njit(inline="always", nogil=True)
def _block_generic(acc, m, q, h, t, b, s, o, d, dm, fmt, qa, a0, da, bsf, zb):
    """The same update as the VNNI intrinsic, lane by lane, same float operations in order."""
    B = fmt & 63
    bits = (fmt >> 6) & 15
    has_o = (fmt >> 10) & 1
    sub = (fmt >> 11) & 1
    per = 256 // B
    nq = B // 4
    for lane in range(LANES):
        isum = np.int32(0)
        for j in range(nq):
            for k in range(4):
                isum += code_at(q, h, t, b, j, lane, k, nq, bits) * np.int32(qa[m, a0 + 4 * j + k])
        isum -= zb
        tv = scale_at(s, d, t, b, lane, sub, per) * np.float32(isum)
        if has_o:
            ov = scale_at(o, dm, t, b, lane, sub, per)
            tv = tv + (-ov if sub else ov) * bsf
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
def _one_tile(t, q, h, s, o, d, dm, fmt, qa, da, bsf, zb, out, isa):
    """Output columns 16t .. 16t+15 of every row."""
    B = fmt & 63
    bits = (fmt >> 6) & 15
    sub = (fmt >> 11) & 1
    nq = B // 4
    nv = q.shape[2]
    nb = q.shape[1]
    M, K = qa.shape
    N = out.shape[1]
    n0 = t * LANES
    if isa > 0 and n0 + LANES <= N:
        w = q.ctypes.data + t * nb * nv * 64
        hb = h.ctypes.data + (t * nb * nq * 8 if bits == 5 else 0)
        ssz = 1 if sub else 2
        sb = s.ctypes.data + t * nb * LANES * ssz
        ob = o.ctypes.data + t * nb * LANES * ssz
        nsb = d.shape[1]
        db = d.ctypes.data + (t * nsb * LANES * 2 if sub else 0)
        dmb = dm.ctypes.data + (t * nsb * LANES * 2 if sub else 0)
        dst = out.ctypes.data + n0 * 4
        m = 0
        while m < M:
            R = 8 if M - m >= 8 else (4 if M - m >= 4 else 1)
            _simd_tile(R, fmt, isa, dst + m * N * 4, N * 4, w, hb, sb, ob, db, dmb,
                       qa.ctypes.data + m * K, K, nb, da.ctypes.data + m * 4,
                       bsf.ctypes.data + m * 4, zb.ctypes.data + m * 4, M)
            m += R
    else:
        # the portable path, also for a partial last tile: results go through acc
        acc = np.zeros((M, LANES), np.float32)
        for b in range(nb):
            for m in range(M):
                _block_generic(acc, m, q, h, t, b, s, o, d, dm, fmt, qa, b * B, da[b, m],
                               bsf[b, m], zb[b, m])
        for m in range(M):
            for lane in range(min(LANES, N - n0)):
                out[m, n0 + lane] = acc[m, lane]


@njit(inline="always", nogil=True)
def _chunk_tiles(T, nw, M, q):
    """Tiles per chunk of the shared counter: 16 chunks per thread, and with M < 8 rows at
    least SMALL_M_CHUNK_BYTES of q's codes (see there)."""
    per = max(1, T // (nw * 16))
    if M < 8:
        per = max(per, SMALL_M_CHUNK_BYTES // (q.shape[1] * q.shape[2] * 64))
    return per


def _make_matmul(fmt: int, isa: int):
    """int8_matmul's kernel for one format and instruction set: constants of the closure, so
    the tile intrinsics see them as literals and emit that loop only (cached per pair)."""
    @njit(**_PJIT)
    def matmul_fmt(q, h, s, o, d, dm, qa, da, bsf, zb, out, nw, counter):
        T = q.shape[0]
        if nw <= 1:         # on the calling thread: products too small to pay a parallel region
            for t in range(T):
                _one_tile(t, q, h, s, o, d, dm, fmt, qa, da, bsf, zb, out, isa)
            return
        # Dynamic scheduling: each thread takes the next chunk of tiles from a shared counter,
        # so a thread the OS preempts (other work on the machine) delays only its current chunk
        # instead of a fixed half of the matrix. Which thread computes a tile changes no bits.
        per = _chunk_tiles(T, nw, qa.shape[0], q)
        nchunks = (T + per - 1) // per
        c_addr = counter.ctypes.data
        for _w in prange(nw):
            while True:
                c = _fetch_add(c_addr, np.int64(1))
                if c >= nchunks:
                    break
                for t in range(c * per, min(T, (c + 1) * per)):
                    _one_tile(t, q, h, s, o, d, dm, fmt, qa, da, bsf, zb, out, isa)
    # Returns nothing (the caller holds `out`): these closures share one qualified name, and a
    # cached closure that boxes an array may find another closure's environment in a new
    # process ("NRT_adapt_ndarray_to_python: 'descr' is NULL").
    return matmul_fmt


_MATMULS: dict[tuple[int, int], object] = {}


def kernel_for(fmt: int, isa: int):
    """The compiled matmul of one format on one instruction set (see _make_matmul)."""
    fn = _MATMULS.get((fmt, isa))
    if fn is None:
        fn = _MATMULS[(fmt, isa)] = _make_matmul(fmt, isa)
    return fn


def int8_matmul(q, h, s, o, d, dm, fmt, qa, da, bsf, zb, out, use_vnni, nw, counter):
    """out[M, N] = dequant(x) @ W^T from the repacked weight (q, h, s, o, d, dm of format fmt,
    see PackedMatrix) and the activation codes.

    q uint8[T, nb, code_planes(B, bits), 16, 4]; h uint8[T, nb, B/4, 8] (the fifth bits; any
    uint8 4-d array otherwise); s, o uint16 halves, or int8 with d, dm uint16[T, K/256, 16]
    (k-quants; any uint16 3-d arrays otherwise); qa int8[M, K]; da, bsf float32[nb, M]; zb
    int32[nb, M]; out float32[M, N] with N <= 16 T; use_vnni: the tile kernel (isa_of: True
    the host's best vector kernel, False the portable loop, or a name); nw: threads to use
    (<= 1: the calling thread only); counter: int64[1] of zero, owned by the caller (an array made here could be
    freed after its last use by name while the threads still add to its address).
    """
    isa = BEST_ISA if use_vnni is True else isa_of(use_vnni)
    fn = _MATMULS.get((fmt, isa))
    if fn is None:
        fn = kernel_for(fmt, isa)
    fn(q, h, s, o, d, dm, qa, da, bsf, zb, out, nw, counter)
    return out


def _make_many(fmts: tuple[int, ...], isa: int):
    """One parallel region over the tiles of two or three matrices of formats `fmts` (each
    with its own activation codes and output): the tiles of all of them are chunks of one
    shared counter, each computed by _one_tile exactly as int8_matmul would."""
    n = len(fmts)
    f0, f1 = fmts[0], fmts[1]
    f2 = fmts[2] if n > 2 else fmts[1]

    @njit(**_PJIT)
    def many(q0, h0, s0, o0, d0, dm0, qa0, da0, bsf0, zb0, out0,
             q1, h1, s1, o1, d1, dm1, qa1, da1, bsf1, zb1, out1,
             q2, h2, s2, o2, d2, dm2, qa2, da2, bsf2, zb2, out2, nw, counter):
        T0, T1 = q0.shape[0], q1.shape[0]
        T2 = q2.shape[0] if n > 2 else 0
        if nw <= 1:
            for t in range(T0):
                _one_tile(t, q0, h0, s0, o0, d0, dm0, f0, qa0, da0, bsf0, zb0, out0, isa)
            for t in range(T1):
                _one_tile(t, q1, h1, s1, o1, d1, dm1, f1, qa1, da1, bsf1, zb1, out1, isa)
            for t in range(T2):
                _one_tile(t, q2, h2, s2, o2, d2, dm2, f2, qa2, da2, bsf2, zb2, out2, isa)
            return
        per = _chunk_tiles(T0 + T1 + T2, nw, qa0.shape[0], q0)
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
                    for t in range(c * per, min(T0, (c + 1) * per)):
                        _one_tile(t, q0, h0, s0, o0, d0, dm0, f0, qa0, da0, bsf0, zb0, out0,
                                  isa)
                elif c < c0 + c1:
                    c -= c0
                    for t in range(c * per, min(T1, (c + 1) * per)):
                        _one_tile(t, q1, h1, s1, o1, d1, dm1, f1, qa1, da1, bsf1, zb1, out1,
                                  isa)
                else:
                    c -= c0 + c1
                    for t in range(c * per, min(T2, (c + 1) * per)):
                        _one_tile(t, q2, h2, s2, o2, d2, dm2, f2, qa2, da2, bsf2, zb2, out2,
                                  isa)
    return many


_MANY: dict[tuple, object] = {}


def int8_matmul_many(jobs, use_vnni, nw, counter):
    """Several int8_matmuls in one parallel region (q/k/v, gate/up: one wake-up of the
    threads instead of one per matrix, and small matrices parallel too). jobs: one to three
    tuples (q, h, s, o, d, dm, fmt, qa, da, bsf, zb, out), int8_matmul's arguments; each out
    gets the same bits as int8_matmul gives it. counter: int64[1] of zero, as int8_matmul's.
    """
    if len(jobs) == 1:
        return int8_matmul(*jobs[0], use_vnni, nw, counter)
    if len(jobs) > 3:
        raise ValueError("int8_matmul_many takes one to three matrices")
    fmts = tuple(int(j[6]) for j in jobs)
    isa = isa_of(use_vnni)
    fn = _MANY.get((fmts, isa))
    if fn is None:
        fn = _MANY[(fmts, isa)] = _make_many(fmts, isa)
    args = [a for j in jobs for a in j[:6] + j[7:]]
    if len(jobs) == 2:
        args += args[11:22]          # typed but never run: no tiles of a third matrix
    fn(*args, nw, counter)


# -- repacking (see repack.py) --------------------------------------------------------------
# Serial on purpose: a model loads on one thread (the daemon's loader) and runs on another (the
# engine's). Every thread that starts a parallel region gets an OpenMP team of its own that
# lives on, and once libgomp manages more threads than there are cores it throttles their
# spin-waiting, so each of the engine's regions pays a futex wake-up: a parallel repack made
# the engine's decode step 18-19 ms instead of 12-13 (2 cores).

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


@njit(**_JIT)
def tile_q8_0(blocks, q, s):
    """Q8_0 blocks uint8[16 T, nb, 34] -> codes q + 128 and the half scales (uint16 s) in
    the tile layout, in one pass."""
    T, nb = q.shape[0], q.shape[1]
    for t in range(T):
        for b in range(nb):
            for lane in range(LANES):
                r = t * LANES + lane
                s[t, b, lane] = np.uint16(blocks[r, b, 0]) | (np.uint16(blocks[r, b, 1]) << np.uint16(8))
            for j in range(8):
                for lane in range(LANES):
                    for k in range(4):
                        q[t, b, j, lane, k] = blocks[t * LANES + lane, b, 2 + 4 * j + k] ^ np.uint8(0x80)
