"""The ingress's other endpoints on the shared apps (tests/serving/conftest.py): models, health,
tokenize and detokenize, error codes (400, 401, 404, 413, 429), /metrics under vLLM's names, LoRA
adapters served by name and loaded at runtime, and the disaggregated path against the colocated."""
from __future__ import annotations

import os

import httpx
import openai
import pytest

from engine import LLM, SamplingParams
from serving.apps import API_KEY, PAGE_ORIGIN, TENANT, TENANT_KEY, auth, metric

ray = pytest.importorskip("ray", reason="the serving tests need ray[serve] (make setup installs it)")
pytestmark = pytest.mark.ray


def test_models_health_tokenize(server, client):
    models = client.models.list()
    # The base model under each of its names, then its adapter.
    assert [m.id for m in models.data] == [server["model"], "tiny-chat", "ad1"] and server["model"] == "tiny"
    assert models.data[2].model_extra["parent"] == server["model"]
    aliased = client.completions.create(model="tiny-chat", prompt="Hello", max_tokens=3, temperature=0)
    assert aliased.model == "tiny" and aliased.choices[0].text == client.completions.create(
        model="tiny", prompt="Hello", max_tokens=3, temperature=0).choices[0].text
    assert client.models.retrieve("ad1").model_extra["parent"] == server["model"]
    with pytest.raises(openai.NotFoundError, match="model 'nope/x' does not exist"):
        client.models.retrieve("nope/x")
    assert httpx.get(f"{server['base']}/health").json()["healthy"] is True
    tok = httpx.post(f"{server['base']}/tokenize", json={"prompt": "Hello world"}, headers=auth()).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["token_strs"] is None
    strs = httpx.post(f"{server['base']}/tokenize", json={"prompt": "Hello world", "return_token_strs": True},
                      headers=auth()).json()["token_strs"]
    assert len(strs) == tok["count"] and all(isinstance(t, str) and t for t in strs)
    assert "".join(strs).replace("\u0120", " ").endswith("Hello world")       # byte-level BPE's space mark
    text = httpx.post(f"{server['base']}/detokenize", json={"tokens": tok["tokens"]}, headers=auth()).json()
    assert text["prompt"].endswith("Hello world")
    # vLLM's chat-template extras: the assistant's last message continued, on /tokenize and in chat.
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I"}]
    extras = {"add_generation_prompt": False, "continue_final_message": True, "chat_template_kwargs": {"x": 1}}
    cont = httpx.post(f"{server['base']}/tokenize", json={"messages": messages, **extras}, headers=auth()).json()
    text = httpx.post(f"{server['base']}/detokenize", json={"tokens": cont["tokens"]}, headers=auth()).json()
    assert text["prompt"].endswith("<|im_start|>assistant\nHello, I")
    done = client.chat.completions.create(model=server["model"], messages=messages, max_tokens=2, extra_body=extras)
    assert done.usage.prompt_tokens == cont["count"]
    with pytest.raises(openai.BadRequestError, match="continue_final_message needs add_generation_prompt=false"):
        client.chat.completions.create(model=server["model"], messages=messages, max_tokens=2,
                                       extra_body={"continue_final_message": True})


