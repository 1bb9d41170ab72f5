"""Gemma 2, Gemma 3 (text) and Phi-3 are token-identical to transformers (fp32, greedy) on tiny
random configs that exercise what sets each apart (tests/conftest.py: soft-caps, local and global
layers with their own ropes, linear rope scaling, LongRoPE, fused checkpoint projections), through
chunked prefill, prefix-cache hits and preemption, on the CPU kernel sets; the MoEs Mixtral,
Qwen3-MoE and Qwen2-MoE too, and what else runs through them (speculation, LoRA, expert load)."""
from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys

import pytest
from helpers import REPO, hf_greedy, mixed_prompts

from engine import LLM, SamplingParams
from engine.llm_engine import LLMEngine
from records.config_resolution import engine_config

FAMILIES = ["gemma2", "gemma3", "phi3", "mixtral", "qwen3_moe", "qwen2_moe"]

MAX_TOKENS = 20


def run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return mixed_prompts(1000, seed=21)


@pytest.fixture(scope="module")
def oracle(prompts):
    cache: dict[str, list[list[int]]] = {}

    def get(path: str) -> list[list[int]]:
        if path not in cache:
            cache[path] = hf_greedy(path, prompts, MAX_TOKENS)
        return cache[path]
    return get


@pytest.mark.parametrize("family,kernels", [(family, "cpu") for family in FAMILIES]
                         + [("gemma2", "reference"), ("phi3", "reference"), ("qwen2_moe", "reference")])
def test_chunked_batch_matches_transformers(family, kernels, prompts, oracle, request, monkeypatch):
    """Every family on the C++ kernels; the torch reference (the fallback where they cannot be
    built) on one model of each kind of layer (the kernels agree with it: tests/kernels)."""
    monkeypatch.setenv("PDSERVE_KERNELS", kernels)
    path = request.getfixturevalue(f"tiny_{family}")
    llm = LLM(path, dtype="float32", max_num_batched_tokens=24, max_model_len=512)
    assert run(llm, prompts) == oracle(path)
    llm.llm_engine.check_no_leaks()


@pytest.mark.parametrize("family", ["llama", *FAMILIES])
def test_a_config_that_crossed_processes_serves_the_same_tokens(family, prompts, oracle, request):
    """What a replica or a TP / PP rank receives: the engine config pickled, the model's config in
    it as plain values (records/frozen_config.py), which a process reads without importing
    transformers or torch; it reads as the original, and an engine built from it is token-identical
    to transformers."""
    path = request.getfixturevalue(f"tiny_{family}")
    config = engine_config(path, dtype="float32", max_model_len=512)
    sent = pickle.dumps(config)
    imported = subprocess.run(
        [sys.executable, "-c", "import pickle, sys; pickle.loads(sys.stdin.buffer.read()); "
                               "print(sorted({m.split('.')[0] for m in sys.modules} & {'transformers', 'torch'}))"],
        input=sent, capture_output=True, cwd=REPO, check=True)
    assert imported.stdout.strip() == b"[]", imported
    received = pickle.loads(sent)
    assert repr(received) == repr(config)          # (what names a pool's replicas: cluster/pool.py: pool_tag)
    engine = LLMEngine(received)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), None, ids, params)
    outs = {}
    while engine.has_unfinished_requests():
        outs.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
    assert [outs[str(i)] for i in range(len(prompts))] == oracle(path)
    engine.check_no_leaks()


