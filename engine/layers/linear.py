"""Linear layers whose parameters load themselves from HF checkpoint tensors.

The fused layers (`QKVLinear`, `MergedLinear`) take separate HF tensors (q/k/v, gate/up) into one
weight through `weight_loader(param, tensor, shard_id)`, so model files keep HF names and do one
matmul instead of three. The tensor-parallel variants (issue: TP/PP) shard in the same loaders.

On CPU, reduced-precision (bf16/fp16) matmuls go through `linear()`, which picks the faster of two
exact-enough paths by the number of rows (see its docstring and benchmarks/cpu_linear.py).
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

# At or above this many rows, a bf16/fp16 matmul on CPU runs as fp32 GEMM on upcast operands.
# oneDNN's bf16 brgemm (AVX512-BF16, no AMX) reaches ~150 GFLOP/s on the 2-core CI machine against
# ~270 for MKL's sgemm, so prefill chunks are 1.3-1.8x faster in fp32 even counting the upcast of
# the weight; below ~64 rows the weight upcast costs more than the faster GEMM saves.
CPU_FP32_MIN_ROWS = 96


def cpu_prepack_enabled() -> bool:
    """Whether CPU linears keep a oneDNN-prepacked copy of bf16/fp16 weights (`PDSERVE_CPU_PREPACK`,
    default on): 1.2-1.7x faster few-row (decode) matmuls for twice the linear weights' memory."""
    value = os.environ.get("PDSERVE_CPU_PREPACK", "1")
    if value not in ("0", "1"):
        raise ValueError(f"PDSERVE_CPU_PREPACK must be 0 or 1; got {value!r}")
    return value == "1"


def prepack(weight: torch.Tensor) -> torch.Tensor | None:
    """A oneDNN-blocked copy of a CPU bf16/fp16 weight for `linear()`, or None where it does not apply."""
    if (weight.device.type != "cpu" or weight.dtype not in (torch.bfloat16, torch.float16)
            or not torch.backends.mkldnn.is_available() or not cpu_prepack_enabled()):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, with two CPU paths for bf16/fp16 chosen by row count.

    Many rows (prefill): fp32 GEMM on upcast operands, rounded back to x's dtype. Products of bf16
    values are exact in fp32 and oneDNN's bf16 GEMM accumulates in fp32 too, so the two differ only
    in summation order. Few rows (decode): the prepacked weight, the same oneDNN kernel as F.linear
    without reordering the weight on every call (bit-identical to F.linear).
    """
    if x.device.type != "cpu" or x.dtype == torch.float32:
        return F.linear(x, weight, bias)
    if x.numel() >= CPU_FP32_MIN_ROWS * x.shape[-1]:
        b = None if bias is None else bias.float()
        return F.linear(x.float(), weight.float(), b).to(x.dtype)
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


class Linear(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        self.packed: torch.Tensor | None = None

    def process_weights_after_loading(self) -> None:
        self.packed = prepack(self.weight)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        _copy_checked(param.data, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed)


class MergedLinear(Linear):
    """Several outputs stacked along dim 0 (gate and up); shard_id is the index of the output."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__(input_size, sum(output_sizes), bias, dtype)
        self.offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes))]
        self.output_sizes = output_sizes

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        i = int(shard_id)  # type: ignore[arg-type]
        _copy_checked(param.data.narrow(0, self.offsets[i], self.output_sizes[i]), loaded)


class QKVLinear(MergedLinear):
    """Query, key and value projections fused; shard_id is "q", "k" or "v"."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, dtype: torch.dtype = torch.float32) -> None:
        sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        super().__init__(hidden_size, sizes, bias, dtype)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        super().weight_loader(param, loaded, "qkv".index(str(shard_id)))


def _copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"checkpoint tensor has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src)
