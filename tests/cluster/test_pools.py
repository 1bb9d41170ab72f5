"""Pools that heal, and a launcher that fails fast and shuts down cleanly.

- Placement: a spec that the Ray cluster can never hold is refused with a message naming the pool
  and the resource (unit), and `python -m cluster.launch` exits with it instead of hanging on a
  pending actor; a replica that Ray cannot place now (another workload holds the CPUs) fails the
  start within the timeout, naming the resource; a spec with an unknown field exits before Ray
  starts.
- Replacement: on a real Serve app (127.0.0.1) with two decode replicas, killing one replica's actor
  leaves the service answering (requests routed to the dead replica go to the other one), the pool
  starts a replacement that joins the routing, and a request that was streaming from a replica
  when it died goes on from the other one, reading as one stream. A manager whose process dies
  is restarted by Ray and adopts the live replicas, and heals the pool afterwards.
- `pdserve serve` (no config: 1 prefill + 1 decode replica over NIXL) answers a completion and the
  serving benchmarks (benchmarks/serve.py, benchmarks/compare.py) and, on SIGINT to its process
  group (Ctrl-C), exits 0 leaving no Ray process behind; with `serving.direct_ingress` the
  ingress replica itself listens on the port.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import psutil
import pytest
from helpers import REPO, SIM_PROFILE, free_port, kill_replica, simulated_outputs, wait_gone, wait_healthy

from cluster.config import ClusterConfig
from cluster.placement import placement_problems, replica_bundles
from records.errors import StartupError


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    env["PATH"] = f"{os.path.dirname(sys.executable)}:{env.get('PATH', '')}"
    return env


# --- spec (unit) -----------------------------------------------------------------------------------
def test_the_serving_spec_s_ray_environment():
    """What Ray's processes must read for direct ingress and the proxies' channel, and the launch's
    check of a cluster's environment against it."""
    serving = ClusterConfig(serving={"port": 8123, "direct_ingress": True}).serving
    assert serving.ray_env() == {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
                                 "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": "8123",
                                 "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": "8124",
                                 "RAY_SERVE_PROXY_USE_GRPC": "1"}
    with pytest.raises(StartupError, match="direct_ingress: this Ray cluster was not started with"):
        serving.check_ray_env({"RAY_SERVE_PROXY_USE_GRPC": "1"})
    assert serving.check_ray_env(serving.ray_env()) is None
    default = ClusterConfig().serving
    assert default.ray_env() == {"RAY_SERVE_PROXY_USE_GRPC": "1"}
    assert "Serve's proxies will use 'ray'" in default.check_ray_env({})
    ray_channel = ClusterConfig(serving={"proxy_channel": "ray"}).serving
    assert ray_channel.ray_env() == {"RAY_SERVE_PROXY_USE_GRPC": "0"}
    assert ray_channel.check_ray_env({}) is None
    assert "will use 'grpc'" in ray_channel.check_ray_env(default.ray_env())
    with pytest.raises(ValueError, match="proxy_channel"):
        ClusterConfig(serving={"proxy_channel": "http"})
    for bad in ({"ingress_replicas": 2}, {"grpc_port": 9000}):
        with pytest.raises(ValueError, match="direct_ingress needs ingress_replicas = 1 and no grpc_port"):
            ClusterConfig(serving={"direct_ingress": True, **bad})


def test_an_unchanged_spec_read_back_is_the_same_spec_and_its_pools_the_same_pools(tmp_path):
    """What `pdserve apply` compares: a spec written to YAML (keys sorted) and read back has the
    fingerprint it had, and each pool's tag is the same on every resolution of its engine config
    (the KV connector's engine id is drawn afresh each time: every spec change used to replace a
    disaggregated deployment's replicas)."""
    import yaml

    from cluster.manager import fingerprint
    from cluster.pool import pool_tag

    config = ClusterConfig(mode="disaggregated", engine={"max_model_len": 512},
                           pools={"prefill": {"replicas": 1}, "decode": {"replicas": 2}})
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(json.loads(config.model_dump_json())))
    assert list(ClusterConfig.from_yaml(str(path)).pools) == ["decode", "prefill"]      # (reordered)
    assert fingerprint(ClusterConfig.from_yaml(str(path))) == fingerprint(config)
    for name, spec in config.pools.items():
        first, second = config.engine_config(name), config.engine_config(name)
        assert first.kv_transfer_config.engine_id != second.kv_transfer_config.engine_id
        assert pool_tag(name, spec, first) == pool_tag(name, spec, second)
    resized = ClusterConfig.model_validate({**config.model_dump(), "routing": {"load_weight": 0.9}})
    assert fingerprint(resized) != fingerprint(config)


# --- starting a local Ray (unit: ray.init stands in) ------------------------------------------------
@pytest.mark.parametrize("errors,started", [([], 1), (["gcs"], 2), (["raylet"], 2), (["gcs", "raylet"], None),
                                            (["other"], None)])
