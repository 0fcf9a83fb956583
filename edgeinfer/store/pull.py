"""`pull`: bring a model into the store from a catalog name, hf://, an http(s) URL, a local
file, or the bundled package, and report progress as Ollama-style status events.

Order of work for a download: resolve the source -> HEAD for size and the hub's sha256 ->
refuse if the disk is too small -> take the per-blob file lock (a second pull of the same
blob waits here, then finds the blob installed) -> stream into partial/ with resume ->
verify sha256 -> validate as GGUF -> atomic install + manifest. A failure registers
nothing; only a partial file worth resuming stays behind.
"""
from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Callable
from urllib.parse import quote, urlsplit

import httpx

from .download import (DownloadError, DownloadPolicy, RemoteInfo, check_disk, download, probe)
from edgeinfer.formats.gguf_error import GGUFError
from edgeinfer.settings import current
from .names import InvalidModelName, ModelName, ModelNotFound, StoreError, name_from_filename, \
    parse_name
from .bundled import by_package
from .model_store import ModelRef, Store, gguf_summary, sha256_file

__all__ = ["pull", "pull_projector", "PullProgress", "PullSource", "CatalogEntry", "load_catalog",
           "resolve_source", "ChecksumMismatch", "InvalidDownload", "HF_ENDPOINT_DEFAULT"]

HF_ENDPOINT_DEFAULT = "https://huggingface.co"
_HEX64 = re.compile(r"[0-9a-f]{64}")
_HF_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class ChecksumMismatch(DownloadError):
    pass


class InvalidDownload(DownloadError):
    pass


@dataclass(frozen=True)
class PullProgress:
    """One progress event; maps 1:1 onto a line of Ollama's POST /api/pull NDJSON stream.
    `digest` is in Ollama's wire form, `sha256:<hex>`."""
    status: str
    digest: str | None = None
    total: int | None = None
    completed: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


ProgressFn = Callable[[PullProgress], None]


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    repo: str
    file: str
    revision: str = "main"
    sha256: str | None = None
    description: str = ""
    bundled: str | None = None          # importable package that ships the same model
    bundled_sha256: str | None = None
    mmproj: str | None = None           # the vision projector's file in the same repo

    @property
    def hf_uri(self) -> str:
        return f"hf://{self.repo}/{self.file}@{self.revision}"

    @property
    def mmproj_uri(self) -> str | None:
        return f"hf://{self.repo}/{self.mmproj}@{self.revision}" if self.mmproj else None


def load_catalog() -> dict[str, CatalogEntry]:
    raw = json.loads(resources.files("edgeinfer.store").joinpath("catalog.json").read_text("utf-8"))
    out = {}
    for key, e in raw.items():
        if key.startswith("_"):
            continue
        name = str(parse_name(key))
        out[name] = CatalogEntry(name, e["repo"], e["file"], e.get("revision", "main"),
                                 e.get("sha256"), e.get("description", ""), e.get("bundled"),
                                 e.get("bundled_sha256"), e.get("mmproj"))
    return out


@dataclass(frozen=True)
class PullSource:
    kind: str                   # "catalog" | "hf" | "url" | "file"
    source: str                 # what the manifest records
    name: ModelName             # the name it will be registered under
    url: str | None = None
    path: Path | None = None
    sha256: str | None = None   # expected digest, when known up front
    headers: tuple[tuple[str, str], ...] = ()
    bundled: str | None = None  # package to use instead of downloading (catalog only)
    bundled_sha256: str | None = None
    mmproj: str | None = None   # a projector that comes with it (catalog entries that name one)


def hf_endpoint() -> str:
    return (current().hf_endpoint or HF_ENDPOINT_DEFAULT).rstrip("/")


def hf_url(repo: str, file: str, revision: str = "main") -> str:
    return f"{hf_endpoint()}/{repo}/resolve/{quote(revision, safe='')}/{quote(file)}"


