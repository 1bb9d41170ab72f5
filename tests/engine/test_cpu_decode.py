"""The CPU decode plan (engine/worker/cpu_decode.py) against the modules it stands in for: every decode
step it runs gives bit-identical hidden states and KV cache bytes to the model's own forward, on
each kind of layer it runs (fp32 and bf16 weights, a QKV bias, GGUF blocks beside their dense copy,
an fp8 cache); and it stands aside where it must (prefill and mixed steps, LoRA, another kernel set,
PDSERVE_CPU_DECODE_PLAN=0)."""
from __future__ import annotations

import pytest
import torch
from helpers import mixed_prompts

from engine import LLM, SamplingParams
from engine.worker.cpu_decode import CpuDecodePlan

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


class CheckedPlan:
    """Runs the plan, then the model's forward on the same step, and compares the two."""

    def __init__(self, plan: CpuDecodePlan) -> None:
        self.plan, self.steps, self.rows = plan, 0, set()

    def run(self, input_ids, positions, kv_caches, meta):
        assert meta.num_decode_tokens == input_ids.shape[0] > 0     # decode steps only
        hidden = self.plan.run(input_ids, positions, kv_caches, meta)
        written = [c.view(torch.uint8).clone() for c in kv_caches]
        again = self.plan.model(input_ids, positions, kv_caches, meta)    # writes the same slots again
        assert hidden.dtype == again.dtype and torch.equal(hidden, again)
        assert all(torch.equal(c.view(torch.uint8), w) for c, w in zip(kv_caches, written))
        self.steps += 1
        self.rows.add(input_ids.shape[0])
        return hidden


def checked(llm: LLM) -> CheckedPlan:
    runner = llm.llm_engine.executor.worker.runner
    plan = CpuDecodePlan.build(runner.model, runner.kernels, runner.kv_caches)
    assert plan is not None
    runner.decode_plan = CheckedPlan(plan)
    return runner.decode_plan


def generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("model,dtype,kv", [("llama", "float32", "auto"), ("qwen2", "float32", "auto"),
                                            ("llama", "bfloat16", "auto"), ("qwen2", "float32", "fp8"),
                                            ("qwen3", "float32", "auto")])
def test_plan_equals_the_modules(model, dtype, kv, request):
    """Mixed-length prompts, so that decode steps of several sizes run beside prefill ones (Qwen3:
    its per-head q/k norms between the QKV split and the rotary embedding)."""
    path = request.getfixturevalue(f"tiny_{model}")
    # Without prefix caching the second generate runs the same steps as the first. With it, a prompt
    # whose blocks but the last token are cached computes that token as a decode row (decode
    # attention) where the first run computed it in a prefill chunk (prefill attention), and in bf16
    # the two kernels round differently (the prefill kernel's softmax weights are bf16 on AVX512-BF16).
    llm = LLM(path, dtype=dtype, kv_cache_dtype=kv, max_model_len=256, max_num_batched_tokens=96,
              enable_prefix_caching=False)
    plan = checked(llm)
    prompts = mixed_prompts(1000, seed=3)
    tokens = generate(llm, prompts)
    assert plan.steps > 0 and len(plan.rows) > 1
    runner = llm.llm_engine.executor.worker.runner
    runner.decode_plan = None                                  # the modules alone
    assert generate(llm, prompts) == tokens


@pytest.mark.parametrize("int8", [False, True])
def test_plan_equals_the_modules_on_gguf_blocks(int8):
    """The embedded Q4_1 model with its dense copy: few rows multiply the blocks (the plan calls the
    kernel directly; with quantize_activations the int8 one), from gguf_dense_min_rows on the dense
    copy (the layer's own matmul)."""
    from kernels.cpu_ops import gguf_dense_min_rows

    dense_min_rows = gguf_dense_min_rows(torch.float32)
    llm = LLM(dtype="float32", quantization="gguf+dense", max_model_len=256, quantize_activations=int8)
    plan = checked(llm)
    prompts = [[1, 30 + i, 700 + 3 * i] for i in range(dense_min_rows + 1)]
    few = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)   # three decode steps each: 135M weights
    llm.generate([{"prompt_token_ids": p} for p in prompts], few, use_tqdm=False)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], few, use_tqdm=False)
    assert {2, dense_min_rows + 1} <= plan.rows


def test_plan_stands_aside(tiny_llama, monkeypatch):
    llm = LLM(tiny_llama, dtype="float32", max_model_len=128)
    runner = llm.llm_engine.executor.worker.runner
    generate(llm, [[1, 2, 3]])
    assert isinstance(runner.decode_plan, CpuDecodePlan)      # built at the first decode step, used by default
    args = (runner.model, runner.kernels, runner.kv_caches)
    monkeypatch.setenv("PDSERVE_CPU_DECODE_PLAN", "0")
    assert CpuDecodePlan.build(*args) is None
    monkeypatch.setenv("PDSERVE_CPU_DECODE_PLAN", "yes")
    with pytest.raises(ValueError, match="PDSERVE_CPU_DECODE_PLAN must be 0 or 1"):
        CpuDecodePlan.build(*args)
    monkeypatch.delenv("PDSERVE_CPU_DECODE_PLAN")
    from kernels import reference
    assert CpuDecodePlan.build(runner.model, reference, runner.kv_caches) is None

    lora = LLM(tiny_llama, dtype="float32", max_model_len=128, enable_lora=True)
    generate(lora, [[1, 2, 3]])
    assert lora.llm_engine.executor.worker.runner.decode_plan is False     # never built with LoRA on
