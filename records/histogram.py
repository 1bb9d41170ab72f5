"""Histograms an engine keeps and reports in its stats as cumulative bucket counts, as Prometheus
histograms are: a reader takes the difference of two readings for what was observed between them
(`delta`), adds those of several replicas (`merge`) and reads a quantile off the sum (`quantile`).
The manager's planner does this with its pools' replicas (cluster/planner.py), `pdserve status`
for each replica's latency percentiles, and the ingress's /metrics exports them per replica
(router/routing/metrics.py). Torch-free and pure.

Two kinds: `LatencyHistogram` (time to first token, inter-token latency, on the planner's buckets
`LATENCY_BUCKETS_S`) and `Histogram` (any buckets and a sum: the per-request series an engine keeps
at vLLM's names and buckets, `engine_histograms`; their help texts are `EngineSeries.HISTOGRAMS`).
"""
from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence

# Upper bounds (seconds) of the buckets; a last bucket holds everything above the last bound.
LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0,
    3.0, 5.0, 7.5, 10.0, 20.0, 40.0)
NUM_BUCKETS = len(LATENCY_BUCKETS_S) + 1

# vLLM's buckets (vllm/v1/metrics/loggers.py), so that dashboards and alerts written for vLLM read
# pdserve's series the same way.
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                     7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0)
VLLM_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                                50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
VLLM_ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# A KV pull: seconds, and bytes (1 KiB .. 16 GiB by factors of 4).
KV_PULL_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                           30.0)
KV_PULL_BYTES_BUCKETS = tuple(float(1024 * 4 ** i) for i in range(13))


def buckets_1_2_5(limit: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's buckets of token counts up to max_model_len)."""
    out: list[float] = []
    exponent = 0
    while True:
        for m in (1, 2, 5):
            value = m * 10 ** exponent
            if value > limit:
                return tuple(out)
            out.append(float(value))
        exponent += 1


def engine_histograms(max_model_len: int) -> dict[str, tuple[float, ...]]:
    """The per-request histograms every engine keeps (stats key `histograms`): name -> buckets.
    The names are vLLM's metric names without the prefix."""
    tokens = buckets_1_2_5(max_model_len)
    return {
        "request_queue_time_seconds": VLLM_REQUEST_LATENCY_BUCKETS,
        "request_prefill_time_seconds": VLLM_REQUEST_LATENCY_BUCKETS,
        "request_decode_time_seconds": VLLM_REQUEST_LATENCY_BUCKETS,
        "request_inference_time_seconds": VLLM_REQUEST_LATENCY_BUCKETS,
        "request_time_per_output_token_seconds": VLLM_ITL_BUCKETS,
        "request_prompt_tokens": tokens,
        "request_generation_tokens": tokens,
        "request_params_n": (1.0, 2.0, 5.0, 10.0, 20.0),
        "request_params_max_tokens": tokens,
        "iteration_tokens_total": tuple(float(b) for b in VLLM_ITERATION_TOKEN_BUCKETS),
        "kv_pull_seconds": KV_PULL_SECONDS_BUCKETS,
        "kv_pull_bytes": KV_PULL_BYTES_BUCKETS,
    }


class Histogram:
    """Counts per bucket (a value equal to a bound counts in that bound's bucket, as Prometheus'
    `le`) and the sum of the values observed, since the engine started."""

    __slots__ = ("buckets", "counts", "sum")

    def __init__(self, buckets: Sequence[float]) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    def reading(self) -> tuple[list[int], float]:
        """What the engine's stats carry: (counts per bucket, not cumulative; sum)."""
        return list(self.counts), self.sum


class LatencyHistogram(Histogram):
    """Latencies on the planner's buckets (LATENCY_BUCKETS_S), since the engine started."""

    __slots__ = ()

    def __init__(self) -> None:
        super().__init__(LATENCY_BUCKETS_S)


def delta(now: Sequence[int], before: Sequence[int] | None) -> tuple[int, ...]:
    """The counts observed between two readings of one histogram. A reading lower than the one
    before (the replica was replaced under the same id) counts from zero."""
    if before is None or len(before) != len(now) or any(b > n for n, b in zip(now, before)):
        return tuple(now)
    return tuple(n - b for n, b in zip(now, before))


def merge(histograms: Iterable[Sequence[int]]) -> tuple[int, ...]:
    out = [0] * NUM_BUCKETS
    for h in histograms:
        for i, c in enumerate(h):
            out[i] += c
    return tuple(out)


def quantile(counts: Sequence[int], q: float, buckets: Sequence[float] = LATENCY_BUCKETS_S) -> float | None:
    """The q-quantile (0 < q < 1) of the values counted, interpolated linearly inside its bucket
    (Prometheus' histogram_quantile); None when nothing was counted. Past the last bound it is the
    last bound."""
    if not 0 < q < 1:
        raise ValueError(f"q must be in (0, 1); got {q}")
    total = sum(counts)
    if total == 0:
        return None
    rank = q * total
    seen = 0
    for i, c in enumerate(counts):
        if c and seen + c >= rank:
            if i >= len(buckets):
                return buckets[-1]
            lo = buckets[i - 1] if i > 0 else 0.0
            return lo + (buckets[i] - lo) * (rank - seen) / c
        seen += c
    return buckets[-1]
