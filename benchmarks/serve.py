"""Serving benchmark against any OpenAI-compatible endpoint (pdserve, vLLM, ...).

Sends a workload to `POST {base_url}/v1/completions` with `stream: true` and measures, per request,
the time to first token (TTFT), the time per output token after the first (TPOT), the gaps between
streamed chunks (ITL) and the end-to-end latency (E2E); then their mean, median, p90 and p99, request
and token throughput, and goodput (requests per second that met every SLO given).

Datasets (`--dataset`: random, sharegpt, prefix, multiturn, mixed): benchmarks/workloads.py.

Load: `--request-rate R` (Poisson arrivals; `--burstiness` < 1 burstier, > 1 more regular: gamma-
distributed gaps as in vLLM's benchmark) or `--concurrency C` (C requests in flight at all times);
the first `--warmup` requests run before timing and are excluded.

    .venv/bin/python benchmarks/serve.py --base-url http://127.0.0.1:8000 --dataset random \\
        --input-len 128:512 --output-len 64 --num-prompts 64 --request-rate 2 --result out.json

`--scrape-metric NAME` (repeatable) reads the server's Prometheus `/metrics` before and after the
timed part and reports each series' increase (e.g. `pdserve:prompt_tokens_computed_total`, or vLLM's
`vllm:prompt_tokens_total`); `--metrics-url` when they are not at `{base_url}/metrics`.

`--plot out.png` draws the latency CDFs (needs matplotlib: `pip install -e .[bench]`);
`benchmarks/plots.py` draws CDFs of several results and throughput against request rate.
`benchmarks/compare.py` runs the same workload against two endpoints and prints the ratios.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from workloads import DATASETS, BenchRequest, add_trace_args, make_dataset


@dataclass
class RequestResult:
    ok: bool
    prompt_len: int = 0                    # tokens, as the server counted them (usage)
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    text: str = ""
    error: str = ""
    cls: str = ""

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def arrival_gaps(rate: float, burstiness: float, count: int, seed: int) -> Iterator[float]:
    """Seconds between arrivals: gamma with mean 1/rate and shape `burstiness` (1 = Poisson)."""
    rng = random.Random(seed + 1)
    for _ in range(count):
        yield 0.0 if rate == float("inf") else rng.gammavariate(burstiness, 1.0 / (rate * burstiness))


@contextlib.contextmanager
def served(spec_yaml: str) -> Iterator[str]:
    """`pdserve serve --config` of a spec (PORT in it becomes a free port) on a local Ray; yields
    the base URL once /health answers, and stops the server (SIGINT, then SIGKILL) at the end."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.join(root, "tests"))
    from helpers import free_port

    port = free_port()
    spec = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"pdserve-bench-{port}.yaml")
    with open(spec, "w") as f:
        f.write(spec_yaml.replace("PORT", str(port)))
    with serving([os.path.join(os.path.dirname(sys.executable), "pdserve"), "serve", "--config", spec], port) as base:
        yield base


