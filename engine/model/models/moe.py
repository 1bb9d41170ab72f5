"""Mixture-of-experts members of the Llama family: Mixtral, Qwen2-MoE (with its gated shared
expert) and Qwen3-MoE. Attention is their base's (Mistral's, Qwen2's with QKV bias, Qwen3's with
q/k norms); the MLP of a sparse layer is a FusedMoE (engine/model/layers/moe.py), of a dense one
(Qwen's `mlp_only_layers`, `decoder_sparse_step`) Llama's.

Checkpoints keep one tensor per expert and projection (Mixtral's `block_sparse_moe.experts.E.w1/w2/w3`,
Qwen's `mlp.experts.E.gate_proj/up_proj/down_proj`); `remap_weight` sends each into the fused
expert weights with its (expert, part) shard id."""
from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.layers.linear import _copy_checked
from engine.model.layers.moe import FusedMoE
from engine.model.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from engine.model.parallel_state import get_parallel_state
from records.model_source import is_moe_layer

# checkpoint expert tensor -> (our parameter, gate/up part); part None: the down projection
_EXPERT = re.compile(r"^(layers\.\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)"
                     r"\.weight$")
_PARTS = {"w1": ("w13", 0), "gate_proj": ("w13", 0), "w3": ("w13", 1), "up_proj": ("w13", 1),
          "w2": ("w2", None), "down_proj": ("w2", None)}


class SparseMoeBlock(nn.Module):
    """The experts, and where the model has one, a shared expert weighed by a sigmoid gate (Qwen2-MoE)."""

    def __init__(self, config: Any, dtype: torch.dtype, num_experts: int, inter: int, renormalize: bool,
                 shared_inter: int = 0) -> None:
        super().__init__()
        self.experts = FusedMoE(num_experts, config.num_experts_per_tok, config.hidden_size, inter, renormalize,
                                dtype, get_parallel_state().moe_dispatch)
        self.shared_expert = LlamaMLP(config, dtype, shared_inter) if shared_inter else None
        self.shared_expert_gate = None
        if shared_inter:
            self.shared_expert_gate = nn.Parameter(torch.empty(1, config.hidden_size, dtype=dtype), requires_grad=False)
            self.shared_expert_gate.weight_loader = lambda p, t, s=None: _copy_checked(p.data, t)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(F.linear(x, self.shared_expert_gate)) * self.shared_expert(x)
        return out


class MixtralForCausalLM(LlamaForCausalLM):
    cpu_decode_plan = False         # its MLP is not the one engine/worker/cpu_decode.py flattens
    cuda_graphs = False             # the experts' token counts are read on the host (kernels/triton_moe.py)

    def moe_block(self, config: Any, dtype: torch.dtype, index: int) -> nn.Module | None:
        """Layer `index`'s MoE block, or None where the layer is dense."""
        return SparseMoeBlock(config, dtype, config.num_local_experts, config.intermediate_size, True)

    def make_layer(self, config: Any, dtype: torch.dtype, index: int, window: int | None) -> nn.Module:
        qkv_bias, o_bias = self.attention_biases(config)
        return LlamaDecoderLayer(config, dtype, qkv_bias, o_bias, self.qk_norm, window,
                                 mlp=self.moe_block(config, dtype, index))

    def remap_weight(self, name: str) -> tuple[str, object] | None:
        match = _EXPERT.match(name)
        if match:
            layer, expert, proj = match.groups()
            param, part = _PARTS[proj]
            return f"{layer}.mlp.experts.{param}", (int(expert), part)
        if name.endswith((".block_sparse_moe.gate.weight", ".mlp.gate.weight")):
            return name.split(".", 2)[0] + "." + name.split(".", 2)[1] + ".mlp.experts.gate", None
        if name.endswith(".mlp.shared_expert_gate.weight"):
            return name.removesuffix(".weight"), None
        return None


class Qwen2MoeForCausalLM(MixtralForCausalLM):
    @staticmethod
    def attention_biases(config: Any) -> tuple[bool, bool]:
        return bool(getattr(config, "qkv_bias", True)), False

    def moe_block(self, config: Any, dtype: torch.dtype, index: int) -> nn.Module | None:
        if not is_moe_layer(config, index):
            return None
        return SparseMoeBlock(config, dtype, config.num_experts, config.moe_intermediate_size,
                              bool(getattr(config, "norm_topk_prob", False)),
                              getattr(config, "shared_expert_intermediate_size", 0) or 0)


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    qk_norm = True

    @staticmethod
    def attention_biases(config: Any) -> tuple[bool, bool]:
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias
