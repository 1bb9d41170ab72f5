"""Latency histograms an engine keeps (time to first token, inter-token latency) and reports in its
stats as cumulative bucket counts, as Prometheus histograms are: a reader takes the difference of two
readings for the latencies between them (`delta`), adds those of several replicas (`merge`) and
reads a quantile off the sum (`quantile`). The manager's planner does this with its pools'
replicas (cluster/planner.py). Torch-free and pure.
"""
from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence

# Upper bounds (seconds) of the buckets; a last bucket holds everything above the last bound.
LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0,
    3.0, 5.0, 7.5, 10.0, 20.0, 40.0)
NUM_BUCKETS = len(LATENCY_BUCKETS_S) + 1


class LatencyHistogram:
    """Counts of observed latencies per bucket of LATENCY_BUCKETS_S, since the engine started."""

    __slots__ = ("counts",)

    def __init__(self) -> None:
        self.counts = [0] * NUM_BUCKETS

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS_S, seconds)] += 1


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


def quantile(counts: Sequence[int], q: float) -> float | None:
    """The q-quantile (0 < q < 1) of the latencies counted, interpolated linearly inside its bucket
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
            if i >= len(LATENCY_BUCKETS_S):
                return LATENCY_BUCKETS_S[-1]
            lo = LATENCY_BUCKETS_S[i - 1] if i > 0 else 0.0
            return lo + (LATENCY_BUCKETS_S[i] - lo) * (rank - seen) / c
        seen += c
    return LATENCY_BUCKETS_S[-1]
