"""The TUI's only view of the daemon: an `httpx.AsyncClient` wrapper with typed results.

Every field name the daemon sends is read here and nowhere else, so adapting to the server's
exact shapes is a change to this one module. Parsing is tolerant: a missing figure becomes
`None` (shown as "-"), never an exception in a widget.

Errors come in two kinds:
- `DaemonUnreachable`: the connection failed or broke (daemon down, killed, restarting).
  The app turns this into the reconnect banner.
- `ApiError`: the daemon answered with an error (unknown model, bad request, ...). Its
  message is the daemon's own sentence and is shown to the user as is.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, AsyncIterator

import httpx

from edgeinfer.settings import current

DEFAULT_HOST = "127.0.0.1:11435"


class DaemonUnreachable(Exception):
    """The daemon could not be reached or the connection broke."""


class ApiError(Exception):
    """The daemon answered with an error status; the message is its `error` text."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


def resolve_base_url(host: str | None = None) -> str:
    """`host:port`, `http(s)://host:port` or None (EDGEINFER_HOST, then the default)."""
    host = host or current().host or DEFAULT_HOST
    host = host.strip().rstrip("/")
    if not host.startswith(("http://", "https://")):
        host = "http://" + host
    return host


# ----- typed results ----------------------------------------------------------------------

@dataclass(frozen=True)
class ModelInfo:
    name: str
    size: int | None = None            # bytes on disk
    family: str | None = None
    parameter_size: str | None = None
    quantization: str | None = None
    modified_at: datetime | None = None


@dataclass(frozen=True)
class LoadedModel:
    name: str
    memory: int | None = None          # bytes resident (weights + KV)
    expires_at: datetime | None = None
    # a load in progress: what it is doing ("compiling kernels (3/12)", "loading weights")
    status: str | None = None


@dataclass(frozen=True)
class Stats:
    """One sample of the daemon's live figures (one `/api/stats/stream` event)."""
    tokens_per_s: float | None = None
    running: int | None = None
    waiting: int | None = None
    kv_used: int | None = None
    kv_total: int | None = None
    prefix_hit_rate: float | None = None      # 0..1
    rss: int | None = None                    # bytes, daemon process
    mem_used: int | None = None               # bytes, whole system
    mem_total: int | None = None
    gpu_used: int | None = None
    gpu_total: int | None = None
    models: tuple[LoadedModel, ...] = ()


@dataclass
class ChatChunk:
    """One line of a streamed chat reply. The last one has `done=True` and the figures."""
    content: str = ""
    done: bool = False
    eval_count: int | None = None
    eval_duration_s: float | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration_s: float | None = None
    total_duration_s: float | None = None
    done_reason: str | None = None


@dataclass(frozen=True)
class PullProgress:
    status: str
    digest: str | None = None
    total: int | None = None
    completed: int | None = None


@dataclass
class ChatOptions:
    temperature: float | None = None
    system: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


# ----- parsing ----------------------------------------------------------------------------

def _get(d: Any, *paths: str) -> Any:
    """First present value among dotted paths ("kv.used", "kv_blocks_used", ...)."""
    for path in paths:
        cur = d
        for part in path.split("."):
            if isinstance(cur, dict) and part in cur:
                cur = cur[part]
            else:
                cur = None
                break
        if cur is not None:
            return cur
    return None


def _num(v: Any, kind: type = float) -> Any:
    if v is None or isinstance(v, bool):
        return None
    try:
        return kind(v)
    except (TypeError, ValueError):
        return None