def test_a_local_ray_that_did_not_come_up_is_started_once_more(monkeypatch, errors, started):
    """Ray's errors for a GCS that never published its port and a raylet that never registered:
    `init_ray` kills what the failed start left and starts a new local Ray once; any other error,
    or a second such failure, reaches the caller."""
    import ray

    from engine.executor import ray_cluster

    calls, killed = [], []
    messages = {"gcs": "Timed out waiting for file /tmp/ray/session_x/gcs_server_port_0a1b",
                "raylet": "The current node timed out during startup. This could happen because ...",
                "other": "something else"}

    def init(**kwargs):
        calls.append(kwargs)
        if len(calls) <= len(errors):
            raise (RuntimeError if errors[len(calls) - 1] == "gcs" else Exception)(messages[errors[len(calls) - 1]])

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray_cluster, "_single_machine_mode", lambda: None)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(ray_cluster, "_kill_ray_children", lambda: killed.append(len(calls)))
    if started is None:
        with pytest.raises(Exception, match=messages[errors[-1]]):
            ray_cluster.init_ray(num_cpus=2)
    else:
        assert ray_cluster.init_ray(num_cpus=2) is True
    assert len(calls) == (started or len(errors))
    assert killed == ([1] if len(calls) == 2 else [])
    assert all(c["address"] == "local" and c["num_cpus"] == 2 for c in calls)


# --- placement (unit) ------------------------------------------------------------------------------
def test_placement_problems_name_the_pool_and_resource():
    gpu_pool = ClusterConfig(pools={"decode": {"replicas": 2, "num_gpus": 1}})
    cpu_node = {"CPU": 16.0, "memory": 1e10}
    problems = placement_problems(gpu_pool, [cpu_node])
    assert any("pools.decode" in p and "GPU: 1" in p for p in problems), problems
    assert any("need 2 GPU in all; the cluster has 0" in p for p in problems), problems
    assert placement_problems(gpu_pool, [{"CPU": 4.0, "GPU": 1.0}, {"CPU": 4.0, "GPU": 1.0}]) == []
    pinned = ClusterConfig(serving={"ingress_resources": {"frontend": 0.01}})
    assert placement_problems(pinned, [cpu_node]) == [
        "serving: no node can hold an ingress replica's {CPU: 0.1, frontend: 0.01} (ingress_num_cpus, "
        "ingress_resources)"]
    assert placement_problems(pinned, [cpu_node, {"CPU": 1.0, "frontend": 1.0}]) == []
    # Each replica fits a node, but three do not fit two GPUs.
    three = ClusterConfig(pools={"decode": {"replicas": 3, "num_gpus": 1}})
    assert placement_problems(three, [{"CPU": 4.0, "GPU": 2.0}]) == [
        "the pools need 3 GPU in all; the cluster has 2"]


def test_placement_of_multi_rank_pools_and_custom_resources():
    # TP=4 ranks of 1 GPU must share a node: 4 GPUs in all, but never 4 on one node.
    tp4 = ClusterConfig(pools={"decode": {"tensor_parallel_size": 4, "num_gpus": 1, "num_cpus": 2}})
    assert replica_bundles(tp4.pools["decode"]) == [{"CPU": 0.1}, {"CPU": 8.0, "GPU": 4.0}]
    two_nodes = [{"CPU": 16.0, "GPU": 2.0}, {"CPU": 16.0, "GPU": 2.0}]
    assert any("no node can hold" in p and "GPU: 4" in p for p in placement_problems(tp4, two_nodes))
    # PP=2 stages of TP=2 may use one node each.
    pp2 = ClusterConfig(pools={"decode": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2,
                                          "num_gpus": 1}})
    assert placement_problems(pp2, two_nodes) == []
    # A pool pinned by a custom resource that no node offers.
    pinned = ClusterConfig(mode="disaggregated", pools={
        "prefill": {"resources": {"pdserve_prefill": 1}}, "decode": {"resources": {"pdserve_decode": 1}}})
    problems = placement_problems(pinned, [{"CPU": 8.0, "pdserve_decode": 100.0}])
    assert any(p.startswith("pools.prefill") and "pdserve_prefill" in p for p in problems), problems
    assert not any(p.startswith("pools.decode") for p in problems), problems


def test_unknown_field_fails_before_ray_starts(tmp_path):
    spec = tmp_path / "bad.yaml"
    spec.write_text("pools:\n  decode: {replicas: 1, gpus: 1}\n")
    # (no bound on its wall time: this test runs in the lane without Ray, at idle priority, where
    # 1 s alone took 25 s beside the Ray lane; that no Ray started is the point)
    done = subprocess.run([sys.executable, "-m", "cluster.launch", "--config", str(spec)], env=_env(),
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "pools.decode.gpus" in done.stderr and "Extra inputs are not permitted" in done.stderr
    assert "Traceback" not in done.stderr and "Started a local Ray" not in done.stderr + done.stdout


def _descendants(pid: int) -> list:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


@pytest.mark.ray
def test_impossible_placement_fails_fast(tmp_path, tiny_llama):
    spec = tmp_path / "gpu.yaml"
    spec.write_text(f"model: {tiny_llama}\npools:\n  decode: {{replicas: 1, num_gpus: 1}}\n")
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "cluster.launch", "--config", str(spec), "--num-cpus", "2",
                             "--port", str(free_port())], env=_env(), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=180)
    finally:
        proc.kill()
    assert proc.returncode == 2, err[-3000:]
    assert "pdserve: error: the Ray cluster cannot hold the pools" in err
    assert "pools.decode: no node can hold {CPU: 1, GPU: 1}" in err and "the cluster has 0" in err
    assert time.monotonic() - start < 150


