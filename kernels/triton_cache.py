"""Triton cache ops: store new K/V into their slots, and copy whole blocks (copy-on-write).

Swapping blocks between the GPU pool and the CPU pool stays with kernels.reference.swap_blocks: it
is a host <-> device transfer (the copy engine's work, which a kernel cannot do faster).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference import FP8_DTYPE, quantize_kv_rows, raw


@triton.jit
def _write_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_cs, stride_ch,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, H_PAD: tl.constexpr,
                     D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:                       # a padded row (CUDA-graph batches): nothing to store
        return
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, D_PAD)
    mask = (h < NUM_KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + h[:, None] * stride_ch + d[None, :]
    k = tl.load(key_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Same contract as kernels.reference.write_kv; a negative slot is skipped (padding). An fp8
    cache's rows are quantized by kernels.reference.quantize_kv and stored as bytes."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if kv_cache.dtype == FP8_DTYPE:
        key, value = quantize_kv_rows(key, value, k_scale, v_scale)
        kv_cache = raw(kv_cache)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    assert key.stride(-1) == 1 and value.stride(-1) == 1 and k_cache.stride(-1) == 1
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, H_PAD=triton.next_power_of_2(num_kv_heads),
        D_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=kv_cache.shape[2])


COPY_CHUNK = 1024       # elements per program of copy_blocks


@triton.jit
def _copy_blocks_kernel(cache_ptr, src_ptr, dst_ptr, block_elems, half_elems, CHUNK: tl.constexpr):
    pair = tl.program_id(0)
    kv = tl.program_id(1)                               # 0: K, 1: V
    chunk = tl.program_id(2)
    src = tl.load(src_ptr + pair).to(tl.int64)
    dst = tl.load(dst_ptr + pair).to(tl.int64)
    i = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = i < block_elems
    base = kv * half_elems
    x = tl.load(cache_ptr + base + src * block_elems + i, mask=mask)
    tl.store(cache_ptr + base + dst * block_elems + i, x, mask=mask)


def copy_blocks(kv_caches: list[torch.Tensor], pairs: list[tuple[int, int]]) -> None:
    """Same contract as kernels.reference.copy_blocks: one launch per layer for all pairs."""
    if not pairs:
        return
    device = kv_caches[0].device
    src = torch.tensor([s for s, _ in pairs], dtype=torch.int64, device=device)
    dst = torch.tensor([d for _, d in pairs], dtype=torch.int64, device=device)
    for kv_cache in kv_caches:
        assert kv_cache.is_contiguous()
        kv_cache = raw(kv_cache)
        num_blocks = kv_cache.shape[1]
        block_elems = kv_cache[0, 0].numel()
        grid = (len(pairs), 2, triton.cdiv(block_elems, COPY_CHUNK))
        _copy_blocks_kernel[grid](kv_cache, src, dst, block_elems, num_blocks * block_elems,
                                  CHUNK=COPY_CHUNK)
