"""Bad input gets a ValueError naming the field; aborts free every block; others keep running."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from records.request import RequestStatus


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, dtype="float32", max_model_len=128)


@pytest.mark.parametrize("kwargs,field", [
    ({"temperature": -0.1}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": 0}, "top_k"), ({"top_k": -2}, "top_k"), ({"n": 0}, "n"), ({"max_tokens": 0}, "max_tokens"),
    ({"min_p": 2.0}, "min_p"), ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"presence_penalty": 3.0}, "presence_penalty"), ({"frequency_penalty": -3.0}, "frequency_penalty"),
    ({"logprobs": 50}, "logprobs"), ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"stop": [""]}, "stop"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
])
def test_invalid_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_prompts_are_refused_and_nothing_is_queued(llm):
    engine = llm.llm_engine
    cases = [
        ({"prompt_token_ids": []}, SamplingParams(), "prompt must not be empty"),
        ("", SamplingParams(), "prompt must not be empty"),
        ({"prompt_token_ids": [1, 10**7]}, SamplingParams(), r"prompt_token_ids must be integers in \[0, "),
        ({"prompt_token_ids": [1, -3]}, SamplingParams(), "prompt_token_ids"),
        ({"prompt_token_ids": [5] * 100}, SamplingParams(max_tokens=50), "max_tokens must be <= 28"),
        ({"prompt_token_ids": [5] * 128}, SamplingParams(), "max_model_len is 128"),
    ]
    for prompt, params, msg in cases:
        with pytest.raises(ValueError, match=msg):
            llm.generate([{"prompt_token_ids": [1, 2, 3]}, prompt], params, use_tqdm=False)
        assert not engine.has_unfinished_requests()
    # sampling_params of the wrong kind: named, not an AttributeError from inside the engine
    for params in ({"max_tokens": 3}, [SamplingParams(), {"max_tokens": 3}]):
        with pytest.raises(ValueError, match="sampling_params must be a SamplingParams or a list of them; got dict"):
            llm.generate(["a", "b"], params, use_tqdm=False)
        assert not engine.has_unfinished_requests()
    # Still serving.
    assert llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=2), use_tqdm=False)


@pytest.mark.parametrize("kwargs,field", [
    ({"dtype": "int8"}, "dtype"), ({"block_size": 3}, "block_size"), ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"preemption_mode": "drop"}, "preemption_mode"), ({"max_model_len": 10**6}, "max_model_len"),
    ({"num_kv_blocks": 2}, "num_kv_blocks"),
])
def test_invalid_engine_args(tiny_llama, kwargs, field):
    with pytest.raises(ValueError, match=field):
        LLM(tiny_llama, **kwargs)


def test_unknown_model_path_and_architecture(tmp_path, tiny_llama):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    import json
    import shutil
    bad = tmp_path / "gpt2ish"
    shutil.copytree(tiny_llama, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    cfg["model_type"] = "gpt2"
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"):
        LLM(str(bad))


def test_hub_repo_id_loads_from_the_hf_cache(tiny_llama, tmp_path, monkeypatch):
    """A Hugging Face Hub repo id as `model` (vLLM's way) loads the HF cache's snapshot (built here by
    hand in huggingface_hub's layout, offline: no network in tests), and a server names the model
    by the id; an id that cannot be had is a ValueError naming it."""
    import shutil

    from huggingface_hub import constants

    from cluster.config import ClusterConfig
    from router.ingress.preparer import RequestPreparer

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--pdserve-test--tiny-llama"
    shutil.copytree(tiny_llama, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = [LLM(model, dtype="float32", max_model_len=128).generate("Hello there", params, use_tqdm=False)[0]
               for model in ("pdserve-test/tiny-llama", tiny_llama)]
    assert outputs[0].outputs[0].token_ids == outputs[1].outputs[0].token_ids
    spec = ClusterConfig(model="pdserve-test/tiny-llama").ingress_spec()
    assert RequestPreparer(spec).model_name == "pdserve-test/tiny-llama"
    with pytest.raises(ValueError, match="'pdserve-test/absent' is not a local path, and as a Hugging Face Hub"):
        LLM("pdserve-test/absent")


@pytest.mark.parametrize("when", ["waiting", "mid-prefill", "decoding"])
def test_abort_frees_blocks_and_others_continue(tiny_llama, when):
    llm = LLM(tiny_llama, dtype="float32", max_num_batched_tokens=32, max_num_seqs=3)
    engine = llm.llm_engine
    kv = engine.kv_cache_manager
    finished = {}

    def step():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out

    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    engine.add_request("keep", None, list(range(10, 30)), params)
    engine.add_request("victim", None, list(range(40, 140)),
                       SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, n=2))
    victim = "victim"
    if when == "waiting":
        engine.add_request("late", None, list(range(5, 25)), params)   # max_num_seqs: it waits
        victim = "late"
        step()
        assert engine.scheduler.requests["late"] in engine.scheduler.waiting
    elif when == "mid-prefill":
        step()
        leader = engine.scheduler.requests["victim#0"]
        assert 0 < leader.num_computed_tokens < leader.num_prompt_tokens
    else:
        while engine.scheduler.requests["victim#1"].num_output_tokens < 2:
            step()
    assert any(rid.startswith(victim) for rid in kv.req_to_blocks) or when == "waiting"
    engine.abort_request(victim)
    assert not any(rid.startswith(victim) for rid in kv.req_to_blocks)
    assert not any(rid.startswith(victim) for rid in engine.scheduler.requests)
    while engine.has_unfinished_requests():
        step()
    assert len(finished["keep"].outputs[0].token_ids) == 30
    assert victim not in finished


def test_finish_requests_status_is_abort(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32")
    engine = llm.llm_engine
    engine.add_request("a", None, [1, 2, 3], SamplingParams(max_tokens=5))
    request = engine.scheduler.requests["a"]
    engine.abort_request("a")
    assert request.status == RequestStatus.FINISHED_ABORTED
