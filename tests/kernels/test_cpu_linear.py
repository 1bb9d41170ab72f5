"""The CPU linear paths (prepacked bf16 and fp32 weights, pdserve's own bf16 and fp32 GEMMs, fp32 GEMM
for bf16 prefill) against plain F.linear (their reference)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import engine.model.layers.cpu_gemm as cpu_gemm
import engine.model.layers.linear as linear_layers
from engine.model.layers.cpu_gemm import (
    CPU_FP32_MIN_ROWS,
    OwnPanels,
    cpu_fp32_gemm,
    linear,
    own_gemm,
    packed_linear,
    prepack,
)
from engine.model.layers.linear import Linear, MergedColumnParallelLinear
from kernels import cpu_ops

needs_own_gemm = pytest.mark.skipif(not cpu_gemm.own_gemm_built(torch.bfloat16),
                                    reason="pdserve's bf16 GEMM needs a CPU with AVX512-BF16 and the C++ kernels")
needs_own_f32_gemm = pytest.mark.skipif(not cpu_gemm.own_gemm_built(torch.float32),
                                        reason="pdserve's fp32 GEMM needs AVX2 or AVX-512 FMA and the C++ kernels")


@pytest.mark.parametrize("rows", [1, 7, CPU_FP32_MIN_ROWS - 1])
def test_prepacked_path_is_bit_identical_to_f_linear(rows, monkeypatch):
    monkeypatch.setenv("PDSERVE_CPU_OWN_GEMM", "0")                  # oneDNN's prepacked weight
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
    monkeypatch.setenv("PDSERVE_CPU_OWN_GEMM", "0")
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

    monkeypatch.setenv("PDSERVE_CPU_OWN_GEMM", "0")                   # the library GEMMs' choice
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


@needs_own_gemm
@pytest.mark.parametrize("rows,in_features,out_features,bias", [
    (1, 576, 960, False), (5, 577, 100, True), (6, 64, 17, True), (13, 1536, 576, False), (32, 576, 3072, True),
    (97, 130, 64, False), (300, 64, 65, True), (0, 64, 64, False)])
def test_own_bf16_gemm_matches_fp32_and_onednn(rows, in_features, out_features, bias):
    """pdserve's bf16 GEMM (kernels/csrc/bf16_gemm.cpp) against the fp32 product of the same bf16
    values rounded once (its reference) and oneDNN's bf16 GEMM: every row-block size (1-6 rows and
    their mixes), odd input features, outputs not a multiple of its 64-column panels, bias."""
    g = torch.Generator().manual_seed(rows + in_features)
    w = torch.randn(out_features, in_features, generator=g).bfloat16()
    b = torch.randn(out_features, generator=g).bfloat16() if bias else None
    x = torch.randn(rows, in_features, generator=g).bfloat16()
    out = OwnPanels(w).matmul(x, b)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
    exact = F.linear(x.float(), w.float(), None if b is None else b.float())
    # fp32 sums in another order than the reference's, then one rounding to bf16: within a bf16 ulp
    torch.testing.assert_close(out.float(), exact, rtol=8e-3, atol=1e-2)
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=8e-3, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_own_gemm_does_not_depend_on_the_thread_count(dtype):
    """The own GEMMs' units go to threads as shares a thread done with its own may take from
    (kernels/csrc/work_split.h run_shares_stealing): with 1, 2 and 7 threads (more than the cores, so
    shares are taken from descheduled threads) every output is the same bits, the fused silu too."""
    if not cpu_gemm.own_gemm_built(dtype):
        pytest.skip(f"the own GEMM for {dtype} needs "
                    f"{'AVX512-BF16' if dtype == torch.bfloat16 else 'AVX2 or AVX-512 with FMA'}")
    g = torch.Generator().manual_seed(3)
    panels = OwnPanels(torch.randn(2 * 640, 576, generator=g).to(dtype), gate_up=True)
    x = torch.randn(300, 576, generator=g).to(dtype)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 7):
            torch.set_num_threads(n)
            outs.append((panels.matmul(x), panels.matmul_silu(x)))
    finally:
        torch.set_num_threads(threads)
    for plain, fused in outs[1:]:
        assert torch.equal(plain, outs[0][0]) and torch.equal(fused, outs[0][1])


@needs_own_gemm
def test_own_bf16_gemm_rows_do_not_depend_on_their_batch():
    """Each output is one sum in one order whatever the rows beside it, their block or their thread:
    a row alone, in a batch of 7 and in one of 200 (3-D, from a strided view) gives the same bits."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(200, 1536, generator=g).bfloat16()
    panels = OwnPanels(w)
    x = torch.randn(200, 1536, generator=g).bfloat16()
    whole = panels.matmul(x[::1].view(8, 25, 1536))
    assert whole.shape == (8, 25, 200)
    assert torch.equal(panels.matmul(x[:7]), whole.view(200, 200)[:7])
    assert torch.equal(panels.matmul(x[3:4]), whole.view(200, 200)[3:4])
    strided = torch.randn(200, 3000, generator=g).bfloat16()[:, :1536]
    assert torch.equal(panels.matmul(strided), panels.matmul(strided.contiguous()))


