"""The Grafana dashboard the Helm chart ships (deploy/helm/pdserve/dashboards/pdserve.json), as
code: edit the panels here and run `python deploy/dashboard.py` to write the JSON
(tests/cluster/test_deploy.py checks that the two agree, and that every series it reads is one the
server exports; tests/serving/test_observability.py runs every expression against a real Prometheus).

Variables: `datasource`, `prefix` (pdserve or vllm, as serving.metrics_prefix) and `pool`.
"""
import json
import os

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helm", "pdserve", "dashboards", "pdserve.json")

P = "${prefix}"
RI = "$__rate_interval"
SEL = 'pool=~"$pool"'


def q(expr, legend=""):
    return {"expr": expr, "legendFormat": legend, "refId": "A"}


def quant(metric, qs=(0.5, 0.99), by="pool", sel=SEL):
    return [{"expr": f'histogram_quantile({x}, sum by (le, {by}) (rate({P}:{metric}_bucket{{{sel}}}[{RI}])))',
             "legendFormat": f"p{int(x * 100)} {{{{{by}}}}}", "refId": chr(65 + i)} for i, x in enumerate(qs)]


rows = [
    ("Traffic", [
        ("Requests in flight (ingress)", [q(f"sum({P}:requests_in_flight)", "in flight")], "short"),
        ("Finished requests / s by reason", [q(f"sum by (finished_reason) (rate({P}:request_success_total[{RI}]))",
                                               "{{finished_reason}}")], "reqps"),
        ("Rejected or failed requests / s by code", [q(f"sum by (code) (rate({P}:request_errors_total[{RI}]))",
                                                       "{{code}}")], "reqps"),
        ("Tokens / s", [q(f"sum by (pool) (rate({P}:generation_tokens_total{{{SEL}}}[{RI}]))", "generated {{pool}}"),
                        {**q(f"sum by (pool) (rate({P}:prompt_tokens_computed_total{{{SEL}}}[{RI}]))",
                             "prompt computed {{pool}}"), "refId": "B"}], "short"),
    ]),
    ("Latency (as clients see it: the decode pool carries P/D requests end to end)", [
        ("Time to first token", quant("time_to_first_token_seconds"), "s"),
        ("Inter-token latency", quant("inter_token_latency_seconds"), "s"),
        ("End-to-end latency", quant("e2e_request_latency_seconds"), "s"),
        ("Time per output token (per request)", quant("request_time_per_output_token_seconds"), "s"),
    ]),
    ("Engine phases (per replica's engine)", [
        ("Queue time", quant("request_queue_time_seconds", (0.5, 0.99)), "s"),
        ("Prefill time (KV pull included)", quant("request_prefill_time_seconds", (0.5, 0.99)), "s"),
        ("Decode time", quant("request_decode_time_seconds", (0.5, 0.99)), "s"),
        ("Tokens per engine step", quant("iteration_tokens_total", (0.5, 0.99)), "short"),
        ("Prompt tokens per request", quant("request_prompt_tokens", (0.5, 0.99)), "short"),
        ("Generated tokens per request", quant("request_generation_tokens", (0.5, 0.99)), "short"),
    ]),
    ("Replicas", [
        ("Running / waiting requests", [
            q(f"sum by (replica) ({P}:num_requests_running{{{SEL}}})", "running {{replica}}"),
            {**q(f"sum by (replica) ({P}:num_requests_waiting{{{SEL}}})", "waiting {{replica}}"), "refId": "B"}],
         "short"),
        ("KV cache usage", [q(f"max by (replica) ({P}:kv_cache_usage_perc{{{SEL}}})", "{{replica}}")], "percentunit"),
        ("Prefix cache hit rate", [q(f"sum by (pool) (rate({P}:prefix_cache_hits_total{{{SEL}}}[{RI}])) / "
                                     f"sum by (pool) (rate({P}:prefix_cache_queries_total{{{SEL}}}[{RI}]))",
                                     "{{pool}}")], "percentunit"),
        ("Preemptions / s", [q(f"sum by (replica) (rate({P}:num_preemptions_total{{{SEL}}}[{RI}]))", "{{replica}}")],
         "short"),
        ("Pool replicas by state", [q(f"sum by (pool, state) ({P}:pool_replicas{{{SEL}}})", "{{pool}} {{state}}")],
         "short"),
        ("Replicas replaced and drained, streams migrated", [
            q(f"sum by (pool) ({P}:replicas_replaced_total{{{SEL}}})", "replaced {{pool}}"),
            {**q(f"sum by (pool) ({P}:request_migrations_total{{{SEL}}})", "migrated {{pool}}"), "refId": "B"},
            {**q(f"sum by (pool, outcome) ({P}:replicas_drained_total{{{SEL}}})", "drained {{pool}} {{outcome}}"),
             "refId": "C"}],
         "short"),
    ]),
    ("Routing and KV movement", [
        ("Routing decisions / s by reason", [q(f"sum by (pool, reason) (rate({P}:router_decisions_total[{RI}]))",
                                               "{{pool}} {{reason}}")], "short"),
        ("Prefix hit tokens per decision", quant("router_prefix_hit_tokens", (0.5, 0.9)), "short"),
        ("KV pull time (P/D, peers)", quant("kv_pull_seconds", (0.5, 0.99)), "s"),
        ("KV pulled: bytes / s, blocks / s", [
            q(f"sum by (pool) (rate({P}:kv_pull_bytes_sum{{{SEL}}}[{RI}]))", "bytes {{pool}}"),
            {**q(f"sum by (pool) (rate({P}:kv_blocks_transferred_total{{{SEL}}}[{RI}]))", "blocks {{pool}}"),
             "refId": "B"}], "Bps"),
        ("KV pull failures", [q(f"sum by (pool) ({P}:kv_load_failures_total{{{SEL}}})", "{{pool}}")], "short"),
        ("KV offload tier: blocks held", [
            q(f"sum by (replica) ({P}:kv_offload_host_blocks{{{SEL}}})", "host {{replica}}"),
            {**q(f"sum by (replica) ({P}:kv_offload_disk_blocks{{{SEL}}})", "disk {{replica}}"), "refId": "B"}],
         "short"),
        ("KV offload tier: blocks saved / loaded per s", [
            q(f"sum by (pool) (rate({P}:kv_offload_blocks_saved_total{{{SEL}}}[{RI}]))", "saved {{pool}}"),
            {**q(f"sum by (pool) (rate({P}:kv_offload_host_hit_blocks_total{{{SEL}}}[{RI}]) + "
                 f"rate({P}:kv_offload_disk_hit_blocks_total{{{SEL}}}[{RI}]))", "loaded {{pool}}"), "refId": "B"}],
         "short"),
    ]),
]



