"""Triton batched LoRA (kernels.reference.lora_add's contract): Punica's BGMV in two launches.

Shrink: one program per (LoRA row, block of A's rows) computes that row's A_s x for its group's slot
s, in fp32, rounded to the activations' dtype as the reference's matmul rounds. Expand: one program
per (LoRA row, block of output features) adds sum_j B^T_s[j] * shrunk[j] to those features, each
feature reading the shrunk values of its own fused output. Rows outside every group are never
touched; A and B are read per row from the slot stacks (no gather, no copy), which the GPU's L2
shares between the rows of one adapter.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import reference


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, rows_ptr, row_slot_ptr, row_rank_ptr, shrunk_ptr, stride_x, in_features,
                   width, SUBS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_IN: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    row = tl.load(rows_ptr + n)
    slot = tl.load(row_slot_ptr + n)
    used = tl.load(row_rank_ptr + n) * SUBS               # rows of A this adapter fills
    kmask = k < used
    acc = tl.zeros([BLOCK_K], dtype=tl.float32)
    for i0 in range(0, in_features, BLOCK_IN):
        i = i0 + tl.arange(0, BLOCK_IN)
        imask = i < in_features
        x = tl.load(x_ptr + row * stride_x + i, mask=imask, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + (slot * width + k[:, None]) * in_features + i[None, :],
                    mask=kmask[:, None] & imask[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    rounded = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(shrunk_ptr + n * width + k, rounded, mask=k < width)


@triton.jit
def _expand_kernel(out_ptr, bt_ptr, rows_ptr, row_slot_ptr, row_rank_ptr, shrunk_ptr, stride_out, out_features,
                   max_rank, width, off1, off2, SUBS: tl.constexpr, BLOCK_O: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    omask = o < out_features
    row = tl.load(rows_ptr + n)
    slot = tl.load(row_slot_ptr + n)
    rank = tl.load(row_rank_ptr + n)
    sub = (o >= off1).to(tl.int32) + (o >= off2).to(tl.int32)       # each feature's fused output
    acc = tl.zeros([BLOCK_O], dtype=tl.float32)
    for j in range(0, rank):
        s = tl.load(shrunk_ptr + n * width + j * SUBS + sub, mask=omask, other=0.0)
        b = tl.load(bt_ptr + (slot * max_rank + j) * out_features + o, mask=omask, other=0.0).to(tl.float32)
        acc += s * b
    dst = out_ptr + row * stride_out + o
    delta = acc.to(out_ptr.dtype.element_ty)
    current = tl.load(dst, mask=omask, other=0.0)
    tl.store(dst, (current + delta).to(out_ptr.dtype.element_ty), mask=omask)


def lora_add(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, rows: torch.Tensor,
             starts: torch.Tensor, slots: torch.Tensor, ranks: torch.Tensor, sub_offsets: torch.Tensor
             ) -> torch.Tensor:
    """kernels.reference.lora_add's contract (at most three fused outputs, contiguous rows)."""
    subs = a.shape[2]
    if subs > 3 or x.stride(1) != 1 or out.stride(1) != 1 or not a.is_contiguous() or not bt.is_contiguous():
        return reference.lora_add(x, out, a, bt, rows, starts, slots, ranks, sub_offsets)
    num_rows = rows.shape[0]
    if num_rows == 0:
        return out
    counts = starts[1:] - starts[:-1]
    per_row = torch.stack([torch.repeat_interleave(slots, counts), torch.repeat_interleave(ranks, counts)])
    if x.is_cuda:
        # From pinned memory, without blocking: a copy from pageable memory would wait for the
        # stream's queued work in every adapted layer of the step.
        per_row = per_row.pin_memory().to(x.device, non_blocking=True)
    row_slot, row_rank = per_row[0], per_row[1]
    max_rank, in_features, out_features = a.shape[1], a.shape[3], bt.shape[2]
    width = max_rank * subs
    shrunk = torch.empty(num_rows, width, dtype=torch.float32, device=x.device)
    block_k = min(64, triton.next_power_of_2(width))
    _shrink_kernel[(num_rows, triton.cdiv(width, block_k))](
        x, a, rows, row_slot, row_rank, shrunk, x.stride(0), in_features, width, SUBS=subs, BLOCK_K=block_k,
        BLOCK_IN=min(128, triton.next_power_of_2(in_features)))
    offsets = sub_offsets.tolist() + [out_features] * (4 - len(sub_offsets))
    block_o = min(256, triton.next_power_of_2(out_features))
    _expand_kernel[(num_rows, triton.cdiv(out_features, block_o))](
        out, bt, rows, row_slot, row_rank, shrunk, out.stride(0), out_features, max_rank, width,
        offsets[1] if subs > 1 else out_features, offsets[2] if subs > 2 else out_features,
        SUBS=subs, BLOCK_O=block_o)
    return out
