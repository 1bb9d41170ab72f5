"""Multi-LoRA: PEFT adapters served in mixed batches, token-identical (fp32 greedy) to transformers +
PEFT on each adapter; the adapter pool's slots and eviction; prefix caching keyed by adapter;
adapters under chunked prefill and preemption; and the errors for adapters that cannot run."""
from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import hf_model, mixed_prompts

from engine.llm import LLM
from engine.lora import LoRARequest
from engine.sampling_params import SamplingParams

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL = ATTENTION + ["gate_proj", "up_proj", "down_proj"]
NEW_TOKENS = 10


def make_adapter(base_path: str, out_dir: str, rank: int, targets: list[str], seed: int,
                 alpha: float | None = None, rslora: bool = False) -> str:
    """A PEFT LoRA adapter of the model at `base_path` with random A and B (PEFT starts B at zero,
    which would make every adapter the base model), saved as PEFT saves one."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank, target_modules=targets,
                        lora_dropout=0.0, use_rslora=rslora)
    model = get_peft_model(base, config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)
    model.save_pretrained(out_dir)
    return out_dir


def peft_greedy(base_path: str, adapter: str | None, prompts: list[list[int]], max_new_tokens: int):
    """The oracle: transformers + PEFT greedy generate on `adapter` (None: the base model)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = hf_model(base_path)
    if adapter is not None:
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32),
                                          adapter).eval()
    outs = []
    for ids in prompts:
        with torch.no_grad():
            gen = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=max_new_tokens,
                                 min_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
        outs.append(gen[0, len(ids):].tolist())
    return outs


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
