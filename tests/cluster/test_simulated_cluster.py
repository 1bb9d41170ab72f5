"""Dozens of simulated replicas on a local Ray (`engine.simulate`, cluster/replica_host.py): 32
replicas on 4 host processes behind the real Serve ingress and manager. Requests spread over them
(the official client, the real router), the manager shows them one by one, a scale-down drains 24
of them (and frees their hosts), and nothing is left on any replica."""
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


@pytest.mark.ray
def test_thirty_two_simulated_replicas_serve_behind_the_real_ingress(eventually_no_leaks):
    ray = pytest.importorskip("ray", reason="needs ray[serve] (make setup installs it)")
    from ray import serve

    from cluster.app import build_app
    from cluster.config import ClusterConfig
    from cluster.launch import init_ray, start_pools

    init_ray(num_cpus=8)
    port = free_port()
    engine = {"simulate": SIM_PROFILE, "max_model_len": 2048}
    config = ClusterConfig(engine=engine, pools={"decode": {"replicas": 32}}, serving={"port": port},
                           name="pdserve-sim-scale")
    assert config.pools["decode"].replicas_per_process == 8
    manager, _ = start_pools(config)            # (loading while Serve starts)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
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
        served = [r for r, h in pools["decode"].items() if ray.get(h.stats.remote())["prompt_tokens"] > 0]
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
        serve.shutdown()            # also its HTTP proxy, which holds this test's port
        ray.get(manager.shutdown.remote())
        ray.kill(manager)
