"""Triton W8A16: x [M, K] times a weight kept as Q8_0 blocks (kernels/reference.py: 32 int8 values
and their fp16 scale per 34 bytes), the form of a GGUF Q8_0 file's weights and of an int8
checkpoint's (engine/quant_checkpoint.py). Decode reads each weight byte once per step, so int8
blocks move about half of bf16's bytes.

Each program computes a [BLOCK_M, BLOCK_N] tile of the output. Per iteration it loads NB
consecutive blocks of BLOCK_N weight rows (a row's NB blocks are NB * 34 contiguous bytes, so the
loads stay wide however the 34-byte blocks fall against 16-byte boundaries), dequantizes them in
registers (int8 times the block's scale in fp32, rounded to x's dtype: exact for fp32 x, a bf16 or
fp16 rounding of each weight otherwise, as a dequantize-then-matmul in x's dtype does) and adds
their `tl.dot` with x's [BLOCK_M, NB * 32] slice to an fp32 accumulator (fp32 x stays IEEE fp32,
not TF32). Large batches dequantize the whole weight into x's dtype and let cuBLAS multiply.
The launch table (LAUNCH) and DEQUANT_MIN_ROWS come from `benchmarks/gpu_quant.py --sweep` on an
H200 (docs/PERFORMANCE.md §14).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import reference

# From this many rows on, dequantize the weight into x's dtype and let cuBLAS multiply: the tile
# loop re-reads the blocks for every BLOCK_M rows of x, and a GEMM's tensor-core tiling wins once
# the weight's bytes stop dominating.
DEQUANT_MIN_ROWS = 64

# (largest M, launch): the first entry whose M bound covers x's rows; BLOCK_M is the smallest of
# 16 (tl.dot's minimum), 32, 64 that holds them.
LAUNCH: list[tuple[int, dict]] = [
    (16, {"BLOCK_N": 32, "NB": 8, "num_warps": 4, "num_stages": 3}),
    (1 << 62, {"BLOCK_N": 64, "NB": 4, "num_warps": 4, "num_stages": 3}),
]


@triton.jit
def _q8_0_linear_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_om, row_bytes,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr, IEEE: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = rm < M, rn < N
    rows = w_ptr + rn.to(tl.int64) * row_bytes                           # [BLOCK_N] row starts
    nb = tl.arange(0, NB)
    j = tl.arange(0, 32)
    kk = tl.arange(0, NB * 32)
    num_blocks = K // 32
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for b0 in range(0, num_blocks, NB):
        bm = n_mask[:, None] & ((b0 + nb) < num_blocks)[None, :]           # [BLOCK_N, NB]
        blk = rows[:, None] + (b0 + nb)[None, :] * 34
        lo = tl.load(blk, mask=bm, other=0).to(tl.uint16)
        hi = tl.load(blk + 1, mask=bm, other=0).to(tl.uint16)
        d = (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)
        q = tl.load(blk[:, :, None] + 2 + j[None, None, :], mask=bm[:, :, None], other=0)
        w = q.to(tl.int8, bitcast=True).to(tl.float32) * d[:, :, None]     # [BLOCK_N, NB, 32]
        w = tl.reshape(w, (BLOCK_N, NB * 32)).to(x_ptr.dtype.element_ty)
        k = b0 * 32 + kk
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + k[None, :],
                    mask=m_mask[:, None] & (k < K)[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    out = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def launch_for(rows: int) -> dict:
    """The kernel's tile and launch options for x with `rows` rows (LAUNCH)."""
    for bound, launch in LAUNCH:
        if rows <= bound:
            return {"BLOCK_M": 16 if rows <= 16 else 32 if rows <= 32 else 64, **launch}
    raise AssertionError("LAUNCH's last bound covers every row count")


def q8_0_linear(x: torch.Tensor, blocks: torch.Tensor, launch: dict | None = None) -> torch.Tensor:
    """kernels.reference.gguf_linear(x, blocks, "Q8_0") on the Triton kernel (any row count);
    `launch` overrides launch_for's choice (BLOCK_M, BLOCK_N, NB, num_warps, num_stages)."""
    M, K = x.shape
    N = blocks.shape[0]
    if K % 32 or blocks.shape[1] != K // 32 * reference.GGUF_BLOCK_BYTES["Q8_0"]:
        raise ValueError(f"Q8_0 blocks of {blocks.shape[1]} bytes per row do not hold {K} input features")
    x = x.contiguous()
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M and N:
        opts = launch or launch_for(M)
        grid = (triton.cdiv(M, opts["BLOCK_M"]), triton.cdiv(N, opts["BLOCK_N"]))
        _q8_0_linear_kernel[grid](x, blocks, out, M, N, K, x.stride(0), out.stride(0), blocks.stride(0),
                                  IEEE=x.dtype == torch.float32, **opts)
    return out


def dequantized_linear(x: torch.Tensor, blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """The weight dequantized into x's dtype (exact in fp32), then one cuBLAS GEMM in that dtype."""
    return F.linear(x, reference.dequantize_gguf(blocks, qtype, x.dtype))


def gguf_linear(x: torch.Tensor, blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """kernels.reference.gguf_linear's contract: Q8_0 (GGUF files and int8 checkpoints) on the
    Triton kernel below DEQUANT_MIN_ROWS rows; 4-bit types and large batches dequantize, then
    cuBLAS (4-bit GGUF blocks are a CPU format here)."""
    if qtype != "Q8_0" or x.shape[0] >= DEQUANT_MIN_ROWS:
        return dequantized_linear(x, blocks, qtype)
    return q8_0_linear(x, blocks)
