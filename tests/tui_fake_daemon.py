"""A small in-process stand-in for the edgeinfer daemon, for the TUI's pilot tests.

A FastAPI app served by uvicorn in a thread on 127.0.0.1 (a port of our own). It speaks the
Ollama-shaped routes the TUI uses, streams a scripted chat reply token by token, a scripted
pull, and a stats event stream; it records what it was asked. `stop()` drops every open
connection (as a killed daemon would), `start()` again brings it back on the same port.
"""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

EXPIRES = "2030-01-01T00:05:00Z"


@dataclass
class FakeState:
    models: list[dict] = field(default_factory=lambda: [
        {"name": "gemma3:270m", "size": 253_000_000, "modified_at": "2026-11-20T10:00:00Z",
         "details": {"family": "gemma3", "parameter_size": "268M",
                     "quantization_level": "Q4_K_M"}},
        {"name": "tiny:latest", "size": 4096, "modified_at": "2026-11-21T10:00:00Z",
         "details": {"family": "llama", "parameter_size": "1K",
                     "quantization_level": "F32"}},
    ])
    loaded: dict[str, dict] = field(default_factory=dict)
    reply: list[str] = field(default_factory=lambda: [
        "Hello", "!", " Here", " is", " **bold**", " and", " `code`", "."])
    token_delay: float = 0.01
    stats_interval: float = 0.1
    # the daemon's /api/stats shape (edgeinfer/server/metrics.py); per-model engine figures
    # are merged into each loaded model's entry
    stats: dict = field(default_factory=lambda: {
        "tokens_per_s": 42.5, "running": 1, "queue_depth": 2, "requests_active": 3,
        "process": {"pid": 1, "rss_bytes": 900 * 2**20},
        "system": {"memory_total_bytes": 24 * 2**30, "memory_available_bytes": 12 * 2**30,
                   "memory_used_percent": 50.0}})
    model_stats: dict = field(default_factory=lambda: {
        "kv_blocks_used": 120, "kv_blocks_total": 512, "prefix_hit_rate": 0.375,
        "running": 1, "waiting": 2})
    pull_steps: int = 5
    pull_delay: float = 0.05
    chats: list[dict] = field(default_factory=list)
    calls: list[tuple[str, dict]] = field(default_factory=list)
    chat_cancelled: int = 0
    stats_events: int = 0


def build_app(state: FakeState) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/api/tags")
    async def tags():
        return {"models": state.models}

    @app.get("/api/ps")
    async def ps():
        return {"models": list(state.loaded.values())}

    @app.post("/api/chat")
    async def chat(request: Request):
        body = await request.json()
        state.chats.append(body)
        if body.get("model") not in {m["name"] for m in state.models}:
            return JSONResponse({"error": f"model '{body.get('model')}' not found"}, 404)

        async def gen():
            t0 = time.monotonic_ns()
            try:
                for tok in state.reply:
                    await asyncio.sleep(state.token_delay)
                    yield json.dumps({"model": body["model"], "created_at": EXPIRES,
                                      "message": {"role": "assistant", "content": tok},
                                      "done": False}) + "\n"
                dur = time.monotonic_ns() - t0
                yield json.dumps({"model": body["model"], "created_at": EXPIRES,
                                  "message": {"role": "assistant", "content": ""},
                                  "done": True, "done_reason": "stop",
                                  "eval_count": len(state.reply), "eval_duration": dur,
                                  "prompt_eval_count": 7, "prompt_eval_duration": 1_000_000,
                                  "total_duration": dur}) + "\n"
            except asyncio.CancelledError:
                state.chat_cancelled += 1
                raise
            finally:
                pass
        return StreamingResponse(gen(), media_type="application/x-ndjson")

    @app.post("/api/generate")
    async def generate(request: Request):
        body = await request.json()
        name = body.get("model")
        state.calls.append(("generate", body))
        if name not in {m["name"] for m in state.models}:
            return JSONResponse({"error": f"model '{name}' not found"}, 404)
        if body.get("keep_alive") == 0:
            state.loaded.pop(name, None)
        else:
            state.loaded[name] = {"name": name, "size": 300_000_000, "expires_at": EXPIRES}
        return {"model": name, "response": "", "done": True}

    @app.post("/api/pull")
    async def pull(request: Request):
        body = await request.json()
        name = body.get("model") or body.get("name")
        state.calls.append(("pull", body))
        if name == "nosuch:model":
            return JSONResponse({"error": "unknown model 'nosuch:model'"}, 404)

        async def gen():
            total = 1000
            yield json.dumps({"status": "pulling manifest"}) + "\n"
            for i in range(1, state.pull_steps + 1):
                await asyncio.sleep(state.pull_delay)
                yield json.dumps({"status": "downloading", "digest": "sha256:ab",
                                  "total": total,
                                  "completed": total * i // state.pull_steps}) + "\n"
            state.models.append({"name": name, "size": total,
                                 "modified_at": "2026-11-21T12:00:00Z",
                                 "details": {"family": "llama", "parameter_size": "1K",
                                             "quantization_level": "Q8_0"}})
            yield json.dumps({"status": "success"}) + "\n"
        return StreamingResponse(gen(), media_type="application/x-ndjson")

    @app.delete("/api/delete")
    async def delete(request: Request):
        body = await request.json()
        state.calls.append(("delete", body))
        before = len(state.models)
        state.models[:] = [m for m in state.models if m["name"] != body.get("model")]
        if len(state.models) == before:
            return JSONResponse({"error": f"model '{body.get('model')}' not found"}, 404)
        return {}

    @app.get("/api/stats/stream")
    async def stats_stream():
        async def gen():
            while True:
                state.stats_events += 1
                ev = dict(state.stats, time=time.time(), models=[
                    {"name": m["name"], "size_bytes": m["size"],
                     "expires_at": m["expires_at"], **state.model_stats}
                    for m in state.loaded.values()])
                yield f"data: {json.dumps(ev)}\n\n"
                await asyncio.sleep(state.stats_interval)
        return StreamingResponse(gen(), media_type="text/event-stream")

    return app


class FakeDaemon:
    def __init__(self, state: FakeState | None = None, port: int | None = None) -> None:
        self.state = state or FakeState()
        self.port = port or free_port()
        self.server: uvicorn.Server | None = None
        self.thread: threading.Thread | None = None

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> "FakeDaemon":
        config = uvicorn.Config(build_app(self.state), host="127.0.0.1", port=self.port,
                                log_level="error", lifespan="off",
                                timeout_graceful_shutdown=0.2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("fake daemon did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
            self.server.force_exit = True
            self.thread.join(timeout=10)
            self.server = None

    def __enter__(self) -> "FakeDaemon":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
