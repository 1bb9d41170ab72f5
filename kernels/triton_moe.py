"""Triton fused mixture of experts (kernels.reference.fused_moe's contract): grouped GEMMs over the
(token, expert) pairs sorted by expert.

The pairs routed to this call's experts are sorted by expert and each expert's run padded to a
multiple of BLOCK_M (`_align`), so every block of BLOCK_M sorted positions belongs to one expert.
One launch of `_grouped_gemm_kernel` computes, per (block, tile of N outputs), the block's rows
times that expert's weight: first the gathered token rows times w13 (gate and up), then, after the
SiLU-gated product (one elementwise torch op), those rows times w2. The outputs, still by sorted
position, are weighed and added into their tokens in fp32. Accumulation is fp32 throughout (fp32
inputs: IEEE products, not TF32, as the attention kernels).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

BLOCK_M = 16


@triton.jit
def _grouped_gemm_kernel(a_ptr, b_ptr, c_ptr, rows_ptr, block_expert_ptr, n_out, k_in, stride_a, stride_be,
                         stride_bn, stride_c, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """c[p] = a[rows[p]] @ b[e]^T for the BLOCK_M sorted positions p of this block (expert e);
    positions with row -1 (padding) are skipped."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pos = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(rows_ptr + pos)
    valid = rows >= 0
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < n_out
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < k_in
        a = tl.load(a_ptr + rows.to(tl.int64)[:, None] * stride_a + k[None, :],
                    mask=valid[:, None] & kmask[None, :], other=0.0)
        b = tl.load(b_ptr + expert * stride_be + n[None, :] * stride_bn + k[:, None],
                    mask=nmask[None, :] & kmask[:, None], other=0.0)
        if IEEE:
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
    tl.store(c_ptr + pos.to(tl.int64)[:, None] * stride_c + n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=valid[:, None] & nmask[None, :])


def _align(ids: torch.Tensor, expert_start: int, num_experts: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pair index per sorted position, -1 for padding; the expert of each BLOCK_M block; the sorted
    position of each kept pair; the kept pairs, sorted by expert) for the pairs of this call's experts."""
    flat = ids.flatten() - expert_start
    pairs = torch.nonzero((flat >= 0) & (flat < num_experts)).flatten()
    experts = flat[pairs]
    order = torch.argsort(experts, stable=True)
    pairs, experts = pairs[order], experts[order]
    counts = torch.bincount(experts, minlength=num_experts).tolist()
    padded = [-(-c // BLOCK_M) * BLOCK_M for c in counts]
    rows = torch.full((sum(padded),), -1, dtype=torch.long, device=ids.device)
    block_expert, start, at = [], 0, 0
    positions = torch.empty_like(pairs)
    for e, (c, p) in enumerate(zip(counts, padded)):
        rows[start:start + c] = pairs[at:at + c]
        positions[at:at + c] = torch.arange(start, start + c, device=ids.device)
        block_expert += [e] * (p // BLOCK_M)
        start, at = start + p, at + c
    return rows, torch.tensor(block_expert, dtype=torch.int32, device=ids.device), positions, pairs


def _gemm(a: torch.Tensor, b: torch.Tensor, rows: torch.Tensor, block_expert: torch.Tensor) -> torch.Tensor:
    """[positions, N]: a's row rows[p] times b[expert of p]^T (b: [E, N, K])."""
    out = torch.zeros(rows.numel(), b.shape[1], dtype=a.dtype, device=a.device)
    n_out, k_in = b.shape[1], b.shape[2]
    block_n = min(64, max(16, triton.next_power_of_2(n_out)))
    grid = (block_expert.numel(), triton.cdiv(n_out, block_n))
    _grouped_gemm_kernel[grid](a, b, out, rows, block_expert, n_out, k_in, a.stride(0), b.stride(0), b.stride(1),
                               out.stride(0), BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=32,
                               IEEE=a.dtype == torch.float32)
    return out


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
              expert_start: int = 0) -> torch.Tensor:
    """Same contract as kernels.reference.fused_moe."""
    top_k, inter = ids.shape[1], w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    rows, block_expert, positions, pairs = _align(ids, expert_start, w13.shape[0])
    if not block_expert.numel():
        return out.to(x.dtype)
    tokens = torch.where(rows >= 0, rows // top_k, -1)
    h = _gemm(x.contiguous(), w13.contiguous(), tokens, block_expert)                 # [P, 2I] by position
    act = F.silu(h[:, :inter]) * h[:, inter:]
    own = torch.where(rows >= 0, torch.arange(rows.numel(), device=x.device), -1)     # each position its own row
    down = _gemm(act.contiguous(), w2.contiguous(), own, block_expert)                # [P, H]
    contrib = down[positions].float() * weights.flatten()[pairs, None].float()
    out.index_add_(0, pairs // top_k, contrib)
    return out.to(x.dtype)
