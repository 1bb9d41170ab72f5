"""Several models behind one endpoint (the /limited app of tests/serving/conftest.py: the tiny Llama
colocated as "tiny" / "tiny-chat", a tiny Qwen2 disaggregated as "qwen"): requests routed by their
`model`, each model's answers token-identical to that model alone, /v1/models, 404s and 400s naming
the models, tokenize, health, metrics by `model_name`, a batch that mixes the models; a model put
to sleep and woken by its next request; `pdserve status`, `scale` and `apply` per model (a third
model added and removed while another streams)."""
from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest
from helpers import wait_healthy

from engine import LLM, SamplingParams
from serving.apps import API_KEY
from serving.test_batches import upload, wait_done

ray = pytest.importorskip("ray", reason="the serving tests need ray[serve] (make setup installs it)")
pytestmark = pytest.mark.ray

MAX_TOKENS = 8


def _prompts(n: int) -> list[str]:
    """Short and long prompts (the long ones, over 32 tokens, are prefilled on qwen's prefill
    replica), some sharing a long prefix (prefix-cache hits on both models)."""
    shared = "A long shared preamble about rivers, mountains and the towns between them. " * 3
    return [(shared if i % 3 == 0 else "") + f"Request {i}: the weather in town {i} is" for i in range(n)]


