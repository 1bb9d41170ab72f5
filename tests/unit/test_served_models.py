"""Several models behind one endpoint (unit): the `models:` specs refused, the metrics of several
models in one exposition, room for a model's pools, single flights. (What needs a model's config,
each entry a deployment and the ingress' lookup of the model a request names, is in
tests/cluster/test_spec.py.)"""
from __future__ import annotations

import asyncio
import os
import re

import pytest
from helpers import REPO

from cluster.config import ClusterConfig
from router.ingress.served_models import label_samples, merge_expositions


def test_the_two_model_example_spec_loads():
    smol, qwen = ClusterConfig.from_yaml(os.path.join(REPO, "deploy/examples/two-models.yaml")).deployments()
    assert smol.serving.served_model_names == ["smol", "chat"] and smol.mode == "disaggregated" and smol.model is None
    assert qwen.serving.served_model_names == ["qwen"] and qwen.pools["decode"].replicas == 2


@pytest.mark.parametrize("models,top,message", [
    ([{"name": "a", "model": None}, {"name": "b", "aliases": ["a"], "model": None}], {},
     "'a' is claimed by a (name/aliases), b (name/aliases)"),
    ([{"name": "a", "model": None}, {"name": "a", "model": None}], {}, "'a' is claimed by a (name/aliases), a"),
    ([{"name": "a", "aliases": ["x"], "model": None},
      {"name": "b", "model": None, "lora": {"modules": {"x": "/p"}}}], {},
     "'x' is claimed by a (name/aliases), b (lora.modules)"),
    ([{"name": "a", "model": None}, {"name": "b"}], {}, "models entry 'b' has no model"),
    ([{"name": "a", "model": None}], {"engine": {"max_model_len": 64}}, "['engine'] belong to each models entry"),
    ([{"name": "a", "model": None}], {"serving": {"served_model_name": "x"}}, "serving.served_model_name is not used"),
    ([{"name": "a/b", "model": None}, {"name": "a b", "model": None}], {}, "would share the manager namespace"),
    ([], {}, "models must list at least one model"),
    ([{"name": "a", "model": None, "serving": {"port": 9000}}], {}, "serving ['port']: a model may set only"),
    ([{"name": "a", "model": None, "serving": {"reasoning_parser": "nope"}}], {}, "reasoning_parser"),
    ([{"name": "a", "model": None, "lora": {"modules": {"ad": "/p"}}}],
     {"serving": {"tenants": {"t": {"api_keys": ["k"], "models": ["ad", "b"]}}}},
     "serving.tenants.t.models: ['ad', 'b'] name no model of models"),
])
def test_a_models_spec_that_cannot_be_served_is_refused_naming_the_entries(models, top, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ClusterConfig.model_validate({"models": models, **top})


def test_several_models_metrics_are_one_exposition_labelled_by_model():
    a = ("# HELP pdserve:requests_total Requests.\n# TYPE pdserve:requests_total counter\n"
         'pdserve:requests_total{finished_reason="stop"} 3\n'
         "# HELP pdserve:in_flight In flight.\n# TYPE pdserve:in_flight gauge\npdserve:in_flight 1\n")
    b = ("# HELP pdserve:requests_total Requests.\n# TYPE pdserve:requests_total counter\n"
         'pdserve:requests_total{finished_reason="length"} 2\n'
         "# HELP pdserve:latency_s Latency.\n# TYPE pdserve:latency_s histogram\n"
         'pdserve:latency_s_bucket{le="+Inf"} 1\npdserve:latency_s_sum 0.5\npdserve:latency_s_count 1\n')
    merged = merge_expositions([label_samples(a, {"model_name": "m1"}), label_samples(b, {"model_name": 'o"q'})])
    assert merged.splitlines() == [
        "# HELP pdserve:requests_total Requests.", "# TYPE pdserve:requests_total counter",
        'pdserve:requests_total{model_name="m1",finished_reason="stop"} 3',
        'pdserve:requests_total{model_name="o\\"q",finished_reason="length"} 2',
        "# HELP pdserve:in_flight In flight.", "# TYPE pdserve:in_flight gauge",
        'pdserve:in_flight{model_name="m1"} 1',
        "# HELP pdserve:latency_s Latency.", "# TYPE pdserve:latency_s histogram",
        'pdserve:latency_s_bucket{model_name="o\\"q",le="+Inf"} 1', 'pdserve:latency_s_sum{model_name="o\\"q"} 0.5',
        'pdserve:latency_s_count{model_name="o\\"q"} 1']


def test_room_for_a_model_is_every_pool_or_none():
    """`room_problems` (cluster/placement.py), what a model of several waits on before it starts:
    its replicas' bundles first-fit onto what the nodes have free. Two models fill three nodes
    between them, sharing one; a third finds no room, and the problem names its pool and bundle."""
    from cluster.placement import room_problems

    def model(name: str, replicas: int, mode: str = "colocated") -> dict:
        pools = {"decode": {"replicas": replicas, "num_cpus": 1, "resources": {"slot": 1}}}
        if mode == "disaggregated":
            pools["prefill"] = {"replicas": 1, "num_cpus": 1, "resources": {"slot": 1}}
        return {"name": name, "model": None, "mode": mode, "pools": pools}

    spec = ClusterConfig.model_validate({"models": [model("a", 2, "disaggregated"), model("b", 3),
                                                    model("c", 1)]})
    a, b, c = spec.deployments()
    nodes = [{"CPU": 2.0, "slot": 2.0} for _ in range(3)]
    assert room_problems(a, nodes) == []
    # What a holds (3 of the 6 slots, placed as Ray would: first fit), then b's 3 fill the rest.
    for bundle in [{"CPU": 1.0, "slot": 1.0}] * 3:
        node = next(n for n in nodes if n["slot"] >= 1)
        for k, v in bundle.items():
            node[k] -= v
    assert [n["slot"] for n in nodes] == [0.0, 1.0, 2.0]        # a: two on the first node, one on the second
    assert room_problems(b, nodes) == []                         # b fits: on the second node too (shared)
    for bundle in [{"CPU": 1.0, "slot": 1.0}] * 3:
        node = next(n for n in nodes if n["slot"] >= 1)
        for k, v in bundle.items():
            node[k] -= v
    assert room_problems(c, nodes) == [
        "models[c].pools.decode: 1 of its bundles ({CPU: 1, slot: 1} each) do not fit what the nodes have free"]


def test_a_single_flight_runs_once_for_every_caller_while_it_runs():
    """records/single_flight.py, behind every wake and start from zero: callers during a run share
    it (result or error), a cancelled caller does not cancel it, and the next call runs anew."""
    from records.single_flight import SingleFlight

    async def scenario() -> None:
        flight: SingleFlight[int] = SingleFlight()
        runs = []

        async def job() -> int:
            runs.append(1)
            await asyncio.sleep(0.05)
            if len(runs) == 2:
                raise RuntimeError("second run fails")
            return len(runs)

        waiter = asyncio.ensure_future(flight.run(job))
        await asyncio.sleep(0.01)
        waiter.cancel()                                  # its run goes on for the others
        assert await asyncio.gather(flight.run(job), flight.run(job)) == [1, 1] and len(runs) == 1
        assert not flight.running
        with pytest.raises(RuntimeError, match="second run fails"):
            await asyncio.gather(flight.run(job), flight.run(job))
        assert len(runs) == 2 and await flight.run(job) == 3

    asyncio.run(scenario())
