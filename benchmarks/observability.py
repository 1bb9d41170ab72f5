"""What observability costs and how well the server's latency histograms match a client's.

    .venv/bin/python benchmarks/observability.py --overhead      # tracing off / on, per token (~1 min)
    .venv/bin/python benchmarks/observability.py --ttft          # served TTFT vs the client's (~3 min)

--overhead: one engine in this process (the embedded model, or --model) decodes the same batch of
--requests greedy requests of --max-tokens tokens, in turns: tracing off (no tracer: what every
deployment without --otlp-traces-endpoint runs), then on (every request traced to an in-memory
exporter: the engine records its spans at each request's end), --rounds times. Reported: wall time
per generated token of each (the median of the rounds) and their difference; and the cost of the
per-request bookkeeping itself (RequestTelemetry.finished: histograms, plus spans when traced),
timed alone over the same requests' records.

--ttft: `pdserve serve` of --model (P/D, serving.direct_ingress unless --through-proxy) on a local
Ray, the benchmark client (benchmarks/serve.py) at each --concurrency, and the server's TTFT
histogram read off /metrics before and after each run (what Prometheus scrapes): its p50 and p90
(histogram_quantile's interpolation) against the client's own TTFTs read through the same buckets,
and the means (the histogram's sum / count against the client's mean). The difference is the part of
the path the server cannot see (the last socket write, the client's own loop; and Serve's proxy when
there is one).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.append(os.path.join(ROOT, "benchmarks"))      # after ROOT: benchmarks/kernels.py is not `kernels`
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def overhead(args: argparse.Namespace) -> None:
    import torch
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    import engine.tracing as tracing
    from engine.llm_engine import LLMEngine
    from records.config_resolution import engine_config
    from records.sampling_params import SamplingParams

    torch.set_num_threads(args.threads)
    engine = LLMEngine(engine_config(args.model, max_model_len=1024, max_num_seqs=args.requests))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    carrier = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    prompts = [[(i * 37 + j * 11) % 5000 + 100 for j in range(64)] for i in range(args.requests)]
    spans = 0
    states = []
    finished = engine.output.forget

    def keep(state):            # the records of the traced requests, to time the bookkeeping alone
        states.append(state)
        finished(state)

    def batch(traced: bool, tag: str) -> float:
        for i, ids in enumerate(prompts):
            engine.add_request(f"{tag}-{i}", None, ids, params, trace_context=carrier if traced else None)
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        return (time.perf_counter() - t0) / (args.requests * args.max_tokens)

    batch(False, "warm")
    per_token: dict[str, list[float]] = {"off": [], "on": []}
    for r in range(args.rounds):
        tracing.shutdown()
        per_token["off"].append(batch(False, f"off{r}"))
        exporter = InMemorySpanExporter()       # one a round: a tracer's shutdown stops its exporter
        tracing.use_exporter(exporter)
        engine.output.forget = keep
        per_token["on"].append(batch(True, f"on{r}"))
        engine.output.forget = finished
        spans += len(exporter.get_finished_spans())
    tracing.shutdown()
    off, on = statistics.median(per_token["off"]), statistics.median(per_token["on"])
    print(f"model {args.model or 'embedded SmolLM2-135M Q4_1'}, {args.requests} requests x {args.max_tokens} tokens, "
          f"{args.rounds} rounds, {args.threads} torch threads")
    print(f"  per token: tracing off {off * 1e3:.3f} ms, on {on * 1e3:.3f} ms ({(on - off) * 1e6:+.1f} us, "
          f"{(on / off - 1) * 100:+.1f}%); {spans} spans ({spans / (args.rounds * args.requests):.0f} per request)")
    # The bookkeeping alone, per request, over the traced requests' records.
    tele = engine.telemetry
    now = time.monotonic()
    t0 = time.perf_counter()
    for state in states:
        state.trace_context = None
        tele.finished(state, now)
    plain = (time.perf_counter() - t0) / len(states)
    tracing.use_exporter(InMemorySpanExporter())
    t0 = time.perf_counter()
    for state in states:
        state.trace_context = carrier
        tele.finished(state, now)
    traced = (time.perf_counter() - t0) / len(states)
    tracing.shutdown()
    print(f"  per request: histograms only {plain * 1e6:.1f} us ({plain / args.max_tokens * 1e6:.2f} us per token), "
          f"with its spans {traced * 1e6:.1f} us ({traced / args.max_tokens * 1e6:.2f} us per token)")


def ttft(args: argparse.Namespace) -> None:
    import httpx
    import serve as bench
    import workloads

    from records.histogram import VLLM_TTFT_BUCKETS, Histogram, quantile

    model = f"model: {args.model}\n" if args.model else ""
    spec = (f"{model}mode: disaggregated\npools: {{prefill: {{}}, decode: {{}}}}\n"
            f"serving: {{port: PORT, direct_ingress: {'false' if args.through_proxy else 'true'}}}\n")
    with bench.served(spec) as base:
        def buckets() -> tuple[list[float], float, float]:
            cumulative: dict[float, float] = {}
            total = count = 0.0
            for line in httpx.get(f"{base}/metrics", timeout=30).text.splitlines():
                if 'pool="decode"' not in line:
                    continue
                value = float(line.rsplit(" ", 1)[1])
                if line.startswith("pdserve:time_to_first_token_seconds_bucket{"):
                    le = float(line.split('le="')[1].split('"')[0])
                    cumulative[le] = cumulative.get(le, 0.0) + value
                elif line.startswith("pdserve:time_to_first_token_seconds_sum{"):
                    total += value
                elif line.startswith("pdserve:time_to_first_token_seconds_count{"):
                    count += value
            ordered = [cumulative.get(b, 0.0) for b in (*VLLM_TTFT_BUCKETS, float("inf"))]
            return [c - p for c, p in zip(ordered, [0.0, *ordered[:-1]])], total, count

        print(f"pdserve serve ({'through Serve proxy' if args.through_proxy else 'direct ingress'}), "
              f"model {args.model or 'embedded'}, prompts {args.input_len} tokens, {args.output_len} out")
        for concurrency in args.concurrency:
            ap = argparse.ArgumentParser()
            bench.add_args(ap)
            # A seed per run: the prompts of one run are not in the prefix cache of another.
            bargs = ap.parse_args(["--dataset", "random", "--input-len", args.input_len, "--output-len",
                                   str(args.output_len), "--num-prompts", str(args.num_prompts), "--concurrency",
                                   str(concurrency), "--warmup", "2", "--quiet", "--seed", str(concurrency)])
            bargs.base_url = base
            readings: list = []            # at the start and the end of the timed part (not the warmup)
            results, _, _ = asyncio.run(bench.run(bargs, workloads.make_dataset(bargs),
                                                  on_timed=lambda: readings.append(buckets())))
            before, after = readings
            counts = [a - b for a, b in zip(after[0], before[0])]
            server_mean = (after[1] - before[1]) / max(1.0, after[2] - before[2])
            client = Histogram(VLLM_TTFT_BUCKETS)
            for r in results:
                client.observe(r.ttft)
            row = []
            for q in (0.5, 0.9):
                s, c = quantile(counts, q, VLLM_TTFT_BUCKETS), quantile(client.counts, q, VLLM_TTFT_BUCKETS)
                row.append(f"p{int(q * 100)} server {s * 1e3:.0f} / client {c * 1e3:.0f} ms ({s / c:.2f}x)")
            client_mean = statistics.mean(r.ttft for r in results)
            print(f"  concurrency {concurrency}: " + "; ".join(row)
                  + f"; mean server {server_mean * 1e3:.0f} / client {client_mean * 1e3:.0f} ms "
                    f"({server_mean / client_mean:.2f}x); {int(after[2] - before[2])} counted, {len(results)} sent")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--overhead", action="store_true")
    ap.add_argument("--ttft", action="store_true")
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M GGUF")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--input-len", default="256:512")
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--through-proxy", action="store_true", help="serve through Serve's HTTP proxy")
    args = ap.parse_args()
    if not (args.overhead or args.ttft):
        ap.error("say --overhead, --ttft or both")
    if args.overhead:
        overhead(args)
    if args.ttft:
        ttft(args)


if __name__ == "__main__":
    main()
