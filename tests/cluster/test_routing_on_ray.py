"""Routing over real engine replica actors on a local Ray: an adapter kept on its replica, round-robin
within each pool, prefix-aware routing against round-robin on the same replicas (metrics decide),
and a router that moves off a dead replica and follows the pools' membership."""
from __future__ import annotations

import asyncio
import random
import time

import pytest

from records.hashing import hash_block_tokens
from records.sampling_params import SamplingParams
from records.serving import PolicyConfig
from router.routing.metrics import ServingMetrics
from router.routing.policy import Decision, RoutingPolicy


@pytest.mark.ray
def test_router_keeps_an_adapter_on_its_replica_and_keys_prefixes_by_it(tiny_llama, tmp_path):
    """Requests under one adapter follow the replica that ran it (while loads allow); the same
    prompt under the base model or another adapter hashes to other blocks, so a replica's cached
    blocks for one adapter never count as a prefix hit for another."""
    from cluster.config import ClusterConfig
    from records.lora import LoRARequest
    from router.ingress.frontend import Frontend

    config = ClusterConfig(model=tiny_llama, pools={"decode": {"replicas": 2}})
    router = Frontend(config.ingress_spec(), {"decode-0": None, "decode-1": None}).router
    a, b = LoRARequest("a", 1, str(tmp_path / "a")), LoRARequest("b", 2, str(tmp_path / "b"))
    prompt = list(range(3, 67))
    first = router.route(prompt[:5], SamplingParams(max_tokens=1, lora_request=a)).replica_id
    for i in range(6):
        d = router.route([i + 7] * 5, SamplingParams(max_tokens=1, lora_request=a))
        assert (d.replica_id, d.reason) == (first, "adapter_hit")
    keys = {name: SamplingParams(lora_request=lora).cache_keys for name, lora in (("base", None), ("a", a), ("b", b))}
    hashes = {name: hash_block_tokens(prompt, 16, k) for name, k in keys.items()}
    assert len({h[0] for h in hashes.values()}) == 3


@pytest.mark.ray
def test_round_robin_alternates_within_each_pool(tiny_llama):
    """With 1 decode and 2 prefill replicas, every request routes in both pools: round-robin must
    still alternate the prefill replicas (a policy shared by both pools sent every prefill to one)."""
    from cluster.config import ClusterConfig
    from router.ingress.frontend import Frontend

    config = ClusterConfig(model=tiny_llama, mode="disaggregated", routing={"name": "round_robin"},
                           pools={"prefill": {"replicas": 2}, "decode": {}})
    pd = Frontend(config.ingress_spec(), {"decode-0": None}, {"prefill-0": None, "prefill-1": None}).router
    params = SamplingParams(max_tokens=1)
    picks = []
    for _ in range(4):
        pd.decode.route(list(range(40)), params)
        picks.append(pd.prefill.route(list(range(40)), params).replica_id)
    assert picks == ["prefill-0", "prefill-1"] * 2


