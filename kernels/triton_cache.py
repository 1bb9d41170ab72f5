"""Triton cache ops: store new K/V into their slots, and copy whole blocks (copy-on-write).

Swapping blocks between the GPU pool and the CPU pool stays with kernels.reference.swap_blocks: it
is a host <-> device transfer (the copy engine's work, which a kernel cannot do faster).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference import FP8_MAX, raw
from kernels.triton_attention import cache_views

E4M3_MAX = tl.constexpr(FP8_MAX)


@triton.jit
def _e4m3_bytes(x, scale, FP8: tl.constexpr):
    """x / scale as an fp8 cache stores it (kernels.reference.quantize_kv: IEEE division in fp32,
    saturated to +-448, rounded to nearest even), as e4m3fn's bytes. FP8 == 2 by the GPU's own
    conversion (sm_89 and later); FP8 == 1 in fp32 and integer arithmetic, for older GPUs and the
    interpreter (whose fp32 -> e4m3 conversion rounds values just below a power of two down)."""
    x = tl.clamp(tl.div_rn(x.to(tl.float32), scale), -E4M3_MAX, E4M3_MAX, propagate_nan=tl.PropagateNan.ALL)
    if FP8 == 2:
        out = x.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
    else:
        bits = x.to(tl.int32, bitcast=True)
        a = tl.abs(x)
        # e4m3's step in |x|'s binade is 2^(e-3) (subnormals: 2^-9, the step of binade -6). Adding
        # 2^(e+20), whose fp32 ulp is that step, rounds |x| to a multiple of it, to nearest even.
        e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
        magic = ((e + 20 + 127) << 23).to(tl.float32, bitcast=True)
        r = (a + magic) - magic
        rbits = r.to(tl.int32, bitcast=True)
        normal = (((rbits >> 23) - 120) << 3) | ((rbits >> 20) & 7)      # biased exponent e + 7, 3 bits
        code = tl.where(r >= 0.015625, normal, (r * 512.0).to(tl.int32))  # below 2^-6: a count of 2^-9
        code = tl.where(x != x, 0x7F, code)                                # NaN stays NaN
        out = (code | ((bits >> 24) & 0x80)).to(tl.uint8)
    return out


@triton.jit
def _write_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale, v_scale,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_cs, stride_ch,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, H_PAD: tl.constexpr,
                     D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr):
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
    if FP8:
        k = _e4m3_bytes(k, k_scale, FP8)
        v = _e4m3_bytes(v, v_scale, FP8)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Same contract as kernels.reference.write_kv; a negative slot is skipped (padding). An fp8
    cache's rows are quantized in the same launch, to kernels.reference.quantize_kv's bytes (the
    reference's eight small kernels a layer had cost more than the attention at decode sizes)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    k_cache, v_cache, fp8 = cache_views(kv_cache)
    assert key.stride(-1) == 1 and value.stride(-1) == 1 and k_cache.stride(-1) == 1
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, float(k_scale), float(v_scale),
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, H_PAD=triton.next_power_of_2(num_kv_heads),
        D_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=kv_cache.shape[2], FP8=fp8)


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
