"""Scalar bit helpers for the numba kernels: half/bfloat16 decoding without float16 support.

numba has no usable float16 scalar type, so half floats are decoded from their bits with
integer arithmetic and an LLVM bitcast. Every path is exact (the same float32 that
`np.float16(...).astype(np.float32)` gives), including subnormals, infinities and NaNs.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic


@intrinsic
def u32_as_f32(typingctx, x):
    """Reinterpret the bits of a uint32 as a float32 (no conversion)."""
    sig = types.float32(types.uint32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


_TWO_M24 = np.float32(2.0 ** -24)   # value of the smallest f16 subnormal


@njit(inline="always", nogil=True)
def half_bits_to_f32(h):
    """float32 value of the IEEE half whose bits are the low 16 bits of uint32 `h`."""
    sign = (h & np.uint32(0x8000)) << np.uint32(16)
    em = h & np.uint32(0x7FFF)
    if em >= np.uint32(0x7C00):     # inf / nan keep their payload
        return u32_as_f32(sign | np.uint32(0x7F800000) | ((em & np.uint32(0x3FF)) << np.uint32(13)))
    if em < np.uint32(0x400):       # zero and subnormals: exact small integer times 2^-24
        v = np.float32(em) * _TWO_M24
        return -v if sign != 0 else v
    # normal: rebias the exponent from 15 to 127 (112 << 10 in the half's bit positions)
    return u32_as_f32(sign | ((em + np.uint32(0x1C000)) << np.uint32(13)))


@njit(inline="always", nogil=True)
def load_f16(buf, n, b, o):
    """The little-endian half at byte `o` of block `b` of row `n` of a uint8[N, nb, B] array."""
    return half_bits_to_f32(np.uint32(buf[n, b, o]) | (np.uint32(buf[n, b, o + 1]) << np.uint32(8)))


@njit(inline="always", nogil=True)
def load_bf16(buf, n, b, o):
    """The little-endian bfloat16 at byte `o` of block `b` of row `n`, as float32 (exact)."""
    return u32_as_f32((np.uint32(buf[n, b, o]) << np.uint32(16)) | (np.uint32(buf[n, b, o + 1]) << np.uint32(24)))


@njit(inline="always", nogil=True)
def load_f32(buf, n, b, o):
    """The little-endian float32 at byte `o` of block `b` of row `n`."""
    return u32_as_f32(load_u32(buf, n, b, o))


@njit(inline="always", nogil=True)
def load_u32(buf, n, b, o):
    """The little-endian uint32 at byte `o` of block `b` of row `n`."""
    return (np.uint32(buf[n, b, o]) | (np.uint32(buf[n, b, o + 1]) << np.uint32(8))
            | (np.uint32(buf[n, b, o + 2]) << np.uint32(16)) | (np.uint32(buf[n, b, o + 3]) << np.uint32(24)))
