"""The deployment as an RL rollout fleet (cluster/weights.py, cluster/rollout.py): a trainer actor
pushes perturbed weights over a gloo group to every rank of the /pd app's two replicas (prefill and
decode) while 50 greedy streams run, between pause("keep") and resume: no stream fails, each says
which weights made which of its tokens, every answer after the update is a fresh engine's of the new
weights, and no prefix block of the old weights is reused; pause("abort") ends streams with what
they have; a wrong shape from disk is refused by name and the old weights keep serving. (The
update into a TP=2 engine's two ranks: tests/cluster/test_parallel.py.) The app's own weights are
loaded back at the end."""
from __future__ import annotations

import glob
import os
import shutil
import sys
import threading
from dataclasses import replace

import httpx
import openai
import pytest

from engine import LLM, SamplingParams

ray = pytest.importorskip("ray", reason="the serving tests need ray[serve] (make setup installs it)")
pytestmark = pytest.mark.ray

MAX_TOKENS = 24
STREAM_TOKENS = 128     # the first streams run on well past the update
# The trainer actor below is sent to its worker by value (the workers do not import the tests).
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _tensors(path: str) -> dict:
    from safetensors.torch import load_file

    out = {}
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        out.update(load_file(file))
    return out


@ray.remote(num_cpus=0)
class Trainer:
    """A trainer's side: its weights (tiny_llama's, perturbed as a training step would) and the
    client it pushes them with."""

    def __init__(self, path: str, base_url: str) -> None:
        import torch

        from cluster.rollout import RolloutClient

        g = torch.Generator().manual_seed(11)
        self.weights = {n: t + 0.05 * torch.randn(t.shape, generator=g, dtype=t.dtype)
                        for n, t in _tensors(path).items()}
        self.client = RolloutClient(base_url)

    def save(self, out: str) -> None:
        from safetensors.torch import save_file

        save_file({n: t.contiguous() for n, t in self.weights.items()}, os.path.join(out, "model.safetensors"))

    def push(self, version: str) -> str:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        return self.client.update_weights(self.weights.items(), version=version, master_port=port)


def _prompts(n: int, salt: int) -> list[list[int]]:
    """Distinct prompts, every third over 32 tokens (prefilled on the prefill replica)."""
    return [[(salt * 131 + i * 17 + j * 7) % 900 + 5 for j in range(48 if i % 3 == 0 else 12)] for i in range(n)]


