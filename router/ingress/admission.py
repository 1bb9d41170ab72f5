"""Admission: which requests the ingress takes, and in what order it hands them to the pools.

A request is first *admitted*: its tenant's limits are checked (router/ingress/tenants.py: requests
and tokens per minute, requests at once) and the server's (`serving.max_in_flight` requests queued
or running); a refusal is a RateLimitError with the seconds to wait (429 and `Retry-After`). When
the server is full, a request of a tenant under its fair share pushes out the newest queued request
of the tenant furthest over its share (that one is answered 429), so a flood fills the server with
its own requests only. Admitted requests are then *dispatched* to the pools, at most
`dispatch_limit()` at once; the rest wait in a fair queue: by band (the tenant's priority; the
Batch API below every tenant), then, within a band, the tenant running the fewest requests for its
weight, then the one with the least service so far, divided by its weight (start-time fair
queuing: a tenant's virtual time never lags the band's, so idling banks no credit), then by the
request's own `priority` (vLLM's field: lower first) and arrival. With several tenants, no one
tenant is dispatched more than (1 - `reserve`) of the dispatch limit: the rest is kept for the
others, so that a light tenant's request starts at once while a heavy one floods, instead of after
one of the flood's requests ends (dispatch does not preempt). With one tenant this is a priority
queue in front of the pools, and nothing is reserved.

Every admitted request holds a `Ticket` until it ends. `Ticket.release()` is idempotent and is called
on every exit path: the end of a stream or of a response, an error, a client that disconnects before
or after the first byte (or while queued), a cancellation by Serve's proxy. It never awaits anything:
under anyio (which runs Starlette's responses) a cancelled task is cancelled again at every later
`await`, so a release placed after an `await` in a `finally` block is skipped, and the count leaks
(a client that drops hundreds of streams used to lock the server out with 429s). A ticket that is
dropped unreleased (a streaming body that never started) releases itself when it is garbage
collected.
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from records.errors import RateLimitError
from records.serving import BATCH_BAND
from router.ingress.tenants import Tenant

if TYPE_CHECKING:
    from router.routing.request_trace import RequestTrace


class Ticket:
    """`count` admitted requests of `tenant`; `release()` gives them back once, however often it is
    called. `queued_s`: how long they waited to be dispatched."""

    __slots__ = ("_admission", "arrival", "band", "count", "dispatched", "generated", "priority", "queued_s",
                 "seq", "tenant", "trace", "waiter")

    def __init__(self, admission: Admission, tenant: Tenant, count: int, band: int, priority: int, seq: int) -> None:
        self._admission: Admission | None = admission
        self.tenant, self.count, self.band, self.priority, self.seq = tenant, count, band, priority, seq
        self.dispatched = False
        self.waiter: asyncio.Future | None = None       # set while it waits in the queue
        self.queued_s = 0.0
        self.generated = 0          # tokens its requests have streamed
        self.trace: RequestTrace | None = None     # held until released (router/routing/request_trace.py)
        self.arrival: float | None = None          # when its request reached the endpoint (time.monotonic())

    def release(self) -> None:
        admission, self._admission = self._admission, None
        if admission is not None:
            admission._release(self)
            if self.trace is not None:
                self.trace.release()

    def charge(self, tokens: int) -> None:
        """Generated tokens, against the tenant's tokens per minute."""
        if tokens:
            self.generated += tokens
            self.tenant.charge(0, tokens)

    @property
    def released(self) -> bool:
        return self._admission is None

    def __lt__(self, other: Ticket) -> bool:
        # A tenant's queue: its band (its Batch API requests behind its interactive ones, which they
        # must not hold up), then the request's own priority, then arrival.
        return (self.band, self.priority, self.seq) < (other.band, other.priority, other.seq)

    def __del__(self) -> None:
        self.release()


