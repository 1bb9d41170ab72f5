"""The ingress's admission (router/ingress/admission.py) and tenants (router/ingress/tenants.py) as
plain classes, on a fake clock: per-tenant limits with their Retry-After, the fair queue (bands,
weights, a request's own priority), push-out of a flooding tenant when the server is full, and
tickets that leave the queue when their client does. The served path is
tests/serving/test_endpoints.py's tenant test; the load figures are benchmarks/tenants.py's."""
from __future__ import annotations

import asyncio

import pytest

from records.errors import RateLimitError
from records.serving import BATCH_BAND, ServingSpec
from router.ingress.admission import Admission
from router.ingress.tenants import Tenants, retry_after


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def tenants(clock: Clock | None = None, environ: dict | None = None, **specs) -> Tenants:
    return Tenants(ServingSpec(tenants=specs), environ or {}, clock or Clock())


def test_keys_resolve_to_tenants_and_bad_specs_are_named(tmp_path):
    ts = Tenants(ServingSpec(api_key="k0", tenants={"a": {"api_keys": ["ka", "ka2"]},
                                                     "b": {"api_key_env": "B_KEY"}}), {"B_KEY": "kb"})
    assert ts.resolve("Bearer ka").name == "a" and ts.resolve("Bearer ka2").name == "a"
    assert ts.resolve("Bearer kb").name == "b" and ts.resolve("Bearer k0").name == "default"
    assert ts.resolve("Bearer nope") is None and ts.resolve("") is None and ts.resolve(None) is None
    open_server = Tenants(ServingSpec(), {})
    assert open_server.open and open_server.resolve(None).name == "default"
    with pytest.raises(ValueError, match="B_KEY"):
        Tenants(ServingSpec(tenants={"b": {"api_key_env": "B_KEY"}}), {})
    with pytest.raises(ValueError, match="serving.tenants.a: give it api_keys"):
        ServingSpec(tenants={"a": {}})
    with pytest.raises(ValueError, match="a and b share an API key"):
        ServingSpec(tenants={"a": {"api_keys": ["k"]}, "b": {"api_keys": ["k"]}})
    with pytest.raises(ValueError, match="priority"):
        ServingSpec(tenants={"a": {"api_keys": ["k"], "priority": 10}})
    with pytest.raises(ValueError, match="default"):
        ServingSpec(api_key="k0", tenants={"default": {"api_keys": ["k"]}})
    # A keys file read where the ingress runs; its errors name the tenant, never a key.
    path = tmp_path / "tenants.json"
    path.write_text('{"c": {"api_keys": ["secret-c"], "weight": 2}}')
    ts = Tenants(ServingSpec(tenants_file=str(path), tenants={"a": {"api_keys": ["ka"]}}), {})
    assert ts.resolve("Bearer secret-c").weight == 2 and ts.resolve("Bearer ka").name == "a"
    path.write_text('{"c": {"api_keys": ["secret-c"], "weight": -1}}')
    with pytest.raises(ValueError, match="tenant 'c': invalid weight") as err:
        Tenants(ServingSpec(tenants_file=str(path)), {})
    assert "secret-c" not in str(err.value)


def test_per_tenant_limits_refuse_with_retry_after():
    clock = Clock()
    ts = tenants(clock, a={"api_keys": ["ka"], "requests_per_minute": 2, "max_concurrent": 3},
                 b={"api_keys": ["kb"], "tokens_per_minute": 600})
    a, b = ts.by_name["a"], ts.by_name["b"]
    adm = Admission(100)
    held = [t1 := adm.admit(a, 1), adm.admit(a, 1)]      # a ticket dropped unreleased releases itself
    with pytest.raises(RateLimitError, match="requests_per_minute") as err:
        adm.admit(a, 1)
    assert err.value.limit == "requests_per_minute" and err.value.retry_after == pytest.approx(30.0)
    assert retry_after(err.value.retry_after) == "30"
    clock.t += 30
    held.append(t3 := adm.admit(a, 1))      # one refilled: the third fits; the fourth is over max_concurrent
    clock.t += 60
    with pytest.raises(RateLimitError, match="max_concurrent is 3") as err:
        adm.admit(a, 1)
    t1.release()
    t1.release()                    # idempotent
    held.append(adm.admit(a, 1))
    # Tokens: prompt tokens at admission, generated ones as they stream; below zero refuses.
    tb = adm.admit(b, 1, prompt_tokens=500)
    tb.charge(200)
    with pytest.raises(RateLimitError, match="tokens_per_minute") as err:
        adm.admit(b, 1, prompt_tokens=10)
    assert err.value.retry_after == pytest.approx(11.0)     # 110 tokens short at 10 per second
    assert adm.in_flight == 4 and t3.tenant is a
    del held[:], t3
    assert adm.in_flight == 1 and a.admitted == 0