def parse_time(v: Any) -> datetime | None:
    """RFC 3339 string (Go's nanosecond fractions included) or Unix seconds."""
    if v is None or v == "":
        return None
    if isinstance(v, (int, float)):
        return datetime.fromtimestamp(float(v), tz=timezone.utc)
    s = str(v).strip().replace("Z", "+00:00")
    if "." in s:  # trim fractions past microseconds (Go writes nanoseconds)
        head, _, rest = s.partition(".")
        digits = "".join(ch for ch in rest if ch.isdigit())
        tz = rest[len(digits):]
        s = f"{head}.{digits[:6]}{tz}"
    try:
        t = datetime.fromisoformat(s)
    except ValueError:
        return None
    if t.tzinfo is None:
        t = t.replace(tzinfo=timezone.utc)
    if t.year < 1971 or t.year > 2200:   # Go's zero or max time: "never"
        return None
    return t


def parse_model(d: dict) -> ModelInfo:
    details = d.get("details") or {}
    return ModelInfo(
        name=str(d.get("name") or d.get("model") or "?"),
        size=_num(d.get("size"), int),
        family=details.get("family") or d.get("family"),
        parameter_size=details.get("parameter_size") or d.get("parameter_size"),
        quantization=details.get("quantization_level") or d.get("quantization"),
        modified_at=parse_time(d.get("modified_at")),
    )


def parse_loaded(d: dict) -> LoadedModel:
    """An /api/ps entry (or a /api/stats `models` one); a load in progress (state
    "loading", or an entry of /api/stats `loading`) carries its progress text."""
    status = None
    if d.get("state") == "loading" or "stage" in d:
        lp = d.get("load_progress") if isinstance(d.get("load_progress"), dict) else d
        status = str(lp.get("text") or lp.get("stage") or "loading")
        step = lp.get("step")
        if step and lp.get("stage") == "compiling kernels":
            status += f": {step}"
    return LoadedModel(
        name=str(d.get("name") or d.get("model") or "?"),
        memory=None if status else _num(_get(d, "size_bytes", "memory", "memory_bytes", "size"), int),
        expires_at=None if status else parse_time(d.get("expires_at")),
        status=status,
    )


def loading_status(models, model: str) -> str | None:
    """The load progress of `model` among a sample's models ("compiling kernels (3/12), ..."),
    or None when it is not loading."""
    for m in models:
        if m.status and (m.name == model or m.name == f"{model}:latest"):
            return m.status
    return None


def _sum(models: list[dict], key: str) -> int | None:
    vals = [_num(m.get(key), int) for m in models]
    vals = [v for v in vals if v is not None]
    return sum(vals) if vals else None


def parse_stats(d: dict) -> Stats:
    """One stats event. The daemon's shape (edgeinfer/server/metrics.py `snapshot`):
    top-level tokens_per_s, running, queue_depth; process.rss_bytes; system.memory_*_bytes;
    per-model KV blocks and prefix hit rate in `models` (summed / averaged here)."""
    models = [m for m in (_get(d, "models", "loaded_models") or []) if isinstance(m, dict)]
    hit = _num(_get(d, "prefix_hit_rate", "prefix_cache.hit_rate", "prefix_cache_hit_rate"))
    if hit is None:
        rates = [_num(m.get("prefix_hit_rate")) for m in models]
        rates = [r for r in rates if r is not None]
        hit = sum(rates) / len(rates) if rates else None
    if hit is not None and hit > 1.0:          # a percentage
        hit = hit / 100.0
    kv_used = _num(_get(d, "kv_blocks_used", "kv.used", "kv.blocks_used"), int)
    kv_total = _num(_get(d, "kv_blocks_total", "kv.total", "kv.blocks_total"), int)
    if kv_total is None and models:
        kv_used, kv_total = _sum(models, "kv_blocks_used"), _sum(models, "kv_blocks_total")
    mem_total = _num(_get(d, "system.memory_total_bytes", "mem_total", "system.memory_total",
                          "system_memory_total"), int)
    mem_used = _num(_get(d, "system.memory_used_bytes", "mem_used", "system.memory_used",
                         "system_memory_used"), int)
    avail = _num(_get(d, "system.memory_available_bytes"), int)
    if mem_used is None and mem_total is not None and avail is not None:
        mem_used = mem_total - avail
    return Stats(
        tokens_per_s=_num(_get(d, "tokens_per_s", "tokens_per_second")),
        running=_num(_get(d, "running", "requests.running"), int),
        waiting=_num(_get(d, "queue_depth", "waiting", "queued", "requests.waiting"), int),
        kv_used=kv_used,
        kv_total=kv_total,
        prefix_hit_rate=hit,
        rss=_num(_get(d, "process.rss_bytes", "rss", "rss_bytes", "process.rss"), int),
        mem_used=mem_used,
        mem_total=mem_total,
        gpu_used=_num(_get(d, "gpu.memory_used_bytes", "gpu.used_bytes", "gpu_memory_used",
                           "gpu.used"), int),
        gpu_total=_num(_get(d, "gpu.memory_total_bytes", "gpu.total_bytes",
                            "gpu_memory_total", "gpu.total"), int),
        models=tuple(parse_loaded(m) for m in models) + tuple(
            parse_loaded(m) for m in (d.get("loading") or []) if isinstance(m, dict)),
    )


