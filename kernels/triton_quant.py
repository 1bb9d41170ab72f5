"""Triton W8A16: x [M, K] times a weight kept as Q8_0 (kernels/reference.py: per 32 input features,
32 int8 values and their fp16 scale), the form of a GGUF Q8_0 file's weights and of an int8
checkpoint's (engine/quant_checkpoint.py). Decode reads each weight byte once per step, so int8
blocks move about half of bf16's bytes.

`pack_gguf` first splits each row of the file's 34-byte blocks into the row's int8 values, then its
fp16 scales (the same bytes, reordered once at load): in the file's layout each block's values
start 2 bytes past a 16-byte boundary, which limited the GPU's loads to 2 bytes each (an H200 read
the blocks at 0.07-0.3 of its copy rate); split, the values load 16 bytes at a time.

Each program computes a [BLOCK_M, BLOCK_N] tile of the output over 1 / SPLIT_K of the input
features. Per iteration it loads NB blocks of BLOCK_N weight rows, dequantizes them in registers
(int8 times the block's scale in fp32, rounded to x's dtype: exact for fp32 x, a bf16 or fp16
rounding of each weight otherwise, as a dequantize-then-matmul in x's dtype does) and adds their
`tl.dot` with x's [BLOCK_M, NB * 32] slice to an fp32 accumulator (fp32 x stays IEEE fp32, not
TF32); split-K partial sums are added after. Large batches dequantize the whole weight into x's
dtype (a Triton kernel) and let cuBLAS multiply. The launch table (LAUNCH) and DEQUANT_MIN_ROWS
come from `benchmarks/gpu_quant.py --sweep` on an H200 (docs/PERFORMANCE.md §14).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import reference

Q8_0_BYTES = reference.GGUF_BLOCK_BYTES["Q8_0"]

# From this many rows on, dequantize the weight into x's dtype and let cuBLAS multiply: the tile
# loop re-reads the blocks for every BLOCK_M rows of x, and a GEMM's tensor-core tiling wins once
# the weight's bytes stop dominating. On an H200 the kernel won at 64 rows (the four projections
# of a Llama-3-8B layer: 306 against 352 us) and lost at 256 (0.2x against 0.5x of bf16).
DEQUANT_MIN_ROWS = 128

# (largest M, launch): the first entry whose M bound covers x's rows; BLOCK_M is the smallest of
# 16 (tl.dot's minimum), 32, 64 that holds them. On the H200 the sweep's best at 1-16 rows and at
# 64 rows was the same, so one entry covers all.
LAUNCH: list[tuple[int, dict]] = [
    (1 << 62, {"BLOCK_N": 64, "NB": 4, "SPLIT_K": 4, "num_warps": 4, "num_stages": 3}),
]


def pack_gguf(blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """This kernel set's form of a weight's GGUF blocks [N, K / 32 * block bytes] (same shape): Q8_0
    rows as [K int8 values | K / 32 fp16 scales]; other types unchanged (they are dequantized per
    call). `gguf_linear` takes what this returns."""
    if qtype != "Q8_0":
        return blocks
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, Q8_0_BYTES)
    return torch.cat([b[..., 2:].reshape(n, -1), b[..., :2].reshape(n, -1)], dim=1).contiguous()


@triton.jit
def _q8_0_scales(rows, K, b, mask):
    """The fp16 scales of blocks b ([BLOCK_N, NB] block indices) of packed rows, as fp32."""
    at = rows + K + b * 2
    lo = tl.load(at, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(at + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _q8_0_linear_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_om, stride_os, row_bytes, blocks_per_split,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr, IEEE: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    m_mask, n_mask = rm < M, rn < N
    rows = w_ptr + rn.to(tl.int64) * row_bytes                           # [BLOCK_N] row starts
    nb = tl.arange(0, NB)
    j = tl.arange(0, 32)
    kk = tl.arange(0, NB * 32)
    first = split * blocks_per_split
    last = tl.minimum(first + blocks_per_split, K // 32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for b0 in range(first, last, NB):
        b = b0 + nb
        bm = n_mask[:, None] & (b < last)[None, :]                          # [BLOCK_N, NB]
        d = _q8_0_scales(rows[:, None], K, b[None, :], bm)
        q = tl.load(rows[:, None, None] + b[None, :, None] * 32 + j[None, None, :], mask=bm[:, :, None], other=0)
        w = q.to(tl.int8, bitcast=True).to(tl.float32) * d[:, :, None]     # [BLOCK_N, NB, 32]
        w = tl.reshape(w, (BLOCK_N, NB * 32)).to(x_ptr.dtype.element_ty)
        k = b0 * 32 + kk
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + k[None, :],
                    mask=m_mask[:, None] & (k < last * 32)[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    out = out_ptr + split * stride_os + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _q8_0_dequantize_kernel(w_ptr, out_ptr, N, K, row_bytes, BLOCK_N: tl.constexpr, NB: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    b = tl.program_id(1) * NB + tl.arange(0, NB)
    j = tl.arange(0, 32)
    mask = (rn < N)[:, None] & (b < K // 32)[None, :]
    rows = w_ptr + rn.to(tl.int64) * row_bytes
    d = _q8_0_scales(rows[:, None], K, b[None, :], mask)
    q = tl.load(rows[:, None, None] + b[None, :, None] * 32 + j[None, None, :], mask=mask[:, :, None], other=0)
    w = q.to(tl.int8, bitcast=True).to(tl.float32) * d[:, :, None]
    out = out_ptr + rn[:, None, None].to(tl.int64) * K + b[None, :, None] * 32 + j[None, None, :]
    tl.store(out, w.to(out_ptr.dtype.element_ty), mask=mask[:, :, None])


def launch_for(rows: int) -> dict:
    """The kernel's tile and launch options for x with `rows` rows (LAUNCH)."""
    for bound, launch in LAUNCH:
        if rows <= bound:
            return {"BLOCK_M": 16 if rows <= 16 else 32 if rows <= 32 else 64, **launch}
    raise AssertionError("LAUNCH's last bound covers every row count")