def test_browsers_on_other_origins(server):
    """CORS as vLLM answers it: the main app (the defaults) lets a page on any origin call it, its
    preflight answered without the key (browsers send none) and a refusal readable by the page; the
    limited app allows one origin, with credentials, and answers others without the headers."""
    base, origin = server["base"], "http://localhost:5173"
    preflight = {"Origin": origin, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    answer = httpx.options(f"{base}/v1/chat/completions", headers=preflight)
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == "*"
    assert "POST" in answer.headers["access-control-allow-methods"]
    assert "authorization" in answer.headers["access-control-allow-headers"].lower()
    models = httpx.get(f"{base}/v1/models", headers={**auth(), "Origin": origin})
    assert models.status_code == 200 and models.headers["access-control-allow-origin"] == "*"
    refused = httpx.get(f"{base}/v1/models", headers={"Origin": origin})
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "*"
    assert "access-control-allow-origin" not in httpx.get(f"{base}/v1/models", headers=auth()).headers
    limited = f"{base}/limited"
    answer = httpx.options(f"{limited}/v1/chat/completions", headers={**preflight, "Origin": PAGE_ORIGIN})
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == PAGE_ORIGIN
    assert answer.headers["access-control-allow-credentials"] == "true"
    other = httpx.options(f"{limited}/v1/chat/completions", headers=preflight)
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    stream = httpx.post(f"{limited}/v1/completions", headers={"Origin": PAGE_ORIGIN},
                        json={"model": server["model"], "prompt": "Hi", "max_tokens": 2, "stream": True})
    assert stream.status_code == 200 and stream.headers["access-control-allow-origin"] == PAGE_ORIGIN
    assert stream.text.rstrip().endswith("data: [DONE]")


def test_error_codes(server, client):
    model = server["model"]
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=model, prompt="x", temperature=-1)
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], top_p=1.5)
    with pytest.raises(openai.BadRequestError, match="bogus"):
        client.completions.create(model=model, prompt="x", extra_body={"bogus": 1})
    # OpenAI's fields that change no output here are accepted, as vLLM accepts them.
    harmless = {"user": "u", "safety_identifier": "s", "metadata": {"team": "a"}, "store": False,
                "service_tier": "auto", "prompt_cache_key": "k"}
    assert client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], max_tokens=1,
                                          modalities=["text"], **harmless).choices[0].finish_reason == "length"
    assert client.completions.create(model=model, prompt="x", max_tokens=1, extra_body=harmless).usage
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.completions.create(model=model, prompt=[5] * 1000, max_tokens=100)
    with pytest.raises(openai.BadRequestError, match="prompt"):
        client.completions.create(model=model, prompt="")
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="no-such-model", prompt="x")
    bad_key = openai.OpenAI(base_url=f"{server['base']}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()
    with pytest.raises(openai.APIStatusError) as big:
        client.completions.create(model=model, prompt="x" * (2 << 20))
    assert big.value.status_code == 413
    body = big.value.response.json()["error"]
    assert set(body) >= {"message", "type", "code"} and body["code"] == 413

    # 429 from the app that admits one request at a time, while one stream is held open.
    limited = openai.OpenAI(base_url=f"{server['base']}/limited/v1", api_key="none", max_retries=0)
    held = limited.completions.create(model=model, prompt="hold", max_tokens=200, stream=True,
                                      extra_body={"ignore_eos": True})
    next(iter(held))
    with pytest.raises(openai.RateLimitError):
        limited.completions.create(model=model, prompt="x", max_tokens=2)
    held.close()
    # and the server keeps answering
    assert client.completions.create(model=model, prompt="still here", max_tokens=2).choices[0].text is not None


def test_tenant_limits_keys_and_metrics(server, client):
    """A tenant of the main app (its own key, 3 requests a minute): served under its key, a fourth
    request is 429 with Retry-After naming the limit, /metrics counts it by tenant (never by key),
    and a bad or missing key is 401 on every route but /health and /ping."""
    base, model = server["base"], server["model"]
    team = openai.OpenAI(base_url=f"{base}/v1", api_key=TENANT_KEY, max_retries=0, timeout=120)
    for _ in range(3):
        assert team.completions.create(model=model, prompt="Hello", max_tokens=2).usage.completion_tokens == 2
    with pytest.raises(openai.RateLimitError, match="tenant team-a is over its requests_per_minute") as err:
        team.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert 1 <= int(err.value.response.headers["retry-after"]) <= 20
    client.completions.create(model=model, prompt="the other tenant is not limited", max_tokens=2)
    text = httpx.get(f"{base}/metrics", headers=auth()).text
    assert metric(text, "pdserve:tenant_requests_total", tenant=TENANT, outcome="admitted") == 3
    assert metric(text, "pdserve:tenant_requests_total", tenant=TENANT, outcome="rejected_requests_per_minute") == 1
    assert metric(text, "pdserve:tenant_tokens_total", tenant=TENANT, kind="generation") == 6
    assert metric(text, "pdserve:tenant_requests_total", tenant="default", outcome="admitted") >= 1
    assert TENANT_KEY not in text and API_KEY not in text
    routes = [("GET", "/v1/models"), ("GET", "/v1/models/x"), ("POST", "/v1/completions"),
              ("POST", "/v1/chat/completions"), ("POST", "/v1/responses"), ("POST", "/tokenize"),
              ("POST", "/detokenize"), ("GET", "/metrics"), ("GET", "/version"), ("GET", "/openapi.json"),
              ("GET", "/admin/status"), ("POST", "/v1/load_lora_adapter"), ("GET", "/no/such/route")]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TENANT_KEY}):
        for method, path in routes:
            r = httpx.request(method, f"{base}{path}", headers=headers, json={}, timeout=30)
            assert r.status_code == 401, (method, path, r.status_code)
    assert httpx.get(f"{base}/health").status_code == 200