@pytest.mark.parametrize("family", ["llama", "llava", "embedded"])
def test_a_resolved_config_is_read_back_frozen_until_its_file_changes(family, request, tmp_path, monkeypatch):
    """What an ingress and a launcher resolve (records/frozen_config.py: resolve_frozen): the model's
    config frozen, as a replica receives it, and the same as resolving it afresh; the next process
    reads it back from the cache without importing transformers' config classes. A changed
    config.json is resolved again, and a cache entry that cannot be read is resolved again too."""
    from records.frozen_config import FrozenConfig, resolve_frozen
    from records.model_source import resolve_model

    cache = tmp_path / "cache"
    monkeypatch.setenv("PDSERVE_CONFIG_CACHE", str(cache))
    model = None
    if family != "embedded":
        model = str(tmp_path / "model")
        os.makedirs(model)
        shutil.copy(os.path.join(request.getfixturevalue(f"tiny_{family}"), "config.json"), model)
    real, frozen = resolve_model(model), resolve_frozen(model)
    assert isinstance(frozen[2], FrozenConfig) and frozen[:2] == real[:2]
    assert frozen[2].to_dict() == real[2].to_dict() and repr(frozen[2]) == repr(real[2])
    assert len(os.listdir(cache)) == 1
    code = ("import json, sys\n"
            "from records.frozen_config import resolve_frozen\n"
            f"path, gguf_file, config = resolve_frozen({model!r})\n"
            "classes = [m for m in sys.modules if m.startswith('transformers.models.') and '.configuration_' in m]\n"
            "print(json.dumps([path, gguf_file, repr(config), classes]))\n")
    read = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert read.returncode == 0, read.stderr[-2000:]
    assert json.loads(read.stdout) == [frozen[0], frozen[1], repr(frozen[2]), []]
    if model is not None:
        config = json.loads((tmp_path / "model" / "config.json").read_text())
        (tmp_path / "model" / "config.json").write_text(json.dumps({**config, "pdserve_note": 7}))
        changed = resolve_frozen(model)[2].to_dict()       # (a vision-language config's in `vision_language`)
        assert '"pdserve_note": 7' in json.dumps(changed) and changed == resolve_model(model)[2].to_dict()
        assert len(os.listdir(cache)) == 2
    for entry in os.listdir(cache):
        (cache / entry).write_bytes(b"not a pickle")
    assert resolve_frozen(model)[2].to_dict() == resolve_model(model)[2].to_dict()


@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_hits_and_preemption_keep_output(family, prompts, oracle, request):
    """A second pass over the same prompts hits the prefix cache; fourteen blocks cannot hold the
    batch, so requests are preempted and recomputed. (Gemma's tiny models, one local and one global
    layer, have a hybrid KV cache whose block is one layer's page: 24 of them are 12 full blocks' bytes.)"""
    path = request.getfixturevalue(f"tiny_{family}")
    blocks = 24 if engine_config(path).kv_groups.hybrid else 14
    llm = LLM(path, dtype="float32", num_kv_blocks=blocks, max_model_len=200, max_num_batched_tokens=64)
    assert run(llm, prompts) == oracle(path)
    stats = llm.llm_engine.stats()
    assert run(llm, prompts) == oracle(path)
    after = llm.llm_engine.stats()
    assert after.num_preemptions > 0 and after.prefix_cache_hits > stats.prefix_cache_hits
    llm.llm_engine.check_no_leaks()


@pytest.mark.parametrize("family", ["gemma2", "mistral_swa", "mixtral"])
def test_ngram_speculation_keeps_output(family, prompts, request):
    """Speculative decoding (n-gram proposals, verified in one pass) gives transformers' tokens; the
    Mistral's window releases blocks while drafts are rolled back."""
    path = request.getfixturevalue(f"tiny_{family}")
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = LLM(path, dtype="float32", max_model_len=512, speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, prompts, 40)
    assert llm.llm_engine.stats().spec.num_draft_tokens > 0
    llm.llm_engine.check_no_leaks()


def test_lora_on_gemma_matches_peft_and_phi3s_fused_targets_are_refused(tiny_gemma2, tiny_phi3, prompts, tmp_path):
    """Gemma's projections carry LoRA as Llama's do (PEFT is the oracle). Phi-3's checkpoint fuses
    them, so its adapters target `qkv_proj` / `gate_up_proj`, which pdserve does not split: refused
    naming the field."""
    from helpers import make_adapter, peft_greedy

    from records.lora import LoRARequest

    adapter = make_adapter(tiny_gemma2, str(tmp_path / "gemma"), 8, ["q_proj", "v_proj", "down_proj"], seed=1)
    llm = LLM(tiny_gemma2, dtype="float32", enable_lora=True, max_lora_rank=8, max_model_len=512)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], params, use_tqdm=False,
                        lora_request=LoRARequest("g", 1, adapter))
    assert [o.outputs[0].token_ids for o in outs] == peft_greedy(tiny_gemma2, adapter, prompts[:4], MAX_TOKENS)
    fused = make_adapter(tiny_phi3, str(tmp_path / "phi3"), 8, ["qkv_proj"], seed=2)
    phi = LLM(tiny_phi3, dtype="float32", enable_lora=True, max_lora_rank=8, max_model_len=512)
    with pytest.raises(ValueError, match="target_modules"):
        phi.generate({"prompt_token_ids": prompts[1]}, params, use_tqdm=False, lora_request=LoRARequest("p", 1, fused))
    phi.llm_engine.check_no_leaks()