@contextlib.contextmanager
def serving(cmd: list[str], port: int, timeout_s: float = 600) -> Iterator[str]:
    """Run a server command (its own process group, in the repository) listening on `port`; yield
    its base URL once /health answers 200, and stop it (SIGINT, then SIGKILL) at the end."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    log = tempfile.NamedTemporaryFile("w+", prefix="pdserve-bench-server-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, cwd=root, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    came_up = False
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                raise SystemExit(f"{' '.join(cmd[:3])} did not come up; its output ({log.name}) ends:\n"
                                 + log.read()[-3000:])
            time.sleep(1.0)
        came_up = True
        yield base
    finally:
        with contextlib.suppress(ProcessLookupError):      # (it may have exited: "did not come up")
            os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
        if came_up:             # (one that did not come up keeps its log: the error names it)
            os.unlink(log.name)


# --- one request ---------------------------------------------------------------------------------
async def send(client: httpx.AsyncClient, args: argparse.Namespace, model: str, req: BenchRequest,
               prompt: list[int] | str) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": req.output_len, "temperature": args.temperature,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": args.ignore_eos}
    if args.top_p is not None:
        body["top_p"] = args.top_p
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    result = RequestResult(ok=False)
    start = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", f"{args.base_url}/v1/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = str(chunk["error"])[:200]
                    return result
                now = time.perf_counter()
                if chunk.get("usage"):
                    result.prompt_len = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", []):
                    if not choice.get("text"):
                        continue
                    result.text += choice["text"]
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
    except httpx.HTTPError as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.e2e = time.perf_counter() - start
    result.ok = last is not None
    if not result.ok:
        result.error = "no output"
    return result


# --- the run ---------------------------------------------------------------------------------------
async def run(args: argparse.Namespace, requests: list[BenchRequest], on_timed: Any = None
              ) -> tuple[list[RequestResult], float, dict[str, float]]:
    """Run the workload; (results of the timed requests in order, wall seconds of the timed part,
    increase of each scraped metric series over the timed part). `on_timed()`, if given, is called
    as the timed part starts and once more as it ends."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits) as client:
        model = args.model or (await client.get(f"{args.base_url}/v1/models", headers=(
            {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}))).json()["data"][0]["id"]
        units = _units(requests)
        warm, timed = units[:args.warmup], units[args.warmup:]
        await asyncio.gather(*[_run_unit(client, args, model, u) for u in warm])
        metrics_url = args.metrics_url or f"{args.base_url}/metrics"
        before = await scrape(client, metrics_url, args.scrape_metric) if args.scrape_metric else {}
        progress = _progress(sum(len(u) for u in timed), args.quiet)
        if on_timed is not None:
            on_timed()
        start = time.perf_counter()
        if timed and all(u[0].arrival_s is not None for u in timed):      # a trace: its own times
            async def at(u: list[BenchRequest]) -> list[RequestResult]:
                await asyncio.sleep(max(0.0, start + u[0].arrival_s - time.perf_counter()))
                return await _run_unit(client, args, model, u, progress)
            results = await asyncio.gather(*[at(u) for u in timed])
        elif args.concurrency:
            sem = asyncio.Semaphore(args.concurrency)

            async def limited(u: list[BenchRequest]) -> list[RequestResult]:
                async with sem:
                    return await _run_unit(client, args, model, u, progress)
            results = await asyncio.gather(*[limited(u) for u in timed])
        else:
            tasks = []
            for unit, gap in zip(timed, arrival_gaps(args.request_rate, args.burstiness, len(timed), args.seed)):
                tasks.append(asyncio.create_task(_run_unit(client, args, model, unit, progress)))
                await asyncio.sleep(gap)
            results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
        if on_timed is not None:
            on_timed()
        if progress is not None:
            progress.close()
        after = await scrape(client, metrics_url, args.scrape_metric) if args.scrape_metric else {}
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    return [r for unit in results for r in unit], wall, delta


async def scrape(client: httpx.AsyncClient, url: str, names: list[str]) -> dict[str, float]:
    """The series of the named metrics in a Prometheus text page: {'name{labels}': value}. The
    engines' counters may be polled by the server (pdserve refreshes them on each scrape)."""
    r = await client.get(url)
    r.raise_for_status()
    return parse_prometheus(r.text, names)


def parse_prometheus(text: str, names: list[str]) -> dict[str, float]:
    wanted = set(names)
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        if series.partition("{")[0] in wanted:
            out[series] = float(value)
    return out


def metric_totals(delta: dict[str, float]) -> dict[str, float]:
    """Per metric name, the sum over its series (all replicas, all pools)."""
    totals: dict[str, float] = {}
    for series, v in delta.items():
        name = series.partition("{")[0]
        totals[name] = totals.get(name, 0.0) + v
    return totals


def _units(requests: list[BenchRequest]) -> list[list[BenchRequest]]:
    """Requests grouped into what runs in order: a conversation's turns, or one request."""
    units: dict[Any, list[BenchRequest]] = {}
    for i, r in enumerate(requests):
        units.setdefault(("c", r.conversation) if r.conversation is not None else ("r", i), []).append(r)
    return list(units.values())