def test_a_trainer_updates_both_replicas_between_pause_and_resume(server, tiny_llama, tmp_path):
    base = f"{server['base']}/pd"
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=300)
    trainer = Trainer.remote(tiny_llama, base)
    trained = tmp_path / "trained"
    trained.mkdir()
    for name in os.listdir(tiny_llama):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(tiny_llama, name), trained / name)
    ray.get(trainer.save.remote(str(trained)))
    probe = _prompts(1, salt=99)[0] * 2                 # cached under the old weights before the update
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    fresh = LLM(str(trained), dtype="float32", max_model_len=1024)
    prompts = _prompts(50, salt=1)
    expected = [o.outputs[0].token_ids for o in fresh.generate(
        [{"prompt_token_ids": p} for p in [*prompts, probe]], greedy, use_tqdm=False)]
    expected_streams = [o.outputs[0].token_ids for o in fresh.generate(
        [{"prompt_token_ids": p} for p in prompts], replace(greedy, max_tokens=STREAM_TOKENS), use_tqdm=False)]

    def complete(ids: list[int]):
        return client.completions.create(model=server["model"], prompt=ids, max_tokens=MAX_TOKENS, temperature=0,
                                         extra_body={"ignore_eos": True, "return_token_ids": True})

    assert complete(probe).model_extra["weight_version"] == "0"
    try:
        start = httpx.get(f"{base}/get_weight_version").json()
        assert (start["weight_version"], start["paused"]) == ("0", None)
        streams: dict[int, list] = {}
        errors: list[BaseException] = []
        first = threading.Semaphore(0)

        def stream(i: int) -> None:
            chunks = []
            try:
                for k, chunk in enumerate(client.completions.create(
                        model=server["model"], prompt=prompts[i], max_tokens=STREAM_TOKENS, temperature=0, stream=True,
                        extra_body={"ignore_eos": True, "return_token_ids": True})):
                    chunks.append(chunk)
                    if k == 0:
                        first.release()
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
            streams[i] = chunks

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(50)]
        for t in threads:
            t.start()
        for _ in range(8):                      # eight streams have their first token (old weights)
            assert first.acquire(timeout=300)
        assert httpx.post(f"{base}/pause", params={"mode": "keep"}, timeout=60).json()["paused"] == "keep"
        assert ray.get(trainer.push.remote("1")) == "1"
        assert httpx.post(f"{base}/resume", timeout=60).json() == {"model": "tiny", "weight_version": "1",
                                                                   "paused": None}
        for t in threads:
            t.join(timeout=300)
        assert not errors and len(streams) == 50
        spanned = after = 0
        for i, chunks in streams.items():
            versions = [c.model_extra["weight_version"] for c in chunks if c.choices and c.choices[0].token_ids]
            tokens = [t for c in chunks if c.choices for t in c.choices[0].token_ids]
            assert len(tokens) == STREAM_TOKENS and versions == sorted(versions) and set(versions) <= {"0", "1"}
            spanned += set(versions) == {"0", "1"}
            if set(versions) == {"1"}:          # wholly after the update: the new weights' answer
                after += 1
                assert tokens == expected_streams[i]
        assert spanned > 0 and after > 0, (spanned, after)
        # After it: a fresh engine's answers of the new weights, the old weights' blocks not taken.
        again = complete(probe)
        assert again.model_extra["weight_version"] == "1" and again.usage.prompt_tokens_details.cached_tokens == 0
        assert again.choices[0].token_ids == expected[-1]
        assert complete(probe).usage.prompt_tokens_details.cached_tokens > 0       # the new ones are
        outs = [complete(p) for p in prompts]
        assert [o.choices[0].token_ids for o in outs] == expected[:-1]
        assert {o.model_extra["weight_version"] for o in outs} == {"1"}
        # The rollout client's side of it: samples with their token ids, logprobs and versions.
        from cluster.rollout import RolloutClient

        rollout = RolloutClient(base)
        [sample] = rollout.generate([probe], max_tokens=MAX_TOKENS, temperature=0, logprobs=1, ignore_eos=True)
        assert sample["token_ids"] == expected[-1] and len(sample["logprobs"]) == MAX_TOKENS
        assert sample["weight_versions"] == [[0, "1"]] and rollout.weight_version() == "1"
        response = httpx.post(f"{base}/v1/responses", json={"model": server["model"], "input": "Hello",
                                                              "max_output_tokens": 4}, timeout=120).json()
        assert response["weight_version"] == "1"
        models = httpx.get(f"{base}/v1/models").json()["data"]
        assert {m["weight_version"] for m in models} == {"1"}
        from cluster.cli import format_status

        status = ray.get(server["managers"][2].describe.remote())           # `pdserve status`
        assert status["weight_version"] == "1" and "weights: version 1" in format_status(status)
    finally:                                    # the app's own weights back, for the tests after
        restored = httpx.post(f"{base}/update_weights_from_disk", json={"model_path": tiny_llama}, timeout=300)
        assert restored.status_code == 200 and restored.json()["weight_version"] == "2"