class Admission:
    """At most `limit` requests admitted and `dispatch_limit()` dispatched; `on_change(in_flight)`
    is told every change of the admitted count (a gauge)."""

    def __init__(self, limit: int, on_change: Callable[[int], None] = lambda _: None,
                 dispatch_limit: Callable[[], int] = lambda: 1 << 30, reserve: float = 0.0,
                 batch_share: float = 1.0) -> None:
        self.limit = limit
        self.dispatch_limit = dispatch_limit
        self.reserve = reserve      # the share of the dispatch limit no one tenant may hold
        self.batch_share = batch_share      # the most of it the Batch API's band may hold
        self.in_flight = 0          # admitted: queued or dispatched
        self.running = 0            # dispatched
        self.on_change = on_change
        self._queues: dict[Tenant, list[Ticket]] = {}     # tenant -> its queued tickets (a heap)
        self._band_vtime: dict[int, float] = {}
        self._seq = itertools.count()

    @property
    def queued(self) -> int:
        return self.in_flight - self.running

    def admit(self, tenant: Tenant, count: int, prompt_tokens: int = 0, priority: int = 0,
              band: int | None = None) -> Ticket:
        """Admit `count` requests of `tenant` (prompt tokens charged now): a ticket, dispatched at
        once or queued (await `wait(ticket)`); RateLimitError (with `retry_after`) when a limit
        refuses them."""
        refused = tenant.refusal(count, prompt_tokens)
        if refused is not None:
            limit, message, wait = refused
            raise RateLimitError(f"{message}: retry later", retry_after=wait, limit=limit)
        band = tenant.band if band is None else band
        if self.in_flight + count > self.limit:
            self._push_out(tenant, count, band)
        tenant.charge(count, prompt_tokens)
        ticket = Ticket(self, tenant, count, band, priority, next(self._seq))
        tenant.admitted += count
        self.in_flight += count
        if not self._queues and self._fits(tenant, count, band):
            self._dispatch(ticket)
        else:
            queue = self._queues.setdefault(tenant, [])
            if not queue:       # joins the band: no credit for the time it sent nothing
                tenant.vtime = max(tenant.vtime, self._band_vtime.get(band, 0.0))
            heapq.heappush(queue, ticket)
            ticket.waiter = asyncio.get_running_loop().create_future()
            self._pump()
        self.on_change(self.in_flight)
        return ticket

    async def wait(self, ticket: Ticket) -> None:
        """Until `ticket` is dispatched; RateLimitError when it was pushed out. Cancelled (the client
        left), it leaves the queue."""
        began = time.monotonic()
        try:
            if ticket.waiter is not None:
                await ticket.waiter
        except BaseException:
            ticket.release()
            raise
        finally:
            ticket.queued_s = time.monotonic() - began

    def _push_out(self, tenant: Tenant, count: int, band: int) -> None:
        """Make room for `count` requests of `tenant` by refusing queued requests of tenants further
        over their share (a worse band, or more admitted per weight); RateLimitError when there are
        none."""
        mine = (band, (tenant.admitted + count) / tenant.weight)
        while self.in_flight + count > self.limit:
            victims = [(max(t.band for t in q), u.admitted / u.weight, u) for u, q in self._queues.items()]
            if not victims:
                break
            vband, share, victim = max(victims, key=lambda v: (v[0], v[1]))
            if (vband, share) <= mine:
                break
            queue = self._queues[victim]
            worst = max(queue, key=lambda t: (t.band, t.priority, t.seq))
            worst.waiter.set_exception(RateLimitError(
                f"the server is full and tenant {victim.name} is over its fair share: retry later",
                retry_after=1.0, limit="fair_share"))
            worst.release()
        if self.in_flight + count > self.limit:
            raise RateLimitError(f"{self.in_flight} requests in flight; the limit is {self.limit}: retry later",
                                 retry_after=1.0, limit="max_in_flight")

    def _fits(self, tenant: Tenant, count: int, band: int) -> bool:
        """Whether `count` more requests of `tenant` may be dispatched now: under the dispatch limit
        (the Batch API's band under its share of it), and with `reserve` of it left to the other
        tenants (so that one arriving while another floods starts at once, not after one of the
        flood's requests ends). A request always fits an idle server, and an idle tenant,
        whatever its count."""
        limit = self.dispatch_limit()
        if band >= BATCH_BAND:
            limit = max(1, int(limit * self.batch_share))
        if self.running and self.running + count > limit:
            return False
        return tenant.running == 0 or tenant.running + count <= limit - math.ceil(limit * self.reserve)

    def _next(self) -> Ticket | None:
        """The queued ticket to dispatch next, of those that fit: best band, the tenant holding the
        fewest dispatch slots for its weight (slots are what a flood takes), least virtual time,
        then its own order."""
        best = None
        for tenant, queue in self._queues.items():
            head = queue[0]
            key = (head.band, tenant.running / tenant.weight, tenant.vtime, head.seq)
            if (best is None or key < best[0]) and self._fits(tenant, head.count, head.band):
                best = (key, head)
        return None if best is None else best[1]

    def _pump(self) -> None:
        while self._queues:
            ticket = self._next()
            if ticket is None:
                return
            self._unqueue(ticket)
            self._dispatch(ticket)
            ticket.waiter.set_result(None)

    def _dispatch(self, ticket: Ticket) -> None:
        tenant = ticket.tenant
        start = max(tenant.vtime, self._band_vtime.get(ticket.band, 0.0))
        self._band_vtime[ticket.band] = start
        tenant.vtime = start + ticket.count / tenant.weight
        ticket.dispatched = True
        tenant.running += ticket.count
        self.running += ticket.count

    def _unqueue(self, ticket: Ticket) -> None:
        queue = self._queues[ticket.tenant]
        queue.remove(ticket)
        heapq.heapify(queue)
        if not queue:
            del self._queues[ticket.tenant]

    def _release(self, ticket: Ticket) -> None:
        tenant = ticket.tenant
        if ticket.dispatched:
            self.running -= ticket.count
            tenant.running -= ticket.count
        else:
            self._unqueue(ticket)
            if ticket.waiter is not None and not ticket.waiter.done():
                ticket.waiter.cancel()
        tenant.admitted -= ticket.count
        self.in_flight -= ticket.count
        assert self.in_flight >= 0 and self.running >= 0, "released more requests than admitted"
        self.on_change(self.in_flight)
        self._pump()

    def queued_by_tenant(self) -> dict[str, int]:
        return {t.name: sum(x.count for x in q) for t, q in self._queues.items()}
