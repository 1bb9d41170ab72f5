"""Trace replay in virtual time (`pdserve simulate`, cluster/sim/replay.py): the server's routers, P/D
plan and planner drive real engines on simulated executors, in one process, no Ray. Checked: every
request completes and nothing is left on any replica; prefix-aware routing reuses a conversation
trace's prefixes where round-robin cannot (the same every time it runs); P/D moves KV and releases
every lease; an autoscaled pool grows under a burst and shrinks after it; the command prints one
JSON object last and refuses a bad trace or profile before running anything."""
from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
from helpers import REPO

from cluster.config import ClusterConfig
from cluster.sim.replay import Replay
from cluster.sim.report import format_summary, plot_replicas, summarize
from cluster.sim.trace import read_trace

ENGINE = {"simulate": "h200-llama3-8b", "max_model_len": 32768}


def conversation_trace(path, conversations: int = 12, turns: int = 4, gap_s: float = 0.4, seed: int = 0) -> str:
    """Mooncake-shaped lines: a shared system prompt (hash id 0), and each conversation's turns
    resending its history (the ids of its earlier turns) plus a new message."""
    rng = random.Random(seed)
    lines, next_id = [], 1
    history = {c: [0] for c in range(conversations)}
    for turn in range(turns):
        for c in range(conversations):
            history[c] = history[c] + list(range(next_id, next_id + 2))
            next_id += 2
            t = (turn * conversations + c) * gap_s + rng.random() * 0.05
            lines.append({"timestamp": int(t * 1000), "input_length": len(history[c]) * 512 - rng.randrange(200),
                          "output_length": rng.randrange(20, 60), "hash_ids": history[c]})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


def _spec(**kwargs) -> ClusterConfig:
    return ClusterConfig.model_validate({"engine": ENGINE, **kwargs})


def test_prefix_aware_routing_reuses_what_round_robin_recomputes(tmp_path):
    # (10 conversations over 4 replicas: round-robin does not send a conversation's turns to one
    # replica by accident)
    trace = read_trace(conversation_trace(tmp_path / "conv.jsonl", conversations=10, turns=5))
    results = {}
    for policy in ("prefix_aware", "round_robin"):
        replay = Replay(_spec(pools={"decode": {"replicas": 4}}, routing={"name": policy}), trace).run()
        results[policy] = s = summarize(replay, ttft_slo_ms=2000, itl_slo_ms=50)
        assert s["completed"] == s["requests"] == len(trace) and s["failed"] == 0
        assert sum(replay.replica_seconds().values()) == pytest.approx(4 * replay.end)   # a fixed pool: 4 x the span
        assert s["ttft_ms"]["p50"] > 0 and s["itl_ms"]["p50"] > 0 and s["throughput_tok_s"] > 0
        assert set(s) >= {"ttft_ms", "itl_ms", "e2e_ms", "throughput_tok_s", "goodput_req_s", "prefix_hit_rate",
                          "replica_seconds"}
        assert "TTFT" in format_summary(s)
    aware, rr = results["prefix_aware"], results["round_robin"]
    # A replay is the same every time (its tie-breaks seeded): here the first requests tie on 4 idle
    # replicas, and each replica computes the same prompt tokens in every run.
    per_replica = [{r.replica_id: r.engine.scheduler.num_prompt_tokens_computed for r in replay.replicas.values()}
                   for replay in (Replay(_spec(pools={"decode": {"replicas": 4}}), trace).run() for _ in range(2))]
    assert per_replica[0] == per_replica[1]
    # Every later turn finds its history on the replica that served the turn before.
    assert aware["prefix_hit_rate"] > rr["prefix_hit_rate"] + 0.2, (aware["prefix_hit_rate"], rr["prefix_hit_rate"])
    assert aware["prompt_tokens_computed"] < rr["prompt_tokens_computed"]


def test_disaggregated_replay_pulls_kv_and_ends_every_lease(tmp_path):
    trace = read_trace(conversation_trace(tmp_path / "conv.jsonl", conversations=6, turns=3))
    replay = Replay(_spec(mode="disaggregated", pools={"prefill": {"replicas": 2}, "decode": {"replicas": 2}},
                          disaggregation={"min_remote_prefill_tokens": 256}), trace).run()
    s = summarize(replay)
    assert s["completed"] == len(trace)
    assert s["pd_decisions"].get("remote_prefill", 0) > 0 and s["kv_blocks_pulled"] > 0
    assert sum(s["pd_decisions"].values()) == len(trace)
    # (Replay.run checked every replica: no request, lease or block left.)
    for replica in replay.replicas.values():
        assert not replica.engine.kv_connector.leases


def test_an_autoscaled_pool_grows_under_a_burst_and_shrinks_after(tmp_path):
    lines = [{"timestamp": int(i * 40), "input_length": 2000, "output_length": 300, "hash_ids": [10_000 + i]}
             for i in range(300)]                           # 25 requests/s for 12 s, then nothing
    # The replicas it adds start in the profile's 60 s; after that, it is quiet long enough to shrink.
    lines.append({"timestamp": 150_000, "input_length": 600, "output_length": 10, "hash_ids": [1]})
    path = tmp_path / "burst.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    spec = _spec(pools={"decode": {"replicas": 1, "autoscaling": {
        "min_replicas": 1, "max_replicas": 6, "target_running_requests": 8, "upscale_delay_s": 2,
        "downscale_delay_s": 10, "cooldown_s": 4}}})
    replay = Replay(spec, read_trace(str(path))).run()
    s = summarize(replay)
    actions = [d["action"] for d in s["planner"]["decisions"]]
    assert "up" in actions and "down" in actions, s["planner"]["decisions"]
    assert max(serving for *_, serving in replay.scaling) > 1
    assert s["completed"] == len(lines)
    assert s["replica_seconds"] < 6 * replay.end        # it did not keep its peak for the whole replay
    plot_replicas(s, str(tmp_path / "replicas.png"))
    assert (tmp_path / "replicas.png").stat().st_size > 1000


def test_pdserve_simulate_prints_json_last_and_refuses_bad_input_before_running(tmp_path):
    trace = conversation_trace(tmp_path / "conv.jsonl", conversations=3, turns=2)
    spec = tmp_path / "spec.yaml"
    spec.write_text("mode: disaggregated\npools:\n  prefill: {replicas: 1}\n  decode: {replicas: 2}\n")
    cmd = [sys.executable, "-m", "cluster.cli", "simulate", "--trace", trace, "--config", str(spec),
           "--profile", "h200-llama3-8b", "--replicas", "3", "--rate-scale", "2", "--ttft-slo", "500",
           "--itl-slo", "40", "--json"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    s = json.loads(done.stdout.strip().splitlines()[-1])
    assert s["replicas"] == {"prefill": 1, "decode": 3} and s["completed"] == 6 and s["mode"] == "disaggregated"
    for key in ("ttft_ms", "itl_ms", "e2e_ms"):
        assert set(s[key]) == {"p50", "p90", "p99"}
    bad = tmp_path / "bad.jsonl"
    bad.write_text(open(trace).readline() + '{"timestamp": 5, "input_length": 0, "output_length": 1, "hash_ids": []}\n')
    for args, message in (([ "--trace", str(bad), "--profile", "h200-llama3-8b"], "bad.jsonl:2: input_length must be"),
                          (["--trace", trace, "--profile", "b300-nothing"], "the built-ins are"),
                          (["--trace", trace], "a simulation profile is needed")):
        done = subprocess.run([sys.executable, "-m", "cluster.cli", "simulate", *args], cwd=REPO,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, done.stderr