def test_lora_on_a_moe_model_matches_peft(tiny_qwen3_moe, prompts, tmp_path):
    """Qwen3-MoE with an adapter on its attention projections, against PEFT; an adapter naming a
    sparse layer's MLP is refused naming target_modules."""
    import json
    import shutil

    from helpers import make_adapter, peft_greedy
    from safetensors.torch import load_file, save_file

    from records.lora import LoRARequest

    adapter = make_adapter(tiny_qwen3_moe, str(tmp_path / "moe"), 8, ["q_proj", "v_proj", "o_proj"], seed=3)
    llm = LLM(tiny_qwen3_moe, dtype="float32", enable_lora=True, max_lora_rank=8, max_model_len=512)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], params, use_tqdm=False,
                        lora_request=LoRARequest("m", 1, adapter))
    assert [o.outputs[0].token_ids for o in outs] == peft_greedy(tiny_qwen3_moe, adapter, prompts[:4], MAX_TOKENS)
    # its layer-1 q_proj tensors renamed onto that layer's (sparse) MLP
    bad = tmp_path / "bad"
    shutil.copytree(adapter, bad)
    tensors = load_file(str(bad / "adapter_model.safetensors"))
    save_file({k.replace("layers.1.self_attn.q_proj", "layers.1.mlp.gate_proj"): v for k, v in tensors.items()},
              str(bad / "adapter_model.safetensors"))
    assert json.loads((bad / "adapter_config.json").read_text())["r"] == 8
    with pytest.raises(ValueError, match="target_modules: layer 1's MLP is a mixture of experts"):
        llm.generate({"prompt_token_ids": prompts[1]}, params, use_tqdm=False,
                     lora_request=LoRARequest("b", 2, str(bad)))
    llm.llm_engine.check_no_leaks()


def test_expert_load_is_counted_and_exported(tiny_mixtral, prompts):
    """Each (token, expert) row a MoE layer runs is counted per expert: a step's rows are the
    tokens times top-k times the MoE layers; the ingress exports them per replica, rank and expert."""
    from router.routing.metrics import ServingMetrics

    llm = LLM(tiny_mixtral, dtype="float32", max_model_len=512)
    run(llm, prompts[:3])
    load = llm.llm_engine.stats().moe_expert_tokens
    assert {expert for _, expert, _ in load} == set(range(8)) and {rank for rank, _, _ in load} == {0}
    tokens = sum(len(p) for p in prompts[:3]) + 3 * (MAX_TOKENS - 1)    # the last token is never run
    assert sum(n for _, _, n in load) == tokens * 2 * 2                 # top-2, two MoE layers
    metrics = ServingMetrics()
    metrics.engines.set_stats("decode", "r0", llm.llm_engine.stats())
    text = metrics.render()
    assert 'pdserve:moe_expert_tokens_total{expert="3",pool="decode",rank="0",replica="r0"}' in text
    metrics.engines.drop("decode", "r0")
    assert "moe_expert_tokens_total{" not in metrics.render()


def test_a_multimodal_gemma3_checkpoint_serves_its_language_model(tiny_gemma3_mm, prompts):
    """Gemma3ForConditionalGeneration (most Gemma 3 checkpoints): text in, text out, from the
    language model's tensors, as transformers' multimodal model generates from text alone."""
    llm = LLM(tiny_gemma3_mm, dtype="float32", max_model_len=512)
    assert llm.llm_engine.config.model_config.architecture == "Gemma3ForCausalLM"
    assert run(llm, prompts) == hf_greedy(tiny_gemma3_mm, prompts, MAX_TOKENS)
