"""Ingress: the HTTP entry of `serve --ray`, in front of the EngineReplica deployment.

Every API request is forwarded whole (method, path, headers, body) to one replica, which
runs edgeinfer.server's own app; the Ingress adds only what one replica cannot know:

- the routing key: the block hashes of the request's prompt (edgeinfer.scaleout.keys),
  which PrefixAffinityRouter reads to send it where its prefix is cached;
- faults: a replica that dies before answering gets the request again on another one
  (generation has no side effects); one that dies mid-stream ends that stream with an error
  in its API's shape (an SSE `error` event for /v1, an NDJSON `{"error": ...}` line for
  /api) instead of a hang or a cut connection;
- the view over all replicas: GET /api/ps lists each replica's loaded models with its
  node and load, and /metrics concatenates every replica's series with a `replica` label
  (counters are also summed across replicas without it).
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from edgeinfer.store.model_store import Store

from .keys import Keyer

log = logging.getLogger("edgeinfer.scaleout")

STREAM_TYPES = ("text/event-stream", "application/x-ndjson")
HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "date", "server"}
RETRIES = 4


def _openai(path: str) -> bool:
    return path.startswith("/v1")


def error_body(path: str, status: int, message: str, code: str) -> dict:
    """The error object of the request's API (edgeinfer.server.errors' two shapes)."""
    if _openai(path):
        kind = "server_error" if status >= 500 else "invalid_request_error"
        return {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return {"error": message}


def stream_error(path: str, message: str, code: str = "replica_failed") -> bytes:
    body = error_body(path, 502, message, code)
    if _openai(path):
        return f"data: {json.dumps(body)}\n\n".encode()
    return (json.dumps(body) + "\n").encode()


class Ingress:
    def __init__(self, engine_handle, config=None, api_key: str | None = None):
        self.engine = engine_handle.options(stream=True, method_name="handle")
        self.api_key = api_key
        self.keyer = Keyer(Store(getattr(config, "home", None)))
        self.started = time.time()

    # ----- entry ---------------------------------------------------------------------------
    async def __call__(self, request: Request) -> Response:
        path, method = request.url.path, request.method
        if method == "GET" and path in ("/api/ps", "/metrics", "/api/replicas", "/api/stats",
                                        "/api/stats/stream"):
            if self.api_key and not self._authorized(request):
                return JSONResponse(error_body(path, 401, "missing or invalid API key (send "
                                               "Authorization: Bearer <key>)", "invalid_api_key"),
                                    status_code=401, headers={"WWW-Authenticate": "Bearer"})
            if path == "/api/stats/stream":
                return self._stats_stream(request)
            reports = await self._reports()
            if path == "/api/stats":
                return JSONResponse(merge_stats(reports))
            if path == "/metrics":
                return PlainTextResponse(merge_metrics(reports),
                                         media_type="text/plain; version=0.0.4")
            if path == "/api/replicas":
                return JSONResponse({"replicas": [replica_summary(r) for r in reports]})
            return JSONResponse(merge_ps(reports))
        body = await request.body()
        keys: list[int] = []
        model = None
        if method == "POST" and body:
            try:
                parsed = json.loads(body)
            except ValueError:
                parsed = None       # the replica answers the 400 in the API's shape
            if isinstance(parsed, dict):
                keys = await asyncio.to_thread(self.keyer.keys, path, parsed)
                m = parsed.get("model", parsed.get("name"))
                model = m if isinstance(m, str) and m else None
        req = {"method": method, "path": path, "query": request.url.query,
               "headers": [(k, v) for k, v in request.headers.items()],
               "client": list(request.client) if request.client else None,
               "body": body, "keys": keys, "model": model}
        return await self._forward(req)

    def _authorized(self, request: Request) -> bool:
        given = request.headers.get("authorization", "")
        token = given[7:].strip() if given.lower().startswith("bearer ") else \
            request.headers.get("x-api-key", "")
        return hmac.compare_digest(token.encode(), (self.api_key or "").encode())

    # ----- forwarding -----------------------------------------------------------------------
    async def _forward(self, req: dict[str, Any]) -> Response:
        path = req["path"]
        last: BaseException | None = None
        for attempt in range(RETRIES):
            gen = self.engine.remote(req)
            try:
                head = await gen.__anext__()
            except StopAsyncIteration:
                last = RuntimeError("the replica ended the request without an answer")
            except asyncio.CancelledError:
                gen.cancel()
                raise
            except Exception as e:          # replica died/unavailable before answering
                last = e
                log.warning("replica failed before answering %s (attempt %d): %s", path,
                            attempt + 1, _one_line(e))
                await asyncio.sleep(0.5 * (attempt + 1))
                continue
            return await self._respond(req, gen, head)
        return JSONResponse(error_body(path, 503, "no engine replica could take the request: "
                                       f"{_one_line(last)}", "replica_unavailable"),
                            status_code=503)

    async def _respond(self, req: dict[str, Any], gen, head: dict) -> Response:
        path = req["path"]
        status = head["status"]
        headers = {k: v for k, v in head["headers"] if k.lower() not in HOP_HEADERS}
        ctype = headers.get("content-type", "")
        if ctype.split(";")[0].strip() in STREAM_TYPES:
            return StreamingResponse(self._relay(path, gen), status_code=status,
                                     headers=headers)
        chunks = []
        try:
            async for chunk in gen:
                chunks.append(chunk)
        except asyncio.CancelledError:
            gen.cancel()
            raise
        except Exception as e:
            return JSONResponse(error_body(path, 502, f"the engine replica failed while "
                                           f"answering: {_one_line(e)}", "replica_failed"),
                                status_code=502)
        return Response(b"".join(chunks), status_code=status, headers=headers)

    async def _relay(self, path: str, gen) -> AsyncIterator[bytes]:
        try:
            async for chunk in gen:
                yield chunk
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.warning("replica failed mid-stream on %s: %s", path, _one_line(e))
            yield stream_error(path, "the engine replica serving this stream failed: "
                               f"{_one_line(e)}")
        finally:
            gen.cancel()

    def _stats_stream(self, request: Request) -> Response:
        try:
            interval = float(request.query_params.get("interval", 0.25))
        except ValueError:
            interval = -1.0
        if not 0.05 <= interval <= 10:
            return JSONResponse(error_body("/api", 400, "interval must be between 0.05 and 10 "
                                           "seconds", "invalid_parameter"), status_code=400)

        async def events():
            while True:
                snap = merge_stats(await self._reports())
                yield f"data: {json.dumps(snap, separators=(',', ':'))}\n\n".encode()
                await asyncio.sleep(interval)
        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    # ----- all replicas --------------------------------------------------------------------
    async def _reports(self) -> list[dict]:
        from .registry import lookup  # lazy: ray (optional); merge_* here are used without it
        try:
            return await lookup().all.remote()
        except Exception as e:
            log.warning("replica registry unavailable: %s", _one_line(e))
            return []


def _one_line(e: BaseException | None) -> str:
    if e is None:
        return "unknown error"
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def replica_summary(r: dict) -> dict:
    stats = r.get("stats") or {}
    models = stats.get("models") or []
    q = sum(m.get("prefix_cached_tokens", 0) for m in models)
    return {"replica": r.get("id"), "replica_id": r.get("replica"), "node": r.get("node"),
            "pid": r.get("pid"), "models": [m.get("name") for m in models],
            "running": stats.get("running", 0), "queued": stats.get("queue_depth", 0),
            "active_requests": stats.get("requests_active", 0),
            "kv_blocks_used": sum(m.get("kv_blocks_used", 0) for m in models),
            "kv_blocks_total": sum(m.get("kv_blocks_total", 0) for m in models),
            "prefix_hit_rate": max((m.get("prefix_hit_rate", 0.0) for m in models), default=0.0),
            "prefix_cached_tokens": q,
            "rss_bytes": (stats.get("process") or {}).get("rss_bytes")}


def merge_stats(reports: list[dict]) -> dict:
    """/api/stats over replicas, in the single daemon's shape (what the TUI reads): load and
    token figures summed, each replica's models listed with their replica and node, and a
    `replicas` list. Machine figures (system, gpu, compute) are the first replica's node."""
    snaps = [(r, r.get("stats") or {}) for r in reports]
    first = snaps[0][1] if snaps else {}
    models = [{**m, "replica": r.get("id"), "node": r.get("node")}
              for r, st in snaps for m in st.get("models") or []]
    totals: dict[str, float] = {}
    for _, st in snaps:
        for k, v in (st.get("totals") or {}).items():
            if isinstance(v, (int, float)):
                totals[k] = totals.get(k, 0) + v

    def total(key: str) -> float:
        return sum(st.get(key) or 0 for _, st in snaps)
    return {
        "time": time.time(), "version": first.get("version"),
        "uptime_s": max((st.get("uptime_s") or 0 for _, st in snaps), default=0),
        "tokens_per_s": total("tokens_per_s"), "requests_active": total("requests_active"),
        "queue_depth": total("queue_depth"), "running": total("running"), "totals": totals,
        "process": {"pid": (first.get("process") or {}).get("pid"),
                    "rss_bytes": sum((st.get("process") or {}).get("rss_bytes") or 0
                                     for _, st in snaps)},
        "system": first.get("system"), "gpu": first.get("gpu"), "compute": first.get("compute"),
        "models": models, "replicas": [replica_summary(r) for r in reports]}


