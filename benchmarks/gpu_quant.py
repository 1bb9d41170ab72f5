"""Quantization on a CUDA GPU (issue 26): int8 (Q8_0 blocks) and fp8 weights, the fp8 KV cache and
batched LoRA, against bf16, on Llama-3-8B shapes with random weights (no download).

    python benchmarks/gpu_quant.py [--quick] [--sweep] [--json out.json]

1. Linear layers (the four projections of one decoder layer) at M rows of x: bf16 `F.linear`
   (cuBLAS); the Triton W8A16 kernel on Q8_0 blocks (kernels/triton_quant.py); the same blocks
   dequantized into bf16 then cuBLAS; fp8 weights through `torch._scaled_mm` (x quantized per row
   on each call, as the engine does). Weights rotate among 4 copies so that none is served from L2.
   `--sweep` first times the W8A16 kernel's tile and launch options (its LAUNCH table came from it).
2. Decode and prefill attention over a bf16 and an fp8 (e4m3) paged cache (its bytes widened by the
   GPU's own e4m3 conversion, as the kernels run, and by bit arithmetic, the C++ kernels' way).
   The slot write of a step's K and V rows: into a bf16 cache, into an fp8 cache quantized in the
   write's own launch (both conversions), and as before that (kernels.reference's quantizer, then
   the byte store: eight small kernels more).
3. LoRA: the Triton shrink/expand pair for 32 rows under 16 rank-16 adapters on the fused QKV
   projection, against the torch reference and against the layer's own bf16 GEMM.
4. End to end: a 32-layer Llama-3-8B-shaped decode step (forward, logits, argmax) replayed from a
   CUDA graph at 1,024 tokens of context, with bf16 weights, an fp8 KV cache, Q8_0 weights and fp8
   weights, against each one's roofline (weight + KV bytes over the copy rate); also fp8_kv_bits
   (the cache widened by bit arithmetic), fp8_kv_unfused (its slot write as before the fusion) and
   fp8_gemm (fp8 weights through cuBLASLt's GEMM at one row too, not the Triton GEMV).
Times are medians of CUDA-event timings (triton.testing.do_bench); nothing is asserted.
"""
from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.loading.quant_checkpoint import quantize_fp8
from engine.model.layers.linear import Linear
from kernels import reference, triton_cache, triton_lora, triton_ops, triton_quant
from kernels import triton_attention as ta

_spec = importlib.util.spec_from_file_location("bench_kernels", Path(__file__).with_name("kernels.py"))
bk = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bk)       # benchmarks/kernels.py: bench, copy_bandwidth, the 8B model

# One decoder layer of Llama-3-8B: (output features, input features).
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
COPIES = 4


def q8_0_blocks(w: torch.Tensor) -> torch.Tensor:
    """A dense weight [N, K] as Q8_0 blocks (amax / 127 per 32 features, as llama.cpp quantizes)."""
    n, k = w.shape
    g = w.float().reshape(n, k // 32, 32)
    d = (g.abs().amax(-1, keepdim=True) / 127).to(torch.float16)
    q = (g / d.float().clamp_min(1e-12)).round().clamp(-127, 127).to(torch.int8)
    return torch.cat([d.view(torch.uint8), q.view(torch.uint8)], dim=-1).reshape(n, -1)


def rotating(fn, items):
    """fn over the next of `items` at each call (the inputs cycle so that L2 holds none of them)."""
    it = itertools.cycle(items)
    return lambda: fn(*next(it))


def weights(n: int, k: int):
    dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(COPIES)]
    blocks = [triton_quant.pack_gguf(q8_0_blocks(w), "Q8_0") for w in dense]
    fp8 = [quantize_fp8(w) for w in dense]
    return dense, blocks, [(f.weight, f.scale) for f in fp8]


