"""Per-type numba kernels for weights in their GGUF blocks, and the parallel drivers that run them.

Weights come in as uint8[N, n_blocks, block_bytes] (a free reshape of the row bytes).
Two levels, so that a type's code compiles once, small and serial, and the parallel loops
compile once for every type:
- per type, two serial kernels written out below (each a generic body `inline="always"`
  with the type's decoder or dot, so the decoder is a direct call to a global): `dec_T`
  decodes rows n0 .. n1-1 into a float32 buffer (embedding rows, and the multi-row
  kernel's 16-row chunks), `dot_T` computes out[m, n] = dot(row n, x[m]) for rows n0 .. n1-1
  and every x row (the matvec and the few-row matvec). They take addresses and sizes only
  (intp arguments), and the drivers call them through their C entry points, as the int8
  path calls its tile kernels (_int8.py);
- three parallel drivers (rows, matvec, multi-row) whose argument types never depend on the
  weight type. Before, each type had four parallel kernels of its own (52 in all, seconds
  of compile time each), so install warmed for minutes and a model with a type not yet
  compiled stalled its first request.
Results are the same bits as before: the same decoders and dots on the same rows, in the
same order.

numba's disk cache is keyed on the content of this file only, yet the kernels inline code
from _decode, _dot and _simd. So this file carries a hash of those three (`_DEPS_HASH`): an
edit there changes this file too, which invalidates the cache. If the hash is stale (an edit
without updating it), caching is switched off rather than loading stale machine code, and
tests/test_matmul.py fails with the value to paste here.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import carray, njit, prange, types
from numba.extending import intrinsic

from . import _decode as D
from . import _stamp
from . import _dot as P
from ._simd import vfma, vhsum, vload, vzero

_DEPS = ("_decode.py", "_dot.py", "_simd.py")
_DEPS_HASH = "e59820164470a0ef"


_CACHE = _stamp.current(_DEPS, _DEPS_HASH)        # see _stamp.py
_f32 = np.float32
_PAR = dict(nogil=True, cache=_CACHE, parallel=True)
_SER = dict(nogil=True, cache=_CACHE)
_CHUNK_ROWS = 16        # output rows per matvec work item
# prange splits work items statically. Dynamic scheduling (numba.set_parallel_chunksize)
# was measured 10-22% slower on one thread for these short calls, so it is not used.


def _pointer_to(nbty):
    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], context.get_value_type(nbty).as_pointer())

    @intrinsic
    def ptr(typingctx, addr):
        return types.CPointer(nbty)(types.intp), codegen
    return ptr


_u8p, _f32p = _pointer_to(types.uint8), _pointer_to(types.float32)


def _codegen_call(nargs: int):
    def codegen(context, builder, sig, args):
        i64 = ir.IntType(64)
        fty = ir.FunctionType(ir.VoidType(), [i64] * nargs)
        builder.call(builder.inttoptr(args[0], fty.as_pointer()), args[1:])
        return context.get_dummy_value()
    return codegen


_DEC_ARGS, _DOT_ARGS = 6, 10


@intrinsic
def _call_dec(typingctx, fn, n0, n1, wp, N, nb, op):
    """Call the dec_T kernel at address fn."""
    return types.void(*([types.intp] * (_DEC_ARGS + 1))), _codegen_call(_DEC_ARGS)


@intrinsic
def _call_dot(typingctx, fn, n0, n1, wp, N, nb, xp, xlen, M, op, ldo):
    """Call the dot_T kernel at address fn."""
    return types.void(*([types.intp] * (_DOT_ARGS + 1))), _codegen_call(_DOT_ARGS)


# -- the per-type bodies ------------------------------------------------------------------

@njit(inline="always")
def _dec_body(dec, bs, ts, n0, n1, wp, N, nb, op):
    """Rows n0 .. n1-1 of w (at wp, uint8[N, nb, ts]) decoded, exactly, into the float32
    buffer at op, row after row (nb * bs values each)."""
    w = carray(_u8p(wp), (N, nb, ts))
    K = nb * bs
    out = carray(_f32p(op), ((n1 - n0) * K,))
    for n in range(n0, n1):
        for b in range(nb):
            dec(w, n, b, (n * nb + b) * ts, out, (n - n0) * K + b * bs)


@njit(inline="always")
def _dot_body(dot, ts, n0, n1, wp, N, nb, xp, xlen, M, op, ldo):
    """out[m, n] = dot(row n of w, x[m]) for rows n0 .. n1-1 and m < M: x float32[M, xlen]
    at xp, out float32[M, ldo] at op. Each weight row comes from memory once and stays in L1
    for the M dots, and a row's result does not depend on M."""
    w = carray(_u8p(wp), (N, nb, ts))
    x = carray(_f32p(xp), (M, xlen))
    out = carray(_f32p(op), (M, ldo))
    for n in range(n0, n1):
        for m in range(M):
            out[m, n] = dot(w, n, x[m])


