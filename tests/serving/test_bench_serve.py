"""The serving benchmark's pieces (unit): datasets, arrivals, percentiles, goodput. It runs against a
live `pdserve serve` in tests/cluster/test_pools.py."""
from __future__ import annotations

import argparse
import statistics

import numpy as np
import pytest
from helpers import benchmarks_on_path

benchmarks_on_path()

import serve
import workloads


def _args(**kw) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    serve.add_args(ap)
    args = ap.parse_args([])
    for k, v in kw.items():
        setattr(args, k, v)
    return args


def test_datasets_have_the_asked_shapes():
    reqs = workloads.make_dataset(_args(dataset="random", input_len="10:20", output_len="5", num_prompts=50, warmup=2))
    assert len(reqs) == 52 and all(10 <= len(r.prompt) <= 20 and r.output_len == 5 for r in reqs)
    assert all(100 <= t < 49152 - 100 for r in reqs for t in r.prompt)
    assert workloads.make_dataset(_args(dataset="random", input_len="10:20", num_prompts=5))[0].prompt == \
        workloads.make_dataset(_args(dataset="random", input_len="10:20", num_prompts=5))[0].prompt    # seeded
    pre = workloads.make_dataset(_args(dataset="prefix", prefix_len=32, num_prefixes=3, input_len="4:8",
                                       num_prompts=40))
    assert len({tuple(r.prompt[:32]) for r in pre}) == 3 and all(36 <= len(r.prompt) <= 40 for r in pre)
    share = workloads.make_dataset(_args(dataset="sharegpt", input_len="200", output_len="100", num_prompts=400,
                                     max_model_len=2048))
    ins = [len(r.prompt) for r in share]
    assert 120 < statistics.median(ins) < 300 and max(ins) <= 1024 and len(set(ins)) > 100
    assert all(len(r.prompt) + r.output_len < 2048 for r in share)
    multi = workloads.make_dataset(_args(dataset="multiturn", num_prompts=3, warmup=1, turns=4, input_len="3:5"))
    units = serve._units(multi)
    assert [len(u) for u in units] == [4] * 4 and all(isinstance(r.prompt, str) for r in multi)
    assert [r.turn for r in units[1]] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="lo:hi"):
        workloads.parse_range("9:3")
    mixed = workloads.make_dataset(_args(dataset="mixed", input_len="8:16", output_len="32", long_input_len="500:600",
                                     long_output_len="2", long_fraction=0.25, num_prompts=400))
    longs = [r for r in mixed if r.cls == "long"]
    assert {r.cls for r in mixed} == {"short", "long"} and 0.18 < len(longs) / len(mixed) < 0.32
    assert all(500 <= len(r.prompt) <= 600 and r.output_len == 2 for r in longs)
    assert all(8 <= len(r.prompt) <= 16 and r.output_len == 32 for r in mixed if r.cls == "short")
    with pytest.raises(ValueError, match="long-fraction"):
        workloads.make_dataset(_args(dataset="mixed", long_fraction=1.5))


def test_poisson_and_bursty_arrivals_keep_the_rate():
    poisson = list(serve.arrival_gaps(4.0, 1.0, 4000, seed=0))
    bursty = list(serve.arrival_gaps(4.0, 0.25, 4000, seed=0))
    for gaps in (poisson, bursty):
        assert abs(statistics.fmean(gaps) - 0.25) < 0.03
    cv = lambda g: statistics.pstdev(g) / statistics.fmean(g)  # noqa: E731
    assert abs(cv(poisson) - 1.0) < 0.1 and cv(bursty) > 1.6          # gamma: cv = 1/sqrt(shape)
    assert set(serve.arrival_gaps(float("inf"), 1.0, 3, 0)) == {0.0}


def test_percentiles_match_numpy_and_goodput_counts_slos():
    xs = [0.3, 0.1, 0.7, 0.2, 0.9, 0.5, 0.4]
    p = serve.percentiles(xs)
    assert p["median"] == pytest.approx(np.percentile(xs, 50)) and p["p90"] == pytest.approx(np.percentile(xs, 90))
    assert p["p99"] == pytest.approx(np.percentile(xs, 99)) and p["mean"] == pytest.approx(np.mean(xs))
    results = [serve.RequestResult(ok=True, prompt_len=10, output_tokens=11, ttft=0.1, e2e=1.1, itl=[0.1] * 10),
               serve.RequestResult(ok=True, prompt_len=10, output_tokens=11, ttft=0.6, e2e=1.6, itl=[0.1] * 10),
               serve.RequestResult(ok=True, prompt_len=10, output_tokens=3, ttft=0.1, e2e=0.9, itl=[0.4, 0.4]),
               serve.RequestResult(ok=False, error="HTTP 503: x")]
    s = serve.summarize(results, 2.0, serve.parse_slos(["ttft:500", "tpot:200"]))
    assert (s["completed"], s["failed"], s["errors"]) == (3, 1, ["HTTP 503: x"])
    assert s["goodput"] == 0.5                     # only the first meets both (the 2nd: TTFT, the 3rd: TPOT)
    assert s["output_token_throughput"] == 12.5 and s["tpot_ms"]["median"] == pytest.approx(100.0)
    with pytest.raises(ValueError, match="ttft:MS"):
        serve.parse_slos(["latency:5"])


def _classed_results() -> list:
    short = [serve.RequestResult(ok=True, prompt_len=10, output_tokens=5, ttft=0.1 * i, e2e=1.0, itl=[0.05, 0.1 * i],
                                 cls="short") for i in range(1, 5)]
    long = [serve.RequestResult(ok=True, prompt_len=1000, output_tokens=2, ttft=2.0, e2e=2.5, itl=[0.5], cls="long")]
    return short + long


def test_summary_per_class_and_scraped_counters():
    results = _classed_results()
    s = serve.summarize(results, 2.0, metrics_delta={'m_total{pool="prefill",replica="p0"}': 7.0,
                                                     'm_total{pool="prefill",replica="p1"}': 5.0})
    assert set(s["classes"]) == {"short", "long"} and s["classes"]["long"]["completed"] == 1
    assert s["classes"]["short"]["itl_ms"]["max"] == pytest.approx(400.0)
    assert s["classes"]["short"]["output_token_throughput"] == 10.0 and s["output_token_throughput"] == 11.0
    assert s["itl_ms"]["max"] == pytest.approx(500.0) and s["metrics_total"] == {"m_total": 12.0}
    assert "classes" not in serve.summarize([serve.RequestResult(ok=True, output_tokens=1)], 1.0)
    page = ('# HELP pdserve:prompt_tokens_computed_total x\n# TYPE pdserve:prompt_tokens_computed_total counter\n'
            'pdserve:prompt_tokens_computed_total{pool="prefill",replica="a"} 1200\n'
            'pdserve:prompt_tokens_computed_total{pool="decode",replica="b"} 3\n'
            'pdserve:prompt_tokens_total{pool="decode",replica="b"} 4000\nvllm:num_requests_running 2.0\n')
    got = serve.parse_prometheus(page, ["pdserve:prompt_tokens_computed_total", "vllm:num_requests_running"])
    assert got == {'pdserve:prompt_tokens_computed_total{pool="prefill",replica="a"}': 1200.0,
                   'pdserve:prompt_tokens_computed_total{pool="decode",replica="b"}': 3.0,
                   "vllm:num_requests_running": 2.0}


def test_plots_write_pngs(tmp_path):
    pytest.importorskip("matplotlib", reason="plots need matplotlib (the bench and test extras)")
    import plots

    results = _classed_results()
    serve.plot(results, str(tmp_path / "cdf.png"), "run")
    summary = serve.summarize(results, 2.0)
    plots.throughput_vs_rate({"a": [(1.0, summary), (2.0, summary),
                                    (2.0, {**summary, "output_token_throughput": 3.0})]},
                             str(tmp_path / "rate.png"))
    for name in ("cdf.png", "rate.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000


def test_vs_vllm_cells_never_resend_each_others_prompts(monkeypatch):
    """Every prompt of the served matrix is new to both servers: no cell (nor round) re-sends another's,
    which would be a prefix-cache hit for whichever server still held it."""
    import compare
    import vs_vllm

    seen: dict[tuple[int, ...], str] = {}

    def fake_compare(argv: list[str]) -> dict:
        ap = argparse.ArgumentParser(allow_abbrev=False)
        ap.add_argument("--rounds", type=int)
        ap.add_argument("--new-prompts-per-round", action="store_true")
        serve.add_args(ap)
        known, _ = ap.parse_known_args(argv)
        cell = f"{known.input_len} c={known.concurrency}"
        for i in range(known.rounds):
            for r in workloads.make_dataset(argparse.Namespace(**{**vars(known), "seed": known.seed + i})):
                key = tuple(r.prompt)
                assert key not in seen, f"{cell} round {i} re-sends a prompt of {seen[key]}"
                seen[key] = f"{cell} round {i}"
        one = {"output_token_throughput": 1.0, "ttft_ms": {"median": 1.0}, "itl_ms": {"median": 1.0, "p99": 1.0}}
        return {"rounds": [{"pdserve": one, "vllm": one}] * known.rounds,
                "ratios": {name: 1.0 for name, _ in vs_vllm.COLUMNS}}

    monkeypatch.setattr(compare, "main", fake_compare)
    cells = vs_vllm.main(["--a", "http://127.0.0.1:1", "--b", "http://127.0.0.1:2", "--concurrency", "1,12,32",
                          "--workloads", "decode-heavy,prefill-heavy", "--rounds", "2"])
    assert len(cells) == 6 and len(seen) == 2 * 2 * (10 + 38 + 98)
    assert cells[0]["prefix_cache_hit_tokens"] == {"pdserve": None, "vllm": None}    # no /metrics there
    text = '# TYPE vllm:prefix_cache_hits_total counter\nvllm:prefix_cache_hits_total{engine="0"} 48.0\n'
    assert serve.parse_prometheus(text, vs_vllm.HIT_COUNTERS) == {'vllm:prefix_cache_hits_total{engine="0"}': 48.0}
