"""Multi-LoRA: PEFT adapters served in mixed batches, token-identical (fp32 greedy) to transformers +
PEFT on each adapter; the adapter pool's slots and eviction; prefix caching keyed by adapter;
adapters under chunked prefill and preemption; and the errors for adapters that cannot run."""
from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
import torch
from helpers import make_adapter, mixed_prompts, peft_greedy, save_random_model

from engine.llm import LLM
from records.lora import LoRARequest
from records.sampling_params import SamplingParams

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL = ATTENTION + ["gate_proj", "up_proj", "down_proj"]
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "attn8": make_adapter(tiny_llama, str(root / "attn8"), 8, ATTENTION, seed=1),
        "all16": make_adapter(tiny_llama, str(root / "all16"), 16, ALL, seed=2),
        "qv8rs": make_adapter(tiny_llama, str(root / "qv8rs"), 8, ["q_proj", "v_proj"], seed=3, alpha=4,
                              rslora=True),
        "mlp16": make_adapter(tiny_llama, str(root / "mlp16"), 16, ["gate_proj", "down_proj"], seed=4),
    }


@pytest.fixture(scope="module")
def oracle(tiny_llama, adapters) -> dict[str | None, list[list[int]]]:
    prompts = mixed_prompts(512)
    return {name: peft_greedy(tiny_llama, adapters.get(name), prompts, NEW_TOKENS)
            for name in [None, *adapters]}


def _requests(adapters: dict[str, str]) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(adapters.items())}


def test_adapters_differ_from_base(oracle):
    """The adapters change the output, so matching each one's oracle means something."""
    for name, out in oracle.items():
        if name is not None:
            assert out != oracle[None], name


@pytest.mark.parametrize("engine_kw", [
    dict(max_loras=4),
    # two slots for four adapters: the scheduler holds the rest back and the slots are refilled;
    # small chunks: prompts prefilled in pieces beside decodes of other adapters
    dict(max_loras=2, max_cpu_loras=2, max_num_batched_tokens=24),
], ids=["slots-for-all", "evicting-chunked"])
def test_mixed_batch_matches_peft(tiny_llama, adapters, oracle, engine_kw):
    prompts = mixed_prompts(512)
    loras = _requests(adapters)
    names = [None, *adapters]
    cases = [(p, names[(i + j) % len(names)]) for i, p in enumerate(prompts) for j in range(2)]
    llm = LLM(tiny_llama, dtype="float32", enable_lora=True, max_lora_rank=16, **engine_kw)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in cases], params, use_tqdm=False,
                        lora_request=[loras[n] if n else None for _, n in cases])
    for (prompt, name), out in zip(cases, outs):
        assert out.outputs[0].token_ids == oracle[name][prompts.index(prompt)], (name, len(prompt))
    slots = llm.llm_engine.executor.worker.runner.lora
    if engine_kw["max_loras"] == 2:
        assert slots.loads > len(adapters)        # host copies evicted and read again


def test_prefix_cache_is_keyed_by_adapter(tiny_llama, adapters, oracle):
    """A prompt cached under one adapter is a hit for that adapter only: under another adapter, or
    the base model, its blocks are computed again (and the outputs still match each oracle)."""
    prompt = mixed_prompts(512)[-1]                      # 130 tokens: 8 full blocks
    loras = _requests(adapters)
    llm = LLM(tiny_llama, dtype="float32", enable_lora=True, max_lora_rank=16)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)

    def run(name):
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False,
                           lora_request=loras[name] if name else None)[0]
        assert out.outputs[0].token_ids == oracle[name][-1], name
        return out.num_cached_tokens

    assert run("attn8") == 0
    assert run("attn8") == 128                           # a hit under the same adapter
    assert run("all16") == 0                             # never shared across adapters
    assert run(None) == 0                                # nor with the base model
    assert run("all16") == 128 and run(None) == 128
    # The same name at another path is another adapter (unload, then load a new version).
    moved = LoRARequest("attn8", 1, adapters["all16"])
    assert llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False,
                        lora_request=moved)[0].num_cached_tokens == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_adapters(tiny_llama, adapters, oracle, mode):
    """Few KV blocks: requests of different adapters are preempted and resumed (recomputed under
    their adapter, or swapped back), and each still matches its oracle."""
    prompts = mixed_prompts(512)
    loras = _requests(adapters)
    names = [None, *adapters]
    cases = [(i, names[(i + j) % len(names)]) for i in range(len(prompts)) for j in range(2)]
    # 14 blocks of 16 tokens cannot hold 14 sequences of up to 140 tokens at once.
    llm = LLM(tiny_llama, dtype="float32", enable_lora=True, max_lora_rank=16, max_loras=4, num_kv_blocks=14,
              max_model_len=200, max_num_batched_tokens=64, preemption_mode=mode)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": prompts[i]} for i, _ in cases], params, use_tqdm=False,
                        lora_request=[loras[n] if n else None for _, n in cases])
    for (i, name), out in zip(cases, outs):
        assert out.outputs[0].token_ids == oracle[name][i], (name, i)
    assert llm.llm_engine.scheduler.num_preemptions > 0


