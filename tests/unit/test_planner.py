"""The planner's decisions, reproduced from recorded samples (no Ray, no clock), and the latency
histograms it reads."""
from __future__ import annotations

import pytest

from cluster.config import MAX_REPLICAS, AutoscalingSpec, ClusterConfig, PoolSpec
from cluster.planner import Planner, PoolSample
from records.histogram import LATENCY_BUCKETS_S, NUM_BUCKETS, LatencyHistogram, delta, merge, quantile


def hist(*latencies_s: float) -> tuple[int, ...]:
    h = LatencyHistogram()
    for x in latencies_s:
        h.observe(x)
    return tuple(h.counts)


def run(planner: Planner, target: int, samples: list[PoolSample]) -> list[tuple[float, str, int]]:
    """Feed samples one by one, acting on each decision as the manager does: (t, action, target)
    per change."""
    changes = []
    for s in samples:
        planner.observe(s)
        d = planner.plan(target, s.t)
        if d.action != "hold":
            target = d.replicas
            changes.append((s.t, d.action, target))
    return changes


# --- histograms ------------------------------------------------------------------------------------
def test_quantile_interpolates_inside_the_bucket_as_prometheus_does():
    counts = hist(*([0.015] * 90 + [0.5] * 10))      # 90 in (0.01, 0.02], 10 in (0.4, 0.5]
    assert quantile(counts, 0.9) == pytest.approx(0.02)
    assert quantile(counts, 0.5) == pytest.approx(0.01 + 0.01 * 50 / 90)
    assert quantile(counts, 0.95) == pytest.approx(0.4 + 0.1 * 5 / 10)
    assert quantile(hist(100.0), 0.9) == LATENCY_BUCKETS_S[-1]       # past the last bound
    assert quantile((0,) * NUM_BUCKETS, 0.9) is None
    with pytest.raises(ValueError, match="q must be in"):
        quantile(counts, 1.0)


def test_delta_and_merge_of_cumulative_readings():
    before, now = hist(0.01, 0.2), hist(0.01, 0.2, 0.2, 3.0)
    assert delta(now, before) == hist(0.2, 3.0)
    assert delta(before, now) == before           # a lower reading: a new replica under that id
    assert delta(now, None) == now
    assert merge([hist(0.01), hist(0.2), hist(0.01)]) == hist(0.01, 0.01, 0.2)


# --- the spec --------------------------------------------------------------------------------------
def test_autoscaling_spec_is_checked():
    with pytest.raises(ValueError, match="autoscaling needs a target"):
        AutoscalingSpec(min_replicas=1, max_replicas=2)
    with pytest.raises(ValueError, match=r"max_replicas \(1\) must be >= min_replicas \(2\)"):
        AutoscalingSpec(min_replicas=2, max_replicas=1, target_kv_usage=0.5)
    with pytest.raises(ValueError, match=r"replicas \(5\) must lie within autoscaling's min_replicas \(1\) "
                                         r"and max_replicas \(4\)"):
        PoolSpec(replicas=5, autoscaling={"max_replicas": 4, "itl_slo_ms": 50})
    spec = PoolSpec(replicas=2, autoscaling={"min_replicas": 1, "max_replicas": 4, "itl_slo_ms": 50})
    assert spec.bounds() == (1, 4) and PoolSpec().bounds() == (1, MAX_REPLICAS)
    # Size and autoscaling are not what replicas are made of; the rest is.
    assert spec.identity() == PoolSpec(replicas=3).identity() != PoolSpec(num_cpus=2).identity()
    with pytest.raises(ValueError, match="extra"):
        ClusterConfig(pools={"decode": {"autoscaling": {"max_replicas": 2, "itl_slo": 5}}})


# --- decisions -------------------------------------------------------------------------------------
SPEC = AutoscalingSpec(min_replicas=1, max_replicas=4, target_running_requests=4, window_s=10,
                       upscale_delay_s=4, downscale_delay_s=10, cooldown_s=6)


def test_load_target_grows_after_the_upscale_delay_and_shrinks_after_the_downscale_delay():
    planner = Planner(SPEC)
    ramp = ([PoolSample(t, 1, 0, running=2) for t in range(0, 10, 2)]
            + [PoolSample(t, 1, 0, running=4, waiting=10) for t in range(10, 30, 2)]      # 14 -> 4 replicas
            + [PoolSample(t, 4, 0, running=1) for t in range(30, 80, 2)])
    changes = run(planner, 1, ramp)
    # Up once every plan of 4 s wanted more (t=10, 12, 14), to 4 (ceil(14 / 4)), then down to 1 once
    # every plan of 10 s after the drop wanted fewer.
    assert changes == [(14, "up", 4), (40, "down", 1)]
    # Reproducible: the same samples, the same decisions.
    assert run(Planner(SPEC), 1, ramp) == changes


