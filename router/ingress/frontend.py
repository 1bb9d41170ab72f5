"""The protocol-neutral frontend: what the HTTP API (router/ingress/openai_api.py) and the gRPC service
(router/ingress/grpc_api.py) share, so that neither copies the other.

`Frontend` holds the request preparer (router/ingress/preparer.py: parsing, validation, the chat
template, tokenization, one `Prepared` record out), the routers of the pools, admission and
metrics. It checks the API key, admits (tickets that every exit path releases:
router/ingress/admission.py), fans a request's prompts out to the router and merges their deltas
(`run`), follows the pools' membership and answers health and metrics. A request's failure while
it runs becomes a `PDServeError` here (`served_error`), so each protocol only maps those errors'
attributes to its own status.
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import re
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

from ray.exceptions import TaskCancelledError

import engine.tracing as tracing
from engine.beam_search import BeamSearch, Hypothesis, deliver, pending
from records.deltas import StepDelta
from records.errors import (
    AuthenticationError,
    ClientClosedError,
    InvalidRequestError,
    NoReplicaError,
    NotFoundError,
    PDServeError,
    RateLimitError,
    RequestFailedError,
    ServiceUnavailableError,
)
from records.sampling_params import SamplingParams
from records.serving import IngressSpec
from router.ingress.admission import Admission, Ticket
from router.ingress.cold_model import WAKE_RETRIES, ColdModel, replica_asleep
from router.ingress.preparer import RequestPreparer
from router.ingress.tenants import Tenant, Tenants
from router.routing.metrics import ServingMetrics
from router.routing.model_routers import ModelRouters
from router.routing.request_trace import ARRIVAL, CURRENT, RequestTrace, log_requests_to_stderr

logger = logging.getLogger(__name__)


def served_error(error: BaseException) -> PDServeError:
    """The error a failed request answers with (its stream, once started, carries it in-band)."""
    if isinstance(error, PDServeError):
        return error
    if isinstance(error, TaskCancelledError):
        # Serve cancelled the request's task: its client went away (no server fault, no traceback).
        return ClientClosedError("the client closed the connection")
    cause = getattr(error, "cause", None)      # a Ray task error: what the replica raised
    if isinstance(cause, PDServeError):
        return cause
    logger.error("request failed", exc_info=error)
    return RequestFailedError(f"generation failed: {type(cause or error).__name__}: {cause or error}")


class Frontend:
    """Everything the ingress does that does not depend on the protocol or on how it is deployed,
    once a request is prepared (`preparer`, router/ingress/preparer.py): the API key, admission,
    running a request's prompts through the routers, metrics, health and the pools' membership."""

    def __init__(self, config: IngressSpec, replicas: dict[str, Any] | None = None,
                 prefill_replicas: dict[str, Any] | None = None, manager: Any = None) -> None:
        """replicas: the decode pool's actor handles; prefill_replicas: the prefill pool's (only in
        disaggregated mode); manager: the ClusterManager's handle, told about replicas that fail
        and followed for the pools' membership (`follow_membership`). Without replicas the server
        is starting: `attach()` gives it the pools once they are up."""
        self.config = config
        tracing.configure(config.serving.otlp_traces_endpoint, "ingress")
        if config.serving.log_requests:
            log_requests_to_stderr()
        self.preparer = RequestPreparer(config)
        info = self.preparer.info
        self.metrics = ServingMetrics(info.max_model_len)
        self.manager = manager
        report = lambda replica_id: self.manager.report_failure.remote(replica_id)  # noqa: E731
        self.routers = ModelRouters.of(config, info, self.metrics, replicas, prefill_replicas,
                                       report if manager is not None else None)
        self.pools, self.router, self.encode = self.routers.pools, self.routers.router, self.routers.encode
        decode = self.pools["decode"]
        # Requests queue at this ingress beyond what the decode pool is given at once (admission.py).
        self.tenants = Tenants(config.serving)     # the API keys (ValueError naming a missing one)
        per_replica = config.serving.dispatch_per_replica or info.max_num_seqs
        reserve = config.serving.tenant_reserve if len(self.tenants.by_name) > 1 else 0.0
        self.admission = Admission(config.serving.max_in_flight, lambda n: self.metrics.requests.in_flight.set(n),
                                   lambda: per_replica * max(1, len(decode.replicas)), reserve,
                                   config.serving.batch_share)
        # None once serving; else why not yet ("starting: ...") or why never ("failed: ...").
        self.not_ready: str | None = None if replicas else "starting: the engine pools are loading"
        # Asleep or scaled to zero: requests wait for the model to be back (router/ingress/cold_model.py).
        self.cold = ColdModel(self._manager, lambda: self.in_flight, config.cold_start_timeout_s)

    def attach(self, manager: Any, pools: dict[str, dict[str, Any]]) -> None:
        """Start serving: the manager and the pools' replicas (pool -> replica id -> handle)."""
        self.manager = manager
        for name, router in self.pools.items():
            router.on_replica_failure = lambda replica_id: self.manager.report_failure.remote(replica_id)
            router.set_replicas(pools.get(name, {}))
        self.routers.start()
        self.not_ready = None

    @property
    def in_flight(self) -> int:
        return self.admission.in_flight

    # --- checks ------------------------------------------------------------------------------------
    def is_authorized(self, authorization: str) -> bool:
        """Whether an `Authorization` header (or gRPC metadata) value carries a tenant's API key."""
        return self.tenants.resolve(authorization) is not None

    def check_key(self, authorization: str, where: str = "Authorization: Bearer <key>") -> Tenant:
        """The tenant whose key `authorization` carries; AuthenticationError when none does."""
        tenant = self.tenants.resolve(authorization)
        if tenant is None:
            raise AuthenticationError(f"invalid or missing API key ({where})")
        return tenant

    def tenant_of(self, headers: Mapping[str, str]) -> Tenant:
        """The tenant an HTTP request's key names (the key middleware let only those through)."""
        return self.check_key(headers.get("authorization", ""))

    async def admit(self, prompts: list[list[int]], params: SamplingParams, tenant: Tenant | None = None,
                    band: int | None = None) -> Ticket:
        """Admit a request's prompts for `tenant` (default: the one whose key the call carries,
        `observe`) and wait for their turn in the fair queue: a ticket to release when they end;
        else ServiceUnavailableError or RateLimitError (its `retry_after` for the Retry-After header)."""
        tenant = tenant or TENANT.get() or self.check_key("")
        if tenant.models is not None and tenant.models.isdisjoint(self.preparer.model_names):
            raise NotFoundError(f"model {self.preparer.model_name!r} is not available to tenant {tenant.name!r}; "
                                f"it may use {sorted(tenant.models)}", "model")
        if self.not_ready is not None:
            raise ServiceUnavailableError(f"the server is not ready ({self.not_ready})")
        if not self.router.replicas:
            if not self.cold.scales_to_zero:
                raise NoReplicaError("no engine replica is available")
            pools = await self.cold.activate()      # held, not failed: the model starts first
            for name, router in self.pools.items():
                router.set_replicas(pools.get(name, {}))
        if self.cold.asleep:        # held, not failed: the model wakes first
            await self.cold.wake()
        band = band if band is not None else BAND.get()
        trace = CURRENT.get()
        began = time.monotonic()
        if trace is not None:
            trace.child("pdserve.prepare", trace.start, began)
        tokens = sum(len(p) for p in prompts)
        try:
            if tenant.allowance is not None:        # limits shared by the ingress replicas
                await tenant.allowance.reserve(len(prompts), tokens)
            try:
                ticket = self.admission.admit(tenant, len(prompts), tokens, params.priority, band)
            except RateLimitError:
                if tenant.allowance is not None:
                    tenant.allowance.refund(len(prompts), tokens)
                raise
            self.metrics.tenants.requests.inc(tenant=tenant.name, outcome="admitted")
            self.metrics.tenants.tokens.inc(tokens, tenant=tenant.name, kind="prompt")
            await self.admission.wait(ticket)
        except RateLimitError as e:
            self.metrics.tenants.requests.inc(tenant=tenant.name, outcome=f"rejected_{e.limit}")
            if trace is not None:
                trace.child("pdserve.admission", began, attributes={"pdserve.in_flight": self.in_flight,
                                                                     "pdserve.admitted": False})
            raise
        self.metrics.tenants.queue_time.observe(ticket.queued_s, tenant=tenant.name)
        if trace is not None:
            trace.child("pdserve.admission", began, attributes={
                "pdserve.in_flight": self.in_flight, "pdserve.admitted": True, "pdserve.tenant": tenant.name,
                "pdserve.queued_s": ticket.queued_s})
        ticket.arrival = ARRIVAL.get()
        if trace is not None:
            ticket.trace = trace
            trace.hold()
        return ticket

    @contextlib.contextmanager
    def observe(self, headers: Mapping[str, str], route: str) -> Iterator[RequestTrace | None]:
        """Around one API call: its RequestTrace (router/routing/request_trace.py) when tracing is
        on or requests are logged, else None. `headers`: the HTTP headers or gRPC metadata (the
        client's `traceparent`)."""
        arrived = ARRIVAL.set(time.monotonic())    # where its latencies start (`run`)
        tenant = TENANT.set(self.tenants.resolve(headers.get("authorization")))
        serving = self.config.serving
        if not tracing.enabled() and not serving.log_requests:
            try:
                yield None
            finally:
                _reset(ARRIVAL, arrived)
                _reset(TENANT, tenant)
            return
        tokenizer = self.preparer.tokenizer
        describe = tokenizer.decode if serving.log_request_prompts and tokenizer is not None else None
        trace = RequestTrace(route, tracing.carrier_from(headers), serving.log_requests, describe)
        token = CURRENT.set(trace)
        try:
            yield trace
        except BaseException as e:
            trace.failed(served_error(e) if isinstance(e, Exception) else e)
            raise
        finally:
            _reset(CURRENT, token)
            _reset(ARRIVAL, arrived)
            _reset(TENANT, tenant)
            trace.release()

    # --- generation --------------------------------------------------------------------------------
    async def run(self, prompts: list[list[int]], params: SamplingParams, request_id: str, ticket: Ticket,
                  images: tuple = (), response_id: str | None = None) -> AsyncIterator[tuple[int, StepDelta]]:
        """Stream (prompt index, StepDelta) over all prompts of one HTTP request; releases `ticket`
        when it ends, however it ends. One prompt (a chat, most completions) streams straight from
        its router; several are merged through one queue, each pumped by a task of its own.
        `images`: a one-prompt request's images (a chat's: records/multimodal.py); `response_id`: the
        id the client sees (traces and request logs name it), where it is not `request_id`, the engine's."""
        # Its time to first token counts from its arrival at the endpoint (`observe`), every hop included.
        arrival = ticket.arrival if ticket.arrival is not None else time.monotonic()
        trace = ticket.trace
        if trace is not None:
            trace.started(response_id or request_id, prompts, self.preparer.model_name, params.adapter_name or None)
        try:
            if len(prompts) == 1:
                try:
                    # (closed when this stream is: a consumer that stops early aborts it on its replica)
                    async with contextlib.aclosing(self._prompt(f"{request_id}-0", prompts[0], params, ticket,
                                                                arrival, images)) as deltas:
                        async for delta in deltas:
                            yield 0, delta
                except Exception as e:  # noqa: BLE001 - as the client gets it
                    raise self._failed(e, trace) from None
            else:
                async for i, delta in self._merged(prompts, params, request_id, ticket, arrival):
                    yield i, delta
        finally:
            # Nothing here may come after an await: a cancelled request is cancelled again at each.
            self.metrics.tenants.tokens.inc(ticket.generated, tenant=ticket.tenant.name, kind="generation")
            ticket.release()

    async def _prompt(self, request_id: str, ids: list[int], params: SamplingParams, ticket: Ticket,
                      arrival: float, images: tuple = ()) -> AsyncIterator[StepDelta]:
        """One prompt's deltas from its router, charged to the ticket; a replica put to sleep since
        this ingress last looked wakes the model, and the prompt is sent again."""
        trace = ticket.trace
        if images and self.encode is not None:
            images = await self.encode.encode(images, trace)
        for attempt in range(WAKE_RETRIES + 1):
            streamed = False
            try:
                async with contextlib.aclosing(self.router.generate(request_id, ids, params, trace=trace,
                                                                    arrival=arrival, images=images)) as deltas:
                    async for delta in deltas:
                        streamed = True
                        if trace is not None:
                            trace.delta(delta)
                        ticket.charge(sum(len(c.token_ids) for c in delta.choices))
                        yield delta
                return
            except Exception as e:
                if streamed or attempt == WAKE_RETRIES or not replica_asleep(e):
                    raise
                self.cold.asleep = True
                await self.cold.wake()

    async def _merged(self, prompts: list[list[int]], params: SamplingParams, request_id: str, ticket: Ticket,
                      arrival: float) -> AsyncIterator[tuple[int, StepDelta]]:
        """Several prompts at once, their deltas in the order they come."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, ids: list[int]) -> None:
            try:
                async for delta in self._prompt(f"{request_id}-{i}", ids, params, ticket, arrival):
                    queue.put_nowait((i, delta))
            except Exception as e:  # noqa: BLE001 - surfaced to the consumer below
                queue.put_nowait((i, e))
            finally:
                queue.put_nowait((i, None))

        tasks = [asyncio.create_task(pump(i, ids)) for i, ids in enumerate(prompts)]
        remaining = len(tasks)
        try:
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                    continue
                if isinstance(item, BaseException):
                    raise self._failed(item, ticket.trace) from None
                yield i, item
        finally:
            for t in tasks:                 # a disconnect cancels the pumps, which abort on the replicas
                t.cancel()

    @staticmethod
    def _failed(error: BaseException, trace: RequestTrace | None) -> PDServeError:
        served = served_error(error)
        if trace is not None:
            trace.failed(served)
        return served

    async def beam_search(self, prompts: list[list[int]], params: SamplingParams, request_id: str,
                          ticket: Ticket) -> list[list[Hypothesis]]:
        """Beam search over each prompt (engine/beam_search.py): each step, every live beam is scored
        as a one-token request through the router (prefix-aware routing keeps a prompt's beams on the
        replica holding its blocks); the best n beams of each prompt. Releases `ticket` at the end."""
        try:
            searches = [(ids, BeamSearch(params, self.preparer.eos_token_ids, len(ids), self.preparer.max_model_len))
                        for ids in prompts]
            step = 0
            while True:
                batch, owners = pending(searches, [params] * len(searches))
                if not batch:
                    return [search.results() for _, search in searches]
                tops = await asyncio.gather(*(self._score(f"{request_id}-{step}-{j}", ids, p, ticket)
                                              for j, (ids, p) in enumerate(batch)))
                deliver(owners, list(tops))
                step += 1
        finally:
            ticket.release()

    async def _score(self, request_id: str, ids: list[int], params: SamplingParams, ticket: Ticket
                     ) -> dict[int, float]:
        """One beam's next-token top logprobs."""
        top: dict[int, float] = {}
        async for delta in self.router.generate(request_id, ids, params, trace=ticket.trace):
            for c in delta.choices:
                if c.logprobs:
                    top = {t: lp.logprob for t, lp in c.logprobs[-1].items()}
        if not top:
            raise RequestFailedError("a beam's step returned no logprobs")
        return top

    def count_finished(self, reason: str | None) -> None:
        self.metrics.requests.finished.inc(finished_reason=reason or "abort")

    async def health(self) -> tuple[bool, dict[str, dict[str, bool]]]:
        """Ready when every pool has at least one healthy replica; pool -> replica id -> healthy."""
        stats = await self.router.refresh_stats()
        detail = {name: {r: r in stats and stats[r].healthy and r not in pool.down
                         for r in pool.replicas} for name, pool in self.pools.items()}
        if self.cold.scales_to_zero and not self.router.replicas:      # at zero by design: a request
            return True, detail                                          # brings it back
        return all(any(replicas.values()) for replicas in detail.values()), detail

    async def follow_membership(self) -> None:
        """Keep each pool's router in line with the manager's pools (long poll): replicas dropped
        for failing health checks leave, replacements join."""
        version = -1
        while True:
            try:
                version, pools = await self.manager.membership.remote(version, 5.0)
            except Exception:
                logger.exception("following the pools' membership failed")
                await asyncio.sleep(1.0)
                continue
            for name, replicas in pools.items():
                if name in self.pools:
                    self.pools[name].set_replicas(replicas)

    # --- the admin API (behind the API key, as every path but /health) ----------------------------
    async def admin_status(self) -> dict[str, Any]:
        """What `pdserve status --json` prints: the spec's fingerprint, the pools, every replica,
        and this ingress replica's `observability()`."""
        return {**await self._manager().describe.remote(), "ingress_observed": self.observability()}

    def observability(self) -> dict[str, Any]:
        """What this ingress replica saw: routing decisions by pool and reason, peer prefix pulls by
        outcome, requests in flight, and where its spans go (since it started)."""
        decisions: dict[str, dict[str, int]] = {}
        for key, value in self.metrics.routing.decisions.values.items():
            labels = dict(key)
            decisions.setdefault(labels.get("pool", ""), {})[labels.get("reason", "")] = int(value)
        pulls = {dict(k).get("outcome", ""): int(v) for k, v in self.metrics.routing.peer_pulls.values.items()}
        return {"routing_decisions": decisions, "peer_prefix_pulls": pulls, "requests_in_flight": self.in_flight,
                "otlp_traces_endpoint": tracing.endpoint(), "log_requests": self.config.serving.log_requests}

    async def admin_scale(self, body: dict[str, Any]) -> dict[str, Any]:
        """Resize a pool as `pdserve scale` does: {"pool", "replicas", "drain_timeout_s" (60)}."""
        pool, replicas, drain = body.get("pool"), body.get("replicas"), body.get("drain_timeout_s", 60.0)
        if not isinstance(pool, str) or pool not in self.pools:
            raise InvalidRequestError(f"pool must be one of {sorted(self.pools)}; got {pool!r}", param="pool")
        if not isinstance(replicas, int) or isinstance(replicas, bool):
            raise InvalidRequestError(f"replicas must be an integer; got {replicas!r}", param="replicas")
        if not isinstance(drain, (int, float)) or isinstance(drain, bool) or drain < 0:
            raise InvalidRequestError(f"drain_timeout_s must be a number >= 0; got {drain!r}",
                                      param="drain_timeout_s")
        try:
            return await self._manager().scale.remote(pool, replicas, float(drain))
        except Exception as e:
            cause = getattr(e, "cause", None) or e
            if isinstance(cause, ValueError):            # out of the pool's bounds
                raise InvalidRequestError(str(cause), param="replicas") from None
            raise

    def _manager(self) -> Any:
        if self.manager is None:
            raise ServiceUnavailableError(f"the engine pools are not attached ({self.not_ready or 'starting'})")
        return self.manager

    async def render_metrics(self) -> str:
        await self.router.refresh_stats()
        if self.manager is not None:
            try:
                self.metrics.pools.set_status(await asyncio.wait_for(self.manager.pool_status.remote(), 2.0))
            except Exception as e:  # noqa: BLE001 - a restarting manager: the last values stand
                logger.warning("the pools' status is unavailable: %s", type(e).__name__)
        queued = self.admission.queued_by_tenant()
        for name, tenant in self.tenants.by_name.items():
            self.metrics.tenants.running.set(tenant.running, tenant=name)
            self.metrics.tenants.queued.set(queued.get(name, 0), tenant=name)
        text = self.metrics.render()
        prefix = self.config.serving.metrics_prefix
        return text if prefix == "pdserve" else _METRIC_NAME.sub(rf"\g<1>{prefix}:", text)


def _reset(var: contextvars.ContextVar, token: contextvars.Token) -> None:
    """Reset a context variable, unless this runs in another context than the one that set it (a
    streaming generator finalized by the garbage collector's task): that context is gone anyway."""
    with contextlib.suppress(ValueError):
        var.reset(token)


# The tenant whose key the API call being served carries (`Frontend.observe`).
TENANT: contextvars.ContextVar[Tenant | None] = contextvars.ContextVar("pdserve_tenant", default=None)

# The band the API call being served runs in (None: its tenant's): the Batch API's runner sets it.
BAND: contextvars.ContextVar[int | None] = contextvars.ContextVar("pdserve_band", default=None)

# A metric's name where it starts a sample line or a HELP / TYPE comment.
_METRIC_NAME = re.compile(r"^((?:# (?:HELP|TYPE) )?)pdserve:", re.MULTILINE)
