"""The fused mixture-of-experts kernels (C++ CPU, Triton under its interpreter without CUDA) against
the torch reference, and the reference against a per-token loop from the definition; routing as
transformers routes (softmax in fp32, top-k, renormalized where the model does)."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

CUDA = torch.cuda.is_available()
if not CUDA:    # Triton's CPU interpreter (set before Triton is imported; tests/kernels/test_kernels.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine.model.layers.moe import route
from kernels import cpu_ops, reference, triton_moe


@pytest.fixture(scope="module", autouse=True)
def built():
    return cpu_ops.load()


def case(tokens: int, experts: int, top_k: int, hidden: int, inter: int, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.2).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) * 0.2).to(dtype)
    logits = torch.randn(tokens, experts, generator=g)
    weights, ids = route(logits, top_k, renormalize=True)
    return x, w13, w2, weights, ids


def naive(x, w13, w2, weights, ids, expert_start=0):
    out = torch.zeros(x.shape, dtype=torch.float32)
    inter = w2.shape[2]
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j]) - expert_start
            if 0 <= e < w13.shape[0]:
                h = w13[e].float() @ x[t].float()
                out[t] += weights[t, j] * (w2[e].float() @ (F.silu(h[:inter]) * h[inter:]))
    return out


def test_routing_is_transformers():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.5]])
    weights, ids = route(logits, 2, renormalize=True)
    probs = torch.softmax(logits, -1)
    assert ids.tolist() == [[1, 2]]
    assert torch.allclose(weights, probs[:, [1, 2]] / probs[:, [1, 2]].sum())
    weights, _ = route(logits, 2, renormalize=False)
    assert torch.allclose(weights, probs[:, [1, 2]])


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 8, 2), (7, 4, 1), (40, 8, 2), (33, 6, 3)])
def test_kernels_match_the_definition(tokens, experts, top_k):
    x, w13, w2, weights, ids = case(tokens, experts, top_k, 32, 24)
    expected = naive(x, w13, w2, weights, ids)
    for name, kernels in [("reference", reference), ("cpu", cpu_ops), ("triton", triton_moe)]:
        out = kernels.fused_moe(x, w13, w2, weights, ids)
        assert out.dtype == x.dtype and torch.allclose(out, expected, atol=1e-5, rtol=1e-4), name


def test_expert_parallel_shares_sum_to_the_whole():
    """Each rank's call over its slice of experts (expert_start) contributes only those; the sum
    over ranks is the whole layer (what expert parallelism all-reduces)."""
    x, w13, w2, weights, ids = case(20, 8, 2, 32, 24, seed=1)
    whole = reference.fused_moe(x, w13, w2, weights, ids)
    for kernels in (reference, cpu_ops, triton_moe):
        parts = [kernels.fused_moe(x, w13[r * 4:(r + 1) * 4], w2[r * 4:(r + 1) * 4], weights, ids, r * 4)
                 for r in range(2)]
        assert torch.allclose(parts[0] + parts[1], whole, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_kernel_in_half_precision(dtype):
    x, w13, w2, weights, ids = case(24, 8, 2, 64, 32, dtype=dtype, seed=2)
    out = cpu_ops.fused_moe(x, w13, w2, weights, ids)
    ref = reference.fused_moe(x, w13, w2, weights, ids)
    assert out.dtype == dtype and torch.allclose(out.float(), ref.float(), atol=3e-2, rtol=3e-2)


def test_cpu_kernel_refuses_mismatched_shapes():
    x, w13, w2, weights, ids = case(4, 4, 2, 32, 24)
    with pytest.raises(RuntimeError, match="w13 must be"):
        cpu_ops.fused_moe(x, w13[:, :10], w2, weights, ids)