def test_a_blip_shorter_than_the_delay_changes_nothing():
    samples = [PoolSample(t, 1, 0, running=2 if t != 6 else 40) for t in range(0, 30, 2)]
    assert run(Planner(SPEC), 1, samples) == []


def test_bounds_cooldown_and_starting_replicas_hold_it():
    planner = Planner(SPEC)
    flood = [PoolSample(t, 1, 0, running=400) for t in range(0, 6, 2)]
    assert run(planner, 1, flood) == [(4, "up", 4)]          # capped at max_replicas
    # While a replica it asked for is starting, it holds (its load would count twice)...
    planner.observe(PoolSample(20, 2, 2, running=0))
    d = planner.plan(4, 20)
    assert d.action == "hold" and "2 replica(s) starting" in d.reason
    # ... and a change by hand restarts the cooldown.
    planner.changed(30)
    planner.observe(PoolSample(32, 4, 0, running=0))
    d = planner.plan(4, 32)
    assert d.action == "hold" and d.reason.startswith("cooling down") and d.wish == 1
    # A target outside the bounds (they changed under it) is brought back at once.
    assert planner.plan(9, 33).replicas == 4


def test_itl_slo_adds_a_replica_while_missed_and_lets_one_go_when_well_under():
    spec = AutoscalingSpec(min_replicas=1, max_replicas=3, itl_slo_ms=50, window_s=4, upscale_delay_s=2,
                           downscale_delay_s=6, cooldown_s=4)
    slow, fast, ok = hist(*[0.08] * 50), hist(*[0.012] * 50), hist(*[0.04] * 50)
    samples = ([PoolSample(t, 1, 0, running=8, itl=slow) for t in range(0, 12, 2)]
               + [PoolSample(t, 3, 0, running=8, itl=ok) for t in range(12, 30, 2)]
               + [PoolSample(t, 3, 0, running=1, itl=fast) for t in range(30, 60, 2)])
    changes = run(Planner(spec), 1, samples)
    # Missed: +1 once 2 s of plans wanted it, +1 when the cooldown (4 s) ends; within the SLO it
    # holds; well under it (from t=32, when the 4 s window holds fast samples only), one fewer
    # after 6 s of plans wanting it, and one more 6 s of plans after that change (t=40..46).
    assert changes == [(2, "up", 2), (6, "up", 3), (38, "down", 2), (46, "down", 1)]
    planner = Planner(spec)
    planner.observe(PoolSample(0, 3, 0, running=8, itl=slow))
    assert planner.wish(3, 0) == (3, "ITL p90 98 ms > 50 ms")          # max_replicas caps it
    # No traffic measured: nothing holds it up.
    planner = Planner(spec)
    planner.observe(PoolSample(0, 2, 0))
    assert planner.wish(2, 0) == (1, "ITL: nothing measured in 4 s")


def test_the_largest_wish_wins_and_kv_and_prompt_queue_targets():
    spec = AutoscalingSpec(min_replicas=1, max_replicas=8, target_kv_usage=0.5, target_queued_prompt_tokens=1000,
                           ttft_slo_ms=200)
    planner = Planner(spec)
    planner.observe(PoolSample(0, 2, 0, queued_prompt_tokens=2500, kv_usage=0.9, ttft=hist(*[0.05] * 10)))
    n, why = planner.wish(2, 0)
    assert (n, why) == (4, "KV usage 90% on 2 / 50% per replica")     # 1.8 replicas' worth / 0.5
    planner.observe(PoolSample(1, 2, 0, queued_prompt_tokens=5200, kv_usage=0.1, ttft=hist(*[0.05] * 10)))
    assert planner.wish(2, 1) == (6, "5200 queued prompt tokens / 1000 per replica")


def test_samples_at_uneven_times_still_decide_after_the_delays():
    """Health checks come every period plus what they take: times that never land on the delays'
    boundaries (a planner that waited for a plan exactly `delay` old never decided)."""
    times = [0.37 + 2.03 * k for k in range(40)]
    samples = [PoolSample(t, 1, 0, running=12 if t < 20 else 0) for t in times]
    changes = run(Planner(SPEC), 1, samples)
    assert [(a, n) for _, a, n in changes] == [("up", 3), ("down", 1)]
    up_at, down_at = changes[0][0], changes[1][0]
    assert 4 <= up_at - times[0] < 4 + 2.1 and 10 <= down_at - 20 < 10 + 2.1 + 2.03
