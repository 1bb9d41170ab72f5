"""Quality of a lossy path against the exact one, teacher-forced on real text: each position's
next-token distribution from the same model over the same tokens, one path against the other.

`python benchmarks/quality.py` prints, for the embedded model on the first `--tokens` tokens of
tests/data/pride_and_prejudice_ch1-3.txt (public domain), the top-1 agreement and the mean
KL(exact || lossy) of the fp8 KV cache (kv_cache_dtype="fp8") against the model's own cache dtype,
and of the model's weights requantized to Q8_0 (`requantize_gguf`, run from their blocks) against
the same weights dequantized (the model ships as Q4_1 only: its Q4_1 values are the exact ones).
The text goes through the model in chunks of `--chunk` tokens, so every chunk after the first
attends to a prefix read back from the (fp8) cache, as chunked prefill and decode do.
tests/engine/test_quant.py asserts issue 26's bounds with the same functions.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TEXT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "data",
                    "pride_and_prejudice_ch1-3.txt")


@dataclass(frozen=True)
class Agreement:
    tokens: int
    top1: float            # share of positions where both paths' argmax agree
    mean_kl: float         # mean over positions of KL(reference || candidate), in nats
    max_kl: float


def text_ids(model: str | None, num_tokens: int) -> list[int]:
    """The first `num_tokens` token ids of the shipped text under the model's tokenizer (as the
    engine loads it: a GGUF file's converted once on this machine, not parsed from the file again:
    tests/engine/test_quant.py checks it is transformers' conversion)."""
    from engine.text.tokenizer import load_tokenizer
    from records.model_source import resolve_model

    path, gguf_file, hf_config = resolve_model(model)
    tokenizer = load_tokenizer(path, gguf_file, hf_config)
    if tokenizer is None:
        raise ValueError(f"model {model or 'embedded'} ships no tokenizer: text_ids needs one")
    with open(TEXT) as f:
        ids = tokenizer(f.read())["input_ids"]
    if len(ids) < num_tokens:
        raise ValueError(f"{TEXT} holds {len(ids)} tokens; asked for {num_tokens}")
    return ids[:num_tokens]


@torch.inference_mode()
def teacher_forced_logprobs(ids: list[int], chunk: int, model: str | None = None, device: str = "cpu",
                            **engine_args) -> torch.Tensor:
    """Log-probabilities [len(ids), vocab] (fp32, on the CPU) of each next token, from one engine's
    model runner and KV cache on `device` built by `engine_config(model, **engine_args)`, the
    text in chunks."""
    from engine.worker.worker import Worker
    from records.config_resolution import engine_config

    config = engine_config(model, max_model_len=max(len(ids), 16), **engine_args)
    worker = Worker(config, device)
    worker.load_model()
    block_size = config.cache_config.block_size
    num_blocks = -(-len(ids) // block_size)
    worker.init_cache(num_blocks, 0)
    runner = worker.runner
    table = torch.arange(num_blocks, device=worker.device)
    out = []
    for start in range(0, len(ids), chunk):
        end = min(len(ids), start + chunk)
        positions = torch.arange(start, end, device=worker.device)
        meta = runner.attention.metadata(slot_mapping=positions, prefill_block_tables=[table],
                                         prefill_query_lens=[end - start], prefill_seq_lens=[end])
        hidden = runner.model(torch.tensor(ids[start:end], device=worker.device), positions, runner.kv_caches, meta)
        out.append(torch.log_softmax(runner.model.compute_logits(hidden).float(), dim=-1).cpu())
    return torch.cat(out)


def agreement(reference: torch.Tensor, candidate: torch.Tensor) -> Agreement:
    """Top-1 agreement and KL(reference || candidate) per position of two [T, vocab] logprob tensors."""
    kl = (reference.exp() * (reference - candidate)).sum(-1)
    top1 = (reference.argmax(-1) == candidate.argmax(-1)).float().mean().item()
    return Agreement(reference.shape[0], top1, kl.mean().item(), kl.max().item())


def requantize_gguf(src: str, dst: str, qtype: str = "Q8_0") -> str:
    """A copy of GGUF file `src` at `dst` whose quantized matrices are requantized to `qtype`
    (dequantized to fp32, then quantized by the gguf package, llama.cpp's quantizers in numpy);
    metadata and dense tensors copied as they are. Returns `dst`."""
    import gguf

    target = getattr(gguf.GGMLQuantizationType, qtype)
    reader = gguf.GGUFReader(src)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    writer = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    tensors = []
    for t in reader.tensors:
        data, kind = t.data, t.tensor_type
        if kind not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
                        gguf.GGMLQuantizationType.BF16):
            data, kind = gguf.quants.quantize(gguf.quants.dequantize(data, kind), target), target
        tensors.append((t.name, data, kind))
        writer.add_tensor_info(t.name, data.shape, data.dtype, data.nbytes, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, data, _ in tensors:
        writer.write_tensor_data(data, tensor_endianess=reader.endianess)
    writer.close()
    return dst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    ids = text_ids(None, args.tokens)
    exact = teacher_forced_logprobs(ids, args.chunk, dtype=args.dtype)
    fp8 = teacher_forced_logprobs(ids, args.chunk, dtype=args.dtype, kv_cache_dtype="fp8")
    a = agreement(exact, fp8)
    print(f"fp8 KV cache vs {args.dtype} cache, {a.tokens} tokens: top-1 agreement {a.top1:.4f}, "
          f"mean KL {a.mean_kl:.5f} nats (max {a.max_kl:.4f})")
    import tempfile

    from records.model_source import embedded_model_path

    with tempfile.TemporaryDirectory() as tmp:
        q8 = requantize_gguf(embedded_model_path(), os.path.join(tmp, "q8_0.gguf"))
        blocks = teacher_forced_logprobs(ids, args.chunk, q8, dtype=args.dtype, quantization="gguf")
    a = agreement(exact, blocks)
    print(f"Q8_0 weights (from their blocks) vs the Q4_1 weights dequantized, {a.tokens} tokens: top-1 "
          f"agreement {a.top1:.4f}, mean KL {a.mean_kl:.5f} nats (max {a.max_kl:.4f})")


if __name__ == "__main__":
    main()
