"""The C heap's policy for large blocks, one per process: the daemon's or an engine's.

glibc serves a block of 128 KiB or more from a mapping of its own and unmaps it when freed, so
a step's next block of the same size faults every page in again, and the kernel zeroes each
one: a 1.5B model's 512-token prefill step allocates ~40 MB of activations per layer (the FFN's
gate and up outputs are 18 MB each), and those faults were 15-20% of the step
(benchmarks/profile.py, prefill512). An engine's process keeps large blocks in the heap
instead (recycle_large_blocks), so each step reuses the pages the last one touched, as
llama.cpp's compute buffer is allocated once at its peak size and kept.

The daemon wants the opposite (pin_mmap_threshold): with in-process engines an unload must
hand a model's memory back, and large blocks in the heap would interleave with what stays.
Whichever policy the daemon sets wins over an engine's later request in the same process.
Elsewhere than glibc, every call is a no-op.
"""
from __future__ import annotations

import ctypes

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_SMALL = 128 * 1024                 # glibc's start values of both thresholds
# Blocks up to this size come from the heap, and this much free memory stays at its top: more
# than any step's activations at 512 tokens per step (what is larger, e.g. an 8K prompt's
# logits, is mapped and unmapped as before). glibc versions that refuse a threshold above
# 32 MiB (half a thread arena's heap) get that.
_LARGE = 256 << 20
_FALLBACK = 32 << 20

_libc = None
_pinned = False


def _glibc():
    """The C library if it is glibc (mallopt and malloc_trim), else None."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL("libc.so.6")
            _libc.mallopt, _libc.malloc_trim    # noqa: B018 - glibc, or not
        except (OSError, AttributeError):
            _libc = False
    return _libc or None


def _mallopt(param: int, value: int) -> bool:
    libc = _glibc()
    return libc is not None and libc.mallopt(param, value) == 1


def pin_mmap_threshold() -> None:
    """The daemon's policy: keep glibc's thresholds at their start values (128 KiB). By default
    one large free raises the mmap threshold (up to 32 MB), after which a model's vocabulary
    tables and any large temporary land in the heap, where they interleave and an unload
    cannot hand all of them back. Pinned, every large block is its own mapping and goes back
    to the OS when freed."""
    global _pinned
    _pinned = True
    _mallopt(_M_MMAP_THRESHOLD, _SMALL)
    _mallopt(_M_TRIM_THRESHOLD, _SMALL)


def recycle_large_blocks() -> bool:
    """An engine's policy: blocks up to 256 MiB from the heap, and freed ones kept there for
    the next step. Call after the weights are loaded (they stay mappings of their own). A
    no-op in a process whose daemon pinned the thresholds. Returns whether it applied."""
    if _pinned:
        return False
    if not _mallopt(_M_MMAP_THRESHOLD, _LARGE) and not _mallopt(_M_MMAP_THRESHOLD, _FALLBACK):
        return False
    return _mallopt(_M_TRIM_THRESHOLD, _LARGE)


def trim() -> None:
    """Hand freed heap memory back to the OS. glibc keeps freed chunks (numpy arrays under its
    mmap threshold) in its arenas, where they still count in RSS; malloc_trim returns them."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