async def _run_unit(client: httpx.AsyncClient, args: argparse.Namespace, model: str, unit: list[BenchRequest],
                    progress: Any = None) -> list[RequestResult]:
    results, history = [], ""
    for req in unit:
        prompt: list[int] | str = req.prompt
        if req.conversation is not None:
            history += f"\nUser: {req.prompt}\nAssistant:"
            prompt = history
        res = await send(client, args, model, req, prompt)
        res.cls = req.cls
        results.append(res)
        history += res.text
        if progress is not None:
            progress.update(1)
    return results


def _progress(total: int, quiet: bool) -> Any:
    if quiet:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="requests", unit="req")


# --- metrics ---------------------------------------------------------------------------------------
def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0}
    ordered = sorted(values)

    def pct(p: float) -> float:      # linear interpolation between closest ranks (numpy's default)
        k = (len(ordered) - 1) * p
        lo = int(k)
        hi = min(lo + 1, len(ordered) - 1)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)

    return {"mean": statistics.fmean(ordered), "median": pct(0.5), "p90": pct(0.9), "p99": pct(0.99),
            "max": ordered[-1]}


def parse_slos(specs: list[str]) -> dict[str, float]:
    """'ttft:500' 'tpot:50' 'e2e:10000' (milliseconds) -> {metric: seconds}."""
    out = {}
    for spec in specs:
        name, _, value = spec.partition(":")
        if name not in ("ttft", "tpot", "e2e") or not value:
            raise ValueError(f"an SLO must be ttft:MS, tpot:MS or e2e:MS; got {spec!r}")
        out[name] = float(value) / 1e3
    return out