def merge_ps(reports: list[dict]) -> dict:
    """Ollama's /api/ps shape over all replicas: each model entry says which replica and
    node holds it; `replicas` has one line per replica (also the ones with nothing loaded)."""
    models = []
    summaries = [replica_summary(r) for r in reports]
    for r, s in zip(reports, summaries):
        for m in (r.get("ps") or {}).get("models", []):
            models.append({**m, "replica": s["replica"], "node": s["node"],
                           "running": s["running"], "queued": s["queued"],
                           "kv_blocks_used": s["kv_blocks_used"],
                           "kv_blocks_total": s["kv_blocks_total"],
                           "prefix_hit_rate": s["prefix_hit_rate"]})
    return {"models": models, "replicas": summaries}


def _family(name: str, known: dict) -> str:
    if name in known:
        return name
    for suffix in ("_total", "_bucket", "_sum", "_count", "_created"):
        if name.endswith(suffix) and name[:-len(suffix)] in known:
            return name[:-len(suffix)]
    return name


def merge_metrics(reports: list[dict]) -> str:
    """Prometheus text over replicas: each family once (HELP, TYPE, then its samples), each
    replica's samples with replica="..." added, and for counters also the sum over replicas
    (same name and labels, no replica label)."""
    fams: dict[str, dict] = {}
    for r in reports:
        rid = str(r.get("id", "?"))
        for line in (r.get("metrics") or "").splitlines():
            if not line.strip():
                continue
            if line.startswith("#"):
                parts = line.split(None, 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    f = fams.setdefault(parts[2], {"meta": [], "samples": [], "sums": {},
                                                   "type": None})
                    if line not in f["meta"]:
                        f["meta"].append(line)
                    if parts[1] == "TYPE" and len(parts) == 4:
                        f["type"] = parts[3].strip()
                continue
            name_labels, _, value = line.rpartition(" ")
            if "{" in name_labels:
                name, labels = name_labels.split("{", 1)
                labels = labels.rstrip("}")
            else:
                name, labels = name_labels, ""
            f = fams.setdefault(_family(name, fams), {"meta": [], "samples": [], "sums": {},
                                                      "type": None})
            f["samples"].append(
                f'{name}{{replica="{rid}"{"," + labels if labels else ""}}} {value}')
            if f["type"] == "counter":
                try:
                    f["sums"][(name, labels)] = f["sums"].get((name, labels), 0.0) + float(value)
                except ValueError:
                    pass
    out = ["# HELP edgeinfer_replicas engine replicas reporting",
           "# TYPE edgeinfer_replicas gauge", f"edgeinfer_replicas {len(reports)}"]
    for f in fams.values():
        out += f["meta"] + f["samples"]
        out += [f"{n}{{{lab}}} {v:g}" if lab else f"{n} {v:g}" for (n, lab), v in f["sums"].items()]
    return "\n".join(out) + "\n"
