"""ChannelServer: a replica's output channels over TCP (the replica end of router/routing/channel.py).

Ray places and supervises the replica actors; per request and per engine step, though, a Ray call
(the submit) and a streaming-generator item (each step's message) cost the ingress most of its CPU
(py-spy on an ingress through Serve's proxy: ~35% of its samples in Ray's submit, the generator's
next and the futures it resolves on a thread; docs/perf/journal.md §32). So an ingress asks the
replica once, by a Ray call, where its channel server listens (`EngineReplica.channel_address`: the
node's address, a port, a token), connects, and from then on the channel's frames carry both ways
what the Ray calls carried: the ingress's submits and aborts, and the replica's `ChannelMessage`s,
each acknowledged before the next leaves (so an ingress that falls behind gets fewer, fuller
messages, as with the Ray stream's backpressure).

Nothing a connection sends is unpickled before its first frame matched the token.
A submit the replica refuses (bad input, a dead or sleeping engine) comes back as that request's
failure delta. A connection that closes (the ingress went away) aborts what that ingress runs here,
as a closed Ray channel does. The token (drawn per replica, handed out over Ray's own authenticated
calls) is the first thing a connection must send; a connection that does not is closed unread.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
import pickle
import secrets
import socket
from typing import Any

from records.deltas import ChannelMessage
from records.errors import RequestFailedError
from router.routing.channel import ABORT, ACK_PAYLOAD, SUBMIT, frame, read_frame, tune_socket

logger = logging.getLogger(__name__)


class ChannelServer:
    def __init__(self, replica: Any) -> None:
        """replica: the EngineReplica (cluster/replica.py) whose channels this serves."""
        self.replica = replica
        self.token = secrets.token_bytes(16)
        self._server: asyncio.base_events.Server | None = None
        self._address: tuple[str, int] | None = None

    async def address(self) -> tuple[str, int, bytes]:
        """Where to connect (this node's address, the port) and the token to send first; the
        server starts on the first call, on the running event loop."""
        if self._server is None:
            host = _node_address()
            self._server = await asyncio.start_server(self._serve, host, 0)
            self._address = (host, self._server.sockets[0].getsockname()[1])
        assert self._address is not None
        return (*self._address, self.token)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        tune_socket(writer.get_extra_info("socket"))
        pump: asyncio.Task | None = None
        try:
            if not hmac.compare_digest(await read_frame(reader, len(self.token)), self.token):
                logger.warning("closing a channel connection that sent the wrong token")
                return
            ingress_id, kv_cursor = pickle.loads(await read_frame(reader))
            acked = asyncio.Event()
            pump = asyncio.get_running_loop().create_task(self._pump(writer, ingress_id, kv_cursor, acked))
            while True:
                payload = await read_frame(reader)
                if payload == ACK_PAYLOAD:
                    acked.set()
                    continue
                kind, *args = pickle.loads(payload)
                if kind == SUBMIT:
                    self._submit(ingress_id, args)
                elif kind == ABORT:
                    self.replica.abort(args[0])
        except (asyncio.IncompleteReadError, ConnectionError):
            pass                                    # the ingress went away (or the replica closes)
        finally:
            if pump is not None:
                pump.cancel()
                with contextlib.suppress(BaseException):
                    await pump
            writer.close()

    def _submit(self, ingress_id: str, args: list) -> None:
        try:
            self.replica.submit(ingress_id, *args)
        except Exception as e:  # noqa: BLE001 - the request's own failure, sent back on its channel
            self.replica.fail(ingress_id, args[0], e)

    async def _pump(self, writer: asyncio.StreamWriter, ingress_id: str, kv_cursor: int | None,
                    acked: asyncio.Event) -> None:
        """The replica's messages for this ingress, each sent once the one before was taken; an
        error that ends the channel (a closed engine) goes as the last frame."""
        try:
            # (closed however the pump ends: its end aborts what the ingress still runs here)
            async with contextlib.aclosing(self.replica.open_channel(ingress_id, kv_cursor)) as channel:
                async for message in channel:
                    writer.write(frame(_pickled(message)))
                    await writer.drain()
                    await acked.wait()
                    acked.clear()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the channel's end, told to the ingress
            with contextlib.suppress(Exception):
                writer.write(frame(pickle.dumps(e, protocol=5)))
                await writer.drain()
        writer.close()


def _pickled(message: ChannelMessage) -> bytes:
    """The message's bytes; an error a delta carries that does not pickle goes as a
    RequestFailedError naming it (it ends that request, not the channel)."""
    try:
        return pickle.dumps(message, protocol=5)
    except Exception:  # noqa: BLE001 - some delta's error: find it
        for i, delta in enumerate(message.deltas):
            try:
                pickle.dumps(delta.error)
            except Exception:  # noqa: BLE001
                error = RequestFailedError(f"{type(delta.error).__name__}: {delta.error}")
                message.deltas[i] = dataclasses.replace(delta, error=error)
        return pickle.dumps(message, protocol=5)


def _node_address() -> str:
    """This node's address for the ingresses to reach (Ray's, under Ray; loopback outside it)."""
    import ray  # noqa: PLC0415 - the class is plain; Ray only where it runs as an actor

    if ray.is_initialized():
        return ray.util.get_node_ip_address()
    return socket.gethostbyname("localhost")
