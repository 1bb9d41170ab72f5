"""Vision encoders of vision-language models: CLIP's vision transformer (LLaVA's tower), run up to
the hidden states the language model reads, and SigLIP's (Gemma 3's: no class token, a norm after
the last layer rather than before the first).

The parameters keep transformers' names below `vision_model.` (`embeddings.patch_embedding.weight`,
`encoder.layers.{i}.self_attn.q_proj.weight`, `pre_layrnorm.weight` as CLIP spells it), so a
checkpoint's tensors load by name. The tower is replicated on every tensor-parallel rank (it is a
few hundred million parameters at most, and runs once per image: engine/worker/encoder_cache.py).
Only the layers up to the deepest one read are built; the pooled head is not (no model reads it).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS = {"quick_gelu": lambda x: x * torch.sigmoid(1.702 * x), "gelu": F.gelu,
               "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu}


def activation(name: str, field: str) -> Any:
    if name not in ACTIVATIONS:
        raise ValueError(f"{field} must be one of {sorted(ACTIVATIONS)}; got {name!r}")
    return ACTIVATIONS[name]


class _Embeddings(nn.Module):
    """The patches' embeddings, after a learned class token's (CLIP's; SigLIP has none)."""

    def __init__(self, config: dict[str, Any], dtype: torch.dtype, siglip: bool = False) -> None:
        super().__init__()
        hidden, patch = config["hidden_size"], config["patch_size"]
        self.patch_size = patch
        self.patch_embedding = nn.Conv2d(config.get("num_channels", 3), hidden, patch, stride=patch, bias=siglip,
                                         dtype=dtype)
        self.class_embedding = None if siglip else nn.Parameter(torch.empty(hidden, dtype=dtype))
        self.patches = (config["image_size"] // patch) ** 2
        self.position_embedding = nn.Embedding(self.patches + (not siglip), hidden, dtype=dtype)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.patch_embedding.weight
        patches = self.patch_embedding(pixel_values.to(weight.device, weight.dtype)).flatten(2).transpose(1, 2)
        if patches.shape[1] != self.patches:                                          # [B, N, hidden]
            raise ValueError(f"pixel_values of {list(pixel_values.shape[-2:])} pixels make {patches.shape[1]} "
                             f"patches; this tower's positions are for {self.patches}")
        if self.class_embedding is not None:
            patches = torch.cat([self.class_embedding.expand(patches.shape[0], 1, -1), patches], dim=1)
        return patches + self.position_embedding.weight


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, dtype: torch.dtype) -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"vision hidden_size {hidden} is not divisible by num_attention_heads {heads}")
        self.heads, self.head_dim = heads, hidden // heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(hidden, hidden, dtype=dtype)
                                                                for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (p(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim ** -0.5)      # every patch sees every one
        return self.out_proj(out.transpose(1, 2).reshape(b, n, -1))


class MLP(nn.Module):
    """A vision transformer's MLP: fc1, the activation the config names, fc2."""

    def __init__(self, hidden: int, inner: int, act: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, inner, dtype=dtype)
        self.fc2 = nn.Linear(inner, hidden, dtype=dtype)
        self.act = activation(act, "vision_config.hidden_act")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class _Layer(nn.Module):
    def __init__(self, config: dict[str, Any], dtype: torch.dtype) -> None:
        super().__init__()
        hidden, eps = config["hidden_size"], config.get("layer_norm_eps", 1e-5)
        self.layer_norm1 = nn.LayerNorm(hidden, eps=eps, dtype=dtype)
        self.self_attn = _Attention(hidden, config["num_attention_heads"], dtype)
        self.layer_norm2 = nn.LayerNorm(hidden, eps=eps, dtype=dtype)
        self.mlp = MLP(hidden, config["intermediate_size"], config.get("hidden_act", "quick_gelu"), dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class _Encoder(nn.Module):
    def __init__(self, config: dict[str, Any], dtype: torch.dtype, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer(config, dtype) for _ in range(num_layers))


class CLIPVisionTower(nn.Module):
    """CLIP's vision transformer: `hidden_states(pixel_values)` returns transformers'
    `output_hidden_states` (index 0 the embeddings after the pre-norm, index i the output of layer
    i), up to layer `num_layers`."""

    def __init__(self, config: dict[str, Any], dtype: torch.dtype, num_layers: int) -> None:
        super().__init__()
        if config.get("model_type", "clip_vision_model") != "clip_vision_model":
            raise ValueError(f"vision_config.model_type must be 'clip_vision_model'; got {config.get('model_type')!r}")
        self.embeddings = _Embeddings(config, dtype)
        self.pre_layrnorm = nn.LayerNorm(config["hidden_size"], eps=config.get("layer_norm_eps", 1e-5), dtype=dtype)
        self.encoder = _Encoder(config, dtype, num_layers)

    def hidden_states(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        x = self.pre_layrnorm(self.embeddings(pixel_values))
        states = [x]
        for layer in self.encoder.layers:
            x = layer(x)
            states.append(x)
        return states

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], partial: bool = False) -> None:
        """Tensors named below `vision_model.`; those of layers past the ones built and of the pooled
        head are skipped."""
        load_by_name(self, weights, "vision_tower", partial)


class SiglipVisionTower(nn.Module):
    """SigLIP's vision transformer (without its pooling head): `forward(pixel_values)` is
    transformers' `last_hidden_state` [images, patches, hidden]."""

    def __init__(self, config: dict[str, Any], dtype: torch.dtype) -> None:
        super().__init__()
        kind = config.get("model_type", "siglip_vision_model")
        if kind != "siglip_vision_model":
            raise ValueError(f"vision_config.model_type must be 'siglip_vision_model'; got {kind!r}")
        config = {"hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6, **config}
        self.embeddings = _Embeddings(config, dtype, siglip=True)
        self.encoder = _Encoder(config, dtype, config["num_hidden_layers"])
        self.post_layernorm = nn.LayerNorm(config["hidden_size"], eps=config["layer_norm_eps"], dtype=dtype)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixel_values)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


def load_by_name(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], what: str, partial: bool,
                 skip_unknown: bool = True) -> None:
    """Copy checkpoint tensors into `module`'s parameters of the same names (below `what`);
    ValueError for a misshapen one, an unknown one (unless `skip_unknown`), or a parameter left
    unloaded (unless `partial`: a weight update)."""
    params = dict(module.named_parameters())
    loaded = set()
    for name, tensor in weights:
        param = params.get(name)
        if param is None:
            if skip_unknown:
                continue
            raise ValueError(f"{what}.{name}: not a tensor of this model's {what}")
        if param.shape != tensor.shape:
            raise ValueError(f"{what}.{name} has shape {list(tensor.shape)}, expected {list(param.shape)}")
        with torch.no_grad():
            param.copy_(tensor.to(param.dtype))
        loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing and not partial:
        raise ValueError(f"checkpoint lacks {what} tensors: {missing[:5]}")