def test_fair_queue_shares_by_weight_and_keeps_bands_and_priority():
    async def main() -> None:
        ts = tenants(heavy={"api_keys": ["kh"], "priority": 1}, light={"api_keys": ["kl"], "weight": 2, "priority": 1},
                     gold={"api_keys": ["kg"], "priority": 0}, batch={"api_keys": ["kx"], "priority": 5})
        heavy, light, gold, batch = (ts.by_name[n] for n in ("heavy", "light", "gold", "batch"))
        adm = Admission(1000, dispatch_limit=lambda: 1)
        running = adm.admit(heavy, 1)
        assert running.dispatched
        order: list[str] = []
        tickets = [adm.admit(heavy, 1, priority=0) for _ in range(8)]
        tickets += [adm.admit(light, 1) for _ in range(4)]
        tickets.append(adm.admit(batch, 1))
        tickets.append(urgent := adm.admit(heavy, 1, priority=-5))     # its own priority: first of heavy's
        assert adm.queued == 14 and adm.running == 1
        for t in tickets:
            t.waiter.add_done_callback(lambda _, t=t: order.append(f"{t.tenant.name}{'!' if t is urgent else ''}"))
        running.release()
        late_gold = None
        for step in range(14):
            await asyncio.sleep(0)
            current = next(t for t in tickets if t.dispatched and not t.released)
            if step == 3:
                late_gold = adm.admit(gold, 1)      # a better band jumps every queued request
                tickets.append(late_gold)
                late_gold.waiter.add_done_callback(lambda _: order.append("gold"))
            current.release()
        await asyncio.sleep(0)
        # light (weight 2) gets two dispatches per heavy one (whose first was running when light
        # came: one unit of service, two of light's); heavy's urgent request is its first; gold's
        # better band is next as soon as it arrives; batch's band waits for every other.
        assert order == ["light"] * 3 + ["heavy!", "gold", "light"] + ["heavy"] * 8 + ["batch"], order

    asyncio.run(main())


def test_a_full_server_pushes_out_the_flooding_tenant():
    async def main() -> None:
        ts = tenants(heavy={"api_keys": ["kh"]}, light={"api_keys": ["kl"]})
        heavy, light = ts.by_name["heavy"], ts.by_name["light"]
        adm = Admission(6, dispatch_limit=lambda: 2)
        flood = [adm.admit(heavy, 1) for _ in range(6)]
        waits = [asyncio.ensure_future(adm.wait(t)) for t in flood]
        await asyncio.sleep(0)
        with pytest.raises(RateLimitError, match="limit is 6"):
            adm.admit(heavy, 1)                     # a flooder gets no room from itself
        mine = [adm.admit(light, 1) for _ in range(3)]     # each pushes out heavy's newest queued request
        assert adm.in_flight == 6 and light.admitted == 3 and heavy.admitted == 3
        await asyncio.sleep(0)
        pushed = [w for w in waits if w.done() and w.exception() is not None]
        assert len(pushed) == 3 and all(w.exception().limit == "fair_share" for w in pushed)
        assert all(t.released for t in flood[3:])
        with pytest.raises(RateLimitError, match="limit is 6"):
            adm.admit(light, 1)         # at equal shares the newcomer waits its turn
        # A client that leaves while queued leaves the queue; its slot goes to the next.
        waiter = asyncio.ensure_future(adm.wait(mine[0]))
        await asyncio.sleep(0)
        waiter.cancel()
        await asyncio.sleep(0)
        assert mine[0].released and adm.in_flight == 5 and adm.queued == 3
        for t in flood + mine:
            t.release()
        assert adm.in_flight == adm.running == adm.queued == 0 and heavy.running == light.running == 0

    asyncio.run(main())


