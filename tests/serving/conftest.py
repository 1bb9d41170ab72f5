"""The apps every serving test talks to, started once for the package on a local Ray: one Serve
instance on 127.0.0.1 (HTTP, and gRPC through Serve's proxy) with three apps of a tiny model, whose
pools load side by side:

- "/" main: two decode replicas, an API key and a tenant with its own key and a requests-per-minute
  limit, a 1 MiB body limit, a LoRA adapter served from the start and runtime adapter loading; the
  gRPC tests' app too (it was an app of its own, one more manager, ingress and engine to start);
- "/limited": four models behind one endpoint (`models:`): the tiny model on one replica (with the
  adapter "ad1"), a tiny Qwen2 ("qwen") disaggregated on two, a tiny LLaVA ("llava") and a tiny
  Gemma 3 ("gemma3") with images in (tests/serving/test_vision.py; a Qwen2-VL's through a P/D
  transfer and an encode pool: tests/cluster/test_node_loss.py) on one each; each admits one request at a time (429 /
  RESOURCE_EXHAUSTED); a reasoning parser whose constraints apply to the thinking too (so that one
  can make the tiny model think), and vLLM's metric names;
- "/pd": disaggregated, one prefill and one decode replica with KV pulled over NIXL; prompts with
  fewer than 32 uncached tokens are prefilled on the decode replica; traced to an OTLP receiver in
  this process, its requests logged, a host offload tier on the decode replica; a trainer's
  endpoints on (tests/serving/test_rollout.py).

Each serves the tiny model as "tiny" and "tiny-chat". At the end every replica must hold no request and
no KV block.
"""
from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from helpers import free_port, make_adapter, wait_healthy

from serving.apps import API_KEY, LIMITED, MAIN, PAGE_ORIGIN, TENANT, TENANT_KEY, auth, grpc_metadata

ray = pytest.importorskip("ray", reason="the serving tests need ray[serve] (make setup installs it)")


@pytest.fixture(scope="package")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, str]:
    """Two PEFT adapters of the tiny model: "ad1" served from the start, "ad2" loaded at runtime."""
    root = tmp_path_factory.mktemp("serving-adapters")
    return {"ad1": make_adapter(tiny_llama, str(root / "ad1"), 8, ["q_proj", "v_proj", "o_proj", "down_proj"], seed=21),
            "ad2": make_adapter(tiny_llama, str(root / "ad2"), 16, ["gate_proj", "up_proj", "k_proj"], seed=22)}


@pytest.fixture(scope="package")
def otlp():
    """The OTLP/gRPC trace receiver the disaggregated app exports its spans to (tests/otlp_collector.py)."""
    from otlp_collector import Collector

    collector = Collector("grpc")
    yield collector
    collector.close()


