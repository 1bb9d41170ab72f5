"""The Triton kernel set, with the same names and contracts as kernels.reference (which
kernels.dispatch returns on CUDA). Block gathers and CPU <-> GPU swaps are plain copies and stay
with the reference's torch implementation, as do silu-and-mul (one elementwise op after the GEMM),
the row argmax and the sampler's softmax and top-k (torch's). fp8 linears are torch._scaled_mm
(cuBLASLt's fp8 GEMM) after a Triton kernel quantizes x's rows. Q8_0 linears (GGUF files, int8
checkpoints) have Triton kernels for decode-sized batches, batched LoRA (`lora_add`) one of its own,
and mixtures of experts grouped GEMMs (`fused_moe`)."""
from __future__ import annotations

from kernels.reference import argmax_rows, gather_blocks, gather_kv, silu_and_mul, softmax_topk, swap_blocks
from kernels.triton_attention import decode_attention, pack_prefill, prefill_attention
from kernels.triton_cache import copy_blocks, write_kv
from kernels.triton_layers import apply_rotary, rms_norm
from kernels.triton_lora import lora_add
from kernels.triton_moe import fused_moe
from kernels.triton_quant import fp8_linear, gguf_linear, pack_gguf, unpack_gguf

# Decode steps of this set can be captured in CUDA graphs: its K/V write skips slot -1, which the
# graphs' padded rows use, and decode's launch does not depend on the sequence lengths.
CUDA_GRAPHS = True

__all__ = ["CUDA_GRAPHS", "apply_rotary", "argmax_rows", "copy_blocks", "decode_attention", "fp8_linear",
           "fused_moe", "gather_blocks", "gather_kv", "gguf_linear", "lora_add", "pack_gguf", "pack_prefill",
           "prefill_attention", "rms_norm", "silu_and_mul", "softmax_topk", "swap_blocks", "unpack_gguf",
           "write_kv"]
