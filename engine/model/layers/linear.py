"""Linear layers whose parameters load themselves from HF checkpoint tensors.

`Linear` is replicated. The tensor-parallel layers shard themselves in their weight loaders, from
the full HF tensor, by this process's TP rank (engine/model/parallel_state.py), so model files keep HF
names: `ColumnParallelLinear` splits output features (its output stays sharded),
`MergedColumnParallelLinear` (gate/up) and `QKVParallelLinear` (GQA-aware: KV heads are replicated
when tp > num_kv_heads) fuse several HF tensors into one matmul, `RowParallelLinear` splits input
features and all-reduces its output. With one rank they are plain (fused) linears.

On CPU, dense matmuls go through `linear()` (engine/model/layers/cpu_gemm.py), which picks the faster
of exact-enough paths by the number of rows and by what this CPU does faster.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from types import ModuleType

import torch
from torch import nn

from engine.loading.quant_checkpoint import FP8Weight, split_fp8_rows
from engine.loading.weights import GGUFWeight
from engine.model.layers.cpu_gemm import (
    Packed,
    cpu_fp32_gemm,
    fp32_packed_min_rows,
    linear,
    linear_silu,
    prepack,
    silu_fusable,
)
from engine.model.layers.lora import LoRAStack
from engine.model.parallel_state import get_parallel_state, tp_all_reduce
from kernels.cpu_ops import gguf_dense_min_rows
from kernels.dispatch import FP8_MIN_CAPABILITY, cuda_capability, has_fp8, kernels_for
from kernels.gguf_format import GGUF_BLOCK, GGUF_BLOCK_BYTES, dequantize_gguf

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)
def _warn_fp8_dequantized(device: torch.device) -> None:
    logger.warning("fp8 weights on %s (compute capability %s) are dequantized to the model's dtype at load: "
                   "fp8 GEMMs need compute capability %s or more", device, cuda_capability(device),
                   FP8_MIN_CAPABILITY)


class Linear(nn.Module):
    """y = x W^T + b. The weight is dense in the model's dtype, or, after `quantize_as`, kept in a
    GGUF file's blocks (uint8 [output_size, input_size / 32 * block bytes]; `qtype` names the type),
    multiplied by the kernel set's `gguf_linear`, or in fp8 (`qtype` "fp8": e4m3 [output_size,
    input_size] and `weight_scale`, fp32 per output feature), multiplied by its `fp8_linear`."""

    kernels: ModuleType | None = None     # bound once by ModelRunner (bind_kernels); else looked up per call
    # GGUF blocks times x quantized to int8 per block (the kernel set's `gguf_linear_int8`; set by the
    # worker with quantize_activations)
    int8_activations: bool = False
    # A [gate | up] weight whose output goes to silu_and_mul (MergedColumnParallelLinear's swiglu):
    # prepacked for the fused pass (cpu_gemm.OwnPanels' gate_up).
    swiglu: bool = False

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
        self.packed: Packed | None = None
        self.qtype: str | None = None
        self.dtype = dtype
        self.dense: torch.Tensor | None = None      # a GGUF layer's dense copy (quantization="gguf+dense")
        # From this many rows on it multiplies that copy; below, its blocks (this CPU's crossing for
        # its dtype: kernels.cpu_ops.gguf_dense_min_rows).
        self.dense_min_rows = gguf_dense_min_rows(dtype)
        self.lora: LoRAStack | None = None          # adapter slots (engine/worker/lora_slots.py), with LoRA enabled
        self.blocks_packed = False                  # GGUF blocks in the kernel set's form (pack_gguf), not the file's

    def quantize_as(self, qtype: str) -> None:
        """Hold the weight in GGUF blocks of `qtype`, or in fp8 (qtype "fp8"), from now on (before its
        tensors are loaded). fp8 loads as FP8Weight.rows() (the scale's bytes after each row's)."""
        # The new weight goes on the dense one's device: the model is built on the worker's device
        # (CUDA), its weights load outside that scope.
        device = self.weight.device
        if qtype == "fp8":
            self.qtype = qtype
            self.weight = nn.Parameter(torch.empty(self.output_size, self.input_size + 4, dtype=torch.uint8,
                                                   device=device), requires_grad=False)
            self.weight.weight_loader = self.weight_loader
            return
        if qtype not in GGUF_BLOCK_BYTES:
            raise ValueError(f"GGUF type must be one of {sorted(GGUF_BLOCK_BYTES)}; got {qtype!r}")
        if self.input_size % GGUF_BLOCK:
            raise ValueError(f"a {qtype} weight needs input features in blocks of {GGUF_BLOCK}; this layer has "
                             f"{self.input_size} (with tensor parallelism: tensor_parallel_size must divide "
                             f"the input features / {GGUF_BLOCK})")
        self.qtype = qtype
        row_bytes = self.input_size // GGUF_BLOCK * GGUF_BLOCK_BYTES[qtype]
        self.weight = nn.Parameter(torch.empty(self.output_size, row_bytes, dtype=torch.uint8, device=device),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def process_weights_after_loading(self, dense_copy: bool = False) -> None:
        """Prepack the weight for oneDNN; a GGUF weight only with `dense_copy` (then a dense copy
        in the model's dtype serves batches of `dense_min_rows` rows or more), its blocks put in
        the form its kernel set reads (`pack_gguf`); an fp8 weight split from its scales, or, on a
        GPU without fp8 GEMMs, dequantized to the model's dtype."""
        self.load_form()                              # (after a weight update: from the loaded form again)
        if self.qtype == "fp8":
            weight, scale = split_fp8_rows(self.weight.data)
            if not has_fp8(weight.device):
                # No fp8 GEMM on this GPU: serve the checkpoint's weights dequantized (weight-only
                # arithmetic, as vLLM's W8A16 fallback there) rather than fail in the first step.
                _warn_fp8_dequantized(weight.device)
                self.qtype = None
                self.weight = nn.Parameter((weight.float() * scale.reshape(-1, 1)).to(self.dtype),
                                           requires_grad=False)
                return
            self.weight = nn.Parameter(weight, requires_grad=False)
            self.weight_scale = scale
            return
        if self.qtype is not None:
            if dense_copy:
                self.dense = dequantize_gguf(self.weight.data, self.qtype, self.dtype)
                self.packed = prepack(self.dense, self.swiglu)
            # The blocks in the form this device's kernel set reads (Triton: Q8_0 rows reordered).
            packed = kernels_for(self.weight).pack_gguf(self.weight.data, self.qtype)
            if packed is not self.weight.data:
                self.weight = nn.Parameter(packed, requires_grad=False)
                self.blocks_packed = True
            return
        self.packed = prepack(self.weight, self.swiglu)
        if self.packed is not None and self.weight.dtype != torch.float32:
            cpu_fp32_gemm(self.weight.dtype)          # time the two GEMMs now, not in the first prefill
        elif isinstance(self.packed, torch.Tensor):   # oneDNN's (the own GEMM takes every row count)
            fp32_packed_min_rows()                    # likewise, not in the first decode step

    def load_form(self) -> None:
        """Put a processed quantized weight back in the form `weight_loader` writes, so that a weight
        update can rewrite some of its rows (a fused layer's other shards keep theirs): an fp8
        weight rejoined with its scales, GGUF blocks out of the kernel set's form. Else a no-op."""
        if self.qtype == "fp8" and self.weight.dtype != torch.uint8:
            self.weight = nn.Parameter(FP8Weight(self.weight.data, self.weight_scale).rows(), requires_grad=False)
        elif self.blocks_packed:
            self.weight = nn.Parameter(kernels_for(self.weight).unpack_gguf(self.weight.data, self.qtype),
                                       requires_grad=False)
            self.blocks_packed = False
        else:
            return
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        _copy_checked(param.data, loaded)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x W^T (+ bias) on this rank's weight, dense or quantized."""
        if self.qtype is None:
            return linear(x, self.weight, bias, self.packed)
        if self.dense is not None and x.numel() >= self.dense_min_rows * self.input_size:
            return linear(x, self.dense, bias, self.packed)
        kernels, rows = self.kernels or kernels_for(x), x.reshape(-1, x.shape[-1])
        if self.qtype == "fp8":
            out = kernels.fp8_linear(rows, self.weight, self.weight_scale)
        elif self.int8_activations:
            out = kernels.gguf_linear_int8(rows, self.weight, self.qtype)
        else:
            out = kernels.gguf_linear(rows, self.weight, self.qtype)
        out = out.reshape(*x.shape[:-1], self.output_size)
        return out if bias is None else out + bias

    def rows_matmul(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """A function of 2-D x computing `matmul(x, self.bias)`, with what matmul decides per call
        decided once where it can be: a GGUF layer's few-row products go straight to its kernel set's
        kernel (`gguf_rows_kernel`, where the set has one). The CPU decode plan (engine/worker/cpu_decode.py)
        calls such functions ~120 times a step, where matmul's own checks cost ~20 us a call."""
        general = functools.partial(self.matmul, bias=self.bias)
        rows_kernel = getattr(self.kernels, "gguf_rows_kernel", None)
        kernel, max_rows = (None, 0) if self.qtype not in GGUF_BLOCK_BYTES or rows_kernel is None else (
            rows_kernel(self.weight.data, self.qtype, self.dtype, self.int8_activations))
        if kernel is None:
            return general
        if self.dense is not None:
            max_rows = min(max_rows, self.dense_min_rows - 1)
        bias = self.bias

        def blocks_matmul(x: torch.Tensor) -> torch.Tensor:
            if x.shape[0] > max_rows:
                return general(x)
            out = kernel(x)
            return out if bias is None else out + bias
        return blocks_matmul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(x, self.bias)
        return out if self.lora is None else self.lora.add(x, out)

    def lora_subs(self) -> list[tuple[int, int]]:
        """(offset, size) of each fused output on this rank, in checkpoint order (one: the whole)."""
        return [(0, self.output_size)]

    def lora_shard(self, sub: int, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of an adapter's A [r, input] and B [output, r] for fused output `sub`."""
        return a, b


class ColumnParallelLinear(Linear):
    """y = x W^T with W's rows (output features) split over the TP ranks; the output stays sharded."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 dtype: torch.dtype = torch.float32) -> None:
        self.tp_rank, self.tp_size, local = _tp_share(output_size, "output size")
        super().__init__(input_size, local, bias, dtype)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        size = param.shape[0]
        _copy_checked(param.data, _shard(loaded, 0, self.tp_rank * size, size, self.tp_size * size))

    def lora_shard(self, sub: int, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        size = self.output_size
        return a, _shard(b, 0, self.tp_rank * size, size, self.tp_size * size)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs stacked along dim 0 (gate and up); shard_id is the output's
    index. Each rank holds its slice of every output, in order. swiglu: the two outputs are a gate and
    its up, taken by `silu_and_mul` (packed for its fused pass)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 dtype: torch.dtype = torch.float32, swiglu: bool = False) -> None:
        super().__init__(input_size, sum(output_sizes), bias, dtype)
        if swiglu and (len(output_sizes) != 2 or output_sizes[0] != output_sizes[1]):
            raise ValueError(f"a swiglu layer's output sizes are a gate's and its up's, equal; got {output_sizes}")
        self.swiglu = swiglu
        if any(n % self.tp_size for n in output_sizes):
            raise ValueError(f"output sizes {output_sizes} are not divisible by tensor_parallel_size {self.tp_size}")
        self.local_sizes = [n // self.tp_size for n in output_sizes]
        self.full_sizes = list(output_sizes)          # what each checkpoint tensor must have
        self.offsets = [sum(self.local_sizes[:i]) for i in range(len(output_sizes))]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        i = int(shard_id)  # type: ignore[arg-type]
        self._load_shard(param, loaded, i, self._shard_index(i))

    def lora_subs(self) -> list[tuple[int, int]]:
        return list(zip(self.offsets, self.local_sizes))

    def lora_shard(self, sub: int, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return a, self._rows(b, sub, self._shard_index(sub))

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a [gate, up] layer's output: the kernel set's silu_and_mul of
        forward(x), in one pass where `cpu_gemm.linear_silu` takes the weight (dense, no LoRA)."""
        fused = linear_silu(x, self.bias, self.packed) if self.lora is None and self.qtype is None else None
        if fused is not None:
            return fused
        gate_up = self(x)
        return (self.kernels or kernels_for(gate_up)).silu_and_mul(gate_up)

    def silu_rows_matmul(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """`silu_and_mul` of 2-D x for the CPU decode plan, as `rows_matmul` is `matmul`: the fused pass
        bound once where it applies to every row count, else the two calls."""
        if self.lora is None and self.qtype is None and silu_fusable(self.packed, self.dtype):
            return functools.partial(self.packed.matmul_silu, bias=self.bias)     # type: ignore[union-attr]
        rows, silu = self.rows_matmul(), (self.kernels or kernels_for(self.weight)).silu_and_mul
        return lambda x: silu(rows(x))

    def _shard_index(self, i: int) -> int:
        """Which slice of output `i` this rank holds."""
        return self.tp_rank

    def _rows(self, loaded: torch.Tensor, i: int, index: int) -> torch.Tensor:
        """Slice `index` of output `i`'s full checkpoint tensor (rows)."""
        size = self.local_sizes[i]
        return _shard(loaded, 0, index * size, size, self.full_sizes[i])

    def _load_shard(self, param: nn.Parameter, loaded: torch.Tensor, i: int, index: int) -> None:
        """Copy slice `index` of output `i`'s checkpoint tensor to its rows in the parameter."""
        _copy_checked(param.data.narrow(0, self.offsets[i], self.local_sizes[i]), self._rows(loaded, i, index))


class QKVParallelLinear(MergedColumnParallelLinear):
    """Query, key and value projections fused; shard_id is "q", "k" or "v". Each rank holds
    num_heads / tp query heads and max(1, num_kv_heads / tp) KV heads; with tp > num_kv_heads every
    KV head is replicated on tp / num_kv_heads ranks (those whose query heads use it)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, dtype: torch.dtype = torch.float32) -> None:
        tp = get_parallel_state().tp_size
        if num_heads % tp or (num_kv_heads % tp and tp % num_kv_heads):
            raise ValueError(f"num_attention_heads ({num_heads}) must be divisible by tensor_parallel_size "
                             f"({tp}), and num_key_value_heads ({num_kv_heads}) must divide or be divisible by it")
        self.head_dim = head_dim
        self.num_heads = num_heads // tp
        self.num_kv_heads = max(1, num_kv_heads // tp)
        rank = get_parallel_state().tp_rank
        self.kv_shard = rank // (tp // num_kv_heads) if tp > num_kv_heads else rank
        # Sizes as if every rank held its own KV heads, so the base class divides them back.
        q, kv = num_heads * head_dim, self.num_kv_heads * head_dim * tp
        super().__init__(hidden_size, [q, kv, kv], bias, dtype)
        self.full_sizes = [q, num_kv_heads * head_dim, num_kv_heads * head_dim]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        i = "qkv".index(str(shard_id))
        self._load_shard(param, loaded, i, self._shard_index(i))

    def _shard_index(self, i: int) -> int:
        return self.tp_rank if i == 0 else self.kv_shard


class RowParallelLinear(Linear):
    """y = x W^T with W's columns (input features) split over the TP ranks: each rank multiplies its
    slice of x (a column-parallel layer's sharded output) and the partial sums are all-reduced; the
    bias is added once, after the reduction."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 dtype: torch.dtype = torch.float32) -> None:
        self.tp_rank, self.tp_size, local = _tp_share(input_size, "input size")
        super().__init__(local, output_size, bias, dtype)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if param.dim() == 1:                  # the bias is not split
            _copy_checked(param.data, loaded)
            return
        size = self.input_size
        _copy_checked(param.data, _shard(loaded, 1, self.tp_rank * size, size, self.tp_size * size))

    def lora_shard(self, sub: int, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        size = self.input_size
        return _shard(a, 1, self.tp_rank * size, size, self.tp_size * size), b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return super().forward(x)
        out = self.matmul(x, None)
        if self.lora is not None:        # this rank's partial B A x, summed with the rest below
            out = self.lora.add(x, out)
        out = tp_all_reduce(out)
        return out if self.bias is None else out + self.bias


def _tp_share(size: int, what: str) -> tuple[int, int, int]:
    """(TP rank, TP size, this rank's share of `size`); ValueError if it does not split evenly."""
    state = get_parallel_state()
    if size % state.tp_size:
        raise ValueError(f"{what} {size} is not divisible by tensor_parallel_size {state.tp_size}")
    return state.tp_rank, state.tp_size, size // state.tp_size


def _shard(loaded: torch.Tensor, dim: int, start: int, size: int, expected_total: int) -> torch.Tensor:
    """Rows (dim 0) or columns (dim 1) [start, start + size) of a full checkpoint tensor, after
    checking it has the full size this layer was built for."""
    if loaded.shape[dim] != expected_total:
        raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)}, expected {expected_total} "
                         f"along dim {dim}")
    return loaded.narrow(dim, start, size)


def _copy_checked(dst: torch.Tensor, src: torch.Tensor | GGUFWeight | FP8Weight) -> None:
    if isinstance(src, (GGUFWeight, FP8Weight)):
        if dst.dtype != torch.uint8:
            raise ValueError(f"a {src.qtype} checkpoint tensor cannot load into a dense parameter: the layer "
                             f"must be quantized first (Linear.quantize_as)")
        src = src.rows()
    if dst.shape != src.shape:
        raise ValueError(f"checkpoint tensor has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src)