# --- replacement on a live Serve app ---------------------------------------------------------------
@pytest.mark.ray
def test_a_replica_that_cannot_be_placed_fails_naming_the_resource(tiny_llama):
    """The cluster's total would hold the pool, but another workload holds the CPUs: the start fails
    within the placement timeout naming what a replica needs and what is free (never a pending
    actor forever)."""
    import ray

    from cluster.config import ClusterConfig
    from cluster.launch import init_ray
    from cluster.pool import EnginePool
    from records.errors import PlacementError

    init_ray(num_cpus=8)
    free = ray.available_resources().get("CPU", 0.0)
    blocker = ray.remote(num_cpus=max(free - 0.5, 0.01))(type("Blocker", (), {"ping": lambda self: 1})).remote()
    ray.get(blocker.ping.remote())
    config = ClusterConfig(model=tiny_llama, engine={"dtype": "float32"}, pools={"decode": {"num_cpus": 1}})
    pool = EnginePool("decode", config.pools["decode"], config.engine_config(), "pdserve-unplaced")
    pool.start()
    try:
        start = time.monotonic()
        with pytest.raises(PlacementError, match=r"pools.decode: replica decode-0 was not placed within 3 s: "
                                                 r"one replica needs \{CPU: 1\}; the cluster has \{CPU: 0\.[0-9]+"):
            asyncio.run(pool.wait_ready(place_timeout_s=3.0))
        assert time.monotonic() - start < 30
    finally:
        pool.shutdown()
        ray.kill(blocker)


@pytest.fixture(scope="module")
def heal(eventually_no_leaks):
    """A Serve app of two simulated decode replicas, each in a process of its own (the cluster is the
    subject here; the real engine's replicas meet the same paths in test_node_loss.py and tests/serving)."""
    ray = pytest.importorskip("ray", reason="needs ray[serve] (make setup installs it)")
    from ray import serve

    from cluster.app import build_app
    from cluster.launch import grpc_start_options, init_ray, start_pools

    init_ray(num_cpus=8)
    port, grpc_port = free_port(), free_port()
    config = ClusterConfig(engine=HEAL_ENGINE, pools={"decode": {"replicas": 2, "replicas_per_process": 1}},
                           serving={"port": port, "grpc_port": grpc_port}, name="pdserve-heal")
    manager, _ = start_pools(config)            # (loading while Serve starts)
    serve.start(http_options={"host": "127.0.0.1", "port": port}, **grpc_start_options(config))
    serve.run(build_app(config), name=config.name, route_prefix="/heal")
    base = f"http://127.0.0.1:{port}/heal"
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)
    yield {"base": base, "manager": manager, "client": client, "model": client.models.list().data[0].id,
           "grpc_port": grpc_port, "name": config.name, "config": config}
    assert eventually_no_leaks(ray.get(manager.replicas.remote("decode"))), \
        "a replica kept requests or blocks after the tests"
    serve.shutdown()            # also its HTTP proxy, which holds this module's port
    ray.get(manager.shutdown.remote())
    ray.kill(manager)


# Simulated replicas at an H200's pace: a stream of 400 tokens lasts two seconds or more, long
# enough to lose its replica midway.
HEAL_ENGINE = {"simulate": SIM_PROFILE, "max_model_len": 2048, "max_num_seqs": 8}
HEAL_ORACLE = {k: v for k, v in HEAL_ENGINE.items() if k not in ("simulate", "simulate_time_scale")}


def _wait_for_membership(manager, gone: str, size: int, timeout: float = 120.0) -> dict:
    import ray

    deadline = time.monotonic() + timeout
    while True:
        _, pools = ray.get(manager.membership.remote())
        if gone not in pools["decode"] and len(pools["decode"]) == size:
            return pools["decode"]
        assert time.monotonic() < deadline, f"the pool was not healed: {ray.get(manager.pool_status.remote())}"
        time.sleep(0.5)


