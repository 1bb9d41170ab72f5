"""The servicer function Serve's gRPC proxy loads (`gRPCOptions.grpc_servicer_functions`).

It registers the Generation service like the generated `add_GenerationServicer_to_server`, with one
repair to Serve's proxy (Ray 2.60): a client that cancels a server-streaming call while the proxy is
between messages (writing one to the client rather than awaiting the next from the replica) was not
cancelled on the replica. The proxy's generator then sees GeneratorExit, its `except BaseException`
swallows it without cancelling the replica call, and the replica generates to `max_tokens` for
nobody (seen in CI: five of eight cancelled streams ran to 900 tokens). Only a cancel that lands
while the proxy awaits the replica's next message reaches the replica.

The repair runs Serve's streaming handler in its own task, which is then always awaiting the
replica when it is cancelled, and cancels that task when the client's call ends for any reason,
then waits for it to end before the call does (the handler still reads the call's context); and
it gives Serve's handlers a context whose peer address was read when the call started
(`CallContext`): reading it from a call gRPC had freed crashed the proxy.
It also makes the proxy's gRPC server listen on the serving host rather than on every interface
(`grpc_options_on`, `bind_grpc_to`). This module runs inside Serve's proxy actor: it imports
nothing of pdserve beyond the schema.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from ray.serve.config import gRPCOptions

from pdserve_proto import pb2_grpc

_END = object()
_HANDLER_END_TIMEOUT_S = 10.0


def cancel_on_close(handler: Callable[[Any, Any], AsyncIterator[Any]]) -> Callable[[Any, Any], AsyncIterator[Any]]:
    """Wrap a server-streaming handler `(request, context) -> async iterator` so that it runs in a
    task of its own, its messages pass through an unbounded queue, and the task is cancelled the
    moment the returned generator is cancelled or closed (client gone, deadline, server stop)."""

    async def unary_stream(request: Any, context: Any) -> AsyncIterator[Any]:
        queue: asyncio.Queue[Any] = asyncio.Queue()
        context = CallContext.of(context)

        async def drive() -> None:
            try:
                async for message in handler(request, context):
                    queue.put_nowait(message)
            except asyncio.CancelledError:
                raise
            except BaseException as error:  # noqa: BLE001 - re-raised in the caller's task below
                queue.put_nowait(_Raised(error))
            finally:
                queue.put_nowait(_END)

        task = asyncio.ensure_future(drive())
        try:
            while (item := await queue.get()) is not _END:
                if isinstance(item, _Raised):
                    raise item.error
                yield item
        finally:
            if not task.done():
                task.cancel()
                # Wait for the handler to end while the call is still alive: Serve's handler
                # reads `context.peer()` for its access log as it ends, and that crashed the whole
                # proxy (a segfault in gRPC's C core) when it ran after gRPC had freed the call.
                await asyncio.wait({task}, timeout=_HANDLER_END_TIMEOUT_S)

    return unary_stream


class CallContext:
    """A call's servicer context with its peer address read once, when the call starts.

    Serve's proxy reads `context.peer()` for its access log after the stream ends. When the client
    had cancelled, gRPC may have freed the call by then, and `peer()` dereferenced it: the proxy
    actor died of a segfault in gRPC's C core (seen in clean-clone test runs), taking every stream
    on it down and leaving the cancelled ones running on their replicas. Everything else is the
    context's own."""
    __slots__ = ("_context", "_peer")

    def __init__(self, context: Any) -> None:
        self._context = context
        self._peer = context.peer()

    @classmethod
    def of(cls, context: Any) -> Any:
        return context if context is None or isinstance(context, cls) else cls(context)

    def peer(self) -> str:
        return self._peer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


def peer_once(handler: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """Wrap a unary handler `(request, context) -> awaitable` to see a `CallContext`."""

    async def unary(request: Any, context: Any) -> Any:
        return await handler(request, CallContext.of(context))

    return unary


class _Raised:
    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


def add_GenerationServicer_to_server(servicer: Any, server: Any) -> None:  # noqa: N802 - gRPC's naming
    """Register the Generation service on `server`. On Serve's proxy server (which builds every
    handler with its `service_handler_factory`), server-streaming handlers get `cancel_on_close`
    and unary ones `peer_once`."""
    factory = getattr(server, "service_handler_factory", None)
    if not callable(factory):
        pb2_grpc.add_GenerationServicer_to_server(servicer, server)
        return

    def repaired(service_method: str, streaming_type: Any) -> Any:
        handler = factory(service_method=service_method, streaming_type=streaming_type)
        kind = getattr(streaming_type, "name", "")
        if kind == "UNARY_STREAM":
            return cancel_on_close(handler)
        return peer_once(handler) if kind == "UNARY_UNARY" else handler

    server.service_handler_factory = repaired
    try:
        pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    finally:
        server.service_handler_factory = factory


def bind_grpc_to(host: str) -> None:
    """In this process, make Serve's gRPC servers listen on `host` instead of every interface:
    Ray 2.60 adds "[::]:<port>" with no setting to narrow it (ray/serve/_private/grpc_util.py,
    `start_grpc_server`, through `default_impl.add_grpc_address`, which it imports at each call).
    Where Ray's layout differs nothing changes (and the port listens on every interface, as
    docs/HARDENING.md says)."""
    try:
        from ray.serve._private import default_impl  # noqa: PLC0415
    except ImportError:
        return
    add = default_impl.add_grpc_address
    original = getattr(add, "pdserve_original", add)

    def add_grpc_address_on_host(server: Any, address: str) -> Any:
        if address.startswith("[::]:"):
            address = f"{_grpc_host(host)}:{address[5:]}"
        return original(server, address)

    add_grpc_address_on_host.pdserve_original = original  # type: ignore[attr-defined]
    default_impl.add_grpc_address = add_grpc_address_on_host


def _grpc_host(host: str) -> str:
    """A host as a gRPC address takes it: an IPv6 literal in brackets."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


class BoundgRPCOptions(gRPCOptions):
    """Serve's gRPCOptions with the host its proxies' gRPC servers listen on: when the options
    are unpickled where a proxy starts (before its gRPC server does), that process's Serve gRPC
    servers bind to the host (`bind_grpc_to`)."""
    bind_host: str = "127.0.0.1"

    def __setstate__(self, state: Any) -> None:
        super().__setstate__(state)
        bind_grpc_to(self.bind_host)


def grpc_options_on(host: str, **fields: Any) -> gRPCOptions:
    """Serve's gRPCOptions whose proxies listen on `host`, not on every interface; a wildcard
    host keeps Serve's own."""
    if host in ("0.0.0.0", "::", "[::]", ""):
        return gRPCOptions(**fields)
    return BoundgRPCOptions(bind_host=host, **fields)
