"""The FastAPI application: the routers (:mod:`llmctl.serve.api.routes`,
:mod:`llmctl.serve.api.loras`) over one :class:`~llmctl.serve.api.handler.RequestHandler`
in the app's state, errors in OpenAI's shape (Anthropic's on /v1/messages), API keys,
and the body limit."""

from __future__ import annotations

import contextlib
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from llmctl.serve.api import loras, routes
from llmctl.serve.api.handler import RequestHandler
from llmctl.serve.api.limits import BodyLimit
from llmctl.serve.openai import errors
from llmctl.serve.openai.errors import APIError
from llmctl.serve.openai.messages_api.errors import error_body, is_messages_path


def create_app(handler: RequestHandler, on_shutdown=None) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        if on_shutdown is not None:
            on_shutdown()

    # With keys, the schema of every route is for key holders only: /docs, /redoc and
    # /openapi.json are off (they would answer 401 anyway, and are not worth a key).
    docs: dict[str, Any] = {"docs_url": None, "redoc_url": None, "openapi_url": None} \
        if handler.tenancy.enabled else {}
    app = FastAPI(title="llmctl", version="1", lifespan=lifespan, **docs)
    app.state.handler = handler
    _add_error_handlers(app, handler)
    _add_auth(app, handler)
    app.include_router(routes.router)
    app.include_router(loras.router)
    limit = handler.config.max_request_bytes
    if limit is not None:  # outside everything: before any body is read
        app.add_middleware(BodyLimit, limit=limit)
    return app


def _add_error_handlers(app: FastAPI, handler: RequestHandler) -> None:
    """Every error answered in OpenAI's JSON shape (Anthropic's on its routes), and
    counted."""
    model_name = handler.config.model.model_name

    def respond(exc: APIError, request: Request) -> JSONResponse:
        handler.metrics.http_errors.labels(model_name, str(exc.status)).inc()
        return JSONResponse(error_body(exc, request.url.path), status_code=exc.status,
                            headers=exc.headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return respond(exc, request)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException):
        # starlette's own refusals (unknown path, wrong method), in OpenAI's shape too
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return respond(APIError(
            exc.status_code, f"{exc.detail}: {request.method} {request.url.path}", kind,
            headers=exc.headers), request)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        # A bug, not the client's fault: still OpenAI's JSON, never starlette's plain text.
        # (starlette re-raises after sending this, so uvicorn logs the traceback.)
        return respond(errors.internal(f"internal server error: {type(exc).__name__}: {exc}"),
                       request)


def _add_auth(app: FastAPI, handler: RequestHandler) -> None:
    # What answers without a key when keys are configured: liveness, for load balancers
    # and orchestrators; /metrics only when asked for (it names every tenant).
    public = {"/health"} | ({"/metrics"} if handler.config.settings.metrics_public else set())

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        # every route, unknown paths included (a 401, not a 404 that maps the server)
        path = request.url.path
        if path not in public:
            authorization = request.headers.get("authorization")
            if authorization is None and is_messages_path(path) and \
                    (key := request.headers.get("x-api-key")):
                authorization = f"Bearer {key}"  # Anthropic's clients send their key so
            try:
                request.state.tenant = handler.tenancy.authenticate(authorization)
            except APIError as exc:
                return JSONResponse(error_body(exc, path), status_code=exc.status,
                                    headers=exc.headers)
        return await call_next(request)
