"""A small Prometheus registry (counters, gauges, histograms with labels) and its text format, and
the series the ingress exports (`ServingMetrics`), grouped by what they describe.

Names follow vLLM's with a `pdserve:` prefix (e.g. `pdserve:time_to_first_token_seconds`); engine-side
series carry `pool` and `replica` labels. No dependency: the text exposition format is a few lines.
"""
from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

from records.engine_stats import EngineStats, read
from records.histogram import (
    VLLM_ITL_BUCKETS,
    VLLM_REQUEST_LATENCY_BUCKETS,
    VLLM_TTFT_BUCKETS,
    buckets_1_2_5,
    engine_histograms,
)

LabelKey = tuple[tuple[str, str], ...]


_KEYS: dict[tuple[tuple[str, str], ...], LabelKey] = {}   # labels as passed -> sorted (a few hundred)


def _key(labels: dict[str, str] | None) -> LabelKey:
    """Labels as a series key (sorted); the sort is remembered, as every request counts the same
    few label sets (the router's decision among them: benchmarks/router_decision.py)."""
    if not labels:
        return ()
    given = tuple(labels.items())
    key = _KEYS.get(given)
    if key is None:
        key = tuple(sorted(given))
        if len(_KEYS) < 65536:          # label values come from config and replica ids, not requests
            _KEYS[given] = key
    return key


def _fmt_labels(key: LabelKey, extra: tuple[tuple[str, str], ...] = ()) -> str:
    items = key + extra
    if not items:
        return ""
    body = ",".join(f'{k}="{_escape(v)}"' for k, v in items)
    return "{" + body + "}"


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    v = float(v)
    return str(int(v)) if v.is_integer() and abs(v) < 1e15 else repr(v)


class _Metric:
    kind = ""

    def __init__(self, name: str, doc: str) -> None:
        self.name, self.doc = name, doc

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.doc}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    kind = "counter"

    def __init__(self, name: str, doc: str) -> None:
        super().__init__(name, doc)
        self.values: dict[LabelKey, float] = {}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        k = _key(labels)
        self.values[k] = self.values.get(k, 0.0) + amount

    def get(self, **labels: str) -> float:
        return self.values.get(_key(labels), 0.0)

    def render(self) -> list[str]:
        return self.header() + [f"{self.name}{_fmt_labels(k)} {_num(v)}" for k, v in self.values.items()]


class Gauge(Counter):
    kind = "gauge"

    def set(self, value: float, **labels: str) -> None:
        self.values[_key(labels)] = float(value)


class HistogramMetric(_Metric):
    """A Prometheus histogram family, its series by label (what a process's latency record,
    records/histogram.py: Histogram, is exposed as)."""
    kind = "histogram"

    def __init__(self, name: str, doc: str, buckets: Sequence[float]) -> None:
        super().__init__(name, doc)
        self.buckets = tuple(buckets)
        self.series: dict[LabelKey, tuple[list[int], list[float]]] = {}   # counts per bucket, [sum]

    def observe(self, value: float, **labels: str) -> None:
        counts, total = self.series.setdefault(_key(labels), ([0] * (len(self.buckets) + 1), [0.0]))
        counts[bisect.bisect_left(self.buckets, value)] += 1
        total[0] += value

    def count(self, **labels: str) -> int:
        series = self.series.get(_key(labels))
        return sum(series[0]) if series else 0

    def render(self) -> list[str]:
        lines = self.header()
        for k, (counts, total) in self.series.items():
            running = 0
            for bound, c in zip((*self.buckets, math.inf), counts):
                running += c
                lines.append(f"{self.name}_bucket{_fmt_labels(k, (('le', _num(bound)),))} {running}")
            lines.append(f"{self.name}_sum{_fmt_labels(k)} {_num(total[0])}")
            lines.append(f"{self.name}_count{_fmt_labels(k)} {running}")
        return lines


class Registry:
    def __init__(self) -> None:
        self.metrics: dict[str, _Metric] = {}

    def _add(self, metric: _Metric) -> _Metric:
        assert metric.name not in self.metrics, metric.name
        self.metrics[metric.name] = metric
        return metric

    def counter(self, name: str, doc: str) -> Counter:
        return self._add(Counter(name, doc))  # type: ignore[return-value]

    def gauge(self, name: str, doc: str) -> Gauge:
        return self._add(Gauge(name, doc))  # type: ignore[return-value]

    def histogram(self, name: str, doc: str, buckets: Sequence[float]) -> HistogramMetric:
        """A histogram family on `buckets` (records/histogram.py holds every set pdserve uses)."""
        return self._add(HistogramMetric(name, doc, buckets))  # type: ignore[return-value]

    def render(self) -> str:
        lines: list[str] = []
        for metric in self.metrics.values():
            lines.extend(metric.render())
        return "\n".join(lines) + "\n"