def build() -> dict:
    """The dashboard as Grafana's JSON model."""
    panels = []
    y = 0
    pid = 1
    for title, items in rows:
        panels.append({"type": "row", "title": title, "id": pid, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        pid += 1
        y += 1
        for i, (ptitle, targets, unit) in enumerate(items):
            panels.append({"type": "timeseries", "title": ptitle, "id": pid,
                           "datasource": {"type": "prometheus", "uid": "${datasource}"},
                           "gridPos": {"h": 8, "w": 8, "x": (i % 3) * 8, "y": y + (i // 3) * 8},
                           "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                           "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
                           "targets": [{**t, "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                                       for t in targets]})
            pid += 1
        y += 8 * (-(-len(items) // 3))

    dashboard = {
        "title": "pdserve", "uid": "pdserve-overview", "schemaVersion": 39, "version": 1, "editable": True,
        "tags": ["pdserve", "llm"], "time": {"from": "now-1h", "to": "now"}, "refresh": "30s",
        "description": "pdserve: traffic, latency (vLLM's histograms), engine phases, replicas, routing and KV "
                       "movement. Every expression reads a series the ingress's /metrics exports "
                       "(tests/serving/test_observability.py checks them against a real Prometheus).",
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"},
            {"name": "prefix", "type": "custom", "label": "metrics_prefix", "query": "pdserve,vllm",
             "current": {"text": "pdserve", "value": "pdserve"},
             "options": [{"text": "pdserve", "value": "pdserve", "selected": True},
                         {"text": "vllm", "value": "vllm", "selected": False}]},
            {"name": "pool", "type": "query", "label": "pool",
             "datasource": {"type": "prometheus", "uid": "${datasource}"},
             "query": {"query": "label_values(${prefix}:num_requests_running, pool)", "refId": "pool"},
             "includeAll": True, "multi": True, "allValue": ".*", "refresh": 2},
        ]},
        "panels": panels,
    }
    return dashboard


if __name__ == "__main__":
    with open(OUT, "w") as f:
        json.dump(build(), f, indent=1)
        f.write("\n")
    print(f"wrote {OUT}")
