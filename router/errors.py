"""Errors in OpenAI's shape: `HTTPError` (status, message, type, the offending field) and the
mapping of whatever a request raised to the one it answers with (`error_for`). Shared by the HTTP
app (router/http.py, router/app.py) and the gRPC service (router/grpc_api.py)."""
from __future__ import annotations

import logging

from fastapi.responses import JSONResponse

from engine.errors import RequestFailedError
from router.pd import NoReplicaError
from router.protocol import error_body

logger = logging.getLogger(__name__)


class HTTPError(Exception):
    """An error answered as `{"error": {...}}` with this HTTP status."""

    def __init__(self, status: int, message: str, err_type: str = "invalid_request_error",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.err_type, self.param = status, message, err_type, param

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.err_type, self.status, self.param), status_code=self.status)


def error_for(error: BaseException) -> HTTPError:
    """The HTTP error a failed request answers with (its stream, once started, carries it in-band)."""
    if isinstance(error, HTTPError):
        return error
    if isinstance(error, NoReplicaError):      # also a replica that died mid-stream (ReplicaDiedError)
        return HTTPError(503, str(error), "service_unavailable")
    cause = getattr(error, "cause", None)      # a Ray task error: what the replica raised
    if isinstance(cause, RequestFailedError):
        return HTTPError(500, str(cause), "server_error")
    logger.error("request failed", exc_info=error)
    return HTTPError(500, f"generation failed: {type(cause or error).__name__}: {cause or error}", "server_error")
