"""EngineReplica: one engine replica as the serving layer sees it (the body of an engine actor).

A plain class around `AsyncLLMEngine` (Ray is applied in `cluster/pool.py`):
- The output channel, one per (ingress, replica) pair: an ingress opens it once
  (`open_channel(ingress_id, kv_cursor)`, a Ray streaming generator when this runs as an actor)
  and then `submit`s requests; every engine step in which some of its requests advanced, or which
  produced KV events the ingress follows, becomes one `ChannelMessage` on its channel: a list of
  `StepDelta`s (per request: the tokens, text and logprobs that step produced for each of its n
  choices, or the error that ended it) and the KV events since the last message. The engine never
  waits for a message to be taken (see AsyncLLMEngine), and a channel that closes (its ingress
  went away) aborts whatever that ingress still runs here. `abort(request_ids)` reaches the engine
  before its next step.
- `generate()` streams one request's StepDeltas on their own (tests and tools).
- Sleep (`sleep(level)`, `wake()`, vLLM's sleep mode for one replica): the engine is torn down in
  the live actor, which keeps its process, imports, handles and channels; its KV cache and weights
  are freed (level 1 leaves the checkpoint's pages in the OS page cache, level 2 asks the OS to drop
  them too), and the KV event log tells its followers the cache is gone. A sleeping replica answers
  health checks as healthy and refuses requests with ModelAsleepError (its ingress wakes the model
  and sends them again); `wake()` builds the engine again from the same config.
- The engine's KV events are an ordered log that any number of readers follow at their own pace:
  the channels (from the cursor an ingress opened its channel at) and `kv_events_since(cursor)`; a
  reader whose cursor fell off the bounded log gets a snapshot (`AllCleared` + `BlockStored(every
  cached hash)`) that brings its index back in line exactly.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from cluster.channel_server import ChannelServer
from cluster.memory import drop_page_cache, engine_released, release_heap, resident_bytes
from pdserve_proto.kv_events import encode_kv_events
from records.config import EngineConfig
from records.deltas import ChannelMessage, StepDelta
from records.engine_stats import ReplicaStats
from records.errors import EngineDeadError, ModelAsleepError
from records.kv_events import AllCleared, KVEvent
from records.outputs import RequestOutput
from records.request import Continuation
from records.sampling_params import SamplingParams
from records.single_flight import SingleFlight

if TYPE_CHECKING:
    from engine.async_engine import AsyncLLMEngine

logger = logging.getLogger(__name__)

MAX_EVENT_LOG = 100_000
# An idle channel sends an empty message this often, so a channel whose ingress is gone is noticed
# (and its requests aborted) even when none of them advances.
CHANNEL_HEARTBEAT_S = 10.0


def _build_engine(config: EngineConfig) -> AsyncLLMEngine:
    # The engine (torch) is imported where one is built: a manager that only names this class to
    # start replicas (cluster/pool.py) never pays its ~1 s import.
    from engine.async_engine import AsyncLLMEngine  # noqa: PLC0415

    return AsyncLLMEngine(config)


def _node_id() -> str | None:
    """The Ray node this runs on (None outside Ray)."""
    import ray  # noqa: PLC0415 - the class is plain; Ray only where it runs as an actor

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None


def _deltas(params: SamplingParams) -> SamplingParams:
    """The request's params asking the engine for deltas (each step's output holds only what is new)."""
    return params if params.output_kind == "delta" else dataclasses.replace(params, output_kind="delta")


class _Outbox:
    """The deltas waiting for one ingress's channel, and the requests of that ingress still running."""

    def __init__(self) -> None:
        self.deltas: list[StepDelta] = []
        self.ready = asyncio.Event()
        self.request_ids: set[str] = set()
        self.channel = 0                         # which of its channels is the open one (counts up)
        self.kv_cursor: int | None = None        # where its KV events stand (None: it does not follow them)

    def put(self, delta: StepDelta) -> None:
        self.deltas.append(delta)
        if delta.finished:
            self.request_ids.discard(delta.request_id)
        self.ready.set()


# What a trainer may call on a replica's engine (AsyncLLMEngine's methods of these names).
WEIGHT_CALLS = ("pause", "resume", "check_weights", "update_weights", "update_weights_from_disk",
                "init_weights_update_group", "update_weights_from_distributed")


