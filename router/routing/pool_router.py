"""RequestRouter: routing within one engine pool, and what a request's stream meets on its way.

The prefix-aware policy picks the replica that already holds the longest run of the prompt's
leading blocks unless load says otherwise. Colocated mode is one such router over a pool of full
engines; router/routing/pd.py puts one over each pool of the prefill/decode split.

Tokens come back over one output channel per replica (router/routing/channel.py): every engine step's
deltas for all of this router's requests on a replica arrive as one message. A replica lost under a
stream has the stream migrate to another replica of the pool (`RequestRouter.generate`).

The router keeps its per-replica view fresh in the background once started: each replica's KV
events arrive on its output channel (router/routing/replica_channels.py), and stats every
`stats_interval_s`; in-flight counts are its own. A router not started (tools, tests) reads the
events when told (`sync_events`).
"""
from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any

from ray.exceptions import ActorUnavailableError, ObjectLostError, RayActorError

from records.deltas import StepDelta
from records.engine_stats import ReplicaStats
from records.errors import EngineDeadError, NoReplicaError, ReplicaDiedError
from records.hashing import hash_block_tokens
from records.request import Continuation
from records.sampling_params import SamplingParams
from router.routing.metrics import ServingMetrics
from router.routing.policy import Decision, Loads, RoutingPolicy
from router.routing.prefix_index import PrefixIndex
from router.routing.replica_channels import ReplicaChannels
from router.routing.request_trace import RequestTrace

# LoRA adapters the router remembers per replica (the most recently routed there): the engine's
# default max_loras, so that a replica "holds" what would fit its slots.
ADAPTERS_REMEMBERED = 8

logger = logging.getLogger(__name__)