@pytest.mark.ray
def test_prefix_aware_routing_beats_round_robin(tiny_llama):
    ray = pytest.importorskip("ray", reason="needs ray (make setup installs it)")
    from cluster.launch import init_ray
    from cluster.replica import EngineReplica
    from records.config_resolution import engine_config
    from router.routing.pool_router import RequestRouter

    init_ray(num_cpus=8)
    # Each replica's KV pool holds about two tenants' system prompts: round-robin sends all four
    # tenants to both replicas and they evict each other; prefix-aware routing keeps two per replica.
    config = engine_config(tiny_llama, dtype="float32", max_model_len=1024, num_kv_blocks=96)
    actor = ray.remote(EngineReplica)
    replicas = {f"r{i}": actor.options(num_cpus=1).remote(config, f"r{i}", 1) for i in range(2)}
    ray.get([h.info.remote() for h in replicas.values()])
    rng = random.Random(0)
    vocab = config.model_config.vocab_size
    systems = [[rng.randrange(3, vocab) for _ in range(600)] for _ in range(4)]
    questions = [(t, [rng.randrange(3, vocab) for _ in range(rng.randrange(8, 24))]) for t in range(4)
                 for _ in range(6)]
    rng.shuffle(questions)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)

    async def run(policy_name: str) -> tuple[ServingMetrics, float, RequestRouter]:
        ray.get([h.reset_prefix_cache.remote() for h in replicas.values()])
        metrics = ServingMetrics()
        router = RequestRouter("decode", replicas, 16, RoutingPolicy(PolicyConfig(policy_name, seed=0)), metrics)
        before = await router.refresh_stats()
        held_before: list[bool] = []
        for i, (tenant, q) in enumerate(questions):
            await router.sync_events()                # what the background poller does
            prompt = systems[tenant] + q
            decision = router.route(prompt, params)
            first_blocks = hash_block_tokens(prompt, 16)[:37]
            held_before.append(router.index.holds(decision.replica_id, first_blocks[-1]))
            async for _ in router.generate(f"{policy_name}-{i}", prompt, params, decision):
                pass
        after = await router.refresh_stats()
        computed = sum((after[r].engine.prompt_tokens - before[r].engine.prompt_tokens)
                       - (after[r].engine.prefix_cache_hits - before[r].engine.prefix_cache_hits) for r in replicas)
        repeats = [held for i, held in enumerate(held_before)
                   if questions[i][0] in {t for t, _ in questions[:i]}]
        return metrics, computed, sum(repeats) / len(repeats)

    prefix_metrics, prefix_computed, prefix_hit_rate = asyncio.run(run("prefix_aware"))
    _, rr_computed, rr_hit_rate = asyncio.run(run("round_robin"))
    print(f"\nprefix_aware: {prefix_hit_rate:.0%} of repeats on a replica holding their prefix, "
          f"{prefix_computed} prefill tokens computed; round_robin: {rr_hit_rate:.0%}, {rr_computed}")
    assert prefix_hit_rate >= 0.9, prefix_hit_rate
    assert prefix_metrics.routing.decisions.get(reason="prefix_hit", pool="decode") >= 0.9 * (len(questions) - 4)
    assert prefix_computed * 2 < rr_computed, (prefix_computed, rr_computed)
    assert all(ray.get([h.check_no_leaks.remote() for h in replicas.values()]))
    for h in replicas.values():
        ray.kill(h)


@pytest.mark.ray
@pytest.mark.parametrize("channel", ["tcp", "ray"])
def test_a_started_router_follows_kv_events_on_the_output_channel(tiny_llama, channel):
    """A started router learns a replica's cached blocks from its output channel (no poll of its
    own), the clearing of its cache too, and a channel opened again goes on from its cursor: the
    index ends holding exactly the replica's blocks, at the end of its event log. Over either
    transport (router/routing/channel.py: a TCP connection, or Ray's calls and generator)."""
    ray = pytest.importorskip("ray", reason="needs ray (make setup installs it)")
    from cluster.launch import init_ray
    from cluster.replica import EngineReplica
    from records.config_resolution import engine_config
    from router.routing.pool_router import RequestRouter

    init_ray(num_cpus=8)
    config = engine_config(tiny_llama, dtype="float32", max_model_len=256)
    replica = ray.remote(EngineReplica).options(num_cpus=1).remote(config, "r", 1)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    a, b = list(range(5, 45)), list(range(50, 90))          # two full blocks each

    async def until(cond, what: str) -> None:
        deadline = time.monotonic() + 60
        while not cond():
            assert time.monotonic() < deadline, what
            await asyncio.sleep(0.05)

    async def run() -> None:
        router = RequestRouter("decode", {"r": replica}, 16, RoutingPolicy(PolicyConfig()), ServingMetrics(),
                               channel=channel)
        router.start()
        try:
            async for _ in router.generate("a", a, params):
                pass
            last_a = hash_block_tokens(a, 16)[-1]
            await until(lambda: router.index.holds("r", last_a), "the index never held a's blocks")
            assert router.index.num_blocks("r") == 2
            assert await asyncio.to_thread(ray.get, replica.reset_prefix_cache.remote())
            await until(lambda: router.index.num_blocks("r") == 0, "the clearing never arrived")
            router.channels.by_replica["r"].close()                  # a channel opened again, from its cursor
            async for _ in router.generate("b", b, params):
                pass
            await until(lambda: router.index.holds("r", hash_block_tokens(b, 16)[-1]), "b's blocks never arrived")
            assert router.index.num_blocks("r") == 2 and not router.index.holds("r", last_a)
            cursor = router.channels.cursors["r"]
            end, after = await asyncio.to_thread(ray.get, replica.kv_event_records_since.remote(cursor))
            assert (end, after) == (cursor, [])                    # the router is at the log's end
        finally:
            router.stop()

    try:
        asyncio.run(run())
    finally:
        ray.kill(replica)