def test_a_request_of_one_adapter_too_many_waits_while_others_run(tiny_llama, adapters):
    """max_loras=1: with "attn8" running, a request under "all16" waits in the queue, and the
    requests behind it under "attn8" (and of the base model) still start; it runs once "attn8" has
    no request left, and every output still matches a run with room for all."""
    from engine.llm_engine import LLMEngine

    loras = _requests(adapters)
    llm = LLM(tiny_llama, dtype="float32", enable_lora=True, max_lora_rank=16, max_loras=1)
    engine: LLMEngine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    prompt = mixed_prompts(512)[2]
    order = [("a1", "attn8"), ("b1", "all16"), ("a2", "attn8"), ("base", None)]
    for rid, name in order:
        engine.add_request(rid, None, prompt, replace(params, lora_request=loras.get(name)))
    engine.step()
    assert {r.request_id for r in engine.scheduler.running} == {"a1", "a2", "base"}
    assert [r.request_id for r in engine.scheduler.waiting] == ["b1"]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    roomy = LLM(tiny_llama, dtype="float32", enable_lora=True, max_lora_rank=16, max_loras=4)
    want = roomy.generate([{"prompt_token_ids": prompt}] * 4, params, use_tqdm=False,
                          lora_request=[loras.get(name) for _, name in order])
    assert [done[rid] for rid, _ in order] == [w.outputs[0].token_ids for w in want]


def _edit_config(path: str, **changes) -> None:
    config_path = os.path.join(path, "adapter_config.json")
    with open(config_path) as f:
        config = json.load(f)
    config.update(changes)
    with open(config_path, "w") as f:
        json.dump(config, f)


def test_bad_adapters_are_refused(tiny_llama, adapters, tmp_path, tmp_path_factory):
    """Each adapter that cannot run is a ValueError naming the field, raised before anything is
    queued; the engine then serves the next request (and the fixture checks every block is free)."""
    import shutil

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    llm = LLM(tiny_llama, dtype="float32", enable_lora=True, max_lora_rank=8)
    params = SamplingParams(temperature=0, max_tokens=4)
    prompt = {"prompt_token_ids": [5, 6, 7]}

    def refused(lora: LoRARequest, *words: str) -> None:
        with pytest.raises(ValueError) as err:
            llm.generate([prompt, prompt], params, use_tqdm=False, lora_request=[None, lora])
        for word in words:
            assert word in str(err.value), str(err.value)

    refused(LoRARequest("big", 1, adapters["all16"]), "r (16)", "max_lora_rank (8)")
    refused(LoRARequest("none", 2, str(tmp_path / "missing")), "lora_path")
    # An adapter of the embedding: a target pdserve does not serve.
    emb = str(tmp_path / "emb")
    base = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "embed_tokens"])).save_pretrained(emb)
    refused(LoRARequest("emb", 3, emb), "target_modules")
    # An adapter trained on another base model: a narrower one (hidden 32 against 64).
    from transformers import LlamaConfig

    narrow = save_random_model(tmp_path_factory, LlamaConfig(
        vocab_size=512, hidden_size=32, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2), "narrow", seed=5)
    refused(LoRARequest("other", 4, make_adapter(narrow, str(tmp_path / "other"), 4, ATTENTION, seed=5)),
            "shape must be", "another base model")
    dora = str(tmp_path / "dora")
    shutil.copytree(adapters["attn8"], dora)
    _edit_config(dora, use_dora=True)
    refused(LoRARequest("dora", 5, dora), "use_dora")
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, dora)
    # No LoRA on this engine.
    plain = LLM(tiny_llama, dtype="float32")
    with pytest.raises(ValueError, match="lora_request.*enable_lora"):
        plain.generate(prompt, params, use_tqdm=False, lora_request=LoRARequest("a", 1, adapters["attn8"]))
    assert llm.generate(prompt, params, use_tqdm=False,
                        lora_request=LoRARequest("ok", 6, adapters["attn8"]))[0].outputs[0].token_ids
