"""Calibrated scales for an fp8 KV cache (kv_cache_dtype="fp8", calculate_kv_scales).

An e4m3 value keeps 3 mantissa bits over 2^-6..448 (subnormals down to 2^-9). A layer whose K or V
stays far below 1 (the embedded model's first layer: V's median 0.02) loses most of its precision
at scale 1.0, vLLM's default for checkpoints without scales: teacher-forced on real text the
embedded model agreed with its exact cache on 95.4% of next tokens (docs/perf/journal.md §10). So,
unless the checkpoint brings scales, the worker runs the model once at load over a fixed text
(CALIBRATION_TEXT, or seeded token ids for a model without a tokenizer), in a temporary cache of
the model's dtype, and sets each layer's scale from the largest |K| and |V| it saw, with vLLM's
headroom (scale = amax / 200 for K, / 100 for V: values up to 2.2x and 4.5x the calibration's
largest stay below e4m3's 448), rounded up to a power of two. Where vLLM measures the first live
batch, a fixed text makes the scales a function of the model alone: prefill and decode replicas
compute the same ones, which their KV transfer requires (records/kv_layout.py). TP ranks take the
maximum over the group.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from engine.model.layers.attention import Attention
from engine.model.parallel_state import get_parallel_state
from engine.text.tokenizer import load_tokenizer
from engine.worker.model_runner import ModelRunner

K_SCALE_CONSTANT = 200.0      # vLLM's (vllm/attention/layer.py): stored K = K / (amax / 200)
V_SCALE_CONSTANT = 100.0
CALIBRATION_TOKENS = 512

CALIBRATION_TEXT = """\
The committee met on a grey Tuesday morning to review the quarterly figures. Revenue had risen by
4.7 percent, while costs fell slightly, and the chair asked whether the trend would hold through
the winter. Nobody was certain. One member pointed out that the new warehouse in the north had
doubled its output since March, and another reminded the room that shipping prices were volatile.

def moving_average(values, window=3):
    \"\"\"Return the running mean of a list of numbers.\"\"\"
    out = []
    for i in range(len(values) - window + 1):
        out.append(sum(values[i:i + window]) / window)
    return out

Q: What is the capital of Australia? A: Canberra, not Sydney, although Sydney is larger.
Q: How many minutes are in a day? A: 24 x 60 = 1,440 minutes.

She opened the window and listened. Somewhere below, a dog barked twice, a bicycle bell rang, and
the baker on the corner pulled down his shutters with a long metallic rattle. The city was waking
up. In the kitchen the kettle began to whistle; she poured the water over the leaves, watched them
unfurl, and thought about the letter she had not yet answered.

| item | price | qty |
|------|-------|-----|
| tea  | 3.50  | 2   |
| milk | 1.20  | 1   |

User: Can you summarize the main causes of the French Revolution in three sentences?
Assistant: Financial crisis and heavy debt strained the monarchy. Social inequality between the
estates bred resentment. Enlightenment ideas encouraged people to question absolute rule.
"""


def calibration_ids(model: str, gguf_file: str | None, vocab_size: int) -> list[int]:
    """The calibration text's token ids (up to CALIBRATION_TOKENS), or seeded ids without a tokenizer."""
    tokenizer = load_tokenizer(model, gguf_file)
    if tokenizer is not None:
        return tokenizer(CALIBRATION_TEXT)["input_ids"][:CALIBRATION_TOKENS]
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (CALIBRATION_TOKENS // 2,), generator=g).tolist()


@torch.inference_mode()
def calibrate_kv_scales(runner: ModelRunner, model: str, gguf_file: str | None, vocab_size: int,
                        max_model_len: int) -> tuple[tuple[float, float], ...]:
    """Each of the runner's layers' (K scale, V scale) from one prefill of the calibration tokens
    (one pipeline stage: EngineConfig refuses calibration with pipeline parallelism)."""
    ids = calibration_ids(model, gguf_file, vocab_size)[:max_model_len]
    attns = [m for m in runner.model.modules() if isinstance(m, Attention)]
    amax = torch.zeros(len(attns), 2)

    def observe(i: int):
        def hook(_module: Attention, args: tuple) -> None:
            _, key, value = args[:3]
            amax[i, 0] = max(amax[i, 0].item(), key.abs().max().item())
            amax[i, 1] = max(amax[i, 1].item(), value.abs().max().item())
        return hook

    hooks = [attn.register_forward_pre_hook(observe(i)) for i, attn in enumerate(attns)]
    try:
        n, block_size = len(ids), runner.block_size
        num_blocks = -(-n // block_size)
        caches = [torch.zeros(2, num_blocks, block_size, a.num_kv_heads, a.head_dim, dtype=runner.model_dtype,
                              device=runner.device) for a in attns]
        positions = torch.arange(n, device=runner.device)
        meta = runner.attention.metadata(slot_mapping=positions,
                                         prefill_block_tables=[torch.arange(num_blocks, device=runner.device)],
                                         prefill_query_lens=[n], prefill_seq_lens=[n])
        runner.model(torch.tensor(ids, device=runner.device), positions, caches, meta)
    finally:
        for h in hooks:
            h.remove()
    state = get_parallel_state()
    if state.tp_size > 1:
        amax = amax.to(runner.device)
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=state.tp_group)
        amax = amax.cpu()
    amax = amax.clamp(min=1e-6)          # a layer of zeros: any scale reads back zeros
    return tuple((_power_of_two(k / K_SCALE_CONSTANT), _power_of_two(v / V_SCALE_CONSTANT)) for k, v in amax.tolist())


def _power_of_two(scale: float) -> float:
    """The scale rounded up to a power of two: replicas whose forward passes round differently
    (other thread counts, other kernels) still agree on it, and K / scale is exact."""
    return 2.0 ** math.ceil(math.log2(scale))
