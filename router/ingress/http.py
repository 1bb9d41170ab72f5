"""The FastAPI app the ingress deployment serves (router/ingress/app.py adds the endpoints): API-key
and CORS middleware, exception handlers that answer every error in OpenAI's shape (pdserve's own
errors by their `status`, FastAPI's 404 / 405 / validation, anything unexpected as 500), the
OpenAPI document with the request bodies, and SSE responses.
"""
# No `from __future__ import annotations`: FastAPI reads handlers' annotations at runtime.
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from records.errors import (
    AuthenticationError,
    InvalidRequestError,
    MethodNotAllowedError,
    NotFoundError,
    PDServeError,
    ServiceUnavailableError,
)
from router.ingress.admission import Ticket
from router.ingress.frontend import served_error
from router.ingress.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
)
from router.ingress.replies import error_body
from router.ingress.responses_request import ResponsesRequest
from router.ingress.tenants import retry_after

logger = logging.getLogger(__name__)

# The schema is served at /openapi.json behind the API key (by the ingress in router/ingress/app.py), with the request
# bodies' models, so that clients and fuzzers (tests/serving/test_robustness.py) can read the API.
fastapi_app = FastAPI(title="pdserve", version="0.1.0", docs_url=None, redoc_url=None, openapi_url=None)
BODY_MODELS: dict[str, type] = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
                                "/v1/responses": ResponsesRequest, "/v1/embeddings": EmbeddingRequest,
                                "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}


def _server_of(scope_or_request: Any) -> Any:
    """The app's Frontend (router/ingress/frontend.py), once the ingress has built it."""
    app = scope_or_request["app"] if isinstance(scope_or_request, dict) else scope_or_request.app
    return getattr(app.state, "server", None)


class _AuthMiddleware:
    """With an API key, every path but /health and /ping (and /metrics when `serving.public_metrics`)
    needs it: unknown routes and the schema too, so nothing is learned about the server without it."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            server = _server_of(scope)
            path, root = scope["path"], scope.get("root_path", "")
            if root and path.startswith(root):
                path = path[len(root):] or "/"
            public = path in ("/health", "/ping") or (path == "/metrics" and server is not None
                                           and server.config.serving.public_metrics)
            if not public and (server is None or not server.is_authorized(_authorization(scope))):
                err = (AuthenticationError("invalid or missing API key (Authorization: Bearer <key>)")
                       if server is not None else ServiceUnavailableError("the server is starting"))
                if server is not None:
                    server.metrics.requests.errors.inc(code=str(err.status))
                await error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _CorsMiddleware:
    """CORS for browsers on other origins (serving.allowed_origins and the rest, vLLM's settings):
    Starlette's middleware with the app's spec, outside the key's, so that a preflight (which browsers
    send without the key) is answered and a refusal (401, 429) carries the headers a page needs to
    read it. Until the ingress has built its server, requests pass through (and are answered 503)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self._cors: tuple[Any, Any] | None = None      # (the serving spec, its middleware)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        server = _server_of(scope) if scope["type"] == "http" else None
        serving = None if server is None else server.config.serving
        if serving is None or not serving.allowed_origins:
            await self.app(scope, receive, send)
            return
        if self._cors is None or self._cors[0] is not serving:     # (a spec is frozen: built once per spec)
            self._cors = serving, CORSMiddleware(
                self.app, allow_origins=serving.allowed_origins, allow_credentials=serving.allow_credentials,
                allow_methods=serving.allowed_methods, allow_headers=serving.allowed_headers)
        await self._cors[1](scope, receive, send)


def _authorization(scope: dict) -> str:
    """The Authorization header, without building a Request."""
    for k, v in scope.get("headers", []):
        if k.lower() == b"authorization":
            return v.decode("latin-1")
    return ""


def error_response(err: PDServeError) -> JSONResponse:
    """`{"error": {...}}` with the error's HTTP status (and `Retry-After` on a 429 that says when)."""
    retry = getattr(err, "retry_after", None)
    headers = {"Retry-After": retry_after(retry)} if retry is not None else None
    return JSONResponse(error_body(err.message, err.err_type, err.status, err.param), status_code=err.status,
                        headers=headers)


fastapi_app.add_middleware(_AuthMiddleware)
fastapi_app.add_middleware(_CorsMiddleware)        # the last added runs first: outside the key's


@fastapi_app.exception_handler(StarletteHTTPException)
async def _route_error(request: Request, exc: StarletteHTTPException) -> Response:
    """404 (no such route) and 405 (wrong method) in OpenAI's shape."""
    if exc.status_code == 404:
        message = (f"no route {request.url.path}; see /v1/models, /v1/completions, /v1/chat/completions, "
                   "/v1/responses, /v1/embeddings")
        err: PDServeError = NotFoundError(message)
    elif exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        err = MethodNotAllowedError(f"method {request.method} is not allowed on {request.url.path}"
                                    + (f"; allowed: {allowed}" if allowed else ""))
    else:
        err = InvalidRequestError(str(exc.detail))
        err.status = exc.status_code
    response = error_response(err)
    response.headers.update(exc.headers or {})
    return response


@fastapi_app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
    return error_response(InvalidRequestError(f"invalid request: {exc.errors()[:1]}"))


@fastapi_app.exception_handler(PDServeError)
async def _pdserve_error(request: Request, exc: PDServeError) -> Response:
    """What an endpoint raised on purpose: its status, counted by code."""
    server = _server_of(request)
    if server is not None:
        server.metrics.requests.errors.inc(code=str(exc.status))
    return error_response(exc)


@fastapi_app.exception_handler(Exception)
async def _unexpected_error(request: Request, exc: Exception) -> Response:
    # A Ray error carrying one of ours keeps its status; anything else is logged and answers 500.
    return await _pdserve_error(request, served_error(exc))


def openapi_schema(app: FastAPI = fastapi_app) -> dict[str, Any]:
    """The app's OpenAPI document, with the request bodies' JSON schemas (the endpoints read raw
    requests, so FastAPI alone would not know them). Cached on the app's state (not in FastAPI's
    own `openapi_schema`, which Serve fills when it wraps the app, before the routes carry bodies)."""
    from fastapi.openapi.utils import get_openapi  # noqa: PLC0415

    cached = getattr(app.state, "openapi", None)
    if cached is not None:
        return cached
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for path, model in BODY_MODELS.items():
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(body.pop("$defs", {}))
        components[model.__name__] = body
        operation = schema["paths"].get(path, {}).get("post")
        if operation is not None:
            operation["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
    app.state.openapi = schema
    return schema


def sse_response(chunks: AsyncIterator[dict], ticket: Ticket, named: bool = False) -> StreamingResponse:
    """An SSE response of `chunks`, ending in `data: [DONE]`; an error once the stream has
    started goes in-band; the admission ticket is released however the body ends. `named`: each
    chunk's `type` is its event's name too (the Responses API's typed events), and no [DONE]."""

    async def body() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                event = f"event: {chunk['type']}\n" if named else ""
                yield f"{event}data: {json.dumps(chunk)}\n\n"
        except Exception as e:  # noqa: BLE001 - the stream has started: report in-band
            err = served_error(e)
            yield ("event: error\n" if named else "") + \
                f"data: {json.dumps(error_body(err.message, err.err_type, err.status, err.param))}\n\n"
        finally:
            ticket.release()        # also when the client left before the body started
        if not named:
            yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")