def test_pause_abort_and_a_refused_update(server, tiny_llama, tmp_path):
    """pause("abort") ends the streams with their partial output (finish reason "abort"); resume;
    a checkpoint with a wrong shape is a 400 naming the tensor, and the version and answers stay;
    an app that did not turn the trainer's endpoints on answers them 404, naming the switch."""
    from safetensors.torch import save_file

    from serving.apps import auth

    off = httpx.post(f"{server['base']}/pause", headers=auth(), timeout=60)
    assert off.status_code == 404 and "serving.enable_weight_updates" in off.json()["error"]["message"]
    assert httpx.post(f"{server['base']}/update_weights_from_disk", headers=auth(), json={"x": 1}).status_code == 404

    base = f"{server['base']}/pd"
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=300)
    outs: list = []
    started = threading.Event()

    def stream() -> None:
        chunks = []
        for chunk in client.completions.create(model=server["model"], prompt=_prompts(1, salt=7)[0], max_tokens=500,
                                               temperature=0, stream=True, extra_body={"ignore_eos": True}):
            chunks.append(chunk)
            started.set()
        outs.append(chunks)

    thread = threading.Thread(target=stream)
    thread.start()
    assert started.wait(timeout=300)
    from cluster.rollout import RolloutClient

    rollout = RolloutClient(base)
    assert rollout.pause("abort")["paused"] == "abort"
    thread.join(timeout=300)
    finish = [c.choices[0].finish_reason for c in outs[0] if c.choices and c.choices[0].finish_reason]
    assert finish == ["abort"] and sum(len(c.choices[0].text) > 0 for c in outs[0] if c.choices) > 0
    assert httpx.post(f"{base}/pause", params={"mode": "sideways"}).status_code == 400
    with pytest.raises(ValueError, match="mode must be one of"):
        rollout.pause("sideways")
    assert rollout.resume()["paused"] is None

    version = httpx.get(f"{base}/get_weight_version").json()["weight_version"]
    weights = _tensors(tiny_llama)
    import torch

    weights["model.layers.1.self_attn.o_proj.weight"] = torch.zeros(5, 5)
    for name in os.listdir(tiny_llama):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(tiny_llama, name), tmp_path / name)
    save_file(weights, str(tmp_path / "model.safetensors"))
    before = client.completions.create(model=server["model"], prompt="The river", max_tokens=8, temperature=0)
    refused = httpx.post(f"{base}/update_weights_from_disk", json={"model_path": str(tmp_path)}, timeout=300)
    assert refused.status_code == 400
    assert "'model.layers.1.self_attn.o_proj.weight' has shape [5, 5]" in refused.json()["error"]["message"]
    after = client.completions.create(model=server["model"], prompt="The river", max_tokens=8, temperature=0)
    assert after.choices[0].text == before.choices[0].text
    assert httpx.get(f"{base}/get_weight_version").json() == {"model": "tiny", "weight_version": version,
                                                               "paused": None}


def test_an_adapter_policy_is_updated_on_both_replicas(server, tiny_llama, adapters, tmp_path):
    """An RL policy trained as a LoRA adapter: the trainer updates the served adapter "ad1" from a
    PEFT directory, on the prefill and the decode replica, and answers under it are then a fresh
    engine's with that adapter (a prompt long enough to be prefilled remotely); then, broadcast over a
    gloo group, the adapter's first tensors come back and so do its first answers. An adapter the
    model does not serve is a 400 naming lora_name."""
    import socket

    import torch
    from safetensors.torch import load_file, save_file

    from cluster.rollout import RolloutClient
    from records.lora import ADAPTER_WEIGHTS, LoRARequest

    base = f"{server['base']}/pd"
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=300)
    prompt = _prompts(1, salt=23)[0]

    def answer() -> list[int]:
        out = client.completions.create(model="ad1", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
        return out.choices[0].token_ids

    # The trainer's step: ad1's tensors perturbed, saved as a PEFT directory of their own.
    first = load_file(os.path.join(adapters["ad1"], ADAPTER_WEIGHTS))
    trained = str(tmp_path / "trained")
    shutil.copytree(adapters["ad1"], trained)
    g = torch.Generator().manual_seed(5)
    save_file({n: (t + 0.5 * torch.randn(t.shape, generator=g, dtype=t.dtype)).contiguous() for n, t in first.items()},
              os.path.join(trained, ADAPTER_WEIGHTS))
    offline = LLM(tiny_llama, dtype="float32", enable_lora=True, max_lora_rank=16)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            lora_request=LoRARequest("trained", 1, trained))
    [want] = offline.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    del offline
    rollout = RolloutClient(base)
    before = answer()
    version = rollout.update_weights_from_disk(trained, lora_name="ad1")
    assert answer() == list(want.outputs[0].token_ids) != before
    with pytest.raises(ValueError, match="lora_name must be one of the adapters served"):
        rollout.update_weights_from_disk(trained, lora_name="nope")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert rollout.update_weights(first.items(), lora_name="ad1", master_port=port) != version
    assert answer() == before