def _check(x: torch.Tensor, packed: torch.Tensor) -> None:
    if x.shape[1] % 32 or packed.shape[1] != x.shape[1] // 32 * Q8_0_BYTES:
        raise ValueError(f"Q8_0 blocks of {packed.shape[1]} bytes per row do not hold {x.shape[1]} input features")


def q8_0_linear(x: torch.Tensor, packed: torch.Tensor, launch: dict | None = None) -> torch.Tensor:
    """kernels.reference.gguf_linear(x, blocks, "Q8_0") on the Triton kernel (any row count), the
    weight as `pack_gguf(blocks, "Q8_0")`; `launch` overrides launch_for's choice (BLOCK_M,
    BLOCK_N, NB, SPLIT_K, num_warps, num_stages)."""
    _check(x, packed)
    M, K = x.shape
    N = packed.shape[0]
    x = x.contiguous()
    opts = dict(launch or launch_for(M))
    num_blocks = K // 32
    splits = max(1, min(opts.pop("SPLIT_K"), num_blocks // opts["NB"]))
    per_split = triton.cdiv(triton.cdiv(num_blocks, splits), opts["NB"]) * opts["NB"]
    splits = triton.cdiv(num_blocks, per_split)
    out = torch.empty(splits, M, N, dtype=x.dtype if splits == 1 else torch.float32, device=x.device)
    if M and N:
        grid = (triton.cdiv(M, opts["BLOCK_M"]), triton.cdiv(N, opts["BLOCK_N"]), splits)
        _q8_0_linear_kernel[grid](x, packed, out, M, N, K, x.stride(0), out.stride(1), out.stride(0), packed.stride(0),
                                  per_split, IEEE=x.dtype == torch.float32, **opts)
    return out[0] if splits == 1 else out.sum(0).to(x.dtype)


def dequantize_q8_0(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight [N, K] that packed Q8_0 rows hold, computed in fp32 and rounded to `dtype`."""
    n, k = packed.shape[0], packed.shape[1] // Q8_0_BYTES * 32
    out = torch.empty(n, k, dtype=dtype, device=packed.device)
    if n and k:
        grid = (triton.cdiv(n, 32), triton.cdiv(k // 32, 8))
        _q8_0_dequantize_kernel[grid](packed, out, n, k, packed.stride(0), BLOCK_N=32, NB=8)
    return out


def dequantized_linear(x: torch.Tensor, weight: torch.Tensor, qtype: str) -> torch.Tensor:
    """The weight (as pack_gguf left it) dequantized into x's dtype (exact in fp32), then one cuBLAS
    GEMM in that dtype."""
    if qtype == "Q8_0":
        _check(x, weight)
        return F.linear(x, dequantize_q8_0(weight, x.dtype))
    return F.linear(x, reference.dequantize_gguf(weight, qtype, x.dtype))


def gguf_linear(x: torch.Tensor, weight: torch.Tensor, qtype: str) -> torch.Tensor:
    """kernels.reference.gguf_linear's contract on `pack_gguf(blocks, qtype)`: Q8_0 (GGUF files and
    int8 checkpoints) on the Triton kernel below DEQUANT_MIN_ROWS rows; 4-bit types and large
    batches dequantize, then cuBLAS (4-bit GGUF blocks are a CPU format here)."""
    if qtype != "Q8_0" or x.shape[0] >= DEQUANT_MIN_ROWS:
        return dequantized_linear(x, weight, qtype)
    return q8_0_linear(x, weight)
