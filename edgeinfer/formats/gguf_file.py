"""A bounded, validating GGUF reader.

We parse the header ourselves instead of trusting `gguf.GGUFReader`: every count, length,
dimension and offset is checked against the bytes that remain in the file before anything is
allocated, so a hostile header cannot make us allocate 2^62 items, read past the end of the
file, or overflow a tensor-size product (the failures behind Ollama's "Bleeding Llama" and
llama.cpp's tensor-size overflows). The tensor data stays in one read-only memory map.
"""
from __future__ import annotations

import mmap
import os
import struct
import threading
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edgeinfer.formats.ggml_types import GGML_QUANT_SIZES, GGMLQuantizationType

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4
MAX_STRING = 1 << 30          # no metadata string is a gigabyte
MAX_DIM = 1 << 40             # no tensor dimension is a trillion elements

# Metadata value types (gguf spec).
_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _FLOAT32, _BOOL, _STRING, _ARRAY, _UINT64, \
    _INT64, _FLOAT64 = range(13)
_SCALAR = {
    _UINT8: "<B", _INT8: "<b", _UINT16: "<H", _INT16: "<h", _UINT32: "<I", _INT32: "<i",
    _FLOAT32: "<f", _BOOL: "<?", _UINT64: "<Q", _INT64: "<q", _FLOAT64: "<d",
}
_NUMPY = {
    _UINT8: np.uint8, _INT8: np.int8, _UINT16: np.uint16, _INT16: np.int16, _UINT32: np.uint32,
    _INT32: np.int32, _FLOAT32: np.float32, _BOOL: np.bool_, _UINT64: np.uint64,
    _INT64: np.int64, _FLOAT64: np.float64,
}


from edgeinfer.formats.gguf_error import GGUFError  # noqa: E402,F401 (its home; here too)


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]      # ggml order: shape[0] is the contiguous (row) dimension
    ggml_type: GGMLQuantizationType
    offset: int                 # absolute offset in the file
    nbytes: int

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def type_name(self) -> str:
        return self.ggml_type.name


