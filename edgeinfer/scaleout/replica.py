"""EngineReplica: one Ray Serve replica = one edgeinfer.server app = one ModelManager.

The replica runs edgeinfer.server.app.create_app in its own process, the same app as plain
`edgeinfer serve` (one engine per model, its paged KV pool and prefix cache, the same
handlers, errors, metrics). No HTTP server of its own: `handle()` drives the app's ASGI
interface directly with a forwarded request and yields the response as it comes (the head
first, then body chunks), so streams stay streams across the Ray hop.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any, AsyncIterator

import ray
from ray import serve
from starlette.requests import Request

from edgeinfer import settings
from edgeinfer.server import ollama_api
from edgeinfer.server.app import create_app

from . import blobs
from .ingress import error_body
from .registry import lookup

log = logging.getLogger("edgeinfer.scaleout")

REPORT_INTERVAL = 1.0


class _ASGICall:
    """One request through an ASGI app: `events()` yields ("start", status, headers) then
    ("body", bytes) pieces. Closing the iterator early tells the app the client left."""

    def __init__(self, app, scope: dict, body: bytes):
        self.app, self.scope, self.body = app, scope, body
        self.gone = asyncio.Event()
        self.out: asyncio.Queue = asyncio.Queue()

    async def _receive(self) -> dict:
        if self.body is not None:
            body, self.body = self.body, None
            return {"type": "http.request", "body": body, "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def _send(self, message: dict) -> None:
        await self.out.put(message)

    async def events(self) -> AsyncIterator[tuple]:
        task = asyncio.ensure_future(self.app(self.scope, self._receive, self._send))
        try:
            while True:
                get = asyncio.ensure_future(self.out.get())
                done, _ = await asyncio.wait({get, task}, return_when=asyncio.FIRST_COMPLETED)
                if get not in done:
                    get.cancel()
                    if self.out.empty():
                        task.result()                   # the app's own exception, if any
                        return                          # ended without finishing a body
                    continue
                m = get.result()
                if m["type"] == "http.response.start":
                    yield ("start", m["status"], [(bytes(k).decode("latin-1"),
                                                   bytes(v).decode("latin-1"))
                                                  for k, v in m.get("headers", [])])
                elif m["type"] == "http.response.body":
                    if m.get("body"):
                        yield ("body", bytes(m["body"]))
                    if not m.get("more_body"):
                        return
        finally:
            self.gone.set()
            if not task.done():
                # the handler sees the disconnect and aborts its engine requests; a stuck
                # one is cancelled (its generator's finally releases them too)
                with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
                    await asyncio.wait_for(asyncio.shield(task), 2.0)
                task.cancel()


def scope_for(req: dict[str, Any]) -> dict:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
            "method": req["method"], "scheme": "http", "path": req["path"],
            "raw_path": req["path"].encode(), "query_string": req.get("query", "").encode(),
            "root_path": "", "headers": [(k.lower().encode("latin-1"), v.encode("latin-1"))
                                         for k, v in req.get("headers", [])],
            "client": tuple(req.get("client") or ("127.0.0.1", 0)),
            "server": ("127.0.0.1", 0), "state": {}}


class EngineReplica:
    async def __init__(self, config, api_key: str | None = None, report: bool = True,
                       home: str | None = None):
        """`home`: the model store this replica uses on its node (default: config's)."""
        if home:
            config = dataclasses.replace(config, home=Path(home))
        settings.install(config)
        self.config, self.api_key = config, api_key
        self.app = create_app(config, api_key=api_key)
        await self._startup()
        ctx = serve.get_replica_context()
        self.replica_id = ctx.replica_id.to_full_id_str()
        self.short_id = ctx.replica_id.unique_id
        self.node = _node_ip()
        self.started_at = time.time()
        self._reporter = asyncio.ensure_future(self._report_forever()) if report else None
        self._present: set[str] = set()
        self._fetching: dict[str, asyncio.Lock] = {}

    async def _startup(self) -> None:
        inbox: asyncio.Queue = asyncio.Queue()
        outbox: asyncio.Queue = asyncio.Queue()
        await inbox.put({"type": "lifespan.startup"})
        self._lifespan_inbox = inbox
        self._lifespan = asyncio.ensure_future(self.app(
            {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, inbox.get, outbox.put))
        msg = await outbox.get()
        if msg["type"] != "lifespan.startup.complete":
            raise RuntimeError(f"the app did not start: {msg.get('message')}")

    async def __del__(self):
        if getattr(self, "_reporter", None):
            self._reporter.cancel()
        if getattr(self, "_lifespan", None) and not self._lifespan.done():
            await self._lifespan_inbox.put({"type": "lifespan.shutdown"})
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._lifespan, 10)

    # ----- requests ------------------------------------------------------------------------
    async def handle(self, req: dict[str, Any]) -> AsyncIterator[Any]:
        """Stream the app's response to a forwarded request: first a dict with status and
        headers (the replica's id added), then the body's pieces as bytes."""
        model = req.get("model")
        if model and model not in self._present:
            problem = await self._ensure_model(model)
            if problem:
                yield {"status": 502, "headers": [("content-type", "application/json"),
                                                  ("x-edgeinfer-replica", self.short_id)]}
                yield json.dumps(error_body(req["path"], 502, problem,
                                            "model_fetch_failed")).encode()
                return
        call = _ASGICall(self.app, scope_for(req), req.get("body") or b"")
        agen = call.events()
        try:
            async for ev in agen:
                if ev[0] == "start":
                    yield {"status": ev[1], "headers": ev[2] + [
                        ("x-edgeinfer-replica", self.short_id)]}
                else:
                    yield ev[1]
        finally:
            await agen.aclose()

    async def _ensure_model(self, model: str) -> str | None:
        """Fetch `model` from the head's store when this node's store lacks it. None when
        the request can go on (also for a model nobody has: the app says 404), else the
        reason the copy failed."""
        lock = self._fetching.setdefault(model, asyncio.Lock())
        async with lock:
            if model in self._present:
                return None
            try:
                what = await asyncio.to_thread(blobs.ensure_local,
                                               self.app.state.manager.store, model)
            except Exception as e:
                log.warning("fetching %s from the head failed: %s", model, e)
                return f"this replica could not copy {model} from the head node: {e}"
            if what == "fetched":
                log.info("copied %s from the head node's store", model)
            if what != "unknown":
                self._present.add(model)
            return None

    # ----- figures -------------------------------------------------------------------------
    async def info(self) -> dict[str, Any]:
        """This replica's /api/ps, /api/stats and /metrics, read from the app's own state
        (not through its HTTP routes, which would count these reads as API requests)."""
        st = self.app.state
        ps = await ollama_api.ps(Request({"type": "http", "app": self.app, "headers": []}))
        return {"replica": self.replica_id, "id": self.short_id, "node": self.node,
                "pid": os.getpid(), "started_at": self.started_at, "ps": ps,
                "stats": st.metrics.snapshot(st.manager),
                "metrics": st.metrics.prometheus(st.manager)}

    async def _report_forever(self) -> None:
        registry = None
        while True:
            try:
                registry = registry or lookup()
                await registry.report.remote(self.replica_id, await self.info())
            except asyncio.CancelledError:
                raise
            except Exception as e:          # the registry restarting: try again next time
                registry = None
                log.debug("report failed: %s", e)
            await asyncio.sleep(REPORT_INTERVAL)

    def record_routing_stats(self) -> dict[str, Any]:
        mgr = getattr(self.app.state, "manager", None)
        return {"models": len(getattr(mgr, "models", {}) or {})}


def _node_ip() -> str:
    """The Ray node's address (127.0.0.1 on a local instance), else the host name."""
    try:
        me = ray.get_runtime_context().get_node_id()
        for n in ray.nodes():
            if n.get("NodeID") == me:
                return n.get("NodeManagerAddress") or socket.gethostname()
    except Exception:
        pass
    return socket.gethostname()
