"""Phi-3: the Llama layer with its projections fused in the checkpoint (`qkv_proj`, `gate_up_proj`)
and LongRoPE scaling where the config has it (engine/model/layers/rotary.py).

The fused checkpoint tensors are cut into their parts (q, k, v; gate, up) as they load, so that
each goes through the same per-part loaders as Llama's (which shard them over TP ranks)."""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from engine.loading.weights import GGUFWeight
from engine.model.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | GGUFWeight]],
                     dense_copies: bool = False, partial: bool = False) -> None:
        super().load_weights(self._unfused(weights), dense_copies, partial)

    def _unfused(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        config = self.config
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        for name, tensor in weights:
            if ".qkv_proj." in name or ".gate_up_proj." in name:
                if not isinstance(tensor, torch.Tensor):
                    raise ValueError(f"{name}: a fused {type(tensor).__name__} cannot be cut into its parts; "
                                     f"Phi-3 loads from safetensors")
                if ".qkv_proj." in name:
                    sizes, parts = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], ("q", "k", "v")
                else:
                    sizes, parts = [tensor.shape[0] // 2] * 2, ("gate", "up")
                fused = ".qkv_proj." if ".qkv_proj." in name else ".gate_up_proj."
                for part, piece in zip(parts, tensor.split(sizes, dim=0), strict=True):
                    yield name.replace(fused, f".{part}_proj."), piece
            else:
                yield name, tensor
