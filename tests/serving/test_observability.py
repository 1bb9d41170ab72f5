"""Seeing inside the cluster, on the shared apps (tests/serving/conftest.py): one P/D request is one
trace across the ingress and both replicas (the "/pd" app exports its spans to an OTLP receiver in
this process), its log line, a real Prometheus scraping the server (every expression of the shipped
Grafana dashboard returns data; its TTFT histogram lies between what the engines' spans and the
benchmark client measured of the same run), and `pdserve status --json` showing both pools."""
from __future__ import annotations

import argparse
import asyncio
import glob
import itertools
import json
import math
import os
import shutil
import subprocess
import time
import uuid

import httpx
import openai
import pytest
import yaml
from helpers import REPO, benchmarks_on_path, free_port

from records.histogram import VLLM_TTFT_BUCKETS, Histogram, quantile

ray = pytest.importorskip("ray", reason="the serving tests need ray[serve] (make setup installs it)")
pytestmark = pytest.mark.ray

DASHBOARD = os.path.join(REPO, "deploy", "helm", "pdserve", "dashboards", "pdserve.json")


def _pd(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server['base']}/pd/v1", api_key="none", max_retries=0, timeout=120)


def _long_prompt() -> str:
    """A prompt no replica has cached (so the P/D router sends it to the prefill pool)."""
    return " ".join(f"w{uuid.uuid4().hex[:6]}" for _ in range(60))


def _traceparent() -> tuple[str, str, str]:
    trace, parent = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    return trace, parent, f"00-{trace}-{parent}-01"


def test_one_pd_request_is_one_trace_under_the_clients_traceparent(server, otlp):
    trace, client_span, header = _traceparent()
    prompt = _long_prompt()
    done = _pd(server).completions.create(model=server["model"], prompt=prompt, max_tokens=6,
                                          temperature=0.0, extra_headers={"traceparent": header})
    # A streamed one too (its spans checked below): its request span lasts until the stream's end.
    trace2, _, header2 = _traceparent()
    chunks = list(_pd(server).chat.completions.create(
        model=server["model"], messages=[{"role": "user", "content": _long_prompt()}], max_tokens=5,
        temperature=0.0, stream=True, extra_headers={"traceparent": header2}))
    assert chunks
    want = {"pdserve.request", "pdserve.prepare", "pdserve.admission", "pdserve.route", "pdserve.engine",
            "pdserve.queue", "pdserve.prefill", "pdserve.kv_pull", "pdserve.decode"}
    spans = otlp.wait_for(trace, want, timeout_s=90, counts={"pdserve.engine": 2, "pdserve.route": 2})
    assert want <= {s["name"] for s in spans}, sorted(s["name"] for s in spans)
    by_id = {s["span_id"]: s for s in spans}
    (request,) = [s for s in spans if s["name"] == "pdserve.request"]
    assert request["parent_id"] == client_span                   # the client's span is the root's parent
    assert request["resource"]["pdserve.component"] == "ingress"
    assert request["attributes"]["gen_ai.request.id"] == done.id
    assert request["attributes"]["pdserve.mode"] == "pd" and request["attributes"]["pdserve.pd_decision"] == \
        "remote_prefill"
    assert request["attributes"]["gen_ai.usage.output_tokens"] == 6
    for name in ("pdserve.prepare", "pdserve.admission"):
        (span,) = [s for s in spans if s["name"] == name]
        assert span["parent_id"] == request["span_id"], name
    routes = {s["attributes"]["pdserve.pool"]: s for s in spans if s["name"] == "pdserve.route"}
    assert set(routes) == {"prefill", "decode"} and all(s["parent_id"] == request["span_id"] for s in routes.values())
    hops = {s["attributes"]["pdserve.pool"]: s for s in spans if s["name"] == "pdserve.engine"}
    assert set(hops) == {"prefill", "decode"}
    for pool, hop in hops.items():
        assert hop["parent_id"] == request["span_id"] and hop["resource"]["pdserve.component"] == "engine", pool
        assert hop["attributes"]["pdserve.replica"] == routes[pool]["attributes"]["pdserve.replica"], pool
        assert hop["attributes"]["pdserve.node"], pool
        assert request["start_ns"] <= hop["start_ns"] <= hop["end_ns"] <= request["end_ns"], pool
    children = {pool: {s["name"]: s for s in spans if s["parent_id"] == hop["span_id"]} for pool, hop in hops.items()}
    assert {"pdserve.queue", "pdserve.prefill"} <= set(children["prefill"]) and \
        "pdserve.kv_pull" not in children["prefill"]
    assert {"pdserve.queue", "pdserve.kv_pull", "pdserve.prefill", "pdserve.decode"} <= set(children["decode"])
    pull = children["decode"]["pdserve.kv_pull"]
    assert pull["attributes"]["pdserve.kv.blocks"] > 0 and pull["attributes"]["pdserve.kv.bytes"] > 0
    assert hops["prefill"]["end_ns"] <= pull["end_ns"]         # P prefilled before D's pull ended
    assert children["decode"]["pdserve.prefill"]["attributes"]["pdserve.computed_prompt_tokens"] == 1
    assert all(s["trace_id"] == trace for s in by_id.values())

    # The streamed request: its span ends after its decode hop.
    spans2 = otlp.wait_for(trace2, {"pdserve.request", "pdserve.decode"}, timeout_s=90)
    (request2,) = [s for s in spans2 if s["name"] == "pdserve.request"]
    decode2 = next(s for s in spans2 if s["name"] == "pdserve.decode")
    assert request2["attributes"]["http.route"] == "/v1/chat/completions"
    assert decode2["end_ns"] <= request2["end_ns"]

    # Its log line (serving.log_requests), in the ingress replica's stderr log: no prompt text.
    line = _log_line(done.id)
    assert line["mode"] == "pd" and line["trace_id"] == trace and line["output_tokens"] == 6
    assert line["prompt_tokens"] == done.usage.prompt_tokens and line["finish_reasons"] == ["length"]
    assert sorted(r.rpartition("-")[0] for r in line["replicas"]) == ["decode", "prefill"]
    assert line["ttft_s"] is not None and 0 < line["ttft_s"] <= line["e2e_s"]
    assert "prompts" not in line and prompt.split()[0] not in json.dumps(line)


