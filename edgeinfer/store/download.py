"""Resumable HTTP downloads into a partial file (httpx, streaming).

One `download()` call fetches a URL into `dest`, appending to what is already there with
`Range: bytes=N-` (after a dropped connection or a restarted pull). Transient failures
(connection drops, timeouts, 5xx, 429) are retried with exponential backoff; the attempt
counter resets whenever an attempt made progress, so a flaky link still finishes. A server
that ignores Range (200 instead of 206) restarts the file cleanly from byte 0.
"""
from __future__ import annotations

import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable
from urllib.parse import urlsplit

import httpx

from .names import StoreError

_SHA256_RE = re.compile(r"[0-9a-f]{64}")


class DownloadError(StoreError):
    """A download that failed; the message names the URL or host."""


class OfflineError(DownloadError):
    pass


class RemoteNotFound(DownloadError):
    pass


class DiskFullError(DownloadError):
    pass


@dataclass(frozen=True)
class DownloadPolicy:
    retries: int = 5                # failed attempts in a row (without progress) before giving up
    connect_retries: int = 2        # fewer when the host cannot be reached at all (offline)
    max_attempts: int = 50          # hard cap, progress or not
    backoff: float = 0.5            # first retry delay in seconds, doubled each time
    backoff_max: float = 10.0
    connect_timeout: float = 15.0
    read_timeout: float = 60.0
    chunk_size: int = 1 << 20

    def timeout(self) -> httpx.Timeout:
        return httpx.Timeout(self.read_timeout, connect=self.connect_timeout)


@dataclass(frozen=True)
class RemoteInfo:
    url: str                        # after redirects
    size: int | None                # whole file, when the server said
    sha256: str | None              # from X-Linked-Etag / ETag when it is a sha256
    etag: str | None
    accept_ranges: bool


def host_of(url: str | httpx.URL) -> str:
    parts = urlsplit(str(url))
    return parts.netloc.rsplit("@", 1)[-1] or str(url)


def etag_sha256(responses: Iterable[httpx.Response]) -> tuple[str | None, str | None]:
    """(sha256, etag) from a response chain. The hub puts an LFS file's sha256 in
    X-Linked-Etag on the redirect (and in ETag on the resolve response)."""
    sha = etag = None
    for r in responses:
        for key in ("x-linked-etag", "etag"):
            v = r.headers.get(key)
            if not v:
                continue
            v = v.strip()
            v = v[2:] if v.startswith("W/") else v
            v = v.strip('"').lower()
            etag = etag or v
            if sha is None and _SHA256_RE.fullmatch(v):
                sha = v
    return sha, etag


def _total_from(r: httpx.Response, offset: int) -> int | None:
    cr = r.headers.get("content-range")
    if cr and "/" in cr:
        total = cr.rsplit("/", 1)[1].strip()
        if total.isdigit():
            return int(total)
    for key in ("x-linked-size", "content-length"):
        v = r.headers.get(key)
        if v and v.isdigit():
            return int(v) + (offset if key == "content-length" and r.status_code == 206 else 0)
    return None


def check_disk(directory: Path, needed: int | None) -> None:
    if not needed or needed <= 0:
        return
    free = shutil.disk_usage(directory).free
    if needed > free:
        raise DiskFullError(f"not enough disk space in {directory}: the download needs "
                            f"{_human(needed)} but only {_human(free)} is free")


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


class _Retry(Exception):
    """A transient failure: try again (after backoff)."""


def _offline(url: str | httpx.URL, err: Exception) -> OfflineError:
    return OfflineError(
        f"cannot reach {host_of(url)} ({type(err).__name__}: {err or 'no details'}); check the "
        f"network, or download the .gguf elsewhere and import it with "
        f"`edgeinfer pull ./FILE.gguf --name NAME:TAG`")


def _status_error(r: httpx.Response, url: str) -> DownloadError:
    code = r.status_code
    if code == 404:
        return RemoteNotFound(f"not found (HTTP 404): {url}")
    if code in (401, 403):
        return DownloadError(f"access denied (HTTP {code}) for {url}: the repository may be "
                             f"gated or private; set HF_TOKEN to a token that can read it")
    return DownloadError(f"HTTP {code} from {host_of(r.url)} for {url}")


def _transient(code: int) -> bool:
    return code == 429 or code == 408 or 500 <= code < 600


class _Retrier:
    """Counts failures and sleeps with exponential backoff; raises when out of attempts."""

    def __init__(self, url: str, policy: DownloadPolicy, sleep: Callable[[float], None]):
        self.url, self.policy, self.sleep = url, policy, sleep
        self.failures = 0
        self.connect_failures = 0
        self.attempts = 0

    def failed(self, err: Exception, progressed: bool) -> None:
        p = self.policy
        self.attempts += 1
        if progressed:
            self.failures = 0
        self.failures += 1
        if isinstance(err, (httpx.ConnectError, httpx.ConnectTimeout)):
            self.connect_failures += 1
            if self.connect_failures > p.connect_retries:
                raise _offline(getattr(getattr(err, "request", None), "url", self.url), err)
        if self.failures > p.retries or self.attempts >= p.max_attempts:
            raise DownloadError(f"download from {self.url} failed after {self.attempts} "
                                f"attempts: {err}") from None
        self.sleep(min(p.backoff * 2 ** (self.failures - 1), p.backoff_max))


