"""Tenants: who a request belongs to, and what that tenant may still send.

`Tenants` maps API keys to `Tenant`s (records/serving.py: `serving.tenants`, `serving.tenants_file`,
and `serving.api_key` as the one tenant "default"); with no key at all every request is the tenant
"default", without limits. A `Tenant` carries its limits (requests and tokens per minute as token
buckets, requests admitted at once), its band and weight, and the live counts the admission keeps
(router/ingress/admission.py). Keys are compared in constant time and never logged or labelled:
metrics and messages name the tenant.
"""
from __future__ import annotations

import hmac
import json
import math
import os
from collections.abc import Callable, Mapping

from records.serving import ServingSpec, TenantSpec, check_tenants
from router.ingress.quota import Allowance, LedgerCall, TokenBucket, concurrency_share

DEFAULT = "default"


class Tenant:
    """A tenant's limits and its live counts. `admitted`: its requests queued or running (by the
    admission's count); `vtime`: its virtual time in the fair queue (the service it had, divided by
    its weight). `allowance`: with several ingress replicas, its per-minute limits are the shared
    ledger's (router/ingress/quota.py) and its own buckets are off."""

    def __init__(self, name: str, spec: TenantSpec, clock: Callable[[], float]) -> None:
        self.name = name
        self.band = spec.priority
        self.weight = spec.weight
        self.max_concurrent = spec.max_concurrent
        self.models = frozenset(spec.models) if spec.models is not None else None
        self.requests = TokenBucket(spec.requests_per_minute, clock) if spec.requests_per_minute else None
        self.tokens = TokenBucket(spec.tokens_per_minute, clock) if spec.tokens_per_minute else None
        self.admitted = 0
        self.running = 0
        self.vtime = 0.0
        self.allowance: Allowance | None = None

    def refusal(self, count: int, prompt_tokens: int) -> tuple[str, str, float] | None:
        """(limit, message, Retry-After seconds) when `count` more requests with `prompt_tokens`
        would break one of this tenant's limits now; else None."""
        if self.max_concurrent is not None and self.admitted + count > self.max_concurrent:
            return ("max_concurrent", f"tenant {self.name} has {self.admitted} requests in flight; its "
                    f"max_concurrent is {self.max_concurrent}", 1.0)
        if self.requests is not None and (wait := self.requests.wait_s(count)) > 0:
            return ("requests_per_minute", f"tenant {self.name} is over its requests_per_minute "
                    f"({int(self.requests.capacity)})", wait)
        if self.tokens is not None and (wait := self.tokens.wait_s(prompt_tokens)) > 0:
            return ("tokens_per_minute", f"tenant {self.name} is over its tokens_per_minute "
                    f"({int(self.tokens.capacity)})", wait)
        return None

    def charge(self, count: int, tokens: int) -> None:
        """Count `count` requests and `tokens` tokens against the per-minute limits."""
        if self.allowance is not None:      # shared: a request's prompt went with its reservation
            if not count:
                self.allowance.charge(tokens)
            return
        if self.requests is not None and count:
            self.requests.take(count)
        if self.tokens is not None and tokens:
            self.tokens.take(tokens)


def retry_after(seconds: float) -> str:
    """A Retry-After header's value: whole seconds, at least 1."""
    return str(max(1, math.ceil(seconds)))


class Tenants:
    """API key -> tenant. `resolve(authorization)` answers for an `Authorization` header (or gRPC
    metadata) value: its tenant, or None for a bad or missing key."""

    def __init__(self, serving: ServingSpec, environ: Mapping[str, str] = os.environ,
                 clock: Callable[[], float] | None = None) -> None:
        import time  # noqa: PLC0415

        clock = clock or time.monotonic
        specs = dict(serving.tenants)
        if serving.tenants_file is not None:
            specs.update(read_tenants_file(serving.tenants_file, specs))
        key = serving.api_key
        if serving.api_key_env is not None and key is None:
            key = environ.get(serving.api_key_env)
            if not key:      # fail closed: never serve openly because a Secret is missing
                raise ValueError(f"serving.api_key_env names {serving.api_key_env!r}, which is not set in "
                                 f"the ingress's environment")
        self._keys: list[tuple[bytes, Tenant]] = []
        self.by_name: dict[str, Tenant] = {}
        for name, spec in specs.items():
            tenant = self.by_name[name] = Tenant(name, spec, clock)
            keys = list(spec.api_keys)
            if spec.api_key_env is not None:
                value = environ.get(spec.api_key_env)
                if not value:
                    raise ValueError(f"serving.tenants.{name}.api_key_env names {spec.api_key_env!r}, which is "
                                     f"not set in the ingress's environment")
                keys.append(value)
            self._keys += [(k.encode(), tenant) for k in keys]
        if key is not None:
            tenant = self.by_name[DEFAULT] = Tenant(DEFAULT, TenantSpec(api_keys=[key]), clock)
            self._keys.append((key.encode(), tenant))
        if len({k for k, _ in self._keys}) != len(self._keys):
            raise ValueError("serving.tenants: two tenants share an API key")
        # No key anywhere: the server is open, every request is the one unlimited tenant.
        self.open = not self._keys
        if self.open:
            self.by_name[DEFAULT] = Tenant(DEFAULT, TenantSpec(), clock)

    def limits(self) -> dict[str, tuple[int | None, int | None]]:
        """Each rate-limited tenant's (requests per minute, tokens per minute)."""
        return {name: (t.requests and int(t.requests.capacity), t.tokens and int(t.tokens.capacity))
                for name, t in self.by_name.items() if t.requests is not None or t.tokens is not None}

    def share(self, replicas: int, call: LedgerCall) -> None:
        """Hold the tenants' limits across `replicas` ingress replicas: the per-minute ones at the
        ledger `call` reaches, max_concurrent split (router/ingress/quota.py)."""
        limits = self.limits()
        for tenant in self.by_name.values():
            tenant.max_concurrent = concurrency_share(tenant.max_concurrent, replicas)
            if tenant.name in limits:
                tenant.allowance = Allowance(tenant.name, *limits[tenant.name], replicas, call)
                tenant.requests = tenant.tokens = None

    def resolve(self, authorization: str | None) -> Tenant | None:
        if self.open:
            return self.by_name[DEFAULT]
        sent = (authorization or "").encode()
        found = None
        for key, tenant in self._keys:        # every key compared, in constant time each
            if hmac.compare_digest(sent, b"Bearer " + key):
                found = tenant
        return found


def read_tenants_file(path: str, known: Mapping[str, TenantSpec]) -> dict[str, TenantSpec]:
    """The tenants of a JSON file (name -> the fields of `serving.tenants.<name>`); ValueError
    naming the file and what is wrong, never a key."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"serving.tenants_file {path!r} cannot be read as JSON: {type(e).__name__}") from None
    if not isinstance(data, dict):
        raise ValueError(f"serving.tenants_file {path!r} must hold an object: tenant name -> its fields")
    specs: dict[str, TenantSpec] = {}
    for name, fields in data.items():
        if name in known:
            raise ValueError(f"serving.tenants_file: tenant {name!r} is in serving.tenants too")
        try:
            specs[name] = TenantSpec.model_validate(fields)
        except ValueError as e:
            errors = getattr(e, "errors", lambda: [])()
            where = ".".join(str(p) for p in errors[0]["loc"]) if errors else ""
            raise ValueError(f"serving.tenants_file: tenant {name!r}: invalid {where or 'fields'}") from None
    check_tenants({**known, **specs})
    return specs