def test_a_reserve_keeps_slots_for_a_tenant_that_arrives_while_another_floods():
    async def main() -> None:
        ts = tenants(heavy={"api_keys": ["kh"]}, light={"api_keys": ["kl"]})
        heavy, light = ts.by_name["heavy"], ts.by_name["light"]
        adm = Admission(100, dispatch_limit=lambda: 4, reserve=0.25)
        flood = [adm.admit(heavy, 1) for _ in range(10)]
        assert [t.dispatched for t in flood].count(True) == 3 == heavy.running      # one slot kept
        first = adm.admit(light, 1)
        assert first.dispatched                 # at once, not after one of the flood's ends
        second = adm.admit(light, 1)
        assert not second.dispatched            # the server is full now: it waits, first in line
        flood[0].release()
        await asyncio.sleep(0)
        assert second.dispatched and heavy.running == 2 and light.running == 2
    asyncio.run(main())


def test_batch_requests_keep_to_their_share_and_never_hold_up_their_tenant():
    async def main() -> None:
        one = tenants(only={"api_keys": ["k"]}).by_name["only"]
        adm = Admission(100, dispatch_limit=lambda: 8, batch_share=0.5)
        batch = [adm.admit(one, 1, band=BATCH_BAND) for _ in range(10)]
        assert sum(t.dispatched for t in batch) == 4           # half the slots at most
        interactive = [adm.admit(one, 1) for _ in range(4)]
        assert all(t.dispatched for t in interactive)          # past the tenant's own queued batch
        late = adm.admit(one, 1)
        assert not late.dispatched                             # the server is full now
        batch[0].release()
        await asyncio.sleep(0)
        assert late.dispatched and sum(t.dispatched for t in batch[1:]) == 3    # its band first
        for t in [*interactive, late]:
            t.release()
        await asyncio.sleep(0)
        assert sum(t.dispatched and not t.released for t in batch) == 4         # back to its share

    asyncio.run(main())


def test_limits_hold_across_ingress_replicas():
    """Two ingress replicas' tenants drawing on one QuotaLedger (router/ingress/quota.py): a tenant
    of 20 requests a minute is admitted at most 20 of 60 requests sent over both (at least 20 less
    a chunk per replica held unspent), the rest refused with a Retry-After; what one replica held
    unspent goes back after the lease and the other gets it; generated tokens one replica charges
    count against the other's prompts; max_concurrent is split between the replicas."""
    from router.ingress import quota
    from router.ingress.quota import QuotaLedger

    clock = Clock()
    spec = {"api_keys": ["ka"], "requests_per_minute": 20, "max_concurrent": 5}
    replicas = [tenants(clock, a=spec, b={"api_keys": ["kb"], "tokens_per_minute": 1000}) for _ in range(2)]
    ledger = QuotaLedger(replicas[0].limits(), clock)
    calls = []

    async def call(method, *args):
        calls.append(method)
        return getattr(ledger, method)(*args)

    for ts in replicas:
        ts.share(2, call)
    a = [ts.by_name["a"] for ts in replicas]
    b = [ts.by_name["b"] for ts in replicas]
    assert [t.max_concurrent for t in a] == [2, 2] and a[0].requests is None and a[0].allowance.chunk[0] == 2

    async def send(tenant, n=1, prompt=0):
        try:
            await tenant.allowance.reserve(n, prompt)
            return True
        except RateLimitError as e:
            assert e.retry_after > 0 and e.limit in ("requests_per_minute", "tokens_per_minute")
            assert "across the ingress replicas" in e.message
            return False

    async def scenario():
        admitted = [await send(a[i % 2]) for i in range(60)]
        assert 20 - 2 * 2 <= sum(admitted) <= 20, sum(admitted)
        assert calls.count("grant") < 20 + 2                          # not a call per request, nor per refusal
        held, level = sum(t.allowance.requests for t in a), ledger.requests["a"].available()
        clock.t += quota.LEASE_S + 0.1
        for t in a:
            await t.allowance.reserve(0, 0)                           # nothing asked: what it held goes back
        refilled = (quota.LEASE_S + 0.1) * 20 / 60
        assert ledger.requests["a"].available() == pytest.approx(level + held + refilled)
        assert sum(t.allowance.requests for t in a) == 0
        # Tokens: replica 0 takes 100 (and a chunk of 125 more), 600 generated there reach the
        # ledger; replica 1's prompts get the 175 left.
        assert await send(b[0], 1, 100)
        b[0].charge(0, 600)
        await asyncio.sleep(0)                                         # the charge's task runs
        assert await send(b[1], 1, 150) and not await send(b[1], 1, 200)

    asyncio.run(scenario())
