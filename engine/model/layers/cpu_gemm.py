"""CPU GEMM paths for the linear layers: `linear()` is `F.linear` with the faster of exact-enough
paths, chosen by the number of rows and by what this CPU was timed to do faster (once per process):
prepacked weights (`prepack`, `packed_linear`) for oneDNN's GEMM or for pdserve's own (`own_gemm`:
bf16 on a CPU with AVX512-BF16, kernels/csrc/bf16_gemm.cpp; fp32 on one with AVX2 or AVX-512 FMA,
kernels/csrc/f32_gemm.cpp), and fp32 GEMM on upcast operands for prefill-sized bf16/fp16 batches
(`cpu_fp32_gemm`). benchmarks/cpu_linear.py prints the sides.
"""
from __future__ import annotations

import functools
import logging
import os
import time

import torch
import torch.nn.functional as F

from kernels import cpu_ops
from kernels.cpu_ops import has_amx
from kernels.dispatch import kernels_for
from records.cpu_flags import cpu_flags

logger = logging.getLogger(__name__)

# At or above this many rows, a bf16/fp16 matmul on CPU may run as fp32 GEMM on upcast operands:
# below ~64 rows the weight upcast costs more than a faster GEMM could save.
CPU_FP32_MIN_ROWS = 96


# fp32 GEMM is chosen only where it beats the reduced-precision GEMM by this factor at prefill size,
# so that timing noise cannot flip the choice between runs on one machine.
CPU_FP32_MIN_SPEEDUP = 1.25


# fp32 weights: oneDNN's prepacked GEMM is used from this many rows on, unless this CPU runs it
# faster than MKL's sgemm at one row too (`fp32_packed_min_rows`): on the CPUs first measured MKL was
# faster below it (oneDNN 0.5-0.8x at one row, docs/perf/journal.md §7); on a first-generation EPYC
# (Zen 1) oneDNN is 1.2-1.4x sgemm at one row and 2.3x at four (§9c, §7j).
CPU_FP32_PACKED_MIN_ROWS = 8


# ... and the factor by which oneDNN must beat sgemm at one or two rows. Lower than
# CPU_FP32_MIN_SPEEDUP: both GEMMs are fp32, so where they are close either choice is as good, and on
# the Zen 1 this timing measured 1.20-1.26x in six processes, which 1.25 split at random between a
# 51.5 and a 59.9 ms batch-1 step of the embedded model.
CPU_FP32_ROWS_MIN_SPEEDUP = 1.1


# pdserve's own GEMM replaces the path linear() took before where this CPU runs it at least this fast,
# relative to that path, at a decode step's size (32 rows, weights streamed from memory as a model's
# are: bf16 1.2-1.4x oneDNN's on a Zen 5 EPYC, docs/perf/journal.md §45; fp32 1.1-1.4x on a Zen 3,
# §46) and at least CPU_OWN_GEMM_PREFILL_MIN_RATIO as fast at a prefill's (256 rows: bf16 1.03-1.08x,
# fp32 1.1-1.2x there with weights cycled; the timing's one cache-hot fp32 weight measured 0.95-0.99x).
# The timing is a median of back-to-back pairs (`_median_ratio`), which noise does not move far, so
# these bounds are not margins against noise: a bound of 1.1 at 32 rows, against a median of 1.13 in
# a replica timed beside an idle server, chose oneDNN's in replicas started beside a loading one (§46).
CPU_OWN_GEMM_MIN_SPEEDUP = 1.0
CPU_OWN_GEMM_PREFILL_MIN_RATIO = 0.9


