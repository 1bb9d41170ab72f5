"""The compiled CPU kernel set: the contracts of kernels.reference, with decode and prefill attention,
RMSNorm, rotary, silu-and-mul and the K/V slot write as C++ kernels (kernels/csrc/: cpu_ops.cpp,
prefill_attention.cpp, and common.h for what they share). The library also holds the GGUF, LoRA and
MoE kernels and a bf16 GEMM on AVX512-BF16's dot products (bf16_gemm.cpp, which
engine/model/layers/cpu_gemm.py chooses over oneDNN's where it times faster).

The reference gathers every sequence's blocks into a padded copy and runs SDPA over it; the C++
decode kernel instead walks each sequence's own blocks once (K and V of all heads of a token are one
contiguous row; each chunk of rows is copied in token order to a per-thread buffer, so the cache
is read front to back), with an online softmax, and sequences (or, for a small batch, token ranges
of each) spread over ATen's threads. On the 2-core CI machine that is 2-5x faster per layer than
the reference (benchmarks/cpu_attention.py). The prefill kernel is flash attention over the paged
cache: tiles of sixteen query positions held one lane per position, so the scores and the online
softmax are plain vector FMAs and elementwise ops; 1.6-2.9x faster per layer than the reference
here, at 115-160 GFLOP/s for prompts of 256-512 tokens. Its FMAs are fp32, except for bf16 on a CPU
with AVX512-BF16, where the same tiles run on its bf16 dot products (1.7-1.9x; docs/kernels.md;
`PDSERVE_CPU_BF16_DOT=0` forces the fp32 kernel), and on a CPU with AMX-BF16 on its tiles
(`amx_prefill`: 1.1-2x SDPA's AMX flash kernel there). Other bf16/fp16 segments long enough go to
SDPA on an AMX CPU, where its matmuls run on the tiles (`sdpa_segments`). The
elementwise layers are one pass each where torch runs 3-10 ops (and Python dispatches each),
following the reference's arithmetic op by op. Block copies and swaps stay with the reference (plain copies).

The extension (`kernels/cpu_extension.py`: its sources, build, cache and load) is compiled on first
use; where it cannot be built, kernels.dispatch falls back to the reference and says why.
"""
from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels import reference
from kernels.cpu_extension import BuildError, build, library_path, load  # noqa: F401 (reached through the set)
from kernels.gguf_format import GGUF_BLOCK_BYTES
from kernels.reference import (
    FP8_DTYPE,
    copy_blocks,
    dequantize_kv,
    fp8_linear_scaled_mm,
    gather_blocks,
    gather_kv,
    pack_gguf,
    quantize_kv_rows,
    swap_blocks,
    unpack_gguf,
)
from records.cpu_flags import cpu_flags

__all__ = ["apply_rotary", "apply_rotary_", "copy_blocks", "decode_attention", "fp8_linear", "gather_blocks",
           "gather_kv", "gguf_linear", "gguf_linear_int8", "gguf_rows_kernel", "lora_add", "pack_gguf",
           "prefill_attention", "rms_norm", "silu_and_mul", "softmax_topk", "swap_blocks", "unpack_gguf",
           "write_kv"]

# Head sizes and dtypes the C++ attention kernels are instantiated for; others run the reference.
HEAD_DIMS = (16, 32, 64, 96, 128, 256)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# With AMX, prefill segments of at least this many query rows run through SDPA where the C++ kernel
# does not run on the tiles itself (sdpa_segments): against its fp32 FMAs, at 128 rows the two are
# level, from 192 SDPA is ahead (1.4x), below 96 the C++ kernel.
SDPA_MIN_QUERY_LEN = 128



def _kernel_reads(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether the C++ attention kernels take this query and cache (else the reference runs): a head
    size and dtype they are built for, and a contiguous cache in the query's dtype or fp8."""
    return (query.shape[-1] in HEAD_DIMS and query.dtype in DTYPES and kv_cache.is_contiguous()
            and kv_cache.dtype in (query.dtype, FP8_DTYPE))


def decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, k_scale: float = 1.0, v_scale: float = 1.0,
                     window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """kernels.reference.decode_attention's contract, computed in fp32 from the paged cache directly
    (an fp8 cache's values widened as they are read, k_scale folded into the query's scale and
    v_scale into the output's normalization)."""
    if not _kernel_reads(query, kv_cache):
        return reference.decode_attention(query, kv_cache, block_tables, seq_lens, scale, k_scale, v_scale,
                                          window, softcap)
    return torch.ops.pdserve_cpu.paged_decode(query, kv_cache, block_tables, seq_lens, float(scale),
                                              float(k_scale), float(v_scale), int(window), float(softcap))


class PackedPrefill:
    """A step's prefill block tables as one padded tensor, with the lengths as tensors: built once
    per step (`pack_prefill`) and read by every layer."""

    def __init__(self, block_tables: list[torch.Tensor], query_lens: list[int], seq_lens: list[int]) -> None:
        self.tables = torch.nn.utils.rnn.pad_sequence([t.long() for t in block_tables], batch_first=True)
        self.query_lens = torch.tensor(query_lens, dtype=torch.long)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.long)


