"""Repacked weights kept on disk: a model's next load maps its tiles instead of repacking.

Repacking (repack.py) writes a model's weights into fresh memory: for Qwen2.5-Coder 0.5B,
~0.25 s of tiling plus ~0.3 s of page faults on 400 MB of new pages in a new process, most
of a load and of a cold start (llama.cpp maps its GGUF and starts at once). After a load,
a background thread of low priority writes the model's repacked matrices into one file; the
next load of the same GGUF maps that file copy-on-write (MAP_PRIVATE: the page cache's
pages, nothing copied, arrays that numba takes as it takes any other array).

<root>/<layout>/<model>.tiles
- layout: a hash of repack.py and _int8.py, which define the tile layout; a new layout
  starts a directory of its own and the old ones are removed;
- model: a store blob (named sha256-<hex> by its content) by that hash and its size, so
  every store holding it shares one file; any other GGUF by its file name and a hash of its
  real path, size and mtime (a file rewritten in place is another model);
- the file: each matrix's arrays, 64-byte aligned, then a JSON index (the GGUF's path, and
  per matrix its fields and each array's dtype, shape and offset), then a trailer: b"EITILES2", the
  index's offset and length (u64 little-endian). A file whose trailer, index or sizes do
  not check out is removed and the model repacked (and written again).
The arrays are the bytes repacking gives, so a mapped matrix computes the same bits.

The directory is bounded: after writing a model the least recently used ones (each load
touches its file) are removed until the total fits `limit_bytes`. A failed write (a full
disk, no permission, less than 1 GiB left beside the file) is logged and the model is served
from memory as usual. A file whose
GGUF is gone (`edgeinfer rm`) is removed by the next eviction.
"""
from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import queue
import re
import shutil
import threading
import time
from pathlib import Path

import numpy as np

from edgeinfer.formats.ggml_types import GGMLQuantizationType as Q

from . import _stamp
from .repack import PackedMatrix

log = logging.getLogger(__name__)

MAGIC = b"EITILES2"
TRAILER = len(MAGIC) + 16
LAYOUT = _stamp.deps_hash(("repack.py", "_int8.py"))
_ARRAYS = ("q", "h", "s", "o", "d", "dm")
_FIELDS = ("has_o", "zero_point", "B", "A", "K", "N", "bits", "fmt")
_ALIGN = 64
MIN_FREE_BYTES = 1 << 30    # left free on the cache's disk after a write
STALE_TMP_S = 600.0     # a temporary file older than this belongs to no live writer
IDLE_S = 2.0            # the writer writes once the load has handed over nothing for this long


_BLOB = re.compile(r"sha256-([0-9a-f]{64})")


def model_file(root: str | os.PathLike, gguf_path: str) -> Path:
    """Where a GGUF's repacked matrices are kept: a store blob by its content hash and size
    (any store holding it shares the file), any other GGUF by its file name and a hash of
    its real path, size and modification time."""
    real = os.path.realpath(gguf_path)
    st = os.stat(real)
    m = _BLOB.fullmatch(Path(real).name)
    if m is not None:
        return Path(root) / LAYOUT / f"blob-{m.group(1)[:32]}-{st.st_size}.tiles"
    h = hashlib.sha256(f"{real}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", Path(real).stem)[:60]
    return Path(root) / LAYOUT / f"{stem}-{h}.tiles"


