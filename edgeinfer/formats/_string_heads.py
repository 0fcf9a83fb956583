"""Where each string of a GGUF string array starts, walked in compiled code.

A vocabulary is 100k-260k length-prefixed strings (and as many merges): following the
lengths one `struct.unpack_from` at a time was ~0.2 s of every model load. Imported only
for large arrays, so reading a small file's header never loads numba.
"""
from __future__ import annotations

import numpy as np
from numba import njit


@njit(nogil=True, cache=True)
def string_heads(buf, pos, count, max_len, heads):
    """heads[i] = where string i's 8-byte little-endian length starts, from byte `pos` of
    buf (uint8); returns the byte after the last string, or -1 if a length runs past the
    end or exceeds max_len (the caller's own loop then says which)."""
    end = buf.shape[0]
    for i in range(count):
        if pos + 8 > end:
            return -1
        n = np.uint64(0)
        for b in range(8):
            n |= np.uint64(buf[pos + b]) << np.uint64(8 * b)
        if n > np.uint64(max_len):
            return -1
        heads[i] = pos
        pos += 8 + np.int64(n)
        if pos > end:
            return -1
    return pos