class OwnPanels:
    """A weight [out_features, in_features] packed for pdserve's own GEMM, which `packed_linear`
    multiplies by: bf16 in bf16_gemm.cpp's panels (64 output columns, K in pairs), fp32 in
    f32_gemm.cpp's (16 columns with AVX2, 64 with AVX-512). What `prepack` returns where
    `own_gemm(weight.dtype)`. A [gate | up] weight (`gate_up`) whose halves are whole half-panels is
    packed with its rows interleaved by half a panel (`interleave_halves`), so that the fused SwiGLU
    (`matmul_silu`) streams each panel whole; `matmul` still returns the columns in the weight's order."""

    __slots__ = ("panels", "out_features", "half", "_linear", "_linear_silu")

    def __init__(self, weight: torch.Tensor, gate_up: bool = False) -> None:
        ops = torch.ops.pdserve_cpu
        if weight.dtype not in OWN_GEMM_DTYPES:
            raise ValueError(f"pdserve's own CPU GEMM takes weights in {OWN_GEMM_DTYPES}; got {weight.dtype}")
        pack, self._linear, self._linear_silu = (
            (ops.bf16_pack, ops.bf16_linear, ops.bf16_linear_silu) if weight.dtype == torch.bfloat16
            else (ops.f32_pack, ops.f32_linear, ops.f32_linear_silu))
        weight = weight.detach()
        self.out_features = weight.shape[0]
        width = pack(weight[:1, :2]).shape[2]                  # the panels' columns on this CPU
        # Half a panel where the gate and up rows interleave in the panels, else 0.
        self.half = width // 2 if gate_up and self.out_features % width == 0 else 0
        self.panels = pack(interleave_halves(weight, self.half) if self.half else weight)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if not self.half:
            return self._linear(x, self.panels, self.out_features, bias)
        # Interleaved panels: the bias goes with its columns (so that it is added before the one
        # rounding, as in the plain product), the output's columns back in the weight's order.
        b = None if bias is None else interleave_halves(bias, self.half)
        out = self._linear(x, self.panels, self.out_features, b)
        return out.unflatten(-1, (-1, 2, self.half)).transpose(-3, -2).reshape(out.shape)

    @property
    def fuses_silu(self) -> bool:
        """Whether `matmul_silu` takes these panels: those of a [gate | up] weight packed as one
        (`gate_up`) whose halves are whole half-panels (the fused kernels' blocks are half a panel of
        gate columns and their up columns: 32 and 32 in bf16, 8 and 8 in fp32 with AVX2, 32 and 32 with
        AVX-512)."""
        return self.half > 0

    def matmul_silu(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """silu_and_mul(self.matmul(x, bias)) bit for bit, for a [gate | up] weight (`fuses_silu`),
        in one pass that never writes the product (kernels/csrc/bf16_gemm.cpp: bf16_linear_silu;
        f32_gemm.cpp: f32_linear_silu)."""
        return self._linear_silu(x, self.panels, self.out_features // 2, bias)


def interleave_halves(t: torch.Tensor, half: int) -> torch.Tensor:
    """A [gate | up] tensor's rows (dim 0: 2 x inter) as blocks of `half` gate rows then the same
    `half` up rows: the order the fused SwiGLU kernels' panels hold them in."""
    return t.unflatten(0, (2, -1, half)).transpose(0, 1).reshape(t.shape)


# The weight dtypes pdserve's own GEMM has a kernel for (fp16 weights keep oneDNN's).
OWN_GEMM_DTYPES = (torch.bfloat16, torch.float32)

# What `prepack` returns and `linear()` takes: oneDNN's blocked tensor, or the own GEMM's panels.
Packed = torch.Tensor | OwnPanels


def own_gemm(dtype: torch.dtype) -> bool:
    """Whether CPU linears with `dtype` weights run pdserve's own GEMM instead of oneDNN's or MKL's.

    `PDSERVE_CPU_OWN_GEMM=auto|0|1` (default auto). auto: where the kernel is built for the dtype
    (`own_gemm_built`), the CPU has no AMX for it (oneDNN's AMX GEMM is several times any
    dot-product kernel), and timing once per process and dtype (~0.5 s) finds it at least
    CPU_OWN_GEMM_MIN_SPEEDUP times as fast at decode size and CPU_OWN_GEMM_PREFILL_MIN_RATIO at
    prefill size. 1 forces it (an error where it is not built), 0 keeps the library GEMMs. fp16
    weights always keep oneDNN's.
    """
    if "PDSERVE_CPU_BF16_GEMM" in os.environ:
        raise ValueError("PDSERVE_CPU_BF16_GEMM is now PDSERVE_CPU_OWN_GEMM (auto, 0 or 1; it covers fp32 "
                         "weights too)")
    value = os.environ.get("PDSERVE_CPU_OWN_GEMM", "auto")
    if value not in ("auto", "0", "1"):
        raise ValueError(f"PDSERVE_CPU_OWN_GEMM must be auto, 0 or 1; got {value!r}")
    if value == "0" or dtype not in OWN_GEMM_DTYPES:
        return False
    built = own_gemm_built(dtype)
    if value == "1" and not built:
        need = "AVX512-BF16" if dtype == torch.bfloat16 else "AVX2 or AVX-512 with FMA"
        raise ValueError(f"PDSERVE_CPU_OWN_GEMM=1 with {dtype} weights needs a CPU with {need} and the C++ CPU "
                         "kernels as the kernel set (PDSERVE_KERNELS auto or cpu); here one of the two is missing")
    return built and (value == "1" or (not has_amx(dtype) and _own_gemm_is_faster(dtype)))


def own_gemm_built(dtype: torch.dtype) -> bool:
    """Whether pdserve's own GEMM for `dtype` weights can run here: the C++ CPU kernels are the kernel
    set and the CPU has AVX512-BF16 (bf16) or fused multiply-adds on AVX2 or AVX-512 (fp32)."""
    if dtype not in OWN_GEMM_DTYPES or kernels_for(torch.empty(0)) is not cpu_ops:
        return False
    flags = cpu_flags()
    if dtype == torch.bfloat16:
        return "avx512_bf16" in flags
    return "fma" in flags and ("avx2" in flags or "avx512f" in flags)


@functools.cache
def _own_gemm_is_faster(dtype: torch.dtype) -> bool:
    """CPU_OWN_GEMM_MIN_SPEEDUP at 32 rows on weights cycled from memory (28 MB, as a model's stream
    by), and CPU_OWN_GEMM_PREFILL_MIN_RATIO at 256 rows, against the library GEMM `linear()` takes
    without it at those sizes (oneDNN's prepacked weight, or MKL's sgemm where oneDNN has no path or
    was timed slower): the median ratio of back-to-back pairs (`_median_ratio`), with one thread
    (another process on the other core then slows neither side's barrier), ~0.5 s (every engine
    replica pays it once at load: the Ray test lane starts ~100). Not through `linear()` itself: for
    bf16 at 256 rows that asks `cpu_fp32_gemm`, whose timing asks `prepack`, which asks this."""
    g = torch.Generator().manual_seed(0)
    cycled = 32 // dtype.itemsize                  # 28 MB of a small model's MLP projections
    weights = [torch.randn(1536, 576, generator=g).to(dtype) for _ in range(cycled)]
    theirs_packed = [_library_prepack(w) for w in weights]
    own = [OwnPanels(w) for w in weights]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    ratios = []
    try:
        for rows, count, least in ((32, cycled, CPU_OWN_GEMM_MIN_SPEEDUP), (256, 1, CPU_OWN_GEMM_PREFILL_MIN_RATIO)):
            x = torch.randn(rows, 576, generator=g).to(dtype)
            ratios.append(_median_ratio(
                lambda x=x, count=count: [F.linear(x, w) if p is None else packed_linear(x, p)
                                          for w, p in zip(weights[:count], theirs_packed[:count])],
                lambda x=x, count=count: [p.matmul(x) for p in own[:count]], pairs=5))
            if ratios[-1] < least:
                break
    finally:
        torch.set_num_threads(threads)
    faster = len(ratios) == 2 and ratios[-1] >= CPU_OWN_GEMM_PREFILL_MIN_RATIO
    # Said once per process: a replica timed while other processes load beside it may choose
    # otherwise than an idle one (docs/perf/journal.md §46, §55), and this is where that shows.
    logger.info("CPU GEMM for %s weights: %s (the library's time over the own GEMM's at 32, then 256 rows: %s)",
                dtype, "pdserve's own" if faster else "the library's", ", ".join(f"{r:.2f}" for r in ratios))
    return faster


def _median_ratio(theirs, ours, pairs: int) -> float:
    """The median over `pairs` back-to-back timings of the two functions (which runs first alternating)
    of theirs' time over ours'. Each pair meets one moment's load: where the server's other processes
    start beside a replica's load, bursts that would decide a best-of-each between the two land on
    both halves of a pair or skew one pair of the median (a best-of-each chose the own fp32 GEMM in
    an idle process and oneDNN's in every served replica on a Zen 3 EPYC, docs/perf/journal.md §46)."""
    def timed(fn) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    theirs()
    ours()
    ratios = []
    for i in range(pairs):
        if i % 2:
            ours_s = timed(ours)
            ratios.append(timed(theirs) / ours_s)
        else:
            theirs_s = timed(theirs)
            ratios.append(theirs_s / timed(ours))
    return sorted(ratios)[pairs // 2]


def cpu_fp32_gemm(dtype: torch.dtype) -> bool:
    """Whether prefill-sized (>= CPU_FP32_MIN_ROWS rows) CPU matmuls with `dtype` weights run in fp32.

    `PDSERVE_CPU_FP32_GEMM=1|0` forces the choice; the default `auto` times both once per process
    and dtype (~0.3 s), except on CPUs with AMX for the dtype, where the reduced-precision GEMM
    always wins. CPUs differ by 2-3x in opposite directions here: on the Xeons with AVX512-BF16 but
    no AMX, oneDNN's bf16 brgemm reaches ~150 GFLOP/s against ~270 for MKL's sgemm, while on AMD
    Zen 4 bf16 is ~3x faster than sgemm, and with AMX-BF16 2.5x faster at prefill sizes
    (benchmarks/cpu_linear.py prints both).
    """
    value = os.environ.get("PDSERVE_CPU_FP32_GEMM", "auto")
    if value not in ("auto", "0", "1"):
        raise ValueError(f"PDSERVE_CPU_FP32_GEMM must be auto, 0 or 1; got {value!r}")
    return value == "1" or (value == "auto" and _fp32_gemm_is_faster(dtype))


@functools.cache
def _fp32_gemm_is_faster(dtype: torch.dtype) -> bool:
    if has_amx(dtype):
        # oneDNN's AMX GEMM in bf16/fp16 is several times any fp32 GEMM on the same cores: timing
        # is not needed, and a timing taken while other processes start (a server beside another)
        # once picked fp32 here and made every prefill 2.5x slower (docs/perf/journal.md §7h).
        return False
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(1536, 576, generator=g).to(dtype)        # a small model's MLP projection
    x = torch.randn(256, 576, generator=g).to(dtype)
    packed = prepack(weight)

    def native() -> None:
        if packed is None:
            F.linear(x, weight)
        else:
            packed_linear(x, packed)

    def fp32() -> None:
        F.linear(x.float(), weight.float()).to(dtype)

    native_s, fp32_s = _best_alternating(native, fp32, rounds=3)
    faster = native_s > CPU_FP32_MIN_SPEEDUP * fp32_s
    logger.info("CPU GEMM for prefill-sized %s batches: %s (its own GEMM's time over fp32's: %.2f)", dtype,
                "fp32 on upcast operands" if faster else "in its own dtype", native_s / fp32_s)
    return faster


def _best_alternating(first, second, rounds: int) -> tuple[float, float]:
    """Each function's best `_best_of` over `rounds` rounds that alternate the two, so that a burst
    of load elsewhere (another process starting) cannot decide between them."""
    first_s = second_s = float("inf")
    for _ in range(rounds):
        first_s = min(first_s, _best_of(first))
        second_s = min(second_s, _best_of(second))
    return first_s, second_s


def _best_of(fn, rounds: int = 5, calls: int = 3) -> float:
    """Fastest of `rounds` timings of `calls` calls each, after one warm-up call."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, time.perf_counter() - start)
    return best


def cpu_prepack_enabled() -> bool:
    """Whether CPU linears keep a oneDNN-prepacked copy of their weights (`PDSERVE_CPU_PREPACK`,
    default on): 1.2-1.7x faster few-row (decode) bf16 matmuls, 1.5-3.3x fp32 ones where oneDNN
    beats MKL, for twice the linear weights' memory."""
    value = os.environ.get("PDSERVE_CPU_PREPACK", "1")
    if value not in ("0", "1"):
        raise ValueError(f"PDSERVE_CPU_PREPACK must be 0 or 1; got {value!r}")
    return value == "1"


def prepack(weight: torch.Tensor, gate_up: bool = False) -> Packed | None:
    """A packed copy of a CPU weight for `linear()`, or None where it does not apply: bf16 and fp32
    weights in pdserve's own GEMM's panels where `own_gemm(weight.dtype)` (a [gate | up] weight, for
    the fused SwiGLU: `OwnPanels`' gate_up); else a oneDNN-blocked copy (`_library_prepack`)."""
    if (weight.device.type != "cpu" or weight.dtype not in (torch.bfloat16, torch.float16, torch.float32)
            or not cpu_prepack_enabled()):
        return None
    if own_gemm(weight.dtype):
        return OwnPanels(weight, gate_up)
    return _library_prepack(weight)


def _library_prepack(weight: torch.Tensor) -> torch.Tensor | None:
    """A oneDNN-blocked copy of a CPU weight: bf16 and fp16 weights always (where oneDNN has the path),
    fp32 weights where this CPU runs oneDNN's prepacked fp32 GEMM faster than F.linear
    (`_fp32_prepack_pays`); else None (F.linear, MKL's GEMM)."""
    if not torch.backends.mkldnn.is_available():
        return None
    if weight.dtype == torch.float32 and not _fp32_prepack_pays():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach())
    except RuntimeError:     # oneDNN's bf16/fp16 path needs AVX-512 or AVX-NE-CONVERT: F.linear then
        return None


@functools.cache
def _fp32_prepack_pays() -> bool:
    """Whether oneDNN's prepacked fp32 GEMM beats F.linear (MKL's sgemm) on this CPU by
    CPU_FP32_MIN_SPEEDUP at decode sizes (timed once per process, ~0.1 s). It does by 1.5-3.3x on an
    AVX2-only EPYC (docs/perf/journal.md §7); CPUs differ, so it is measured, not assumed."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(1536, 576, generator=g)                  # a small model's MLP projection
    x = torch.randn(16, 576, generator=g)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight)
    except RuntimeError:
        return False
    sgemm, onednn = _best_alternating(lambda: F.linear(x, weight), lambda: packed_linear(x, packed), rounds=4)
    return sgemm > CPU_FP32_MIN_SPEEDUP * onednn


@functools.cache
def fp32_packed_min_rows() -> int:
    """From how many rows an fp32 linear with a prepacked weight takes oneDNN's GEMM: the fewest of
    1 and 2 rows at which this CPU runs it CPU_FP32_ROWS_MIN_SPEEDUP times faster than F.linear (MKL's
    sgemm), else CPU_FP32_PACKED_MIN_ROWS. Timed once per process (~0.3 s), alternating, on weights
    cycled from memory as a model's are (cache-hot, the order differs: on a Zen 1 EPYC sgemm was
    1.15x oneDNN at one row hot and 0.7x from memory)."""
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(1536, 576, generator=g) for _ in range(8)]     # 28 MB: more than a CPU's L3 slice
    try:
        packed = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights]
    except RuntimeError:
        return CPU_FP32_PACKED_MIN_ROWS
    for rows in (1, 2):
        x = torch.randn(rows, 576, generator=g)
        sgemm, onednn = _best_alternating(lambda x=x: [F.linear(x, w) for w in weights],
                                          lambda x=x: [packed_linear(x, p) for p in packed], rounds=2)
        if sgemm > CPU_FP32_ROWS_MIN_SPEEDUP * onednn:
            return rows
    return CPU_FP32_PACKED_MIN_ROWS


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: Packed | None = None) -> torch.Tensor:
    """`F.linear`, with faster CPU paths.

    fp32 with the own GEMM's panels: that GEMM (one fused multiply-add per K step, in K order, whatever
    the batch). fp32 with oneDNN's prepacked weight (where `prepack` found it faster) and at least
    `fp32_packed_min_rows()` rows: oneDNN's GEMM instead of MKL's sgemm, the same products summed in
    another order. bf16/fp16: many rows (prefill) on a CPU where
    `cpu_fp32_gemm` finds it faster: fp32 GEMM on upcast operands, rounded back to x's dtype.
    Products of bf16 values are exact in fp32 and oneDNN's bf16 GEMM accumulates in fp32 too, so the
    two differ only in summation order. Otherwise the prepacked weight: pdserve's own bf16 GEMM (fp32
    sums of bf16 pair products as oneDNN's, in one order over K whatever the batch; on a Zen 5 EPYC
    99.97-100% of its outputs equal oneDNN's), or the same oneDNN kernel as F.linear without
    reordering the weight on every call (bit-identical to F.linear).
    """
    if x.device.type != "cpu":
        return F.linear(x, weight, bias)
    if x.dtype == torch.float32:
        if type(packed) is OwnPanels:
            return packed.matmul(x, bias)
        if packed is None or x.numel() < fp32_packed_min_rows() * x.shape[-1]:
            return F.linear(x, weight, bias)
        return packed_linear(x, packed, bias)
    if fp32_takes(x.dtype, x.numel() // max(1, x.shape[-1])):
        b = None if bias is None else bias.float()
        return F.linear(x.float(), weight.float(), b).to(x.dtype)
    if packed is not None:
        return packed_linear(x, packed, bias)
    return F.linear(x, weight, bias)


def linear_silu(x: torch.Tensor, bias: torch.Tensor | None, packed: Packed | None) -> torch.Tensor | None:
    """silu_and_mul(linear(x, weight, bias, packed)) for a [gate | up] weight, in one pass where
    linear() would take pdserve's own GEMM and its panels fuse the silu (`OwnPanels.matmul_silu`: the
    same bits, without the [rows, 2 inter] product written and read back; perf/journal.md §55); None
    where they would not (the caller takes the two passes)."""
    if x.device.type != "cpu" or not silu_fusable(packed, x.dtype, x.numel() // max(1, x.shape[-1])):
        return None
    return packed.matmul_silu(x, bias)                      # type: ignore[union-attr]


def silu_fusable(packed: Packed | None, dtype: torch.dtype, rows: int | None = None) -> bool:
    """Whether `linear_silu` takes these panels for `rows` rows of `dtype` x (None: for every number)."""
    if type(packed) is not OwnPanels or not packed.fuses_silu or packed.panels.dtype != dtype:
        return False
    if dtype == torch.float32:                              # linear() takes fp32 panels at every size
        return True
    return not (cpu_fp32_gemm(dtype) if rows is None else fp32_takes(dtype, rows))


def fp32_takes(dtype: torch.dtype, rows: int) -> bool:
    """Whether linear() multiplies `rows` rows of bf16/fp16 x as fp32 GEMM on upcast operands."""
    return rows >= CPU_FP32_MIN_ROWS and cpu_fp32_gemm(dtype)


def packed_linear(x: torch.Tensor, packed: Packed, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b with a weight from `prepack` (oneDNN's: bf16/fp16 bit-identical to F.linear)."""
    if type(packed) is OwnPanels:
        return packed.matmul(x, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