class PackedCache:
    """One model's file: get() maps a matrix from it, put() hands one to the writer.
    CpuOps makes one on a model's first matrix."""

    def __init__(self, root: str | os.PathLike, gguf_path: str, limit_bytes: int):
        self.root = Path(root)
        self.path = model_file(root, gguf_path)
        # the GGUF whose removal makes the file stale; none for a blob that other stores
        # (or a later pull) may hold: the size order removes those
        self.gguf = None if self.path.name.startswith("blob-") else os.path.realpath(gguf_path)
        self.limit_bytes = limit_bytes
        self.hits = 0
        self.misses = 0
        self._index: dict | None = None
        self._mm: mmap.mmap | None = None
        try:
            self._open()
        except (FileNotFoundError, NotADirectoryError):
            pass
        except (OSError, ValueError, KeyError, TypeError) as e:     # truncated or foreign
            log.warning("repack cache: %s unreadable (%s); repacking", self.path.name, e)
            self._index = self._mm = None
            try:
                self.path.unlink(missing_ok=True)
            except OSError:
                pass
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()       # the writer thread's start and end
        self._writer: threading.Thread | None = None
        # the writer's: every matrix of this load, mapped or repacked, and whether any was
        # repacked (then the file is written again with all of them, else only touched)
        self._pending: list[tuple[str, PackedMatrix]] = []
        self._repacked = False

    def _open(self) -> None:
        with open(self.path, "rb") as f:
            off, header = _read_index(f)
            index = header["matrices"]
            for entry in index.values():
                for spec in entry["arrays"].values():
                    if spec is not None and spec["offset"] + spec["nbytes"] > off:
                        raise ValueError("an array past the data")
            # copy-on-write: writable arrays to numba's eyes, the page cache's pages
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        self._index = index

    # -- reading -----------------------------------------------------------------------------
    def get(self, tensor: str) -> PackedMatrix | None:
        entry = self._index.get(tensor) if self._index is not None else None
        if entry is None:
            self.misses += 1
            return None
        self.hits += 1
        m = self._view(entry)
        self._hand_over("mapped", (tensor, m))
        return m

    def _view(self, entry: dict) -> PackedMatrix:
        arrays = {}
        for name, spec in entry["arrays"].items():
            if spec is not None:
                dt = np.dtype(spec["dtype"])
                arrays[name] = np.frombuffer(self._mm, dt, spec["nbytes"] // dt.itemsize,
                                             spec["offset"]).reshape(spec["shape"])
        meta = entry["meta"]
        return PackedMatrix(arrays["q"], arrays["h"], arrays["s"], arrays.get("o", arrays["s"]),
                            arrays["d"], arrays.get("dm", arrays["d"]), meta["has_o"],
                            meta["zero_point"], meta["B"], meta["A"], Q(meta["qtype"]),
                            meta["K"], meta["N"], meta["bits"], meta["fmt"])

    # -- writing -----------------------------------------------------------------------------
    def put(self, tensor: str, m: PackedMatrix) -> None:
        """A matrix this load repacked (get() had none). Once the load has handed over
        nothing for IDLE_S, the writer writes the file with every matrix of the load; a
        load that mapped them all only touches it (the eviction order)."""
        self._hand_over("repacked", (tensor, m))

    def _hand_over(self, kind: str, item) -> None:
        self._start_writer()
        self._queue.put((kind, item))

    def flush(self) -> None:
        """Write now what was handed over, and wait for it (tests, benchmarks)."""
        with self._lock:
            writer = self._writer
            if writer is not None:
                self._queue.put(("write", None))
        if writer is not None:
            writer.join()

    def _start_writer(self) -> None:
        with self._lock:
            if self._writer is None:
                self._writer = threading.Thread(target=self._run, name="repack-cache",
                                                daemon=True)
                self._writer.start()

    def _run(self) -> None:
        try:        # a low priority: the model's first request runs beside this thread
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):
            pass
        while True:
            try:
                kind, item = self._queue.get(timeout=IDLE_S)
            except queue.Empty:
                kind, item = "write", None
            if kind in ("mapped", "repacked"):
                self._pending.append(item)
                self._repacked |= kind == "repacked"
                continue
            if self._repacked:
                try:
                    self._write_file()
                except Exception:       # never a dead writer: the load is served either way
                    log.exception("repack cache: writing %s failed", self.path)
            elif self._pending:
                self._pending = []
                try:
                    os.utime(self.path)
                except OSError:
                    pass
            with self._lock:
                if self._queue.empty():
                    self._writer = None
                    return

    def _write_file(self) -> None:
        pending, self._pending, self._repacked = self._pending, [], False
        size = sum(m.nbytes for _, m in pending)
        if size > self.limit_bytes:
            return          # bigger than the whole cache: written, it would evict everything
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(self.path.parent).free
        except OSError as e:
            log.warning("repack cache: not writing %s (%s); the model is served from memory "
                        "as usual", self.path, e)
            return
        if free < size + MIN_FREE_BYTES:    # a cache never takes the disk's last space
            log.warning("repack cache: not writing %s (%.0f MB) with %.0f MB free on its disk",
                        self.path.name, size / 2**20, free / 2**20)
            return
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                index = {name: _append(f, m) for name, m in pending}
                off = f.tell()
                body = json.dumps({"gguf": self.gguf, "matrices": index}).encode()
                f.write(body + MAGIC + off.to_bytes(8, "little") + len(body).to_bytes(8, "little"))
            os.replace(tmp, self.path)
        except OSError as e:
            log.warning("repack cache: not writing %s (%s); the model is served from memory "
                        "as usual", self.path, e)
            return
        finally:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
        try:
            evict(self.root, self.limit_bytes, keep=self.path)
        except OSError as e:
            log.warning("repack cache: eviction failed (%s)", e)


