"""Simulated replicas on a local Ray (`engine.simulate`, cluster/replica_host.py) behind the real
Serve ingress and manager: 32 replicas on 4 host processes, requests spread over them (the official
client, the real router), the manager shows them one by one, a scale-down drains 24 of them (and
frees their hosts), and nothing is left on any replica; and a disaggregated model that scales to
zero when idle and back for its next request."""
from __future__ import annotations

import asyncio
import time

import openai
import pytest
from helpers import SIM_PROFILE, free_port, simulated_outputs


def host_actors(namespace: str) -> list[str]:
    """The live replica hosts' actor names (the pool names them `<spec>-<pool>-host-<n>`)."""
    import ray

    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == namespace and "-host-" in a["name"]]


@pytest.fixture(scope="module")
def serve_port():
    """Serve on a free loopback port of a local Ray, for the module's apps."""
    pytest.importorskip("ray", reason="needs ray[serve] (make setup installs it)")
    from ray import serve

    from cluster.launch import init_ray

    init_ray(num_cpus=8)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield port
    serve.shutdown()            # also its HTTP proxy, which holds the port


@pytest.mark.ray
def test_thirty_two_simulated_replicas_serve_behind_the_real_ingress(serve_port, eventually_no_leaks):
    import ray
    from ray import serve

    from cluster.app import build_app
    from cluster.config import ClusterConfig
    from cluster.launch import start_pools

    port = serve_port
    engine = {"simulate": SIM_PROFILE, "max_model_len": 2048}
    config = ClusterConfig(engine=engine, pools={"decode": {"replicas": 32}}, serving={"port": port},
                           name="pdserve-sim-scale")
    assert config.pools["decode"].replicas_per_process == 8
    manager, _ = start_pools(config)            # (loading while Serve deploys the ingress)
    serve.run(build_app(config), name=config.name, route_prefix="/sim")
    try:
        status = ray.get(manager.pool_status.remote())["decode"]
        assert len(status["replicas"]) == 32 and {r["state"] for r in status["detail"]} == {"serving"}
        assert len(host_actors(config.name)) == 4

        prompts = [f"Request {i} to the simulated cluster asks about the number {i}." for i in range(96)]
        want = simulated_outputs(prompts, 16, **{"max_model_len": 2048})

        async def send() -> list[str]:
            client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/sim/v1", api_key="none",
                                        max_retries=0, timeout=120)
            model = (await client.models.list()).data[0].id

            async def one(prompt: str) -> str:
                out = await client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0.0,
                                                      extra_body={"ignore_eos": True})
                return out.choices[0].text
            return await asyncio.gather(*[one(p) for p in prompts])

        assert asyncio.run(send()) == want
        _, pools = ray.get(manager.membership.remote())
        served = [r for r, h in pools["decode"].items() if ray.get(h.stats.remote()).engine.prompt_tokens > 0]
        assert len(served) >= 16, served           # the router spread them (least cost among idle replicas)

        out = ray.get(manager.scale.remote("decode", 8, 30.0))
        assert len(out["draining"]) == 24
        deadline = time.monotonic() + 120
        while (st := ray.get(manager.pool_status.remote())["decode"])["draining"] or len(st["replicas"]) != 8:
            assert time.monotonic() < deadline, st
            time.sleep(0.5)
        _, pools = ray.get(manager.membership.remote())
        assert eventually_no_leaks(pools["decode"])
        # The hosts emptied by the drain are gone: those left hold the 8 replicas.
        left = {h.host._actor_id for h in pools["decode"].values()}
        deadline = time.monotonic() + 60
        while {ray.get_actor(n, namespace=config.name)._actor_id for n in host_actors(config.name)} != left:
            assert time.monotonic() < deadline, left
            time.sleep(0.5)
    finally:
        serve.delete(config.name)
        ray.get(manager.shutdown.remote())
        ray.kill(manager)


@pytest.mark.ray
def test_a_model_scaled_to_zero_when_idle_answers_its_next_request(serve_port, eventually_no_leaks):
    """autoscaling min_replicas 0 on both pools of a disaggregated (simulated) model: idle past its
    idle timeout it goes to zero replicas (drained; /health stays 200, /v1/models says so), and the
    next request is held while one replica per pool starts, then answered as before."""
    import httpx
    import ray
    from ray import serve

    from cluster.app import build_app
    from cluster.config import ClusterConfig
    from cluster.launch import start_pools

    port = serve_port
    zero = {"min_replicas": 0, "max_replicas": 1, "idle_timeout_s": 1}
    config = ClusterConfig(engine={"simulate": SIM_PROFILE, "max_model_len": 2048}, mode="disaggregated",
                           pools={"prefill": {"replicas": 1, "autoscaling": zero},
                                  "decode": {"replicas": 1, "autoscaling": zero}},
                           disaggregation={"connector": "nixl", "min_remote_prefill_tokens": 8},
                           serving={"port": port}, name="pdserve-sim-zero")
    manager, _ = start_pools(config)
    serve.run(build_app(config), name=config.name, route_prefix="/zero")
    base = f"http://127.0.0.1:{port}/zero"
    try:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        prompt = "A request that finds the model scaled to zero waits for it, then runs."
        want = simulated_outputs([prompt], 16, max_model_len=2048)[0]

        def ask() -> str:
            return client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0.0,
                                             extra_body={"ignore_eos": True}).choices[0].text

        assert ask() == want
        deadline = time.monotonic() + 90
        while any((st := ray.get(manager.pool_status.remote()))[p]["replicas"] or st[p]["draining"]
                  for p in ("prefill", "decode")):
            assert time.monotonic() < deadline, st
            time.sleep(0.5)
        assert {p: st[p]["target"] for p in st} == {"prefill": 0, "decode": 0}
        assert not host_actors(config.name)                  # nothing left running
        deadline = time.monotonic() + 30                     # (the ingress follows the membership)
        while httpx.get(f"{base}/v1/models").json()["data"][0]["state"] != "scaled_to_zero":
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert httpx.get(f"{base}/health").status_code == 200
        began = time.monotonic()
        assert ask() == want                                 # held while a replica per pool starts
        cold_start_s = time.monotonic() - began
        st = ray.get(manager.pool_status.remote())
        assert {p: len(st[p]["replicas"]) for p in st} == {"prefill": 1, "decode": 1}, (st, cold_start_s)
        _, pools = ray.get(manager.membership.remote())
        assert eventually_no_leaks({r: h for pool in pools.values() for r, h in pool.items()})
    finally:
        serve.delete(config.name)
        ray.get(manager.shutdown.remote())
        ray.kill(manager)
