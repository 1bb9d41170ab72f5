"""The CPU linear paths for bf16 weights against plain F.linear (their reference)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.layers.linear import CPU_FP32_MIN_ROWS, Linear, linear, prepack


@pytest.mark.parametrize("rows", [1, 7, CPU_FP32_MIN_ROWS - 1])
def test_prepacked_path_is_bit_identical_to_f_linear(rows):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 64, generator=g).bfloat16()
    b = torch.randn(96, generator=g).bfloat16()
    x = torch.randn(rows, 64, generator=g).bfloat16()
    packed = prepack(w)
    if packed is None:
        pytest.skip("oneDNN (mkldnn) is not available in this torch build")
    assert torch.equal(linear(x, w, b, packed), F.linear(x, w, b))


def test_many_rows_run_in_fp32_and_round_once():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g).bfloat16()
    x = torch.randn(CPU_FP32_MIN_ROWS + 5, 64, generator=g).bfloat16()
    out = linear(x, w, None, prepack(w))
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, F.linear(x.float(), w.float()).bfloat16())
    # Same values as the bf16 GEMM up to its rounding of the fp32 accumulator.
    torch.testing.assert_close(out.float(), F.linear(x, w).float(), rtol=1.6e-2, atol=1e-2)


def test_fp32_and_prepack_switch(monkeypatch):
    w = torch.randn(8, 4)
    x = torch.randn(3, 4)
    assert prepack(w) is None                                   # fp32 weights are never packed
    assert torch.equal(linear(x, w), F.linear(x, w))
    monkeypatch.setenv("PDSERVE_CPU_PREPACK", "0")
    assert prepack(w.bfloat16()) is None
    layer = Linear(4, 8, dtype=torch.bfloat16)
    layer.process_weights_after_loading()
    assert layer.packed is None
    monkeypatch.setenv("PDSERVE_CPU_PREPACK", "yes")
    with pytest.raises(ValueError, match="PDSERVE_CPU_PREPACK must be 0 or 1"):
        prepack(w.bfloat16())
