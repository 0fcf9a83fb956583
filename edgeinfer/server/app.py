"""The FastAPI app: routes, API-key check, per-API error shapes, /health, /metrics and the
live stats stream."""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from edgeinfer import __version__
# the daemon renders every chat prompt: Jinja's sandbox loads as it starts, not in its first
# chat request (engine processes, which render none, never load it)
from edgeinfer.formats import chat_sandbox  # noqa: F401

from . import anthropic_api, embeddings_api, ollama_api, openai_api, responses_api
from .errors import APIError
from .generation import ClientGone
from .metrics import Metrics
from .model_manager import ModelManager, ServerConfig

log = logging.getLogger("edgeinfer.server")

PUBLIC_PATHS = ("/health", "/")       # answer without a key: liveness probes
MAX_BODY_BYTES = 32 << 20              # far beyond any context; stops memory abuse early


def _is_openai(request: Request) -> bool:
    return request.url.path.startswith("/v1")


def error_response(request: Request, err: APIError) -> JSONResponse:
    body = err.openai_body() if _is_openai(request) else err.ollama_body()
    if anthropic_api.is_anthropic_path(request.url.path):
        body = anthropic_api.error_body(err)
    headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
    return JSONResponse(body, status_code=err.status, headers=headers)


def _validation_error(exc: RequestValidationError) -> APIError:
    errs = exc.errors()
    if not errs:
        return APIError(400, "invalid request body")
    e = errs[0]
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    # pydantic reports each member of a union; the first failing field is the useful part.
    loc = [x for x in loc if not x.startswith(("function-", "list[", "str", "int", "float"))]
    param = ".".join(loc) or None
    if e.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {e.get('msg')}",
                        code="invalid_json")
    if e.get("type") == "missing":
        return APIError(400, f"missing required parameter: {param}", param=param,
                        code="missing_required_parameter")
    return APIError(400, f"invalid value for {param or 'the request body'}: {e.get('msg')}",
                    param=param, code="invalid_parameter")


class AuthAndCount:
    """Pure ASGI middleware (BaseHTTPMiddleware would buffer streams and hide client
    disconnects): checks the bearer key, counts requests by route and status."""

    def __init__(self, app, api_key: str | None):
        self.app, self.api_key = app, api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        metrics = getattr(scope["app"].state, "metrics", None)
        if self.api_key and scope["path"] not in PUBLIC_PATHS and not self._authorized(scope):
            request = Request(scope)
            err = APIError(401, "missing or invalid API key (send Authorization: Bearer <key>)",
                           code="invalid_api_key")
            if metrics:
                metrics.on_request(scope["path"], 401)
            return await error_response(request, err)(scope, receive, send)
        size = dict(scope.get("headers") or []).get(b"content-length", b"0")
        if size.isdigit() and int(size) > MAX_BODY_BYTES:
            err = APIError(413, f"the request body is {int(size)} bytes; the limit is "
                           f"{MAX_BODY_BYTES}", code="request_too_large")
            return await error_response(Request(scope), err)(scope, receive, send)
        if scope["method"] in ("POST", "DELETE") and scope["path"].startswith(("/api/", "/v1/")):
            scope = _as_json(scope)
        status = [500]

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)
        try:
            await self.app(scope, receive, send_status)
        finally:
            if metrics:
                route = scope.get("route")
                metrics.on_request(getattr(route, "path", "unmatched"), status[0])

    def _authorized(self, scope) -> bool:
        headers = dict(scope.get("headers") or [])
        given = headers.get(b"authorization", b"").decode("latin-1")
        token = given[7:].strip() if given.lower().startswith("bearer ") else \
            headers.get(b"x-api-key", b"").decode("latin-1")
        return hmac.compare_digest(token.encode(), self.api_key.encode())


def _as_json(scope):
    """Ollama reads every body as JSON whatever the Content-Type (`curl -d` sends a form
    type); do the same rather than fail with a confusing validation error."""
    headers = [(k, v) for k, v in scope.get("headers") or [] if k != b"content-type"]
    ctype = dict(scope.get("headers") or []).get(b"content-type", b"")
    if b"json" in ctype:
        return scope
    return {**scope, "headers": headers + [(b"content-type", b"application/json")]}


def create_app(config: ServerConfig | None = None, api_key: str | None = None,
               manager: ModelManager | None = None, spares=None) -> FastAPI:
    """The app; `spares`: a SpareRunner already started for the ModelManager it makes."""
    config = config or ServerConfig.from_env()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.manager = manager or ModelManager(config, spares=spares)
        app.state.metrics = Metrics()
        app.state.manager.start()
        try:
            yield
        finally:
            await app.state.manager.close()

    app = FastAPI(title="edgeinfer", version=__version__, lifespan=lifespan,
                  description="Local GGUF inference: OpenAI (/v1) and Ollama (/api) APIs.")
    app.include_router(openai_api.router)
    app.include_router(ollama_api.router)
    app.include_router(embeddings_api.router)
    app.include_router(anthropic_api.router)
    app.include_router(responses_api.router)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return error_response(request, _validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        msg = "not found" if exc.status_code == 404 else str(exc.detail)
        if exc.status_code == 404:
            msg = f"no route {request.method} {request.url.path}"
        return error_response(request, APIError(exc.status_code, msg))

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, exc: ClientGone):   # nobody reads this; nginx's 499
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception):   # a bug: one line, keep serving
        log.exception("unhandled error in %s", request.url.path)
        return error_response(request, APIError(500, f"internal error: {type(exc).__name__}: "
                                                f"{exc}", code="internal_error"))

    app.add_middleware(AuthAndCount, api_key=api_key)

    @app.get("/", include_in_schema=False)
    async def root():
        return PlainTextResponse("edgeinfer is running")

    @app.get("/health", tags=["daemon"])
    async def health(request: Request):
        return {"status": "ok", "version": __version__,
                "models_loaded": len(request.app.state.manager.models)}

    @app.get("/metrics", tags=["daemon"], response_class=PlainTextResponse)
    async def metrics(request: Request):
        st = request.app.state
        return PlainTextResponse(st.metrics.prometheus(st.manager),
                                 media_type="text/plain; version=0.0.4")

    @app.get("/api/stats", tags=["daemon"])
    async def stats(request: Request):
        st = request.app.state
        return st.metrics.snapshot(st.manager)

    @app.get("/api/stats/stream", tags=["daemon"])
    async def stats_stream(request: Request, interval: float = 0.25):
        if not 0.05 <= interval <= 10:
            raise APIError(400, "interval must be between 0.05 and 10 seconds", param="interval")
        st = request.app.state

        async def events():
            while True:
                snap = st.metrics.snapshot(st.manager)
                yield f"data: {json.dumps(snap, separators=(',', ':'))}\n\n".encode()
                await asyncio.sleep(interval)
        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    return app