def summarize(results: list[RequestResult], wall: float, slos: dict[str, float] | None = None,
              metrics_delta: dict[str, float] | None = None, per_class: bool = True) -> dict[str, Any]:
    """Throughput and latency percentiles over the results (and per class, if they carry labels,
    under `classes`: throughputs there are the class's tokens over the whole run's wall time)."""
    ok = [r for r in results if r.ok]
    slos = slos or {}

    def meets(r: RequestResult) -> bool:
        values = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2e": r.e2e}
        return all(values[k] <= v for k, v in slos.items())

    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    ms = lambda xs: {k: v * 1e3 for k, v in percentiles(xs).items()}  # noqa: E731
    return {
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": wall,
        "request_throughput": len(ok) / wall if wall else 0.0,
        "output_token_throughput": out_tokens / wall if wall else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / wall if wall else 0.0,
        "input_tokens": in_tokens, "output_tokens": out_tokens,
        "goodput": (sum(meets(r) for r in ok) / wall if wall else 0.0) if slos else None,
        "slos_ms": {k: v * 1e3 for k, v in slos.items()},
        "ttft_ms": ms([r.ttft for r in ok]),
        "tpot_ms": ms([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": ms([x for r in ok for x in r.itl]),
        "e2e_ms": ms([r.e2e for r in ok]),
        **({"metrics_delta": metrics_delta, "metrics_total": metric_totals(metrics_delta)}
           if metrics_delta is not None else {}),
        **({"classes": {c: summarize([r for r in results if r.cls == c], wall, slos, per_class=False)
                        for c in sorted({r.cls for r in results})}}
           if per_class and any(r.cls for r in results) else {}),
    }


def plot(results: list[RequestResult], path: str, label: str = "") -> None:
    """Latency CDFs (TTFT, TPOT, ITL, E2E) in one PNG; one curve per class when requests carry
    class labels (benchmarks/plots.py draws several runs together)."""
    import plots

    classes = sorted({r.cls for r in results})
    runs = {(f"{label} {c}".strip() if c else label or "all"): [r for r in results if r.cls == c] for c in classes}
    plots.latency_cdfs(runs, path)


def print_summary(s: dict[str, Any], title: str = "") -> None:
    print(f"=== {title or 'result'}: {s['completed']} ok, {s['failed']} failed in {s['duration_s']:.1f} s")
    print(f"throughput: {s['request_throughput']:.2f} req/s, {s['output_token_throughput']:.1f} output tok/s, "
          f"{s['total_token_throughput']:.1f} total tok/s" +
          (f", goodput {s['goodput']:.2f} req/s under {s['slos_ms']}" if s["goodput"] is not None else ""))
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        p = s[name]
        print(f"{name[:-3].upper():5s} ms: mean {p['mean']:8.1f}  median {p['median']:8.1f}  p90 {p['p90']:8.1f}"
              f"  p99 {p['p99']:8.1f}  max {p['max']:8.1f}")
    for cls, c in s.get("classes", {}).items():
        print(f"  [{cls}] {c['completed']} ok: TTFT median {c['ttft_ms']['median']:.1f} p99 {c['ttft_ms']['p99']:.1f}, "
              f"ITL median {c['itl_ms']['median']:.1f} p99 {c['itl_ms']['p99']:.1f} max {c['itl_ms']['max']:.1f}, "
              f"TPOT median {c['tpot_ms']['median']:.1f} ms; {c['output_token_throughput']:.1f} output tok/s")
    for series, v in s.get("metrics_delta", {}).items():
        print(f"  {series} +{v:g}")
    if s["errors"]:
        print("errors:", s["errors"])


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default=None, help="model name (default: the server's first)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--dataset", default="random", choices=DATASETS)
    ap.add_argument("--num-prompts", type=int, default=64, help="timed requests (multiturn: conversations)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--input-len", default="128:512", help="tokens (multiturn: words per user turn)")
    ap.add_argument("--output-len", default="64")
    ap.add_argument("--prefix-len", type=int, default=512)
    ap.add_argument("--num-prefixes", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--long-fraction", type=float, default=0.2, help="mixed: share of long requests")
    ap.add_argument("--long-input-len", default="1024", help="mixed: tokens of a long prompt")
    ap.add_argument("--long-output-len", default="4", help="mixed: output tokens of a long request")
    ap.add_argument("--vocab-size", type=int, default=49152, help="token ids are drawn below this")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--request-rate", type=float, default=float("inf"), help="req/s (inf: all at once)")
    ap.add_argument("--burstiness", type=float, default=1.0)
    ap.add_argument("--concurrency", type=int, default=None, help="fixed requests in flight (instead of a rate)")
    ap.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false")
    ap.add_argument("--temperature", type=float, default=0.0, help="every request's (0: greedy)")
    ap.add_argument("--top-p", type=float, default=None, help="every request's (default: the server's, 1)")
    ap.add_argument("--slo", action="append", default=[], help="ttft:MS, tpot:MS or e2e:MS (goodput)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--scrape-metric", action="append", default=[], metavar="NAME",
                    help="Prometheus metric to read before and after the timed part (its increase is reported)")
    ap.add_argument("--metrics-url", default=None, help="default: {base_url}/metrics")
    add_trace_args(ap)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    add_args(ap)
    ap.add_argument("--result", default=None, help="write the summary and per-request results as JSON")
    ap.add_argument("--plot", default=None, help="write latency CDFs to this PNG (needs matplotlib)")
    ap.add_argument("--label", default="", help="name of this run in the plot")
    args = ap.parse_args(argv)
    slos = parse_slos(args.slo)
    requests = make_dataset(args)
    results, wall, delta = asyncio.run(run(args, requests))
    summary = summarize(results, wall, slos, delta if args.scrape_metric else None)
    print_summary(summary, args.base_url)
    if args.result:
        with open(args.result, "w") as f:
            json.dump({"args": vars(args), "summary": summary,
                       "requests": [dataclasses.asdict(r) | {"text": None} for r in results]}, f, indent=1,
                      default=str)
    if args.plot:
        plot(results, args.plot, args.label)
    return summary


if __name__ == "__main__":
    main()
