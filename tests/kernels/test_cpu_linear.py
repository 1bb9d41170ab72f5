"""The CPU linear paths (prepacked bf16 and fp32 weights, fp32 GEMM for bf16 prefill) against plain
F.linear (their reference)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model.layers.cpu_gemm import CPU_FP32_MIN_ROWS, cpu_fp32_gemm, linear, packed_linear, prepack
from engine.model.layers.linear import Linear


@pytest.mark.parametrize("rows", [1, 7, CPU_FP32_MIN_ROWS - 1])
def test_prepacked_path_is_bit_identical_to_f_linear(rows):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 64, generator=g).bfloat16()
    b = torch.randn(96, generator=g).bfloat16()
    x = torch.randn(rows, 64, generator=g).bfloat16()
    packed = prepack(w)
    if packed is None:
        pytest.skip("oneDNN's bf16 path is not available here (no oneDNN, or a CPU without AVX-512 or AVX-NE-CONVERT)")
    assert torch.equal(linear(x, w, b, packed), F.linear(x, w, b))


def test_many_rows_run_in_fp32_and_round_once(monkeypatch):
    monkeypatch.setenv("PDSERVE_CPU_FP32_GEMM", "1")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g).bfloat16()
    x = torch.randn(CPU_FP32_MIN_ROWS + 5, 64, generator=g).bfloat16()
    out = linear(x, w, None, prepack(w))
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, F.linear(x.float(), w.float()).bfloat16())
    # Same values as the bf16 GEMM up to its rounding of the fp32 accumulator.
    torch.testing.assert_close(out.float(), F.linear(x, w).float(), rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize("fp32_gemm", ["0", "1"])
def test_many_rows_take_the_chosen_gemm(monkeypatch, fp32_gemm):
    monkeypatch.setenv("PDSERVE_CPU_FP32_GEMM", fp32_gemm)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 640, generator=g).bfloat16()
    x = torch.randn(CPU_FP32_MIN_ROWS + 5, 640, generator=g).bfloat16()
    packed = prepack(w)
    if packed is None:
        pytest.skip("oneDNN's bf16 path is not available here (no oneDNN, or a CPU without AVX-512 or AVX-NE-CONVERT)")
    dtypes = []
    real = F.linear
    monkeypatch.setattr(F, "linear", lambda a, b, c=None: dtypes.append(a.dtype) or real(a, b, c))
    out = linear(x, w, None, packed)
    assert dtypes == ([torch.float32] if fp32_gemm == "1" else [])      # else the prepacked oneDNN call
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), real(x, w).float(), rtol=1.6e-2, atol=1e-2)


def test_fp32_gemm_choice(monkeypatch):
    """`auto` times both GEMMs once per dtype and keeps the answer; the variable forces it."""
    monkeypatch.setenv("PDSERVE_CPU_FP32_GEMM", "auto")
    chosen = cpu_fp32_gemm(torch.bfloat16)
    assert isinstance(chosen, bool) and cpu_fp32_gemm(torch.bfloat16) is chosen
    monkeypatch.setenv("PDSERVE_CPU_FP32_GEMM", "1")
    assert cpu_fp32_gemm(torch.bfloat16) is True
    monkeypatch.setenv("PDSERVE_CPU_FP32_GEMM", "0")
    assert cpu_fp32_gemm(torch.bfloat16) is False
    monkeypatch.setenv("PDSERVE_CPU_FP32_GEMM", "fast")
    with pytest.raises(ValueError, match="PDSERVE_CPU_FP32_GEMM must be auto, 0 or 1"):
        cpu_fp32_gemm(torch.bfloat16)


def test_fp32_and_prepack_switch(monkeypatch):
    w = torch.randn(8, 4)
    x = torch.randn(3, 4)
    assert torch.equal(linear(x, w), F.linear(x, w))            # no packed weight: F.linear
    monkeypatch.setenv("PDSERVE_CPU_PREPACK", "0")
    assert prepack(w) is None
    assert prepack(w.bfloat16()) is None
    layer = Linear(4, 8, dtype=torch.bfloat16)
    layer.process_weights_after_loading()
    assert layer.packed is None
    monkeypatch.setenv("PDSERVE_CPU_PREPACK", "yes")
    with pytest.raises(ValueError, match="PDSERVE_CPU_PREPACK must be 0 or 1"):
        prepack(w.bfloat16())


def test_fp32_prepacked_path_matches_f_linear(monkeypatch):
    """fp32 weights are prepacked exactly where oneDNN's GEMM was timed faster on this CPU, and that
    path agrees with F.linear to float rounding (the same products, summed in another order)."""
    import engine.model.layers.cpu_gemm as lin

    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    monkeypatch.setattr(lin, "_fp32_prepack_pays", lambda: False)
    assert prepack(w) is None
    monkeypatch.setattr(lin, "_fp32_prepack_pays", lambda: True)
    packed = prepack(w)
    if packed is None:
        pytest.skip("oneDNN (mkldnn) is not available in this torch build")
    for min_rows in (1, lin.CPU_FP32_PACKED_MIN_ROWS):      # oneDNN faster at one row here, or not
        monkeypatch.setattr(lin, "fp32_packed_min_rows", lambda min_rows=min_rows: min_rows)
        for rows in (1, lin.CPU_FP32_PACKED_MIN_ROWS - 1, lin.CPU_FP32_PACKED_MIN_ROWS, 200):
            x = torch.randn(rows, 64, generator=g)
            if rows < min_rows:                       # few rows: MKL's sgemm itself
                assert torch.equal(linear(x, w, b, packed), F.linear(x, w, b))
            else:
                assert torch.equal(linear(x, w, b, packed), packed_linear(x, packed, b))
            torch.testing.assert_close(linear(x, w, b, packed), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    monkeypatch.undo()
    assert lin.fp32_packed_min_rows() in (1, 2, lin.CPU_FP32_PACKED_MIN_ROWS)      # this CPU's own timing