def parse_chat_line(d: dict) -> ChatChunk:
    msg = d.get("message") or {}
    content = msg.get("content") if isinstance(msg, dict) else None
    if content is None:
        content = d.get("response") or ""

    def secs(key: str) -> float | None:
        ns = _num(d.get(key))
        return ns / 1e9 if ns is not None else None

    return ChatChunk(
        content=str(content),
        done=bool(d.get("done")),
        eval_count=_num(d.get("eval_count"), int),
        eval_duration_s=secs("eval_duration"),
        prompt_eval_count=_num(d.get("prompt_eval_count"), int),
        prompt_eval_duration_s=secs("prompt_eval_duration"),
        total_duration_s=secs("total_duration"),
        done_reason=d.get("done_reason"),
    )


def _error_text(response: httpx.Response) -> str:
    try:
        body = response.json()
    except (ValueError, httpx.ResponseNotRead):
        body = None
    if isinstance(body, dict):
        err = body.get("error") or body.get("detail")
        if isinstance(err, dict):
            err = err.get("message") or json.dumps(err)
        if err:
            return str(err)
    text = ""
    try:
        text = response.text.strip()
    except httpx.ResponseNotRead:
        pass
    return text[:200] or f"HTTP {response.status_code}"


# ----- the client -------------------------------------------------------------------------