class RequestRouter:
    def __init__(self, pool: str, replicas: dict[str, Any], block_size: int, policy: RoutingPolicy,
                 metrics: ServingMetrics, stats_interval_s: float = 0.5,
                 on_replica_failure: Callable[[str], None] | None = None, max_migrations: int = 3,
                 min_peer_pull_tokens: int | None = None, channel: str = "tcp") -> None:
        """replicas: replica id -> Ray actor handle of an EngineReplica; on_replica_failure: called
        with a replica's id when a call to it failed because its actor is gone (the ingress tells the
        manager, which replaces it); max_migrations: how many times one stream may move to another
        replica when its own is lost (`generate`); min_peer_pull_tokens: prefix tokens another
        replica must hold beyond the chosen one's for it to pull them from that peer (None: never;
        the replicas need a KV connector); channel: how its output channels travel
        (records/serving.py: CHANNEL_TRANSPORTS)."""
        self.pool = pool
        self.max_migrations = max_migrations
        self.min_peer_pull_tokens = min_peer_pull_tokens
        self.replicas: dict[str, Any] = {}
        self.block_size = block_size
        self.policy = policy
        self.metrics = metrics
        metrics.routing.migrations.inc(0, pool=pool)        # exported at 0 from the start (dashboards, alerts)
        self.stats_interval_s = stats_interval_s
        self.on_replica_failure = on_replica_failure
        self.index = PrefixIndex()
        self.loads = Loads(max_num_seqs=policy.max_num_seqs)
        # LoRA adapters routed to each replica lately, least recent first (their cache keys; the
        # replicas keep more than this in host memory, so this errs on the side of "not held").
        self.adapters: dict[str, OrderedDict[tuple, None]] = {}
        self.down: set[str] = set()          # failed a call; not routed to until membership drops it
        self._available: list[str] | None = None     # `available`, until the membership or `down` changes
        self._available_down = 0
        # This router's output channels, one per replica (opened on the first request to it, or
        # when started), and the KV events they bring.
        self.channels = ReplicaChannels(pool, self.replicas, self.index, metrics, self.mark_down, channel)
        self._stats_task: asyncio.Task | None = None
        self.set_replicas(replicas)

    def set_replicas(self, replicas: dict[str, Any]) -> None:
        """Follow the pool's membership: forget replicas that left (their index, load and channel)
        and start following new ones. The channel of one that left while streams run on it (a
        replica draining) stays open until they end."""
        self._available = None
        for r in [r for r in self.replicas if r not in replicas]:
            load = self.loads.pop(r)
            del self.replicas[r], self.adapters[r]
            self.index.remove_replica(r)
            self.down.discard(r)
            self.metrics.engines.drop(self.pool, r)
            self.channels.removed(r, busy=load.in_flight > 0)
        for r, handle in replicas.items():
            if r in self.replicas:
                continue
            self.replicas[r] = handle
            self.loads.add(r)
            self.adapters[r] = OrderedDict()
            self.index.add_replica(r)
            self.channels.added(r)

    @property
    def available(self) -> list[str]:
        """The replicas requests may go to (not down), in membership order."""
        if self._available is None or self._available_down != len(self.down):
            self._available = [r for r in self.replicas if r not in self.down]
            self._available_down = len(self.down)
        return self._available

    def mark_down(self, replica_id: str, error: BaseException) -> None:
        if replica_id in self.down or replica_id not in self.replicas:
            return
        logger.warning("%s replica %s failed a call (%s): not routing to it", self.pool, replica_id,
                       type(error).__name__)
        self.down.add(replica_id)
        self._available = None
        self.metrics.requests.errors.inc(code=f"replica_down_{self.pool}")
        if self.on_replica_failure is not None:
            self.on_replica_failure(replica_id)

    # --- background view of the replicas -----------------------------------------------------------
    def start(self) -> None:
        """Start the background view: every replica's channel (its KV events), and stats polls."""
        if self._stats_task is not None:
            return
        self._stats_task = asyncio.get_running_loop().create_task(self._poll_stats())
        self.channels.follow()

    async def _poll_stats(self) -> None:
        while True:
            try:
                await self.refresh_stats()
            except Exception:
                logger.exception("polling replica stats failed")
            await asyncio.sleep(self.stats_interval_s)

    async def sync_events(self) -> None:
        """Apply every replica's new KV events to the prefix index (a router not started; a
        started one's channels bring them)."""
        await self.channels.sync_events()

    async def refresh_stats(self) -> dict[str, ReplicaStats]:
        """Poll replica stats (KV usage feeds the policy) and publish them as metrics."""
        ids = list(self.replicas)
        results = await asyncio.gather(*[self.replicas[r].stats.remote() for r in ids], return_exceptions=True)
        out = {}
        for r, res in zip(ids, results):
            if isinstance(res, RayActorError) and not isinstance(res, ActorUnavailableError):
                self.mark_down(r, res)
            if isinstance(res, BaseException) or r not in self.replicas:
                continue
            out[r] = res
            self.loads[r].kv_usage = res.engine.kv_cache_usage_perc
            self.metrics.engines.set_stats(self.pool, r, res.engine)
        return out

    # --- one request -------------------------------------------------------------------------------
    def block_hashes(self, prompt_token_ids: list[int], params: SamplingParams, images: tuple = ()) -> list[bytes]:
        """The prompt's full blocks' hashes, as this pool's engines compute them (a block holding an
        image's tokens keyed by the image: records/multimodal.py)."""
        return hash_block_tokens(prompt_token_ids, self.block_size, params.cache_keys,
                                 items=tuple(image.key for image in images))

    def route(self, prompt_token_ids: list[int], params: SamplingParams, trace: RequestTrace | None = None,
              hashes: list[bytes] | None = None, images: tuple = ()) -> Decision:
        """Choose the replica for a prompt (the policy over the prefix index, loads, adapters, tiers;
        a peer to pull a prefix from). `trace`: the request's, given a span of the decision;
        `hashes`: the prompt's `block_hashes`, when the caller has them; `images`: the prompt's."""
        began = time.monotonic()
        candidates = self.available
        if not candidates:
            raise NoReplicaError(f"no {self.pool} engine replica is available"
                                 + (f" ({len(self.down)} failed, being replaced)" if self.down else ""))
        if hashes is None:
            hashes = self.block_hashes(prompt_token_ids, params, images)
        lora = params.lora_request
        held = None if lora is None else {r for r in candidates if lora.cache_key in self.adapters[r]}
        tiers = {}
        if self.index.has_tiers():
            matched, default = self.index.match(hashes), 0
            tiers = self.index.match_tiers(hashes, matched)
        else:       # the replicas whose run differs from most replicas' (a few of hundreds)
            matched, default = self.index.match_sparse(hashes)
        decision = self.policy.choose(matched, len(hashes), self.loads, self.index.num_blocks_of, held, tiers,
                                      candidates, default)
        decision.block_hashes = hashes
        if self.min_peer_pull_tokens is not None and params.n == 1 and params.prompt_logprobs is None:
            decision.peer = self._peer_for(decision, {r: matched.get(r, default) + tiers.get(r, 0)
                                                      for r in candidates}, hashes)
        if lora is not None:
            recent = self.adapters[decision.replica_id]
            recent[lora.cache_key] = None
            recent.move_to_end(lora.cache_key)
            while len(recent) > ADAPTERS_REMEMBERED:
                recent.popitem(last=False)
        self.metrics.routing.decisions.inc(reason=decision.reason, pool=self.pool)
        self.metrics.routing.prefix_hit_tokens.observe(decision.matched_blocks * self.block_size, pool=self.pool)
        if trace is not None:
            trace.routed(self.pool, decision, began, self.block_size)
        return decision

    def _peer_for(self, decision: Decision, held: dict[str, int], hashes: list[bytes]
                  ) -> tuple[str, list[bytes]] | None:
        """The replica holding the longest run of the prompt's blocks (`held`: in its pool, then its
        tier, which it loads back before leasing), when that is at least `min_peer_pull_tokens`
        more than the chosen replica holds: the chosen one pulls them rather than computing them
        (the peer stays free for its own work)."""
        mine = held.pop(decision.replica_id, 0)
        best = max(held, key=lambda r: held[r], default=None)
        if best is None or (held[best] - mine) * self.block_size < (self.min_peer_pull_tokens or 0):
            return None
        return best, hashes[:held[best]]

    async def _lease_from_peer(self, decision: Decision, params: SamplingParams) -> dict | None:
        """Ask the decision's peer to lease its prefix blocks; their kv_transfer_params, or None
        (then the chosen replica computes the prompt, as without peers)."""
        assert decision.peer is not None
        peer, hashes = decision.peer
        handle = self.replicas.get(peer)
        if handle is None:
            return None
        try:
            kv_params = await handle.lease_prefix.remote(hashes, params.adapter_name)
        except Exception as e:  # noqa: BLE001 - a peer that cannot answer only costs the pull
            if replica_lost(e):
                self.mark_down(peer, e)
            self.metrics.routing.peer_pulls.inc(pool=self.pool, outcome="failed")
            return None
        if kv_params is None:
            self.metrics.routing.peer_pulls.inc(pool=self.pool, outcome="missed")
            return None
        self.metrics.routing.peer_pulls.inc(pool=self.pool, outcome="leased")
        self.metrics.routing.peer_pull_blocks.inc(len(kv_params["remote_block_ids"]), pool=self.pool)
        return kv_params

    def uncached_tokens(self, num_prompt_tokens: int, decision: Decision) -> int:
        """Prompt tokens the chosen replica would compute (those past its prefix-cache and tier hits)."""
        return max(0, num_prompt_tokens - (decision.matched_blocks + decision.tier_blocks) * self.block_size)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       decision: Decision | None = None, kv_transfer_params: dict | None = None,
                       prefill_tokens: int | None = None, trace: RequestTrace | None = None,
                       arrival: float | None = None, images: tuple = ()) -> AsyncIterator[StepDelta]:
        """Stream the chosen replica's StepDeltas (routing first unless `decision` is given). If the
        consumer stops early (client disconnect), the request is aborted on the replica, which
        frees its blocks. `prefill_tokens`: the prompt tokens the replica computes before the first
        token (default: those past its cache hit), counted in its backlog until then
        (`ReplicaLoad.prefill_tokens`).

        A replica lost under the request (its actor or node died, its engine stopped): if it had
        streamed nothing, the request goes to another replica as it was. Mid-stream, the stream
        migrates, up to `max_migrations` times: another replica resumes it after the tokens already
        streamed (records/request.py: Continuation; it computes the prompt and those tokens itself,
        from its prefix cache where it holds them) and the consumer reads on, one stream. Past the
        limit, with no replica left, or for a stream that cannot resume (n > 1, prompt logprobs
        partly streamed) it ends with ReplicaDiedError naming the replica. `trace`: the request's
        (router/routing/request_trace.py): its decisions get spans, and the replica its carrier.
        `arrival` (time.monotonic(); default now): where its time to first token and end-to-end
        latency start. `images`: the prompt's (records/multimodal.py), sent with it wherever it runs."""
        decision = decision or self.route(prompt_token_ids, params, trace, images=images)
        carrier = trace.carrier() if trace is not None else None
        peer_lease = None
        if decision.peer is not None and not (kv_transfer_params or {}).get("do_remote_prefill"):
            leased = await self._lease_from_peer(decision, params)
            if leased is not None:         # a prefill for a decode replica pulls its prefix too
                peer_lease = (decision.peer[0], leased)
                kv_transfer_params = leased if kv_transfer_params is None else {**kv_transfer_params,
                                                                                "peer_prefix": leased}
        progress = _Progress()
        started = time.monotonic() if arrival is None else arrival
        try:
            while True:
                continuation = progress.continuation()
                if continuation is not None:
                    backlog = self.uncached_tokens(len(prompt_token_ids) + len(continuation.token_ids), decision)
                elif prefill_tokens is None:
                    backlog = self.uncached_tokens(len(prompt_token_ids), decision)
                else:
                    backlog = prefill_tokens
                if trace is not None:
                    trace.ran_on(decision.replica_id)
                try:
                    async for delta in self._stream(decision, request_id, prompt_token_ids, params,
                                                    kv_transfer_params, backlog, continuation, started, carrier,
                                                    images):
                        progress.add(delta)
                        # The resuming replica's cache hit covers tokens the client already has.
                        yield delta if continuation is None else dataclasses.replace(delta, num_cached_tokens=0)
                    return
                except Exception as e:
                    if not replica_lost(e):
                        raise
                    self.mark_down(decision.replica_id, e)
                    lost = decision.replica_id
                if not progress.streamed:       # NoReplicaError when none is left
                    decision = self.route(prompt_token_ids, params, trace, images=images)
                    continue
                decision, params = self._migrate(request_id, lost, prompt_token_ids, params, progress, trace,
                                                 images)
                kv_transfer_params = None           # the resuming replica computes the prompt itself
        except BaseException:
            if peer_lease is not None:          # the replica may never have taken it (see end_lease)
                self.end_lease(*peer_lease)
            raise

    def end_lease(self, replica_id: str, kv_transfer_params: dict) -> None:
        """End the lease that `kv_transfer_params` (what the replica returned when it leased) names
        on `replica_id`, its holder: the request it was for ended before, or without, the replica it
        was for releasing it (a client gone between the two hops), and the holder would keep the
        blocks until the lease expired (`kv_lease_s`). An abort of the lease's id ends it there; one
        already released is not found, and nothing happens."""
        handle = self.replicas.get(replica_id)
        if handle is not None:          # sent outside the cancelled request's context (channel.py)
            contextvars.Context().run(handle.abort.remote, kv_transfer_params["remote_request_id"])

    def _migrate(self, request_id: str, lost: str, prompt_token_ids: list[int], params: SamplingParams,
                 progress: _Progress, trace: RequestTrace | None = None, images: tuple = ()
                 ) -> tuple[Decision, SamplingParams]:
        """Where a stream whose replica was lost goes on, and the params it resumes with; raises
        ReplicaDiedError when it cannot (the reason counted in the metrics)."""
        def fail(reason: str, why: str) -> ReplicaDiedError:
            self.metrics.routing.migration_failures.inc(pool=self.pool, reason=reason)
            return ReplicaDiedError(f"{self.pool} engine replica {lost} died while running request "
                                    f"{request_id}{why}; retry the request")

        if params.n != 1 or (progress.prompt_logprobs and not progress.token_ids):
            raise fail("not_migratable", " (a stream with n > 1 or prompt logprobs under way cannot move)")
        if progress.migrations >= self.max_migrations:
            raise fail("limit", f" after {progress.migrations} migrations (routing.max_migrations)")
        if params.prompt_logprobs is not None:          # all streamed before the first token
            params = dataclasses.replace(params, prompt_logprobs=None)
        try:
            decision = self.route(prompt_token_ids + progress.token_ids, params, trace, images=images)
        except NoReplicaError:
            raise fail("no_replica", " and no other replica is available") from None
        progress.migrations += 1
        self.metrics.routing.migrations.inc(pool=self.pool)
        logger.warning("%s request %s: replica %s lost after %d tokens; resuming on %s", self.pool, request_id,
                       lost, len(progress.token_ids), decision.replica_id)
        return decision, params

    async def _stream(self, decision: Decision, request_id: str, prompt_token_ids: list[int],
                      params: SamplingParams, kv_transfer_params: dict | None, prefill_tokens: int = 0,
                      continuation: Continuation | None = None, started: float | None = None,
                      carrier: dict[str, str] | None = None, images: tuple = ()) -> AsyncIterator[StepDelta]:
        replica_id = decision.replica_id
        channel = self.channels.get(replica_id)
        load = self.loads[replica_id]
        load.started(prefill_tokens)
        start = time.monotonic() if started is None else started
        # A resumed stream's first token is not the request's (its time to first token went out).
        last = None if continuation is None else time.monotonic()
        finished = False
        try:
            async for delta in channel.stream(request_id, prompt_token_ids, params, kv_transfer_params,
                                              continuation, carrier, decision.block_hashes, images):
                now = time.monotonic()
                new_tokens = sum(len(c.token_ids) for c in delta.choices)
                if new_tokens or delta.finished:
                    load.prefilled(prefill_tokens)      # its prompt is done
                    prefill_tokens = 0
                if new_tokens:
                    if last is None:
                        self.metrics.requests.ttft.observe(now - start, pool=self.pool, replica=replica_id)
                    else:
                        self.metrics.requests.itl.observe(now - last, pool=self.pool, replica=replica_id)
                    last = now
                finished = delta.finished
                yield delta
            if finished:
                self.metrics.requests.e2e.observe(time.monotonic() - start, pool=self.pool, replica=replica_id)
        finally:
            load.ended()
            load.prefilled(prefill_tokens)
            if load.in_flight == 0:
                self.channels.released(replica_id)

    def stop(self) -> None:
        if self._stats_task is not None:
            self._stats_task.cancel()
        self.channels.close()
        self._stats_task = None


def replica_lost(error: BaseException) -> bool:
    """Whether a request failed because its replica is gone (its actor or node died, its output
    channel broke, its engine stopped), rather than for something of the request's own."""
    return isinstance(error, (RayActorError, ObjectLostError, EngineDeadError, ConnectionError))


@dataclasses.dataclass
class _Progress:
    """What the consumer of one stream has had so far (its first choice): what a migration resumes."""
    streamed: bool = False
    token_ids: list[int] = dataclasses.field(default_factory=list)
    num_chars: int = 0
    prompt_logprobs: bool = False
    migrations: int = 0

    def add(self, delta: StepDelta) -> None:
        self.streamed = True
        self.prompt_logprobs = self.prompt_logprobs or bool(delta.prompt_logprobs)
        for c in delta.choices:
            if c.index == 0:
                self.token_ids += c.token_ids
                self.num_chars += len(c.text)

    def continuation(self) -> Continuation | None:
        return Continuation(tuple(self.token_ids), self.num_chars) if self.token_ids else None
