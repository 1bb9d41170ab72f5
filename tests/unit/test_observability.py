"""The pieces of observability that need no server: histogram buckets and readings, the engine
histograms on /metrics per replica, a request's trace and log line at the ingress, and what
`pdserve status` makes of a replica's stats."""
from __future__ import annotations

import json
import logging

import pytest

from cluster.cli import format_status
from cluster.pool import replica_latency, replica_tier
from records.deltas import ChoiceDelta, StepDelta
from records.engine_stats import EngineStats, KVTierStats
from records.histogram import (
    LATENCY_BUCKETS_S,
    VLLM_REQUEST_LATENCY_BUCKETS,
    Histogram,
    LatencyHistogram,
    buckets_1_2_5,
    engine_histograms,
    quantile,
)
from router.routing.metrics import ServingMetrics
from router.routing.policy import Decision
from router.routing.request_trace import RequestTrace, log_requests_to_stderr


def test_buckets_and_readings():
    assert buckets_1_2_5(1000) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
    assert buckets_1_2_5(4) == (1, 2)
    h = Histogram((1.0, 2.0))
    for v in (0.5, 1.0, 1.5, 3.0):
        h.observe(v)
    assert h.reading() == ([2, 1, 1], 6.0)        # a value on a bound counts in that bound's bucket (le)
    assert quantile([0, 10, 0], 0.5, (1.0, 2.0)) == 1.5
    assert set(engine_histograms(2048)) >= {"request_queue_time_seconds", "iteration_tokens_total", "kv_pull_bytes"}


def test_engine_histograms_render_per_replica_and_leave_with_it():
    m = ServingMetrics(max_model_len=1024)
    hist = engine_histograms(1024)
    counts = [0] * (len(hist["request_queue_time_seconds"]) + 1)
    counts[2] = 3
    stats = EngineStats(num_requests_running=1, histograms={"request_queue_time_seconds": (counts, 1.25),
                                                            "not_a_series": ([1], 1.0)})
    m.engines.set_stats("decode", "decode-0", stats)
    text = m.render()
    labels = 'pool="decode",replica="decode-0"'
    le = f'{VLLM_REQUEST_LATENCY_BUCKETS[2]}'
    assert f'pdserve:request_queue_time_seconds_bucket{{{labels},le="{le}"}} 3' in text
    assert f"pdserve:request_queue_time_seconds_count{{{labels}}} 3" in text
    assert f"pdserve:request_queue_time_seconds_sum{{{labels}}} 1.25" in text
    assert "# TYPE pdserve:iteration_tokens_total histogram" in text and "not_a_series" not in text
    m.engines.drop("decode", "decode-0")
    assert "pdserve:request_queue_time_seconds_count{" not in m.render()
    # The client-facing histograms use vLLM's buckets.
    m.requests.ttft.observe(0.03, pool="decode", replica="decode-0")
    assert 'pdserve:time_to_first_token_seconds_bucket{pool="decode",replica="decode-0",le="0.04"} 1' in m.render()


def test_a_request_trace_logs_one_line_without_the_prompt_unless_asked(caplog):
    log_requests_to_stderr()
    logger = logging.getLogger("pdserve.requests")
    logger.propagate = True                       # for caplog
    try:
        for describe in (None, lambda ids: f"<{len(ids)} tokens>"):
            caplog.clear()
            trace = RequestTrace("/v1/completions", None, log=True, describe_prompt=describe)
            trace.started("cmpl-1", [[1, 2, 3]], "tiny", None)
            trace.routed("decode", Decision("decode-0", "prefix_hit", matched_blocks=2), trace.start, 16)
            trace.routed("prefill", Decision("prefill-1", "least_loaded"), trace.start, 16)
            trace.disaggregated("remote_prefill")
            trace.ran_on("prefill-1")
            trace.ran_on("decode-0")
            trace.hold()                              # the ticket's
            trace.release()                           # the endpoint returned: the stream goes on
            assert not caplog.records
            trace.delta(StepDelta("cmpl-1-0", [ChoiceDelta(0, [7], "a")], False, 3, num_cached_tokens=16))
            trace.delta(StepDelta("cmpl-1-0", [ChoiceDelta(0, [8], "b", finish_reason="length")], True, 3))
            trace.release()
            (record,) = caplog.records
            line = json.loads(record.getMessage())
            assert line["id"] == "cmpl-1" and line["mode"] == "pd" and line["replicas"] == ["prefill-1", "decode-0"]
            assert (line["prompt_tokens"], line["output_tokens"], line["cached_tokens"]) == (3, 2, 16)
            assert line["finish_reasons"] == ["length"] and line["error"] is None
            assert 0 <= line["ttft_s"] <= line["e2e_s"] and "trace_id" not in line     # not traced
            assert ("prompts" in line) == (describe is not None)
            if describe is not None:
                assert line["prompts"] == ["<3 tokens>"]
    finally:
        logger.propagate = False


def test_status_reads_latency_percentiles_and_the_tier_off_a_replicas_stats():
    ttft = LatencyHistogram()
    for s in (0.01, 0.02, 0.02, 0.5):
        ttft.observe(s)
    queue = [0] * (len(VLLM_REQUEST_LATENCY_BUCKETS) + 1)
    queue[0] = 4
    stats = EngineStats(ttft=tuple(ttft.counts), itl=(0,) * len(ttft.counts),
                        histograms={"request_queue_time_seconds": (queue, 0.1)},
                        kv_tier=KVTierStats(host_blocks=3, host_slots=40, disk_slots=0))
    latency = replica_latency(stats)
    assert latency["ttft_s"]["count"] == 4 and latency["itl_s"] == {"p50": None, "p90": None, "p99": None, "count": 0}
    assert latency["ttft_s"]["p50"] == pytest.approx(quantile(ttft.counts, 0.5, LATENCY_BUCKETS_S), abs=1e-4)
    assert latency["queue_s"]["count"] == 4
    assert replica_tier(stats) == {"host": [3, 40]}
    assert replica_tier(EngineStats()) is None and replica_latency(EngineStats()) is None    # (asleep)
    status = {"name": "pd", "fingerprint": "abc", "phase": "ready", "reason": None, "updating": None,
              "tracing": {"otlp_traces_endpoint": "http://127.0.0.1:4317", "log_requests": False},
              "ingress_observed": {"routing_decisions": {"pd": {"remote_prefill": 2}}, "peer_prefix_pulls": {}},
              "pools": {"decode": {"replicas": ["decode-0"], "target": 1, "bounds": [1, 4], "replaced": 0,
                                   "detail": [{"id": "decode-0", "state": "serving", "layout": "TP1xPP1",
                                               "node": "n1", "kv_usage": 0.5, "running": 1, "waiting": 0,
                                               "latency": latency, "kv_tier": replica_tier(stats)}]}}}
    text = format_status(status)
    assert "tracing: http://127.0.0.1:4317; request log: off" in text
    assert "routing (pd): remote_prefill 2" in text and "KV tier host: 3/40 blocks" in text
    assert "TTFT p50/p90/p99 " in text and "QUEUE p50/p90/p99 " in text and "ITL" not in text
