"""ReplicaChannel: the ingress end of one engine replica's output channel (cluster/replica.py).

One per (ingress, replica) pair instead of one Ray stream per request: the ingress submits each
request with a plain call and receives every engine step's deltas for all of its requests on that
replica as one message, which a single task here hands to the requests' queues. A channel that
follows the replica's KV events (`on_events`) gets them on the same messages, in the log's order,
from the cursor it last reached (so a reopened channel misses none and repeats none): one stream
per replica carries both. A request whose consumer stops early (client disconnect) is aborted on the
replica at once; the replica aborts everything of an ingress whose channel closes. When the replica
dies, every request on the channel gets the Ray error (the router re-routes those that streamed
nothing yet).

The channel and the aborts are sent outside the calling request's context. Ray ties an actor call
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
from collections.abc import AsyncIterator, Callable
from typing import Any

from records.outputs import ChannelMessage, StepDelta
from records.request import Continuation
from records.sampling_params import SamplingParams

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


class ReplicaChannel:
    def __init__(self, handle: Any, ingress_id: str, on_events: Callable[[bytes], bool] | None = None,
                 on_end: Callable[[BaseException], bool] | None = None,
                 kv_cursor: Callable[[], int] = lambda: 0) -> None:
        """handle: the replica's Ray actor handle; ingress_id: unique per ingress process.
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
        self._receiver: asyncio.Task | None = None

    async def stream(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     kv_transfer_params: dict | None = None, continuation: Continuation | None = None,
                     trace_context: dict[str, str] | None = None, block_hashes: list[bytes] | None = None
                     ) -> AsyncIterator[StepDelta]:
        """Run one request on the replica and stream its StepDeltas (`continuation`: resumed after
        tokens a lost replica sent; `trace_context`: the W3C carrier of its trace; `block_hashes`:
        the hash chain the router routed it on; EngineReplica.submit).
        Raises what the replica raised on submit (ValueError for bad input), the error a delta
        carries (RequestFailedError, EngineDeadError, ...), or the Ray error of a dead replica.
        Stopping early aborts it."""
        self.open()
        queue: asyncio.Queue = asyncio.Queue()
        self.queues[request_id] = queue
        finished = False
        try:
            await self.handle.submit.remote(self.ingress_id, request_id, prompt_token_ids, params,
                                            kv_transfer_params, continuation, trace_context, block_hashes)
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
                contextvars.Context().run(self.handle.abort.remote, request_id)

    def close(self) -> None:
        if self._receiver is not None:
            self._receiver.cancel()
            self._receiver = None

    def open(self) -> None:
        """Open the channel now (it opens on the first request otherwise); one that follows KV
        events is opened again after it ends, until its replica is gone or `close()`."""
        if self._receiver is None or self._receiver.done():
            self._receiver = asyncio.get_running_loop().create_task(self._receive(),
                                                                    context=contextvars.Context())

    async def _receive(self) -> None:
        while True:
            try:
                cursor = self.kv_cursor() if self.on_events is not None else None
                stream = self.handle.open_channel.options(
                    num_returns="streaming", _generator_backpressure_num_objects=SENT_AHEAD
                ).remote(self.ingress_id, cursor)
                async for ref in stream:
                    message: ChannelMessage = await ref
                    if message.kv_events is not None and self.on_events is not None \
                            and not self.on_events(message.kv_events):
                        self.on_events = None       # refused: the channel follows no events from now on
                    for delta in message.deltas:
                        queue = self.queues.get(delta.request_id)
                        if queue is not None:
                            queue.put_nowait(delta)
                error: BaseException = ConnectionError("the replica closed its output channel")
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the replica is gone: every request on it learns why
                error = e
            logger.warning("the output channel to a replica ended: %s", type(error).__name__)
            for queue in self.queues.values():
                queue.put_nowait(error)
            gone = self.on_end(error) if self.on_end is not None else True
            if gone or self.on_events is None:
                return
            await asyncio.sleep(REOPEN_S)
