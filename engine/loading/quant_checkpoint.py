"""Quantized safetensors checkpoints: their linear weights, as the tensors of one layer arrive in the
checkpoint's stream, become what pdserve's layers hold (records/quantization.py: checkpoint_quant says which
layout a checkpoint has; engine/loading/weights.py streams the tensors).

- int8, weight-only (W8A16), symmetric, with a scale per output channel or per group of input
  features (a multiple of 32), in the compressed-tensors layout (`weight_packed` int32 words of four
  biased bytes, or `weight` int8, with `weight_scale`) or GPTQ's (`qweight` packed along the input
  features, `qzeros` all at the symmetric zero, `scales`): each row's values with their scales
  become GGUF Q8_0 blocks (32 int8 and an fp16 scale; kernels/reference.py), so every Q8_0 path
  (the CPU block kernel, tensor-parallel shards on block boundaries, dense copies) serves them.
  bf16 and fp16 scales are exact in fp16; an fp32 scale is rounded to fp16 (relative change at most
  2^-11, far below the int8 step) and a warning says by how much.
- fp8 (e4m3) weights with a scale per tensor or per output channel, from compressed-tensors or
  vLLM's fp8 checkpoints, or a dense checkpoint's linear weights quantized at load (per output
  channel): `FP8Weight`, multiplied by `torch._scaled_mm` (kernels/reference.py: fp8_linear).

With quantization="none" the same tensors are dequantized (w = q * scale in fp32) instead.
Activation scales (`input_scale`: static W8A8 checkpoints) are not used: activations stay in the
model's dtype (int8) or are quantized per token at run time (fp8).
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.loading.weights import GGUFWeight, iterate_weights
from kernels.gguf_format import GGUF_BLOCK, quantize_gguf
from kernels.reference import FP8_DTYPE, FP8_MAX
from records.quantization import CheckpointQuant, checkpoint_quant

if TYPE_CHECKING:
    from records.config import ModelConfig

logger = logging.getLogger(__name__)

# The linear weights a dense checkpoint's quantization="fp8" quantizes (vLLM keeps the embedding and
# the LM head in the model's dtype too).
FP8_ONLINE_SUFFIXES = tuple(f".{p}_proj.weight" for p in ("q", "k", "v", "o", "gate", "up", "down"))


@dataclass(frozen=True)
class FP8Weight:
    """An e4m3 weight [rows, cols] and its fp32 scale per row (output feature): w = weight * scale.
    `rows()` packs both into uint8 rows [rows, cols + 4] (the scale's bytes last), the form a layer
    holds, so that a tensor-parallel shard of rows carries its scales."""
    weight: torch.Tensor
    scale: torch.Tensor

    qtype = "fp8"

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    def narrow(self, dim: int, start: int, size: int) -> FP8Weight:
        if dim == 0:
            return FP8Weight(self.weight.narrow(0, start, size), self.scale.narrow(0, start, size))
        return FP8Weight(self.weight.narrow(1, start, size), self.scale)

    def rows(self) -> torch.Tensor:
        return torch.cat([self.weight.contiguous().view(torch.uint8),
                          self.scale.float().reshape(-1, 1).contiguous().view(torch.uint8)], dim=1)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.weight.float() * self.scale.float().reshape(-1, 1)).to(dtype)


def split_fp8_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8Weight.rows()'s inverse: (e4m3 weight [rows, cols], fp32 scale [rows]), both contiguous."""
    return rows[:, :-4].contiguous().view(FP8_DTYPE), rows[:, -4:].contiguous().view(torch.float32).reshape(-1)


def quantize_fp8(weight: torch.Tensor) -> FP8Weight:
    """A dense weight as e4m3 with a scale per row (the row's amax / 448; a zero row gets scale 1)."""
    w = weight.float()
    scale = w.abs().amax(dim=1) / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (w / scale.reshape(-1, 1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return FP8Weight(q, scale)


def quantize_to(weight: torch.Tensor, qtype: str) -> GGUFWeight | FP8Weight:
    """A dense checkpoint tensor [rows, cols] in the form a layer kept in `qtype` loads: what a weight
    update into such a layer writes (fp8 as a dense checkpoint's are quantized at load; GGUF types,
    and an int8 checkpoint's Q8_0 blocks, as llama.cpp's quantizers make them)."""
    if qtype == "fp8":
        return quantize_fp8(weight)
    return GGUFWeight(quantize_gguf(weight, qtype), qtype, weight.shape[1])


def int8_blocks(q: torch.Tensor, scale: torch.Tensor, name: str) -> GGUFWeight:
    """int8 values [rows, cols] with scales [rows, groups] (one group: per channel) as Q8_0 blocks."""
    rows, cols = q.shape
    groups = scale.shape[1]
    if cols % GGUF_BLOCK or cols % groups or cols // groups % GGUF_BLOCK:
        raise ValueError(f"{name}: int8 weights are kept as blocks of {GGUF_BLOCK} input features with one "
                         f"scale each; {cols} features in {groups} scale groups do not fit (the group size "
                         f"must be a multiple of {GGUF_BLOCK}; quantization='none' dequantizes them)")
    per_block = scale.repeat_interleave(cols // groups // GGUF_BLOCK, dim=1)       # [rows, cols / 32]
    half = per_block.to(torch.float16)
    if not torch.isfinite(half).all() or (half == 0).any() != (per_block == 0).any():
        raise ValueError(f"{name}: weight scales must be finite and within fp16's range; got "
                         f"[{per_block.min().item():.3g}, {per_block.max().item():.3g}]")
    if per_block.dtype not in (torch.float16, torch.bfloat16):
        change = ((half.float() - per_block.float()).abs() / per_block.float().abs().clamp_min(1e-30)).max().item()
        if change > 0:
            logger.warning("%s: fp32 weight scales rounded to fp16 (Q8_0 blocks): relative change up to %.2g",
                           name, change)
    blocks = torch.empty(rows, cols // GGUF_BLOCK, 2 + GGUF_BLOCK, dtype=torch.uint8)
    blocks[..., :2] = half.view(torch.uint8).reshape(rows, -1, 2)
    blocks[..., 2:] = q.contiguous().view(torch.uint8).reshape(rows, -1, GGUF_BLOCK)
    return GGUFWeight(blocks.reshape(rows, -1), "Q8_0", cols)


def _scales_2d(scale: torch.Tensor, rows: int) -> torch.Tensor:
    """A weight scale as [rows, groups]: per tensor ([] or [1]) and per channel ([rows] or [rows, 1])."""
    if scale.numel() == 1:
        return scale.reshape(1, 1).expand(rows, 1)
    return scale.reshape(rows, -1)


def _unpack_compressed_tensors(parts: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """A compressed-tensors int8 weight [rows, cols]: `weight` as it is, or `weight_packed`, whose
    int32 words hold four values each, value + 128 in byte i (little-endian) for column 4 j + i."""
    if "weight" in parts:
        return parts["weight"]
    rows, cols = (int(v) for v in parts["weight_shape"].tolist())
    packed = parts["weight_packed"]
    if packed.dtype != torch.int32 or packed.shape[0] != rows or packed.shape[1] * 4 < cols:
        raise ValueError(f"{name}.weight_packed: expected int32 [{rows}, {(cols + 3) // 4}] for weight_shape "
                         f"[{rows}, {cols}]; got {packed.dtype} {list(packed.shape)}")
    biased = packed.contiguous().view(torch.uint8)[:, :cols]
    return (biased ^ 0x80).view(torch.int8)                    # byte - 128, as two's complement


def _unpack_gptq(parts: dict[str, torch.Tensor], name: str, v2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A GPTQ 8-bit weight: (int8 [rows, cols], scales [rows, groups]). `qweight` [cols / 4, rows]
    holds column 4 i + b of output r in byte b of word [i, r]; `qzeros` [groups, rows / 4] likewise
    along the rows, stored minus one (format v1); symmetric checkpoints have every zero at 128."""
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    packed_cols, rows = qweight.shape
    u8 = qweight.contiguous().view(torch.uint8).reshape(packed_cols, rows, 4).permute(1, 0, 2).reshape(rows, -1)
    zeros = qzeros.contiguous().view(torch.uint8).reshape(qzeros.shape[0], -1)[:, :rows].int() + (0 if v2 else 1)
    if not (zeros == 128).all():
        raise ValueError(f"{name}.qzeros: symmetric 8-bit GPTQ has every zero point at 128; this checkpoint "
                         f"has zero points in [{zeros.min().item()}, {zeros.max().item()}] (not supported)")
    return (u8 ^ 0x80).view(torch.int8), scales.t()


# The tensors that make up one quantized weight, per layout, and which of them mark it as quantized.
_PARTS = {"compressed-tensors": ("weight", "weight_packed", "weight_scale", "weight_shape"),
          "fp8": ("weight", "weight_scale"),
          "gptq": ("qweight", "qzeros", "scales")}
_DROPPED = ("input_scale", "weight_zero_point", "input_zero_point", "g_idx", "weight_g_idx")


def _complete(parts: dict[str, torch.Tensor], layout: str) -> bool:
    if layout == "gptq":
        return len(parts) == 3
    if "weight_packed" in parts:
        return "weight_scale" in parts and "weight_shape" in parts
    return "weight" in parts and "weight_scale" in parts


def convert(stream: Iterable[tuple[str, torch.Tensor]], quant: CheckpointQuant, keep: bool
            ) -> Iterator[tuple[str, torch.Tensor | GGUFWeight | FP8Weight]]:
    """The checkpoint's (name, tensor) stream with each quantized weight's tensors combined into one
    `<prefix>.weight`: a GGUFWeight (int8) or FP8Weight with `keep`, else dequantized to fp32.
    Dense tensors (norms, embeddings, an unquantized LM head) pass as they are."""
    layout = quant.layout
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in stream:
        prefix, _, part = name.rpartition(".")
        quantized_part = part in _PARTS[layout] and (part != "weight" or tensor.dtype in (torch.int8, FP8_DTYPE))
        if part in _DROPPED:
            continue
        if not quantized_part:
            yield name, tensor
            continue
        parts = pending.setdefault(prefix, {})
        parts[part] = tensor
        if _complete(parts, layout):
            yield f"{prefix}.weight", _weight(pending.pop(prefix), prefix, quant, keep)
    if pending:
        prefix, parts = next(iter(pending.items()))
        want = [p for p in _PARTS[layout] if p not in parts and p != "weight_packed"]
        raise ValueError(f"checkpoint has {sorted(parts)} for {prefix} but not {want}: a {quant.layout} "
                         f"{quant.weights} weight needs them all")


def _weight(parts: dict[str, torch.Tensor], prefix: str, quant: CheckpointQuant, keep: bool
            ) -> torch.Tensor | GGUFWeight | FP8Weight:
    if quant.weights == "fp8":
        weight = parts["weight"]
        if weight.dtype != FP8_DTYPE:
            raise ValueError(f"{prefix}.weight: an fp8 checkpoint's weights must be float8_e4m3fn; got {weight.dtype}")
        scale = _scales_2d(parts["weight_scale"].float(), weight.shape[0])
        if scale.shape[1] != 1:
            raise ValueError(f"{prefix}.weight_scale: fp8 weights need one scale per tensor or per output "
                             f"channel; got shape {list(parts['weight_scale'].shape)}")
        w = FP8Weight(weight, scale.reshape(-1).contiguous())
        return w if keep else w.dequantize()
    if quant.layout == "gptq":
        q, scale = _unpack_gptq(parts, prefix, quant.gptq_v2)
    else:
        q = _unpack_compressed_tensors(parts, prefix)
        if q.dtype != torch.int8:
            raise ValueError(f"{prefix}.weight: an int8 checkpoint's weights must be int8; got {q.dtype}")
        scale = _scales_2d(parts["weight_scale"], q.shape[0])
    if scale.shape[0] != q.shape[0] or q.shape[1] % scale.shape[1]:
        raise ValueError(f"{prefix}: {list(scale.shape)} scales do not fit a [{q.shape[0]}, {q.shape[1]}] weight")
    if keep:
        return int8_blocks(q, scale, prefix)
    return q.float() * scale.float().repeat_interleave(q.shape[1] // scale.shape[1], dim=1)


def quantize_fp8_online(stream: Iterable[tuple[str, torch.Tensor]]
                        ) -> Iterator[tuple[str, torch.Tensor | FP8Weight]]:
    """A dense checkpoint's stream with its attention and MLP projections as FP8Weights."""
    for name, tensor in stream:
        yield name, quantize_fp8(tensor) if name.endswith(FP8_ONLINE_SUFFIXES) and tensor.dim() == 2 else tensor


def model_weights(mc: ModelConfig) -> Iterator[tuple[str, torch.Tensor | GGUFWeight | FP8Weight]]:
    """The tensors a worker loads for ModelConfig `mc`, in the form its `quantization` keeps them:
    GGUF blocks, an int8 or fp8 checkpoint's weights (`convert`), fp8 weights
    quantized at load, or every weight dense ("none")."""
    keep = mc.quantization != "none"
    if mc.gguf_file is not None:
        return iterate_weights(mc.model, mc.gguf_file, mc.hf_config, keep)
    stream = iterate_weights(mc.model, None, mc.hf_config)
    quant = checkpoint_quant(mc.hf_config)
    if quant is not None:
        return convert(stream, quant, keep)
    return quantize_fp8_online(stream) if mc.quantization == "fp8" else stream
