"""The HTTP client CLI commands use to talk to the daemon.

`connect()` finds the daemon at EDGEINFER_HOST (default 127.0.0.1:11435) and, for a loopback
address, starts one in the background when none answers; the new daemon inherits this
process's environment, so it uses the same store (EDGEINFER_HOME) and address. The API key
comes from EDGEINFER_API_KEY.

`stream_generate()` is what `edgeinfer run` uses: text chunks as they arrive, then one
`GenerationStats`.

The standard library's http.client, not httpx: every command starts with this module, and
httpx's import (with httpcore, h11 and the rest) was 0.2 s of a 0.3 s `edgeinfer run` on a
loaded model. One connection per request: the daemon is usually on loopback.
"""
from __future__ import annotations

import http.client
import json
from dataclasses import dataclass
from typing import Any, Callable, Iterator
from urllib.parse import urlsplit

from edgeinfer.server import daemon
from edgeinfer.settings import current
from edgeinfer.store.model_store import StoreError

CONNECT_TIMEOUT = 5.0

__all__ = ["Client", "ClientError", "GenerationStats", "connect", "daemon_pull",
           "stream_generate"]


class ClientError(Exception):
    """The daemon refused a request (its one-sentence message) or could not be reached."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class GenerationStats:
    """The final line of a generation, in seconds (Ollama sends nanoseconds)."""
    model: str
    done_reason: str
    prompt_tokens: int
    completion_tokens: int
    total_duration: float
    load_duration: float
    prompt_eval_duration: float
    eval_duration: float
    cached_tokens: int = 0          # prompt tokens served from the prefix cache

    @property
    def prompt_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prompt_eval_duration if self.prompt_eval_duration else 0.0

    @property
    def tokens_per_s(self) -> float:
        # the first token comes from the prefill, so eval_duration covers count - 1 tokens
        n = self.completion_tokens - 1
        return n / self.eval_duration if n > 0 and self.eval_duration else 0.0

    @classmethod
    def from_ollama(cls, d: dict[str, Any]) -> "GenerationStats":
        s = lambda k: (d.get(k) or 0) / 1e9  # noqa: E731
        return cls(d.get("model", ""), d.get("done_reason", "stop"),
                   int(d.get("prompt_eval_count") or 0), int(d.get("eval_count") or 0),
                   s("total_duration"), s("load_duration"), s("prompt_eval_duration"),
                   s("eval_duration"), int(d.get("prompt_cached_count") or 0))


def _error_message(status: int, data: bytes) -> str:
    try:
        body = json.loads(data)
    except ValueError:
        return f"HTTP {status}: {data[:200].decode('utf-8', 'replace')}"
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        return str(err.get("message"))
    return str(err or f"HTTP {status}")


class Client:
    def __init__(self, base_url: str | None = None, api_key: str | None = None,
                 timeout: float | None = None):
        self.base_url = base_url or daemon.url_for(*daemon.env_address())
        key = api_key if api_key is not None else current().api_key
        self._headers = {"Content-Type": "application/json"}
        if key:
            self._headers["Authorization"] = f"Bearer {key}"
        u = urlsplit(self.base_url)
        self._tls = u.scheme == "https"
        self._host = u.hostname or "127.0.0.1"
        self._port = u.port or (443 if self._tls else 80)
        # generations can run for minutes: no read timeout unless asked, a short connect one
        self.timeout = timeout

    def close(self) -> None:
        """Nothing held between requests (kept for the callers' with-blocks)."""

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, method: str, path: str, body: dict | None,
              timeout: float | None) -> http.client.HTTPResponse:
        """The response to one request on a connection of its own (OSError and
        http.client.HTTPException for a daemon that is not there or hangs up)."""
        if self._tls:
            conn = http.client.HTTPSConnection(self._host, self._port, timeout=CONNECT_TIMEOUT)
        else:
            conn = http.client.HTTPConnection(self._host, self._port, timeout=CONNECT_TIMEOUT)
        conn.connect()
        conn.sock.settimeout(timeout)
        data = json.dumps(body).encode() if body is not None else None
        conn.request(method, path, body=data, headers=self._headers)
        return conn.getresponse()

    def health(self) -> dict | None:
        return daemon.health(self.base_url)

    def request(self, method: str, path: str, body: dict | None = None) -> Any:
        try:
            r = self._send(method, path, body, self.timeout)
            data = r.read()
        except (OSError, http.client.HTTPException) as e:
            raise ClientError(f"cannot reach the daemon at {self.base_url}: {e}") from None
        if r.status >= 400:
            raise ClientError(_error_message(r.status, data), r.status)
        return json.loads(data) if data else None

    def stream(self, path: str, body: dict) -> Iterator[dict]:
        """POST and yield the NDJSON lines; an {"error"} line raises ClientError."""
        try:
            r = self._send("POST", path, body, self.timeout)
            try:
                if r.status >= 400:
                    raise ClientError(_error_message(r.status, r.read()), r.status)
                while True:
                    line = r.readline()     # the chunked body, a line as soon as it is in
                    if not line:
                        break
                    if not line.strip():
                        continue
                    obj = json.loads(line)
                    if "error" in obj:
                        raise ClientError(str(obj["error"]))
                    yield obj
            finally:
                r.close()
        except (OSError, http.client.HTTPException) as e:
            raise ClientError(f"connection to the daemon at {self.base_url} failed: {e}") \
                from None