@dataclass
class GGUFFile:
    path: str
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    data_offset: int
    file_size: int
    _mmap: mmap.mmap | None = field(default=None, repr=False)

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view into the memory map (no copy)."""
        t = self.tensors[name]
        assert self._mmap is not None
        return np.frombuffer(self._mmap, dtype=np.uint8, count=t.nbytes, offset=t.offset)

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def will_need(self, names) -> None:
        """Ask the kernel to read these tensors' pages ahead, all at once (madvise
        MADV_WILLNEED; returns at once): a load that copies many small tensors scattered
        through the file (a model's norms) then waits for one batch of reads, not one read
        after another, when the file is not in the page cache (after a reboot). Nothing
        where madvise or the flag is missing."""
        if self._mmap is None or not hasattr(mmap, "MADV_WILLNEED"):
            return
        page, size = mmap.PAGESIZE, len(self._mmap)
        for name in names:
            t = self.tensors[name]
            start = t.offset // page * page
            try:
                self._mmap.madvise(mmap.MADV_WILLNEED, start,
                                   min(t.offset + t.nbytes, size) - start)
            except (OSError, ValueError):
                return

    def release_pages(self, name: str | None = None) -> None:
        """Drop mapped file pages (of one tensor, or all) from this process's memory; the page
        cache keeps them.

        For backends that copy or repack weights at load: the pages they read stay mapped and
        count in the process's RSS until then. Safe for any mapping: a view still in use reads
        its pages back from the file on the next access."""
        if self._mmap is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start, end = 0, len(self._mmap)
        if name is not None:
            t = self.tensors[name]
            page = mmap.PAGESIZE
            start = -(-t.offset // page) * page              # whole pages inside the tensor
            end = (t.offset + t.nbytes) // page * page
            if end <= start:
                return
        try:
            self._mmap.madvise(mmap.MADV_DONTNEED, start, end - start)
        except (OSError, ValueError):
            pass

    def close(self) -> None:
        # Views handed out by raw() keep the map alive; let the GC close it then.
        self._mmap = None


_U64 = struct.Struct("<Q")
_COMPILED_WALK = 4096          # string arrays from this long may walk their lengths in numba


class _Cursor:
    """Reads little-endian values from a buffer, refusing to step past its end."""

    def __init__(self, buf, path: str, compiled_walk: bool = False):
        self.buf = buf
        self.compiled_walk = compiled_walk
        self.pos = 0
        self.end = len(buf)
        self.path = path

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.end:
            raise GGUFError(f"{what} runs past the end of the file at byte {self.pos} "
                            f"(file is {self.end} bytes): truncated or corrupt")

    def scalar(self, fmt: str, what: str):
        size = struct.calcsize(fmt)
        self.need(size, what)
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return v

    def u32(self, what: str) -> int:
        return self.scalar("<I", what)

    def u64(self, what: str) -> int:
        return self.scalar("<Q", what)

    def string(self, what: str) -> str:
        n = self.u64(f"length of {what}")
        if n > MAX_STRING:
            raise GGUFError(f"{what} claims a length of {n} bytes, which is not plausible")
        self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            # Vocabularies can hold invalid UTF-8 pieces; keep them losslessly.
            return raw.decode("utf-8", errors="surrogateescape")

    def strings(self, count: int, what: str) -> list[str]:
        """`count` strings in a row (vocabularies: 100k-260k of them, most of a model's load
        time), as `string` reads them: a loop that only follows the lengths, then numpy turns
        each 8-byte length into one NUL, and the bytes are decoded and split once (a NUL inside
        a string, which no vocabulary has, takes the string-by-string way)."""
        buf, pos, end = self.buf, self.pos, self.end
        first = pos
        if self.compiled_walk and count >= _COMPILED_WALK:
            from edgeinfer.formats._string_heads import string_heads
            h = np.empty(count, np.int64)
            stop = string_heads(np.frombuffer(buf, np.uint8, count=end), pos, count,
                                MAX_STRING, h)
            if stop >= 0:
                self.pos = stop
                return self._split(buf, first, stop, h, count)
        unpack = _U64.unpack_from
        heads = [0] * count             # where each length field starts (and which is bad)
        for i in range(count):
            if pos + 8 > end:
                self.pos = pos
                self.need(8, f"length of {what}")
            n = unpack(buf, pos)[0]
            if n > MAX_STRING:
                raise GGUFError(f"{what} claims a length of {n} bytes, which is not plausible")
            heads[i] = pos
            pos += 8 + n
            if pos > end:
                self.pos = pos - n
                self.need(n, what)
        self.pos = pos
        if not count:
            return []
        return self._split(buf, first, pos, np.asarray(heads, np.int64), count)

    @staticmethod
    def _split(buf, first: int, pos: int, heads: np.ndarray, count: int) -> list[str]:
        """The strings whose length fields start at `heads`, in buf[first:pos]."""
        region = np.frombuffer(buf, np.uint8, count=pos - first, offset=first).copy()
        h = heads - first
        keep = np.ones(len(region), bool)
        keep[(h[:, None] + np.arange(7)).reshape(-1)] = False     # each length's last byte
        region[h + 7] = 0                                        # stays, as a NUL
        joined = region[keep][1:].tobytes()
        # surrogateescape keeps invalid UTF-8 pieces losslessly; a NUL never takes part in a
        # multi-byte sequence, so decoding the whole is decoding each string
        out = joined.decode("utf-8", errors="surrogateescape").split("\x00")
        if len(out) != count:
            ends = list(h[1:] + first) + [pos]
            out = [bytes(buf[a + 8:b]).decode("utf-8", errors="surrogateescape")
                   for a, b in zip(heads.tolist(), ends)]
        return out

    def value(self, vtype: int, key: str, depth: int = 0) -> Any:
        if vtype in _SCALAR:
            return self.scalar(_SCALAR[vtype], f"value of {key!r}")
        if vtype == _STRING:
            return self.string(f"value of {key!r}")
        if vtype == _ARRAY:
            if depth > 0:
                raise GGUFError(f"metadata {key!r} nests arrays, which GGUF models never do")
            etype = self.u32(f"array type of {key!r}")
            count = self.u64(f"array length of {key!r}")
            if etype in _SCALAR:
                item = struct.calcsize(_SCALAR[etype])
                if count > (self.end - self.pos) // item:
                    raise GGUFError(f"metadata array {key!r} claims {count} items, more than the "
                                    f"file can hold")
                arr = np.frombuffer(self.buf, dtype=np.dtype(_NUMPY[etype]).newbyteorder("<"),
                                    count=count, offset=self.pos).copy()
                self.pos += count * item
                return arr
            if etype == _STRING:
                if count > (self.end - self.pos) // 8:   # each string needs its 8-byte length
                    raise GGUFError(f"metadata array {key!r} claims {count} strings, more than "
                                    f"the file can hold")
                return self.strings(count, f"item of {key!r}")
            if etype == _ARRAY:
                raise GGUFError(f"metadata {key!r} nests arrays, which GGUF models never do")
            raise GGUFError(f"metadata array {key!r} has unknown item type {etype}")
        raise GGUFError(f"metadata {key!r} has unknown value type {vtype}")


def _tensor_nbytes(name: str, shape: tuple[int, ...], gtype: GGMLQuantizationType) -> int:
    block, type_size = GGML_QUANT_SIZES[gtype]
    if shape[0] % block:
        raise GGUFError(f"tensor {name!r} has a row of {shape[0]} values, not a multiple of "
                        f"the {gtype.name} block size {block}")
    n = 1
    for d in shape:
        n *= d          # Python ints: no overflow
    return n // block * type_size


# path -> (the file's identity, its parsed header): kept only where remember_headers() ran
_HEADERS: dict[str, tuple[tuple, GGUFFile]] | None = None
_HEADERS_WALK = False       # remember_headers(compiled_walk): how those parses walk


def remember_headers(compiled_walk: bool = False) -> None:
    """From now on this process parses each file's header once: a later read_gguf of the
    same unchanged file (same size, mtime, inode) gets a fresh mapping and the parsed
    metadata and tensor table (shared: read them, never change them); `compiled_walk`, for
    every parse, as read_gguf's. For the engine process, which reads its model three times
    while it loads (the memory estimate, the kernel steps, the runner) and holds the
    vocabulary anyway; not for the daemon, whose memory must go back after an unload."""
    global _HEADERS, _HEADERS_WALK
    if _HEADERS is None:
        _HEADERS = {}
    _HEADERS_WALK = _HEADERS_WALK or compiled_walk


def forget_headers(keep: str | None = None) -> None:
    """Drop the remembered parses but `keep`'s (a spare engine process parsed its hint
    model ahead; the model it then serves may be another)."""
    if _HEADERS is not None:
        for path in [p for p in _HEADERS if p != keep]:
            del _HEADERS[path]


# one parse handed to the next read of the same unchanged file, if it comes within a few
# seconds (read_gguf's hand_on_s): the daemon's /api/show parses a model that the request
# after it usually loads (`edgeinfer run` asks show, then chat), and that load reads the
# vocabulary again (~0.08 s for 151k tokens, on the first run's path to its first token)
_HANDOFF: tuple[str, tuple, GGUFFile] | None = None
_HANDOFF_LOCK = threading.Lock()


def _take_handoff(path: str, ident: tuple) -> GGUFFile | None:
    global _HANDOFF
    with _HANDOFF_LOCK:
        entry, _HANDOFF = _HANDOFF, None
    return entry[2] if entry is not None and entry[:2] == (path, ident) else None


def _hand_on(path: str, ident: tuple, gf: GGUFFile, seconds: float) -> None:
    global _HANDOFF
    entry = (path, ident, dataclasses.replace(gf, _mmap=None))
    with _HANDOFF_LOCK:
        _HANDOFF = entry

    def expire() -> None:       # the vocabulary goes back if no read takes it
        global _HANDOFF
        with _HANDOFF_LOCK:
            if _HANDOFF is entry:
                _HANDOFF = None
    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()


def read_gguf(path: str | os.PathLike, compiled_walk: bool = False,
              hand_on_s: float = 0.0) -> GGUFFile:
    """Parse and validate a GGUF file's header and tensor table; map its data read-only.
    compiled_walk: follow a long string array's lengths in numba (_string_heads.py, ~0.2 s
    less for a 150k vocabulary) — for a process that runs numba kernels anyway (the model
    runner). Elsewhere (the daemon's front, pull, show) the Python loop keeps numba's runtime
    (~50 MB once a function has loaded) out of the process. hand_on_s: keep this parse for
    the next read of the file within that many seconds (one read takes it; see _HANDOFF);
    parsed metadata is shared then: read it, never change it."""
    path = os.fspath(path)
    try:
        size = os.path.getsize(path)
        f = open(path, "rb")
    except FileNotFoundError:
        raise GGUFError("file not found") from None
    except IsADirectoryError:
        raise GGUFError("is a directory, not a GGUF file") from None
    except OSError as e:
        raise GGUFError(f"cannot be opened: {e.strerror}") from None
    with f:
        if size < 24:
            raise GGUFError(f"is {size} bytes, too small to be a GGUF file")
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        st = os.fstat(f.fileno())
    ident = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    known = _HEADERS.get(path) if _HEADERS is not None else None
    if known is not None and known[0] == ident:
        return dataclasses.replace(known[1], _mmap=mm)
    handed = _take_handoff(path, ident) if _HANDOFF is not None else None
    if handed is not None:
        return dataclasses.replace(handed, _mmap=mm)
    view = memoryview(mm)
    try:
        gf = _parse(path, mm, view, size,
                    compiled_walk or (_HEADERS is not None and _HEADERS_WALK))
        if _HEADERS is not None:
            _HEADERS[path] = (ident, dataclasses.replace(gf, _mmap=None))
        if hand_on_s > 0:
            _hand_on(path, ident, gf, hand_on_s)
        return gf
    except GGUFError:
        view.release()
        try:
            mm.close()
        except BufferError:  # a temporary array still views it; the GC unmaps it later
            pass
        raise


def _parse(path: str, mm: mmap.mmap, view: memoryview, size: int,
           compiled_walk: bool) -> GGUFFile:
    cur = _Cursor(view, path, compiled_walk)
    magic = bytes(mm[:4])
    if magic != GGUF_MAGIC:
        raise GGUFError(f"is not a GGUF file (magic {magic!r}, expected b'GGUF')")
    cur.pos = 4
    version = cur.u32("version")
    if version not in SUPPORTED_VERSIONS:
        raise GGUFError(f"has GGUF version {version}; supported versions are 2 and 3")
    n_tensors = cur.u64("tensor count")
    n_kv = cur.u64("metadata count")
    # Every key-value pair needs at least 8 (key length) + 4 (type) + 1 bytes, every tensor
    # info at least 8 + 4 + 8 + 4 + 8 bytes: bound the counts by the bytes that remain.
    remaining = size - cur.pos
    if n_kv > remaining // 13:
        raise GGUFError(f"claims {n_kv} metadata entries, more than its {size} bytes can hold")
    if n_tensors > remaining // 32:
        raise GGUFError(f"claims {n_tensors} tensors, more than its {size} bytes can hold")

    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string("metadata key")
        vtype = cur.u32(f"type of {key!r}")
        if key in metadata:
            raise GGUFError(f"repeats metadata key {key!r}")
        metadata[key] = cur.value(vtype, key)

    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1) or alignment > 1 << 20:
        raise GGUFError(f"has an invalid general.alignment of {alignment!r}")

    infos = []
    for i in range(n_tensors):
        name = cur.string(f"name of tensor {i}")
        n_dims = cur.u32(f"dimension count of {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise GGUFError(f"tensor {name!r} has {n_dims} dimensions; GGUF allows 1 to {MAX_DIMS}")
        shape = tuple(cur.u64(f"shape of {name!r}") for _ in range(n_dims))
        if any(d == 0 or d > MAX_DIM for d in shape):
            raise GGUFError(f"tensor {name!r} has an invalid shape {list(shape)}")
        raw_type = cur.u32(f"type of {name!r}")
        try:
            gtype = GGMLQuantizationType(raw_type)
            GGML_QUANT_SIZES[gtype]
        except (ValueError, KeyError):
            raise GGUFError(f"tensor {name!r} has unknown type id {raw_type}") from None
        offset = cur.u64(f"offset of {name!r}")
        infos.append((name, shape, gtype, offset))

    data_offset = (cur.pos + alignment - 1) // alignment * alignment
    tensors: dict[str, TensorInfo] = {}
    spans = []
    for name, shape, gtype, offset in infos:
        if name in tensors:
            raise GGUFError(f"has two tensors named {name!r}")
        nbytes = _tensor_nbytes(name, shape, gtype)
        if offset % alignment:
            raise GGUFError(f"tensor {name!r} starts at offset {offset}, not aligned to {alignment}")
        start = data_offset + offset
        if start + nbytes > size:
            raise GGUFError(f"tensor {name!r} ({nbytes} bytes at offset {offset}) extends past the "
                            f"end of the file ({size} bytes): truncated or corrupt")
        tensors[name] = TensorInfo(name, shape, gtype, start, nbytes)
        spans.append((start, start + nbytes, name))
    spans.sort()
    for (s0, e0, n0), (s1, e1, n1) in zip(spans, spans[1:]):
        if s1 < e0:
            raise GGUFError(f"tensors {n0!r} and {n1!r} overlap in the file")
    return GGUFFile(path, version, metadata, tensors, data_offset, size, mm)