OWN_DTYPES = [pytest.param(torch.bfloat16, marks=needs_own_gemm), pytest.param(torch.float32, marks=needs_own_f32_gemm)]


@pytest.mark.parametrize("dtype", OWN_DTYPES)
@pytest.mark.parametrize("rows,in_features,inter,bias", [
    (1, 576, 1536, False), (5, 577, 96, True), (13, 64, 32, True), (200, 130, 64, False), (0, 64, 32, False)])
def test_own_gemm_fuses_silu_and_mul(dtype, rows, in_features, inter, bias):
    """bf16_linear_silu and f32_linear_silu (kernels/csrc/bf16_gemm.cpp, f32_gemm.cpp) are the product
    of a [gate | up] weight then silu_and_mul, bit for bit, without the product: every row-block size,
    odd input features, bias; gate and up halves that are not a multiple of a panel's columns. The
    panels of a [gate | up] weight interleave its halves; their plain product is still the weight's,
    columns in order, bias included."""
    g = torch.Generator().manual_seed(rows + inter)
    w = (torch.randn(2 * inter, in_features, generator=g) * 0.1).to(dtype)
    b = torch.randn(2 * inter, generator=g).to(dtype) if bias else None
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    panels, plain = OwnPanels(w, gate_up=True), OwnPanels(w)
    assert panels.fuses_silu and not plain.fuses_silu
    product = plain.matmul(x, b)
    assert torch.equal(panels.matmul(x, b), product)
    out = panels.matmul_silu(x, b)
    assert out.shape == (rows, inter) and torch.equal(out, cpu_ops.silu_and_mul(product))
    odd = OwnPanels(w[:2 * inter - 2], gate_up=True)
    assert not odd.fuses_silu
    fused = torch.ops.pdserve_cpu.bf16_linear_silu if dtype == torch.bfloat16 else torch.ops.pdserve_cpu.f32_linear_silu
    with pytest.raises(RuntimeError, match="inter must be a multiple of"):
        fused(x, odd.panels, inter - 1, None)


@pytest.mark.parametrize("dtype", OWN_DTYPES)
def test_gate_up_layer_takes_the_fused_silu_where_it_can(monkeypatch, dtype):
    """MergedColumnParallelLinear.silu_and_mul (LlamaMLP's): the fused pass on the own GEMM's panels,
    the two passes with LoRA or (bf16, many rows) where fp32 GEMM takes them; the same bits either
    way, and in its decode-plan form."""
    monkeypatch.setenv("PDSERVE_CPU_OWN_GEMM", "1")
    for module in (cpu_gemm, linear_layers):
        monkeypatch.setattr(module, "cpu_fp32_gemm", lambda dtype: False)
    layer = MergedColumnParallelLinear(64, [96, 96], bias=True, dtype=dtype, swiglu=True)
    g = torch.Generator().manual_seed(3)
    layer.weight.data.copy_(torch.randn(192, 64, generator=g))
    layer.bias.data.copy_(torch.randn(192, generator=g))
    layer.process_weights_after_loading()
    x = torch.randn(7, 64, generator=g).to(dtype)
    two = cpu_ops.silu_and_mul(layer(x))
    calls = []
    real = OwnPanels.matmul_silu
    monkeypatch.setattr(OwnPanels, "matmul_silu", lambda self, *a, **kw: calls.append(1) or real(self, *a, **kw))
    assert torch.equal(layer.silu_and_mul(x), two) and torch.equal(layer.silu_rows_matmul()(x), two)
    assert len(calls) == 2
    monkeypatch.setattr(cpu_gemm, "cpu_fp32_gemm", lambda dtype: True)      # bf16: many rows take fp32 GEMM
    many = torch.randn(200, 64, generator=g).to(dtype)
    assert torch.equal(layer.silu_and_mul(many), cpu_ops.silu_and_mul(layer(many)))
    assert len(calls) == (2 if dtype == torch.bfloat16 else 3)             # fp32 panels take every size
    assert torch.equal(layer.silu_and_mul(x), two) and len(calls) == (3 if dtype == torch.bfloat16 else 4)
    layer.lora = object()                                                   # an adapter's sum goes before the silu
    monkeypatch.setattr(MergedColumnParallelLinear, "forward", lambda self, x: self.matmul(x, self.bias))
    assert torch.equal(layer.silu_and_mul(x), two) and len(calls) == (3 if dtype == torch.bfloat16 else 4)