def _hf_headers() -> tuple[tuple[str, str], ...]:
    token = current().hf_token
    return (("Authorization", f"Bearer {token}"),) if token else ()


def _parse_hf(uri: str) -> tuple[str, str, str]:
    """hf://OWNER/REPO/PATH/FILE.gguf[@REVISION] -> (owner/repo, path, revision)."""
    rest = uri[len("hf://"):]
    revision = "main"
    if "@" in rest:
        rest, revision = rest.rsplit("@", 1)
    parts = rest.split("/")
    if len(parts) < 3 or not revision or any(not p for p in parts):
        raise InvalidModelName(f"invalid Hugging Face source {uri!r}: expected "
                               f"hf://OWNER/REPO/FILE.gguf[@REVISION]")
    for p in parts[:2]:
        if not _HF_PART.fullmatch(p) or ".." in p:
            raise InvalidModelName(f"invalid Hugging Face repository in {uri!r}")
    if any(p in (".", "..") for p in parts[2:]):
        raise InvalidModelName(f"invalid file path in {uri!r}")
    return f"{parts[0]}/{parts[1]}", "/".join(parts[2:]), revision


def _check_sha(sha256: str | None) -> str | None:
    if sha256 is None:
        return None
    s = sha256.strip().lower().removeprefix("sha256:")
    if not _HEX64.fullmatch(s):
        raise StoreError(f"invalid --sha256 {sha256!r}: expected 64 hex digits")
    return s


def resolve_source(source: str, name: str | None = None, sha256: str | None = None,
                   store: Store | None = None) -> PullSource:
    """Work out where SOURCE comes from and what it will be called."""
    sha = _check_sha(sha256)
    given = parse_name(name) if name else None
    src = source.strip()
    low = src.lower()
    if low.startswith("hf://"):
        repo, file, rev = _parse_hf(src)
        return PullSource("hf", src, given or name_from_filename(file), url=hf_url(repo, file, rev),
                          sha256=sha, headers=_hf_headers())
    if low.startswith(("http://", "https://")):
        url = src
        parts = urlsplit(url)
        # A hub "blob" page link means the file itself.
        if parts.netloc.endswith("huggingface.co") and "/blob/" in parts.path:
            url = url.replace("/blob/", "/resolve/", 1)
        headers = _hf_headers() if urlsplit(url).netloc == urlsplit(hf_endpoint()).netloc else ()
        return PullSource("url", src, given or name_from_filename(parts.path or "model"),
                          url=url, sha256=sha, headers=headers)
    p = Path(src).expanduser()
    if low.endswith(".gguf") or src.startswith(("/", "./", "../", "~")) or p.is_file():
        if not p.is_file():
            raise ModelNotFound(f"local file {src} does not exist")
        return PullSource("file", str(p.resolve()), given or name_from_filename(p.name), path=p,
                          sha256=sha)
    n = parse_name(src)
    entry = load_catalog().get(str(n))
    if entry is not None:
        return PullSource("catalog", entry.hf_uri, given or n,
                          url=hf_url(entry.repo, entry.file, entry.revision),
                          sha256=sha or entry.sha256, headers=_hf_headers(),
                          bundled=entry.bundled, bundled_sha256=entry.bundled_sha256,
                          mmproj=entry.mmproj_uri)
    # Not in the catalog: re-pull a registered model from where it came from.
    store = store or Store()
    ref = store.get(str(n))
    if ref is not None:
        prev = str(ref.manifest.get("source", ""))
        if prev.lower().startswith(("hf://", "http://", "https://")):
            return resolve_source(prev, name=str(given or n), sha256=sha, store=store)
    known = ", ".join(sorted(load_catalog()))
    raise ModelNotFound(f"unknown model {str(n)!r}: not in the catalog ({known}); pull "
                        f"hf://OWNER/REPO/FILE.gguf, an https:// URL, or a local .gguf file")