def test_two_models_serve_interleaved_requests_each_as_served_alone(server, tiny_llama, tiny_qwen2):
    base = f"{server['base']}/limited"
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)
    cards = httpx.get(f"{base}/v1/models").json()["data"]
    assert [(c["id"], c["parent"], c["state"]) for c in cards] == [
        ("tiny", None, "ready"), ("tiny-chat", None, "ready"), ("ad1", "tiny", "ready"), ("qwen", None, "ready"),
        ("llava", None, "ready"), ("gemma3", None, "ready")]
    assert [c["max_model_len"] for c in cards] == [1024, 1024, 1024, 512, 512, 512]
    prompts = _prompts(100)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = {}
    for name, path, max_len in (("tiny", tiny_llama, 1024), ("qwen", tiny_qwen2, 512)):
        with LLM(path, dtype="float32", max_model_len=max_len) as llm:       # the model served alone
            want[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert want["tiny"] != want["qwen"]         # two different models, or the check proves nothing

    got: dict[str, list] = {"tiny": [None] * len(prompts), "qwen": [None] * len(prompts)}
    failures: list[BaseException] = []

    def run(name: str, alias: str) -> None:   # one model's requests, one at a time (max_in_flight: 1)
        try:
            for i, prompt in enumerate(prompts):
                out = client.completions.create(model=alias if i % 2 else name, prompt=prompt, max_tokens=MAX_TOKENS,
                                                temperature=0.0, extra_body={"ignore_eos": True,
                                                                             "return_token_ids": True})
                assert out.model == name
                got[name][i] = out.choices[0].model_extra["token_ids"]
        except BaseException as e:  # noqa: BLE001 - reported by the test's thread
            failures.append(e)

    # 200 requests, the two models' interleaved at the ingress.
    threads = [threading.Thread(target=run, args=args) for args in (("tiny", "tiny-chat"), ("qwen", "qwen"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures
    for name in ("tiny", "qwen"):
        mismatched = [i for i, (a, b) in enumerate(zip(got[name], want[name])) if a != b]
        assert not mismatched, (name, mismatched[:5])

    # An adapter of one model, addressed by its name: the tiny model's "ad1", answering as the main
    # app (the same model and adapter, alone) does, and not as the base model.
    main = openai.OpenAI(base_url=f"{server['base']}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    differs = False
    for prompt in prompts[:4]:
        args = dict(prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0, extra_body={"ignore_eos": True})
        adapted = client.completions.create(model="ad1", **args)
        assert adapted.model == "ad1"
        assert adapted.choices[0].text == main.completions.create(model="ad1", **args).choices[0].text
        differs |= adapted.choices[0].text != client.completions.create(model="tiny", **args).choices[0].text
    assert differs

    # qwen's long prompts went through its prefill replica; each model's series carry its name.
    metrics = httpx.get(f"{base}/metrics").text
    lines = [line for line in metrics.splitlines() if line.startswith("vllm:generation_tokens_total{")]
    assert any('model_name="tiny"' in line for line in lines) and any('model_name="qwen"' in line for line in lines)
    assert metrics.count("# TYPE vllm:generation_tokens_total ") == 1
    transferred = [line for line in metrics.splitlines()
                   if line.startswith('vllm:kv_blocks_transferred_total{model_name="qwen"')]
    assert transferred and sum(float(line.rsplit(" ", 1)[1]) for line in transferred) > 0, transferred


def test_requests_name_a_served_model_or_are_refused_naming_them(server):
    base = f"{server['base']}/limited"
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)
    with pytest.raises(openai.NotFoundError, match=r"model 'gpt-4' does not exist; this server serves "
                                                   r"\['tiny', 'tiny-chat', 'ad1', 'qwen', 'llava', 'gemma3'\]"):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    with pytest.raises(openai.NotFoundError, match="this server serves"):
        client.models.retrieve("gpt-4")
    assert client.models.retrieve("qwen").model_extra["max_model_len"] == 512
    r = httpx.post(f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
    assert "model is required" in r.json()["error"]["message"]
    # /tokenize answers with the model named (its own context length).
    for model, max_len in (("tiny", 1024), ("qwen", 512)):
        tok = httpx.post(f"{base}/tokenize", json={"model": model, "prompt": "Hello world"}).json()
        assert tok["max_model_len"] == max_len and tok["count"] == len(tok["tokens"]) > 0
    health = httpx.get(f"{base}/health").json()
    assert health["healthy"] is True and sorted(health["models"]) == ["gemma3", "llava", "qwen", "tiny"]
    assert sorted(health["models"]["qwen"]["pools"]) == ["decode", "prefill"]
    # A chat request goes to its model too.
    chat = client.chat.completions.create(model="qwen", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=3, temperature=0)
    assert chat.model == "qwen" and chat.usage.completion_tokens >= 1


def test_a_batch_mixes_models(server):
    client = openai.OpenAI(base_url=f"{server['base']}/limited/v1", api_key="none", max_retries=0, timeout=60)
    bodies = {f"{m}-{i}": {"model": m, "prompt": f"Batch line {i} for {m}", "max_tokens": 4, "temperature": 0}
              for m in ("tiny", "qwen") for i in range(2)}
    lines = [{"custom_id": cid, "method": "POST", "url": "/v1/completions", "body": body}
             for cid, body in bodies.items()]
    lines.append({"custom_id": "unknown", "method": "POST", "url": "/v1/completions",
                  "body": {"model": "gpt-4", "prompt": "x", "max_tokens": 2}})
    batch = client.batches.create(input_file_id=upload(client, lines), endpoint="/v1/completions",
                                  completion_window="24h")
    done = wait_done(client, batch.id)
    assert (done.status, done.request_counts.completed, done.request_counts.failed) == ("completed", 4, 1), done
    out = {r["custom_id"]: r["response"]
           for r in map(json.loads, client.files.content(done.output_file_id).text.splitlines())}
    for cid, body in bodies.items():
        direct = client.completions.create(**body)
        assert out[cid]["body"]["model"] == body["model"]
        assert out[cid]["body"]["choices"][0]["text"] == direct.choices[0].text
    errors = [json.loads(x) for x in client.files.content(done.error_file_id).text.splitlines()]
    assert [(e["custom_id"], e["response"]["status_code"]) for e in errors] == [("unknown", 404)]


def test_a_sleeping_model_frees_memory_and_wakes_for_the_next_request(server, tiny_qwen2):
    """vLLM's sleep endpoints, per model: level 1 and 2 free every replica's KV cache and weights
    (the resident memory each reports asleep is below what it holds awake); /is_sleeping and
    /v1/models say so; a request for the sleeping model is held while it wakes, then answered as
    before; the other model serves throughout."""
    base = f"{server['base']}/limited"
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)
    prompt = "Sleep and wake: the night train to the coast"
    with LLM(tiny_qwen2, dtype="float32", max_model_len=512) as llm:
        want = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].token_ids

    def qwen() -> list[int]:
        out = client.completions.create(model="qwen", prompt=prompt, max_tokens=12, temperature=0.0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
        return out.choices[0].model_extra["token_ids"]

    assert qwen() == want
    for bad, param in (("3", "level"), ("x", "level")):
        r = httpx.post(f"{base}/sleep", params={"model": "qwen", "level": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert httpx.post(f"{base}/sleep", params={"level": 1}).status_code == 400       # which model?
    for level in (1, 2):
        asleep = httpx.post(f"{base}/sleep", params={"model": "qwen", "level": level}, timeout=120)
        assert asleep.status_code == 200, asleep.text
        assert asleep.json()["level"] == level and sorted(asleep.json()["rss_bytes"]) == ["decode-0", "prefill-0"]
        assert httpx.get(f"{base}/is_sleeping", params={"model": "qwen"}).json() == {"is_sleeping": True,
                                                                                     "level": level}
        assert httpx.get(f"{base}/is_sleeping", params={"model": "tiny"}).json()["is_sleeping"] is False
        cards = {c["id"]: c["state"] for c in httpx.get(f"{base}/v1/models").json()["data"]}
        assert cards == {"tiny": "ready", "tiny-chat": "ready", "ad1": "ready", "qwen": "sleeping", "llava": "ready",
                         "gemma3": "ready"}
        assert client.completions.create(model="tiny", prompt="still awake", max_tokens=2).choices[0].text
        if level == 1:
            assert qwen() == want                   # held while it wakes, then answered
        else:
            woke = httpx.post(f"{base}/wake_up", params={"model": "qwen"}, timeout=120).json()
            assert woke["is_sleeping"] is False and woke["wake_s"] > 0
            for replica, rss in asleep.json()["rss_bytes"].items():     # memory given back while asleep
                assert rss < woke["rss_bytes"][replica], (replica, rss, woke)
            assert qwen() == want
        assert httpx.get(f"{base}/is_sleeping", params={"model": "qwen"}).json()["is_sleeping"] is False


def test_status_scale_and_apply_per_model(server, apps, tiny_llama, tmp_path, capsys):
    """`pdserve status` shows each model's pools; `pdserve scale` takes MODEL/POOL; `pdserve apply`
    of the spec with a third model (simulated replicas: nothing to load) serves it while the tiny
    model streams, and applying the spec without it again removes it while the tiny model streams:
    no stream is cut or changed, the other models' pools are not touched."""
    import ray
    import yaml
    from helpers import SIM_PROFILE, simulated_outputs

    from cluster.cli import main
    from cluster.config import ClusterConfig
    from cluster.manager import MANAGER_NAME
    from serving.apps import LIMITED

    base = f"{server['base']}/limited"
    capsys.readouterr()
    assert main(["status", "--json", "--name", LIMITED]) == 0
    status = json.loads(capsys.readouterr().out)
    assert sorted(status["models"]) == ["gemma3", "llava", "qwen", "tiny"]
    qwen = status["models"]["qwen"]
    assert sorted(qwen["pools"]) == ["decode", "prefill"]
    assert (qwen["phase"], qwen["mode"]) == ("ready", "disaggregated")
    assert main(["status", "--name", LIMITED]) == 0
    text = capsys.readouterr().out
    assert "deployment pdserve-limited: 4 models" in text and "model qwen (disaggregated" in text, text
    assert main(["scale", "decode", "1", "--name", LIMITED]) == 2
    assert ("serves several models: name MODEL/POOL, MODEL one of ['gemma3', 'llava', 'qwen', 'tiny']"
            in capsys.readouterr().err)
    assert main(["scale", "qwen/decode", "1", "--name", LIMITED]) == 0

    spec = apps[3]["limited"]
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)
    prompt = "The ferry left the harbour at dawn and"
    with LLM(tiny_llama, dtype="float32", max_model_len=1024) as llm:
        want = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].text
    pids = {r: ray.get(h.info.remote())["pid"]
            for r, h in ray.get(apps[2]["qwen"].membership.remote())[1]["decode"].items()}

    def apply_while_streaming(config: ClusterConfig, name: str) -> None:
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(json.loads(config.model_dump_json())))
        done, streams, failures = threading.Event(), [], []

        def stream() -> None:           # one tiny stream after another (its max_in_flight is 1)
            while not done.is_set():
                try:
                    chunks = client.completions.create(model="tiny", prompt=prompt, max_tokens=60, temperature=0.0,
                                                       stream=True, extra_body={"ignore_eos": True})
                    streams.append("".join(c.choices[0].text for c in chunks if c.choices))
                except BaseException as e:  # noqa: BLE001 - reported below
                    failures.append(e)
                    return

        thread = threading.Thread(target=stream)
        thread.start()
        try:
            assert main(["apply", str(path), "--route-prefix", "/limited"]) == 0
        finally:
            done.set()
            thread.join()
        assert not failures, failures
        assert len(streams) >= 2 and all(s == want for s in streams), streams

    sim = {"name": "sim", "model": None, "engine": {"simulate": SIM_PROFILE, "max_model_len": 1024},
           "pools": {"decode": {"replicas": 1}}}
    with_sim = ClusterConfig.model_validate({**spec.model_dump(), "models": [*spec.model_dump()["models"], sim]})
    apply_while_streaming(with_sim, "with-sim")
    assert '"sim": {' in capsys.readouterr().out
    wait_healthy(base)          # (the new ingress attaches sim's pool once it serves)
    sim_prompt = "A model added by pdserve apply answers"
    out = client.completions.create(model="sim", prompt=sim_prompt, max_tokens=8, temperature=0.0,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == simulated_outputs([sim_prompt], 8, max_model_len=1024)[0]
    assert [m.id for m in client.models.list().data] == ["tiny", "tiny-chat", "ad1", "qwen", "llava", "gemma3", "sim"]

    apply_while_streaming(spec, "without-sim")
    assert '"sim": {\n    "removed": true' in capsys.readouterr().out
    with pytest.raises(openai.NotFoundError,
                       match=r"this server serves \['tiny', 'tiny-chat', 'ad1', 'qwen', 'llava', 'gemma3'\]"):
        client.completions.create(model="sim", prompt=sim_prompt, max_tokens=2)
    with pytest.raises(ValueError):                                         # its manager is gone
        ray.get_actor(MANAGER_NAME, namespace="pdserve-limited-sim")
    # qwen's replicas were not touched by either update.
    assert {r: ray.get(h.info.remote())["pid"]
            for r, h in ray.get(apps[2]["qwen"].membership.remote())[1]["decode"].items()} == pids
    assert client.completions.create(model="qwen", prompt=prompt, max_tokens=2).choices[0].text