@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, marks=needs_own_gemm),
                                   pytest.param(torch.float32, marks=needs_own_f32_gemm)])
def test_own_gemm_is_what_linear_takes_where_chosen(monkeypatch, dtype):
    """With PDSERVE_CPU_OWN_GEMM=1 a bf16 or fp32 weight is prepacked in the own GEMM's panels and
    linear() multiplies by them at every row count (bf16 prefill-sized batches too, unless fp32 GEMM
    is chosen); with 0, oneDNN's copy (or none); fp16 weights stay oneDNN's."""
    g = torch.Generator().manual_seed(2)
    w, b = torch.randn(96, 64, generator=g).to(dtype), torch.randn(96, generator=g).to(dtype)
    x = torch.randn(CPU_FP32_MIN_ROWS + 5, 64, generator=g).to(dtype)
    monkeypatch.setenv("PDSERVE_CPU_OWN_GEMM", "1")
    monkeypatch.setenv("PDSERVE_CPU_FP32_GEMM", "0")
    packed = prepack(w)
    assert type(packed) is OwnPanels
    calls = []
    real = OwnPanels.matmul
    monkeypatch.setattr(OwnPanels, "matmul", lambda self, *a: calls.append(a[0].shape[0]) or real(self, *a))
    for rows in (1, 7, x.shape[0]):
        assert torch.equal(linear(x[:rows], w, b, packed), real(packed, x[:rows], b))
    assert calls == [1, 7, x.shape[0]]
    assert packed_linear(x[:2], packed).shape == (2, 96)
    layer = Linear(64, 96, dtype=dtype)
    layer.weight.data.copy_(w)
    layer.process_weights_after_loading()
    assert type(layer.packed) is OwnPanels and torch.equal(layer(x[:3]), real(packed, x[:3]))
    monkeypatch.setenv("PDSERVE_CPU_OWN_GEMM", "0")
    assert type(prepack(w)) is not OwnPanels
    assert type(prepack(w.half())) is not OwnPanels


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_own_gemm_auto_decides_once(monkeypatch, dtype):
    """auto decides once per process and dtype, and only where the kernel is built; 0 keeps the library's."""
    monkeypatch.setenv("PDSERVE_CPU_OWN_GEMM", "auto")
    chosen = own_gemm(dtype)
    assert isinstance(chosen, bool) and own_gemm(dtype) is chosen
    if not cpu_gemm.own_gemm_built(dtype):
        assert chosen is False
    monkeypatch.setenv("PDSERVE_CPU_OWN_GEMM", "0")
    assert own_gemm(dtype) is False


def test_own_bf16_gemm_choice(monkeypatch):
    """1 where the bf16 kernel cannot run is a clear error, auto there keeps oneDNN's; a bad value names
    the allowed ones."""
    monkeypatch.setattr(cpu_gemm, "cpu_flags", lambda: {"avx2", "fma", "f16c"})   # an AVX2-only CPU
    for value in ("auto", "1"):
        monkeypatch.setenv("PDSERVE_CPU_OWN_GEMM", value)
        if value == "auto":
            assert own_gemm(torch.bfloat16) is False and type(prepack(torch.randn(8, 4).bfloat16())) is not OwnPanels
        else:
            with pytest.raises(ValueError, match="PDSERVE_CPU_OWN_GEMM=1 with torch.bfloat16 weights needs a CPU "
                                                 "with AVX512-BF16"):
                own_gemm(torch.bfloat16)
    monkeypatch.setenv("PDSERVE_CPU_OWN_GEMM", "fast")
    with pytest.raises(ValueError, match="PDSERVE_CPU_OWN_GEMM must be auto, 0 or 1"):
        own_gemm(torch.bfloat16)