def connect(autostart: bool = True, warm: str | None = None) -> Client:
    """A client for a daemon that answers, starting one (loopback only) if needed, whose
    spare engine process then warms `warm`'s kernels first (the model about to be asked)."""
    c = Client()
    if c.health() is not None:
        return c
    host, port = daemon.env_address()
    if not autostart or not daemon.is_loopback(host) and host not in ("0.0.0.0", "::"):
        c.close()
        raise ClientError(f"no edgeinfer daemon answers at {c.base_url}")
    try:
        daemon.start_background(host, port, warm=warm)
    except daemon.DaemonError as e:
        c.close()
        raise ClientError(str(e)) from None
    return c


def daemon_pull(source: str, name: str | None, sha256: str | None,
                progress: Callable[[Any], None]) -> bool:
    """Pull through a running daemon (never starts one). False when none answers; the
    store's own errors come back as StoreError so the CLI prints them as usual."""
    from edgeinfer.store.pull import PullProgress      # lazy: it imports httpx
    with Client() as c:
        if c.health() is None:
            return False
        body: dict[str, Any] = {"model": source, "stream": True}
        if name:
            body["as"] = name
        if sha256:
            body["sha256"] = sha256
        try:
            for ev in c.stream("/api/pull", body):
                progress(PullProgress(ev.get("status", ""), ev.get("digest"), ev.get("total"),
                                      ev.get("completed")))
        except ClientError as e:
            raise StoreError(str(e)) from None
    return True


def stream_generate(model: str, prompt: str | None = None,
                    messages: list[dict[str, Any]] | None = None,
                    options: dict[str, Any] | None = None, raw: bool = False,
                    system: str | None = None, keep_alive: str | float | None = None,
                    client: Client | None = None) -> Iterator[str | GenerationStats]:
    """Generate through the daemon: yields text chunks (str), then one GenerationStats.
    `messages` uses /api/chat, `prompt` /api/generate (`raw` skips the chat template).
    `options` are Ollama's (num_predict, temperature, top_k, top_p, min_p, repeat_penalty,
    seed, stop, num_ctx) plus `backend` and `device`. Errors raise ClientError."""
    if (prompt is None) == (messages is None):
        raise ValueError("pass exactly one of prompt and messages")
    own = client is None
    c = client or connect()
    body: dict[str, Any] = {"model": model, "stream": True, "options": options or {}}
    if keep_alive is not None:
        body["keep_alive"] = keep_alive
    if messages is not None:
        path = "/api/chat"
        body["messages"] = ([{"role": "system", "content": system}] if system else []) + \
            list(messages)
    else:
        path = "/api/generate"
        body.update(prompt=prompt, raw=raw)
        if system:
            body["system"] = system
    try:
        for obj in c.stream(path, body):
            text = obj.get("response") if messages is None else \
                (obj.get("message") or {}).get("content")
            if text:
                yield text
            if obj.get("done"):
                yield GenerationStats.from_ollama(obj)
                return
    finally:
        if own:
            c.close()
