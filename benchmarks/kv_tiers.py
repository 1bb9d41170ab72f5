"""KV beyond one pool: a multi-tenant, multi-turn chat workload whose system prompts exceed the
replicas' KV pools several times, served by two colocated replicas with prefix-aware routing alone,
then with each replica's offload tier (host memory), then with the tier and peer prefix pulls, one
after the other in one run on a local Ray.

    .venv/bin/python benchmarks/kv_tiers.py                                  # ~10 minutes on 2 cores
    .venv/bin/python benchmarks/kv_tiers.py --tenants 16 --system-tokens 800 --turns 2   # shorter
    .venv/bin/python benchmarks/kv_tiers.py --crossover       # where a pull beats recomputing (~2 min)

The workload: --tenants tenants, each with its own system prompt of about --system-tokens tokens
(a passage of tests/data's text, the tenant named first so no two share a block); each tenant holds
a conversation of --turns user turns, every turn resending the system prompt and the whole
history (the user's questions and the model's greedy answers of --max-tokens tokens). Turn k of every
tenant runs before turn k + 1 of any, --concurrency at a time: between two turns of one tenant the
replicas serve every other tenant, so a pool of --num-kv-blocks blocks has long evicted that
tenant's prefix, which only a tier (or a peer) still holds.

Reported per variant: prompt tokens the engines computed (summed over the replicas, from their
stats), cached prompt tokens (the API's usage.prompt_tokens_details.cached_tokens), client-side TTFT
p50/p99, output tok/s over the run, tier hits, and peer pulls; and the ratio of computed prompt
tokens to prefix-aware routing alone's. Compare the variants of one run, not runs of different days.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TQDM_DISABLE", "1")

TEXT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "data",
                    "pride_and_prejudice_ch1-3.txt")
WORDS_PER_TOKEN = 0.72      # this text under SmolLM2's tokenizer (measured: 1,000 words ~ 1,390 tokens)


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def conversations(tenants: int, system_tokens: int, turns: int) -> list[dict]:
    words = open(TEXT).read().split()
    n = int(system_tokens * WORDS_PER_TOKEN)
    out = []
    for t in range(tenants):
        start = (t * 997) % max(1, len(words) - n)
        system = f"Tenant {t}'s assistant. Answer from this text only:\n" + " ".join(words[start:start + n])
        questions = [f"Question {k + 1} of tenant {t}: who speaks in the passage's paragraph {k + 2}, and why?"
                     for k in range(turns)]
        out.append({"system": system, "questions": questions, "history": []})
    return out


async def one_turn(client, model: str, conv: dict, turn: int, max_tokens: int, samples: dict) -> None:
    messages = [{"role": "system", "content": conv["system"]}]
    for q, a in conv["history"]:
        messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    question = conv["questions"][turn]
    messages.append({"role": "user", "content": question})
    start = time.monotonic()
    first, text, usage = None, [], None
    try:
        stream = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0.0, stream=True,
            stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            if chunk.choices and chunk.choices[0].delta.content:
                if first is None:
                    first = time.monotonic() - start
                text.append(chunk.choices[0].delta.content)
    except Exception as e:  # noqa: BLE001 - counted and reported
        samples["failed"].append(f"{type(e).__name__}: {e}"[:200])
        return
    conv["history"].append((question, "".join(text)))
    if first is not None:
        samples["ttft"].append(first)
    if usage is not None:
        samples["prompt_tokens"] += usage.prompt_tokens
        samples["completion_tokens"] += usage.completion_tokens
        details = usage.prompt_tokens_details
        samples["cached_tokens"] += (details.cached_tokens or 0) if details is not None else 0


async def workload(base: str, convs: list[dict], turns: int, concurrency: int, max_tokens: int) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=900)
    model = (await client.models.list()).data[0].id
    samples = {"ttft": [], "failed": [], "prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}
    gate = asyncio.Semaphore(concurrency)

    async def bounded(conv: dict, turn: int) -> None:
        async with gate:
            await one_turn(client, model, conv, turn, max_tokens, samples)

    start = time.monotonic()
    for turn in range(turns):
        await asyncio.gather(*[bounded(conv, turn) for conv in convs])
    samples["seconds"] = time.monotonic() - start
    return samples


def scrape(base: str) -> dict[str, float]:
    """The ingress's /metrics, every series summed over its labels."""
    totals: dict[str, float] = {}
    for line in urllib.request.urlopen(f"{base}/metrics", timeout=30).read().decode().splitlines():
        m = re.match(r"^(pdserve:[a-z_]+)(?:\{([^}]*)\})? ([0-9.e+-]+)$", line)
        if m:
            key = m.group(1) + ("{" + m.group(2) + "}" if "outcome" in (m.group(2) or "") else "")
            totals[key] = totals.get(key, 0.0) + float(m.group(3))
    return totals


