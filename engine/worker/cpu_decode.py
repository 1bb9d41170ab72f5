"""The CPU's counterpart of CUDA graphs: a decode step's forward pass as one flat loop of kernel calls.

At small batch a CPU decode step of a small model spends as much time in Python as in its kernels:
each of the embedded model's 30 layers makes eleven module calls, each linear looks up its kernel
set and checks its input, each kernel wrapper re-checks dtypes and strides, and every `self.x` of
a module goes through `nn.Module.__getattr__`. On a 2-core AMD EPYC that was ~10 ms of a 33 ms
batch-1 step (docs/perf/journal.md §9c). `CpuDecodePlan` resolves all of that once, when it is built:
it holds every layer's weights and norms in a flat tuple and calls the C++ kernels directly, with
the checks their wrappers make per call made here once (dtypes, head size, the cache's layout).

It runs only steps in which every token is a decode (prefill and mixed steps take the modules), on
one rank (no TP or PP), without LoRA, on the C++ CPU kernel set, for the Llama family's layer,
Qwen3's per-head q/k norms included (engine/model/models/llama.py: LlamaDecoderLayer, whose forward this
mirrors call for call, so the two give bit-identical hidden states: tests/engine/test_cpu_decode.py).
Where any of that does not hold, `build` returns None and the modules run. `PDSERVE_CPU_DECODE_PLAN=0` turns it off.
"""
from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from engine.model.layers.attention import AttentionMetadata
from engine.model.models.llama import LlamaForCausalLM
from engine.model.parallel_state import get_parallel_state
from kernels import cpu_ops


def plan_enabled() -> bool:
    """`PDSERVE_CPU_DECODE_PLAN` (default 1): whether CPU decode steps may run as a flat plan."""
    value = os.environ.get("PDSERVE_CPU_DECODE_PLAN", "1")
    if value not in ("0", "1"):
        raise ValueError(f"PDSERVE_CPU_DECODE_PLAN must be 0 or 1; got {value!r}")
    return value == "1"


class CpuDecodePlan:
    """A Llama-family model's decode forward as a flat list of C++ kernel calls (see the module)."""

    def __init__(self, model: nn.Module, layers: list[tuple[Any, ...]], fp8_cache: bool) -> None:
        self.model = model
        self.layers = layers
        ops = torch.ops.pdserve_cpu
        self.rms_norm, self.rotary, self.paged_decode = ops.rms_norm, ops.rotary, ops.paged_decode
        # A cache in the model's dtype: one C++ call from the QKV output to the attention output
        # (rotary, the K/V write, paged decode). An fp8 cache's rows are quantized by their layer's
        # scales before the byte write (in cpu_ops.write_kv), and Qwen3 normalizes q and k before
        # the rotary embedding, so there the steps stay separate.
        self.fp8_cache, self.write_kv = fp8_cache, cpu_ops.write_kv
        self.attention = ops.decode_attention_qkv.default

    @classmethod
    def build(cls, model: nn.Module, kernels: Any, kv_caches: list[torch.Tensor]) -> CpuDecodePlan | None:
        """The plan for this model, kernel set and cache, or None where the modules must run."""
        state = get_parallel_state()
        if (not plan_enabled() or kernels is not cpu_ops or not isinstance(model, LlamaForCausalLM)
                or not model.cpu_decode_plan
                or state.tp_size > 1 or state.pp_size > 1 or not kv_caches):
            return None
        dtype = model.rotary.cos.dtype
        attn = model.layers[0].self_attn
        norms = [n for layer in model.layers for n in (layer.input_layernorm, layer.post_attention_layernorm,
                                                        layer.self_attn.q_norm, layer.self_attn.k_norm)
                 if n is not None]
        cache = kv_caches[0]
        # What the kernel wrappers check per call (kernels/cpu_ops.py), checked once: every call
        # below would take the C++ kernel there too.
        if (dtype not in cpu_ops.DTYPES or model.norm.weight.dtype != dtype or model.embed_tokens.dtype != dtype
                or any(n.weight.dtype != dtype for n in norms)
                or attn.head_dim not in cpu_ops.HEAD_DIMS
                or any(not c.is_contiguous() or c.dtype != cache.dtype for c in kv_caches)
                or cache.dtype not in (dtype, cpu_ops.FP8_DTYPE)):
            return None
        layers = []
        for layer in model.layers:
            a, mlp = layer.self_attn, layer.mlp
            linears = (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if any(m.dtype != dtype for m in linears):
                return None
            layers.append((layer.input_layernorm.weight, float(layer.input_layernorm.eps), a.qkv_proj.rows_matmul(),
                           [a.q_size, a.kv_size, a.kv_size], a.num_heads, a.num_kv_heads, a.head_dim, a.attn,
                           (float(a.attn.scale), int(a.attn.window), float(a.attn.softcap)),
                           a.o_proj.rows_matmul(), layer.post_attention_layernorm.weight,
                           float(layer.post_attention_layernorm.eps), mlp.gate_up_proj.silu_rows_matmul(),
                           mlp.down_proj.rows_matmul(),
                           None if a.q_norm is None else (a.q_norm.weight, a.k_norm.weight, float(a.q_norm.eps))))
        return cls(model, layers, fp8_cache=cache.dtype != dtype)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
            meta: AttentionMetadata) -> torch.Tensor:
        """The final hidden states [T, hidden] of a step whose T tokens are all decodes; what
        `model(input_ids, positions, kv_caches, meta)` returns, bit for bit."""
        model, num = self.model, input_ids.shape[0]
        rms_norm, rotary, paged_decode, attention, write_kv, fp8_cache = (
            self.rms_norm, self.rotary, self.paged_decode, self.attention, self.write_kv, self.fp8_cache)
        slots, tables, lens = meta.slot_mapping, meta.decode_block_tables, meta.decode_seq_lens
        cos, sin = model.rotary.lookup(positions)
        hidden, residual = model.embed_tokens(input_ids), None
        for (norm1, eps1, qkv, sizes, heads, kv_heads, head_dim, attn, shape, o_proj, norm2, eps2, swiglu,
             down, qk_norms), kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = rms_norm(hidden, norm1, eps1, residual)
            k_scale, v_scale = attn.k_scale, attn.v_scale       # read per step: calibration sets them after build
            if not fp8_cache and qk_norms is None:
                out = attention(qkv(hidden), cos, sin, kv_cache, slots, tables, lens, heads, kv_heads, shape[0],
                                float(k_scale), float(v_scale), *shape[1:])
            else:
                q, k, v = qkv(hidden).split(sizes, dim=-1)
                if qk_norms is not None:                   # Qwen3: each head's q and k RMS-normalized
                    q_norm, k_norm, qk_eps = qk_norms
                    q = rms_norm(q.reshape(-1, head_dim), q_norm, qk_eps, None)[0]
                    k = rms_norm(k.reshape(-1, head_dim), k_norm, qk_eps, None)[0]
                q, k = rotary(q.view(num, heads, head_dim), k.view(num, kv_heads, head_dim), cos, sin)
                write_kv(k, v.view(num, kv_heads, head_dim), kv_cache, slots, k_scale, v_scale)
                out = paged_decode(q, kv_cache, tables, lens, shape[0], float(k_scale), float(v_scale),
                                   *shape[1:]).view(num, heads * head_dim)
            hidden = o_proj(out)
            hidden, residual = rms_norm(hidden, norm2, eps2, residual)
            hidden = down(swiglu(hidden))
        hidden, _ = rms_norm(hidden, model.norm.weight, float(model.norm.eps), residual)
        return hidden
