"""Float32 matmuls on AMX-BF16 tiles, split-precision ("bf16x3"), for the vision towers.

Each float32 operand is split into two bfloat16 halves, hi = bf16(x) (round to nearest even)
and lo = bf16(x - hi), so x = hi + lo to about 2^-16 relative. A product then takes three
bf16 tile products,

    a . b  ~=  hi_a . hi_b + hi_a . lo_b + lo_a . hi_b          (lo_a . lo_b ~ 2^-16 dropped)

each bf16 x bf16 product exact in float32 and summed in the tile's float32 accumulators
(tdpbf16ps: 16 x 16 float32 outputs += 16 x 32 bf16 times 32 x 16 bf16). The error is about
1e-5 of the largest product term, two orders below the 1e-3 the vision parity tests allow,
and AMX's bf16 rate (1024 flops a cycle a core) leaves the three products several times faster
than float32 FMAs. f16 inputs (f16 weights, activations rounded to f16 as ggml does for f16
matrices) split exactly: 11 mantissa bits fit hi's 8 and lo's 8.

Layouts (bf16 as uint16 bit patterns; a tile is 16 rows of 64 bytes, 1 KB):
- activations (split_rows, per call): uint16[Mp / 32, KC, 2, 32, 32], Mp = M rounded up to
  32, KC = K / 32 rounded up, zero padded: block mb, chunk c, half (hi, lo) is rows
  32 mb .. 32 mb + 31 by K values 32 c .. 32 c + 31, i.e. two A tiles (rows 0-15, 16-31)
  contiguous, and a block's four tiles of a chunk 4 KB in a row (a strided A, rows K * 2
  bytes apart, puts a tile's 16 rows in a few L1 sets);
- weights (split_weight, once at load; W[N, K], y = x @ W^T): uint16[N / 32, KC, 2, 2, 16,
  16, 2]: 32 output columns, chunk c, half, n tile (columns 16 t .. 16 t + 15), then AMX's
  pair-interleaved B tile [16 pairs of K][16 columns][2].

The kernel computes 32 x 32 output blocks (four C tiles, two A tiles and two B tiles: all
eight tile registers) over the K chunks in a fixed order, so every output value is the same
sequence of operations whatever the number of threads or which thread takes the block:
results are bit-identical run to run and for any thread count. Work items (32 rows x a panel
of columns, panels sized so their weights stay in L2) are dealt from a shared counter; an
item's blocks accumulate in a thread's scratch, in passes of K_CHUNKS chunks.

The attention (`attention`) runs its two products per head on the same 32 x 32 blocks: Q
split as A tiles, K and V^T as B tiles (split per call), the scores' softmax in 16-lane
vector code that splits P for the second product as it goes.

AMX needs the CPU flags (amx-tile, amx-bf16) and Linux's permission for the tile state
(arch_prctl ARCH_REQ_XCOMP_PERM); `available()` says whether both hold, and callers keep their
float32 path otherwise. EDGEINFER_NO_AMX=1 turns it off.
"""
from __future__ import annotations

import os
import sys

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import errors
from numba.extending import intrinsic

from . import _stamp
from ._int8 import _bits_f32, _f32_bits, _fetch_add

_DEPS = ("_int8.py",)          # its bit casts and atomic counter inlined here: see _stamp.py
_DEPS_HASH = "47539028bb1de1d7"
_CACHE = _stamp.current(_DEPS, _DEPS_HASH)
_JIT = dict(nogil=True, cache=_CACHE)
_PJIT = dict(nogil=True, cache=_CACHE, parallel=True)

# Column panels: at most this many bytes of split weights (hi + lo) per panel, so a panel
# stays in the core's L2 while a thread runs its 32-row blocks over it.
PANEL_BYTES = 1 << 20
# K chunks (32 values each) per pass over a panel: the two A tiles' rows of a pass
# (32 rows x KB x 32 values x 2 halves x 2 bytes = 16 KB at 4) stay in L1 across the panel's
# column blocks; the C tiles are stored and reloaded between passes.
K_CHUNKS = 8
M_GROUP = 1


# -- availability ---------------------------------------------------------------------------

def _host_features() -> dict:
    try:
        import llvmlite.binding as llb
        return dict(llb.get_host_cpu_features())
    except Exception:
        return {}


