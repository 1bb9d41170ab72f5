"""Two tenants on one server, one flooding: does the light one keep its latency?

    .venv/bin/python benchmarks/tenants.py              # ~3 min on 2 cores

`pdserve serve` of the embedded model (or --model), one colocated replica, with two tenants of
equal weight ("light" and "heavy", each its own key) and `serving.max_in_flight` --max-in-flight.
First the server's capacity is measured (a closed loop at --max-num-seqs concurrent requests: X
requests/s). Then, each for --seconds: the light tenant alone, Poisson arrivals at --light-share of
X (its unloaded TTFT); and the light tenant at the same rate while the heavy one sends ten times as
many (the two together above capacity). The same loaded run is repeated with both tenants sending
under one key (no fair queue between them: what one shared key gives), for comparison. Reported:
the light tenant's TTFT p50 / p90 in each run and the loaded-to-unloaded ratio, the heavy tenant's
requests answered and refused (429, with the Retry-After the server sent), and the per-tenant
series of /metrics. Requests: --input-len random tokens in, --output-len out (ignore_eos), streamed.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.append(os.path.join(ROOT, "benchmarks"))
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
from serve import served

KEYS = {"light": "light-key", "heavy": "heavy-key", "shared": "shared-key"}


async def one(client, base: str, key: str, prompt: list[int], args: argparse.Namespace) -> tuple[float | None, str]:
    """(TTFT or None, outcome: ok, 429 with its Retry-After, or the error)."""
    body = {"model": args.served, "prompt": prompt, "max_tokens": args.output_len, "temperature": 0.0,
            "stream": True, "ignore_eos": True}
    start = time.perf_counter()
    async with client.stream("POST", f"{base}/v1/completions", json=body,
                             headers={"Authorization": f"Bearer {key}"}) as r:
        if r.status_code != 200:
            await r.aread()
            return None, f"{r.status_code} retry-after={r.headers.get('retry-after')}"
        ttft = None
        async for line in r.aiter_lines():
            if ttft is None and line.startswith("data: {"):
                ttft = time.perf_counter() - start
        return ttft, "ok"


async def load(base: str, args: argparse.Namespace, streams: dict[str, tuple[str, float]], seconds: float,
               seed: int) -> dict[str, list[tuple[float | None, str]]]:
    """Poisson arrivals per stream (name -> (key, requests/s)) for `seconds`; every outcome by stream."""
    import httpx

    rng = random.Random(seed)
    out: dict[str, list] = {name: [] for name in streams}
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=2000)) as client:
        tasks = []

        async def arrivals(name: str, key: str, rate: float) -> None:
            t_end = time.perf_counter() + seconds
            while time.perf_counter() < t_end:
                prompt = [rng.randrange(100, 20000) for _ in range(args.input_len)]
                tasks.append(asyncio.ensure_future(one(client, base, key, prompt, args)))
                tasks[-1].add_done_callback(lambda t, name=name: out[name].append(t.result()))
                await asyncio.sleep(rng.expovariate(rate))

        await asyncio.gather(*(arrivals(name, key, rate) for name, (key, rate) in streams.items()))
        await asyncio.gather(*tasks)
    return out


async def capacity(base: str, args: argparse.Namespace) -> float:
    """Requests/s a closed loop of max_num_seqs streams gets."""
    import httpx

    rng = random.Random(7)
    done = 0
    async with httpx.AsyncClient(timeout=600) as client:
        t_end = time.perf_counter() + args.seconds / 2

        async def loop() -> None:
            nonlocal done
            while time.perf_counter() < t_end:
                await one(client, base, KEYS["shared"], [rng.randrange(100, 20000) for _ in range(args.input_len)],
                          args)
                done += 1
        t0 = time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(args.max_num_seqs)))
        return done / (time.perf_counter() - t0)


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else values[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M GGUF")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--max-in-flight", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--light-share", type=float, default=0.15, help="light's rate, as a fraction of capacity")
    ap.add_argument("--seconds", type=float, default=30.0)
    args = ap.parse_args()
    import httpx

    model = f"model: {args.model}\n" if args.model else ""
    tenants = ", ".join(f"{name}: {{api_keys: [{key}]}}" for name, key in KEYS.items())
    spec = (f"{model}pools: {{decode: {{replicas: 1}}}}\nengine: {{max_num_seqs: {args.max_num_seqs}}}\n"
            f"serving: {{port: PORT, max_in_flight: {args.max_in_flight}, tenants: {{{tenants}}}}}\n")
    with served(spec) as base:
        args.served = httpx.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {KEYS['shared']}"}
                                ).json()["data"][0]["id"]
        x = asyncio.run(capacity(base, args))
        light = x * args.light_share
        print(f"pdserve serve, model {args.model or 'embedded'}, 1 replica, max_num_seqs {args.max_num_seqs}, "
              f"max_in_flight {args.max_in_flight}; {args.input_len} tokens in, {args.output_len} out")
        print(f"  capacity {x:.1f} requests/s; light {light:.2f}/s, heavy {10 * light:.2f}/s "
              f"(together {11 * args.light_share:.2f}x capacity), {args.seconds:.0f} s each")
        alone = asyncio.run(load(base, args, {"light": (KEYS["light"], light)}, args.seconds, 1))["light"]
        base_ttft = [t for t, o in alone if o == "ok"]
        p50 = pct(base_ttft, 50)
        print(f"  light alone: TTFT p50 {p50 * 1e3:.0f} ms, p90 {pct(base_ttft, 90) * 1e3:.0f} ms "
              f"({len(base_ttft)} requests)")
        for label, (light_key, heavy_key) in (("two tenants (fair queue)", (KEYS["light"], KEYS["heavy"])),
                                              ("one shared key", (KEYS["shared"], KEYS["shared"]))):
            runs = asyncio.run(load(base, args, {"light": (light_key, light), "heavy": (heavy_key, 10 * light)},
                                    args.seconds, 2))
            mine, heavy = runs["light"], runs["heavy"]
            ttft = [t for t, o in mine if o == "ok"]
            refused = [o for _, o in heavy if o.startswith("429")]
            other = [o for _, o in [*mine, *heavy] if o != "ok" and not o.startswith("429")]
            print(f"  {label}: light TTFT p50 {pct(ttft, 50) * 1e3:.0f} ms ({pct(ttft, 50) / p50:.2f}x alone), "
                  f"p90 {pct(ttft, 90) * 1e3:.0f} ms; light refused {sum(o != 'ok' for _, o in mine)}/{len(mine)}; "
                  f"heavy answered {sum(o == 'ok' for _, o in heavy)}, refused {len(refused)} "
                  f"(e.g. {refused[0] if refused else '-'}); other errors {len(other)}")
        text = httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {KEYS['shared']}"}).text
        print("  /metrics:")
        for line in text.splitlines():
            if line.startswith(("pdserve:tenant_requests_total", "pdserve:tenant_queue_time_seconds_count",
                                "pdserve:tenant_queue_time_seconds_sum")):
                print("    " + line)


if __name__ == "__main__":
    main()
