"""Triton W8A16: x [M, K] times a weight kept as Q8_0 blocks (kernels/reference.py: 32 int8 values
and their fp16 scale per 34 bytes), the form of a GGUF Q8_0 file's weights and of an int8
checkpoint's (engine/quant_checkpoint.py). Decode reads each weight byte once per step, so int8
blocks move about half of bf16's bytes.

Each program computes a [BLOCK_M, BLOCK_N] tile of the output: for every block of 32 input
features it loads x's [BLOCK_M, 32] slice and the [32, BLOCK_N] int8 values of BLOCK_N weight rows,
multiplies them with `tl.dot` in x's dtype (int8 values are exact in bf16 and fp16; fp32 x stays in
IEEE fp32, not TF32) and adds the product times the rows' scales to an fp32 accumulator: the
reference's sum in another order. Large batches take dequantize + cuBLAS instead (`gguf_linear`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import reference

# From this many rows on, dequantize the weight and let cuBLAS multiply: the tile loop re-reads the
# blocks for every BLOCK_M rows of x, and a GEMM's tensor-core tiling wins once the weight's bytes
# stop dominating.
DEQUANT_MIN_ROWS = 64


@triton.jit
def _q8_0_linear_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_om, row_bytes,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, 32)
    m_mask, n_mask = rm < M, rn < N
    rows = w_ptr + rn.to(tl.int64) * row_bytes                           # [BLOCK_N] row starts
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for b in range(0, K // 32):
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + b * 32 + rk[None, :],
                    mask=m_mask[:, None], other=0.0)
        blk = rows + b * 34
        q = tl.load(blk[None, :] + 2 + rk[:, None], mask=n_mask[None, :], other=0)      # [32, BLOCK_N]
        q = q.to(tl.int8, bitcast=True).to(x.dtype)
        lo = tl.load(blk, mask=n_mask, other=0).to(tl.uint16)
        hi = tl.load(blk + 1, mask=n_mask, other=0).to(tl.uint16)
        d = (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)
        if IEEE:
            dot = tl.dot(x, q, input_precision="ieee")
        else:
            dot = tl.dot(x, q)
        acc += dot * d[None, :]
    out = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def q8_0_linear(x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """kernels.reference.gguf_linear(x, blocks, "Q8_0") on the Triton kernel (any row count)."""
    M, K = x.shape
    N = blocks.shape[0]
    if K % 32 or blocks.shape[1] != K // 32 * reference.GGUF_BLOCK_BYTES["Q8_0"]:
        raise ValueError(f"Q8_0 blocks of {blocks.shape[1]} bytes per row do not hold {K} input features")
    x = x.contiguous()
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M and N:
        block_m = 16 if M <= 16 else 32
        block_n = 64
        grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
        _q8_0_linear_kernel[grid](x, blocks, out, M, N, K, x.stride(0), out.stride(0), blocks.stride(0),
                                  BLOCK_M=block_m, BLOCK_N=block_n, IEEE=x.dtype == torch.float32)
    return out


def gguf_linear(x: torch.Tensor, blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """kernels.reference.gguf_linear's contract: Q8_0 (GGUF files and int8 checkpoints) on the
    Triton kernel below DEQUANT_MIN_ROWS rows; 4-bit types and large batches dequantize, then
    cuBLAS (4-bit GGUF blocks are a CPU format here)."""
    if qtype != "Q8_0" or x.shape[0] >= DEQUANT_MIN_ROWS:
        return reference.gguf_linear(x, blocks, qtype)
    return q8_0_linear(x, blocks)