class ServingMetrics:
    """Every series the ingress exports, by what they describe: the engines (set from the replicas'
    stats at each scrape), the requests as a client sees them, routing, tenants and pools."""

    def __init__(self, max_model_len: int = 2048) -> None:
        r = self.registry = Registry()
        self.engines = EngineSeries(r, max_model_len)
        self.requests = RequestSeries(r)
        self.routing = RoutingSeries(r, max_model_len)
        self.tenants = TenantSeries(r)
        self.pools = PoolSeries(r)

    def render(self) -> str:
        return self.registry.render()


class EngineSeries:
    """The engines' own series, per pool and replica, set from their stats at each scrape
    (cumulative readings): counters and gauges, the engines' histograms, MoE expert load."""

    # EngineStats field (dotted in a group: records/engine_stats.py) -> (metric name, kind, help)
    SERIES = {
        "prompt_tokens": ("pdserve:prompt_tokens_total", "counter", "Prefill tokens received."),
        "prompt_tokens_computed": ("pdserve:prompt_tokens_computed_total", "counter",
                                   "Prompt tokens run through the model (not prefix-cache hits, not pulled "
                                   "KV; recomputed again after a preemption)."),
        "generation_tokens": ("pdserve:generation_tokens_total", "counter", "Tokens generated."),
        "prefix_cache_queries": ("pdserve:prefix_cache_queries_total", "counter",
                                 "Prompt tokens looked up in the prefix cache."),
        "prefix_cache_hits": ("pdserve:prefix_cache_hits_total", "counter",
                              "Prompt tokens served from the prefix cache."),
        "num_preemptions": ("pdserve:num_preemptions_total", "counter", "Preempted requests."),
        "num_requests_running": ("pdserve:num_requests_running", "gauge", "Requests in the running batch."),
        "num_requests_waiting": ("pdserve:num_requests_waiting", "gauge", "Requests waiting to be scheduled."),
        "kv_cache_usage_perc": ("pdserve:kv_cache_usage_perc", "gauge", "Fraction of KV blocks in use."),
        "num_kv_blocks": ("pdserve:kv_cache_blocks", "gauge",
                          "KV blocks the replica's cache holds, in use or not (its capacity, in blocks of "
                          "block_size tokens)."),
        "kv_transfer.blocks_pulled": ("pdserve:kv_blocks_transferred_total", "counter",
                             "KV blocks pulled from prefill replicas (counted on the decode side)."),
        "kv_transfer.load_failures": ("pdserve:kv_load_failures_total", "counter",
                             "KV pulls that failed or timed out (then recomputed or failed)."),
        "kv_transfer.leases_active": ("pdserve:kv_leases_active", "gauge",
                             "Prefilled requests whose blocks wait under a lease for a decode replica."),
        "kv_transfer.leases_expired": ("pdserve:kv_leases_expired_total", "counter",
                              "Leases that ran out before a decode replica pulled or released them."),
        "kv_transfer.prefix_leases": ("pdserve:kv_prefix_leases_total", "counter",
                             "Cached prefixes leased to a peer replica to pull (peer prefix pulls)."),
        # The offload tier (engine/core/kv_tier.py): what it holds and what it moved.
        "kv_tier.host_blocks": ("pdserve:kv_offload_host_blocks", "gauge", "Blocks the host tier holds."),
        "kv_tier.disk_blocks": ("pdserve:kv_offload_disk_blocks", "gauge", "Blocks the disk tier holds."),
        "kv_tier.host_hit_blocks": ("pdserve:kv_offload_host_hit_blocks_total", "counter",
                                    "Blocks loaded back from the host tier instead of recomputed."),
        "kv_tier.disk_hit_blocks": ("pdserve:kv_offload_disk_hit_blocks_total", "counter",
                                    "Blocks loaded back from the disk tier instead of recomputed."),
        "kv_tier.blocks_saved": ("pdserve:kv_offload_blocks_saved_total", "counter",
                                 "Evicted pool blocks copied to the host tier."),
        "kv_tier.blocks_demoted": ("pdserve:kv_offload_blocks_demoted_total", "counter",
                                   "Host-tier blocks moved to the disk tier."),
        "kv_tier.load_failures": ("pdserve:kv_offload_load_failures_total", "counter",
                                  "Tier loads that failed (their requests recomputed the prompt)."),
        "kv_tier.bytes_saved": ("pdserve:kv_offload_saved_bytes_total", "counter", "Bytes copied to the host tier."),
        "kv_tier.bytes_loaded": ("pdserve:kv_offload_loaded_bytes_total", "counter",
                                 "Bytes loaded back from the tier."),
        "kv_tier.bytes_written_to_disk": ("pdserve:kv_offload_disk_written_bytes_total", "counter",
                                          "Bytes written to the disk tier."),
        "kv_tier.seconds": ("pdserve:kv_offload_seconds_total", "counter",
                            "Seconds engine steps spent copying blocks to and from the tier."),
    }

    # EngineStats.histograms key -> help (records/histogram.py: engine_histograms gives the buckets)
    HISTOGRAMS = {
        "request_queue_time_seconds": "Time requests waited in the engine's queue (arrival to first scheduled).",
        "request_prefill_time_seconds": "Time from first scheduled to the first token (a KV pull included).",
        "request_decode_time_seconds": "Time from the first token to the last.",
        "request_inference_time_seconds": "Time from first scheduled to the last token.",
        "request_time_per_output_token_seconds": "Mean time per output token of each request, after the first.",
        "request_prompt_tokens": "Prompt tokens per request.",
        "request_generation_tokens": "Generated tokens per request (all n choices).",
        "request_params_n": "The n parameter of requests.",
        "request_params_max_tokens": "The max_tokens parameter of requests (resolved).",
        "iteration_tokens_total": "Tokens scheduled per engine step.",
        "kv_pull_seconds": "Time a KV pull from a prefill replica or a peer took (counted by the puller).",
        "kv_pull_bytes": "Bytes a KV pull moved (counted by the puller).",
    }

    def __init__(self, r: Registry, max_model_len: int) -> None:
        self.values: dict[str, Counter] = {}
        for key, (name, kind, doc) in self.SERIES.items():
            self.values[key] = r.counter(name, doc) if kind == "counter" else r.gauge(name, doc)
        self.histograms = {key: r.histogram(f"pdserve:{key}", self.HISTOGRAMS[key], buckets)
                           for key, buckets in engine_histograms(max_model_len).items()}
        self.expert_tokens = r.counter("pdserve:moe_expert_tokens_total",
                                       "(token, expert) rows each MoE expert has run, summed over layers, by "
                                       "replica, the rank holding the expert and the expert (expert load).")

    def set_stats(self, pool: str, replica: str, stats: EngineStats) -> None:
        """One replica's engine stats (`LLMEngine.stats()`), read at a scrape."""
        key = _key({"pool": pool, "replica": replica})
        for path, metric in self.values.items():
            value = read(stats, path)
            if value is not None:
                metric.values[key] = value
        for name, (counts, total) in stats.histograms.items():
            hist = self.histograms.get(name)
            if hist is not None and len(counts) == len(hist.buckets) + 1:
                hist.series[key] = (list(counts), [float(total)])
        for rank, expert, rows in stats.moe_expert_tokens:
            labels = {"pool": pool, "replica": replica, "rank": str(rank), "expert": str(expert)}
            self.expert_tokens.values[_key(labels)] = float(rows)

    def drop(self, pool: str, replica: str) -> None:
        """Forget a replica that left its pool (replaced or drained): its series stop being exported."""
        key = _key({"pool": pool, "replica": replica})
        for metric in self.values.values():
            metric.values.pop(key, None)
        for hist in self.histograms.values():
            hist.series.pop(key, None)
        for labels in [k for k in self.expert_tokens.values if set(key) <= set(k)]:
            self.expert_tokens.values.pop(labels)