def _emit(progress: ProgressFn | None, status: str, digest: str | None = None,
          total: int | None = None, completed: int | None = None) -> None:
    if progress is not None:
        progress(PullProgress(status, f"sha256:{digest}" if digest else None, total, completed))


def _finish(progress: ProgressFn | None, ref: ModelRef) -> ModelRef:
    _emit(progress, "writing manifest")
    _emit(progress, "success")
    return ref


def pull(source: str, name: str | None = None, sha256: str | None = None,
         store: Store | None = None, progress: ProgressFn | None = None,
         policy: DownloadPolicy | None = None) -> ModelRef:
    """Pull SOURCE into the store and return the registered model. `progress` receives
    PullProgress events; it may raise to cancel (the partial file is kept for resuming).
    A catalog entry that names a vision projector brings it too (Store.attach_projector)."""
    store = store or Store()
    ref = _pull_model(source, name, sha256, store, progress, policy)
    src = resolve_source(source, name, sha256, store)
    if src.mmproj and ref.projector_path is None:
        _emit(progress, "pulling vision projector")
        ref = pull_projector(store, ref.full_name, src.mmproj, policy=policy)
        _emit(progress, "success")
    return ref


def _pull_model(source: str, name: str | None, sha256: str | None, store: Store,
                progress: ProgressFn | None, policy: DownloadPolicy | None) -> ModelRef:
    started = time.time()   # a concurrent pull of this source that ends later is reused
    store = store or Store()
    policy = policy or DownloadPolicy()
    src = resolve_source(source, name, sha256, store)
    store.clean_stale()
    _emit(progress, "pulling manifest")

    if src.kind == "file":
        assert src.path is not None
        _emit(progress, f"importing {src.path}")
        _emit(progress, "verifying sha256 digest")
        ref = store.register_file(src.path, str(src.name), source=src.source, sha256=src.sha256)
        return _finish(progress, ref)

    # A bundled package ships the catalog's model (gemma3:270m, qwen2.5-coder:0.5b): no
    # network needed.
    shipped = by_package(src.bundled) if src.bundled else None
    if shipped and src.bundled_sha256 == shipped.sha256 \
            and (src.sha256 in (None, shipped.sha256)) and shipped.available():
        digest = shipped.sha256
        if not store.has_blob(digest):
            _emit(progress, "assembling the bundled model", digest)
        ref = store.ensure_bundled(shipped.name)
        if str(src.name) != f"{ref.name}:{ref.tag}":
            ref = store.tag_existing(ref.digest or digest, str(src.name), ref.manifest["source"],
                                     ref.manifest.get("gguf"))
        _emit(progress, f"pulling {digest[:12]}", digest, ref.size, ref.size)
        _emit(progress, "verifying sha256 digest")
        return _finish(progress, ref)

    assert src.url is not None
    headers = dict(src.headers)
    expected = src.sha256
    if expected and store.has_blob(expected):
        return _tag_known(store, src, expected, progress)

    store.ensure_dirs()
    with httpx.Client(timeout=policy.timeout(), follow_redirects=True,
                      headers={"User-Agent": "edgeinfer"}) as client:
        info = probe(client, src.url, headers, policy)
        if expected and info.sha256 and info.sha256 != expected:
            raise ChecksumMismatch(f"{src.source} is published with sha256 {info.sha256}, "
                                   f"not the expected {expected}")
        expected = expected or info.sha256
        if expected and store.has_blob(expected):
            return _tag_known(store, src, expected, progress)
        key = _partial_key(src.url, expected, info)
        partial = store.partial / f"{key}.partial"
        have = partial.stat().st_size if partial.exists() else 0
        if info.size is not None:
            check_disk(store.partial, info.size - have)
        with store.lock("blob-" + key.removeprefix("sha256-") if expected else key):
            # Someone else may have finished this blob while we waited for the lock.
            if expected and store.has_blob(expected):
                return _tag_known(store, src, expected, progress)
            if not expected:
                reused = _recently_pulled(store, src.source, started)
                if reused:
                    return _tag_known(store, src, reused, progress)
            return _download_and_install(client, store, src, headers, policy, partial,
                                         expected, progress)