def test_tenant_limits_hold_across_two_ingress_replicas(server, tiny_llama):
    """An app of two ingress replicas (on simulated engine replicas), a tenant of 20 requests a
    minute: of 60 requests sent over both through Serve's proxy, at most 20 are served (plus what
    the bucket refills while they run: router/ingress/quota.py states the bound), the rest are 429
    with a Retry-After; the replicas draw on one ledger actor."""
    import concurrent.futures
    import time

    from helpers import SIM_PROFILE, wait_healthy
    from ray import serve

    from cluster.app import build_app
    from cluster.config import ClusterConfig
    from cluster.launch import shutdown, start_pools

    key, prefix = "shared-limits-key", "/shared"
    config = ClusterConfig(model=tiny_llama, engine={"simulate": SIM_PROFILE, "max_model_len": 512},
                           pools={"decode": {"replicas": 1, "num_cpus": 0.5}},
                           serving={"port": server["port"], "wait_for_pools": False, "ingress_replicas": 2,
                                    "tenants": {"team-s": {"api_keys": [key], "requests_per_minute": 20}}},
                           name="pdserve-shared-limits")
    try:
        start_pools(config)
        serve.run(build_app(config), name=config.name, route_prefix=prefix, blocking=False)
        base = f"{server['base']}{prefix}"
        wait_healthy(base)
        headers = {"Authorization": f"Bearer {key}"}
        model = httpx.get(f"{base}/v1/models", headers=headers, timeout=60).json()["data"][0]["id"]
        body = {"model": model, "prompt": "Hello", "max_tokens": 1}
        started = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            replies = list(pool.map(lambda _: httpx.post(f"{base}/v1/completions", json=body, timeout=120,
                                                         headers=headers), range(60)))
        refilled = (time.monotonic() - started) * 20 / 60
        codes = [r.status_code for r in replies]
        assert set(codes) <= {200, 429}, codes
        assert 16 <= codes.count(200) <= 20 + refilled + 1, (codes.count(200), refilled)
        for r in replies:
            if r.status_code == 429:
                assert "across the ingress replicas" in r.json()["error"]["message"]
                assert int(r.headers["retry-after"]) >= 1
        named = ray.util.list_named_actors(all_namespaces=True)
        assert f"pdserve-quota-{config.name}" in [a["name"] for a in named], named
    finally:
        shutdown(config)


def test_metrics_under_vllm_names(server):
    """serving.metrics_prefix "vllm" (the /limited app): /metrics names its series as vLLM does, for
    what scrapes vLLM (autoscalers, gateways): the engine's gauges and the ingress's histograms."""
    c = openai.OpenAI(base_url=f"{server['base']}/limited/v1", api_key="none", max_retries=0)
    c.completions.create(model=server["model"], prompt="count", max_tokens=2)
    text = httpx.get(f"{server['base']}/limited/metrics").text
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                 "vllm:time_to_first_token_seconds_count", "vllm:generation_tokens_total"):
        assert name in names, sorted(names)
    assert all(n.startswith("vllm:") for n in names) and "# TYPE vllm:kv_cache_usage_perc gauge" in text


def test_lora_adapters_over_http(server, client, adapters, tiny_llama):
    """`model` names an adapter: its answer is the offline engine's under that adapter (not the
    base model's), on the colocated and the disaggregated app; adapters load and unload at runtime
    behind the API key, where the spec allows it; every refusal is a 4xx naming the field."""
    from records.lora import LoRARequest

    prompt = "The history of the printing press begins " + "with movable type and ink, " * 8
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(tiny_llama, dtype="float32", max_model_len=1024, enable_lora=True, max_lora_rank=16)
    loras = {name: LoRARequest(name, i + 1, adapters[name]) for i, name in enumerate(("ad1", "ad2"))}
    want = {name: llm.generate(prompt, params, use_tqdm=False, lora_request=loras.get(name))[0].outputs[0].text
            for name in (None, "ad1", "ad2")}
    assert len(set(want.values())) == 3
    kwargs = dict(prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    out = client.completions.create(model="ad1", **kwargs)
    assert out.model == "ad1" and out.choices[0].text == want["ad1"]
    assert client.completions.create(model=server["model"], **kwargs).choices[0].text == want[None]
    streamed = client.completions.create(model="ad1", stream=True, **kwargs)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == want["ad1"]
    pd_client = openai.OpenAI(base_url=f"{server['base']}/pd/v1", api_key="none", max_retries=0, timeout=120)
    assert pd_client.completions.create(model="ad1", **kwargs).choices[0].text == want["ad1"]   # pulled KV
    with pytest.raises(openai.NotFoundError, match="ad2"):
        client.completions.create(model="ad2", **kwargs)
    # Runtime loading: behind the API key, checked, then served; unloading ends it.
    base = server["base"]
    body = {"lora_name": "ad2", "lora_path": adapters["ad2"]}
    assert httpx.post(f"{base}/v1/load_lora_adapter", json=body).status_code == 401
    loaded = httpx.post(f"{base}/v1/load_lora_adapter", json=body, headers=auth())
    assert loaded.status_code == 200, loaded.text
    assert "ad2" in [m.id for m in client.models.list().data]
    assert client.completions.create(model="ad2", **kwargs).choices[0].text == want["ad2"]
    for bad, field in (({"lora_name": "ad2", "lora_path": adapters["ad2"]}, "lora_name"),
                       ({"lora_name": "x", "lora_path": "/nonexistent"}, "lora_path"),
                       ({"lora_name": "x"}, "lora_path")):
        r = httpx.post(f"{base}/v1/load_lora_adapter", json=bad, headers=auth())
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert httpx.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "ad2"}, headers=auth()).status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="ad2", **kwargs)
    assert httpx.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "ad2"},
                      headers=auth()).status_code == 404
    # The disaggregated app's spec does not allow runtime updates.
    refused = httpx.post(f"{base}/pd/v1/load_lora_adapter", json=body)
    assert refused.status_code == 404 and "allow_runtime_updates" in refused.text


