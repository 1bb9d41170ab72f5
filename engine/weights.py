"""Streaming a model's weights: HF safetensors directories (single or sharded) and GGUF files
(dequantized through transformers' GGUF support). Finding the model is engine/model_source.py.
"""
from __future__ import annotations

import glob
import os
from collections.abc import Iterator
from typing import Any

import torch


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
            for name in f.keys():
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
