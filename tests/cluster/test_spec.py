"""The cluster spec on real models' configs, without Ray: its validation and YAML, each entry of a
`models:` spec a deployment with the shared sections, and the ingress picking the model a request
names (names, aliases, adapters, tenants). (tests/unit holds what needs no model.)"""
from __future__ import annotations

import asyncio

import pytest
from helpers import make_adapter

from cluster.config import ClusterConfig
from cluster.placement import placement_problems, required_cpus
from records.errors import InvalidRequestError, NotFoundError, ServiceUnavailableError
from records.sampling_params import SamplingParams
from router.ingress.served_models import ServedModels


def test_cluster_spec_validates_and_loads_yaml(tmp_path, tiny_llama):
    from pydantic import ValidationError

    from cluster.config import ClusterConfig

    spec = tmp_path / "spec.yaml"
    spec.write_text("pools: {decode: {replicas: 3}}\nrouting: {name: least_load}\nserving: {port: 9000}\n")
    config = ClusterConfig.from_yaml(str(spec))
    assert (config.pools["decode"].replicas, config.routing.name, config.serving.port) == (3, "least_load", 9000)
    with pytest.raises(ValidationError, match="routing.name"):
        ClusterConfig(routing={"name": "random"})
    with pytest.raises(ValidationError, match="replicas"):
        ClusterConfig(pools={"decode": {"replicas": 0}})
    with pytest.raises(ValidationError, match="needs a 'prefill' pool"):
        ClusterConfig(mode="disaggregated")
    with pytest.raises(ValidationError, match="mode is 'colocated'"):
        ClusterConfig(pools={"prefill": {}, "decode": {}})
    with pytest.raises(ValidationError, match="disaggregation.connector"):
        ClusterConfig(mode="disaggregated", pools={"prefill": {}, "decode": {}},
                      disaggregation={"connector": "tcp"})
    with pytest.raises(ValidationError, match="kv_connector"):
        ClusterConfig(engine={"kv_connector": "nixl"})
    pd = ClusterConfig(mode="disaggregated", pools={"prefill": {}, "decode": {}},
                       disaggregation={"connector": "torch_dist", "min_remote_prefill_tokens": 64})
    assert pd.disaggregation.engine_args()["kv_connector"] == "torch_dist"
    static = ClusterConfig(model=tiny_llama, engine={"batching": "static"})
    assert static.engine_config().scheduler_config.batching == "static"
    with pytest.raises(ValueError, match="batching must be one of"):
        ClusterConfig(model=tiny_llama, engine={"batching": "barrier"})


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