def run_variant(label: str, args: argparse.Namespace, engine: dict, routing: dict) -> dict:
    from cluster.config import ClusterConfig
    from cluster.launch import serve_cluster, shutdown

    config = ClusterConfig(model=args.model, engine=engine, mode="colocated",
                           pools={"decode": {"replicas": 2, "num_cpus": 1}}, routing=routing,
                           serving={"port": args.port, "wait_for_pools": True}, name=f"tiers-{label}")
    base = f"http://127.0.0.1:{args.port}"
    serve_cluster(config, blocking=False)
    try:
        convs = conversations(args.tenants, args.system_tokens, args.turns)
        samples = asyncio.run(workload(base, convs, args.turns, args.concurrency, args.max_tokens))
        time.sleep(2.0)                  # one more stats poll of the replicas
        metrics = scrape(base)
    finally:
        shutdown(config)
    return {
        "label": label, "requests": args.tenants * args.turns, "failed": len(samples["failed"]),
        "errors": samples["failed"][:3], "prompt_tokens": samples["prompt_tokens"],
        "prompt_tokens_computed": int(metrics.get("pdserve:prompt_tokens_computed_total", 0)),
        "cached_tokens": samples["cached_tokens"],
        "ttft_p50_ms": _ms(pct(samples["ttft"], 0.5)), "ttft_p99_ms": _ms(pct(samples["ttft"], 0.99)),
        "output_tok_s": round(samples["completion_tokens"] / samples["seconds"], 1),
        "seconds": round(samples["seconds"], 1),
        "tier_hit_blocks": int(metrics.get("pdserve:kv_offload_host_hit_blocks_total", 0)
                               + metrics.get("pdserve:kv_offload_disk_hit_blocks_total", 0)),
        "peer_pulls": {k.split('outcome="')[1].split('"')[0]: int(v) for k, v in metrics.items()
                       if k.startswith("pdserve:peer_prefix_pulls_total")},
        "kv_blocks_pulled": int(metrics.get("pdserve:kv_blocks_transferred_total", 0)),
    }