def _log_line(request_id: str, timeout_s: float = 60.0) -> dict:
    """The request log's line of `request_id` in this Ray session's worker logs."""
    logs = os.path.join(ray._private.worker._global_node.get_session_dir_path(), "logs")
    needle = f'"id": "{request_id}"'
    deadline = time.monotonic() + timeout_s
    while True:
        for path in glob.glob(os.path.join(logs, "worker-*.err")):
            with open(path, errors="replace") as f:
                for text in f:
                    if needle in text:
                        return json.loads(text[text.index("{"):])
        assert time.monotonic() < deadline, f"no request log line for {request_id} in {logs}"
        time.sleep(0.5)


def _engine_ttfts(otlp, since_ns: int, n: int, timeout_s: float = 90.0) -> list[float]:
    """Each traced request since `since_ns` that reached a decode replica: its time to first token
    as its engines saw it (from a replica's arrival to the first token that replica computed, the
    longer of its replicas'), once `n` such requests' spans came (exported in batches, ~5 s apart)."""
    deadline = time.monotonic() + timeout_s
    while True:
        spans = otlp.all()
        requests = {s["trace_id"] for s in spans if s["name"] == "pdserve.request" and s["start_ns"] >= since_ns}
        hops: dict[str, list[dict]] = {}
        firsts = {s["parent_id"]: s["end_ns"] for s in spans if s["name"] == "pdserve.prefill"}
        for s in spans:
            if s["name"] == "pdserve.engine" and s["trace_id"] in requests and s["span_id"] in firsts:
                hops.setdefault(s["trace_id"], []).append(s)
        seen = [max((firsts[h["span_id"]] - h["start_ns"]) / 1e9 for h in hs) for hs in hops.values()
                if any(h["attributes"]["pdserve.pool"] == "decode" for h in hs)]
        if len(seen) >= n or time.monotonic() > deadline:
            return seen
        time.sleep(0.5)


