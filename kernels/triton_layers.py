"""Triton RMSNorm (with the residual add fused in) and rotary embedding.

Each replaces several elementwise torch kernels (add, pow, mean, rsqrt, mul, cast; or mul, slice,
neg, cat, mul, add per tensor) with one pass over the activations; the arithmetic follows
kernels.reference (fp32 statistics, the product with the weight and the rotation in the activations'
dtype, no fused multiply-adds): fp32 rotary matches it bit for bit, RMSNorm to rounding (its
sum of squares is reduced in another order).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_r, hidden, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    mask = i < hidden
    x = tl.load(x_ptr + row * stride_x + i, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = x + tl.load(res_ptr + row * stride_r + i, mask=mask, other=0.0)
    tl.store(res_out_ptr + row * hidden + i, x, mask=mask)
    h = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, 0) / hidden + eps)
    w = tl.load(w_ptr + i, mask=mask, other=0.0)
    normed = (h * rstd).to(x.dtype)
    tl.store(out_ptr + row * hidden + i, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as kernels.reference.rms_norm."""
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    res_out = torch.empty_like(x2, memory_format=torch.contiguous_format)
    if x2.shape[0]:
        r2 = residual.reshape(-1, hidden) if residual is not None else x2
        _rms_norm_kernel[(x2.shape[0],)](x2, r2, weight, out, res_out, x2.stride(0), r2.stride(0),
                                         hidden, eps, HAS_RESIDUAL=residual is not None,
                                         BLOCK=triton.next_power_of_2(hidden), enable_fp_fusion=False)
    return out.view(x.shape), res_out.view(x.shape)


@triton.jit
def _rotary_kernel(x_ptr, out_ptr, cos_ptr, sin_ptr, stride_xt, stride_xh, stride_c, num_heads,
                   HALF: tl.constexpr, HALF_PAD: tl.constexpr, H_PAD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, H_PAD)
    i = tl.arange(0, HALF_PAD)
    mask = (h < num_heads)[:, None] & (i < HALF)[None, :]
    src = x_ptr + t * stride_xt + h[:, None] * stride_xh + i[None, :]
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    c1 = tl.load(cos_ptr + t * stride_c + i, mask=i < HALF, other=0.0)[None, :]
    c2 = tl.load(cos_ptr + t * stride_c + HALF + i, mask=i < HALF, other=0.0)[None, :]
    s1 = tl.load(sin_ptr + t * stride_c + i, mask=i < HALF, other=0.0)[None, :]
    s2 = tl.load(sin_ptr + t * stride_c + HALF + i, mask=i < HALF, other=0.0)[None, :]
    dst = out_ptr + t * num_heads * 2 * HALF + h[:, None] * 2 * HALF + i[None, :]
    # Rounded as the reference: each product in the activations' dtype, then the sum.
    a1 = (x1 * c1).to(x1.dtype)
    b1 = (-x2 * s1).to(x1.dtype)
    a2 = (x2 * c2).to(x1.dtype)
    b2 = (x1 * s2).to(x1.dtype)
    tl.store(dst, (a1 + b1).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (a2 + b2).to(out_ptr.dtype.element_ty), mask=mask)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    num_tokens, num_heads, head_dim = x.shape
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=x.dtype, device=x.device)
    if num_tokens:
        half = head_dim // 2
        _rotary_kernel[(num_tokens,)](x, out, cos, sin, x.stride(0), x.stride(1), cos.stride(0),
                                      num_heads, HALF=half, HALF_PAD=triton.next_power_of_2(half),
                                      H_PAD=triton.next_power_of_2(num_heads),
                                      enable_fp_fusion=False)
    return out


def apply_rotary(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as kernels.reference.apply_rotary (neox style, rotate halves)."""
    assert query.stride(-1) == 1 and key.stride(-1) == 1 and cos.is_contiguous() and sin.is_contiguous()
    return _rotate(query, cos, sin), _rotate(key, cos, sin)
