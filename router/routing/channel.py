"""ReplicaChannel: the ingress end of one engine replica's output channel (cluster/replica.py).

One per (ingress, replica) pair instead of one Ray stream per request: the ingress submits each
request on it and receives every engine step's deltas for all of its requests on that replica as
one message, which a single task here hands to the requests' queues. It travels on a TCP
connection of its own to the replica's channel server (cluster/channel_server.py; the frames
below), which a Ray call sets up; or, with transport "ray", as an actor call per submit and a Ray
streaming generator for the messages (a third more of the ingress's CPU a streamed token). A channel that
follows the replica's KV events (`on_events`) gets them on the same messages, in the log's order,
from the cursor it last reached (so a reopened channel misses none and repeats none): one stream
per replica carries both. A request whose consumer stops early (client disconnect) is aborted on the
replica at once; the replica aborts everything of an ingress whose channel closes. When the replica
dies, every request on the channel gets the Ray error (the router re-routes those that streamed
nothing yet); over TCP, a connection that ends is told apart by asking Ray whether the replica is
still there.

Over Ray, the channel and the aborts are sent outside the calling request's context. Ray ties an actor call
to the task that made it, and Serve cancels an HTTP request's task when its client goes away,
together with every call made in its context. A channel opened in a request's context was closed
with that request, failing every other request on the replica; an abort sent from the cancelled
request's `finally` arrived in our runs, but Ray's own tests clear the context before such a call,
and so does this.
"""
from __future__ import annotations

import asyncio
import contextvars
import logging
import pickle
import socket
import struct
from collections.abc import AsyncIterator, Callable
from typing import Any

from records.deltas import ChannelMessage, StepDelta
from records.request import Continuation
from records.sampling_params import SamplingParams
from records.serving import CHANNEL_TRANSPORTS

logger = logging.getLogger(__name__)

# Step messages a replica may send ahead of what this ingress has taken (Ray's streaming-generator
# backpressure). While one waits, the replica's engine steps on and its deltas gather in the
# channel's outbox, so the next message carries every step since: an ingress that falls behind gets
# fewer, fuller messages instead of a backlog of one per step (each costs the ingress a Ray reply,
# an unpickling and a task wake-up: a request of 8 tokens took ~7 messages, now ~2 at saturation,
# and the ingress served 1.4x the requests per CPU-second; docs/perf/journal.md §24). An ingress
# that keeps up sees no difference: the wait is one acknowledgement on loopback.
SENT_AHEAD = 1

# After a channel that follows KV events ends for a reason other than its replica's end: how long
# until it is opened again.
REOPEN_S = 1.0

# The TCP channel's frames: a 4-byte big-endian length, then a pickle. The ingress sends the
# replica's token (raw bytes: nothing is unpickled before it matched), a hello (ingress id, KV
# cursor), then (SUBMIT, request id, the submit's arguments...), (ABORT, request id) and (ACK,)
# after each message it took; the replica sends ChannelMessages, and the error that ended the
# channel as its last frame.
SUBMIT, ABORT, ACK = "submit", "abort", "ack"
_LENGTH = struct.Struct("!I")
# A lost replica whose socket did not close (its node vanished): keepalive probes and unacknowledged
# data give up after about this long.
LINK_TIMEOUT_S = 30
# After the connection ended: how long to wait for Ray to say whether the replica is gone.
PROBE_TIMEOUT_S = 30.0
# How long a connection to a replica's channel server may take to open (past it, or refused, while
# the replica answers Ray: the channel goes over Ray).
CONNECT_TIMEOUT_S = 10.0


def frame(payload: bytes) -> bytes:
    return _LENGTH.pack(len(payload)) + payload


ACK_PAYLOAD = pickle.dumps((ACK,))      # (the replica tells an ack by its bytes: one a step message)
_ACK_FRAME = frame(ACK_PAYLOAD)