def _permitted() -> bool:
    """Linux hands AMX's tile data state only to a process that asks for it (the permission
    covers the whole process); without it the first tile instruction faults (SIGILL)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes
        import platform
        if platform.machine() not in ("x86_64", "AMD64"):
            return False
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(158, 0x1023, 18) == 0     # SYS_arch_prctl, XFEATURE_XTILEDATA
    except Exception:
        return False


_AVAILABLE: bool | None = None


def available() -> bool:
    """Whether this process can run the AMX-BF16 kernel (checked once)."""
    global _AVAILABLE
    if _AVAILABLE is None:
        f = _host_features()
        _AVAILABLE = (not os.environ.get("EDGEINFER_NO_AMX")
                      and bool(f.get("amx-tile")) and bool(f.get("amx-bf16"))
                      and _permitted())
    return _AVAILABLE


# -- tile instructions (LLVM's AMX intrinsics; tile registers are immediates) ----------------

_i8 = ir.IntType(8)
_i64 = ir.IntType(64)
_i8p = ir.PointerType(_i8)


def _fn(builder, name, argtys):
    f = builder.module.globals.get(name)
    if f is None:
        f = ir.Function(builder.module, ir.FunctionType(ir.VoidType(), argtys), name)
    return f


def _lit(*ts):
    for t in ts:
        if not isinstance(t, types.IntegerLiteral):
            raise errors.RequireLiteralValue(t)


@intrinsic
def _tile_config(typingctx, addr):
    """ldtilecfg from the 64 bytes at addr."""
    def codegen(context, builder, sig, args):
        builder.call(_fn(builder, "llvm.x86.ldtilecfg", [_i8p]), [builder.inttoptr(args[0], _i8p)])
        return context.get_dummy_value()
    return types.none(types.intp), codegen


@intrinsic
def _tile_release(typingctx):
    def codegen(context, builder, sig, args):
        builder.call(_fn(builder, "llvm.x86.tilerelease", []), [])
        return context.get_dummy_value()
    return types.none(), codegen


def _tile_memory(name: str, doc: str):
    """An intrinsic (t, addr, stride) -> LLVM's `name` on tile t and 16 rows of 64 bytes at
    addr, rows stride bytes apart (the tile load and store differ in the name only)."""
    @intrinsic
    def tile_memory(typingctx, t, addr, stride):
        _lit(t)

        def codegen(context, builder, sig, args):
            builder.call(_fn(builder, name, [_i8, _i8p, _i64]),
                         [ir.Constant(_i8, sig.args[0].literal_value),
                          builder.inttoptr(args[1], _i8p), args[2]])
            return context.get_dummy_value()
        return types.none(t, types.intp, types.intp), codegen
    tile_memory.__doc__ = doc
    return tile_memory


_tload = _tile_memory("llvm.x86.tileloadd64", "Tile t <- the rows at addr.")
_tstore = _tile_memory("llvm.x86.tilestored64", "Tile t -> the rows at addr.")


@intrinsic
def _tzero(typingctx, t):
    _lit(t)

    def codegen(context, builder, sig, args):
        builder.call(_fn(builder, "llvm.x86.tilezero", [_i8]),
                     [ir.Constant(_i8, sig.args[0].literal_value)])
        return context.get_dummy_value()
    return types.none(t), codegen


@intrinsic
def _tdp(typingctx, c, a, b):
    """Tile c (16 x 16 float32) += tile a (16 x 32 bf16) times tile b (32 x 16 bf16, pairs)."""
    _lit(c, a, b)

    def codegen(context, builder, sig, args):
        builder.call(_fn(builder, "llvm.x86.tdpbf16ps", [_i8, _i8, _i8]),
                     [ir.Constant(_i8, s.literal_value) for s in sig.args])
        return context.get_dummy_value()
    return types.none(c, a, b), codegen


def tile_config() -> np.ndarray:
    """Palette 1, all eight tiles 16 rows x 64 bytes (C: 16 x 16 float32; A: 16 x 32 bf16;
    B: 16 pairs x 16 columns x 2 bf16)."""
    cfg = np.zeros(64, np.uint8)
    cfg[0] = 1
    cfg[16:32].view(np.uint16)[:] = 64
    cfg[48:56] = 16
    return cfg


_CFG = tile_config()


# -- splitting --------------------------------------------------------------------------------

def split_array(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 x -> (hi, lo) bf16 bit patterns (uint16), hi = bf16(x), lo = bf16(x - hi),
    both rounded to nearest even (numpy; for weights, once at load)."""
    x = np.ascontiguousarray(x, np.float32)
    u = x.view(np.uint32)
    h = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
    hi_f = (h << np.uint32(16)).view(np.float32)
    r = (x - hi_f).view(np.uint32)
    lo = (r + np.uint32(0x7FFF) + ((r >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    return h.astype(np.uint16), lo.astype(np.uint16)


def split_weight(w: np.ndarray) -> np.ndarray:
    """W float32[N, K] -> uint16[N / 32, KC, 2 (hi, lo), 2 (n tile), 16 pairs, 16, 2] (see
    the module doc), zero padded."""
    w = np.ascontiguousarray(w, np.float32)
    N, K = w.shape
    out = np.empty(((N + 31) // 32, (K + 31) // 32, 2, 2, 16, 16, 2), np.uint16)
    _split_weight(w, out)
    return out


@njit(**_JIT)
def _split_weight(w, out):
    """split_weight's loop. Serial on purpose: a model loads on one thread and runs on
    another, and a parallel region would leave the loader thread an OpenMP team of its own
    (see _int8.py's repacking)."""
    N, K = w.shape
    NB, KC = out.shape[0], out.shape[1]
    for nb in range(NB):
        for c in range(KC):
            for nt in range(2):
                for col in range(16):
                    n = nb * 32 + nt * 16 + col
                    for pair in range(16):
                        for e in range(2):
                            k = c * 32 + pair * 2 + e
                            v = w[n, k] if n < N and k < K else np.float32(0.0)
                            h, lb = _split1(v)
                            out[nb, c, 0, nt, pair, col, e] = h
                            out[nb, c, 1, nt, pair, col, e] = lb


@njit(**_PJIT)
def split_rows(x, a, f16, gelu, table):
    """x float32[M, K] (C-contiguous) -> a uint16[Mp / 32, KC, 2, 32, 32] (hi, lo: see
    split_array and the module doc), padding rows and columns zero; 32-row blocks in
    parallel. gelu: x replaced by ggml's GELU of it first (_gelu_f16, from `table`: the
    GELU at every float16, kernels.gelu_f16_table). f16: x rounded to float16 (ggml's
    activations for f16 matrices; then hi + lo is exact)."""
    M, K = x.shape
    nmb, KC = a.shape[0], a.shape[1]
    KF = K // 32                        # chunks without padding
    for mb in prange(nmb):
        g = np.empty(32, np.float32)
        for r in range(32):
            i = mb * 32 + r
            for c in range(KC):
                if i < M and c < KF:
                    src = x[i, c * 32:].ctypes.data
                    if gelu:
                        for kk in range(32):
                            g[kk] = _gelu_f16(x[i, c * 32 + kk], table)
                        src = g.ctypes.data
                    hi = a[mb, c, 0, r].ctypes.data
                    lo = a[mb, c, 1, r].ctypes.data
                    _vsplit16(src, hi, lo, f16)
                    _vsplit16(src + 64, hi + 32, lo + 32, f16)
                    continue
                for kk in range(32):
                    k = c * 32 + kk
                    if i < M and k < K:
                        v = x[i, k]
                        if gelu:
                            v = _gelu_f16(v, table)
                        if f16:
                            v = _f16_round(v)
                        h, lb = _split1(v)
                        a[mb, c, 0, r, kk] = h
                        a[mb, c, 1, r, kk] = lb
                    else:
                        a[mb, c, 0, r, kk] = 0
                        a[mb, c, 1, r, kk] = 0


@intrinsic
def _f16_round(typingctx, x):
    """float32 -> nearest float16 (ties to even) -> float32 (vcvtps2ph / vcvtph2ps)."""
    def codegen(context, builder, sig, args):
        return builder.fpext(builder.fptrunc(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.float32), codegen


@intrinsic
def _f16_bits(typingctx, x):
    """float32 -> the bit pattern of the nearest float16 (ties to even)."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
    return types.uint16(types.float32), codegen


@njit(inline="always", nogil=True)
def _gelu_f16(v, table):
    """ggml's GELU of one value (as kernels.gelu_f16_at): its shortcuts beyond +-10, else the
    table's entry at the value rounded to float16."""
    if v <= np.float32(-10.0):
        return np.float32(0.0)
    if v >= np.float32(10.0):
        return v
    return table[_f16_bits(v)]




# -- the product ------------------------------------------------------------------------------

@njit(inline="always", nogil=True)
def _block(ahi, alo, acs, bhi, blo, bcs, bts, c0, c1, out, so, init, bias):
    """The 32 x 32 float32 block at address out (rows so bytes apart) (+)= its product over
    K chunks c0 .. c1 - 1. A: the two tiles of chunk c at ahi + c acs (rows 16-31 1 KB
    after rows 0-15), the lo halves at alo + c acs. B: the two n tiles of chunk c at
    bhi + c bcs and bts bytes further, the lo halves at blo + c bcs. init: 0 start from
    zero, 1 from bias (32 float32 at address bias, every row), 2 from out."""
    if init == 0:
        _tzero(0)
        _tzero(1)
        _tzero(2)
        _tzero(3)
    elif init == 1:
        _tload(0, bias, 0)
        _tload(1, bias + 64, 0)
        _tload(2, bias, 0)
        _tload(3, bias + 64, 0)
    else:
        _tload(0, out, so)
        _tload(1, out + 64, so)
        _tload(2, out + 16 * so, so)
        _tload(3, out + 16 * so + 64, so)
    for c in range(c0, c1):
        ah = ahi + c * acs
        al = alo + c * acs
        bh = bhi + c * bcs
        bl = blo + c * bcs
        _tload(4, ah, 64)
        _tload(5, ah + 1024, 64)
        _tload(6, bh, 64)
        _tload(7, bh + bts, 64)
        _tdp(0, 4, 6)
        _tdp(1, 4, 7)
        _tdp(2, 5, 6)
        _tdp(3, 5, 7)
        _tload(6, bl, 64)
        _tload(7, bl + bts, 64)
        _tdp(0, 4, 6)
        _tdp(1, 4, 7)
        _tdp(2, 5, 6)
        _tdp(3, 5, 7)
        _tload(4, al, 64)
        _tload(5, al + 1024, 64)
        _tload(6, bh, 64)
        _tload(7, bh + bts, 64)
        _tdp(0, 4, 6)
        _tdp(1, 4, 7)
        _tdp(2, 5, 6)
        _tdp(3, 5, 7)
    _tstore(0, out, so)
    _tstore(1, out + 64, so)
    _tstore(2, out + 16 * so, so)
    _tstore(3, out + 16 * so + 64, so)


@njit(**_PJIT)
def _gemm(cfg, a, b, bias, has_bias, out, panel, kb, mg, nw, counter):
    """out[Mp, Np] = A @ W^T (+ bias) from the split operands a (split_rows) and b
    (split_weight): see the module doc. A work item is mg
    32-row blocks times a panel of `panel` 32-column blocks; per pass of kb K chunks the
    item's A chunks stay in L1 across the panel, each column block's B chunks across the mg
    row blocks. nw threads take items from counter."""
    nmb = a.shape[0]
    nnb, KC = b.shape[0], b.shape[1]
    npn = (nnb + panel - 1) // panel
    nmg = (nmb + mg - 1) // mg
    items = nmg * npn
    a0, b0 = a.ctypes.data, b.ctypes.data
    bz = bias.ctypes.data
    cnt = counter.ctypes.data
    cfga = cfg.ctypes.data
    for _w in prange(nw):
        # the item's C blocks accumulate here, 32 x 32 float32 each (rows 128 bytes apart:
        # out's own rows are Np * 4 bytes apart, a multiple of 4 KB for the usual widths,
        # which would put a tile's 16 rows in one L1 set)
        cs = np.empty((panel * mg, 32, 32), np.float32)
        csa = cs.ctypes.data
        _tile_config(cfga)
        while True:
            it = _fetch_add(cnt, np.int64(1))
            if it >= items:
                break
            p = it // nmg            # consecutive items: the same panel, the next rows
            g = it - p * nmg
            j0 = p * panel
            j1 = min(nnb, j0 + panel)
            m0 = g * mg
            m1 = min(nmb, m0 + mg)
            for k0 in range(0, KC, kb):
                k1 = min(KC, k0 + kb)
                if k0 > 0:
                    init = 2
                elif has_bias:
                    init = 1
                else:
                    init = 0
                for j in range(j0, j1):
                    bj = b0 + j * KC * 4096
                    for mb in range(m0, m1):
                        am = a0 + mb * KC * 4096
                        _block(am, am + 2048, 4096, bj, bj + 2048, 4096, 1024, k0, k1,
                               csa + ((j - j0) * mg + mb - m0) * 4096, 128, init,
                               bz + j * 128)
            for j in range(j0, j1):
                for mb in range(m0, m1):
                    blk = cs[(j - j0) * mg + mb - m0]
                    for r in range(32):
                        out[mb * 32 + r, j * 32:j * 32 + 32] = blk[r]
        _tile_release()


class AmxMatrix:
    """A float32 (or f16) matrix W[N, K] split for the AMX kernel; y = x @ W^T."""

    def __init__(self, w: np.ndarray):
        if not available():        # also asks for the tile permission, once per process
            raise RuntimeError("AMX-BF16 is not available in this process")
        w = np.asarray(w, np.float32)
        self.N, self.K = w.shape
        self.b = split_weight(w)
        self.Np = self.b.shape[0] * 32
        self.Kp = self.b.shape[1] * 32
        # 32-column blocks per work item: about PANEL_BYTES of split weights
        per_block = 32 * self.Kp * 4
        self.panel = max(1, min(self.Np // 32, PANEL_BYTES // per_block))

    def matmul(self, x: np.ndarray, bias: np.ndarray | None = None, nw: int | None = None,
               split=None, f16: bool = False, gelu: np.ndarray | None = None) -> np.ndarray:
        """float32[M, N] = x @ W^T (+ bias). split: x's split_x, to share one split between
        matrices of the same input; f16: x rounded to float16 first; gelu: ggml's GELU
        table (kernels.gelu_f16_table): the product of GELU(x) instead, in the same pass."""
        a = split if split is not None else split_x(x, self.K, f16, gelu)
        M = x.shape[0]
        Mp = a.shape[0] * 32
        if a.shape[1] * 32 != self.Kp:
            raise ValueError(f"amx matmul: x has {a.shape[1] * 32} padded columns, W {self.Kp}")
        out = np.empty((Mp, self.Np), np.float32)
        if bias is not None:
            b = np.zeros(self.Np, np.float32)
            b[:self.N] = bias
        else:
            b = np.zeros(32, np.float32)
        if nw is None:
            import numba
            nw = numba.get_num_threads()
        _gemm(_CFG, a, self.b, b, bias is not None, out, self.panel, K_CHUNKS,
              M_GROUP, nw, np.zeros(1, np.int64))
        if self.Np == self.N:
            return out[:M]
        return np.ascontiguousarray(out[:M, :self.N])


_NO_TABLE = np.zeros(1, np.float32)


def split_x(x: np.ndarray, K: int | None = None, f16: bool = False,
            gelu: np.ndarray | None = None) -> np.ndarray:
    """Activations float32[M, K] -> their split for AmxMatrix.matmul (gelu, f16: see it)."""
    x = np.ascontiguousarray(x, np.float32)
    M, Kx = x.shape
    if K is not None and Kx != K:
        raise ValueError(f"amx matmul: x has {Kx} columns but the weight rows have {K}")
    Mp = (M + 31) // 32 * 32
    Kp = (Kx + 31) // 32 * 32
    a = np.empty((Mp // 32, Kp // 32, 2, 32, 32), np.uint16)
    if not x.flags.writeable:
        x = x.copy()
    split_rows(x, a, bool(f16), gelu is not None, _NO_TABLE if gelu is None else gelu)
    return a


# -- attention --------------------------------------------------------------------------------

_VF = ir.VectorType(ir.FloatType(), 16)
_VI = ir.VectorType(ir.IntType(32), 16)
_VH = ir.VectorType(ir.IntType(16), 16)


def _vptr(builder, addr, vty):
    return builder.inttoptr(addr, vty.as_pointer())


def _vsplat(builder, x, vty):
    u = ir.Constant(vty, ir.Undefined)
    v = builder.insert_element(u, x, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(v, u, ir.Constant(_VI, [0] * 16))


def _vround_bf16(builder, u):
    """Round-to-nearest-even of float32 bits u (<16 x i32>) to bf16, in the high 16 bits."""
    one = ir.Constant(_VI, [1] * 16)
    b = builder.and_(builder.lshr(u, ir.Constant(_VI, [16] * 16)), one)
    return builder.and_(builder.add(builder.add(u, ir.Constant(_VI, [0x7FFF] * 16)), b),
                        ir.Constant(_VI, [-65536] * 16))


@intrinsic
def _vmax16(typingctx, acc, src):
    """16 floats at acc = max(those, the 16 at src) (in place)."""
    def codegen(context, builder, sig, args):
        pa, ps = _vptr(builder, args[0], _VF), _vptr(builder, args[1], _VF)
        a = builder.load(pa, align=4)
        x = builder.load(ps, align=4)
        builder.store(builder.select(builder.fcmp_ordered(">", x, a), x, a), pa, align=4)
        return context.get_dummy_value()
    return types.none(types.intp, types.intp), codegen


@intrinsic
def _vexp_split16(typingctx, src, scale, mx, acc, hi, lo):
    """e = exp(x scale - mx) of the 16 floats x at src (0 where that is below -88); the 16
    floats at acc += e; e split (see split_array) into 16 bf16 at hi and 16 at lo."""
    def codegen(context, builder, sig, args):
        mod = builder.module

        def c(v):
            return ir.Constant(_VF, [float(v)] * 16)

        def fma(a, b, d):
            f = mod.globals.get("llvm.fma.v16f32") or ir.Function(
                mod, ir.FunctionType(_VF, [_VF] * 3), "llvm.fma.v16f32")
            return builder.call(f, [a, b, d])
        x = builder.load(_vptr(builder, args[0], _VF), align=4)
        v = fma(x, _vsplat(builder, args[1], _VF),
                builder.fneg(_vsplat(builder, args[2], _VF)))
        under = builder.fcmp_ordered("<", v, c(-88.0))
        v = builder.select(under, c(-88.0), v)
        rint = mod.globals.get("llvm.rint.v16f32") or ir.Function(
            mod, ir.FunctionType(_VF, [_VF]), "llvm.rint.v16f32")
        n = builder.call(rint, [builder.fmul(v, c(1.44269504088896341))])
        r = fma(n, c(-0.693359375), v)
        r = fma(n, c(2.12194440e-4), r)
        y = c(1.9875691500e-4)
        for k in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1,
                  5.0000001201e-1):
            y = fma(y, r, c(k))
        y = fma(y, builder.fmul(r, r), r)
        y = builder.fadd(y, c(1.0))
        bits = builder.shl(builder.add(builder.fptosi(n, _VI), ir.Constant(_VI, [127] * 16)),
                           ir.Constant(_VI, [23] * 16))
        e = builder.fmul(y, builder.bitcast(bits, _VF))
        e = builder.select(under, c(0.0), e)
        pa = _vptr(builder, args[3], _VF)
        builder.store(builder.fadd(builder.load(pa, align=4), e), pa, align=4)
        h = _vround_bf16(builder, builder.bitcast(e, _VI))
        rem = builder.fsub(e, builder.bitcast(h, _VF))
        lo = _vround_bf16(builder, builder.bitcast(rem, _VI))
        sh = ir.Constant(_VI, [16] * 16)
        builder.store(builder.trunc(builder.lshr(h, sh), _VH), _vptr(builder, args[4], _VH),
                      align=2)
        builder.store(builder.trunc(builder.lshr(lo, sh), _VH), _vptr(builder, args[5], _VH),
                      align=2)
        return context.get_dummy_value()
    return types.none(types.intp, types.float32, types.float32, types.intp, types.intp,
                      types.intp), codegen


@intrinsic
def _vsplit16(typingctx, src, hi, lo, f16):
    """The 16 floats at src (rounded to float16 first if f16) split (see split_array) into
    16 bf16 at hi and 16 at lo."""
    def codegen(context, builder, sig, args):
        x = builder.load(_vptr(builder, args[0], _VF), align=4)
        r16 = builder.fpext(builder.fptrunc(x, ir.VectorType(ir.HalfType(), 16)), _VF)
        x = builder.select(builder.icmp_unsigned("!=", args[3], ir.Constant(args[3].type, 0)),
                           r16, x)
        h = _vround_bf16(builder, builder.bitcast(x, _VI))
        rem = builder.fsub(x, builder.bitcast(h, _VF))
        lo_ = _vround_bf16(builder, builder.bitcast(rem, _VI))
        sh = ir.Constant(_VI, [16] * 16)
        builder.store(builder.trunc(builder.lshr(h, sh), _VH), _vptr(builder, args[1], _VH),
                      align=2)
        builder.store(builder.trunc(builder.lshr(lo_, sh), _VH), _vptr(builder, args[2], _VH),
                      align=2)
        return context.get_dummy_value()
    return types.none(types.intp, types.intp, types.intp, types.boolean), codegen


@njit(inline="always", nogil=True)
def _split1(v):
    """(hi, lo) bf16 bits of a float32 (see split_array)."""
    u = _f32_bits(v)
    h = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    ru = _f32_bits(v - _bits_f32(h))
    lb = (ru + np.uint32(0x7FFF) + ((ru >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    return np.uint16(h >> np.uint32(16)), np.uint16(lb)


@njit(**_PJIT)
def _attention(cfg, qkv, T, H, D, scale, qh, ql, kh, kl, vh, vl, k32h, k32l, v32h, v32l, out, nw,
               counter):
    """out[T, H D] = softmax(scale Q K^T) V per head, Q, K, V the column thirds of qkv
    [>= T, 3 H D] (head h: columns h D .. h D + D - 1 of each third). qh..vl: scratch for the
    split operands (attention's doc); items (head, 32 query rows) dealt from counter."""
    nmb, KCd = qh.shape[1], qh.shape[2]
    KCt = vh.shape[2]
    Tp, Dp = nmb * 32, KCd * 32
    e = H * D
    # the operands split: Q as A tiles, K and V^T as B tiles (a weight's layout)
    for it in prange(H * nmb):
        h = it // nmb
        tb = it - h * nmb
        kt_h = np.empty((32, Dp), np.uint16)
        kt_l = np.empty((32, Dp), np.uint16)
        vt_h = np.empty((32, Dp), np.uint16)
        vt_l = np.empty((32, Dp), np.uint16)
        kt_h32 = kt_h.view(np.uint32)
        kt_l32 = kt_l.view(np.uint32)
        for r in range(32):
            t = tb * 32 + r
            for c in range(KCd):            # Q: whole chunks 16 lanes at a time
                if t < T and (c + 1) * 32 <= D:
                    src = qkv[t, h * D + c * 32:].ctypes.data
                    _vsplit16(src, qh[h, tb, c, r].ctypes.data, ql[h, tb, c, r].ctypes.data,
                              False)
                    _vsplit16(src + 64, qh[h, tb, c, r].ctypes.data + 32,
                              ql[h, tb, c, r].ctypes.data + 32, False)
                    continue
                for dd in range(32):
                    d = c * 32 + dd
                    if t < T and d < D:
                        q0, q1 = _split1(qkv[t, h * D + d])
                    else:
                        q0 = q1 = np.uint16(0)
                    qh[h, tb, c, r, dd] = q0
                    ql[h, tb, c, r, dd] = q1
            # K and V rows split into the scratch, 16 lanes at a time where whole
            for sec in range(2):
                th, tl = (kt_h, kt_l) if sec == 0 else (vt_h, vt_l)
                col = (sec + 1) * e + h * D
                for c in range(KCd):
                    if t < T and (c + 1) * 32 <= D:
                        src = qkv[t, col + c * 32:].ctypes.data
                        _vsplit16(src, th[r, c * 32:].ctypes.data, tl[r, c * 32:].ctypes.data,
                                  False)
                        _vsplit16(src + 64, th[r, c * 32 + 16:].ctypes.data,
                                  tl[r, c * 32 + 16:].ctypes.data, False)
                        continue
                    for dd in range(32):
                        d = c * 32 + dd
                        if t < T and d < D:
                            th[r, d], tl[r, d] = _split1(qkv[t, col + d])
                        else:
                            th[r, d] = 0
                            tl[r, d] = 0
        # K's B tiles: pairs of K values (d, d + 1) of a row are one uint32, 16 rows apart
        for r in range(32):
            t = tb * 32 + r
            for c in range(KCd):
                for pp in range(16):
                    k32h[h, t // 16, c, pp, t % 16] = kt_h32[r, c * 16 + pp]
                    k32l[h, t // 16, c, pp, t % 16] = kt_l32[r, c * 16 + pp]
        # V^T's: pairs of rows (r, r + 1) of a column d are one uint32
        sh = np.uint32(16)
        for r2 in range(16):
            for d in range(Dp):
                v32h[h, d // 16, tb, r2, d % 16] = (np.uint32(vt_h[2 * r2, d])
                                                    | (np.uint32(vt_h[2 * r2 + 1, d]) << sh))
                v32l[h, d // 16, tb, r2, d % 16] = (np.uint32(vt_l[2 * r2, d])
                                                    | (np.uint32(vt_l[2 * r2 + 1, d]) << sh))
    items = H * nmb
    cnt = counter.ctypes.data
    cfga = cfg.ctypes.data
    sbk = KCd * 1024                    # a K n-tile's bytes (all its chunks)
    sbv = KCt * 1024
    hk = (Tp // 16) * sbk               # a head's K (or V^T) bytes
    hv = (Dp // 16) * sbv
    hq = nmb * KCd * 2048
    scl = np.float32(scale)
    for _w in prange(nw):
        # scores: rows Tp + 16 floats apart (Tp * 4 bytes, a multiple of 4 KB at T = 1024,
        # would put each stored C tile's 16 rows in one L1 set)
        St = Tp + 16
        S = np.empty((32, St), np.float32)
        ph = np.empty((KCt, 32, 32), np.uint16)
        pl = np.empty((KCt, 32, 32), np.uint16)
        o = np.empty((32, Dp), np.float32)
        inv = np.empty(32, np.float32)
        acc = np.empty(16, np.float32)
        acca = acc.ctypes.data
        sa, pa, pla, oa = S.ctypes.data, ph.ctypes.data, pl.ctypes.data, o.ctypes.data
        _tile_config(cfga)
        while True:
            it = _fetch_add(cnt, np.int64(1))
            if it >= items:
                break
            h = it // nmb
            mb = it - h * nmb
            qa = qh.ctypes.data + h * hq + mb * KCd * 2048
            qla = ql.ctypes.data + h * hq + mb * KCd * 2048
            for j in range(Tp // 32):
                _block(qa, qla, 2048, kh.ctypes.data + h * hk + 2 * j * sbk,
                       kl.ctypes.data + h * hk + 2 * j * sbk, 1024, sbk, 0, KCd,
                       sa + j * 128, St * 4, 0, sa)
            for r in range(32):
                row = S[r]
                for t in range(T, Tp):
                    row[t] = -np.inf
                ra = sa + r * St * 4
                # the row's max and sum in 16 lanes (a fixed order: the same bits always)
                for l in range(16):
                    acc[l] = row[l]
                for t0 in range(16, Tp, 16):
                    _vmax16(acca, ra + t0 * 4)
                mx = acc[0]
                for l in range(1, 16):
                    mx = acc[l] if acc[l] > mx else mx
                mx *= scl
                for l in range(16):
                    acc[l] = np.float32(0.0)
                for t0 in range(0, Tp, 16):
                    # P's A tiles: chunk t0 // 32, row r, values t0 % 32 ..
                    po = ((t0 // 32) * 1024 + r * 32 + t0 % 32) * 2
                    _vexp_split16(ra + t0 * 4, scl, mx, acca, pa + po, pla + po)
                s = np.float32(0.0)
                for l in range(16):
                    s += acc[l]
                inv[r] = np.float32(1.0) / s
            for j in range(Dp // 32):
                _block(pa, pla, 2048, vh.ctypes.data + h * hv + 2 * j * sbv,
                       vl.ctypes.data + h * hv + 2 * j * sbv, 1024, sbv, 0, KCt,
                       oa + j * 128, Dp * 4, 0, oa)
            for r in range(32):
                t = mb * 32 + r
                if t < T:
                    for d in range(D):
                        out[t, h * D + d] = o[r, d] * inv[r]
        _tile_release()


def attention(qkv: np.ndarray, T: int, H: int, D: int, scale: float,
              nw: int | None = None) -> np.ndarray:
    """Full (non-causal) attention of T positions, float32[T, H D], from the q/k/v product
    qkv float32[>= T, 3 H D] (q, k, v: its column thirds), every product on the AMX-BF16
    tiles split as the matmuls are: per head and 32 query rows, S = Q K^T (C tiles), a
    softmax of the rows in float32, P split, then P V. The scores of one block (32 x T)
    stay in a thread's scratch; K and V^T are split once per call into B tiles."""
    if not available():
        raise RuntimeError("AMX-BF16 is not available in this process")
    if qkv.dtype != np.float32 or qkv.ndim != 2 or qkv.shape[0] < T or \
            qkv.shape[1] < 3 * H * D or qkv.strides[1] != 4:
        raise ValueError("amx attention: qkv must be float32[>= T, 3 H D], rows contiguous")
    nmb = (T + 31) // 32
    KCd = (D + 31) // 32
    Tp, Dp = nmb * 32, KCd * 32
    qh = np.empty((H, nmb, KCd, 32, 32), np.uint16)
    ql = np.empty_like(qh)
    kh = np.empty((H, Tp // 16, KCd, 16, 16, 2), np.uint16)
    kl = np.empty_like(kh)
    vh = np.empty((H, Dp // 16, nmb, 16, 16, 2), np.uint16)
    vl = np.empty_like(vh)
    out = np.empty((T, H * D), np.float32)
    if nw is None:
        import numba
        nw = numba.get_num_threads()
    def pairs(a):       # the same bytes, a pair of bf16 as one uint32
        return a.view(np.uint32).reshape(a.shape[:-1])
    _attention(_CFG, qkv, T, H, D, np.float32(scale), qh, ql, kh, kl, vh, vl, pairs(kh),
               pairs(kl), pairs(vh), pairs(vl), out, nw, np.zeros(1, np.int64))
    return out