@njit(inline="always", nogil=True)
def _put(out, m, n, M, N, v):
    if m < M and n < N:
        out[m, n] = vhsum(v)


@njit(nogil=True, cache=_CACHE)
def _micro4x4(buf, wo, xp, xo, K, out, m0, n0, M, N):
    """out[m0:m0+4, n0:n0+4] = x rows (from xp at xo) . decoded weight rows (buf at wo).

    16 vector accumulators along k, one horizontal sum each at the end: per 16 values of k
    it is 8 loads and 16 FMAs, so it runs near the FMA ceiling with no transposes.
    """
    a00 = vzero(); a01 = vzero(); a02 = vzero(); a03 = vzero()
    a10 = vzero(); a11 = vzero(); a12 = vzero(); a13 = vzero()
    a20 = vzero(); a21 = vzero(); a22 = vzero(); a23 = vzero()
    a30 = vzero(); a31 = vzero(); a32 = vzero(); a33 = vzero()
    for k in range(0, K, 16):
        w0 = vload(buf, wo + k)
        w1 = vload(buf, wo + K + k)
        w2 = vload(buf, wo + 2 * K + k)
        w3 = vload(buf, wo + 3 * K + k)
        x0 = vload(xp, xo + k)
        a00 = vfma(x0, w0, a00); a01 = vfma(x0, w1, a01); a02 = vfma(x0, w2, a02); a03 = vfma(x0, w3, a03)
        x1 = vload(xp, xo + K + k)
        a10 = vfma(x1, w0, a10); a11 = vfma(x1, w1, a11); a12 = vfma(x1, w2, a12); a13 = vfma(x1, w3, a13)
        x2 = vload(xp, xo + 2 * K + k)
        a20 = vfma(x2, w0, a20); a21 = vfma(x2, w1, a21); a22 = vfma(x2, w2, a22); a23 = vfma(x2, w3, a23)
        x3 = vload(xp, xo + 3 * K + k)
        a30 = vfma(x3, w0, a30); a31 = vfma(x3, w1, a31); a32 = vfma(x3, w2, a32); a33 = vfma(x3, w3, a33)
    _put(out, m0, n0, M, N, a00); _put(out, m0, n0 + 1, M, N, a01)
    _put(out, m0, n0 + 2, M, N, a02); _put(out, m0, n0 + 3, M, N, a03)
    _put(out, m0 + 1, n0, M, N, a10); _put(out, m0 + 1, n0 + 1, M, N, a11)
    _put(out, m0 + 1, n0 + 2, M, N, a12); _put(out, m0 + 1, n0 + 3, M, N, a13)
    _put(out, m0 + 2, n0, M, N, a20); _put(out, m0 + 2, n0 + 1, M, N, a21)
    _put(out, m0 + 2, n0 + 2, M, N, a22); _put(out, m0 + 2, n0 + 3, M, N, a23)
    _put(out, m0 + 3, n0, M, N, a30); _put(out, m0 + 3, n0 + 1, M, N, a31)
    _put(out, m0 + 3, n0 + 2, M, N, a32); _put(out, m0 + 3, n0 + 3, M, N, a33)


@njit(nogil=True, cache=_CACHE)
def _micro1x4(buf, wo, xp, xo, K, out, m, n0, N):
    """out[m, n0:n0+4] for one x row: per output the very same FMA chain and lane sum as
    _micro4x4, so a row's result does not depend on how many rows share the call (batch
    invariance: a request decodes the same alone or batched, chunked or not)."""
    a0 = vzero(); a1 = vzero(); a2 = vzero(); a3 = vzero()
    for k in range(0, K, 16):
        x0 = vload(xp, xo + k)
        a0 = vfma(x0, vload(buf, wo + k), a0)
        a1 = vfma(x0, vload(buf, wo + K + k), a1)
        a2 = vfma(x0, vload(buf, wo + 2 * K + k), a2)
        a3 = vfma(x0, vload(buf, wo + 3 * K + k), a3)
    M = out.shape[0]
    _put(out, m, n0, M, N, a0); _put(out, m, n0 + 1, M, N, a1)
    _put(out, m, n0 + 2, M, N, a2); _put(out, m, n0 + 3, M, N, a3)



