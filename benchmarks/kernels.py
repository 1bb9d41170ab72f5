"""Triton kernels and the decode step on a CUDA GPU (Llama-3-8B shapes, random weights, bf16).

    python benchmarks/kernels.py [--quick] [--json out.json]

1. Copy bandwidth: a device-to-device copy of 4 GiB, bytes read + written over time (the ceiling).
2. Decode attention: K/V bytes read over time, batch 1-256 x context 512-32k, against (1); the torch
   reference (gather + SDPA) side by side where it fits.
3. Prefill attention: causal TFLOP/s against torch's scaled_dot_product_attention (flash backend) on
   the same data laid out contiguously.
4. End to end: decode tokens/s of a 32-layer Llama-3-8B-shaped model (no weights are downloaded:
   random bf16), eager and with CUDA graphs, against the roofline (weight + KV bytes per step over
   the copy bandwidth). A step is the model forward plus logits and argmax of every row.
Times are medians of CUDA-event timings (triton.testing.do_bench). Every figure here is printed
with its ratio; nothing is asserted.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import reference
from kernels import triton_attention as ta

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
DTYPE = torch.bfloat16


def bench(fn, warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds."""
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def copy_bandwidth() -> float:
    src = torch.empty(1 << 31, dtype=torch.int16, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return 2 * src.numel() * 2 / ms / 1e9      # TB/s: bytes read + written


def paged_cache(batch: int, context: int):
    blocks_per_seq = -(-context // BLOCK)
    num_blocks = batch * blocks_per_seq
    cache = torch.empty(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda").normal_()
    tables = torch.randperm(num_blocks, device="cuda").view(batch, blocks_per_seq)
    return cache, tables


def decode_attention(copy_tbs: float, quick: bool) -> list[dict]:
    rows = []
    batches = (1, 16, 64, 256)
    contexts = (512, 2048, 8192, 32768) if not quick else (2048, 32768)
    for batch in batches:
        for context in contexts:
            cache, tables = paged_cache(batch, context)
            q = torch.randn(batch, HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
            lens = torch.full((batch,), context, device="cuda")
            ms = bench(lambda: ta.decode_attention(q, cache, tables, lens, HEAD_DIM ** -0.5))
            kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * cache.element_size()
            row = {"batch": batch, "context": context, "ms": ms, "tb_s": kv_bytes / ms / 1e9,
                   "splits": ta.decode_partitions(batch, KV_HEADS, tables.shape[1] * BLOCK, BLOCK, q.device)[0]}
            row["of_copy"] = row["tb_s"] / copy_tbs
            if batch * context <= 64 * 8192:
                ref_ms = bench(lambda: reference.decode_attention(q, cache, tables, lens, HEAD_DIM ** -0.5))
                row["speedup_over_reference"] = ref_ms / ms
            rows.append(row)
            print(f"decode b={batch:4d} ctx={context:6d}: {ms:8.3f} ms {row['tb_s']:5.2f} TB/s "
                  f"({row['of_copy']:.2f} of copy) splits={row['splits']}"
                  + (f" {row['speedup_over_reference']:.1f}x reference" if "speedup_over_reference" in row else ""),
                  flush=True)
            cache = tables = None       # free the cache before the next size
    return rows


def prefill_attention(quick: bool, seqs: tuple[int, ...] | None = None) -> list[dict]:
    rows = []
    for seq in seqs or ((2048, 8192) if quick else (1024, 2048, 4096, 8192)):
        cache, tables = paged_cache(1, seq)
        q = torch.randn(seq, HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
        # The segments' device form built once, as the engine does per step (not per layer): built in
        # each call, it was most of the time measured at 1k-2k tokens.
        segments = [tables[0]]
        packed = ta.pack_prefill(segments, [seq], [seq], q.device)
        ms = bench(lambda: ta.prefill_attention(q, cache, segments, [seq], [seq], HEAD_DIM ** -0.5, packed))
        k, v = reference.gather_kv(cache, tables[0], seq)
        group = HEADS // KV_HEADS
        qc = q.transpose(0, 1)[None].contiguous()
        kc = k.repeat_interleave(group, 1).transpose(0, 1)[None].contiguous()
        vc = v.repeat_interleave(group, 1).transpose(0, 1)[None].contiguous()
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            sdpa_ms = bench(lambda: F.scaled_dot_product_attention(qc, kc, vc, is_causal=True))
        flops = 4 * HEADS * HEAD_DIM * seq * seq / 2          # causal: half of QK^T and PV
        row = {"seq": seq, "ms": ms, "tflops": flops / ms / 1e9, "sdpa_ms": sdpa_ms,
               "sdpa_tflops": flops / sdpa_ms / 1e9}
        row["of_sdpa"] = sdpa_ms / ms
        rows.append(row)
        print(f"prefill T={seq:5d}: triton {row['tflops']:6.1f} TFLOP/s, sdpa flash {row['sdpa_tflops']:6.1f} "
              f"TFLOP/s ({row['of_sdpa']:.2f}x of sdpa)", flush=True)
    return rows


def sweep() -> None:
    """Launch options and tile sizes of both attention kernels, at a few shapes (for tuning)."""
    import itertools

    saved = (ta.TILE_TOKENS, ta.PREFILL_BLOCK_M, ta.PROGRAMS_PER_SM, dict(ta.DECODE_LAUNCH),
             dict(ta.PREFILL_LAUNCH))
    shapes = [(b, c, *paged_cache(b, c)) for b, c in ((1, 32768), (16, 4096), (128, 2048))]
    for tile, per_sm, warps, stages in itertools.product((32, 64, 128), (2, 8), (4, 8), (2, 3)):
        ta.TILE_TOKENS, ta.PROGRAMS_PER_SM = tile, per_sm
        ta.DECODE_LAUNCH.update(num_warps=warps, num_stages=stages)
        cells = []
        for batch, context, cache, tables in shapes:
            q = torch.randn(batch, HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
            lens = torch.full((batch,), context, device="cuda")
            ms = bench(lambda: ta.decode_attention(q, cache, tables, lens, HEAD_DIM ** -0.5), rep=40)
            cells.append(f"b{batch}xc{context} {2 * batch * context * KV_HEADS * HEAD_DIM * 2 / ms / 1e9:.2f}TB/s")
        print(f"sweep decode tile={tile} per_sm={per_sm} warps={warps} stages={stages}: " + ", ".join(cells),
              flush=True)
    ta.TILE_TOKENS, ta.PROGRAMS_PER_SM = saved[0], saved[2]
    ta.DECODE_LAUNCH.update(saved[3])
    seq = 4096
    cache, tables = paged_cache(1, seq)
    q = torch.randn(seq, HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    segments = [tables[0]]
    packed = ta.pack_prefill(segments, [seq], [seq], q.device)
    flops = 4 * HEADS * HEAD_DIM * seq * seq / 2
    for block_m, tile, warps, stages in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3)):
        ta.PREFILL_BLOCK_M, ta.TILE_TOKENS = block_m, tile
        ta.PREFILL_LAUNCH.update(num_warps=warps, num_stages=stages)
        try:
            ms = bench(lambda: ta.prefill_attention(q, cache, segments, [seq], [seq], HEAD_DIM ** -0.5, packed),
                       rep=40)
            print(f"sweep prefill T={seq} block_m={block_m} tile={tile} warps={warps} stages={stages}: "
                  f"{flops / ms / 1e9:.1f} TFLOP/s", flush=True)
        except Exception as e:  # noqa: BLE001 - e.g. out of shared memory for the largest tiles
            print(f"sweep prefill block_m={block_m} tile={tile} warps={warps} stages={stages}: {type(e).__name__}")
    ta.TILE_TOKENS, ta.PREFILL_BLOCK_M = saved[0], saved[1]
    ta.PREFILL_LAUNCH.update(saved[4])


def llama3_8b_model(max_positions: int):
    from transformers import LlamaConfig

    from engine.model.models.llama import LlamaForCausalLM

    config = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, rope_theta=500000.0,
                         max_position_embeddings=max_positions, tie_word_embeddings=False)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config, DTYPE, max_positions).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    return model


def decode_inputs(batch: int, context: int, kv_dtype: torch.dtype = DTYPE):
    """One decode step of `batch` sequences of `context` tokens on the 8B model: the 32 layers' KV
    caches (random contents and block tables, room for one block more), the blocks per sequence,
    the token ids, positions and attention metadata -> (kv_caches, blocks_per_seq, ids, pos, meta)."""
    from engine.model.layers.attention import AttentionMetadata

    blocks_per_seq = -(-(context + BLOCK) // BLOCK)
    num_blocks = batch * blocks_per_seq
    kv_caches = [torch.empty(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda").normal_()
                 .to(kv_dtype) for _ in range(32)]
    tables = torch.randperm(num_blocks, device="cuda").view(batch, blocks_per_seq)
    ids = torch.randint(0, 128256, (batch,), device="cuda")
    pos = torch.full((batch,), context, device="cuda")
    slots = tables[:, context // BLOCK] * BLOCK + context % BLOCK
    meta = AttentionMetadata(slot_mapping=slots, num_decode_tokens=batch, decode_block_tables=tables,
                             decode_seq_lens=pos + 1)
    return kv_caches, blocks_per_seq, ids, pos, meta


def end_to_end(copy_tbs: float, quick: bool) -> list[dict]:
    from engine.worker.cuda_graph import CudaGraphRunner

    context = 1024
    model = llama3_8b_model(context + BLOCK)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    rows = []
    for batch in ((1, 64) if quick else (1, 16, 64, 256)):
        kv_caches, blocks_per_seq, ids, pos, meta = decode_inputs(batch, context)

        def step(hidden_fn):
            hidden = hidden_fn()
            return model.compute_logits(hidden).argmax(-1)

        with torch.inference_mode():
            eager_ms = bench(lambda: step(lambda: model(ids, pos, kv_caches, meta)), warmup=10, rep=50)
            graphs = CudaGraphRunner(model, kv_caches, (batch,), blocks_per_seq, torch.device("cuda"))
            graphs.capture()
            graph_ms = bench(lambda: step(lambda: graphs.run(ids, pos, meta)), warmup=10, rep=50)
        kv_bytes = batch * (context + 1) * 32 * 2 * KV_HEADS * HEAD_DIM * 2
        roofline_ms = (weight_bytes + kv_bytes) / (copy_tbs * 1e9)
        row = {"batch": batch, "context": context, "eager_ms": eager_ms, "graph_ms": graph_ms,
               "eager_tok_s": batch / eager_ms * 1e3, "graph_tok_s": batch / graph_ms * 1e3,
               "roofline_ms": roofline_ms, "graph_of_roofline": roofline_ms / graph_ms,
               "eager_of_roofline": roofline_ms / eager_ms, "graph_speedup": eager_ms / graph_ms}
        rows.append(row)
        print(f"8B decode b={batch:3d} ctx={context}: eager {eager_ms:6.2f} ms ({row['eager_tok_s']:7.0f} tok/s, "
              f"{row['eager_of_roofline']:.2f} of roofline), graphs {graph_ms:6.2f} ms "
              f"({row['graph_tok_s']:7.0f} tok/s, {row['graph_of_roofline']:.2f} of roofline, "
              f"{row['graph_speedup']:.2f}x eager); roofline {roofline_ms:.2f} ms", flush=True)
        kv_caches = graphs = None
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes")
    parser.add_argument("--json", help="write every figure here")
    parser.add_argument("--skip", default="", help="comma list of: decode,prefill,e2e")
    parser.add_argument("--sweep", action="store_true", help="only sweep the kernels' tile and launch options")
    parser.add_argument("--prefill-seqs", default="", help="comma list of prompt lengths for the prefill section "
                        "(default 1024,2048,4096,8192; --quick 2048,8192)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernels.py needs a CUDA GPU")
    skip = set(args.skip.split(","))
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    result["copy_tb_s"] = copy_tbs = copy_bandwidth()
    print(f"{result['device']}: device-to-device copy {copy_tbs:.2f} TB/s", flush=True)
    if args.sweep:
        sweep()
        return
    if "decode" not in skip:
        result["decode"] = decode_attention(copy_tbs, args.quick)
    if "prefill" not in skip:
        seqs = tuple(int(n) for n in args.prefill_seqs.split(",") if n)
        result["prefill"] = prefill_attention(args.quick, seqs)
    if "e2e" not in skip:
        result["end_to_end"] = end_to_end(copy_tbs, args.quick)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
