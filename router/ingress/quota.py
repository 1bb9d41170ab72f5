"""A tenant's per-minute limits (`TokenBucket`), and how they hold across several ingress replicas
(`serving.ingress_replicas` > 1).

Each replica enforcing a tenant's per-minute limits on its own would let N replicas admit N times
them. Instead the per-minute buckets are held once, in a `QuotaLedger` (a plain class; the ingress
runs it as a Ray actor its replicas share, router/ingress/app.py), and each replica spends small
grants drawn from it (`Allowance`, one per tenant per replica):

- requests per minute and prompt tokens per minute: a request is admitted against the replica's
  grant; when the grant is short the replica asks the ledger for at least what it needs and up to
  a chunk more (a quarter of the limit over the replicas). The ledger grants only what its bucket
  holds, so all replicas together admit no more than one replica alone would. What a replica holds
  unspent is given back after `LEASE_S` (until then another replica may be refused what it holds:
  at most a chunk per replica);
- generated tokens are charged to the ledger once a replica's debt reaches a chunk, and at its next
  grant: tokens per minute may run over by up to a chunk per replica (a quarter of the limit);
- `max_concurrent` is not a rate: each replica admits up to its share, max_concurrent / N (at
  least 1), so the tenant never has more in flight than max_concurrent (or N, where that is larger).

A ledger lost with its replica is made again (full buckets: at most one minute's limit more).
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

from records.errors import RateLimitError

logger = logging.getLogger(__name__)


class TokenBucket:
    """`per_minute` units, refilled continuously; a take may drive it below zero (tokens generated
    after admission are charged as they come), and then nothing more is admitted until it refills."""

    __slots__ = ("capacity", "clock", "level", "rate", "stamp")

    def __init__(self, per_minute: int, clock: Callable[[], float]) -> None:
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.clock = clock
        self.level = self.capacity
        self.stamp = clock()

    def _refill(self) -> None:
        now = self.clock()
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def wait_s(self, amount: float) -> float:
        """Seconds until `amount` (at most the capacity) can be taken; 0 when it can now."""
        self._refill()
        need = min(amount, self.capacity) - self.level
        return 0.0 if need <= 0 else need / self.rate

    def take(self, amount: float) -> None:
        self._refill()
        self.level -= amount

    def available(self) -> float:
        """What it holds now (below zero while tokens charged after admission are paid off)."""
        self._refill()
        return self.level

    def give(self, amount: float) -> None:
        """Units taken but not used, back (never above the capacity)."""
        self._refill()
        self.level = min(self.capacity, self.level + amount)


LEASE_S = 2.0           # a replica gives back what it did not spend of a grant after this long
CHUNK_SHARE = 0.25      # a grant's extra: this share of the limit, over the replicas


class QuotaLedger:
    """The per-minute buckets of every limited tenant, held once for all ingress replicas.
    `limits`: tenant -> (requests per minute or None, tokens per minute or None)."""

    def __init__(self, limits: dict[str, tuple[int | None, int | None]],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.requests = {name: TokenBucket(rpm, clock) for name, (rpm, _) in limits.items() if rpm}
        self.tokens = {name: TokenBucket(tpm, clock) for name, (_, tpm) in limits.items() if tpm}

    def grant(self, tenant: str, need: tuple[int, int], want: tuple[int, int], debt: int = 0
              ) -> tuple[int, int, float, str | None]:
        """Charge `debt` generated tokens, then take at least `need` (requests, tokens) and up to
        `want` from the tenant's buckets: (requests, tokens, 0, None); or, where a bucket cannot
        give the need now, nothing: (0, 0, seconds until it can, the limit's name)."""
        requests, tokens = self.requests.get(tenant), self.tokens.get(tenant)
        if tokens is not None and debt:
            tokens.take(debt)
        for bucket, amount, limit in ((requests, need[0], "requests_per_minute"),
                                      (tokens, need[1], "tokens_per_minute")):
            if bucket is not None and amount and (wait := bucket.wait_s(amount)) > 0:
                return 0, 0, wait, limit
        out = []
        for bucket, n, w in ((requests, need[0], want[0]), (tokens, need[1], want[1])):
            got = 0 if bucket is None else max(n, min(w, math.floor(bucket.available())))
            if got:
                bucket.take(got)
            out.append(got)
        return out[0], out[1], 0.0, None

    def give_back(self, tenant: str, requests: int, tokens: int) -> None:
        """A grant's unspent part (requests, tokens) returned."""
        for bucket, amount in ((self.requests.get(tenant), requests), (self.tokens.get(tenant), tokens)):
            if bucket is not None and amount > 0:
                bucket.give(amount)

    def charge(self, tenant: str, tokens: int) -> None:
        """Generated tokens, against the tenant's tokens per minute."""
        bucket = self.tokens.get(tenant)
        if bucket is not None and tokens:
            bucket.take(tokens)


# How a replica calls its ledger: (method name, *args) -> the method's result.
LedgerCall = Callable[..., Awaitable[Any]]


class Allowance:
    """One tenant's grant at one ingress replica (the module docstring says how it is spent)."""

    def __init__(self, tenant: str, rpm: int | None, tpm: int | None, replicas: int, call: LedgerCall,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.tenant, self.rpm, self.tpm, self.call, self.clock = tenant, rpm, tpm, call, clock
        self.chunk = tuple(max(1, int((limit or 0) * CHUNK_SHARE / replicas)) for limit in (rpm, tpm))
        self.requests = self.tokens = 0       # granted, not spent
        self.granted_at = 0.0
        self.debt = 0                         # generated tokens not charged at the ledger yet
        self._flushing: asyncio.Task | None = None
        # After the ledger said no: refused here, without asking, until then (a flood over its
        # limit costs the ledger a call per Retry-After, not one a request).
        self.refused_until, self.refused_limit = 0.0, ""

    async def reserve(self, count: int, prompt_tokens: int) -> None:
        """Spend `count` requests and `prompt_tokens` from the grant, asking the ledger for more when
        it is short; RateLimitError (with the seconds until the ledger could give them) if it cannot."""
        if self.clock() - self.granted_at > LEASE_S and (self.requests or self.tokens):
            held, self.requests, self.tokens = (self.requests, self.tokens), 0, 0   # (before the await)
            await self.call("give_back", self.tenant, *held)
        need = (max(0, count - self.requests) if self.rpm else 0,
                max(0, prompt_tokens - self.tokens) if self.tpm else 0)
        if need[0] or need[1]:
            if self.clock() < self.refused_until:
                self._refuse(self.refused_limit, self.refused_until - self.clock())
            want = (need[0] + self.chunk[0] if self.rpm else 0, need[1] + self.chunk[1] if self.tpm else 0)
            debt, self.debt = self.debt, 0
            requests, tokens, wait, limit = await self.call("grant", self.tenant, need, want, debt)
            if wait > 0:
                self.refused_until, self.refused_limit = self.clock() + wait, limit
                self._refuse(limit, wait)
            self.requests += requests
            self.tokens += tokens
            self.granted_at = self.clock()
        if self.rpm:
            self.requests -= count
        if self.tpm:
            self.tokens -= prompt_tokens

    def _refuse(self, limit: str, wait: float) -> None:
        value = self.rpm if limit == "requests_per_minute" else self.tpm
        raise RateLimitError(f"tenant {self.tenant} is over its {limit} ({value}) across the ingress replicas: "
                             f"retry later", retry_after=wait, limit=limit)

    def refund(self, count: int, prompt_tokens: int) -> None:
        """A reserved request the replica then refused (its concurrency, a full server)."""
        if self.rpm:
            self.requests += count
        if self.tpm:
            self.tokens += prompt_tokens

    def charge(self, tokens: int) -> None:
        """Generated tokens: charged at the ledger once they reach a chunk (or with the next grant)."""
        if not self.tpm or not tokens:
            return
        self.debt += tokens
        if self.debt >= self.chunk[1] and (self._flushing is None or self._flushing.done()):
            debt, self.debt = self.debt, 0
            self._flushing = asyncio.get_running_loop().create_task(self._charge(debt))

    async def _charge(self, tokens: int) -> None:
        try:
            await self.call("charge", self.tenant, tokens)
        except Exception as e:  # noqa: BLE001 (any failure of the call: charged with the next grant)
            logger.warning("tenant %s: charging %d generated tokens at the quota ledger failed: %s",
                           self.tenant, tokens, e)
            self.debt += tokens


def concurrency_share(max_concurrent: int | None, replicas: int) -> int | None:
    """One replica's share of a tenant's max_concurrent (at least 1)."""
    return None if max_concurrent is None else max(1, max_concurrent // replicas)