def _same_origin(a: httpx.URL, b: httpx.URL) -> bool:
    return (a.scheme, a.host, a.port) == (b.scheme, b.host, b.port)


def probe(client: httpx.Client, url: str, headers: dict[str, str], policy: DownloadPolicy,
          sleep: Callable[[float], None] = time.sleep) -> RemoteInfo:
    """HEAD the URL for size and sha256. Redirects are followed on the same host only: the
    hub answers for an LFS file with a redirect that carries X-Linked-Etag/X-Linked-Size,
    and the CDN's signed URL behind it may refuse HEAD. Unreachable hosts, 404 and auth
    failures raise; anything else odd returns what is known and lets the GET decide."""
    retrier = _Retrier(url, policy, sleep)
    current = httpx.URL(url)
    history: list[httpx.Response] = []
    while True:
        try:
            r = client.head(current, headers=headers, follow_redirects=False)
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            retrier.failed(e, False)
            continue
        except httpx.TransportError:
            return RemoteInfo(str(current), None, *etag_sha256(history), False)
        if r.is_redirect and "location" in r.headers and len(history) < 10:
            history.append(r)
            nxt = current.join(r.headers["location"])
            if not _same_origin(current, nxt):
                size = r.headers.get("x-linked-size", "")
                return RemoteInfo(str(nxt), int(size) if size.isdigit() else None,
                                  *etag_sha256(history), False)
            current = nxt
            continue
        if r.status_code in (401, 403, 404):
            raise _status_error(r, url)
        if r.status_code >= 300:
            return RemoteInfo(str(current), None, *etag_sha256(history), False)
        sha, etag = etag_sha256([*history, r])
        return RemoteInfo(str(current), _total_from(r, 0), sha, etag,
                          r.headers.get("accept-ranges", "").lower() == "bytes")


def download(client: httpx.Client, url: str, dest: Path, headers: dict[str, str],
             policy: DownloadPolicy, on_progress: Callable[[int, int | None], None],
             sleep: Callable[[float], None] = time.sleep) -> RemoteInfo:
    """Fetch `url` into `dest`, resuming from dest's current size. Returns what the server
    said about the file. `dest` is left in place on failure (for the next resume)."""
    retrier = _Retrier(url, policy, sleep)
    info = RemoteInfo(url, None, None, None, False)
    while True:
        offset = dest.stat().st_size if dest.exists() else 0
        req_headers = dict(headers)
        req_headers["Accept-Encoding"] = "identity"     # byte ranges of the real file
        if offset:
            req_headers["Range"] = f"bytes={offset}-"
        written = 0
        try:
            with client.stream("GET", url, headers=req_headers, follow_redirects=True) as r:
                if r.status_code == 416 and offset:
                    total = _total_from(r, 0)
                    if total == offset:          # the partial file is already complete
                        return RemoteInfo(str(r.url), total, *etag_sha256([*r.history, r]),
                                          True)
                    dest.unlink()                # stale partial larger than the file
                    raise _Retry("the server refused the resume range; restarting")
                if _transient(r.status_code):
                    raise _Retry(f"HTTP {r.status_code} from {host_of(r.url)}")
                if r.status_code not in (200, 206):
                    raise _status_error(r, url)
                sha, etag = etag_sha256([*r.history, r])
                mode = "ab"
                if r.status_code == 206:
                    cr = r.headers.get("content-range", "")
                    m = re.match(r"bytes (\d+)-", cr)
                    if not m or int(m.group(1)) != offset:
                        dest.unlink(missing_ok=True)
                        raise _Retry(f"the server answered range {cr!r} to bytes={offset}-")
                elif offset:
                    mode, offset = "wb", 0       # Range ignored: start over cleanly
                total = _total_from(r, offset)
                info = RemoteInfo(str(r.url), total, sha, etag, r.status_code == 206
                                  or r.headers.get("accept-ranges", "").lower() == "bytes")
                check_disk(dest.parent, total - offset if total is not None else None)
                on_progress(offset, total)
                # Unbuffered iteration: every byte received is on disk before a drop, so
                # the resume offset is exact; the file object does the write batching.
                with open(dest, mode, buffering=policy.chunk_size) as f:
                    for chunk in r.iter_bytes():
                        f.write(chunk)
                        written += len(chunk)
                        on_progress(offset + written, total)
                    f.flush()
                    os.fsync(f.fileno())
                if total is not None and offset + written != total:
                    raise _Retry(f"connection closed after {offset + written} of {total} bytes")
                return info
        except (httpx.TransportError, _Retry) as e:
            retrier.failed(e, written > 0)