def test_disaggregated_path_matches_colocated(server, client, eventually_no_leaks):
    """Long prompts go prefill -> transfer -> decode, short ones stay on the decode replica; both give
    the colocated app's greedy output, streamed or not; every block is freed on both pools."""
    pd_client = openai.OpenAI(base_url=f"{server['base']}/pd/v1", api_key="none", max_retries=0, timeout=120)
    long_prompt = "The history of the printing press begins " + "with movable type and ink, " * 20
    short_prompt = "Hello there"
    kwargs = dict(model=server["model"], max_tokens=12, temperature=0.0)
    for prompt in (long_prompt, short_prompt):
        before = httpx.get(f"{server['base']}/pd/metrics").text
        want = client.completions.create(prompt=prompt, **kwargs).choices[0].text
        got = pd_client.completions.create(prompt=prompt, **kwargs).choices[0].text
        streamed = "".join(c.choices[0].text for c in pd_client.completions.create(prompt=prompt, stream=True, **kwargs)
                           if c.choices)
        assert got == want and streamed == want, prompt
        after = httpx.get(f"{server['base']}/pd/metrics").text
        remote = (metric(after, "pdserve:router_decisions_total", reason="remote_prefill")
                  - metric(before, "pdserve:router_decisions_total", reason="remote_prefill"))
        local = (metric(after, "pdserve:router_decisions_total", reason="local_prefill")
                 - metric(before, "pdserve:router_decisions_total", reason="local_prefill"))
        if prompt is long_prompt:
            # The second request's prompt is in the decode replica's cache only after the first
            # pull; with a 32-token threshold the cached part keeps it local.
            assert remote >= 1, after
        else:
            assert (remote, local) == (0, 2)
    metrics = httpx.get(f"{server['base']}/pd/metrics").text
    assert metric(metrics, "pdserve:kv_blocks_transferred_total", pool="decode") > 0
    assert metric(metrics, "pdserve:kv_load_failures_total") == 0
    manager = server["managers"][-1]
    replicas = {**ray.get(manager.replicas.remote("decode")), **ray.get(manager.replicas.remote("prefill"))}
    assert eventually_no_leaks(replicas)


def _process_of(replica) -> tuple[int, str | None]:
    """A replica actor's nice value and OpenMP wait policy, read inside its process."""
    return ray.get(replica.__ray_call__.remote(
        lambda _: (os.getpriority(os.PRIO_PROCESS, 0), os.environ.get("OMP_WAIT_POLICY"))))


@pytest.mark.ray
def test_engine_processes_run_at_their_pool_s_niceness_with_openmp_asleep(server):
    """A pool's replica actors run as its spec says (`niceness`, `process_env`): the disaggregated
    app's prefill pool at 5, the other pools at Ray's worker niceness (what a plain task gets), each
    with OpenMP's idle threads asleep (the kernels' own threads run their regions)."""
    rays = ray.get(ray.remote(num_cpus=0)(lambda: os.getpriority(os.PRIO_PROCESS, 0)).remote())
    assert rays != 5
    pd = server["replicas"]["pd"]
    assert _process_of(pd["prefill-0"]) == (5, "passive")
    assert _process_of(pd["decode-0"]) == (rays, "passive")
    assert {_process_of(h) for h in server["replicas"]["main"].values()} == {(rays, "passive")}
