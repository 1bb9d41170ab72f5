"""Per-token overhead of the gRPC path against the HTTP/SSE path, in one run, on one Serve app.

Starts a local Ray and one Serve app (a tiny random Llama, as in tests/conftest.py, one decode
replica) with HTTP and gRPC both on 127.0.0.1, then sends the same greedy token-id requests
(`--output-len` tokens, ignore_eos) through each path at each concurrency, alternating the paths
round by round so that both see the same machine state. TTFT = request sent -> first message with
tokens; ITL = gaps between such messages (one per engine step on both paths: SSE chunks, gRPC
GenerateResponses). Prints medians (ms) per path and concurrency.

    .venv/bin/python benchmarks/grpc_overhead.py --num-requests 48 --output-len 32 --concurrency 1,16
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_tiny_llama(out: str) -> str:
    """The tests' tiny Llama (2 layers, hidden 64) with the embedded model's tokenizer."""
    sys.path.append(os.path.dirname(os.path.abspath(__file__)))   # after the repo: benchmarks/kernels.py
    from step_overhead import make_tiny_model

    return make_tiny_model(out, hidden=64, heads=4, kv_heads=2, intermediate=128, tied=False)


async def http_one(client, base: str, prompt: list[int], n: int) -> tuple[float, list[float]]:
    body = {"model": client.model_name, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "stream": True}
    start = time.perf_counter()
    stamps = []
    async with client.stream("POST", f"{base}/v1/completions", json=body) as resp:
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("choices"):          # one chunk per engine step (text may be empty)
                    stamps.append(time.perf_counter())
    return stamps[0] - start, [b - a for a, b in zip(stamps, stamps[1:])]


async def grpc_one(stub, pb2, prompt: list[int], n: int) -> tuple[float, list[float]]:
    request = pb2.GenerateRequest(token_ids=pb2.TokenIds(ids=prompt), sampling=pb2.SamplingOptions(
        max_tokens=n, temperature=0, ignore_eos=True))
    start = time.perf_counter()
    stamps = []
    async for msg in stub.Generate(request):
        if msg.token_ids:
            stamps.append(time.perf_counter())
    return stamps[0] - start, [b - a for a, b in zip(stamps, stamps[1:])]


async def run(args: argparse.Namespace, base: str, grpc_target: str, vocab: int) -> dict:
    import random

    import grpc
    import httpx

    from pdserve_proto import pb2, pb2_grpc

    rng = random.Random(0)
    prompts = [[rng.randrange(100, vocab) for _ in range(args.input_len)] for _ in range(args.num_requests)]
    results: dict = {}
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=64)) as client, \
            grpc.aio.insecure_channel(grpc_target) as channel:
        stub = pb2_grpc.GenerationStub(channel)
        client.model_name = (await client.get(f"{base}/v1/models")).json()["data"][0]["id"]
        for path in ("http", "grpc"):                         # warm up both paths
            await (http_one(client, base, prompts[0], 4) if path == "http" else grpc_one(stub, pb2, prompts[0], 4))
        for conc in args.concurrency:
            acc = {"http": ([], []), "grpc": ([], [])}
            for round_start in range(0, args.num_requests, conc):
                batch = prompts[round_start:round_start + conc]
                for path in (("http", "grpc") if (round_start // conc) % 2 == 0 else ("grpc", "http")):
                    coros = [http_one(client, base, p, args.output_len) if path == "http"
                             else grpc_one(stub, pb2, p, args.output_len) for p in batch]
                    for ttft, itl in await asyncio.gather(*coros):
                        acc[path][0].append(ttft)
                        acc[path][1].extend(itl)
            for path, (ttfts, itls) in acc.items():
                results[f"{path}@{conc}"] = {"ttft_ms_p50": 1000 * statistics.median(ttfts),
                                             "itl_ms_p50": 1000 * statistics.median(itls),
                                             "requests": len(ttfts)}
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=48, help="per path and concurrency")
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--num-cpus", type=int, default=8)
    args = ap.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]

    import ray
    from ray import serve

    from cluster.app import build_app
    from cluster.config import ClusterConfig
    from cluster.launch import grpc_start_options, init_ray
    from cluster.manager import MANAGER_NAME

    model = make_tiny_llama(tempfile.mkdtemp(prefix="pdserve-tiny-"))
    init_ray(num_cpus=args.num_cpus)
    http_port, grpc_port = _free_port(), _free_port()
    config = ClusterConfig(model=model, engine={"dtype": "float32", "max_model_len": 1024, "max_num_seqs": 32},
                           pools={"decode": {"replicas": 1, "num_cpus": 1}},
                           serving={"port": http_port, "grpc_port": grpc_port}, name="pdserve-grpc-bench")
    serve.start(http_options={"host": "127.0.0.1", "port": http_port}, **grpc_start_options(config))
    serve.run(build_app(config), name=config.name, route_prefix="/")
    try:
        from transformers import AutoConfig
        vocab = AutoConfig.from_pretrained(model).vocab_size
        results = asyncio.run(run(args, f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}", vocab))
    finally:
        serve.shutdown()
        manager = ray.get_actor(MANAGER_NAME, namespace=config.name)
        ray.get(manager.shutdown.remote())
    print(f"{'path@concurrency':<18}{'TTFT p50 ms':>13}{'ITL p50 ms':>12}{'requests':>10}")
    for key, r in results.items():
        print(f"{key:<18}{r['ttft_ms_p50']:>13.1f}{r['itl_ms_p50']:>12.2f}{r['requests']:>10}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