@pytest.fixture(scope="package")
def apps(tiny_llama, tiny_qwen2, tiny_llava, tiny_gemma3_vl, adapters, eventually_no_leaks, otlp):
    """Start the three apps; yield (http port, gRPC port, app name -> its manager's handle (and
    "qwen" -> the /limited app's second model's), app name -> its spec)."""
    from ray import serve
    from ray.serve.api import RunTarget

    from cluster.app import build_app
    from cluster.config import ClusterConfig
    from cluster.launch import grpc_start_options, init_ray, start_pools
    from cluster.manager import MANAGER_NAME

    init_ray(num_cpus=10)
    port, grpc_port = free_port(), free_port()
    engine = {"dtype": "float32", "max_model_len": 1024, "max_num_seqs": 16}
    # The apps answer at once and load their pools side by side (/health says when they serve).
    serving = {"port": port, "grpc_port": grpc_port, "wait_for_pools": False,
               "served_model_name": ["tiny", "tiny-chat"]}        # (vLLM's --served-model-name tiny tiny-chat)
    lora = {"modules": {"ad1": adapters["ad1"]}, "max_loras": 2}
    main = ClusterConfig(model=tiny_llama, engine=engine, pools={"decode": {"replicas": 2, "num_cpus": 1}},
                         serving={**serving, "api_key": API_KEY, "max_body_bytes": 1 << 20,
                                  "tenants": {TENANT: {"api_keys": [TENANT_KEY], "requests_per_minute": 3}}},
                         name=MAIN,
                         lora={**lora, "allow_runtime_updates": True})
    # Two models behind one endpoint (`models:`): the tiny Llama colocated, and a tiny Qwen2 served
    # disaggregated as "qwen" with a shorter context.
    shared = {k: v for k, v in serving.items() if k != "served_model_name"}
    limited = ClusterConfig(models=[
        {"name": "tiny", "aliases": ["tiny-chat"], "model": tiny_llama, "engine": engine,
         "pools": {"decode": {"replicas": 1, "num_cpus": 1}}, "lora": lora},
        {"name": "qwen", "model": tiny_qwen2, "engine": {**engine, "max_model_len": 512}, "mode": "disaggregated",
         "pools": {"prefill": {"replicas": 1, "num_cpus": 1}, "decode": {"replicas": 1, "num_cpus": 1}},
         "disaggregation": {"connector": "nixl", "min_remote_prefill_tokens": 32}},
        {"name": "llava", "model": tiny_llava, "engine": {**engine, "max_model_len": 512,
                                                          "limit_mm_per_prompt": {"image": 2},
                                                          "allowed_media_domains": ["127.0.0.1"]},
         "pools": {"decode": {"replicas": 1, "num_cpus": 1}}},
        {"name": "gemma3", "model": tiny_gemma3_vl, "engine": {**engine, "max_model_len": 512},
         "pools": {"decode": {"replicas": 1, "num_cpus": 1}}}],
        serving={**shared, "max_in_flight": 1, "reasoning_parser": "qwen3",
                 "structured_outputs_in_reasoning": True, "metrics_prefix": "vllm",
                 "allowed_origins": [PAGE_ORIGIN], "allow_credentials": True},
        name=LIMITED)
    # Traced (every process's spans to `otlp`), its requests logged, and an offload tier on its
    # decode pool: tests/serving/test_observability.py reads all three. Its prefill pool runs at
    # niceness 5 (tests/serving/test_endpoints.py).
    pd = ClusterConfig(model=tiny_llama, engine=engine, mode="disaggregated",
                       pools={"prefill": {"replicas": 1, "num_cpus": 1, "niceness": 5},
                              "decode": {"replicas": 1, "num_cpus": 1, "kv_offloading": {"size_gib": 0.01}}},
                       disaggregation={"connector": "nixl", "min_remote_prefill_tokens": 32},
                       serving={**serving, "otlp_traces_endpoint": otlp.endpoint, "log_requests": True,
                                "enable_weight_updates": True},
                       name="pdserve-pd", lora=lora)
    configs = {"main": (main, "/"), "limited": (limited, "/limited"), "pd": (pd, "/pd")}
    for config, _ in configs.values():          # the pools load while Serve starts (as the launcher's)
        for deployment in config.deployments():
            start_pools(deployment)
    serve.start(http_options={"host": "127.0.0.1", "port": port}, **grpc_start_options(main))
    # The three at once: their ingress replicas start side by side. (With the pools started first,
    # this fixture's setup took 30.4 s here, against 36.9 s with each app's ingress starting its
    # pools, one app after another.)
    serve.run_many([RunTarget(build_app(config), name=config.name, route_prefix=prefix)
                    for config, prefix in configs.values()])
    base = f"http://127.0.0.1:{port}"
    for _, prefix in configs.values():
        wait_healthy(f"{base}{prefix.rstrip('/')}")
    # Each model's manager (the /limited app's second model's as "qwen").
    managers = {name if i == 0 else d.serving.served_model_names[0]: ray.get_actor(MANAGER_NAME, namespace=d.name)
                for name, (config, _) in configs.items() for i, d in enumerate(config.deployments())}
    yield port, grpc_port, managers, {name: config for name, (config, _) in configs.items()}
    for name, manager in managers.items():      # block accounting on every replica: nothing left behind
        pools = ray.get(manager.membership.remote())[1]
        replicas = {r: h for pool in pools.values() for r, h in pool.items()}
        leaks = eventually_no_leaks(replicas)
        assert leaks, f"a replica of the {name} app kept requests or blocks after the tests: {leaks}"
    serve.shutdown()
    for manager in managers.values():
        ray.get(manager.shutdown.remote())
        ray.kill(manager)


@pytest.fixture(scope="package")
def server(apps) -> dict:
    """The HTTP side: base URL, port, each app's replicas (app -> replica id -> handle), the main,
    limited and disaggregated apps' managers, and the served model's name."""
    port, _, managers, _ = apps
    base = f"http://127.0.0.1:{port}"
    replicas = {}
    for name in ("main", "limited", "pd"):
        _, pools = ray.get(managers[name].membership.remote())
        replicas[name] = {r: h for pool in pools.values() for r, h in pool.items()}
    return {"base": base, "port": port, "replicas": replicas,
            "managers": [managers["main"], managers["limited"], managers["pd"]],
            "model": json.loads(httpx.get(f"{base}/v1/models", headers=auth()).text)["data"][0]["id"]}


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server['base']}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="package")
def grpc_server(apps) -> dict:
    """The gRPC side: a stub on the proxy's port (metadata picks the app: serving.apps.grpc_metadata),
    the messages module, the main app's HTTP base, and the main and limited apps' managers."""
    grpc = pytest.importorskip("grpc")
    from pdserve_proto import pb2, pb2_grpc

    port, grpc_port, managers, _ = apps
    channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
    stub = pb2_grpc.GenerationStub(channel)
    deadline = time.monotonic() + 120
    while True:
        try:
            if stub.Health(pb2.HealthRequest(), metadata=grpc_metadata(), timeout=10).healthy:
                break
        except grpc.RpcError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.5)
    yield {"stub": stub, "pb2": pb2, "http": f"http://127.0.0.1:{port}",
           "managers": [managers["main"], managers["limited"]],
           "model": stub.Models(pb2.ModelsRequest(), metadata=grpc_metadata()).models[0].id}
    channel.close()