def crossover(args: argparse.Namespace) -> list[dict]:
    """Where a pull pays: time to first token of a prompt of `n` prefix tokens and a 16-token question
    when another engine holds the prefix (pulled over NIXL: lease_prefix, pull, compute the question),
    against computing it all, and against loading the prefix from the host tier, in this process
    on the embedded model (one torch thread, engines stepped alternately, as tests/kv_transfer/
    does). Medians of --repeats, after a warm-up."""
    import statistics

    import torch

    from engine.llm_engine import LLMEngine
    from records.config_resolution import engine_config
    from records.hashing import hash_block_tokens
    from records.sampling_params import SamplingParams

    torch.set_num_threads(1)
    make = lambda **kw: LLMEngine(engine_config(args.model, max_model_len=2048, num_kv_blocks=160,  # noqa: E731
                                                      kv_connector="nixl", **kw))
    peer, here = make(), make(kv_offloading_size=1.0)
    params = SamplingParams(temperature=0, max_tokens=1)
    words = open(TEXT).read().split()
    rows = []

    def first_token(engine, rid, ids, kv=None, others=()) -> float:
        start = time.perf_counter()
        engine.add_request(rid, None, ids, params, kv_transfer_params=kv)
        while True:
            if any(o.request_id == rid and o.finished for o in engine.step()):
                took = time.perf_counter() - start
                break
            for o in others:
                o.step()
        while any(e.has_unfinished_requests() for e in (engine, *others)):
            for e in (engine, *others):
                e.step()
        return took

    for n in [int(x) for x in args.crossover_tokens.split(",")]:
        times: dict[str, list[float]] = {"computed": [], "pulled": [], "tier": []}
        for rep in range(args.repeats + 1):
            text = " ".join(words[(rep * 131 + n) % 5000:][:n * 2])
            prefix = here.tokenizer.encode(text)[:n]
            ids, other = prefix + [17] * 16, prefix + [23] * 16   # one prefix, two 16-token questions
            here.reset_prefix_cache()
            peer.reset_prefix_cache()
            computed = first_token(here, f"c{n}-{rep}", ids)
            first_token(peer, f"p{n}-{rep}", other)                # the peer caches the prefix
            here.reset_prefix_cache()
            kv = peer.lease_prefix(hash_block_tokens(ids, 16))
            pulled = first_token(here, f"l{n}-{rep}", ids, kv, (peer,))
            # The tier: evict the prefix from here's pool (fill it with another prompt), then ask again.
            here.reset_prefix_cache()
            first_token(here, f"t{n}-{rep}", other)
            first_token(here, f"f{n}-{rep}", [(7 * i) % 5000 + 9 for i in range(2000)])   # 125 of 160 blocks
            tier = first_token(here, f"u{n}-{rep}", ids)
            if rep:                                                 # rep 0 warms up
                for k, v in (("computed", computed), ("pulled", pulled), ("tier", tier)):
                    times[k].append(v)
        row = {"prefix_tokens": n, **{f"{k}_ms": round(statistics.median(v) * 1e3, 1) for k, v in times.items()}}
        rows.append(row)
        print(f"prefix {n:>5} tokens: TTFT computed {row['computed_ms']:>7} ms, pulled from a peer "
              f"{row['pulled_ms']:>7} ms, loaded from the host tier {row['tier_ms']:>7} ms", flush=True)
    return rows


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--tenants", type=int, default=32)
    ap.add_argument("--system-tokens", type=int, default=1500)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--num-kv-blocks", type=int, default=512, help="KV blocks per replica (16 tokens each)")
    ap.add_argument("--tier-gib", type=float, default=2.5, help="host tier per replica (GiB)")
    ap.add_argument("--min-peer-pull-tokens", type=int, default=128)
    ap.add_argument("--variants", default="off,host,host+peers")
    ap.add_argument("--port", type=int, default=8124)
    ap.add_argument("--result", default=None, help="write the report as JSON here")
    ap.add_argument("--crossover", action="store_true",
                    help="instead: TTFT of a prefix pulled from a peer / loaded from the tier / computed, by length")
    ap.add_argument("--crossover-tokens", default="32,64,128,256,512,1024")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.crossover:
        rows = crossover(args)
        if args.result:
            with open(args.result, "w") as f:
                json.dump({"args": vars(args), "crossover": rows}, f, indent=2)
        return

    from cluster.launch import init_ray

    init_ray(num_cpus=4)
    engine = {"max_model_len": min(4096, 16 * args.num_kv_blocks), "num_kv_blocks": args.num_kv_blocks,
              "max_num_seqs": 16}
    variants = {
        "off": (engine, {}),
        "host": ({**engine, "kv_offloading_size": args.tier_gib}, {}),
        "host+peers": ({**engine, "kv_offloading_size": args.tier_gib},
                       {"peer_prefix_pulls": True, "min_peer_pull_tokens": args.min_peer_pull_tokens}),
    }
    report = {"args": vars(args), "variants": [run_variant(name, args, *variants[name])
                                               for name in args.variants.split(",")]}
    base = report["variants"][0]["prompt_tokens_computed"] or 1
    print(f"{'variant':<12} {'computed':>9} {'ratio':>6} {'cached':>8} {'TTFT p50':>9} {'p99':>8} "
          f"{'tok/s':>6} {'tier hits':>9}  peer pulls / blocks   failed")
    for v in report["variants"]:
        v["computed_ratio"] = round(v["prompt_tokens_computed"] / base, 3)
        print(f"{v['label']:<12} {v['prompt_tokens_computed']:>9} {v['computed_ratio']:>6} {v['cached_tokens']:>8} "
              f"{v['ttft_p50_ms']:>9} {v['ttft_p99_ms']:>8} {v['output_tok_s']:>6} {v['tier_hit_blocks']:>9}  "
              f"{v['peer_pulls']} / {v['kv_blocks_pulled']}   {v['failed']}")
    if args.result:
        with open(args.result, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