# --- a real Prometheus ---------------------------------------------------------------------------
def _prometheus(tmp_path, metrics_port: int) -> tuple[subprocess.Popen, str]:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("needs a prometheus binary (Debian's prometheus package: make test installs it when run as "
                    "root; else apt-get install prometheus)")
    port = free_port()
    config = {"global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
              "scrape_configs": [{"job_name": "pdserve-pd", "metrics_path": "/pd/metrics",
                                  "static_configs": [{"targets": [f"127.0.0.1:{metrics_port}"]}]}]}
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    proc = subprocess.Popen([binary, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
                             "--storage.tsdb.retention.time=1h"],
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "w"))
    return proc, f"http://127.0.0.1:{port}"


def _query(api: str, expr: str, at: float) -> list[dict]:
    r = httpx.get(f"{api}/api/v1/query", params={"query": expr, "time": f"{at:.3f}"}, timeout=30)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", (expr, r.text)
    return body["data"]["result"]


def _wait_scraped(api: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if any(s["value"][1] == "1" for s in _query(api, 'up{job="pdserve-pd"}', time.time())):
                return
        except (httpx.HTTPError, AssertionError, ValueError):
            pass
        assert time.monotonic() < deadline, "Prometheus never scraped the server"
        time.sleep(0.5)


def _ttft_buckets(text: str) -> list[float]:
    """The decode pool's TTFT counts per bucket (not cumulative, summed over its replicas) in
    Prometheus text."""
    cumulative: dict[float, float] = {}
    for line in text.splitlines():
        if line.startswith("pdserve:time_to_first_token_seconds_bucket{") and 'pool="decode"' in line:
            le = float(line.split('le="')[1].split('"')[0])
            cumulative[le] = cumulative.get(le, 0.0) + float(line.rsplit(" ", 1)[1])
    ordered = [cumulative.get(b, 0.0) for b in (*VLLM_TTFT_BUCKETS, math.inf)]
    return [c - p for c, p in zip(ordered, [0.0, *ordered[:-1]])]


def test_a_real_prometheus_reads_every_dashboard_expression_and_the_ttft_the_client_saw(server, otlp, tmp_path):
    benchmarks_on_path()
    import serve as bench
    import workloads

    proc, api = _prometheus(tmp_path, server["port"])
    try:
        _wait_scraped(api)                         # a scrape since the earlier tests' requests ended
        metrics = f"{server['base']}/pd/metrics"
        server_before = httpx.get(metrics).text
        before = time.time()
        bad = httpx.post(f"{server['base']}/pd/v1/completions", json={"model": server["model"], "prompt": "x",
                                                                      "max_tokens": -1}, timeout=30)
        assert bad.status_code == 400                   # (the dashboard charts errors too)
        ap = argparse.ArgumentParser()
        bench.add_args(ap)
        args = ap.parse_args(["--dataset", "random", "--input-len", "40:200", "--output-len", "8",
                              "--num-prompts", "24", "--concurrency", "4", "--warmup", "0", "--quiet",
                              "--max-model-len", "1024", "--vocab-size", "1000"])
        args.base_url = f"{server['base']}/pd"
        results, wall, _ = asyncio.run(bench.run(args, workloads.make_dataset(args)))
        assert all(r.ok for r in results), [r.error for r in results if not r.ok]
        ttft = 'pdserve:time_to_first_token_seconds_{0}{{pool="decode"}}'

        def since(series: str) -> str:       # its increase since `before` (a series new since then: all of it)
            return f"(({series}) - ({series} @ {before:.3f}) or ({series}))"

        deadline = time.monotonic() + 60                # until a scrape after the run's end (1 s apart)
        while True:
            after = time.time()
            count = _query(api, f"sum({since(ttft.format('count'))})", after)
            if count and float(count[0]["value"][1]) >= len(results) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert float(count[0]["value"][1]) == len(results)        # every request counted, once
        served = float(_query(api, f"histogram_quantile(0.5, sum by (le) ({since(ttft.format('bucket'))}))",
                              after)[0]["value"][1])
        # What the server itself exported over the run, read straight off /pd/metrics: the same.
        exported = [a - b for a, b in zip(_ttft_buckets(httpx.get(metrics).text), _ttft_buckets(server_before))]
        assert abs(served - quantile(exported, 0.5, VLLM_TTFT_BUCKETS)) <= 1e-6, (served, exported)
        # Each request's TTFT as the server counted it lies between what its engines saw of it (from
        # a replica's arrival to the first token it computed: inside the ingress' interval) and what
        # the client saw (the ingress cannot see the hops after it: Serve's proxy, the client's own
        # loop). Both hold per request whatever the machine's load, so through the same buckets the
        # server's cumulative counts lie between the two at every bound, and so do the quantiles.
        # How close the server reads to the client where TTFT is the model's
        # (benchmarks/observability.py) is in docs/observability.md.
        client = Histogram(VLLM_TTFT_BUCKETS)
        for r in results:
            client.observe(r.ttft)
        engines = Histogram(VLLM_TTFT_BUCKETS)
        for seconds in _engine_ttfts(otlp, int(before * 1e9), len(results)):
            engines.observe(seconds)
        assert sum(engines.counts) == len(results), engines.counts      # every request's spans came
        low, mid, high = (list(itertools.accumulate(c)) for c in (engines.counts, exported, client.counts))
        assert all(lo >= m >= hi for lo, m, hi in zip(low, mid, high)), (low, mid, high)
        seen = quantile(client.counts, 0.5, VLLM_TTFT_BUCKETS)
        inside = quantile(engines.counts, 0.5, VLLM_TTFT_BUCKETS)
        print(f"TTFT p50: engines {inside * 1000:.1f} ms, Prometheus {served * 1000:.1f} ms, "
              f"the client (same buckets) {seen * 1000:.1f} ms")
        assert inside <= served <= seen, (inside, served, seen)

        # Every expression of the shipped dashboard returns data, and some of it is a number. Read two
        # scrapes (1 s apart) later: a counter first exported in the run's last scrape then has the two
        # samples rate() needs.
        time.sleep(2.5)
        after = time.time()
        window = f"{math.ceil(after - before) + 10}s"
        dashboard = json.load(open(DASHBOARD))
        exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
        assert len(exprs) >= 30
        empty = []
        for expr in exprs:
            q = expr.replace("${prefix}", "pdserve").replace("$__rate_interval", window).replace("$pool", ".*")
            values = [s["value"][1] for s in _query(api, q, after)]
            if not values or all(v == "NaN" for v in values):
                empty.append(q)
        assert not empty, empty
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_pdserve_status_json_shows_both_pools_with_nodes_states_and_latency(server, otlp, capsys):
    from cluster.cli import format_status, main

    assert main(["status", "--json", "--name", "pdserve-pd"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["mode"] == "disaggregated" and st["phase"] == "ready"
    assert st["tracing"] == {"otlp_traces_endpoint": otlp.endpoint, "log_requests": True}
    assert set(st["pools"]) == {"prefill", "decode"}
    for pool, p in st["pools"].items():
        (row,) = p["detail"]
        assert row["state"] == "serving" and row["node"], row
        latency = row["latency"]
        assert latency["ttft_s"]["count"] > 0 and 0 < latency["ttft_s"]["p50"] <= latency["ttft_s"]["p99"], row
        assert latency["queue_s"]["count"] > 0 and latency["queue_s"]["p50"] is not None, row
        if pool == "decode":
            assert latency["itl_s"]["count"] > 0, row
            held, slots = row["kv_tier"]["host"]
            assert 0 <= held <= slots and slots > 0, row
        else:
            assert row["kv_tier"] is None
    seen = st["ingress_observed"]
    assert seen["routing_decisions"]["pd"]["remote_prefill"] >= 1 and seen["otlp_traces_endpoint"] == otlp.endpoint
    text = format_status(st)
    assert f"tracing: {otlp.endpoint}; request log: on" in text and "TTFT p50/p90/p99" in text
    assert "KV tier host:" in text and "routing (pd): " in text, text
