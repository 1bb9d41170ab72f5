"""Sleep and wake of one engine on a CUDA GPU, in-process (what `EngineReplica.sleep` / `wake` do
to its engine, cluster/replica.py), for docs/serving.md's GPU column: device memory (torch's
allocated and reserved, and the device's used memory) awake after a request, asleep, and woken;
the wake's time against the first build (a cold start less the process and imports). A random
Llama of ~1B shape in bf16 (no checkpoint download).

    python3 benchmarks/sleep_wake_gpu.py [--layers 16] [--hidden 2048] [--holders]

`--holders` lists what still holds device memory after the first sleep: the live CUDA tensors the
garbage collector can see (their bytes, shapes and who refers to them, three levels up).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _without_grpc_tools() -> None:
    """The lent GPU machine has no grpcio-tools to build pdserve_proto's stubs; an engine without a
    KV connector never uses them (kv_transfer/base.py imports two functions at load)."""
    try:
        import grpc_tools  # noqa: F401
    except ImportError:
        import types

        def unavailable(*_args, **_kwargs):
            raise RuntimeError("pdserve_proto is not built on this machine (no grpcio-tools)")

        package, transfer = types.ModuleType("pdserve_proto"), types.ModuleType("pdserve_proto.transfer")
        transfer.from_params = transfer.to_params = unavailable
        package.transfer = transfer
        sys.modules.update({"pdserve_proto": package, "pdserve_proto.transfer": transfer})


def _describe(obj, target) -> str:
    import types

    if isinstance(obj, dict):
        keys = [k for k, v in obj.items() if v is target][:2]
        return f"dict[{', '.join(map(repr, keys))}]" if keys else f"dict({len(obj)})"
    if isinstance(obj, types.ModuleType):
        return f"module {obj.__name__}"
    if isinstance(obj, types.FunctionType):
        return f"function {obj.__qualname__}"
    return type(obj).__module__ + "." + type(obj).__qualname__


def cuda_holders(limit: int = 6, depth: int = 3) -> dict:
    """The live CUDA tensors the garbage collector sees (>= 1 MiB), and who refers to the largest."""
    import gc
    import types

    import torch

    gc.collect()
    seen = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.is_cuda
            and o.numel() * o.element_size() >= 1 << 20]
    mine = {id(seen)}
    chains = []
    for tensor in sorted(seen, key=lambda t: -t.numel() * t.element_size())[:limit]:
        chain, obj = [], tensor
        for _ in range(depth):
            refs = [r for r in gc.get_referrers(obj) if id(r) not in mine and not isinstance(r, types.FrameType)
                    and r is not seen]
            if not refs:
                break
            chain.append(" | ".join(_describe(r, obj) for r in refs[:3]))
            obj = refs[0]
        chains.append({"shape": list(tensor.shape), "dtype": str(tensor.dtype),
                       "mib": tensor.numel() * tensor.element_size() >> 20, "referrers": chain})
    return {"tensors": len(seen), "mib": sum(t.numel() * t.element_size() for t in seen) >> 20,
            "largest": chains}


def used_mib() -> int:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True).stdout.split()
    return int(out[0]) if out else -1


async def main() -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--holders", action="store_true", help="after the first sleep, list what holds device memory")
    args = ap.parse_args()
    _without_grpc_tools()
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from cluster.memory import engine_released, release_heap
    from engine.async_engine import AsyncLLMEngine
    from records.config_resolution import engine_config
    from records.sampling_params import SamplingParams

    path = tempfile.mkdtemp()
    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                      num_attention_heads=args.hidden // 128, num_key_value_heads=8, vocab_size=32000,
                      max_position_embeddings=4096, torch_dtype="bfloat16")
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    config = engine_config(path, dtype="bfloat16", max_model_len=2048, worker_num_gpus=1)
    prompt = list(range(1, 65))
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)

    async def tokens(engine) -> list[int]:
        out = []
        async for o in engine.generate("r", prompt, params):
            out = list(o.outputs[0].token_ids)
        return out

    row: dict = {"used_mib_start": used_mib()}
    began = time.monotonic()
    engine = AsyncLLMEngine(config)
    row["first_build_s"] = time.monotonic() - began
    want = await tokens(engine)
    torch.cuda.synchronize()
    row.update(awake_allocated_mib=torch.cuda.memory_allocated() >> 20,
               awake_reserved_mib=torch.cuda.memory_reserved() >> 20, awake_used_mib=used_mib())
    for level in (1, 2):
        began = time.monotonic()
        await engine.shutdown()             # (what EngineReplica.sleep does to its engine)
        await engine_released(engine)
        del engine
        release_heap()
        row[f"sleep{level}_s"] = time.monotonic() - began
        row.update({f"asleep{level}_allocated_mib": torch.cuda.memory_allocated() >> 20,
                    f"asleep{level}_reserved_mib": torch.cuda.memory_reserved() >> 20,
                    f"asleep{level}_used_mib": used_mib()})
        if level == 2:
            from cluster.memory import drop_page_cache
            drop_page_cache(path)
        began = time.monotonic()
        engine = await asyncio.to_thread(AsyncLLMEngine, config)
        row[f"wake{level}_s"] = time.monotonic() - began
        row[f"same_tokens_after_wake{level}"] = await tokens(engine) == want
    return row


if __name__ == "__main__":
    result = asyncio.run(main())
    out = os.environ.get("OUT", "/tmp")
    with open(os.path.join(out, "sleep_wake_gpu.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))
