"""The Batch API beside interactive traffic: does a batch cost the interactive streams their latency?

    .venv/bin/python benchmarks/batch.py            # ~6 min on 2 cores

`pdserve serve` of the embedded model (or --model), one replica (max_num_seqs --max-num-seqs). An
interactive load (streamed chat completions, Poisson arrivals at --rate per second, --output-len
tokens each) runs for --seconds alone, then again (other prompts of the same shape) while a batch of
200 requests runs, submitted with the `openai` client (120 chat, 50 completions, 30 embeddings: one
batch per endpoint, greedy), in fp32 (--dtype). Reported: the interactive TTFT and ITL (p50, p99) of both runs and
their ratio; how long the batches took and their counts; and whether each batch output's body
equals the same request sent directly afterwards (greedy text, usage; embeddings within 1e-5).
"""
from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve import served  # benchmarks/ is the script's own directory
from tenants import pct

TOPICS = ["the sea", "a city at night", "mountains", "a library", "rain", "an old train", "the moon", "a garden"]


def batch_lines(model: str) -> dict[str, list[dict]]:
    chat = [{"custom_id": f"chat-{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": model, "temperature": 0, "max_tokens": 8 + i % 24,
                      "messages": [{"role": "user", "content": f"Tell me about {TOPICS[i % 8]} ({i})."}]}}
            for i in range(120)]
    completions = [{"custom_id": f"cmpl-{i}", "method": "POST", "url": "/v1/completions",
                    "body": {"model": model, "temperature": 0, "max_tokens": 16,
                             "prompt": f"Story {i}: once upon a time, {TOPICS[i % 8]}"}} for i in range(50)]
    embeddings = [{"custom_id": f"emb-{i}", "method": "POST", "url": "/v1/embeddings",
                   "body": {"model": model, "input": f"A note about {TOPICS[i % 8]}, number {i}.",
                            "encoding_format": "float"}} for i in range(30)]
    return {"/v1/chat/completions": chat, "/v1/completions": completions, "/v1/embeddings": embeddings}


async def interactive(base: str, model: str, args: argparse.Namespace, seed: int) -> tuple[list, list]:
    """(TTFTs, ITLs) of streamed chats arriving at args.rate per second for args.seconds."""
    import httpx

    rng = random.Random(seed)
    ttfts: list[float] = []
    itls: list[float] = []

    async def one(client: httpx.AsyncClient, i: int) -> None:
        body = {"model": model, "stream": True, "max_tokens": args.output_len, "ignore_eos": True,
                "temperature": 0, "messages": [{"role": "user", "content": f"Chat {seed}-{i}: {rng.random()}"}]}
        start = last = time.perf_counter()
        first = True
        async with client.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: {") or '"content":""' in line.replace(" ", ""):
                    continue
                now = time.perf_counter()
                (ttfts if first else itls).append(now - (start if first else last))
                first, last = False, now

    async with httpx.AsyncClient(timeout=600) as client:
        tasks = []
        t_end = time.perf_counter() + args.seconds
        i = 0
        while time.perf_counter() < t_end:
            tasks.append(asyncio.ensure_future(one(client, i)))
            i += 1
            await asyncio.sleep(rng.expovariate(args.rate))
        await asyncio.gather(*tasks)
    return ttfts, itls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M GGUF")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--rate", type=float, default=1.0, help="interactive requests per second")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--dtype", default="float32", help="greedy outputs compare exactly in fp32")
    args = ap.parse_args()
    import httpx
    import openai

    files_dir = tempfile.mkdtemp(prefix="pdserve-batch-bench-")
    model_line = f"model: {args.model}\n" if args.model else ""
    spec = (f"{model_line}pools: {{decode: {{replicas: 1}}}}\n"
            f"engine: {{max_num_seqs: {args.max_num_seqs}, dtype: {args.dtype}}}\n"
            f"serving: {{port: PORT, files_dir: {files_dir}}}\n")
    with served(spec) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        print(f"pdserve serve, model {args.model or 'embedded'}, 1 replica, max_num_seqs {args.max_num_seqs}; "
              f"interactive chats at {args.rate}/s x {args.output_len} tokens for {args.seconds:.0f} s")
        asyncio.run(interactive(base, model, argparse.Namespace(**{**vars(args), "seconds": 5}), 0))     # warm
        alone = asyncio.run(interactive(base, model, args, 1))
        lines = batch_lines(model)
        t0 = time.perf_counter()
        batches = []
        for endpoint, group in lines.items():
            data = "".join(json.dumps(x) + "\n" for x in group).encode()
            file_id = client.files.create(file=("b.jsonl", io.BytesIO(data)), purpose="batch").id
            batches.append(client.batches.create(input_file_id=file_id, endpoint=endpoint, completion_window="24h"))
        beside = asyncio.run(interactive(base, model, args, 2))
        during = {b.id: client.batches.retrieve(b.id).request_counts.completed for b in batches}
        while True:
            states = [client.batches.retrieve(b.id) for b in batches]
            if all(s.status in ("completed", "failed", "cancelled", "expired") for s in states):
                break
            time.sleep(1.0)
        took = time.perf_counter() - t0
        for label, (ttft, itl) in (("alone", alone), ("beside the batch", beside)):
            print(f"  interactive {label}: TTFT p50 {pct(ttft, 50) * 1e3:.0f} ms p99 {pct(ttft, 99) * 1e3:.0f} ms; "
                  f"ITL p50 {pct(itl, 50) * 1e3:.1f} ms p99 {pct(itl, 99) * 1e3:.1f} ms ({len(ttft)} requests)")
        print(f"  ratio beside / alone: ITL p99 {pct(beside[1], 99) / pct(alone[1], 99):.2f}x, "
              f"ITL p50 {pct(beside[1], 50) / pct(alone[1], 50):.2f}x, "
              f"TTFT p50 {pct(beside[0], 50) / pct(alone[0], 50):.2f}x")
        print(f"  batches: {sum(s.request_counts.total for s in states)} requests, "
              f"{sum(s.request_counts.completed for s in states)} completed, "
              f"{sum(s.request_counts.failed for s in states)} failed, in {took:.0f} s "
              f"({sum(during.values())} done while the interactive load ran)")
        text = httpx.get(f"{base}/metrics", timeout=30).text
        for name in ("pdserve:tenant_queue_time_seconds", "pdserve:request_queue_time_seconds"):
            total_s = sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.startswith(name + "_sum"))
            count = sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.startswith(name + "_count"))
            print(f"  {name}: mean {total_s / max(count, 1) * 1e3:.0f} ms over {count:.0f} requests")
        same = total = 0
        for state in states:
            outputs = {r["custom_id"]: r["response"]["body"]
                       for r in map(json.loads, client.files.content(state.output_file_id).text.splitlines())}
            for line in lines[state.endpoint]:
                total += 1
                got = outputs.get(line["custom_id"])
                direct = httpx.post(f"{base}{state.endpoint}", json=line["body"], timeout=600).json()
                if got is None:
                    continue
                if state.endpoint == "/v1/embeddings":
                    ok = max(abs(a - b) for a, b in zip(got["data"][0]["embedding"],
                                                        direct["data"][0]["embedding"])) <= 1e-5
                else:       # the usage's cached tokens differ: the direct one hits the batch's blocks
                    ok = got["choices"] == direct["choices"] and all(
                        got["usage"][k] == direct["usage"][k] for k in ("prompt_tokens", "completion_tokens"))
                same += ok
        print(f"  output bodies equal to the same requests sent directly: {same}/{total}")


if __name__ == "__main__":
    main()