def _append(f, m: PackedMatrix) -> dict:
    """Write m's arrays at the file's end, each 64-byte aligned; its index entry."""
    arrays = {}
    for name in _ARRAYS:
        a = getattr(m, name)
        if name == "o" and not m.has_o or name == "dm" and m.dm is m.d:
            arrays[name] = None         # the same array as s / d: not stored twice
            continue
        off = -(-f.tell() // _ALIGN) * _ALIGN
        f.seek(off)
        f.write(memoryview(np.ascontiguousarray(a)).cast("B"))
        arrays[name] = {"dtype": a.dtype.str, "shape": list(a.shape), "offset": off,
                        "nbytes": a.nbytes}
    meta = {k: getattr(m, k) for k in _FIELDS}
    meta.update(has_o=bool(m.has_o), qtype=int(m.qtype))
    return {"meta": meta, "arrays": arrays}


def evict(root: str | os.PathLike, limit_bytes: int, keep: Path | None = None) -> None:
    """Remove other layouts' directories, stale temporaries and the files of GGUFs that are
    gone, then the least recently used models until the rest fits limit_bytes (never
    `keep`, the model just written)."""
    root = Path(root)
    if not root.is_dir():
        return
    for d in root.iterdir():
        if d.is_dir() and d.name != LAYOUT:
            shutil.rmtree(d, ignore_errors=True)
    here = root / LAYOUT
    if not here.is_dir():
        return
    files = []
    now = time.time()
    for f in here.iterdir():
        if f.suffix == ".tmp" and now - f.stat().st_mtime > STALE_TMP_S:
            f.unlink(missing_ok=True)       # a writer that was killed (its process ended)
        if f.suffix != ".tiles":
            continue
        gguf = _gguf_of(f)
        if gguf is not None and not os.path.exists(gguf):
            f.unlink(missing_ok=True)
        else:
            files.append((f.stat(), f))
    files.sort(key=lambda t: t[0].st_mtime)
    total = sum(st.st_size for st, _ in files)
    for st, f in files:
        if total <= limit_bytes:
            break
        if f == keep:
            continue
        f.unlink(missing_ok=True)
        total -= st.st_size


def _read_index(f) -> tuple[int, dict]:
    """(where the data ends, the JSON index) of an open tiles file, its trailer checked
    (ValueError for a file that is not one, or not whole)."""
    size = os.fstat(f.fileno()).st_size
    if size < TRAILER:
        raise ValueError("too short")
    f.seek(size - TRAILER)
    tail = f.read(TRAILER)
    if tail[:len(MAGIC)] != MAGIC:
        raise ValueError("no trailer")
    off = int.from_bytes(tail[len(MAGIC):len(MAGIC) + 8], "little")
    n = int.from_bytes(tail[len(MAGIC) + 8:], "little")
    if off + n != size - TRAILER:
        raise ValueError("index out of place")
    f.seek(off)
    return off, json.loads(f.read(n))


def _gguf_of(path: Path) -> str | None:
    """The GGUF path a file's index names (None: a blob's, or unreadable: left to the size
    order)."""
    try:
        with open(path, "rb") as f:
            return _read_index(f)[1]["gguf"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
