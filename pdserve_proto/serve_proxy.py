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
then waits for it to end before the call does (the handler still reads the call's context).
This module runs inside Serve's proxy actor: it imports nothing of pdserve beyond the schema.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from pdserve_proto import pb2_grpc

_END = object()
_HANDLER_END_TIMEOUT_S = 10.0


def cancel_on_close(handler: Callable[[Any, Any], AsyncIterator[Any]]) -> Callable[[Any, Any], AsyncIterator[Any]]:
    """Wrap a server-streaming handler `(request, context) -> async iterator` so that it runs in a
    task of its own, its messages pass through an unbounded queue, and the task is cancelled the
    moment the returned generator is cancelled or closed (client gone, deadline, server stop)."""

    async def unary_stream(request: Any, context: Any) -> AsyncIterator[Any]:
        queue: asyncio.Queue[Any] = asyncio.Queue()

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


class _Raised:
    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


def add_GenerationServicer_to_server(servicer: Any, server: Any) -> None:  # noqa: N802 - gRPC's naming
    """Register the Generation service on `server`. On Serve's proxy server (which builds every
    handler with its `service_handler_factory`), server-streaming handlers get `cancel_on_close`."""
    factory = getattr(server, "service_handler_factory", None)
    if not callable(factory):
        pb2_grpc.add_GenerationServicer_to_server(servicer, server)
        return

    def repaired(service_method: str, streaming_type: Any) -> Any:
        handler = factory(service_method=service_method, streaming_type=streaming_type)
        return cancel_on_close(handler) if getattr(streaming_type, "name", "") == "UNARY_STREAM" else handler

    server.service_handler_factory = repaired
    try:
        pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    finally:
        server.service_handler_factory = factory