@pytest.mark.ray
def test_router_moves_off_a_dead_replica_and_follows_membership(tiny_llama):
    ray = pytest.importorskip("ray", reason="needs ray (make setup installs it)")
    from cluster.launch import init_ray
    from cluster.replica import EngineReplica
    from records.config_resolution import engine_config
    from records.errors import NoReplicaError
    from router.routing.pool_router import RequestRouter

    init_ray(num_cpus=8)
    config = engine_config(tiny_llama, dtype="float32", max_model_len=256)
    actor = ray.remote(EngineReplica)
    dead = actor.options(num_cpus=0.1).remote(config, "a", 1)
    ray.kill(dead, no_restart=True)
    live = actor.options(num_cpus=1).remote(config, "b", 1)
    ray.get(live.info.remote())
    reported: list[str] = []
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

    async def run() -> None:
        router = RequestRouter("decode", {"a": dead, "b": live}, 16,
                               RoutingPolicy(PolicyConfig("round_robin")), ServingMetrics(),
                               on_replica_failure=reported.append)
        # Sent to "a", the request fails there before any output and goes to "b".
        deltas = [d async for d in router.generate("r0", [5, 6, 7], params, Decision("a", "round_robin"))]
        assert sum(len(c.token_ids) for d in deltas for c in d.choices) == 3
        assert reported == ["a"] and router.available == ["b"]
        assert {router.route([5, 6, 7], params).replica_id for _ in range(4)} == {"b"}   # not a candidate
        router.start()
        router.set_replicas({"b": live})                              # the manager dropped "a"
        assert set(router.replicas) == set(router.loads) == {"b"} and not router.down
        assert set(router.channels.by_replica) == {"b"} and "a" not in router.index.replica_ids
        router.set_replicas({})
        with pytest.raises(NoReplicaError, match="no decode engine replica is available"):
            router.route([5, 6, 7], params)
        router.stop()

    asyncio.run(run())
    assert ray.get(live.check_no_leaks.remote())
    ray.kill(live)


@pytest.mark.ray
def test_a_cancelled_request_takes_nothing_else_with_it(tiny_llama, eventually_no_leaks):
    """Ray cancels an actor call together with every call made in its context, and Serve cancels a
    request's call when its client goes away. The request that opened the router's output channel
    to a replica is cancelled while another streams on it: the other request streams to its end,
    and the cancelled one is aborted on the replica (it does not run on to max_tokens)."""
    ray = pytest.importorskip("ray", reason="needs ray (make setup installs it)")
    from cluster.launch import init_ray
    from cluster.replica import EngineReplica
    from records.config_resolution import engine_config

    init_ray(num_cpus=8)
    config = engine_config(tiny_llama, dtype="float32", max_model_len=2048)
    replica = ray.remote(EngineReplica).options(num_cpus=1).remote(config, "r", 1)
    ray.get(replica.info.remote())

    @ray.remote
    class Ingress:
        """What the ingress does per request: stream one through a RequestRouter."""

        def __init__(self, handle) -> None:
            from router.routing.pool_router import RequestRouter

            self.router = RequestRouter("decode", {"r": handle}, 16, RoutingPolicy(PolicyConfig("round_robin")),
                                        ServingMetrics())
            self.tokens: dict[str, int] = {}

        async def stream(self, request_id: str, max_tokens: int) -> int:
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            self.tokens[request_id] = 0
            async for delta in self.router.generate(request_id, [5, 6, 7], params):
                self.tokens[request_id] += sum(len(c.token_ids) for c in delta.choices)
            return self.tokens[request_id]

        def progress(self) -> dict[str, int]:
            return dict(self.tokens)

    ingress = Ingress.remote(replica)
    first = ingress.stream.remote("first", 2000)         # opens the channel to the replica
    while ray.get(ingress.progress.remote()).get("first", 0) == 0:
        time.sleep(0.01)
    other = ingress.stream.remote("other", 1000)
    while ray.get(ingress.progress.remote()).get("other", 0) == 0:
        time.sleep(0.01)
    ray.cancel(first)
    assert ray.get(other) == 1000
    with pytest.raises(ray.exceptions.TaskCancelledError):
        ray.get(first)
    ran = ray.get(ingress.progress.remote())["first"]
    assert eventually_no_leaks({"r": replica})
    assert ray.get(replica.stats.remote()).engine.generation_tokens < 2000 + 1000, f"first ran on ({ran} streamed)"
    ray.kill(ingress)
    ray.kill(replica)


