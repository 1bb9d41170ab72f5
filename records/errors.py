"""Every exception pdserve raises on purpose, in one hierarchy (a record layer: no imports).

`PDServeError` carries how a request that fails with it is answered: an HTTP status, OpenAI's
error type, a gRPC status code (by name, so this module needs no grpc) and the offending field.
The HTTP app (router/ingress/http.py) and the gRPC service (router/ingress/grpc_api.py) read these attributes;
nothing else maps statuses.

Two failures must never be confused (DESIGN, style 7): the engine is dead (every request on it
fails, the replica is replaced: `EngineDeadError`) or one request failed (its stream ends with an
error, every other request and the engine go on: `RequestFailedError`). Bad user input is an
`InvalidRequestError` (a ValueError) naming the field, raised before anything is queued.
"""
from __future__ import annotations


class PDServeError(Exception):
    """Base of pdserve's errors. Class attributes say how a request failing with it is answered;
    `param` names the offending request field (None when no single field is at fault)."""
    status = 500
    err_type = "server_error"
    grpc_code = "INTERNAL"

    def __init__(self, message: str = "", param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param = message, param

    def __reduce__(self):  # pickles with its field: Ray ships errors between processes
        return type(self), (self.message, self.param)


# --- a request refused before it runs (answered 4xx / 503) ----------------------------------------
class InvalidRequestError(PDServeError, ValueError):
    """A request field has a value the server cannot serve; the message names the allowed ones."""
    status, err_type, grpc_code = 400, "invalid_request_error", "INVALID_ARGUMENT"


class AuthenticationError(PDServeError):
    status, err_type, grpc_code = 401, "authentication_error", "UNAUTHENTICATED"


class NotFoundError(PDServeError):
    """An unknown model or route."""
    status, err_type, grpc_code = 404, "not_found_error", "NOT_FOUND"


class MethodNotAllowedError(PDServeError):
    status, err_type, grpc_code = 405, "invalid_request_error", "UNIMPLEMENTED"


class PayloadTooLargeError(PDServeError):
    status, err_type, grpc_code = 413, "invalid_request_error", "INVALID_ARGUMENT"


class UnsupportedMediaTypeError(PDServeError):
    status, err_type, grpc_code = 415, "invalid_request_error", "INVALID_ARGUMENT"


class RateLimitError(PDServeError):
    """Too many requests in flight, or a tenant over a limit: retry after `retry_after` seconds
    (the `Retry-After` header); `limit` names the limit that refused it."""
    status, err_type, grpc_code = 429, "rate_limit_error", "RESOURCE_EXHAUSTED"

    def __init__(self, message: str = "", param: str | None = None, retry_after: float | None = None,
                 limit: str | None = None) -> None:
        super().__init__(message, param)
        self.retry_after, self.limit = retry_after, limit

    def __reduce__(self):
        return type(self), (self.message, self.param, self.retry_after, self.limit)


class ServiceUnavailableError(PDServeError):
    """The server is starting, or has no replica to serve with."""
    status, err_type, grpc_code = 503, "service_unavailable", "UNAVAILABLE"


class ClientClosedError(PDServeError):
    """The client went away before its answer was complete (nginx's 499): nobody reads the answer;
    the status is for the error counter, where a disconnect is not a server error."""
    status, err_type, grpc_code = 499, "client_closed_request", "CANCELLED"


class NoReplicaError(ServiceUnavailableError):
    """No healthy replica can take the request."""


class ReplicaDiedError(NoReplicaError):
    """The replica running a request died after it had streamed part of the output."""


class ModelAsleepError(ServiceUnavailableError):
    """The replica was put to sleep (`/sleep`): the ingress wakes its model and sends the request
    again; a client sees it only if waking fails."""


# --- a request that failed while it ran (answered 500, or in-band once streaming) -----------------
class RequestFailedError(PDServeError, RuntimeError):
    """One request failed while it ran (a step could not serve it); its blocks are freed and the
    engine keeps serving every other request."""


class KVTransferError(RequestFailedError):
    """A request's KV could not be pulled and its failure policy is "fail"."""


class EngineDeadError(PDServeError, RuntimeError):
    """The engine can no longer run steps (a worker died, or steps keep failing); every in-flight
    request fails with it."""


# --- the system itself (not a request's answer) ---------------------------------------------------
class PlacementError(PDServeError, ValueError):
    """The Ray cluster cannot hold what the cluster spec asks for (names the pool and resource)."""


class StartupError(PDServeError, RuntimeError):
    """The pools could not be started (the message says why: a resource, a model that failed to load)."""


class SchemaVersionMismatch(PDServeError, ValueError):
    """A control-plane message was written with another schema version than this process reads."""


class KVLayoutMismatch(PDServeError, ValueError):
    """The two engines' KV layouts (or connectors) differ: their blocks cannot be exchanged."""


class LeaseGoneError(PDServeError, RuntimeError):
    """The prefill side no longer holds the blocks (released, aborted or expired)."""


class ChannelClosed(PDServeError, ConnectionError):
    """The other end of a step channel closed the connection (its process died or shut down)."""


class BuildError(PDServeError, RuntimeError):
    """The C++ extension could not be compiled or loaded; the message carries the compiler's output."""