class RequestSeries:
    """The requests as a client sees them, measured in the ingress per pool and replica (P/D hops
    included): latencies, how they finished or failed, how many are in flight."""

    def __init__(self, r: Registry) -> None:
        self.ttft = r.histogram("pdserve:time_to_first_token_seconds", "Time to first token.", VLLM_TTFT_BUCKETS)
        self.itl = r.histogram("pdserve:inter_token_latency_seconds", "Time between streamed tokens.",
                               VLLM_ITL_BUCKETS)
        self.e2e = r.histogram("pdserve:e2e_request_latency_seconds", "End-to-end request latency.",
                               VLLM_REQUEST_LATENCY_BUCKETS)
        self.finished = r.counter("pdserve:request_success_total", "Finished requests by finish reason.")
        self.errors = r.counter("pdserve:request_errors_total", "Rejected or failed requests by status code.")
        for code in ("400", "429", "500", "503"):     # exported at 0 from the start: a healthy server's
            self.errors.inc(0, code=code)             # error panels and alerts read 0, not "no data"
        self.in_flight = r.gauge("pdserve:requests_in_flight", "Requests the ingress is serving.")


class RoutingSeries:
    """The router's choices: decisions by reason, prefix hits, peer prefix pulls, migrations."""

    def __init__(self, r: Registry, max_model_len: int) -> None:
        self.prefix_hit_tokens = r.histogram("pdserve:router_prefix_hit_tokens",
                                             "Prompt tokens the chosen replica held in its prefix cache, per "
                                             "routing decision (by pool).", buckets_1_2_5(max_model_len))
        self.decisions = r.counter("pdserve:router_decisions_total", "Routing decisions by reason.")
        self.peer_pulls = r.counter("pdserve:peer_prefix_pulls_total",
                                    "Prefixes a replica was sent to pull from a peer replica of its pool instead of "
                                    "computing them, by outcome (leased: the peer leased its blocks; missed: it no "
                                    "longer held them; failed: the peer could not be asked)")
        self.peer_pull_blocks = r.counter("pdserve:peer_prefix_pull_blocks_total",
                                          "KV blocks leased by peer replicas for prefix pulls")
        self.migrations = r.counter("pdserve:request_migrations_total",
                                    "Streams moved to another replica after theirs was lost, by pool.")
        self.migration_failures = r.counter(
            "pdserve:request_migration_failures_total",
            "Streams that ended with an error when their replica was lost, by pool and reason "
            "(limit: past routing.max_migrations; no_replica: none left; not_migratable: n > 1 or "
            "prompt logprobs already streaming).")


