"""Gemma 2 and Gemma 3 (text): the Llama family's parts arranged as Gemma arranges them.

What differs from Llama: the embedding is scaled by sqrt(hidden_size); every norm is Gemma's
RMSNorm, which scales by (1 + weight); each layer is a "sandwich" (a norm after attention and
another before and after the MLP); the MLP is GELU (tanh) gated; scores are scaled by
`query_pre_attn_scalar ** -0.5`; local layers attend within `sliding_window` (Gemma 2 alternates
local and global, Gemma 3 has five local per global, with their own rope base); Gemma 2 soft-caps
attention scores (`attn_logit_softcapping`) and the final logits (`final_logit_softcapping`); Gemma 3
normalizes each head's q and k (as Qwen3).

The residual stream is carried as Llama carries it, (hidden, residual) into the next norm, which
adds them: the sandwich's extra norms act on the branch before it joins the stream, so the sums
are transformers' own, in the same order. Weights load through LlamaForCausalLM's loader (the same
HF names). Local and global layers keep their KV in separate block tables (records/kv_layout.py:
KVGroups), so the local layers' blocks behind their window are freed while the global ones stay.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.layers.attention import AttentionMetadata
from engine.model.layers.linear import MergedColumnParallelLinear, RowParallelLinear, _copy_checked
from engine.model.layers.rmsnorm import RMSNorm
from engine.model.layers.rotary import RotaryEmbedding, rope_parameters
from engine.model.models.llama import LlamaAttention, LlamaForCausalLM


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm, x / rms(x) * (1 + weight): the loader keeps 1 + weight, which is the same
    product (fp32: the same bits; in bf16 the sum is rounded once, where transformers keeps it fp32)."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(hidden_size, eps, dtype)
        self.weight.weight_loader = lambda p, t, s=None: _copy_checked(p.data, (t.float() + 1.0).to(p.dtype))


class GemmaMLP(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"hidden_activation must be 'gelu_pytorch_tanh'; got {act!r}")
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2,
                                                       bias=False, dtype=dtype)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype, window: int | None, qk_norm: bool) -> None:
        super().__init__()
        eps, hidden = config.rms_norm_eps, config.hidden_size
        bias = bool(getattr(config, "attention_bias", False))
        self.is_local = window is not None
        self.self_attn = LlamaAttention(config, dtype, bias, bias, qk_norm, window,
                                        scale=config.query_pre_attn_scalar ** -0.5,
                                        softcap=getattr(config, "attn_logit_softcapping", None), norm=GemmaRMSNorm)
        self.mlp = GemmaMLP(config, dtype)
        self.input_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                rotary: RotaryEmbedding, kv_cache: torch.Tensor, meta: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos, sin, rotary, kv_cache, meta)
        hidden, _ = self.post_attention_layernorm(hidden)
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        hidden, _ = self.post_feedforward_layernorm(self.mlp(hidden))
        return hidden, residual


class Gemma2ForCausalLM(LlamaForCausalLM):
    qk_norm = False
    cpu_decode_plan = False         # its layer is not the one engine/worker/cpu_decode.py flattens
    norm_class = GemmaRMSNorm

    def make_layer(self, config: Any, dtype: torch.dtype, index: int, window: int | None) -> nn.Module:
        return GemmaDecoderLayer(config, dtype, window, self.qk_norm)

    def __init__(self, config: Any, dtype: torch.dtype, max_positions: int) -> None:
        super().__init__(config, dtype, max_positions)
        # Local layers' own rope (Gemma 3: a lower base than the global layers'); None: one rope.
        head_dim = self.layers[0].self_attn.head_dim
        local = rope_parameters(config, "sliding_attention")
        self.local_rotary = (RotaryEmbedding(head_dim, max_positions, local, dtype)
                             if local != rope_parameters(config) else None)
        self.embed_scale = config.hidden_size ** 0.5
        self.final_softcap = getattr(config, "final_logit_softcapping", None)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        return hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)

    def layer_ropes(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, RotaryEmbedding]]:
        ropes = super().layer_ropes(positions)
        if self.local_rotary is None:
            return ropes
        local = (*self.local_rotary.lookup(positions), self.local_rotary)
        return [local if layer.is_local else rope for layer, rope in zip(self.layers, ropes, strict=True)]

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None,
                       model_dtype: bool = False) -> torch.Tensor:
        """LlamaForCausalLM.compute_logits', soft-capped where the model caps them (monotonic: a
        greedy argmax is the same either way)."""
        logits = super().compute_logits(hidden, out, model_dtype)
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = True
