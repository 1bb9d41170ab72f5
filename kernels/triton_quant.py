"""Triton W8A16: x [M, K] times a weight kept as Q8_0 (kernels/reference.py: per 32 input features,
32 int8 values and their fp16 scale), the form of a GGUF Q8_0 file's weights and of an int8
checkpoint's (engine/loading/quant_checkpoint.py). Decode reads each weight byte once per step, so int8
blocks move about half of bf16's bytes.

`pack_gguf` first splits each row of the file's 34-byte blocks into the row's int8 values, then its
fp16 scales (the same bytes, reordered once at load): in the file's layout each block's values
start 2 bytes past a 16-byte boundary, which limited the GPU's loads to 2 bytes each (an H200 read
the blocks at 0.07-0.3 of its copy rate); split, the values load 16 bytes at a time.

Two kernels (chosen by `benchmarks/gpu_quant.py --variants` on an H200, docs/perf/journal.md §14):
- one row of x (single-sequence decode): `_q8_0_gemv_kernel`, no tensor cores: each program takes
  BLOCK_N weight rows, NB blocks per step with 16-byte loads, their integers times x in fp32 summed
  per block, times the block's scale. On Llama-3-8B's projections 1.27x bf16 cuBLAS's time (the
  gate/up projection's blocks at 2.5 TB/s, 0.59 of the copy rate).
- more rows: `_q8_0_linear_kernel`, a [BLOCK_M, BLOCK_N] tile of the output over 1 / SPLIT_K of
  the input features, each 32-feature block its own `tl.dot` of x with the block's exact integers
  (int8 is exact in bf16 and fp16; fp32 x stays IEEE fp32, not TF32) and the block's scale applied
  to the product in fp32: no per-weight multiply and no rounding of q d to x's dtype. 0.92x bf16 at
  4-16 rows, 0.58x at 64 (a tile that dequantized each weight into x's dtype before one wider
  `tl.dot` ran at 0.51-0.65x and 0.46x). Split-K partial sums are added after.
Large batches dequantize the whole weight into x's dtype (a Triton kernel) and let cuBLAS multiply.

fp8 (e4m3) weights: x is quantized per row by one Triton kernel (`quantize_fp8_rows`); one row then
goes through `_fp8_gemv_kernel` (cuBLASLt's fp8 GEMM was slower than bf16 there), more rows through
`torch._scaled_mm`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import reference
from kernels.gguf_format import GGUF_BLOCK_BYTES, dequantize_gguf

Q8_0_BYTES = GGUF_BLOCK_BYTES["Q8_0"]

# From this many rows on, dequantize the weight into x's dtype and let cuBLAS multiply: the tile
# loop re-reads the blocks for every BLOCK_M rows of x, and a GEMM's tensor-core tiling wins once
# the weight's bytes stop dominating. On an H200 the tile kernel won at 64 rows (the four
# projections of a Llama-3-8B layer: 295 against 352 us) and lost at 256 (833 against 399 us).
DEQUANT_MIN_ROWS = 128

# The tile kernel's (largest M, launch): the first entry whose M bound covers x's rows; BLOCK_M is
# the smallest of 16 (tl.dot's minimum), 32, 64 that holds them. The H200 sweep's best at 4 and 16
# rows on three of the four projections, and at 64 on two (the gate/up projection preferred
# SPLIT_K 1 there).
LAUNCH: list[tuple[int, dict]] = [
    (16, {"BLOCK_N": 64, "NB": 4, "SPLIT_K": 4, "num_warps": 4, "num_stages": 3}),
    (1 << 62, {"BLOCK_N": 128, "NB": 2, "SPLIT_K": 4, "num_warps": 4, "num_stages": 3}),
]
# The one-row kernel's launch: 8 weight rows of 8 blocks per step; split over the features in 4
# where the output has fewer than 768 tiles of rows (the H200's best for N = 4096; for N of 6,144
# and 28,672, one split).
GEMV_LAUNCH = {"BLOCK_N": 8, "NB": 8, "num_warps": 4}
GEMV_SPLIT_MAX_TILES = 768
# Whether one row of x times fp8 weights takes `fp8_gemv` (else cuBLASLt's fp8 GEMM, as more rows do).
GEMV_FP8 = True


def pack_gguf(blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """This kernel set's form of a weight's GGUF blocks [N, K / 32 * block bytes] (same shape): Q8_0
    rows as [K int8 values | K / 32 fp16 scales]; other types unchanged (they are dequantized per
    call). `gguf_linear` takes what this returns."""
    if qtype != "Q8_0":
        return blocks
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, Q8_0_BYTES)
    return torch.cat([b[..., 2:].reshape(n, -1), b[..., :2].reshape(n, -1)], dim=1).contiguous()


def unpack_gguf(packed: torch.Tensor, qtype: str) -> torch.Tensor:
    """`pack_gguf`'s inverse: the file's blocks again (before a weight update rewrites some rows)."""
    if qtype != "Q8_0":
        return packed
    n, row_bytes = packed.shape
    k = row_bytes // Q8_0_BYTES * 32
    values, scales = packed[:, :k].reshape(n, -1, 32), packed[:, k:].reshape(n, -1, 2)
    return torch.cat([scales, values], dim=2).reshape(n, -1).contiguous()


@triton.jit
def _q8_0_linear_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_om, stride_os, row_bytes, blocks_per_split,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr, IEEE: tl.constexpr):
    """A [BLOCK_M, BLOCK_N] tile of x W^T over blocks [split * blocks_per_split, ...): per block one
    `tl.dot` of x with the block's integers in x's dtype, times the block's scale."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    m_mask, n_mask = rm < M, rn < N
    rows = w_ptr + rn.to(tl.int64) * row_bytes
    scales = (rows + K).to(tl.pointer_type(tl.float16))
    j = tl.arange(0, 32)
    first = split * blocks_per_split
    last = tl.minimum(first + blocks_per_split, K // 32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for b0 in range(first, last, NB):
        for i in tl.static_range(NB):
            b = b0 + i
            n_ok = n_mask & (rn * 0 + b < last)         # (a vector: the interpreter refuses scalar masks)
            d = tl.load(scales + b, mask=n_ok, other=0.0).to(tl.float32)
            q = tl.load(rows[:, None] + b * 32 + j[None, :], mask=n_ok[:, None], other=0)
            w = q.to(tl.int8, bitcast=True).to(x_ptr.dtype.element_ty)
            x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + b * 32 + j[None, :],
                        mask=(m_mask & (rm * 0 + b < last))[:, None], other=0.0)
            if IEEE:
                p = tl.dot(x, tl.trans(w), input_precision="ieee")
            else:
                p = tl.dot(x, tl.trans(w))
            acc += p * d[None, :]
    out = out_ptr + split * stride_os + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _q8_0_gemv_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_om, stride_os, row_bytes, blocks_per_split,
                      BLOCK_N: tl.constexpr, NB: tl.constexpr):
    """Row program_id(0) of x against BLOCK_N weight rows over blocks [split * blocks_per_split, ...):
    per step NB blocks of each row, their integers times x in fp32, summed per block, times the
    block's scale. (x's rows are the grid's fastest axis, so programs sharing a weight tile run
    together and read it from L2; above one row the tile kernel is faster all the same.)"""
    m = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    n_mask = rn < N
    rows = w_ptr + rn.to(tl.int64) * row_bytes
    scales = (rows + K).to(tl.pointer_type(tl.float16))
    nb = tl.arange(0, NB)
    kk = tl.arange(0, NB * 32)
    first = split * blocks_per_split
    last = tl.minimum(first + blocks_per_split, K // 32)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    x_row = x_ptr + m.to(tl.int64) * stride_xm
    for b0 in range(first, last, NB):
        k = b0 * 32 + kk
        k_ok = k < last * 32
        q = tl.load(rows[:, None] + k[None, :], mask=n_mask[:, None] & k_ok[None, :], other=0)
        x = tl.load(x_row + k, mask=k_ok, other=0.0).to(tl.float32)
        p = q.to(tl.int8, bitcast=True).to(tl.float32) * x[None, :]
        per_block = tl.sum(tl.reshape(p, (BLOCK_N, NB, 32)), axis=2)
        b = b0 + nb
        d = tl.load(scales[:, None] + b[None, :], mask=n_mask[:, None] & (b < last)[None, :], other=0.0)
        acc += tl.sum(per_block * d.to(tl.float32), axis=1)
    tl.store(out_ptr + split * stride_os + m.to(tl.int64) * stride_om + rn, acc.to(out_ptr.dtype.element_ty),
             mask=n_mask)


@triton.jit
def _q8_0_dequantize_kernel(w_ptr, out_ptr, N, K, row_bytes, BLOCK_N: tl.constexpr, NB: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    b = tl.program_id(1) * NB + tl.arange(0, NB)
    j = tl.arange(0, 32)
    mask = (rn < N)[:, None] & (b < K // 32)[None, :]
    rows = w_ptr + rn.to(tl.int64) * row_bytes
    d = tl.load((rows + K).to(tl.pointer_type(tl.float16))[:, None] + b[None, :], mask=mask, other=0.0)
    q = tl.load(rows[:, None, None] + b[None, :, None] * 32 + j[None, None, :], mask=mask[:, :, None], other=0)
    w = q.to(tl.int8, bitcast=True).to(tl.float32) * d.to(tl.float32)[:, :, None]
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


def q8_0_linear(x: torch.Tensor, packed: torch.Tensor, launch: dict | None = None,
                kernel: str | None = None) -> torch.Tensor:
    """kernels.reference.gguf_linear(x, blocks, "Q8_0") on a Triton kernel (any row count), the
    weight as `pack_gguf(blocks, "Q8_0")`. `kernel` ("gemv" or "tile"; default: gemv for one row)
    and `launch` (BLOCK_M for the tile, BLOCK_N, NB, SPLIT_K, num_warps, num_stages) override the
    defaults."""
    _check(x, packed)
    M, K = x.shape
    N = packed.shape[0]
    x = x.contiguous()
    kernel = kernel or ("gemv" if M == 1 else "tile")
    if launch is None and kernel == "gemv":
        tiles = triton.cdiv(N, GEMV_LAUNCH["BLOCK_N"])
        launch = {**GEMV_LAUNCH, "SPLIT_K": 4 if tiles < GEMV_SPLIT_MAX_TILES else 1}
    opts = dict(launch or launch_for(M))
    num_blocks = K // 32
    splits = max(1, min(opts.pop("SPLIT_K"), num_blocks // opts["NB"]))
    per_split = triton.cdiv(triton.cdiv(num_blocks, splits), opts["NB"]) * opts["NB"]
    splits = triton.cdiv(num_blocks, per_split)
    out = torch.empty(splits, M, N, dtype=x.dtype if splits == 1 else torch.float32, device=x.device)
    if M and N:
        args = (x, packed, out, M, N, K, x.stride(0), out.stride(1), out.stride(0), packed.stride(0), per_split)
        if kernel == "gemv":
            opts.pop("BLOCK_M", None)
            _q8_0_gemv_kernel[(M, triton.cdiv(N, opts["BLOCK_N"]), splits)](*args, **opts)
        else:
            grid = (triton.cdiv(M, opts["BLOCK_M"]), triton.cdiv(N, opts["BLOCK_N"]), splits)
            _q8_0_linear_kernel[grid](*args, IEEE=x.dtype == torch.float32, **opts)
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
    return F.linear(x, dequantize_gguf(weight, qtype, x.dtype))


def gguf_linear(x: torch.Tensor, weight: torch.Tensor, qtype: str) -> torch.Tensor:
    """kernels.reference.gguf_linear's contract on `pack_gguf(blocks, qtype)`: Q8_0 (GGUF files and
    int8 checkpoints) on the Triton kernel below DEQUANT_MIN_ROWS rows; 4-bit types and large
    batches dequantize, then cuBLAS (4-bit GGUF blocks are a CPU format here)."""
    if qtype != "Q8_0" or x.shape[0] >= DEQUANT_MIN_ROWS:
        return dequantized_linear(x, weight, qtype)
    return q8_0_linear(x, weight)


@triton.jit
def _fp8_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, BLOCK_K: tl.constexpr, FP8_MAX: tl.constexpr,
                     TINY: tl.constexpr):
    """Row program_id(0) of x: its amax, then every value over amax / FP8_MAX as e4m3, and the scale."""
    m = tl.program_id(0).to(tl.int64)
    row = x_ptr + m * stride_xm
    kk = tl.arange(0, BLOCK_K)
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        v = tl.load(row + k0 + kk, mask=k0 + kk < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
    scale = tl.maximum(tl.max(amax, axis=0) / FP8_MAX, TINY)
    for k0 in range(0, K, BLOCK_K):
        v = tl.load(row + k0 + kk, mask=k0 + kk < K, other=0.0).to(tl.float32)
        q = tl.clamp(tl.div_rn(v, scale), -FP8_MAX, FP8_MAX)
        tl.store(q_ptr + m * stride_qm + k0 + kk, q.to(tl.float8e4nv, fp_downcast_rounding="rtne"), mask=k0 + kk < K)
    tl.store(s_ptr + m, scale)


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels.reference.quantize_fp8_rows in one launch (the reference's eight elementwise and
    reduction kernels cost more than the fp8 GEMM itself at decode sizes): the same amax / 448
    scale per row and the same e4m3 values (IEEE division, saturation, round to nearest even) on a
    GPU's conversion instruction."""
    x = x.contiguous()
    m, k = x.shape
    q = torch.empty(m, k, dtype=reference.FP8_DTYPE, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m and k:
        _fp8_rows_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0), BLOCK_K=min(1024, triton.next_power_of_2(k)),
                               FP8_MAX=reference.FP8_MAX, TINY=torch.finfo(torch.float32).tiny, num_warps=4)
    return q, scale


@triton.jit
def _fp8_gemv_kernel(xq_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, N, K, stride_w, stride_os, per_split,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FINAL: tl.constexpr):
    """One quantized row of x (e4m3 values, its scale) against BLOCK_N e4m3 weight rows over
    features [split * per_split, ...): the exact products of the widened values summed in fp32, then
    times both scales (FINAL: rounded to the output's dtype; else a split's fp32 partial sum)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    n_mask = rn < N
    rows = w_ptr + rn.to(tl.int64) * stride_w
    kk = tl.arange(0, BLOCK_K)
    first = split * per_split
    last = tl.minimum(first + per_split, K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(first, last, BLOCK_K):
        k = k0 + kk
        k_ok = k < last
        w = tl.load(rows[:, None] + k[None, :], mask=n_mask[:, None] & k_ok[None, :], other=0)
        x = tl.load(xq_ptr + k, mask=k_ok, other=0)
        acc += (w.to(tl.float8e4nv, bitcast=True).to(tl.float32)
                * x.to(tl.float8e4nv, bitcast=True).to(tl.float32)[None, :])
    out = tl.sum(acc, axis=1)
    if FINAL:
        out = out * tl.load(xs_ptr) * tl.load(ws_ptr + rn, mask=n_mask, other=0.0)
    tl.store(out_ptr + split * stride_os + rn, out.to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _fp8_gemv_reduce_kernel(part_ptr, xs_ptr, ws_ptr, out_ptr, N, stride_ps, SPLITS: tl.constexpr,
                            BLOCK: tl.constexpr):
    """The splits' fp32 partial sums added in split order, times both scales, in the output's dtype."""
    rn = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = rn < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        acc += tl.load(part_ptr + s * stride_ps + rn, mask=mask, other=0.0)
    acc = acc * tl.load(xs_ptr) * tl.load(ws_ptr + rn, mask=mask, other=0.0)
    tl.store(out_ptr + rn, acc.to(out_ptr.dtype.element_ty), mask=mask)


# The one-row kernel's launch (fp8 weights at single-sequence decode, where cuBLASLt's fp8 GEMM ran
# at 0.71-0.87x bf16's time on three of Llama-3-8B's four projections on an H200, §14b), and the
# split over the features below FP8_GEMV_SPLIT_MAX_TILES output tiles. On an H100 (§14e) single
# readings of these ~25 us kernels moved up to 3x between rounds; by their best readings 8 rows of
# 512 features per step, unsplit, is within a few percent of the best option on every projection
# (1.1-1.6x bf16), and splitting gained nothing that held up, so it is off (1).
FP8_GEMV_LAUNCH = {"BLOCK_N": 8, "BLOCK_K": 512, "num_warps": 4}
FP8_GEMV_SPLIT = 1
FP8_GEMV_SPLIT_MAX_TILES = 768


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, launch: dict | None = None,
             splits: int | None = None, quantize_rows=None) -> torch.Tensor:
    """`kernels.reference.fp8_linear` for one row of x (on a GPU with e4m3 conversion): x quantized
    by `quantize_rows` (default `quantize_fp8_rows`), then `_fp8_gemv_kernel`; the same products as
    the fp8 GEMM, summed in another order. `launch` and `splits` override FP8_GEMV_*."""
    assert x.shape[0] == 1
    n, k = weight.shape
    xq, x_scale = (quantize_rows or quantize_fp8_rows)(x)
    opts = dict(launch or FP8_GEMV_LAUNCH)
    tiles = triton.cdiv(n, opts["BLOCK_N"])
    if splits is None:
        splits = FP8_GEMV_SPLIT if tiles < FP8_GEMV_SPLIT_MAX_TILES else 1
    per_split = triton.cdiv(triton.cdiv(k, splits), opts["BLOCK_K"]) * opts["BLOCK_K"]
    splits = triton.cdiv(k, per_split)
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    part = out if splits == 1 else torch.empty(splits, n, dtype=torch.float32, device=x.device)
    w_scale = scale.reshape(-1).float().contiguous()
    _fp8_gemv_kernel[(tiles, splits)](xq.view(torch.uint8), x_scale, weight.view(torch.uint8), w_scale, part, n, k,
                                      weight.stride(0), part.stride(0), per_split, FINAL=splits == 1, **opts)
    if splits > 1:
        _fp8_gemv_reduce_kernel[(triton.cdiv(n, 1024),)](part, x_scale, w_scale, out, n, part.stride(0),
                                                         SPLITS=splits, BLOCK=1024)
    return out


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """kernels.reference.fp8_linear on a GPU: one row through `fp8_gemv`, more through
    `fp8_linear_scaled_mm` with x quantized per row by `quantize_fp8_rows`. (Elsewhere, i.e. under
    TRITON_INTERPRET=1, the reference's fp8 GEMM and quantizer: the interpreter's fp32 -> e4m3
    conversion rounds values just below a power of two down to the power below.)"""
    if not x.is_cuda:
        return reference.fp8_linear_scaled_mm(x, weight, scale)
    if x.shape[0] == 1 and GEMV_FP8:
        return fp8_gemv(x, weight, scale)
    return reference.fp8_linear_scaled_mm(x, weight, scale, quantize_fp8_rows)