class EngineReplica:
    def __init__(self, config: EngineConfig, replica_id: str = "replica-0", num_threads: int | None = None,
                 load: bool = True, tag: str = "") -> None:
        """`load=False` defers loading the model to `load()`: an actor built that way answers
        `info()` as soon as Ray has placed it, so a pool tells "not placed" (a resource the cluster
        lacks, reported within the placement timeout) from "still loading" (as long as it takes).
        `tag`: what its pool knows it by (a restarted manager adopts the replicas of its own spec)."""
        self.tag = tag
        if num_threads:
            # A Ray actor with num_cpus=1 runs torch single-threaded unless told otherwise.
            import torch  # noqa: PLC0415

            torch.set_num_threads(num_threads)
        self.replica_id = replica_id
        self.config = config
        self.engine: AsyncLLMEngine | None = None
        self._log: list[KVEvent] = []
        self._log_start = 0                 # cursor value of self._log[0]
        self._outboxes: dict[str, _Outbox] = {}   # ingress id -> its channel's pending deltas
        self._closed = False
        self.asleep = 0                     # the sleep level (0: awake)
        self._waking: SingleFlight[None] = SingleFlight()
        self._channel_server = ChannelServer(self)
        if load:
            self.load()

    def load(self) -> dict[str, Any]:
        """Load the model and size the KV cache (once); returns `info()`."""
        if self.engine is None:
            self._attach(_build_engine(self.config))
        return self.info()

    def _attach(self, engine: AsyncLLMEngine) -> None:
        self.engine = engine
        engine.on_step = self._stepped
        # On each of its requests' spans (engine/telemetry.py): which replica, pool and node.
        engine.engine.telemetry.attributes.update({
            "pdserve.replica": self.replica_id, "pdserve.pool": self.replica_id.rpartition("-")[0],
            "pdserve.node": _node_id() or ""})

    # --- sleep and wake -----------------------------------------------------------------------------
    async def sleep(self, level: int = 1) -> dict[str, Any]:
        """Free the engine's KV cache and weights (vLLM's sleep levels: 1 keeps the checkpoint warm
        in the page cache, 2 drops it from there too). Refused (ValueError naming what runs) while
        a request, lease or transfer is under way. Returns the replica's resident memory after."""
        if level not in (1, 2):
            raise ValueError(f"level must be 1 or 2; got {level!r}")
        await self._waking.join()
        if not self.asleep:
            busy = self.leaks()
            if busy is not None:
                raise ValueError(f"replica {self.replica_id} is busy ({busy}); put it to sleep once idle")
            engine, self.engine, self.asleep = self.engine, None, level
            self._take_events_from(engine)
            self._log.append(AllCleared())           # its routers' prefix index forgets it
            await engine.shutdown()
            await engine_released(engine)
            del engine
            release_heap()
            for box in self._outboxes.values():
                if box.kv_cursor is not None:
                    box.ready.set()
        if level == 2:
            self.asleep = 2
            drop_page_cache(self.config.model_config.model)
        return {"replica_id": self.replica_id, "asleep": self.asleep, "rss_bytes": resident_bytes()}

    async def wake(self) -> dict[str, Any]:
        """Build the engine again (concurrent calls share one wake); its time and resident memory."""
        began = time.monotonic()
        if self.asleep:
            await self._waking.run(self._wake)
        return {"replica_id": self.replica_id, "asleep": self.asleep, "wake_s": time.monotonic() - began,
                "rss_bytes": resident_bytes()}

    async def _wake(self) -> None:
        # Built off the event loop: health checks and stats answer meanwhile.
        self._attach(await asyncio.to_thread(_build_engine, self.config))
        self.asleep = 0

    def _engine(self) -> AsyncLLMEngine:
        """The engine, or ModelAsleepError while the replica sleeps."""
        if self.engine is None:
            raise ModelAsleepError(f"replica {self.replica_id} is asleep (level {self.asleep})")
        return self.engine

    def info(self) -> dict[str, Any]:
        mc, cc = self.config.model_config, self.config.cache_config
        kvt = self.config.kv_transfer_config
        return {"replica_id": self.replica_id, "pid": os.getpid(), "loaded": self.engine is not None,
                "asleep": self.asleep,
                "tag": self.tag, "node_id": _node_id(),
                "block_size": cc.block_size,
                "kv_connector": kvt.kv_connector if kvt else None,
                "max_model_len": mc.max_model_len, "max_num_seqs": self.config.scheduler_config.max_num_seqs,
                "num_ranks": self.config.parallel_config.world_size,
                "weight_version": self.engine.engine.weights.version if self.engine is not None else None}

    # --- weight updates, pause and resume (RL: cluster/weights.py, engine/weight_updates.py) --------
    async def weights_call(self, method: str, *args: Any) -> Any:
        """The engine's `method` (one of WEIGHT_CALLS) between its steps; ValueError for a refusal."""
        if method not in WEIGHT_CALLS:
            raise ValueError(f"method must be one of {WEIGHT_CALLS}; got {method!r}")
        return await getattr(self._engine(), method)(*args)

    # --- the output channel -------------------------------------------------------------------------
    async def open_channel(self, ingress_id: str, kv_cursor: int | None = None) -> AsyncIterator[ChannelMessage]:
        """The channel of one ingress: one message per engine step in which any of its requests
        advanced or, with `kv_cursor` (the KV event log's cursor to follow from: 0 at the start),
        which produced KV events (an empty one every CHANNEL_HEARTBEAT_S when idle). Closing it
        (the ingress went away) aborts the requests that ingress still runs here. A channel the
        same ingress opens again replaces this one, which ends quietly (the ingress may see its end
        only later, as a dropped stream does)."""
        box = self._outboxes.setdefault(ingress_id, _Outbox())
        box.channel += 1
        mine, box.kv_cursor = box.channel, kv_cursor
        box.ready.set()             # (an earlier channel wakes and ends; this one sends what waits)
        try:
            while True:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(box.ready.wait(), CHANNEL_HEARTBEAT_S)
                if box.channel != mine:
                    return
                if self._closed:
                    raise EngineDeadError(f"replica {self.replica_id} was closed")
                box.ready.clear()
                batch, box.deltas = box.deltas, []
                events = None
                if box.kv_cursor is not None:
                    self._take_events()
                    end, records = self._events_after(box.kv_cursor)
                    if end != box.kv_cursor or records:
                        events, box.kv_cursor = encode_kv_events(end, records, self.replica_id), end
                yield ChannelMessage(batch, events)
        finally:
            if box.channel == mine and self.engine is not None:   # (a replaced channel leaves the
                for request_id in box.request_ids:              # requests to its successor)
                    self.engine.abort(request_id)
                self._outboxes.pop(ingress_id, None)

    async def channel_address(self) -> tuple[str, int, bytes]:
        """Where an ingress connects for its channel over TCP (cluster/channel_server.py): this
        node's address, a port, and the token a connection sends first."""
        return await self._channel_server.address()

    def fail(self, ingress_id: str, request_id: str, error: BaseException) -> None:
        """End a request this replica refused (its submit raised) on its ingress's channel."""
        self._outboxes.setdefault(ingress_id, _Outbox()).put(StepDelta.failure(request_id, error))

    def submit(self, ingress_id: str, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               kv_transfer_params: dict | None = None, continuation: Continuation | None = None,
               trace_context: dict[str, str] | None = None, block_hashes: list[bytes] | None = None,
               images: tuple = ()) -> None:
        """Start a request whose deltas go to `ingress_id`'s channel (`continuation`: a stream
        migrated from a lost replica, resumed after the tokens it sent; `trace_context`: the W3C
        carrier its spans go under; `block_hashes`: the prompt's hash chain, from an ingress that
        prepared it: LLMEngine.add_request; `images`: its images, records/multimodal.py). Raises
        ValueError for bad input and EngineDeadError for a dead engine (nothing runs then)."""
        box = self._outboxes.setdefault(ingress_id, _Outbox())     # the channel may open just after

        def sink(item: RequestOutput | BaseException) -> None:
            box.put(StepDelta.failure(request_id, item) if isinstance(item, BaseException)
                    else StepDelta.of_output(item, item.error()))

        # Counted before the engine can answer (a sink may run before submit returns), and dropped
        # again if nothing runs: a leftover id would be a request the channel waits on forever.
        engine = self._engine()
        box.request_ids.add(request_id)
        try:
            queued = engine.submit(request_id, prompt_token_ids, _deltas(params), sink, kv_transfer_params,
                                   continuation=continuation, trace_context=trace_context, block_hashes=block_hashes,
                                   images=images)
        except BaseException:
            box.request_ids.discard(request_id)
            raise
        if not queued:                   # its abort came first: the ingress gave up on it already
            box.request_ids.discard(request_id)

    async def encode(self, images: list[Any]) -> list[Any]:
        """Encode a request's images (a replica of an encode pool: router/routing/encode.py): each
        one's embeddings put in this node's object store, as references, for the replica that
        prefills the prompt to read."""
        import ray  # noqa: PLC0415

        return [ray.put(made) for made in await self._engine().encode_images(images)]

    async def encoder_stats(self) -> dict[str, int] | None:
        """Images this replica encoded and received made (AsyncLLMEngine.encoder_stats)."""
        return await self._engine().encoder_stats()

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       kv_transfer_params: dict | None = None) -> AsyncIterator[StepDelta]:
        """Stream one request's StepDeltas on their own; closing the stream early aborts the request
        (its blocks are freed)."""
        async for out in self._engine().generate(request_id, prompt_token_ids, _deltas(params), kv_transfer_params):
            yield StepDelta.of_output(out, out.error())

    async def close(self) -> None:
        """Stop serving (a simulated replica its host removes, cluster/replica_host.py): every open
        channel ends with EngineDeadError (its ingress migrates the streams) and the engine stops."""
        self._closed = True
        self._channel_server.close()
        for box in self._outboxes.values():
            box.ready.set()
        if self.engine is not None:
            await self.engine.shutdown()

    def abort(self, request_ids: str | list[str]) -> None:
        """Abort requests, or end the lease on the blocks of one prefilled for a remote decode."""
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            if self.engine is not None:
                self.engine.abort(request_id)
            for box in self._outboxes.values():     # its channel sends it nothing more
                box.request_ids.discard(request_id)

    def renew_lease(self, request_id: str, seconds: float) -> bool:
        return self.engine is not None and self.engine.renew_lease(request_id, seconds)

    async def lease_prefix(self, block_hashes: list[bytes], adapter: str = "") -> dict[str, Any] | None:
        """Lease the leading run of these blocks this replica holds (its pool, then its offload
        tier), for a peer replica to pull (LLMEngine.lease_prefix): its kv_transfer_params, or None."""
        return None if self.engine is None else await self.engine.lease_prefix(block_hashes, adapter)

    def stats(self) -> ReplicaStats:
        if self.engine is None:             # asleep: healthy, nothing running, nothing cached
            return ReplicaStats(self.replica_id, healthy=True, asleep=self.asleep)
        return ReplicaStats(self.replica_id, healthy=self.engine.is_healthy, engine=self.engine.stats())

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (refused while requests hold blocks); emits AllCleared."""
        done = self._engine().engine.reset_prefix_cache()
        self._stepped()             # (no step follows an idle engine's reset: tell the channels now)
        return done

    def leaks(self) -> str | None:
        """What is left behind, in words (a request in the engine or on a channel, a pull, a lease,
        a held KV block), or None when nothing is."""
        try:
            if self.engine is not None:
                self.engine.engine.check_no_leaks()
        except AssertionError as e:
            return str(e) or "KV blocks are not all free"
        left = sorted(rid for box in self._outboxes.values() for rid in box.request_ids)
        return f"requests still on a channel: {left}" if left else None

    def check_no_leaks(self) -> bool:
        """True when no request is left (in the engine or on a channel) and every KV block is free
        (for tests and drains)."""
        return self.leaks() is None

    async def kv_events_since(self, cursor: int, wait_s: float = 0.0) -> bytes:
        """Events after `cursor` (0 at the start) and the cursor to pass next time, as a protobuf
        KVEventBatch (`pdserve_proto.kv_events.decode_kv_events` gives them back), so a router of
        another schema version refuses them instead of misreading them.

        A long poll: with `wait_s` > 0 and nothing new, it returns after the first engine step that
        produced events, or after `wait_s` seconds, so a replica whose cache does not change costs
        its routers nothing."""
        end, events = await self.kv_event_records_since(cursor, wait_s)
        return encode_kv_events(end, events, self.replica_id)

    async def kv_event_records_since(self, cursor: int, wait_s: float = 0.0) -> tuple[int, list[KVEvent]]:
        """`kv_events_since` as Python records (in-process readers)."""
        self._take_events()
        deadline = time.monotonic() + wait_s
        # Wait on until a step has produced events: most decode steps fill no block, and answering
        # each with nothing cost the ingress and this actor a wake-up per token.
        while cursor >= self._log_start + len(self._log) and (left := deadline - time.monotonic()) > 0:
            if self.engine is None:                 # asleep: no step will come before the wait ends
                await asyncio.sleep(left)
            else:
                await self.engine.wait_for_step(left)
            self._take_events()
        return self._events_after(cursor)

    def _take_events(self) -> bool:
        """Move the engine's new KV events onto the log (bounded: its oldest half goes when full);
        whether there were any."""
        return self.engine is not None and self._take_events_from(self.engine)

    def _take_events_from(self, engine: AsyncLLMEngine) -> bool:
        new = engine.take_kv_events()
        self._log.extend(new)
        if len(self._log) > MAX_EVENT_LOG:
            drop = len(self._log) - MAX_EVENT_LOG // 2
            del self._log[:drop]
            self._log_start += drop
        return bool(new)

    def _events_after(self, cursor: int) -> tuple[int, list[KVEvent]]:
        """The log's end cursor and its events after `cursor` (a snapshot for one fallen off the log)."""
        end = self._log_start + len(self._log)
        if cursor < self._log_start:
            return end, (self.engine.engine.kv_cache_manager.block_pool.snapshot() if self.engine is not None
                         else [AllCleared()])
        return end, self._log[cursor - self._log_start:]

    def _stepped(self) -> None:
        """After an engine step: wake the channels that follow KV events if it produced any."""
        if self._take_events():
            for box in self._outboxes.values():
                if box.kv_cursor is not None:
                    box.ready.set()
