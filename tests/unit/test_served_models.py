"""Several models behind one endpoint (unit): the `models:` spec and what it refuses, the ingress'
lookup of the model a request names, and the metrics of several models in one exposition."""
from __future__ import annotations

import asyncio
import os
import re

import pytest
from helpers import REPO, make_adapter

from cluster.config import ClusterConfig
from cluster.placement import placement_problems, required_cpus
from records.errors import InvalidRequestError, NotFoundError, ServiceUnavailableError
from records.sampling_params import SamplingParams
from router.ingress.served_models import ServedModels, label_samples, merge_expositions


def _two(tiny_llama: str, tiny_qwen2: str, adapter: str = "/adapters/ad1", **top) -> ClusterConfig:
    return ClusterConfig.model_validate({"models": [
        {"name": "llama", "aliases": ["tiny"], "model": tiny_llama, "mode": "disaggregated",
         "pools": {"prefill": {"replicas": 1}, "decode": {"replicas": 2}},
         "lora": {"modules": {"ad1": adapter}, "allow_runtime_updates": True}},
        {"name": "org/qwen", "model": tiny_qwen2, "engine": {"max_model_len": 256},
         "serving": {"reasoning_parser": "qwen3", "tool_call_parser": "hermes"}}], **top})


def test_each_model_entry_becomes_a_deployment_with_the_shared_sections(tiny_llama, tiny_qwen2):
    config = _two(tiny_llama, tiny_qwen2, serving={"port": 8123, "api_key": "k"}, routing={"name": "round_robin"})
    llama, qwen = config.deployments()
    assert (llama.name, qwen.name) == ("pdserve-llama", "pdserve-org-qwen")     # each its own manager
    assert llama.serving.served_model_names == ["llama", "tiny"] and qwen.serving.served_model_names == ["org/qwen"]
    assert llama.mode == "disaggregated" and llama.pools["decode"].replicas == 2 and llama.lora is not None
    assert qwen.mode == "colocated" and qwen.engine.max_model_len == 256 and qwen.lora is None
    assert (qwen.serving.reasoning_parser, qwen.serving.tool_call_parser) == ("qwen3", "hermes")
    assert (llama.serving.reasoning_parser, llama.serving.tool_call_parser) == (None, None)
    for d in (llama, qwen):
        assert d.serving.port == 8123 and d.serving.api_key == "k" and d.routing.name == "round_robin"
        assert d.models is None
    # A spec that crossed a process as JSON (the manager, Serve) is the same spec.
    assert ClusterConfig.model_validate_json(config.model_dump_json()).deployments() == [llama, qwen]
    # A one-model spec is its own only deployment.
    assert ClusterConfig(model=tiny_llama).deployments()[0].name == "pdserve"
    # Placement counts every model's pools: 3 + 1 replicas of 1 CPU and one ingress of 0.1.
    assert required_cpus(config) == pytest.approx(4.1)
    problems = placement_problems(config, [{"CPU": 2.0}])
    assert "the pools and the ingress need 4.1 CPU in all; the cluster has 2" in problems, problems


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


def test_the_ingress_picks_the_model_a_request_names(tiny_llama, tiny_qwen2, tmp_path):
    adapter = make_adapter(tiny_llama, str(tmp_path / "ad1"), 8, ["q_proj", "v_proj"], seed=3)
    models = ServedModels([d.ingress_spec() for d in _two(tiny_llama, tiny_qwen2, adapter).deployments()])
    llama, qwen = models.servers
    assert models.ids() == ["llama", "tiny", "ad1", "org/qwen"]
    for name, server in (("llama", llama), ("tiny", llama), ("ad1", llama), ("org/qwen", qwen)):
        assert models.pick(name) is server
    with pytest.raises(NotFoundError, match=r"model 'gpt-4' does not exist; this server serves \['llama', 'tiny', "
                                            r"'ad1', 'org/qwen'\]"):
        models.pick("gpt-4")
    with pytest.raises(InvalidRequestError, match="model is required"):
        models.pick(None)
    cards = models.models()["data"]
    assert [(c["id"], c["parent"], c["state"]) for c in cards] == [
        ("llama", None, "starting"), ("tiny", None, "starting"), ("ad1", "llama", "starting"),
        ("org/qwen", None, "starting")]
    assert models.model("org/qwen")["max_model_len"] == 256
    assert models.not_ready().startswith("starting: model llama: starting")
    # An adapter loaded at runtime may not take another model's id; it is served by the model named.
    with pytest.raises(InvalidRequestError, match="already served by the model 'org/qwen'"):
        models.load_adapter({"model": "llama", "lora_name": "org/qwen", "lora_path": "/nowhere"})
    # Tokenizing goes to the model named (each its own limits).
    assert qwen.frontend.preparer.tokenize({"model": "org/qwen", "prompt": "hi"})["max_model_len"] == 256
    # A batch line naming no served model is that line's 404 (a batch may mix models).
    status, body = asyncio.run(models.execute("/v1/completions", {"model": "nope", "prompt": "x"}, "default"))
    assert status == 404 and "this server serves" in body["error"]["message"]
    # A tenant limited to some models is refused the others (404, as OpenAI answers a model one
    # may not use), before anything is queued.
    limited = ServedModels([d.ingress_spec() for d in _two(tiny_llama, tiny_qwen2, adapter, serving={
        "tenants": {"team": {"api_keys": ["team-key"], "models": ["org/qwen"]}}}).deployments()])
    team = limited.first.frontend.tenants.by_name["team"]
    prompt, params = [[1, 2, 3]], SamplingParams(max_tokens=1)
    with pytest.raises(NotFoundError, match=r"model 'llama' is not available to tenant 'team'; "
                                            r"it may use \['org/qwen'\]"):
        asyncio.run(limited.first.frontend.admit(prompt, params, team))
    qwen = limited.servers[1].frontend
    with pytest.raises(ServiceUnavailableError, match="not ready"):      # (allowed: on to the pools)
        asyncio.run(qwen.admit(prompt, params, qwen.tenants.by_name["team"]))
    # With one model, a request need not name it.
    one = ServedModels([ClusterConfig(model=tiny_llama).ingress_spec()])
    assert one.pick(None) is one.first


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