class DaemonClient:
    """Async client of one daemon. One instance per app; `close()` on exit."""

    def __init__(self, base_url: str | None = None, *,
                 transport: httpx.AsyncBaseTransport | None = None,
                 timeout: float = 10.0) -> None:
        self.base_url = resolve_base_url(base_url)
        key = current().api_key
        self._http = httpx.AsyncClient(
            base_url=self.base_url, transport=transport,
            headers={"Authorization": f"Bearer {key}"} if key else {},
            timeout=httpx.Timeout(timeout, read=None), trust_env=False)

    @property
    def host(self) -> str:
        return self.base_url.split("://", 1)[-1]

    async def close(self) -> None:
        await self._http.aclose()

    # -- plumbing
    async def _request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            r = await self._http.request(method, path, **kw)
        except httpx.TransportError as e:
            raise DaemonUnreachable(_transport_text(e)) from None
        if r.status_code >= 400:
            raise ApiError(_error_text(r), r.status_code)
        return r

    async def _lines(self, method: str, path: str, **kw: Any) -> AsyncIterator[str]:
        try:
            async with self._http.stream(method, path, **kw) as r:
                if r.status_code >= 400:
                    await r.aread()
                    raise ApiError(_error_text(r), r.status_code)
                async for line in r.aiter_lines():
                    yield line
        except httpx.TransportError as e:
            raise DaemonUnreachable(_transport_text(e)) from None

    async def _ndjson(self, method: str, path: str, **kw: Any) -> AsyncIterator[dict]:
        async for line in self._lines(method, path, **kw):
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict) and obj.get("error"):
                raise ApiError(str(obj["error"]))
            if isinstance(obj, dict):
                yield obj

    # -- endpoints
    async def health(self) -> bool:
        try:
            r = await self._http.get("/health", timeout=3.0)
        except httpx.TransportError:
            return False
        return r.status_code < 500

    async def models(self) -> list[ModelInfo]:
        r = await self._request("GET", "/api/tags")
        return [parse_model(m) for m in (r.json().get("models") or []) if isinstance(m, dict)]

    async def loaded(self) -> list[LoadedModel]:
        r = await self._request("GET", "/api/ps")
        return [parse_loaded(m) for m in (r.json().get("models") or []) if isinstance(m, dict)]

    async def chat(self, model: str, messages: list[dict[str, str]],
                   options: ChatOptions | None = None) -> AsyncIterator[ChatChunk]:
        """Stream a reply. `messages` are {"role", "content"}; the system prompt from
        `options` goes first when set."""
        options = options or ChatOptions()
        msgs = list(messages)
        if options.system.strip():
            msgs.insert(0, {"role": "system", "content": options.system})
        opts = dict(options.extra)
        if options.temperature is not None:
            opts["temperature"] = options.temperature
        body: dict[str, Any] = {"model": model, "messages": msgs, "stream": True}
        if opts:
            body["options"] = opts
        async for obj in self._ndjson("POST", "/api/chat", json=body):
            yield parse_chat_line(obj)

    async def stats_stream(self) -> AsyncIterator[Stats]:
        """Server-sent events from /api/stats/stream, one `Stats` per `data:` event."""
        data: list[str] = []
        async for line in self._lines("GET", "/api/stats/stream",
                                      headers={"Accept": "text/event-stream"}):
            if line.startswith("data:"):
                data.append(line[5:].lstrip())
            elif line == "" and data:
                payload, data = "\n".join(data), []
                try:
                    obj = json.loads(payload)
                except ValueError:
                    continue
                if isinstance(obj, dict):
                    yield parse_stats(obj)

    async def pull(self, name: str) -> AsyncIterator[PullProgress]:
        async for obj in self._ndjson("POST", "/api/pull", json={"model": name, "stream": True}):
            yield PullProgress(status=str(obj.get("status") or ""), digest=obj.get("digest"),
                               total=_num(obj.get("total"), int),
                               completed=_num(obj.get("completed"), int))

    async def delete(self, name: str) -> None:
        await self._request("DELETE", "/api/delete", json={"model": name})

    async def load(self, name: str) -> None:
        await self._request("POST", "/api/generate",
                            json={"model": name, "prompt": "", "stream": False})

    async def unload(self, name: str) -> None:
        await self._request("POST", "/api/generate",
                            json={"model": name, "prompt": "", "keep_alive": 0,
                                  "stream": False})


def _transport_text(e: httpx.TransportError) -> str:
    if isinstance(e, httpx.ConnectError):
        return "connection refused"
    if isinstance(e, httpx.TimeoutException):
        return "timed out"
    if isinstance(e, (httpx.RemoteProtocolError, httpx.ReadError)):
        return "connection lost"
    return str(e) or type(e).__name__


# ----- formatting helpers shared by screens -----------------------------------------------

def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit in ("B", "KiB") else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def fmt_until(t: datetime | None, now: datetime) -> str:
    """'in 4m 12s', 'now', 'never' for a loaded model's expiry."""
    if t is None:
        return "never"
    secs = int((t - now).total_seconds())
    if secs <= 0:
        return "now"
    if secs >= 2 * 86400:
        return f"in {secs // 86400}d"
    if secs >= 3600:
        return f"in {secs // 3600}h {secs % 3600 // 60}m"
    if secs >= 60:
        return f"in {secs // 60}m {secs % 60}s"
    return f"in {secs}s"
