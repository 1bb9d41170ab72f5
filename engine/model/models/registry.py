"""Architecture name (HF `architectures[0]`) -> model class."""
from __future__ import annotations

from torch import nn

from engine.model.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from engine.model.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from engine.model.models.moe import MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from engine.model.models.phi3 import Phi3ForCausalLM
from records.model_source import SUPPORTED_ARCHITECTURES

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}
assert tuple(MODEL_REGISTRY) == SUPPORTED_ARCHITECTURES, "records/model_source.py names what is registered here"


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in MODEL_REGISTRY:
        raise ValueError(f"model architecture {architecture!r} is not supported; supported "
                         f"architectures: {', '.join(MODEL_REGISTRY)}")
    return MODEL_REGISTRY[architecture]