class TenantSeries:
    """Per tenant (router/ingress/tenants.py; the tenant's name, never its key)."""

    def __init__(self, r: Registry) -> None:
        self.requests = r.counter("pdserve:tenant_requests_total",
                                  "Requests per tenant by outcome (admitted, or rejected by the limit "
                                  "named: max_concurrent, requests_per_minute, tokens_per_minute, "
                                  "max_in_flight, fair_share).")
        self.tokens = r.counter("pdserve:tenant_tokens_total",
                                "Tokens per tenant: prompt tokens admitted, generation tokens streamed.")
        self.running = r.gauge("pdserve:tenant_requests_running", "Requests per tenant dispatched to the pools.")
        self.queued = r.gauge("pdserve:tenant_requests_queued",
                              "Requests per tenant waiting in the ingress's fair queue.")
        self.queue_time = r.histogram("pdserve:tenant_queue_time_seconds",
                                      "Time requests waited in the ingress's fair queue, per tenant.",
                                      VLLM_TTFT_BUCKETS)


class PoolSeries:
    """The pools as their manager reports them: replicas by state, the planner's changes, drains
    and replacements (set from `ClusterManager.pool_status()`)."""

    def __init__(self, r: Registry) -> None:
        self.replicas = r.gauge("pdserve:pool_replicas",
                                "Engine replicas per pool: serving, starting (pending or loading), "
                                "draining, and the target, as the manager reports them.")
        self.planner_decisions = r.counter("pdserve:planner_decisions_total",
                                           "Pool size changes by the planner (autoscaling), by pool and "
                                           "action (up, down), since the manager started.")
        self.drained = r.counter("pdserve:replicas_drained_total",
                                 "Replicas drained out of their pool (scaled down, or replaced by a spec "
                                 "update), by pool and outcome (empty: its requests ended in time; timeout: "
                                 "its streams migrated), since the manager started.")
        self.replaced = r.counter("pdserve:replicas_replaced_total",
                                  "Replicas the manager dropped and replaced (actor or node died, engine "
                                  "stopped, missed health checks), per pool, since the manager started.")

    def set_status(self, status: dict[str, dict]) -> None:
        """The manager's view of the pools (`ClusterManager.pool_status()`)."""
        for pool, st in status.items():
            for state, value in (("serving", len(st["replicas"])), ("starting", len(st["starting"])),
                                 ("draining", len(st["draining"])), ("target", st["target"])):
                self.replicas.set(value, pool=pool, state=state)
            self.replaced.values[_key({"pool": pool})] = float(st["replaced"])
            for outcome, count in st.get("drained", {}).items():
                self.drained.values[_key({"pool": pool, "outcome": outcome})] = float(count)
            for action, count in st.get("planner", {}).get("decisions", {}).items():
                self.planner_decisions.values[_key({"pool": pool, "action": action})] = float(count)