async def read_frame(reader: asyncio.StreamReader, limit: int | None = None) -> bytes:
    """One frame's payload; asyncio.IncompleteReadError at the connection's end, ConnectionError
    for one longer than `limit`."""
    (size,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    if limit is not None and size > limit:
        raise ConnectionError(f"a frame of {size} bytes where at most {limit} may come")
    return await reader.readexactly(size)


def tune_socket(sock: socket.socket | None) -> None:
    """No Nagle delay on small frames; a peer that vanishes without closing is noticed within
    LINK_TIMEOUT_S (keepalive when idle, a timeout on unacknowledged data)."""
    if sock is None:
        return
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 4),
                        ("TCP_USER_TIMEOUT", LINK_TIMEOUT_S * 1000)):
        if hasattr(socket, name):           # (Linux)
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class ReplicaChannel:
    def __init__(self, handle: Any, ingress_id: str, on_events: Callable[[bytes], bool] | None = None,
                 on_end: Callable[[BaseException], bool] | None = None,
                 kv_cursor: Callable[[], int] = lambda: 0, transport: str = "tcp") -> None:
        """handle: the replica's Ray actor handle; ingress_id: unique per ingress process;
        transport: "tcp" (a connection of its own to the replica's channel server,
        cluster/channel_server.py: the submits, aborts and step messages as frames) or "ray" (the
        submit an actor call, the messages a Ray streaming generator).
        `on_events`: follow the replica's KV events, from `kv_cursor()` (the owner's cursor: where
        the batches it took so far end) whenever the channel opens: called with each message's
        batch (protobuf), it returns whether it took it (False: refused, and the channel stops
        following). `on_end(error)`: called when the channel ends; True means the replica is gone
        for good (the channel is not opened again for its events)."""
        self.handle = handle
        self.ingress_id = ingress_id
        self.queues: dict[str, asyncio.Queue] = {}     # request id -> its deltas (or the channel's error)
        self.on_events = on_events
        self.on_end = on_end
        self.kv_cursor = kv_cursor
        if transport not in CHANNEL_TRANSPORTS:
            raise ValueError(f"transport must be one of {CHANNEL_TRANSPORTS}; got {transport!r}")
        self.transport = transport
        self._receiver: asyncio.Task | None = None
        # The TCP channel's connection once it is up (its writer), or the error it failed with.
        self._link: asyncio.Future | None = None

    async def stream(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     kv_transfer_params: dict | None = None, continuation: Continuation | None = None,
                     trace_context: dict[str, str] | None = None, block_hashes: list[bytes] | None = None,
                     images: tuple = ()) -> AsyncIterator[StepDelta]:
        """Run one request on the replica and stream its StepDeltas (`continuation`: resumed after
        tokens a lost replica sent; `trace_context`: the W3C carrier of its trace; `block_hashes`:
        the hash chain the router routed it on; `images`: the prompt's; EngineReplica.submit).
        Raises what the replica raised on submit (ValueError for bad input), the error a delta
        carries (RequestFailedError, EngineDeadError, ...), or the Ray error of a dead replica.
        Stopping early aborts it."""
        self.open()
        queue: asyncio.Queue = asyncio.Queue()
        self.queues[request_id] = queue
        finished = False
        try:
            writer = None
            # Images with their embeddings' object references (an encode pool's) go through Ray, whose
            # serialization tells the references' owner that the replica borrows them.
            if self.transport == "tcp" and not any(image.embeddings is not None for image in images):
                link = self._link
                assert link is not None
                writer = link.result() if link.done() else await asyncio.shield(link)
            if writer is not None:
                writer.write(frame(pickle.dumps((SUBMIT, request_id, prompt_token_ids, params, kv_transfer_params,
                                                 continuation, trace_context, block_hashes, images), protocol=5)))
            else:                   # (over Ray, or a TCP channel that fell back to it: the link says None)
                await self.handle.submit.remote(self.ingress_id, request_id, prompt_token_ids, params,
                                                kv_transfer_params, continuation, trace_context, block_hashes,
                                                images)
            while not finished:
                delta = await queue.get()
                if isinstance(delta, BaseException):
                    raise delta
                if delta.error is not None:
                    finished = True
                    raise delta.error
                finished = delta.finished
                yield delta
        finally:
            del self.queues[request_id]
            if not finished:
                self._abort(request_id)

    def _abort(self, request_id: str) -> None:
        link = self._link
        if link is None:                    # over Ray (or a TCP channel that fell back to it)
            contextvars.Context().run(self.handle.abort.remote, request_id)
        elif link.done() and not link.cancelled() and link.exception() is None:
            writer = link.result()
            if writer is not None and not writer.is_closing():
                writer.write(frame(pickle.dumps((ABORT, request_id))))
        # (a channel whose connection is down aborted the ingress's requests on the replica as it closed)

    def close(self) -> None:
        if self._receiver is not None:
            self._receiver.cancel()
            self._receiver = None
        if self._link is not None:
            if not self._link.done():
                self._link.cancel()
            self._link = None

    def open(self) -> None:
        """Open the channel now (it opens on the first request otherwise); one that follows KV
        events is opened again after it ends, until its replica is gone or `close()`."""
        if self._receiver is None or self._receiver.done():
            if self.transport == "tcp":
                self._new_link()
            receive = self._receive_tcp if self.transport == "tcp" else self._receive
            self._receiver = asyncio.get_running_loop().create_task(receive(), context=contextvars.Context())

    def _new_link(self) -> None:
        if self._link is None or self._link.done():
            self._link = asyncio.get_running_loop().create_future()
            # (an error no stream was waiting for is not an unretrieved one)
            self._link.add_done_callback(lambda f: f.cancelled() or f.exception())

    def _dispatch(self, message: ChannelMessage) -> None:
        if message.kv_events is not None and self.on_events is not None and not self.on_events(message.kv_events):
            self.on_events = None       # refused: the channel follows no events from now on
        for delta in message.deltas:
            queue = self.queues.get(delta.request_id)
            if queue is not None:
                queue.put_nowait(delta)

    def _ended(self, error: BaseException) -> bool:
        """Tell every request on the channel how it ended; whether to stop (the replica is gone,
        or the channel follows no events: the next request opens it again)."""
        logger.warning("the output channel to a replica ended: %s", type(error).__name__)
        for queue in self.queues.values():
            queue.put_nowait(error)
        gone = self.on_end(error) if self.on_end is not None else True
        return gone or self.on_events is None

    async def _receive_tcp(self) -> None:
        while True:
            assert self._link is not None
            writer = None
            try:
                host, port, token = await self.handle.channel_address.remote()
                try:
                    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), CONNECT_TIMEOUT_S)
                except (OSError, asyncio.TimeoutError) as e:
                    if await self._gone() is None:      # the replica is there: its port is not reachable
                        await self._over_ray(f"{host}:{port}", e)
                        return
                    raise
                tune_socket(writer.get_extra_info("socket"))
                cursor = self.kv_cursor() if self.on_events is not None else None
                writer.write(frame(token) + frame(pickle.dumps((self.ingress_id, cursor))))
                self._link.set_result(writer)
                while True:
                    message = pickle.loads(await read_frame(reader))
                    if isinstance(message, BaseException):
                        raise message               # what ended the channel on the replica
                    writer.write(_ACK_FRAME)
                    self._dispatch(message)
            except asyncio.CancelledError:
                if writer is not None:
                    writer.close()
                raise
            except (asyncio.IncompleteReadError, OSError):
                error = await self._gone() or ConnectionError("the connection to the replica's channel closed")
            except Exception as e:  # noqa: BLE001 - the replica is gone: every request on it learns why
                error = e
            if writer is not None:
                writer.close()
            if not self._link.done():
                self._link.set_exception(error)
            stop = self._ended(error)
            self._link = None if stop else self._link
            if stop:
                return
            self._new_link()        # (requests from now on wait for the next connection)
            await asyncio.sleep(REOPEN_S)

    async def _gone(self) -> BaseException | None:
        """Ask Ray whether the replica is still there: None if it answers, else the error that
        says why not (Ray's, for a replica that is gone)."""
        try:
            await asyncio.wait_for(self.handle.channel_address.remote(), PROBE_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - gone (or unreachable for that long)
            return e
        return None

    async def _over_ray(self, address: str, error: BaseException) -> None:
        """The replica answers Ray but its channel server cannot be reached (a network that lets
        Ray's ports through and not others): this channel goes over Ray from now on."""
        logger.warning("cannot connect to a replica's channel server at %s (%s): its channel goes over Ray "
                       "(routing.channel: ray)", address, type(error).__name__)
        self.transport = "ray"
        link, self._link = self._link, None
        if link is not None and not link.done():
            link.set_result(None)           # (streams waiting for the connection submit over Ray)
        await self._receive()

    async def _receive(self) -> None:
        while True:
            try:
                cursor = self.kv_cursor() if self.on_events is not None else None
                stream = self.handle.open_channel.options(
                    num_returns="streaming", _generator_backpressure_num_objects=SENT_AHEAD
                ).remote(self.ingress_id, cursor)
                async for ref in stream:
                    self._dispatch(await ref)
                error: BaseException = ConnectionError("the replica closed its output channel")
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the replica is gone: every request on it learns why
                error = e
            if self._ended(error):
                return
            await asyncio.sleep(REOPEN_S)