_GEMM_ROWS = 16         # weight rows decoded per step (4 micro-kernel columns)
_GEMM_MT = 64           # x rows per pass over a decoded chunk (64 x K floats stay in L2)
_GEMM_SPLIT = 64        # work items for prange; each owns one decode buffer


# -- the drivers (one compiled signature each, whatever the type) -------------------------

@njit(**_PAR)
def rows_driver(dec, w, ids, out):
    """out[r, :] = decoded row ids[r] of w, exact (dec: the type's dec_T address). out is
    float32[len(ids), K]."""
    N, nb = w.shape[0], w.shape[1]
    K = out.shape[1]
    for r in prange(ids.shape[0]):
        n = ids[r]
        _call_dec(dec, n, n + 1, w.ctypes.data, N, nb, out.ctypes.data + r * K * 4)


@njit(**_SER)
def rows_serial(dec, w, ids, out):
    """rows_driver on the calling thread: a decode step's embedding row or two is a
    microsecond of work, and a parallel region to wake costs tens (far more when another
    program holds a core)."""
    N, nb = w.shape[0], w.shape[1]
    K = out.shape[1]
    for r in range(ids.shape[0]):
        n = ids[r]
        _call_dec(dec, n, n + 1, w.ctypes.data, N, nb, out.ctypes.data + r * K * 4)


# below this many rows, rows() decodes on the calling thread (rows_serial)
SERIAL_ROWS = 16


@njit(**_PAR)
def matvec_driver(dot, w, x, out):
    """out[m, n] = dot(row n of w, x[m]) for the few rows of x (dot: the type's dot_T
    address), parallel over chunks of 16 weight rows."""
    N, nb = w.shape[0], w.shape[1]
    nch = (N + _CHUNK_ROWS - 1) // _CHUNK_ROWS
    for c in prange(nch):
        _call_dot(dot, c * _CHUNK_ROWS, min(N, (c + 1) * _CHUNK_ROWS), w.ctypes.data, N, nb,
                  x.ctypes.data, x.shape[1], x.shape[0], out.ctypes.data, out.shape[1])


@njit(**_PAR)
def matmul_driver(dec, w, xp, out):
    """out[m, n] = dot(x[m], row n of w) for M = out.shape[0] >= 1 rows (dec: the type's
    dec_T address).

    Rows go four at a time through the 4x4 micro-kernel and the remainder one at a time through
    the 1x4 one; both give a row bit-identical results. Each work item decodes 16 weight rows
    at a time (exactly, into an L2-sized float buffer) and runs the 4x4 register-blocked
    micro-kernel over all x rows, so each weight byte is decoded once per call. The
    micro-kernel is type-independent and compiled once.
    """
    N = w.shape[0]
    nb = w.shape[1]
    M = out.shape[0]
    M4 = M // 4 * 4
    K = xp.shape[1]
    nch = (N + _GEMM_ROWS - 1) // _GEMM_ROWS
    nsplit = min(nch, _GEMM_SPLIT)
    per = (nch + nsplit - 1) // nsplit
    for sp in prange(nsplit):
        buf = np.zeros(_GEMM_ROWS * K, _f32)
        for c in range(sp * per, min(nch, (sp + 1) * per)):
            n0 = c * _GEMM_ROWS
            _call_dec(dec, n0, min(N, n0 + _GEMM_ROWS), w.ctypes.data, N, nb, buf.ctypes.data)
            for mt in range(0, M4, _GEMM_MT):
                for j in range(0, _GEMM_ROWS, 4):
                    for m0 in range(mt, min(M4, mt + _GEMM_MT), 4):
                        _micro4x4(buf, j * K, xp, m0 * K, K, out, m0, n0 + j, M, N)
            for m in range(M4, M):
                for j in range(0, _GEMM_ROWS, 4):
                    _micro1x4(buf, j * K, xp, m * K, K, out, m, n0 + j, N)