@pytest.mark.ray
def test_killed_replica_is_replaced_while_the_service_keeps_answering(heal):
    import ray

    manager, client = heal["manager"], heal["client"]
    _, pools = ray.get(manager.membership.remote())
    before = pools["decode"]
    victim = sorted(before)[0]
    kill_replica(before[victim])
    # Requests keep succeeding: one routed to the dead replica fails there before any output and
    # is sent to the live one.
    # The prompts span full KV blocks, so the survivor ends up caching some and the replacement (which
    # caches none) wins the policy's tie-break below, not a coin flip.
    story = "tell me about the history of the old city, its rivers, bridges and markets. " * 3
    for i in range(6):
        out = client.completions.create(model=heal["model"], prompt=f"request {i}: {story}", max_tokens=4,
                                        temperature=0.0, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 4
    now = _wait_for_membership(manager, victim, 2)
    replacement = (set(now) - set(before)).pop()
    status = ray.get(manager.pool_status.remote())["decode"]
    assert status["replaced"] == 1 and victim not in status["replicas"], status
    metrics = httpx.get(f"{heal['base']}/metrics", timeout=10).text
    assert 'pdserve:replicas_replaced_total{pool="decode"} 1' in metrics, metrics

    deadline = time.monotonic() + 30
    while True:          # the ingress follows the membership: the replacement is routed to
        health = httpx.get(f"{heal['base']}/health", timeout=10)
        if health.status_code == 200 and set(health.json()["pools"]["decode"]) == set(now):
            break
        assert time.monotonic() < deadline, health.text
        time.sleep(0.5)
    assert all(health.json()["pools"]["decode"].values())
    survivor = (set(now) - {replacement}).pop()
    _, events = ray.get(now[survivor].kv_event_records_since.remote(0))
    assert any(type(e).__name__ == "BlockStored" and e.block_hashes for e in events), events
    for i in range(4):       # distinct prompts, no cache hit: ties go to the replica caching least
        client.completions.create(model=heal["model"], prompt=f"another {i} prompt entirely", max_tokens=2,
                                  temperature=0.0)
    assert ray.get(now[replacement].stats.remote()).engine.prompt_tokens > 0


@pytest.mark.ray
def test_a_stream_whose_replica_dies_migrates_and_reads_as_one(heal):
    """The replica streaming a request is killed mid-decode: the stream goes on from another replica
    (resumed after the tokens already sent), and the client reads the same text, token count and
    finish reason as an uninterrupted run; the migration is counted in /metrics."""
    manager, client = heal["manager"], heal["client"]
    kwargs = dict(model=heal["model"], prompt="Count slowly:", max_tokens=400, temperature=0.0,
                  extra_body={"ignore_eos": True})
    expected = simulated_outputs([kwargs["prompt"]], 400, **HEAL_ORACLE)[0]
    stream = client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    chunks = iter(stream)
    text = [next(chunks).choices[0].text]
    lost = _kill_the_running_replica(manager)
    finish, usage = None, None
    for chunk in chunks:
        if chunk.choices:
            text.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        usage = chunk.usage or usage
    assert "".join(text) == expected
    assert (finish, usage.completion_tokens) == ("length", 400)
    metrics = httpx.get(f"{heal['base']}/metrics", timeout=10).text
    assert 'pdserve:request_migrations_total{pool="decode"} 1' in metrics, metrics
    assert 'pdserve:pool_replicas{pool="decode",state="target"} 2' in metrics, metrics
    _wait_for_membership(manager, lost, 2)


def _kill_the_running_replica(manager) -> str:
    import ray

    _, pools = ray.get(manager.membership.remote())
    running = [r for r, h in pools["decode"].items() if ray.get(h.stats.remote()).engine.num_requests_running]
    assert len(running) == 1, running
    kill_replica(pools["decode"][running[0]])
    return running[0]


@pytest.mark.ray
def test_a_grpc_stream_whose_replica_dies_migrates_too(heal):
    """The same over gRPC: one stream, the uninterrupted run's text and token count."""
    grpc = pytest.importorskip("grpc")
    from pdserve_proto import pb2, pb2_grpc

    manager = heal["manager"]
    expected = simulated_outputs(["Count on:"], 400, **HEAL_ORACLE)[0]
    request = pb2.GenerateRequest(text="Count on:", sampling=pb2.SamplingOptions(
        temperature=0, max_tokens=400, ignore_eos=True))
    metadata = [("application", heal["name"])]
    with grpc.insecure_channel(f"127.0.0.1:{heal['grpc_port']}") as channel:
        stub = pb2_grpc.GenerationStub(channel)
        deadline = time.monotonic() + 60
        while True:                         # Serve's gRPC proxy may still be starting
            try:
                if stub.Health(pb2.HealthRequest(), metadata=metadata, timeout=10).healthy:
                    break
            except grpc.RpcError:
                assert time.monotonic() < deadline, "the gRPC proxy never answered"
            time.sleep(0.5)
        messages = stub.Generate(request, metadata=metadata, timeout=300)
        first = next(messages)
        lost = _kill_the_running_replica(manager)
        rest = list(messages)
    tokens = [m for m in [first, *rest] if m.index == 0]
    assert "".join(m.text for m in tokens) == expected
    assert tokens[-1].finish_reason == "length" and rest[-1].usage.completion_tokens == 400
    _wait_for_membership(manager, lost, 2)


@pytest.mark.ray
def test_a_restarted_manager_adopts_the_replicas_and_heals_on(heal):
    """The manager's process dies (Ray restarts it): the restarted manager takes over the live
    replicas (same processes, none restarted) while the service keeps answering, and heals the
    pool afterwards (a replica killed then is replaced)."""
    import ray

    manager, client = heal["manager"], heal["client"]
    _, pools = ray.get(manager.membership.remote())
    pids = {r: ray.get(h.info.remote())["pid"] for r, h in pools["decode"].items()}
    stream = client.completions.create(model=heal["model"], prompt="Count:", max_tokens=300, temperature=0.0,
                                       stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)
    ray.kill(manager, no_restart=False)                       # its process dies; Ray starts it again
    out = client.completions.create(model=heal["model"], prompt="meanwhile", max_tokens=3, temperature=0.0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3
    assert sum(1 for _ in chunks) > 0                         # the stream went on
    _, after = ray.get(manager.membership.remote())
    assert {r: ray.get(h.info.remote())["pid"] for r, h in after["decode"].items()} == pids
    victim = sorted(after["decode"])[0]
    kill_replica(after["decode"][victim])
    healed = _wait_for_membership(manager, victim, 2)
    assert victim not in healed and len(healed) == 2


@pytest.mark.ray
@pytest.mark.parametrize("drain_timeout", [60.0, 0.0], ids=["drained", "migrated"])
def test_pdserve_scale_down_during_streams_cuts_none(heal, capsys, drain_timeout):
    """`pdserve scale decode 1` while 16 greedy streams run on 2 replicas: the replica removed is
    drained (out of routing at once, its streams finish there) or, given no time to drain, killed
    at once (its streams migrate); all 16 complete with an undisturbed run's text. `pdserve status`
    shows the pool; scaling back to 2 starts a replica."""
    import ray

    from cluster.cli import main

    manager, model = heal["manager"], heal["model"]
    # Prompts no replica has cached, so that the streams spread over both (the oracle runs here).
    prompts = [f"Stream {i} ({drain_timeout}): the bridges of the old city, one by one," for i in range(16)]
    want = simulated_outputs(prompts, 200, **HEAL_ORACLE)

    def migrations() -> float:
        text = httpx.get(f"{heal['base']}/metrics", timeout=10).text
        found = re.search(r'^pdserve:request_migrations_total\{pool="decode"\} (\S+)$', text, re.M)
        return float(found.group(1)) if found else 0.0

    before = migrations()

    async def streams() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{heal['base']}/v1", api_key="none", max_retries=0, timeout=300)
        started = asyncio.Event()
        count = 0

        async def one(prompt: str) -> str:
            nonlocal count
            text = []
            async for chunk in await client.completions.create(model=model, prompt=prompt, max_tokens=200,
                                                               temperature=0.0, stream=True,
                                                               extra_body={"ignore_eos": True}):
                if chunk.choices and chunk.choices[0].text:
                    if not text:
                        count += 1
                        if count == len(prompts):
                            started.set()
                    text.append(chunk.choices[0].text)
            return "".join(text)

        tasks = [asyncio.create_task(one(p)) for p in prompts]
        await started.wait()
        _, pools = ray.get(manager.membership.remote())
        running = [ray.get(h.stats.remote()).engine.num_requests_running for h in pools["decode"].values()]
        assert len(running) == 2 and min(running) > 0, running      # the replica removed has streams
        code = await asyncio.to_thread(main, ["scale", "decode", "1", "--name", heal["name"],
                                              "--drain-timeout", str(drain_timeout)])
        assert code == 0
        return await asyncio.gather(*tasks)

    assert asyncio.run(streams()) == want
    # Drained, the removed replica's streams finished there; killed at once, they moved.
    assert (migrations() > before) == (drain_timeout == 0.0)
    deadline = time.monotonic() + 120
    while (st := ray.get(manager.pool_status.remote())["decode"])["draining"] or len(st["replicas"]) != 1:
        assert time.monotonic() < deadline, st
        time.sleep(0.2)
    capsys.readouterr()
    assert main(["status", "--name", heal["name"]]) == 0
    out = capsys.readouterr().out
    assert "decode: 1/1 serving (bounds 1..1024; replaced" in out and f"  {st['replicas'][0]} " in out, out
    assert "ingress: 1 running" in out, out
    assert main(["scale", "decode", "0", "--name", heal["name"]]) == 2
    assert "replicas must be within 1..1024 for pool 'decode'" in capsys.readouterr().err
    # The same over HTTP: /admin/status, and /admin/scale refusing bad bodies by field.
    assert httpx.get(f"{heal['base']}/admin/status", timeout=30).json()["pools"]["decode"]["target"] == 1
    for body, field, says in [({"pool": "decode", "replicas": 0}, "replicas", "replicas must be within 1..1024"),
                              ({"pool": "prefill", "replicas": 2}, "pool", "pool must be one of ['decode']"),
                              ({"pool": ["decode"], "replicas": 2}, "pool", "pool must be one of ['decode']"),
                              ({"pool": "decode", "replicas": "2"}, "replicas", "must be an integer")]:
        r = httpx.post(f"{heal['base']}/admin/scale", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == field and says in r.json()["error"]["message"], \
            r.text
    r = httpx.post(f"{heal['base']}/admin/scale", json={"pool": "decode", "replicas": 2}, timeout=60)
    assert r.status_code == 200 and r.json()["target"] == 2 and len(r.json()["started"]) == 1, r.text
    deadline = time.monotonic() + 120
    while len(ray.get(manager.membership.remote())[1]["decode"]) != 2:
        assert time.monotonic() < deadline, ray.get(manager.pool_status.remote())
        time.sleep(0.5)


@pytest.mark.ray
def test_a_spec_applied_in_place_resizes_or_rolls_the_pool_and_cuts_no_stream(heal, tmp_path, capsys):
    """`pdserve apply` of a changed spec on a running deployment, while greedy streams run: a new
    size and routing weight resize the pool (the serving replicas are not restarted) and roll the
    ingress; a changed engine field replaces every replica rolling (the new ones load first, the old
    drain). No stream fails or changes; a restarted manager serves the spec last applied."""
    import ray
    import yaml

    from cluster.cli import main
    from cluster.manager import fingerprint

    manager, model = heal["manager"], heal["model"]
    prompts = [f"Applied spec {i}: the lighthouse keeper wrote" for i in range(4)]
    want = simulated_outputs(prompts, 80, **HEAL_ORACLE)

    def apply_during_streams(config: ClusterConfig) -> dict:
        path = tmp_path / f"{fingerprint(config)}.yaml"
        path.write_text(yaml.safe_dump(json.loads(config.model_dump_json())))

        async def run() -> list[str]:
            client = openai.AsyncOpenAI(base_url=f"{heal['base']}/v1", api_key="none", max_retries=0, timeout=300)

            async def one(prompt: str) -> str:
                text = []
                async for chunk in await client.completions.create(model=model, prompt=prompt, max_tokens=80,
                                                                   temperature=0.0, stream=True,
                                                                   extra_body={"ignore_eos": True}):
                    text.extend(c.text for c in chunk.choices)
                return "".join(text)

            tasks = [asyncio.create_task(one(p)) for p in prompts]
            await asyncio.sleep(0.5)
            assert await asyncio.to_thread(main, ["apply", str(path), "--route-prefix", "/heal"]) == 0
            return await asyncio.gather(*tasks)

        assert asyncio.run(run()) == want
        status = ray.get(manager.describe.remote())
        assert status["fingerprint"] == fingerprint(config) and status["updating"] is None
        return status

    def pids() -> dict[str, int]:
        _, pools = ray.get(manager.membership.remote())
        return {r: ray.get(h.info.remote())["pid"] for r, h in pools["decode"].items()}

    before = pids()
    old = heal["config"].model_dump()
    resized = ClusterConfig.model_validate({**old, "pools": {"decode": {**old["pools"]["decode"], "replicas": 3}},
                                            "routing": {**old["routing"], "load_weight": 0.9}})
    capsys.readouterr()
    status = apply_during_streams(resized)
    assert '"pools": {\n    "decode": "resized to 3"' in capsys.readouterr().out
    deadline = time.monotonic() + 120
    while len(now := pids()) != 3:
        assert time.monotonic() < deadline, status
        time.sleep(0.5)
    assert {r: now[r] for r in before} == before           # the serving replicas were not restarted
    # A manager Ray restarts serves the spec last applied, at its size (kept in the GCS).
    ray.kill(manager, no_restart=False)
    assert ray.get(manager.describe.remote())["fingerprint"] == fingerprint(resized)
    assert pids() == now

    rolled = ClusterConfig.model_validate({**resized.model_dump(), "engine": {**old["engine"], "max_num_seqs": 6}})
    apply_during_streams(rolled)
    after = pids()
    assert len(after) == 3 and not set(after) & set(now), (now, after)
    assert all(ray.get(h.info.remote())["max_num_seqs"] == 6
               for h in ray.get(manager.membership.remote())[1]["decode"].values())
    deadline = time.monotonic() + 120
    while ray.get(manager.pool_status.remote())["decode"]["draining"]:     # the old ones drain, then go
        assert time.monotonic() < deadline
        time.sleep(0.5)


# --- pdserve serve and Ctrl-C ----------------------------------------------------------------------
@pytest.mark.ray
def _start_pdserve(*args: str) -> subprocess.Popen:
    return subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "pdserve"), "serve", *args],
                            env=_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


class _Output:
    """A launcher's merged stdout and stderr, read line by line on a thread: a test waits for a line
    with a deadline (a read from the pipe has none), and on missing it fails with what the launcher
    wrote and its threads' stacks (`pdserve serve` dumps them on SIGUSR1) instead of hanging."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self.ended = False
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self.ended = True
            self._changed.notify_all()

    def text(self) -> str:
        with self._changed:
            return "".join(self.lines)

    def wait_for(self, marker: str, timeout_s: float = 300) -> None:
        """Until a line holds `marker` (anywhere in it: Ray's log lines share the pipe); fails when
        the output ends first, or after timeout_s."""
        def seen() -> bool:
            return any(marker in line for line in self.lines)
        with self._changed:
            self._changed.wait_for(lambda: self.ended or seen(), timeout_s)
            if seen():
                return
            ended = self.ended
        if not ended:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGUSR1)
            time.sleep(5)                   # for the stacks to arrive
        pytest.fail(f"no line with {marker!r} after {timeout_s} s (exit code {self.proc.poll()}):\n"
                    + self.text()[-6000:])

    def finish(self, timeout_s: float = 120) -> str:
        """Everything the launcher wrote, once it has exited (TimeoutExpired after timeout_s)."""
        self.proc.wait(timeout=timeout_s)
        self._reader.join(timeout=30)
        return self.text()


def _wait_healthy(proc: subprocess.Popen, base: str, timeout_s: float = 240) -> None:
    def running() -> None:
        assert proc.poll() is None, proc.stdout.read()[-3000:]
    wait_healthy(base, timeout_s, running, poll_s=1.0)


def _stop_with_sigint(proc: subprocess.Popen, ray_procs: list) -> str:
    os.killpg(proc.pid, signal.SIGINT)          # what Ctrl-C in a terminal sends
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output[-3000:]
    assert "pdserve: shutting down (SIGINT)" in output
    assert wait_gone(ray_procs, 30) == []
    return output


@pytest.mark.ray
def test_pdserve_serve_answers_and_sigint_leaves_no_ray_process(tiny_llama, tmp_path):
    """`pdserve serve` with the default pools (1 prefill + 1 decode replica, which must fit the
    local Ray it starts on a 2-core machine: no --num-cpus) and serving.direct_ingress (the ingress
    replica itself listens on the port: no Serve proxy on the token path): it answers, the serving
    benchmarks run against it, everything listens on loopback only, a dropped stream leaks nothing,
    and Ctrl-C leaves no Ray process."""
    port = free_port()
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"model: {tiny_llama}\nmode: disaggregated\npools: {{prefill: {{}}, decode: {{}}}}\n"
                    f"serving: {{port: {port}, direct_ingress: true}}\n")
    proc = _start_pdserve("--config", str(spec))
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_healthy(proc, base)
        health = httpx.get(f"{base}/health").json()
        assert set(health["pools"]) == {"prefill", "decode"}, health
        ray_procs = _descendants(proc.pid)
        owners = [p.name() for p in ray_procs for c in _listening(p) if c.laddr.port == port]
        assert owners and all("ServeReplica" in name for name in owners), owners
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        out = client.completions.create(model=model, prompt="Hello", max_tokens=5,
                                        temperature=0.0, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 5
        chunks = list(client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0.0,
            stream=True, extra_body={"ignore_eos": True}))
        first = next(c for c in chunks if c.choices)
        assert first.choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        # The serving benchmark against it: token-id prompts, then a multi-turn text workload.
        bench = subprocess.run(
            [sys.executable, "benchmarks/serve.py", "--base-url", base, "--num-prompts", "6", "--warmup", "1",
             "--input-len", "20:300", "--output-len", "6", "--concurrency", "3", "--quiet",
             "--scrape-metric", "pdserve:prompt_tokens_computed_total",
             "--result", str(tmp_path / "bench.json")], cwd=REPO, capture_output=True, text=True, timeout=300)
        assert bench.returncode == 0, bench.stderr[-3000:]
        summary = json.loads((tmp_path / "bench.json").read_text())["summary"]
        assert summary["completed"] == 6 and summary["output_tokens"] == 36 and summary["ttft_ms"]["p99"] > 0
        # Random prompts share no block: every prompt token is computed once, on P or on D, and D
        # computes the last token again of a prompt it pulled (its first token comes from there).
        computed = summary["metrics_total"]["pdserve:prompt_tokens_computed_total"]
        assert summary["input_tokens"] <= computed <= summary["input_tokens"] + 6, summary["metrics_delta"]
        assert summary["itl_ms"]["median"] > 0 and summary["request_throughput"] > 0
        compared = subprocess.run(
            [sys.executable, "benchmarks/compare.py", "--a", base, "--b", base, "--dataset", "multiturn",
             "--num-prompts", "2", "--turns", "2", "--warmup", "0", "--input-len", "5:10", "--output-len", "4",
             "--request-rate", "4", "--quiet", "--result", str(tmp_path / "cmp.json")],
            cwd=REPO, capture_output=True, text=True, timeout=300)
        assert compared.returncode == 0, compared.stderr[-3000:]
        rounds = json.loads((tmp_path / "cmp.json").read_text())["rounds"][0]
        assert [r["completed"] for r in rounds.values()] == [4, 4] and "request_throughput" in compared.stdout
        with httpx.stream("POST", f"{base}/v1/completions", timeout=60,
                          json={"model": model, "prompt": "Hello", "max_tokens": 200, "stream": True,
                                "ignore_eos": True}) as dropped:
            next(dropped.iter_lines())              # one event, then the client goes away
        deadline = time.monotonic() + 30
        while _metric(base, "pdserve:requests_in_flight") != 0:
            assert time.monotonic() < deadline, "the dropped stream stayed in flight"
            time.sleep(0.5)
        ray_procs = _descendants(proc.pid)
        names = {p.name() for p in ray_procs}
        assert {"gcs_server", "raylet"} <= names, names
        # A local server listens on loopback only: Ray's GCS, raylet, agents, every worker, Serve.
        exposed = _listening_beyond_loopback([psutil.Process(proc.pid), *ray_procs])
        assert exposed == [], exposed
        _stop_with_sigint(proc, ray_procs)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def _metric(base: str, name: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith((name + " ", name + "{")))


def _listening(p: psutil.Process) -> list:
    try:
        return [c for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    except psutil.Error:
        return []


def _listening_beyond_loopback(procs: list) -> list[str]:
    return [f"{p.name()} {c.laddr.ip}:{c.laddr.port}" for p in procs for c in _listening(p)
            if not (c.laddr.ip.startswith("127.") or c.laddr.ip in ("::1", "::ffff:127.0.0.1"))]


@pytest.mark.ray
def test_pdserve_serve_stops_with_an_error_when_its_ray_dies(tiny_llama, tmp_path):
    """The GCS of the Ray `pdserve serve` started, killed under it while it serves (`ray stop --force`,
    the OOM killer): the launcher says so and exits 1, instead of Ray's driver spinning a core on
    a minute of reconnecting before it ends the process with a line of its own."""
    port = free_port()
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"model: {tiny_llama}\nmode: colocated\npools: {{decode: {{}}}}\nserving: {{port: {port}}}\n")
    proc = _start_pdserve("--config", str(spec))
    ray_procs: list = []
    try:
        out = _Output(proc)
        out.wait_for("pdserve: serving on")
        assert proc.poll() is None, out.text()[-3000:]
        ray_procs = _descendants(proc.pid)
        gcs = [p for p in ray_procs if p.name() == "gcs_server"]
        assert len(gcs) == 1, [p.name() for p in ray_procs]
        gcs[0].kill()
        output = out.finish(timeout_s=120)
        assert proc.returncode == 1, output[-3000:]
        assert "pdserve: error: the local Ray's gcs_server exited (code -9): stopping" in output, output[-3000:]
        assert "Failed to connect to GCS" not in output, output[-3000:]     # Ray's own end, a minute later
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for p in _descendants(proc.pid) + ray_procs:       # what the GCS's end left (agents linger a minute)
            with contextlib.suppress(psutil.Error):
                p.kill()


WHOLE_LINES = """
import sys, threading
from cluster.launch import whole_lines
whole_lines()
def logs():                 # as Ray's driver prints its workers' logs, from a thread of its own
    for _ in range(4000):
        print("(ProxyActor pid=1) INFO " + "x" * 200, file=sys.stderr)
thread = threading.Thread(target=logs)
thread.start()
for i in range(4000):
    print(f"pdserve: line {i}", flush=True)
thread.join()
"""


def test_the_launcher_s_lines_stay_whole_beside_ray_s_log_thread():
    """With PYTHONUNBUFFERED=1 (container images often set it) print() writes a line's text and its
    newline apart, and a launcher line could land inside a Ray log line in the pipe both go to (a
    lane run waited on `pdserve: serving on` for ten minutes). The launcher's streams write whole
    lines (cluster/launch.py: whole_lines). Without it, 1-4% of the lines here came glued."""
    out = subprocess.run([sys.executable, "-c", WHOLE_LINES], env={**_env(), "PYTHONUNBUFFERED": "1"}, cwd=REPO,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:]
    lines = out.stdout.splitlines()
    assert sum(line.startswith("pdserve: line") for line in lines) == 4000
    assert [line for line in lines if "pdserve: line" in line and not line.startswith("pdserve: line")] == []


@pytest.mark.ray
def test_sigint_during_startup_exits_cleanly(tiny_llama):
    """Ctrl-C while the pools are still loading and Serve starts: the launcher tears down what it
    started and exits 0. (/health's 503 while the pools load: test_node_loss.py's ramp.)"""
    port = free_port()
    proc = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "pdserve"), "serve", "--model", tiny_llama,
                             "--port", str(port)], env=_env(), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out = _Output(proc)
        out.wait_for("pdserve: loading the pools")          # the pools are loading; Serve is next
        assert proc.poll() is None, out.text()[-3000:]
        ray_procs = _descendants(proc.pid)
        os.killpg(proc.pid, signal.SIGINT)
        output = out.finish(timeout_s=120)
        assert proc.returncode == 0, output[-3000:]
        assert "pdserve: shutting down (SIGINT)" in output and "Traceback" not in output, output[-3000:]
        assert "pdserve: serving on" not in output
        assert wait_gone([p for p in ray_procs if p.is_running()], 30) == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_api_key_from_environment_fails_closed(tiny_llama, monkeypatch):
    from router.ingress.frontend import Frontend

    config = ClusterConfig(model=tiny_llama, serving={"api_key_env": "PDSERVE_TEST_KEY"})
    monkeypatch.delenv("PDSERVE_TEST_KEY", raising=False)
    with pytest.raises(ValueError, match="serving.api_key_env names 'PDSERVE_TEST_KEY', which is not set"):
        Frontend(config.ingress_spec(), {})
    monkeypatch.setenv("PDSERVE_TEST_KEY", "s3cret")
    server = Frontend(config.ingress_spec(), {})
    assert server.is_authorized("Bearer s3cret")
    assert not server.is_authorized("Bearer wrong")