def test_own_gemm_old_variable_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("PDSERVE_CPU_BF16_GEMM", "1")
    with pytest.raises(ValueError, match="PDSERVE_CPU_BF16_GEMM is now PDSERVE_CPU_OWN_GEMM"):
        own_gemm(torch.float32)


@needs_own_f32_gemm
@pytest.mark.parametrize("rows,in_features,out_features,bias", [
    (1, 576, 960, False), (5, 577, 100, True), (6, 64, 17, True), (13, 1536, 576, False), (32, 576, 3072, True),
    (97, 130, 64, False), (300, 64, 65, True), (0, 64, 64, False), (11, 3, 9, True)])
def test_own_f32_gemm_matches_float64_and_f_linear(rows, in_features, out_features, bias):
    """pdserve's fp32 GEMM (kernels/csrc/f32_gemm.cpp) against the float64 product (its reference) and
    F.linear: every row-block size (1-6 rows and their even splits), odd input features, outputs not a
    multiple of its panels (16 or 64 columns), bias, fewer features than a register."""
    g = torch.Generator().manual_seed(rows + in_features)
    w = torch.randn(out_features, in_features, generator=g)
    b = torch.randn(out_features, generator=g) if bias else None
    x = torch.randn(rows, in_features, generator=g)
    out = OwnPanels(w).matmul(x, b)
    assert out.dtype == torch.float32 and out.shape == (rows, out_features)
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    # K fused multiply-adds in K order: an error of a few fp32 ulps of the sum of |products|
    bound = 4 * in_features * torch.finfo(torch.float32).eps * F.linear(x.abs().double(), w.abs().double())
    assert ((out.double() - exact).abs() <= bound + 1e-30).all()
    assert ((out.double() - F.linear(x, w, b).double()).abs() <= 2 * bound + 1e-30).all()   # as far as two such sums


@needs_own_f32_gemm
def test_own_f32_gemm_rows_do_not_depend_on_their_batch():
    """Each output is one fused multiply-add per input feature in one order whatever the rows beside
    it, their block or their thread: a row alone, in 7 and in 200 (3-D, from a strided view) gives
    the same bits."""
    g = torch.Generator().manual_seed(6)
    w = torch.randn(200, 1536, generator=g)
    panels = OwnPanels(w)
    x = torch.randn(200, 1536, generator=g)
    whole = panels.matmul(x.view(8, 25, 1536))
    assert whole.shape == (8, 25, 200)
    assert torch.equal(panels.matmul(x[:7]), whole.view(200, 200)[:7])
    assert torch.equal(panels.matmul(x[3:4]), whole.view(200, 200)[3:4])
    strided = torch.randn(200, 3000, generator=g)[:, :1536]
    assert torch.equal(panels.matmul(strided), panels.matmul(strided.contiguous()))


def test_own_f32_gemm_choice(monkeypatch):
    """1 on a CPU without FMA is a clear error, auto there keeps the library's; fp16 weights never take
    it; the panels refuse other dtypes."""
    monkeypatch.setenv("PDSERVE_CPU_OWN_GEMM", "1")
    assert own_gemm(torch.float16) is False
    monkeypatch.setattr(cpu_gemm, "cpu_flags", lambda: {"sse4_2"})                 # no AVX2 / FMA
    with pytest.raises(ValueError, match="with torch.float32 weights needs a CPU with AVX2 or AVX-512 with FMA"):
        own_gemm(torch.float32)
    monkeypatch.setenv("PDSERVE_CPU_OWN_GEMM", "auto")
    assert own_gemm(torch.float32) is False and type(prepack(torch.randn(8, 4))) is not OwnPanels
    with pytest.raises(ValueError, match="takes weights in"):
        OwnPanels(torch.randn(8, 4).half())