# -- per type: the two serial kernels, written out (each names its decoder, a global) ------

@njit(**_SER)
def dec_f32(n0, n1, wp, N, nb, op):
    _dec_body(D.dec_f32, 32, 128, n0, n1, wp, N, nb, op)


@njit(**_SER)
def dot_f32(n0, n1, wp, N, nb, xp, xlen, M, op, ldo):
    _dot_body(P.dot_f32, 128, n0, n1, wp, N, nb, xp, xlen, M, op, ldo)


@njit(**_SER)
def dec_f16(n0, n1, wp, N, nb, op):
    _dec_body(D.dec_f16, 32, 64, n0, n1, wp, N, nb, op)


@njit(**_SER)
def dot_f16(n0, n1, wp, N, nb, xp, xlen, M, op, ldo):
    _dot_body(P.dot_f16, 64, n0, n1, wp, N, nb, xp, xlen, M, op, ldo)


@njit(**_SER)
def dec_bf16(n0, n1, wp, N, nb, op):
    _dec_body(D.dec_bf16, 32, 64, n0, n1, wp, N, nb, op)


@njit(**_SER)
def dot_bf16(n0, n1, wp, N, nb, xp, xlen, M, op, ldo):
    _dot_body(P.dot_bf16, 64, n0, n1, wp, N, nb, xp, xlen, M, op, ldo)


@njit(**_SER)
def dec_q4_0(n0, n1, wp, N, nb, op):
    _dec_body(D.dec_q4_0, 32, 18, n0, n1, wp, N, nb, op)


@njit(**_SER)
def dot_q4_0(n0, n1, wp, N, nb, xp, xlen, M, op, ldo):
    _dot_body(P.dot_q4_0, 18, n0, n1, wp, N, nb, xp, xlen, M, op, ldo)


@njit(**_SER)
def dec_q4_1(n0, n1, wp, N, nb, op):
    _dec_body(D.dec_q4_1, 32, 20, n0, n1, wp, N, nb, op)


@njit(**_SER)
def dot_q4_1(n0, n1, wp, N, nb, xp, xlen, M, op, ldo):
    _dot_body(P.dot_q4_1, 20, n0, n1, wp, N, nb, xp, xlen, M, op, ldo)


@njit(**_SER)
def dec_q5_0(n0, n1, wp, N, nb, op):
    _dec_body(D.dec_q5_0, 32, 22, n0, n1, wp, N, nb, op)


@njit(**_SER)
def dot_q5_0(n0, n1, wp, N, nb, xp, xlen, M, op, ldo):
    _dot_body(P.dot_q5_0, 22, n0, n1, wp, N, nb, xp, xlen, M, op, ldo)


@njit(**_SER)
def dec_q5_1(n0, n1, wp, N, nb, op):
    _dec_body(D.dec_q5_1, 32, 24, n0, n1, wp, N, nb, op)


@njit(**_SER)
def dot_q5_1(n0, n1, wp, N, nb, xp, xlen, M, op, ldo):
    _dot_body(P.dot_q5_1, 24, n0, n1, wp, N, nb, xp, xlen, M, op, ldo)


@njit(**_SER)
def dec_q8_0(n0, n1, wp, N, nb, op):
    _dec_body(D.dec_q8_0, 32, 34, n0, n1, wp, N, nb, op)


@njit(**_SER)
def dot_q8_0(n0, n1, wp, N, nb, xp, xlen, M, op, ldo):
    _dot_body(P.dot_q8_0, 34, n0, n1, wp, N, nb, xp, xlen, M, op, ldo)


@njit(**_SER)
def dec_q2_k(n0, n1, wp, N, nb, op):
    _dec_body(D.dec_q2_k, 256, 84, n0, n1, wp, N, nb, op)


@njit(**_SER)
def dot_q2_k(n0, n1, wp, N, nb, xp, xlen, M, op, ldo):
    _dot_body(P.dot_q2_k, 84, n0, n1, wp, N, nb, xp, xlen, M, op, ldo)


@njit(**_SER)
def dec_q3_k(n0, n1, wp, N, nb, op):
    _dec_body(D.dec_q3_k, 256, 110, n0, n1, wp, N, nb, op)


