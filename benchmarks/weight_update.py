"""How long a trainer's weight update takes (engine/weight_updates.py, engine/worker/weight_sync.py):
the embedded model (SmolLM2-135M, served dense: quantization="none", or from its GGUF blocks:
"embedded-gguf") and a Llama-shaped 1B random model (bf16, or its projections in fp8: "1b-fp8"; the
quantized ones quantize every update), each through the three paths: tensors handed to the engine
in-process, a safetensors checkpoint from disk, and a broadcast over a gloo group from a trainer
process (rank 0: another process, so the bytes cross a socket as they would between nodes, here
over loopback).

    .venv/bin/python benchmarks/weight_update.py [--models embedded,embedded-gguf,1b,1b-fp8] [--runs 3]

Prints, per model and path, the median seconds of an update and the bytes per second it moved
(every tensor of the checkpoint, whole). The 1B model's checkpoint (2.2 GB) is written once under
$PDSERVE_BENCH_DIR (default /tmp/pdserve-bench).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from engine import LLM
from engine.loading.weights import iterate_weights
from engine.worker.weight_sync import WeightUpdateGroup


def llama_1b(root: str) -> str:
    """A Llama-3.2-1B-shaped model of random bf16 weights (the embedded model's tokenizer)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from records.model_source import embedded_model_path

    out = os.path.join(root, "llama-1b-random")
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    config = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=49152, max_position_embeddings=4096,
                         tie_word_embeddings=True, torch_dtype="bfloat16")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    path = embedded_model_path()
    AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path)).save_pretrained(out)
    return out


def _trainer(port: int, weights: list[tuple[str, torch.Tensor]], rounds: int) -> None:
    group = WeightUpdateGroup("127.0.0.1", port, 0, 2)
    for _ in range(rounds):
        for _, tensor in weights:
            group.broadcast(tensor)


def bench(name: str, path: str | None, runs: int, **engine: object) -> None:
    llm = LLM(path, max_model_len=512, **engine)
    mc = llm.llm_engine.config.model_config
    weights = [(n, t.contiguous()) for n, t in iterate_weights(mc.model, mc.gguf_file, mc.hf_config)]
    weights = [(n, t) for n, t in weights if n in llm.llm_engine.executor.worker.weight_sync.shapes]
    nbytes = sum(t.numel() * t.element_size() for _, t in weights)
    times: dict[str, list[float]] = {"tensors": [], "disk": [], "gloo": []}
    for _ in range(runs):
        began = time.perf_counter()
        llm.update_weights(weights)
        times["tensors"].append(time.perf_counter() - began)
    if mc.gguf_file is None:
        for _ in range(runs):
            began = time.perf_counter()
            llm.update_weights_from_disk(mc.model)
            times["disk"].append(time.perf_counter() - began)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    trainer = mp.get_context("spawn").Process(target=_trainer, args=(port, weights, runs))
    trainer.start()
    llm.init_weights_update_group("127.0.0.1", port, 1, 2)
    names, dtypes = [n for n, _ in weights], [str(t.dtype).removeprefix("torch.") for _, t in weights]
    shapes = [list(t.shape) for _, t in weights]
    for _ in range(runs):
        began = time.perf_counter()
        llm.update_weights_from_distributed(names, dtypes, shapes)
        times["gloo"].append(time.perf_counter() - began)
    trainer.join()
    for kind, values in times.items():
        if values:
            median = statistics.median(values)
            print(f"{name:10s} {kind:8s} {nbytes / 1e9:6.2f} GB  {median:7.2f} s  {nbytes / median / 1e9:6.2f} GB/s  "
                  f"(runs: {', '.join(f'{v:.2f}' for v in values)})", flush=True)
    llm.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="embedded,embedded-gguf,1b,1b-fp8")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    root = os.environ.get("PDSERVE_BENCH_DIR", "/tmp/pdserve-bench")
    os.makedirs(root, exist_ok=True)
    for name in args.models.split(","):
        if name == "embedded":
            bench(name, None, args.runs, quantization="none", dtype="bfloat16")
        elif name == "embedded-gguf":           # kept in its GGUF blocks, dense copies: each update quantizes
            bench(name, None, args.runs, quantization="gguf+dense", dtype="bfloat16")
        elif name == "1b":
            bench(name, llama_1b(root), args.runs, dtype="bfloat16", num_kv_blocks=64)
        elif name == "1b-fp8":                  # projections kept in fp8: each update quantizes them
            bench(name, llama_1b(root), args.runs, dtype="bfloat16", num_kv_blocks=64, quantization="fp8")
        else:
            raise SystemExit(f"--models: embedded, embedded-gguf, 1b and/or 1b-fp8; got {name!r}")


if __name__ == "__main__":
    main()