def sweep(rows_list=(4, 16, 64)) -> None:
    """Times the W8A16 tile kernel's launch options at a few shapes (GB/s of blocks read) and puts the best
    one for each of LAUNCH's row ranges (summed over the shapes) into triton_quant.LAUNCH for the
    sections after it."""
    speeds: dict[tuple[int, str], dict[tuple, float]] = {}
    for name in ("gate_up", "down"):
        n, k = SHAPES[name]
        _, blocks, _ = weights(n, k)
        for rows in rows_list:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            cells = []
            for block_n, nb, split in itertools.product((16, 32, 64), (4, 8), (1, 2, 4)):
                launch = {"BLOCK_M": 16 if rows <= 16 else 64, "BLOCK_N": block_n, "NB": nb, "SPLIT_K": split,
                          "num_warps": 4, "num_stages": 3}
                try:
                    ms = bk.bench(rotating(lambda b: triton_quant.q8_0_linear(x, b, launch, "tile"),
                                           [(b,) for b in blocks]), warmup=5, rep=20)
                except Exception as e:  # noqa: BLE001 - e.g. out of shared memory or registers
                    cells.append(f"{block_n}/{nb}/{split}: {type(e).__name__}")
                    continue
                speeds.setdefault((rows, name), {})[(block_n, nb, split)] = blocks[0].numel() / ms / 1e6
                cells.append(f"{block_n}/{nb}/{split}: {blocks[0].numel() / ms / 1e6:.0f}")
            print(f"sweep q8_0 {name} M={rows} (BLOCK_N/NB/SPLIT_K: GB/s): " + ", ".join(cells), flush=True)
        blocks = None
    for i, (bound, _) in enumerate(triton_quant.LAUNCH):
        low = triton_quant.LAUNCH[i - 1][0] if i else 0
        cells = [v for (rows, _), v in speeds.items() if low < rows <= bound]
        if not cells:
            continue
        best = max(set.intersection(*(set(c) for c in cells)), key=lambda key: sum(c[key] for c in cells))
        triton_quant.LAUNCH[i] = (bound, {**dict(zip(("BLOCK_N", "NB", "SPLIT_K"), best)), "num_warps": 4,
                                          "num_stages": 3})
        print(f"sweep: rows {low + 1}..{bound}: best {triton_quant.LAUNCH[i][1]} "
              f"({sum(c[best] for c in cells) / len(cells):.0f} GB/s mean)", flush=True)


