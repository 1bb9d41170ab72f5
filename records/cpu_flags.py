"""This host's CPU: its feature flags, read once per process without torch, and what they mean for
the kernels pdserve picks (the GGUF block kernels, half-precision GEMMs).
"""
from __future__ import annotations

import functools


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags from /proc/cpuinfo (empty where there is none), read once per
    process (a config resolution asks twice: the quantization choice, the dtype warning); configs
    import without torch."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split())
    except OSError:
        pass
    return frozenset()


def fast_block_kernels() -> bool:
    """Whether this CPU has what the GGUF block kernel was measured fast with: AVX512-BF16
    (`vdpbf16ps`), or AVX2 with FMA and F16C (explicit byte -> float conversions; without them
    GCC scalarized the block decoding and the blocks ran at 0.64x dense bf16 weights). Elsewhere
    (other ISAs, older x86) auto leaves GGUF files dequantized (docs/perf/journal.md §9)."""
    flags = cpu_flags()
    return "avx512_bf16" in flags or {"avx2", "fma", "f16c"} <= flags


def slow_half_dtype_warning(dtype: str) -> str | None:
    """Why a bfloat16 / float16 model on this CPU will be slow, or None: without AVX512-BF16 or
    AMX, half-precision GEMMs run through conversions (3.4x slower than float32 at batch 16 on an
    AVX2 EPYC, docs/perf/journal.md §9), and dtype "auto" takes the checkpoint's, usually bfloat16."""
    flags = cpu_flags()
    if dtype == "float32" or not flags or "avx512_bf16" in flags or "amx_bf16" in flags:
        return None
    return (f"dtype {dtype} on a CPU without AVX512-BF16 or AMX runs several times slower than float32 "
            f"(docs/perf/journal.md §9); pass dtype='float32' (--dtype float32) where memory allows")