def _partial_key(url: str, expected: str | None, info: RemoteInfo) -> str:
    if expected:
        return f"sha256-{expected}"
    # Unknown digest: name the partial by URL and the server's validators, so a changed
    # remote file never resumes onto stale bytes.
    ident = f"{url}\n{info.etag or ''}\n{info.size or ''}"
    return "url-" + hashlib.sha256(ident.encode()).hexdigest()[:32]


def _recently_pulled(store: Store, source: str, since: float) -> str | None:
    """The digest a concurrent pull of the same source installed while we waited."""
    for ref in store.list():
        if ref.manifest.get("source") == source and ref.modified_at >= since:
            return ref.digest
    return None


def _tag_known(store: Store, src: PullSource, digest: str, progress: ProgressFn | None
               ) -> ModelRef:
    size = store.blob_path(digest).stat().st_size
    _emit(progress, f"pulling {digest[:12]}", digest, size, size)
    _emit(progress, "verifying sha256 digest")
    ref = store.tag_existing(digest, str(src.name), src.source)
    return _finish(progress, ref)


def _download_and_install(client: httpx.Client, store: Store, src: PullSource,
                          headers: dict[str, str], policy: DownloadPolicy, partial: Path,
                          expected: str | None, progress: ProgressFn | None) -> ModelRef:
    label = f"pulling {expected[:12]}" if expected else \
        f"pulling {Path(urlsplit(src.url or '').path).name or 'model'}"
    last = [0.0]

    def on_bytes(done: int, total: int | None) -> None:
        now = time.monotonic()
        if now - last[0] >= 0.1 or (total is not None and done >= total):
            last[0] = now
            _emit(progress, label, expected, total, done)

    assert src.url is not None
    info = download(client, src.url, partial, headers, policy, on_bytes)
    if expected is None and info.sha256:
        expected = info.sha256
    _emit(progress, "verifying sha256 digest", expected)
    digest = sha256_file(partial)
    if expected and digest != expected:
        partial.unlink(missing_ok=True)
        raise ChecksumMismatch(f"the file from {src.source} has sha256 {digest}, expected "
                               f"{expected}; the download was discarded")
    try:
        summary = gguf_summary(partial)
    except GGUFError as e:
        partial.unlink(missing_ok=True)
        raise InvalidDownload(f"the file from {src.source} is not a usable GGUF model "
                              f"({e}); the download was discarded") from None
    ref = store.install_blob(partial, digest, str(src.name), src.source, summary)
    return _finish(progress, ref)


def pull_projector(store: Store, model: str, source: str,
                   on_bytes: Callable[[int, int | None], None] | None = None,
                   policy: DownloadPolicy | None = None) -> ModelRef:
    """Attach the vision projector (mmproj GGUF) at `source` (a local file, an http(s) URL or
    hf://OWNER/REPO/FILE.gguf[@REVISION]) to the registered model `model`, checked and stored
    with it (Store.attach_projector)."""
    if "://" not in source:
        return store.attach_projector(model, Path(source))
    headers: dict[str, str] = {}
    url = source
    if source.startswith("hf://"):
        repo, file, rev = _parse_hf(source)
        url, headers = hf_url(repo, file, rev), dict(_hf_headers())
    elif not source.startswith(("http://", "https://")):
        raise StoreError(f"unsupported projector source {source!r}: a local .gguf path, an "
                         "http(s) URL or hf://OWNER/REPO/FILE.gguf")
    store.ensure_dirs()
    tmp = store.new_temp("mmproj-download")
    policy = policy or DownloadPolicy()
    try:
        with httpx.Client(timeout=policy.timeout()) as client:
            download(client, url, tmp, headers, policy, on_bytes or (lambda done, total: None))
        return store.attach_projector(model, tmp, source=source, move=True)
    finally:
        tmp.unlink(missing_ok=True)