def pack_prefill(block_tables: list[torch.Tensor], query_lens: list[int], seq_lens: list[int],
                 device: torch.device) -> PackedPrefill | None:
    """kernels.reference.pack_prefill's contract."""
    return PackedPrefill(block_tables, query_lens, seq_lens) if block_tables else None


def prefill_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: list[torch.Tensor],
                      query_lens: list[int], seq_lens: list[int], scale: float,
                      packed: PackedPrefill | None = None, k_scale: float = 1.0, v_scale: float = 1.0,
                      window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """kernels.reference.prefill_attention's contract, computed from the paged cache directly (fp32
    arithmetic, or bf16 dot products into fp32 on AVX512-BF16);
    on tiles where `amx_prefill`; otherwise, on a CPU with AMX for a bf16/fp16 query, segments of
    SDPA_MIN_QUERY_LEN rows or more go to SDPA instead (see `sdpa_segments`; not for a windowed or
    soft-capped layer, which SDPA's flash kernel cannot mask or cap)."""
    if not _kernel_reads(query, kv_cache) or not block_tables:
        return reference.prefill_attention(query, kv_cache, block_tables, query_lens, seq_lens, scale, None,
                                           k_scale, v_scale, window, softcap)
    scales = (float(scale), float(k_scale), float(v_scale))
    tiles = amx_prefill(query.dtype, kv_cache.dtype, query.shape[-1])
    large = [] if window or softcap else sdpa_segments(query.dtype, query_lens, tiles)
    if not large:
        packed = packed or PackedPrefill(block_tables, query_lens, seq_lens)
        return torch.ops.pdserve_cpu.paged_prefill(query, kv_cache, packed.tables, packed.query_lens,
                                                   packed.seq_lens, *scales, int(window), float(softcap))
    _check_segments(query, kv_cache, block_tables, query_lens, seq_lens)
    out = torch.empty_like(query)
    starts = [0]
    for q_len in query_lens:
        starts.append(starts[-1] + q_len)
    rest = [i for i in range(len(query_lens)) if i not in large]
    for i in large:
        rows = slice(starts[i], starts[i + 1])
        out[rows] = _sdpa_segment(query[rows], kv_cache, block_tables[i], seq_lens[i], *scales)
    if rest:
        rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in rest])
        out[rows] = torch.ops.pdserve_cpu.paged_prefill(
            query[rows], kv_cache, torch.nn.utils.rnn.pad_sequence([block_tables[i].long() for i in rest],
                                                                   batch_first=True),
            torch.tensor([query_lens[i] for i in rest]), torch.tensor([seq_lens[i] for i in rest]), *scales, 0, 0.0)
    return out


def sdpa_segments(dtype: torch.dtype, query_lens: list[int], kernel_on_tiles: bool = False) -> list[int]:
    """The prefill segments that run through torch's SDPA rather than the C++ kernel: those of at
    least SDPA_MIN_QUERY_LEN rows, on a CPU with AMX for a bf16/fp16 dtype. There SDPA's flash
    kernel does its two matmuls on AMX tiles (oneDNN brgemm) and is 1.4-2x the C++ kernel, whose
    FMAs are fp32 AVX-512 (benchmarks/cpu_attention.py); without AMX its bf16 path is slower than
    the C++ kernel, and for short segments its per-call cost is (docs/perf/journal.md §7i).
    None where the C++ kernel itself runs on the tiles (`kernel_on_tiles`: `amx_prefill`).
    `PDSERVE_CPU_PREFILL_SDPA=auto|0|1` overrides the CPU check (0: never; 1: as with AMX, and
    whether or not the kernel runs on tiles)."""
    value = os.environ.get("PDSERVE_CPU_PREFILL_SDPA", "auto")
    if value not in ("auto", "0", "1"):
        raise ValueError(f"PDSERVE_CPU_PREFILL_SDPA must be auto, 0 or 1; got {value!r}")
    if dtype == torch.float32 or value == "0" or (value == "auto" and (kernel_on_tiles or not has_amx(dtype))):
        return []
    return [i for i, q_len in enumerate(query_lens) if q_len >= SDPA_MIN_QUERY_LEN]