@njit(**_SER)
def dot_q3_k(n0, n1, wp, N, nb, xp, xlen, M, op, ldo):
    _dot_body(P.dot_q3_k, 110, n0, n1, wp, N, nb, xp, xlen, M, op, ldo)


@njit(**_SER)
def dec_q4_k(n0, n1, wp, N, nb, op):
    _dec_body(D.dec_q4_k, 256, 144, n0, n1, wp, N, nb, op)


@njit(**_SER)
def dot_q4_k(n0, n1, wp, N, nb, xp, xlen, M, op, ldo):
    _dot_body(P.dot_q4_k, 144, n0, n1, wp, N, nb, xp, xlen, M, op, ldo)


@njit(**_SER)
def dec_q5_k(n0, n1, wp, N, nb, op):
    _dec_body(D.dec_q5_k, 256, 176, n0, n1, wp, N, nb, op)


@njit(**_SER)
def dot_q5_k(n0, n1, wp, N, nb, xp, xlen, M, op, ldo):
    _dot_body(P.dot_q5_k, 176, n0, n1, wp, N, nb, xp, xlen, M, op, ldo)


@njit(**_SER)
def dec_q6_k(n0, n1, wp, N, nb, op):
    _dec_body(D.dec_q6_k, 256, 210, n0, n1, wp, N, nb, op)


@njit(**_SER)
def dot_q6_k(n0, n1, wp, N, nb, xp, xlen, M, op, ldo):
    _dot_body(P.dot_q6_k, 210, n0, n1, wp, N, nb, xp, xlen, M, op, ldo)


# type code -> (dec_T, dot_T); their literal block sizes are D.BLOCK's (tests/test_matmul.py)
SERIAL = {
    D.F32: (dec_f32, dot_f32),
    D.F16: (dec_f16, dot_f16),
    D.BF16: (dec_bf16, dot_bf16),
    D.Q4_0: (dec_q4_0, dot_q4_0),
    D.Q4_1: (dec_q4_1, dot_q4_1),
    D.Q5_0: (dec_q5_0, dot_q5_0),
    D.Q5_1: (dec_q5_1, dot_q5_1),
    D.Q8_0: (dec_q8_0, dot_q8_0),
    D.Q2_K: (dec_q2_k, dot_q2_k),
    D.Q3_K: (dec_q3_k, dot_q3_k),
    D.Q4_K: (dec_q4_k, dot_q4_k),
    D.Q5_K: (dec_q5_k, dot_q5_k),
    D.Q6_K: (dec_q6_k, dot_q6_k),
}

# type code -> (order within each 256-value super-block in which that type's matvec reads x,
# function (x, gather index) -> the x array that matvec takes)
X_LAYOUT = {D.Q4_K: (P.q4k_x_order(), P.q4k_x), D.Q6_K: (P.q6k_x_order(), P.q6k_x)}

_ADDRESSES: dict[tuple[int, int], int] = {}


def kernel_address(code: int, which: int) -> int:
    """The C entry point of type `code`'s dec_T (which=0) or dot_T (which=1): compiled, or
    loaded from numba's disk cache, on first use."""
    a = _ADDRESSES.get((code, which))
    if a is None:
        disp = SERIAL[code][which]
        sig = (types.intp,) * (_DEC_ARGS if which == 0 else _DOT_ARGS)
        disp.compile(sig)
        cres = disp.overloads[sig]
        a = _ADDRESSES[(code, which)] = cres.library.get_pointer_to_function(
            cres.fndesc.llvm_cfunc_wrapper_name)
    return a


def rows(code: int, w, ids, out) -> None:
    """out[r] = decoded row ids[r] of w (uint8[N, nb, ts] read-only, ids int64, out float32
    [len(ids), K] C-contiguous)."""
    drive = rows_serial if ids.shape[0] < SERIAL_ROWS else rows_driver
    drive(kernel_address(code, 0), w, ids, out)


def matvec(code: int, w, x, out) -> None:
    """out[m, n] = dot(row n, x[m]) for x float32[M, xlen] (M small: each weight row is read
    once for all of them), out float32[M, N]; C-contiguous."""
    matvec_driver(kernel_address(code, 1), w, x, out)


def matmul_rows(code: int, w, x, out) -> None:
    """out = x @ W^T by the register-blocked kernel (x float32[M, K], out float32[M, N])."""
    matmul_driver(kernel_address(code, 0), w, x, out)
