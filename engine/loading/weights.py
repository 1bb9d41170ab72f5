"""Streaming a model's weights: HF safetensors directories (single or sharded) and GGUF files
(dequantized as transformers' GGUF loader does, or with their Q8_0/Q4_0/Q4_1 tensors kept in their
blocks as `GGUFWeight`s). Finding the model is records/model_source.py.
"""
from __future__ import annotations

import glob
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from kernels.gguf_format import GGUF_BLOCK, GGUF_BLOCK_BYTES, dequantize_gguf
from records.frozen_config import transformers_config
from records.gguf_file import computed_once, gguf_architecture, gguf_reader
from records.quantization import GGUF_NATIVE_ARCHITECTURES


@dataclass(frozen=True)
class GGUFWeight:
    """A 2-D weight [rows, cols] kept in its GGUF blocks: `blocks` is uint8 [rows, cols / 32 * block
    bytes] of type `qtype` (kernels/reference.py: the layouts). Rows are output features; a shard
    of the input features (tensor parallelism) must fall on block boundaries."""
    blocks: torch.Tensor
    qtype: str
    cols: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.blocks.shape[0], self.cols

    def narrow(self, dim: int, start: int, size: int) -> GGUFWeight:
        if dim == 0:
            return GGUFWeight(self.blocks.narrow(0, start, size), self.qtype, self.cols)
        if start % GGUF_BLOCK or size % GGUF_BLOCK:
            raise ValueError(f"a {self.qtype} weight splits its {self.cols} input features only at its "
                             f"{GGUF_BLOCK}-feature blocks: tensor_parallel_size must divide {self.cols // GGUF_BLOCK}")
        per = GGUF_BLOCK_BYTES[self.qtype]
        return GGUFWeight(self.blocks.narrow(1, start // GGUF_BLOCK * per, size // GGUF_BLOCK * per),
                          self.qtype, size)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_gguf(self.blocks, self.qtype, dtype)

    def rows(self) -> torch.Tensor:
        """The blocks, the form a quantized layer holds."""
        return self.blocks


def iterate_weights(path: str, gguf_file: str | None, hf_config: Any, keep_quantized: bool = False
                    ) -> Iterator[tuple[str, torch.Tensor | GGUFWeight]]:
    """Yield (HF parameter name, tensor) for every tensor of the checkpoint; with `keep_quantized`,
    a GGUF file's Q8_0/Q4_0/Q4_1 matrices come as GGUFWeights (their blocks), the rest dequantized."""
    if gguf_file is not None:
        # (the skeleton below is transformers' own model class: it takes a transformers config)
        hf_config = transformers_config(hf_config, path, gguf_file)
        file = os.path.join(path, gguf_file)
        if keep_quantized:
            yield from _gguf_native_weights(file, hf_config)
        elif gguf_architecture(gguf_reader(file)) in GGUF_NATIVE_ARCHITECTURES:
            yield from _gguf_native_weights(file, hf_config, keep_blocks=False)
        else:
            yield from _gguf_weights(file, hf_config)
        return
    from safetensors import safe_open  # noqa: PLC0415

    for file in safetensors_files(path, "model directory"):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def safetensors_files(path: str, what: str) -> list[str]:
    """A checkpoint directory's safetensors files, in order; ValueError (`what` names the path)
    when it has none."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"{what} {path!r} has no *.safetensors files")
    return files


def checkpoint_shapes(path: str, what: str) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape in a safetensors checkpoint directory, read from the files' headers."""
    from safetensors import safe_open  # noqa: PLC0415

    shapes = {}
    for file in safetensors_files(path, what):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def _gguf_weights(file: str, hf_config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor dequantized by transformers' GGUF loader (the architectures pdserve does not read
    itself: `_gguf_native_weights` yields the same tensors for its own)."""
    import gguf  # noqa: PLC0415
    from transformers import AutoModelForCausalLM  # noqa: PLC0415
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint  # noqa: PLC0415

    # transformers maps GGUF tensor names to HF names through a model skeleton; build it on the
    # meta device so nothing is allocated.
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(hf_config)
    # Its walk over the model's modules asks gguf-py for the tensor-name table at every module
    # (~400 times for the embedded model, 12 of the load's 20 s of CPU); the table depends only on
    # the architecture and the layer count, and transformers only reads it.
    with computed_once(gguf, "get_tensor_name_map"):
        parsed = load_gguf_checkpoint(file, return_tensors=True, model_to_load=skeleton)
    yield from parsed["tensors"].items()


def _gguf_native_weights(file: str, hf_config: Any, keep_blocks: bool = True
                         ) -> Iterator[tuple[str, torch.Tensor | GGUFWeight]]:
    """A GGUF file of GGUF_NATIVE_ARCHITECTURES read by pdserve: its Q8_0/Q4_0/Q4_1 matrices as
    GGUFWeights (`keep_blocks`), every other tensor (every tensor without `keep_blocks`) dequantized
    by gguf-py and processed as transformers' loader does (the llama row order of attn_q/attn_k):
    the same tensors as its `load_gguf_checkpoint`, which also parses the tokenizer's arrays and
    walks the model's modules for names (~8 s of CPU per load of the embedded model, `gguf_names`)."""
    import numpy as np  # noqa: PLC0415
    from gguf import dequantize  # noqa: PLC0415
    from transformers import AutoModelForCausalLM  # noqa: PLC0415
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor  # noqa: PLC0415

    reader = gguf_reader(file)
    arch = gguf_architecture(reader)
    if arch not in GGUF_NATIVE_ARCHITECTURES:
        raise ValueError(f"quantization='gguf' keeps the blocks of {GGUF_NATIVE_ARCHITECTURES} GGUF files; "
                         f"this one is {arch!r} (quantization='none' dequantizes it)")
    heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(
        config={"num_attention_heads": heads, "num_key_value_heads": kv_heads})
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(hf_config)
    names = gguf_names(skeleton, processor)
    for tensor in reader.tensors:
        if tensor.name not in names:
            continue
        qtype = tensor.tensor_type.name
        if keep_blocks and qtype in GGUF_BLOCK_BYTES and len(tensor.shape) == 2:
            blocks = torch.from_numpy(np.array(tensor.data))          # [rows, row bytes], a copy
            if arch == "llama" and (".attn_q." in tensor.name or ".attn_k." in tensor.name):
                # llama.cpp's converter interleaves the rotary halves of each head's rows; undo it
                # (transformers' LlamaTensorProcessor does the same to the dequantized rows).
                n = heads if ".attn_q." in tensor.name else kv_heads
                rows, width = blocks.shape
                blocks = blocks.reshape(n, rows // n // 2, 2, width).transpose(1, 2).reshape(rows, width)
            yield names[tensor.name], GGUFWeight(blocks.contiguous(), qtype, int(tensor.shape[0]))
        else:
            weights = processor.process(weights=dequantize(tensor.data, tensor.tensor_type), name=tensor.name,
                                        tensor_key_mapping=names, parsed_parameters={"tensors": {}}).weights
            yield names[tensor.name], torch.from_numpy(np.copy(weights))


def gguf_names(skeleton: Any, processor: Any) -> dict[str, str]:
    """GGUF tensor name -> HF parameter name for a model skeleton: transformers'
    get_gguf_hf_weights_map, without its second walk over every submodule, which builds gguf-py's
    name table once per module (~400 times, ~5 s, for the embedded model). The full names of the
    top-level state dict map every tensor of the architectures pdserve reads; an architecture
    gguf-py does not name goes to transformers' walk (tests/engine/test_quant.py compares the two)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map  # noqa: PLC0415
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map  # noqa: PLC0415

    config = skeleton.config
    arch = next((k for k, v in MODEL_ARCH_NAMES.items() if v == config.model_type), None)
    if arch is None:
        return get_gguf_hf_weights_map(skeleton, processor)
    table = get_tensor_name_map(arch, config.num_hidden_layers)
    names = {}
    for hf_name in skeleton.state_dict():
        name, dot, suffix = processor.preprocess_name(hf_name).rpartition(".")
        if suffix not in ("weight", "bias"):
            name, dot, suffix = processor.preprocess_name(hf_name), "", ""
        gguf_name = table.get_name(name)
        if gguf_name is not None:
            names[gguf_name + dot + suffix] = hf_name
    return names