def _check_segments(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: list[torch.Tensor],
                    query_lens: list[int], seq_lens: list[int]) -> None:
    """The C++ kernel's checks of the segments, for the path that leaves some of them to SDPA."""
    if sum(query_lens) != query.shape[0]:
        raise RuntimeError(f"prefill_attention: query_lens sum to {sum(query_lens)} but query has "
                           f"{query.shape[0]} rows")
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    for i, (table, q_len, seq_len) in enumerate(zip(block_tables, query_lens, seq_lens)):
        if not 0 <= q_len <= seq_len:
            raise RuntimeError(f"prefill_attention: query_len {q_len} of segment {i} must be in [0, seq_len "
                               f"{seq_len}]")
        used = table[:-(-seq_len // block_size)]
        if len(used) * block_size < seq_len:
            raise RuntimeError(f"prefill_attention: segment {i} needs more blocks than the block table holds")
        if len(used) and not (0 <= int(used.min()) and int(used.max()) < num_blocks):
            raise RuntimeError(f"prefill_attention: segment {i}'s block table points outside the pool")


def _sdpa_segment(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
                  scale: float, k_scale: float, v_scale: float) -> torch.Tensor:
    """One segment's causal attention by SDPA over its K/V gathered from the paged cache, in the
    query's dtype: query [q_len, H, D] holds the last q_len of seq_len positions."""
    q_len = query.shape[0]
    k, v = gather_kv(kv_cache, block_table, seq_len)              # [seq_len, kvh, d]
    k, v = dequantize_kv(k, k_scale, query.dtype), dequantize_kv(v, v_scale, query.dtype)
    # 4-D inputs: 3-D ones fall back to SDPA's slow math kernel on CPU.
    q, k, v = query.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if q_len == seq_len:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:       # query row r sits at position seq_len - q_len + r and sees keys up to it
        mask = torch.ones(q_len, seq_len, dtype=torch.bool).tril(seq_len - q_len)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


def amx_prefill(dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the C++ prefill kernel runs this query and cache on AMX tiles: bf16 both, a head size
    a multiple of 32, a library built for a CPU with AMX-BF16 (and allowed its tiles), and neither
    `PDSERVE_CPU_AMX_ATTENTION=0` (its bf16 dot products instead) nor `PDSERVE_CPU_BF16_DOT=0` (its
    fp32 FMAs), as the kernel reads them. There it is 1.1-2x SDPA's flash kernel on the same tiles
    (docs/perf/journal.md §57), so no segment goes to SDPA."""
    return (dtype == cache_dtype == torch.bfloat16 and head_dim % 32 == 0 and _prefill_amx_built()
            and os.environ.get("PDSERVE_CPU_AMX_ATTENTION", "1") != "0"
            and os.environ.get("PDSERVE_CPU_BF16_DOT", "1") != "0")


@functools.cache
def _prefill_amx_built() -> bool:
    return bool(torch.ops.pdserve_cpu.prefill_amx_built())


@functools.cache
def has_amx(dtype: torch.dtype) -> bool:
    """Whether this CPU has AMX tiles for `dtype` (bf16: AMX-BF16; fp16: AMX-FP16)."""
    try:
        if dtype == torch.float16:
            return bool(torch.cpu._is_amx_fp16_supported())
        if dtype == torch.bfloat16:
            return bool(torch.cpu._is_amx_tile_supported()) and bool(torch.cpu._is_avx512_bf16_supported())
    except AttributeError:           # another torch
        pass
    return False


@functools.cache
def ymm_gguf_kernel() -> bool:
    """Whether the C++ GGUF kernel built here is its AVX2 form (AVX2, FMA and F16C without AVX-512:
    the library is built for this CPU, -march=native), which multiplies in fp32 on ymm registers.
    Cached: `gguf_linear` asks on every call."""
    flags = cpu_flags()
    return {"avx2", "fma", "f16c"} <= flags and "avx512f" not in flags


def gguf_dequant_min_rows() -> int:
    """From this many rows of x on, `gguf_linear` dequantizes the weight (C++) into x's dtype for a
    oneDNN GEMM; below it the C++ kernel multiplies the blocks (its time is the weight's bytes plus
    their decoding, and its per-row work grows with the rows). Measured crossings (docs/perf/journal.md §9):
    8-16 rows against oneDNN's bf16 AMX GEMM; beyond 64 rows on an AVX2-only CPU in fp32, where the
    kernel runs at the dense GEMM's own FMA rate and the dequantized copy costs a pass over memory."""
    return 64 if ymm_gguf_kernel() else 12


def gguf_dense_min_rows(dtype: torch.dtype) -> int:
    """quantization="gguf+dense": from this many rows of x on, a GGUF layer multiplies its dense
    copy (oneDNN, prepacked) in the model's `dtype` instead of its blocks. 6 where the blocks'
    kernel is the bf16-dot one (a bfloat16 model on a CPU with AVX512-BF16, docs/perf/journal.md
    §9). 12 elsewhere: a float32 dense copy is eight times the 4-bit blocks' bytes and a decode step
    streams every weight from memory, so the blocks stay faster longer. On a 2-core AVX-512 EPYC
    without BF16, embedded-model decode steps of 6, 7 and 8 rows took 92, 110 and 70 ms on the dense
    copy against 42, 49 and 56 on the blocks (level at 10; §22); on an AVX2-only CPU the ymm kernel
    is 1.2-3.6x oneDNN's prepacked fp32 GEMM up to 8 rows and level at 12 (§9). It is also where
    `gguf_dequant_min_rows` stops multiplying the blocks."""
    return 6 if dtype == torch.bfloat16 and "avx512_bf16" in cpu_flags() else 12


_GGUF_TYPE_IDS = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2}


def gguf_linear(x: torch.Tensor, blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """kernels.reference.gguf_linear's contract: the C++ kernel for few rows, else dequantize + GEMM."""
    if qtype not in GGUF_BLOCK_BYTES:
        raise ValueError(f"GGUF type must be one of {sorted(GGUF_BLOCK_BYTES)}; got {qtype!r}")
    if x.dtype not in DTYPES:
        return reference.gguf_linear(x, blocks, qtype)
    if x.shape[0] >= gguf_dequant_min_rows():
        return F.linear(x, torch.ops.pdserve_cpu.gguf_dequantize(blocks, _GGUF_TYPE_IDS[qtype], x.dtype))
    return torch.ops.pdserve_cpu.gguf_linear(x, blocks, _GGUF_TYPE_IDS[qtype])


def gguf_linear_int8(x: torch.Tensor, blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """kernels.reference.gguf_linear_int8's contract in C++ (AVX2 integer dot products, `maddubs`)
    for decode-sized batches; from `gguf_dequant_min_rows` rows on (prefill), the exact
    `gguf_linear`: there the dequantized GEMM is faster than any per-block kernel."""
    if qtype not in GGUF_BLOCK_BYTES:
        raise ValueError(f"GGUF type must be one of {sorted(GGUF_BLOCK_BYTES)}; got {qtype!r}")
    if x.dtype not in DTYPES:
        return reference.gguf_linear_int8(x, blocks, qtype)
    if x.shape[0] >= gguf_dequant_min_rows():
        return gguf_linear(x, blocks, qtype)
    return torch.ops.pdserve_cpu.gguf_linear_int8(x, blocks, _GGUF_TYPE_IDS[qtype])


def gguf_rows_kernel(blocks: torch.Tensor, qtype: str, dtype: torch.dtype, int8_activations: bool = False
                     ) -> tuple[Callable[[torch.Tensor], torch.Tensor] | None, int]:
    """`gguf_linear(x, blocks, qtype)` (`gguf_linear_int8` with `int8_activations`) for 2-D x of
    `dtype` as one call to the C++ kernel, this function's checks made once, and the most rows of x
    it takes (fewer than `gguf_dequant_min_rows`); (None, 0) where it would not call the kernel."""
    if qtype not in GGUF_BLOCK_BYTES or dtype not in DTYPES:
        return None, 0
    ops = torch.ops.pdserve_cpu
    op, type_id = ops.gguf_linear_int8 if int8_activations else ops.gguf_linear, _GGUF_TYPE_IDS[qtype]
    return (lambda x: op(x, blocks, type_id)), gguf_dequant_min_rows() - 1


# fp8 weights: torch._scaled_mm, which oneDNN runs on CPU (slowly: ~30x a bf16 GEMV at one row on an
# AVX2 EPYC, so auto never picks fp8 on CPU; docs/perf/journal.md §10).
fp8_linear = fp8_linear_scaled_mm


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels.reference.rms_norm's contract."""
    if x.dtype not in DTYPES or weight.dtype != x.dtype:
        return reference.rms_norm(x, weight, eps, residual)
    return torch.ops.pdserve_cpu.rms_norm(x, weight, float(eps), residual)


def apply_rotary(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels.reference.apply_rotary's contract (on strided views of the fused QKV output too)."""
    if not _rotary_kernel_takes(query, key, cos, sin):
        return reference.apply_rotary(query, key, cos, sin)
    return torch.ops.pdserve_cpu.rotary(query, key, cos, sin)


def apply_rotary_(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """`apply_rotary`'s result written into query and key (views of a QKV projection's output that
    nothing else reads): no fresh outputs for the first writes to fill (docs/perf/journal.md §55)."""
    if not _rotary_kernel_takes(query, key, cos, sin):
        q, k = reference.apply_rotary(query, key, cos, sin)
        query.copy_(q)
        key.copy_(k)
        return
    torch.ops.pdserve_cpu.rotary_(query, key, cos, sin)


def _rotary_kernel_takes(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether the C++ rotary runs these: one dtype it has, rows whose last dim is contiguous."""
    return (query.dtype in DTYPES and key.dtype == cos.dtype == sin.dtype == query.dtype
            and query.stride(-1) == 1 and key.stride(-1) == 1)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """kernels.reference.silu_and_mul's contract."""
    if x.dtype not in DTYPES:
        return reference.silu_and_mul(x)
    return torch.ops.pdserve_cpu.silu_and_mul(x)


def lora_add(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, rows: torch.Tensor,
             starts: torch.Tensor, slots: torch.Tensor, ranks: torch.Tensor, sub_offsets: torch.Tensor
             ) -> torch.Tensor:
    """kernels.reference.lora_add's contract in one C++ call per layer (kernels/csrc/lora.cpp): the
    reference's four to eight small ops per adapter cost ~15 us each on a 2-core CPU, 16 adapters'
    worth of them more than the base step's matmuls (docs/perf/journal.md §13)."""
    if x.dtype not in DTYPES or not x.is_contiguous() or not out.is_contiguous():
        return reference.lora_add(x, out, a, bt, rows, starts, slots, ranks, sub_offsets)
    torch.ops.pdserve_cpu.lora_add(x, out, a, bt, rows, starts, slots, ranks, sub_offsets)
    return out


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
              expert_start: int = 0) -> torch.Tensor:
    """kernels.reference.fused_moe's contract, in one C++ call (kernels/csrc/moe.cpp)."""
    return torch.ops.pdserve_cpu.fused_moe(x, w13, w2, weights, ids, int(expert_start))


def softmax_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels.reference.softmax_topk's contract, in two passes over each row (kernels/csrc/sampling.cpp)."""
    if x.dtype != torch.float32 or x.dim() != 2 or not 1 <= k <= x.shape[1] or x.stride(1) != 1:
        return reference.softmax_topk(x, k)
    return torch.ops.pdserve_cpu.softmax_topk(x, int(k))


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """kernels.reference.argmax_rows's contract."""
    if x.dtype not in DTYPES or x.dim() != 2 or x.shape[1] == 0 or x.stride(1) != 1:
        return reference.argmax_rows(x)
    return torch.ops.pdserve_cpu.argmax_rows(x)


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """kernels.reference.write_kv's contract; slots < 0 (padding rows) are skipped. An fp8 cache's
    rows are quantized by kernels.reference.quantize_kv and written as bytes."""
    if kv_cache.dtype == FP8_DTYPE and kv_cache.is_contiguous():
        key, value = quantize_kv_rows(key, value, k_scale, v_scale)
        kv_cache = kv_cache.view(torch.uint8)
    rows_ok = all(t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] for t in (key, value))
    if kv_cache.dtype not in (*DTYPES, torch.uint8) or not kv_cache.is_contiguous() or not rows_ok:
        return reference.write_kv(key, value, kv_cache, slot_mapping, k_scale, v_scale)
    torch.ops.pdserve_cpu.write_kv(key, value, kv_cache, slot_mapping)
