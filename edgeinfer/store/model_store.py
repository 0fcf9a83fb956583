"""The model store: content-addressed GGUF blobs plus one JSON manifest per `name:tag`.

Layout under the home directory (`$EDGEINFER_HOME`, else the platform user data dir):

    blobs/sha256-<hex>                      the model files, named by their sha256
    manifests/<namespace>/<model>/<tag>.json  source, size, digest, GGUF summary, pulled_at
    partial/                                downloads in progress (kept for resuming)
    locks/                                  empty lock files (flock), never deleted

Two names can point at one blob; a blob is deleted when the last manifest using it goes.
Every change is an atomic rename, and every read-modify-write of manifests and blobs runs
under one store-wide file lock, so two processes (CLI and daemon) can share a store.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

from edgeinfer.formats.gguf_error import GGUFError
from edgeinfer.settings import current
from .bundled import BUNDLED, DEFAULT_MODEL, bundled
from .names import (InvalidModelName, ModelName, ModelNotFound, StoreError,
                    name_from_filename, parse_name)

__all__ = ["Store", "ModelRef", "StoreError", "InvalidModelName", "ModelNotFound",
           "BUNDLED_NAME", "DEFAULT_MODEL", "gguf_summary", "sha256_file", "default_home", "file_lock"]

BUNDLED_NAME = "gemma3:270m"              # the k-quant reference model (bundled.py)
MANIFEST_SCHEMA = 1
_HASH_CHUNK = 1 << 20

try:                                    # POSIX
    import fcntl

    def _lock_fd(fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_EX)

    def _unlock_fd(fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_UN)
except ImportError:                     # Windows
    import msvcrt

    def _lock_fd(fd: int) -> None:
        while True:
            try:
                msvcrt.locking(fd, msvcrt.LK_LOCK, 1)
                return
            except OSError:             # LK_LOCK gives up after 10 s; keep waiting
                continue

    def _unlock_fd(fd: int) -> None:
        os.lseek(fd, 0, os.SEEK_SET)
        msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock between processes (and threads: each call opens its own fd)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _lock_fd(fd)
        try:
            yield
        finally:
            _unlock_fd(fd)
    finally:
        os.close(fd)


def default_home() -> Path:
    home = current().home
    if home:
        return home
    import platformdirs  # lazy: only without EDGEINFER_HOME
    return Path(platformdirs.user_data_dir("edgeinfer", appauthor=False))


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def gguf_summary(path: Path) -> dict[str, Any]:
    """Validate a GGUF file (raises GGUFError) and summarize it for the manifest."""
    from edgeinfer.formats.ggml_types import LlamaFileType
    from edgeinfer.formats.gguf_file import read_gguf  # lazy: every CLI command imports the store
    g = read_gguf(path)
    try:
        if g.metadata.get("general.architecture") == "clip":
            raise GGUFError("it is a vision projector (mmproj), not a model: store it with "
                            "its model (edgeinfer pull MODEL --mmproj FILE)")
        ft = g.metadata.get("general.file_type")
        file_type = None
        if isinstance(ft, int):
            try:
                file_type = LlamaFileType(ft).name.removeprefix("MOSTLY_")
            except ValueError:
                file_type = f"unknown({ft})"
        return {
            "architecture": g.metadata.get("general.architecture"),
            "file_type": file_type,
            "parameters": sum(t.n_elements for t in g.tensors.values()),
            "tensors": len(g.tensors),
            "name": g.metadata.get("general.name"),
        }
    finally:
        g.close()


def _is_path_like(model: str) -> bool:
    return (model.lower().endswith(".gguf") or model.startswith(("/", "./", "../", "~"))
            or os.sep in model.replace("/", "") or (len(model) > 1 and model[1] == ":"
                                                  and os.name == "nt"))


@dataclass(frozen=True)
class ModelRef:
    """A model the engine can load. `digest` is the bare sha256 hex (None for a file that is
    not registered in the store)."""
    name: str
    tag: str
    path: Path
    digest: str | None
    size: int
    manifest: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def registered(self) -> bool:
        return self.digest is not None

    @property
    def full_name(self) -> str:
        return f"{self.name}:{self.tag}" if self.tag else self.name

    @property
    def projector_path(self) -> Path | None:
        """The vision projector (mmproj) stored with this model, if any."""
        p = self.manifest.get("projector")
        if isinstance(p, dict) and isinstance(p.get("path"), str):
            return Path(p["path"])
        return None

    @property
    def id(self) -> str:
        """Ollama-style short id: the first 12 hex of the digest."""
        return (self.digest or "")[:12]

    @property
    def modified_at(self) -> float:
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            return datetime.fromisoformat(self.manifest["pulled_at"]).timestamp()
        with contextlib.suppress(OSError):
            return self.path.stat().st_mtime
        return 0.0


class Store:
    def __init__(self, home: Path | str | None = None):
        self.home = Path(home).expanduser() if home is not None else default_home()
        self.blobs = self.home / "blobs"
        self.manifests = self.home / "manifests"
        self.partial = self.home / "partial"
        self.locks = self.home / "locks"

    # ----- paths and locks -------------------------------------------------------------

    def ensure_dirs(self) -> None:
        for d in (self.blobs, self.manifests, self.partial, self.locks):
            d.mkdir(parents=True, exist_ok=True)

    def blob_path(self, digest: str) -> Path:
        digest = digest.removeprefix("sha256:").lower()
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise StoreError(f"invalid sha256 digest {digest!r}")
        return self.blobs / f"sha256-{digest}"

    def has_blob(self, digest: str) -> bool:
        return self.blob_path(digest).is_file()

    def _manifest_path(self, n: ModelName) -> Path:
        return self.manifests / n.namespace / n.model / f"{n.tag}.json"

    def lock(self, key: str = "store") -> contextlib.AbstractContextManager[None]:
        """The store-wide lock (default) or a named one, e.g. per blob being downloaded."""
        if not key.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"bad lock key {key!r}")
        self.ensure_dirs()
        return file_lock(self.locks / f"{key}.lock")

    def new_temp(self, prefix: str) -> Path:
        """A unique temp path in partial/ (same filesystem as blobs/, so renames are atomic)."""
        self.ensure_dirs()
        return self.partial / f"{prefix}.{os.getpid()}.{time.monotonic_ns()}.tmp"

    def clean_stale(self, max_age: float = 86400.0) -> None:
        """Delete temp files a killed process left in partial/ (never *.partial: those are
        kept for resuming)."""
        if not self.partial.is_dir():
            return
        cutoff = time.time() - max_age
        for p in self.partial.glob("*.tmp"):
            with contextlib.suppress(OSError):
                if p.stat().st_mtime < cutoff:
                    p.unlink()

    # ----- reading ---------------------------------------------------------------------

    def _read_manifest(self, path: Path) -> dict[str, Any] | None:
        try:
            with open(path, encoding="utf-8") as f:
                m = json.load(f)
        except (OSError, ValueError):
            return None
        return m if isinstance(m, dict) and isinstance(m.get("digest"), str) else None

    def _ref(self, n: ModelName, m: dict[str, Any]) -> ModelRef:
        digest = m["digest"].removeprefix("sha256:")
        proj = m.get("projector")
        if isinstance(proj, dict) and isinstance(proj.get("digest"), str):
            m = dict(m, projector=dict(proj, path=str(self.blob_path(
                proj["digest"].removeprefix("sha256:")))))
        return ModelRef(n.name, n.tag, self.blob_path(digest), digest, int(m.get("size", 0)), m)

    def get(self, model: str) -> ModelRef | None:
        """The registered model `name[:tag]`, or None. No bundled fallback."""
        n = parse_name(model)
        m = self._read_manifest(self._manifest_path(n))
        if m is None:
            return None
        ref = self._ref(n, m)
        return ref if ref.path.is_file() else None

    def resolve(self, model: str, allow_path: bool = True) -> ModelRef:
        """`name[:tag]` -> its registered blob; a path to a .gguf -> an unregistered ref
        (only with allow_path: the daemon passes False, so a request can never make it open
        a file outside the store). A bundled model's name (bundled.py) falls back to (and
        registers) its package."""
        if not isinstance(model, str) or not model.strip():
            raise InvalidModelName("empty model name")
        if _is_path_like(model) and not allow_path:
            raise InvalidModelName(
                f"{model!r} is a file path, not a model name; import the file first with "
                f"`edgeinfer pull ./FILE.gguf --name NAME:TAG` and use that name")
        if _is_path_like(model):
            p = Path(model).expanduser()
            if not p.is_file():
                raise ModelNotFound(f"model file {model} does not exist")
            n = name_from_filename(p.name)
            return ModelRef(n.name, "", p.resolve(), None, p.stat().st_size,
                            {"source": str(p.resolve())})
        n = parse_name(model)
        ref = self.get(str(n))
        if ref is not None:
            return ref
        if bundled_available(str(n)):
            return self.ensure_bundled(str(n))
        raise ModelNotFound(f"model {str(n)!r} not found; run `edgeinfer pull {model}` "
                            f"or import a local file with `edgeinfer pull ./FILE.gguf --name {n}`")

    def list(self) -> list[ModelRef]:
        out = []
        if not self.manifests.is_dir():
            return out
        for path in sorted(self.manifests.glob("*/*/*.json")):
            ns, model, tag = path.parent.parent.name, path.parent.name, path.stem
            try:
                n = parse_name(f"{ns}/{model}:{tag}")
            except InvalidModelName:
                continue                # not ours (hand-made file); never crash a listing
            m = self._read_manifest(path)
            if m is None:
                continue
            with contextlib.suppress(StoreError):
                ref = self._ref(n, m)
                if ref.path.is_file():
                    out.append(ref)
        out.sort(key=lambda r: r.modified_at, reverse=True)
        return out

    def _digests_in_use(self) -> set[str]:
        used = set()
        for path in self.manifests.glob("*/*/*.json"):
            m = self._read_manifest(path)
            if m is not None:
                used.add(m["digest"].removeprefix("sha256:"))
                proj = m.get("projector")
                if isinstance(proj, dict) and isinstance(proj.get("digest"), str):
                    used.add(proj["digest"].removeprefix("sha256:"))
        return used

    # ----- writing ---------------------------------------------------------------------

    def _write_manifest(self, n: ModelName, manifest: dict[str, Any]) -> None:
        path = self._manifest_path(n)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.new_temp("manifest")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def _check_space(self, needed: int) -> None:
        free = shutil.disk_usage(self.partial).free
        if needed > free:
            raise StoreError(f"not enough disk space in {self.home}: the copy needs "
                             f"{needed / 1e6:.1f} MB but only {free / 1e6:.1f} MB is free")

    def _manifest_for(self, n: ModelName, digest: str, source: str,
                      summary: dict[str, Any]) -> dict[str, Any]:
        return {
            "schema": MANIFEST_SCHEMA,
            "name": str(n),
            "digest": f"sha256:{digest}",
            "size": self.blob_path(digest).stat().st_size,
            "source": source,
            "gguf": summary,
            "pulled_at": datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
        }

    def install_blob(self, tmp: Path, digest: str, name: str, source: str,
                     summary: dict[str, Any], readonly: bool = True) -> ModelRef:
        """Move a verified temp file (in partial/) into blobs/ and write the manifest, as one
        step under the store lock (so a concurrent `rm` cannot delete the blob in between).
        The caller has checked the digest and validated the file. `readonly=False` for a hard
        link to a user's file, whose mode we must not change."""
        n = parse_name(name)
        blob = self.blob_path(digest)
        with self.lock():
            if blob.is_file():
                tmp.unlink(missing_ok=True)     # same content already stored
            else:
                if readonly:
                    os.chmod(tmp, 0o444)
                os.replace(tmp, blob)
            manifest = self._manifest_for(n, digest, source, summary)
            self._write_manifest(n, manifest)
        return self._ref(n, manifest)

    def tag_existing(self, digest: str, name: str, source: str,
                     summary: dict[str, Any] | None = None) -> ModelRef:
        """Register `name` for a blob already in the store."""
        n = parse_name(name)
        if summary is None:
            summary = gguf_summary(self.blob_path(digest))
        with self.lock():
            if not self.has_blob(digest):
                raise ModelNotFound(f"blob sha256-{digest[:12]} vanished from the store")
            manifest = self._manifest_for(n, digest, source, summary)
            self._write_manifest(n, manifest)
        return self._ref(n, manifest)

    def register_file(self, path: Path | str, name: str | None, source: str | None = None,
                      move: bool = False, sha256: str | None = None) -> ModelRef:
        """Import a local GGUF file under `name` (default: from the file name). The file is
        validated first; it is hard-linked into blobs/ when possible, else copied (or
        renamed when `move`). With `sha256`, a file with another digest is refused."""
        path = Path(path).expanduser()
        n = parse_name(name) if name else name_from_filename(path.name)
        try:
            summary = gguf_summary(path)
        except GGUFError as e:
            raise StoreError(f"{path} is not a usable GGUF model: {e}") from None
        source = source or str(path.resolve())
        self.ensure_dirs()
        tmp = self.new_temp("import")
        try:
            linked = False
            if move:
                try:
                    os.replace(path, tmp)
                except OSError:                 # another filesystem
                    self._check_space(path.stat().st_size)
                    shutil.copyfile(path, tmp)
                    path.unlink()
            else:
                try:
                    os.link(path, tmp)
                    linked = True
                except OSError:                 # another filesystem, or links not allowed
                    self._check_space(path.stat().st_size)
                    shutil.copyfile(path, tmp)
            digest = sha256_file(tmp)
            if sha256 and digest != sha256.lower().removeprefix("sha256:"):
                if move:                        # give the user's file back
                    os.replace(tmp, path)
                raise StoreError(f"{path} has sha256 {digest}, expected {sha256}")
            return self.install_blob(tmp, digest, str(n), source, summary, readonly=not linked)
        finally:
            tmp.unlink(missing_ok=True)

    def copy(self, src: str, dst: str, allow_path: bool = True) -> ModelRef:
        ref = self.resolve(src, allow_path=allow_path)
        if not ref.registered:
            return self.register_file(ref.path, dst)
        n = parse_name(dst)
        with self.lock():
            m = dict(ref.manifest)
            m["name"] = str(n)
            m["copied_from"] = ref.full_name
            m["pulled_at"] = datetime.now(timezone.utc).isoformat(timespec="milliseconds")
            self._write_manifest(n, m)
        return self._ref(n, m)

    def remove(self, model: str) -> ModelRef:
        """Delete the manifest of `name[:tag]`; delete its blob when no manifest uses it."""
        n = parse_name(model)
        with self.lock():
            path = self._manifest_path(n)
            m = self._read_manifest(path)
            if m is None:
                raise ModelNotFound(f"model {str(n)!r} not found")
            ref = self._ref(n, m)
            path.unlink()
            for d in (path.parent, path.parent.parent):   # tidy empty name dirs
                with contextlib.suppress(OSError):
                    d.rmdir()
            used = self._digests_in_use()
            if ref.digest not in used:
                ref.path.unlink(missing_ok=True)
            proj = m.get("projector")
            if isinstance(proj, dict) and isinstance(proj.get("digest"), str):
                pd = proj["digest"].removeprefix("sha256:")
                if pd not in used:
                    self.blob_path(pd).unlink(missing_ok=True)
        return ref

    def attach_projector(self, model: str, path: Path | str, source: str | None = None,
                         move: bool = False) -> ModelRef:
        """Store a vision projector (mmproj GGUF) with the registered model `name[:tag]`:
        checked (a projector, of the model's width), linked or copied into blobs/, named in
        the model's manifest. `show`, /api/show and the loads find it there."""
        # lazy: the CLI imports the store, and `edgeinfer --help` stays fast without this
        from edgeinfer.formats.gguf_file import read_gguf
        from edgeinfer.formats.mmproj import check_pair, read_mmproj
        from edgeinfer.formats.model_config import load_model_config
        path = Path(path).expanduser()
        ref = self.resolve(model, allow_path=False)
        try:
            gf, vcfg = read_mmproj(str(path))
            gf.close()
            tf = read_gguf(str(ref.path))
            try:
                width = load_model_config(tf).n_embd
            finally:
                tf.close()
            check_pair(vcfg, width, ref.full_name)
        except GGUFError as e:
            raise StoreError(f"{path} cannot be {ref.full_name}'s projector: {e}") from None
        self.ensure_dirs()
        tmp = self.new_temp("mmproj")
        try:
            linked = False
            if move:
                try:
                    os.replace(path, tmp)
                except OSError:
                    shutil.copyfile(path, tmp)
                    path.unlink()
            else:
                try:
                    os.link(path, tmp)
                    linked = True
                except OSError:
                    self._check_space(path.stat().st_size)
                    shutil.copyfile(path, tmp)
            digest = sha256_file(tmp)
            blob = self.blob_path(digest)
            n = parse_name(ref.full_name)
            with self.lock():
                if blob.is_file():
                    tmp.unlink(missing_ok=True)
                else:
                    if not linked:
                        os.chmod(tmp, 0o444)
                    os.replace(tmp, blob)
                m = self._read_manifest(self._manifest_path(n))
                if m is None:
                    raise ModelNotFound(f"model {ref.full_name!r} vanished from the store")
                m["projector"] = {"digest": f"sha256:{digest}", "size": blob.stat().st_size,
                                  "source": source or str(path.resolve()),
                                  "projector_type": vcfg.projector,
                                  "tokens_per_image": vcfg.tokens_per_image,
                                  "image_size": vcfg.image_size,
                                  **({"longest_edge": vcfg.longest_edge}
                                     if vcfg.longest_edge else {})}
                self._write_manifest(n, m)
            return self._ref(n, m)
        finally:
            tmp.unlink(missing_ok=True)

    # ----- the bundled models ---------------------------------------------------------

    def ensure_bundled(self, name: str = BUNDLED_NAME) -> ModelRef:
        """Register the bundled model `name` from its packages (assembled once into blobs/,
        checked against its pinned sha256)."""
        b = bundled(name)
        if b is None:
            raise ModelNotFound(f"{name!r} is not a bundled model")
        if not b.available():
            raise ModelNotFound(f"the bundled model {name} needs the packages "
                                f"{', '.join(b.missing())}; install edgeinfer[bundled] or run "
                                f"`edgeinfer pull {name}`")
        digest = b.sha256
        existing = self.get(name)
        if existing is not None and existing.digest == digest:
            return existing
        source = f"bundled:{b.packages[0]}"
        with self.lock(f"blob-{digest}"):   # one assembler at a time, others wait and reuse
            if self.has_blob(digest):
                return self.tag_existing(digest, name, source)
            tmp = self.new_temp(f"sha256-{digest}")
            try:
                b.assemble(tmp)
                got = sha256_file(tmp)
                if got != digest:
                    raise StoreError(f"the bundled model {name} assembled with sha256 {got[:12]}, "
                                     f"expected {digest[:12]}; reinstall {', '.join(b.packages)}")
                try:
                    summary = gguf_summary(tmp)
                except GGUFError as e:
                    raise StoreError(f"the bundled model {name} is not a usable GGUF file: "
                                     f"{e}") from None
                return self.install_blob(tmp, digest, name, source, summary)
            finally:
                tmp.unlink(missing_ok=True)


def bundled_available(name: str | None = None) -> bool:
    """Whether the bundled model `name` (any of them, without a name) can be assembled here."""
    if name is None:
        return any(b.available() for b in BUNDLED.values())
    b = bundled(name)
    return b is not None and b.available()