@pytest.mark.ray
def test_tiers_and_peer_pulls_on_replica_actors(tiny_llama, eventually_no_leaks):
    """Two replica actors with an offload tier and a NIXL connector, tenants whose prompts exceed
    each pool: a tenant's second turn loads its prefix from the tier; a replica chosen for load
    pulls a prefix from its peer; a peer killed after leasing costs a recompute, not the request.
    Every output is the first computation's (greedy, the path without tier or peer)."""
    ray = pytest.importorskip("ray", reason="needs ray (make setup installs it)")
    pytest.importorskip("nixl", reason="needs nixl: make setup installs it")
    from cluster.launch import init_ray
    from cluster.replica import EngineReplica
    from records.config_resolution import engine_config
    from router.routing.pool_router import RequestRouter

    init_ray(num_cpus=8)
    # 40 blocks: one tenant's 400-token prompt (25 blocks) at a time; the tier holds them all.
    config = engine_config(tiny_llama, dtype="float32", max_model_len=640, num_kv_blocks=40,
                                 kv_offloading_size=400 * 8192 / (1 << 30), kv_connector="nixl")
    actor = ray.remote(EngineReplica)
    replicas = {f"r{i}": actor.options(num_cpus=1).remote(config, f"r{i}", 1) for i in range(2)}
    ray.get([h.info.remote() for h in replicas.values()])
    rng = random.Random(1)
    vocab = config.model_config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(400)] for _ in range(4)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    metrics = ServingMetrics()

    async def tokens(router: RequestRouter, rid: str, prompt: list[int], decision=None, kv=None) -> list[int]:
        await router.sync_events()
        out = []
        async for delta in router.generate(rid, prompt, params, decision, kv):
            out += delta.choices[0].token_ids if delta.choices else []
        return out

    async def run() -> dict:
        router = RequestRouter("decode", replicas, 16, RoutingPolicy(PolicyConfig(seed=0)), metrics,
                               min_peer_pull_tokens=64)
        first = [await tokens(router, f"a{i}", p, Decision("r0", "test")) for i, p in enumerate(prompts[:3])]
        # Round two goes to r0 (a tier hit): its pool holds the last tenant only, its tier the others.
        again = [await tokens(router, f"b{i}", p) for i, p in enumerate(prompts[:3])]
        # r0 busy: r1 gets the prompt and pulls its prefix from r0.
        router.loads["r0"].in_flight = 9                              # past imbalance_threshold
        decision = router.route(prompts[0], params)
        assert decision.replica_id == "r1" and decision.peer is not None and decision.peer[0] == "r0"
        pulled = await tokens(router, "c0", prompts[0], decision)
        s1 = (await replicas["r1"].stats.remote()).engine
        assert s1.kv_transfer.blocks_pulled == 25 and s1.kv_transfer.load_failures == 0
        # r1 computes a prompt r0 never saw, leases it, and is killed before r0 pulls it.
        fresh = await tokens(router, "d0", prompts[3], Decision("r1", "test"))
        leased = await replicas["r1"].lease_prefix.remote(hash_block_tokens(prompts[3], 16))
        assert leased is not None and len(leased["remote_block_ids"]) == 25
        ray.kill(replicas["r1"], no_restart=True)
        while True:                   # ray.kill returns at once; the process goes a little later
            try:
                await replicas["r1"].info.remote()
            except ray.exceptions.RayActorError:
                break
            await asyncio.sleep(0.05)
        after_kill = await tokens(router, "e0", prompts[3], Decision("r0", "test"), leased)
        return {"first": first, "again": again, "pulled": pulled, "fresh": fresh, "after_kill": after_kill}

    out = asyncio.run(run())
    assert out["again"] == out["first"] and out["pulled"] == out["first"][0] and out["after_kill"] == out["fresh"]
    s0 = ray.get(replicas["r0"].stats.remote()).engine
    assert s0.kv_tier.host_hit_blocks >= 2 * 24 and s0.kv_tier.load_failures == 0
    # The pull from the killed peer failed (and r0 computed the prompt), or, when the peer's process
    # was still going away as the pull read its memory, it succeeded: either way the request ran.
    kv = s0.kv_transfer
    assert kv.prefix_leases == 1 and (kv.load_failures == 1 or kv.blocks_pulled == 25)
    assert metrics.routing.peer_pulls.get(pool="decode", outcome="leased") == 1
    assert eventually_no_leaks({"r0": replicas["r0"]})
    for h in replicas.values():
        ray.kill(h)