def kernel_variants(rows_list=(1, 4, 16, 64)) -> list[dict]:
    """Each W8A16 kernel (q8_0_linear's "tile" and "gemv") over a small grid of its launch options,
    per projection shape and row count: the best time of each (GB/s of blocks read, against bf16
    cuBLAS on the same shape) and its error against the fp32 reference on fresh inputs. (The
    kernels' defaults came from this; a third variant then, a tile that dequantized each weight
    into x's dtype before one wider `tl.dot`, lost to both: docs/perf/journal.md §14.)"""
    grids = {
        "tile": lambda rows: [{"BLOCK_M": triton_quant.launch_for(rows)["BLOCK_M"], "BLOCK_N": bn, "NB": nb,
                               "SPLIT_K": sk, "num_warps": 4, "num_stages": 3}
                              for bn, nb, sk in itertools.product((32, 64, 128), (2, 4), (1, 2, 4))],
        "gemv": lambda rows: [] if rows > 16 else [{"BLOCK_N": bn, "NB": nb, "SPLIT_K": sk, "num_warps": 4}
                                                   for bn, nb, sk in itertools.product((8, 16, 32, 64), (4, 8),
                                                                                       (1, 2, 4))],
    }
    out = []
    for name, (n, k) in SHAPES.items():
        dense, blocks, _ = weights(n, k)
        for rows in rows_list:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            row = {"layer": name, "n": n, "k": k, "m": rows,
                   "bf16_ms": bk.bench(rotating(lambda w: F.linear(x, w), [(w,) for w in dense]))}
            for kernel, grid in grids.items():
                best = None
                for launch in grid(rows):
                    try:
                        ms = bk.bench(rotating(lambda b: triton_quant.q8_0_linear(x, b, launch, kernel),
                                               [(b,) for b in blocks]), warmup=5, rep=20)
                    except Exception as e:  # noqa: BLE001 - e.g. out of registers: next option
                        print(f"  {kernel} {launch}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                        continue
                    if best is None or ms < best[0]:
                        best = (ms, launch)
                if best is None:
                    continue
                xe = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
                ref = xe.float() @ triton_quant.dequantize_q8_0(blocks[0], torch.float32).T
                got = triton_quant.q8_0_linear(xe, blocks[0], best[1], kernel).float()
                row[kernel] = {"ms": best[0], "launch": best[1], "gb_s": blocks[0].numel() / best[0] / 1e6,
                               "rel_err": ((got - ref).norm() / ref.norm()).item()}
            out.append(row)
            print(f"variants {name:7s} M={rows:3d}: bf16 {row['bf16_ms'] * 1e3:7.1f} us; " + "; ".join(
                f"{kern} {row[kern]['ms'] * 1e3:7.1f} us ({row['bf16_ms'] / row[kern]['ms']:.2f}x bf16, "
                f"{row[kern]['gb_s']:.0f} GB/s, err {row[kern]['rel_err']:.1e}, {row[kern]['launch']})"
                for kern in grids if kern in row), flush=True)
        dense = blocks = None
    for rows in rows_list:
        cells = [r for r in out if r["m"] == rows]
        sums = {kern: sum(r[kern]["ms"] for r in cells) for kern in grids if all(kern in r for r in cells)}
        bf16 = sum(r["bf16_ms"] for r in cells)
        print(f"variants M={rows}: the layer's four projections, x bf16: " +
              ", ".join(f"{kern} {bf16 / ms:.2f}x" for kern, ms in sums.items()), flush=True)
    return out


def linears(copy_tbs: float, quick: bool) -> list[dict]:
    rows_out = []
    ms_list = (1, 16, 64, 256, 2048) if quick else (1, 8, 16, 32, 64, 128, 256, 512, 2048, 8192)
    for name, (n, k) in SHAPES.items():
        dense, blocks, fp8 = weights(n, k)
        for m in ms_list:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row = {"layer": name, "n": n, "k": k, "m": m}
            row["bf16_ms"] = bk.bench(rotating(lambda w: F.linear(x, w), [(w,) for w in dense]))
            if m <= 512:
                row["q8_triton_ms"] = bk.bench(rotating(lambda b: triton_quant.q8_0_linear(x, b),
                                                        [(b,) for b in blocks]))
            row["q8_dequant_ms"] = bk.bench(rotating(lambda b: triton_quant.dequantized_linear(x, b, "Q8_0"),
                                                     [(b,) for b in blocks]))
            row["fp8_ms"] = bk.bench(rotating(lambda w, s: triton_quant.fp8_linear(x, w, s), fp8))
            bf16_bytes = n * k * 2
            row["bf16_of_copy"] = bf16_bytes / row["bf16_ms"] / 1e9 / copy_tbs
            if "q8_triton_ms" in row:
                row["q8_triton_of_copy"] = blocks[0].numel() / row["q8_triton_ms"] / 1e9 / copy_tbs
            rows_out.append(row)
            ratios = " ".join(f"{key[:-3]} {row['bf16_ms'] / row[key]:.2f}x" for key in
                              ("q8_triton_ms", "q8_dequant_ms", "fp8_ms") if key in row)
            print(f"linear {name:7s} {n}x{k} M={m:5d}: bf16 {row['bf16_ms'] * 1e3:8.1f} us "
                  f"({row['bf16_of_copy']:.2f} of copy); " + ratios
                  + (f"; q8 triton {row['q8_triton_of_copy']:.2f} of copy" if "q8_triton_of_copy" in row else ""),
                  flush=True)
        dense = blocks = fp8 = None
    # The row count from which dequantize + cuBLAS beats the kernel over the layer's four projections.
    for m in sorted({r["m"] for r in rows_out if "q8_triton_ms" in r}):
        cells = [r for r in rows_out if r["m"] == m]
        if sum(r["q8_dequant_ms"] for r in cells) < sum(r["q8_triton_ms"] for r in cells):
            triton_quant.DEQUANT_MIN_ROWS = m
            break
    else:
        triton_quant.DEQUANT_MIN_ROWS = 1 << 30
    print(f"W8A16: dequantize + cuBLAS from {triton_quant.DEQUANT_MIN_ROWS} rows on (the layer's four projections)",
          flush=True)
    return rows_out


ROUNDS = 3


def fp8_gemv(copy_tbs: float) -> list[dict]:
    """One row of x times fp8 weights: bf16 cuBLAS, cuBLASLt's fp8 GEMM (x quantized by the Triton
    row quantizer), and the Triton fp8 GEMV over its launch options; the options with the least
    time summed over the four projections become triton_quant's defaults for what runs after."""
    rows, sums = [], {}
    warm = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    bk.bench(lambda: warm @ warm, warmup=1000, rep=1000)        # the clock up from idle first
    for name, (n, k) in SHAPES.items():
        dense, _, fp8 = weights(n, k)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        bf16_ms = bk.bench(rotating(lambda w: F.linear(x, w), [(w,) for w in dense]))
        gemm_ms = bk.bench(rotating(
            lambda w, sc: reference.fp8_linear_scaled_mm(x, w, sc, triton_quant.quantize_fp8_rows), fp8))
        want = reference.fp8_linear(x, *fp8[0])
        row = {"layer": name, "n": n, "k": k, "bf16_ms": bf16_ms, "fp8_gemm_ms": gemm_ms, "gemv": {}}
        options = list(itertools.product((4, 8), (256, 512, 1024), (1, 2, 4)))
        times = {}
        for _ in range(ROUNDS):        # rounds over all options: single readings moved up to 3x
            for block_n, block_k, split in options:
                launch = {"BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": 4}
                splits = split if triton.cdiv(n, block_n) < triton_quant.FP8_GEMV_SPLIT_MAX_TILES else 1
                got = triton_quant.fp8_gemv(x, *fp8[0], launch=launch, splits=splits)
                if ((got.float() - want.float()).norm() / want.float().norm()).item() > 1e-2:
                    raise AssertionError(f"fp8 GEMV {launch} splits={splits} is wrong on {name}")
                times.setdefault(f"{block_n}/{block_k}/{split}", []).append(bk.bench(rotating(
                    lambda w, sc: triton_quant.fp8_gemv(x, w, sc, launch=launch, splits=splits), fp8)))
        row["gemv_all"] = times
        for key, ms in times.items():
            row["gemv"][key] = ms = sorted(ms)[len(ms) // 2]
            sums[key] = sums.get(key, 0.0) + ms
        best = min(row["gemv"], key=row["gemv"].get)
        rows.append(row)
        print(f"fp8 one row {name:7s} {n}x{k}: bf16 {bf16_ms * 1e3:6.1f} us; fp8 GEMM {bf16_ms / gemm_ms:.2f}x; "
              f"fp8 GEMV best {best} (BLOCK_N/BLOCK_K/split) {bf16_ms / row['gemv'][best]:.2f}x "
              f"({n * k / row['gemv'][best] / 1e9 / copy_tbs:.2f} of copy)", flush=True)
        dense = fp8 = None
    best = min(sums, key=sums.get)
    block_n, block_k, split = map(int, best.split("/"))
    triton_quant.FP8_GEMV_LAUNCH = {"BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": 4}
    triton_quant.FP8_GEMV_SPLIT = split
    print(f"fp8 GEMV: best over the layer {best}: " + ", ".join(
        f"{r['layer']} {r['bf16_ms'] / r['gemv'][best]:.2f}x (GEMM {r['bf16_ms'] / r['fp8_gemm_ms']:.2f}x)"
        for r in rows), flush=True)
    return rows


def fp8_both(call) -> tuple[float, float]:
    """An fp8-cache call timed as the kernels run it (the GPU's e4m3 conversion where it has one)
    and with the bytes widened by bit arithmetic (ta.HARDWARE_FP8 = False); their outputs must be equal."""
    auto, auto_out = bk.bench(call), call()
    ta.HARDWARE_FP8 = False
    try:
        bits, bits_out = bk.bench(call), call()
    finally:
        ta.HARDWARE_FP8 = None
    if not torch.equal(auto_out, bits_out):
        raise AssertionError("the two ways of widening an fp8 cache gave different outputs")
    return auto, bits


def attention(quick: bool) -> list[dict]:
    rows = []
    shapes = ((16, 2048), (64, 8192)) if quick else ((1, 32768), (16, 2048), (16, 8192), (64, 2048), (64, 8192),
                                                     (256, 2048))
    for batch, context in shapes:
        cache, tables = bk.paged_cache(batch, context)
        fp8 = cache.to(reference.FP8_DTYPE)
        q = torch.randn(batch, bk.HEADS, bk.HEAD_DIM, dtype=bk.DTYPE, device="cuda")
        lens = torch.full((batch,), context, device="cuda")
        scale = bk.HEAD_DIM ** -0.5
        bf16_ms = bk.bench(lambda: ta.decode_attention(q, cache, tables, lens, scale))
        fp8_ms, bits_ms = fp8_both(lambda: ta.decode_attention(q, fp8, tables, lens, scale, 0.5, 0.5))
        rows.append({"kind": "decode", "batch": batch, "context": context, "bf16_ms": bf16_ms, "fp8_ms": fp8_ms,
                     "fp8_bits_ms": bits_ms})
        print(f"decode attention b={batch:3d} ctx={context:6d}: bf16 cache {bf16_ms * 1e3:8.1f} us, fp8 cache "
              f"{fp8_ms * 1e3:8.1f} us ({bf16_ms / fp8_ms:.2f}x; widened by bit arithmetic "
              f"{bf16_ms / bits_ms:.2f}x)", flush=True)
        cache = fp8 = None
    for seq in (2048,) if quick else (2048, 8192):
        cache, tables = bk.paged_cache(1, seq)
        fp8 = cache.to(reference.FP8_DTYPE)
        q = torch.randn(seq, bk.HEADS, bk.HEAD_DIM, dtype=bk.DTYPE, device="cuda")
        segments = [tables[0]]
        packed = ta.pack_prefill(segments, [seq], [seq], q.device)      # once, as the engine does per step
        bf16_ms = bk.bench(lambda: ta.prefill_attention(q, cache, segments, [seq], [seq], 0.1, packed))
        fp8_ms, bits_ms = fp8_both(lambda: ta.prefill_attention(q, fp8, segments, [seq], [seq], 0.1, packed, 0.5, 0.5))
        rows.append({"kind": "prefill", "tokens": seq, "bf16_ms": bf16_ms, "fp8_ms": fp8_ms, "fp8_bits_ms": bits_ms})
        print(f"prefill attention T={seq}: bf16 cache {bf16_ms * 1e3:8.1f} us, fp8 cache {fp8_ms * 1e3:8.1f} us "
              f"({bf16_ms / fp8_ms:.2f}x; widened by bit arithmetic {bf16_ms / bits_ms:.2f}x)", flush=True)
    return rows


def unfused_fp8_write(key, value, kv_cache, slot_mapping, k_scale=1.0, v_scale=1.0) -> None:
    """The fp8 slot write as it was before the quantization moved into the write's launch: the
    reference's quantizer (upcast, divide, clamp, cast for K and for V), then the byte store."""
    if kv_cache.dtype == reference.FP8_DTYPE:
        key, value = reference.quantize_kv_rows(key, value, k_scale, v_scale)
        kv_cache = reference.raw(kv_cache)
    triton_cache.write_kv(key, value, kv_cache, slot_mapping)


def slot_write(quick: bool) -> list[dict]:
    rows = []
    for tokens in (1, 64, 2048) if quick else (1, 16, 64, 256, 2048):
        cache, _ = bk.paged_cache(1, max(tokens, 16) * 8)
        fp8 = torch.zeros_like(cache, dtype=reference.FP8_DTYPE)
        key, value = (torch.randn(tokens, bk.KV_HEADS, bk.HEAD_DIM, dtype=bk.DTYPE, device="cuda") for _ in "kv")
        slots = torch.randperm(cache.shape[1] * cache.shape[2], device="cuda")[:tokens]
        bf16_ms = bk.bench(lambda: triton_cache.write_kv(key, value, cache, slots))
        written = {}
        for hardware in (None, False):
            ta.HARDWARE_FP8 = hardware
            written[hardware] = (bk.bench(lambda: triton_cache.write_kv(key, value, fp8, slots, 0.5, 2.0)),
                                 fp8.view(torch.uint8).clone())
            fp8.view(torch.uint8).zero_()
        ta.HARDWARE_FP8 = None
        (fused_ms, fused), (bits_ms, bits) = written[None], written[False]
        before_ms = bk.bench(lambda: unfused_fp8_write(key, value, fp8, slots, 0.5, 2.0))
        if not (torch.equal(fused, bits) and torch.equal(fused, fp8.view(torch.uint8))):
            raise AssertionError("the fused fp8 slot writes and the reference's gave different bytes")
        rows.append({"tokens": tokens, "bf16_ms": bf16_ms, "fp8_ms": fused_ms, "fp8_bits_ms": bits_ms,
                     "fp8_unfused_ms": before_ms})
        print(f"slot write T={tokens:5d}: bf16 cache {bf16_ms * 1e3:6.1f} us, fp8 fused {fused_ms * 1e3:6.1f} us "
              f"(bit arithmetic {bits_ms * 1e3:6.1f} us), fp8 as before {before_ms * 1e3:6.1f} us", flush=True)
        cache = fp8 = None
    return rows


def lora() -> dict:
    n, k = SHAPES["qkv"]
    subs, slots, rank, rows_n = [4096, 1024, 1024], 16, 16, 32
    a = torch.randn(slots, rank, len(subs), k, device="cuda", dtype=torch.bfloat16) * 0.02
    bt = torch.randn(slots, rank, n, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(rows_n, k, device="cuda", dtype=torch.bfloat16)
    out = torch.randn(rows_n, n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    order = torch.randperm(rows_n, device="cuda")
    args = (a, bt, order, torch.arange(0, rows_n + 1, 2), torch.arange(16), torch.full((16,), rank),
            torch.tensor([0, 4096, 5120, 6144]))
    want = reference.lora_add(x, out.clone(), *args).float()
    err = ((triton_lora.lora_add(x, out.clone(), *args).float() - want).norm() / (want - out.float()).norm()).item()
    row = {"rows": rows_n, "adapters": 16, "rank": rank,
           "triton_ms": bk.bench(lambda: triton_lora.lora_add(x, out, *args)),
           "reference_ms": bk.bench(lambda: reference.lora_add(x, out, *args)),
           "base_gemm_ms": bk.bench(lambda: F.linear(x, w)), "rel_err_vs_reference": err}
    print(f"lora qkv 32 rows x 16 adapters rank 16: triton {row['triton_ms'] * 1e3:.1f} us, torch reference "
          f"{row['reference_ms'] * 1e3:.1f} us ({row['reference_ms'] / row['triton_ms']:.1f}x), the layer's bf16 GEMM "
          f"{row['base_gemm_ms'] * 1e3:.1f} us; rel. error {err:.1e}", flush=True)
    return row


def quantize_linears(model, qtype: str) -> None:
    """Every decoder projection of `model` held as Q8_0 blocks or fp8 from its bf16 weight."""
    for module in model.modules():
        if isinstance(module, Linear) and module.qtype is None and module.weight.dim() == 2:
            w = module.weight.data
            data = quantize_fp8(w).rows() if qtype == "fp8" else q8_0_blocks(w)
            module.quantize_as(qtype)
            module.weight.data.copy_(data)
            module.process_weights_after_loading()
            del w, data
    torch.cuda.empty_cache()


E2E_VARIANTS = ("bf16", "fp8_kv", "q8_0", "fp8")     # also: fp8_kv_bits (the cache widened by bit arithmetic)


def end_to_end(copy_tbs: float, batches: tuple[int, ...], variants=E2E_VARIANTS) -> list[dict]:
    rows = []
    for variant in variants:
        ta.HARDWARE_FP8 = False if variant == "fp8_kv_bits" else None
        triton_ops.write_kv = unfused_fp8_write if variant == "fp8_kv_unfused" else triton_cache.write_kv
        triton_quant.GEMV_FP8 = variant != "fp8_gemm"
        try:
            rows += decode_steps(variant, copy_tbs, batches)
        except Exception:  # noqa: BLE001 - report it and go on to the next variant
            traceback.print_exc()
        ta.HARDWARE_FP8 = None
        triton_ops.write_kv = triton_cache.write_kv
        triton_quant.GEMV_FP8 = True
        torch.cuda.empty_cache()
    base = {r["batch"]: r["tok_s"] for r in rows if r["variant"] == "bf16"}
    for r in rows:
        r["x_bf16"] = r["tok_s"] / base[r["batch"]] if r["batch"] in base else None
    print("8B decode tok/s against bf16 weights and cache: " + ", ".join(
        f"{r['variant']} b={r['batch']} {r['x_bf16']:.2f}x" for r in rows if r["variant"] != "bf16" and r["x_bf16"]),
        flush=True)
    return rows


def decode_steps(variant: str, copy_tbs: float, batches: tuple[int, ...]) -> list[dict]:
    from engine.model.layers.attention import Attention
    from engine.worker.cuda_graph import CudaGraphRunner

    context = 1024
    model = bk.llama3_8b_model(context + bk.BLOCK)
    if variant in ("q8_0", "fp8", "fp8_gemm"):
        quantize_linears(model, "Q8_0" if variant == "q8_0" else "fp8")
    kv_dtype = reference.FP8_DTYPE if variant.startswith("fp8_kv") else bk.DTYPE
    if variant.startswith("fp8_kv"):
        for m in model.modules():
            if isinstance(m, Attention):
                m.k_scale = m.v_scale = 0.5
    weight_bytes = sum(t.numel() * t.element_size() for t in itertools.chain(model.parameters(), model.buffers()))
    rows = []
    for batch in batches:
        kv_caches, blocks_per_seq, ids, pos, meta = bk.decode_inputs(batch, context, kv_dtype)
        with torch.inference_mode():
            graphs = CudaGraphRunner(model, kv_caches, (batch,), blocks_per_seq, torch.device("cuda"))
            graphs.capture()
            ms = bk.bench(lambda: model.compute_logits(graphs.run(ids, pos, meta)).argmax(-1), warmup=10, rep=50)
        kv_bytes = batch * (context + 1) * 32 * 2 * bk.KV_HEADS * bk.HEAD_DIM * kv_caches[0].element_size()
        roofline_ms = (weight_bytes + kv_bytes) / (copy_tbs * 1e9)
        row = {"variant": variant, "batch": batch, "context": context, "graph_ms": ms,
               "tok_s": batch / ms * 1e3, "weight_gb": weight_bytes / 1e9, "roofline_ms": roofline_ms,
               "of_roofline": roofline_ms / ms}
        rows.append(row)
        print(f"8B decode {variant:6s} b={batch:3d} ctx={context}: graphs {ms:6.2f} ms ({row['tok_s']:7.0f} tok/s, "
              f"{row['of_roofline']:.2f} of its roofline {roofline_ms:.2f} ms; weights {row['weight_gb']:.1f} GB)",
              flush=True)
        kv_caches = graphs = None
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes")
    parser.add_argument("--sweep", action="store_true", help="time the W8A16 kernel's launch options first")
    parser.add_argument("--variants", action="store_true", help="time each W8A16 kernel variant first")
    parser.add_argument("--skip", default="", help="comma list of: linear,fp8gemv,attention,write,lora,e2e")
    parser.add_argument("--json", help="write every figure here")
    parser.add_argument("--e2e", default=",".join(E2E_VARIANTS), help="comma list of the end-to-end variants")
    parser.add_argument("--e2e-batches", default=None, help="comma list of batch sizes (default 1,16,64; --quick 1,64)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/gpu_quant.py needs a CUDA GPU")
    skip = set(args.skip.split(","))
    batches = (tuple(map(int, args.e2e_batches.split(","))) if args.e2e_batches
               else (1, 64) if args.quick else (1, 16, 64))
    result = {"device": torch.cuda.get_device_name(), "capability": torch.cuda.get_device_capability(),
              "torch": torch.__version__, "triton": triton.__version__}
    result["copy_tb_s"] = copy_tbs = bk.copy_bandwidth()
    print(f"{result['device']}: device-to-device copy {copy_tbs:.2f} TB/s", flush=True)

    def save():
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))

    if args.sweep:
        sweep()
    if args.variants:
        result["variants"] = kernel_variants()
        save()
    result["launch"], result["dequant_min_rows"] = triton_quant.LAUNCH, None
    for name, fn in (("linear", lambda: linears(copy_tbs, args.quick)), ("fp8gemv", lambda: fp8_gemv(copy_tbs)),
                     ("attention", lambda: attention(args.quick)),
                     ("write", lambda: slot_write(args.quick)),
                     ("lora", lora), ("e2e", lambda: end_to_end(copy_tbs, batches, args.e2e.split(",")))):
        if name not in skip:
            try:
                result[name] = fn()
            except Exception:  # noqa: BLE001 - report it and go on: the device's minutes are few
                traceback.print_exc()
                result[name] = {"error": traceback.format_exc()}
            result["dequant_min_rows"] = triton_quant.DEQUANT_MIN_ROWS
            save()


if __name__ == "__main__":
    main()
