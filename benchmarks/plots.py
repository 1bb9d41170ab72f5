"""PNG plots of serving benchmark results (benchmarks/serve.py and benchmarks/compare.py JSON):
latency CDFs of several runs, and throughput against request rate. Needs matplotlib
(`pip install -e .[bench]`).

    .venv/bin/python benchmarks/plots.py cdf docs/ttft.png prefix.json rr.json --panels ttft
    .venv/bin/python benchmarks/plots.py cdf docs/itl.png cmp.json --cls short --panels itl,ttft
    .venv/bin/python benchmarks/plots.py rate docs/rate.png cmp-r0.5.json cmp-r1.json cmp-r2.json

A serve.py result is one run (named by its --label, else its file name); a compare.py result gives
one run per endpoint label, its rounds pooled.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path
from typing import Any

PANELS = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2e": "E2E"}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _record(r: Any) -> dict[str, Any]:
    return dataclasses.asdict(r) if dataclasses.is_dataclass(r) else r


def _values(records: list[dict[str, Any]], panel: str) -> list[float]:
    """Milliseconds: per request (TTFT, TPOT, E2E) or per streamed gap (ITL)."""
    ok = [r for r in records if r["ok"]]
    if panel == "itl":
        return [x * 1e3 for r in ok for x in r["itl"]]
    if panel == "tpot":
        return [(r["e2e"] - r["ttft"]) / (r["output_tokens"] - 1) * 1e3 for r in ok if r["output_tokens"] > 1]
    return [r[panel] * 1e3 for r in ok]


def latency_cdfs(runs: dict[str, list[Any]], path: str, panels: tuple[str, ...] = tuple(PANELS),
                 title: str = "") -> None:
    """One panel per latency (CDF, log x when the values span more than 20x), one curve per run.
    runs: label -> per-request results (RequestResult or its JSON dict)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.2), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        lo, hi = float("inf"), 0.0
        for label, records in runs.items():
            values = sorted(_values([_record(r) for r in records], panel))
            if not values:
                continue
            lo, hi = min(lo, max(values[0], 1e-3)), max(hi, values[-1])
            ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=label, drawstyle="steps-post")
        if hi > 20 * lo:
            ax.set_xscale("log")
        ax.set_xlabel(f"{PANELS[panel]} (ms)")
        ax.set_ylabel("fraction of gaps" if panel == "itl" else "fraction of requests")
        _style(ax)
    _save(plt, fig, path, title)


def _style(ax: Any) -> None:
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)


def _save(plt: Any, fig: Any, path: str, title: str) -> None:
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def throughput_vs_rate(points: dict[str, list[tuple[float, dict[str, Any]]]], path: str, title: str = "") -> None:
    """Output tokens/s and median TTFT against the offered request rate, one line per label (the
    median over runs at the same rate, bars spanning their range).
    points: label -> [(request rate, serve.summarize() dict)]."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    for label, pts in points.items():
        by_rate: dict[float, list[dict[str, Any]]] = {}
        for rate, summary in pts:
            by_rate.setdefault(rate, []).append(summary)
        rates = sorted(by_rate)
        for ax, get in ((left, lambda s: s["output_token_throughput"]), (right, lambda s: s["ttft_ms"]["median"])):
            ys = [sorted(get(s) for s in by_rate[r]) for r in rates]     # several rounds: median, range
            mid = [statistics.median(y) for y in ys]
            ax.errorbar(rates, mid, yerr=[[m - y[0] for m, y in zip(mid, ys)], [y[-1] - m for m, y in zip(mid, ys)]],
                        marker="o", capsize=3, label=label)
    left.set_ylabel("output tokens/s")
    right.set_ylabel("median TTFT (ms)")
    right.set_yscale("log")
    for ax in (left, right):
        ax.set_xlabel("offered request rate (req/s)")
        _style(ax)
    _save(plt, fig, path, title)


def load_runs(path: str, cls: str | None = None) -> dict[str, list[dict[str, Any]]]:
    """label -> per-request records of a serve.py or compare.py result file (one class if given)."""
    data = json.loads(Path(path).read_text())
    if "rounds" in data:
        runs = data["requests"]
    else:
        runs = {data["args"].get("label") or Path(path).stem: data["requests"]}
    if cls is not None:
        runs = {label: [r for r in records if r.get("cls") == cls] for label, records in runs.items()}
    return runs


def load_rate_points(path: str) -> dict[str, list[tuple[float, dict[str, Any]]]]:
    """label -> [(request rate, summary)] of a result file (every round of a compare.py result)."""
    data = json.loads(Path(path).read_text())
    rate = float(data["args"]["request_rate"])
    if "rounds" in data:
        out: dict[str, list[tuple[float, dict[str, Any]]]] = {}
        for one in data["rounds"]:
            for label, summary in one.items():
                out.setdefault(label, []).append((rate, summary))
        return out
    return {data["args"].get("label") or "run": [(rate, data["summary"])]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("kind", choices=["cdf", "rate"])
    ap.add_argument("out", help="PNG to write")
    ap.add_argument("results", nargs="+", help="serve.py --result or compare.py --result JSON files")
    ap.add_argument("--cls", default=None, help="cdf: only requests of this class (mixed dataset)")
    ap.add_argument("--panels", default=",".join(PANELS), help="cdf: comma-separated of ttft,tpot,itl,e2e")
    ap.add_argument("--title", default="")
    args = ap.parse_args(argv)
    if args.kind == "cdf":
        runs: dict[str, list[dict[str, Any]]] = {}
        for path in args.results:
            for label, records in load_runs(path, args.cls).items():
                runs.setdefault(label, []).extend(records)
        panels = tuple(p.strip() for p in args.panels.split(","))
        unknown = [p for p in panels if p not in PANELS]
        if unknown:
            raise SystemExit(f"--panels must be among {list(PANELS)}; got {unknown}")
        latency_cdfs(runs, args.out, panels, args.title)
    else:
        points: dict[str, list[tuple[float, dict[str, Any]]]] = {}
        for path in args.results:
            for label, pts in load_rate_points(path).items():
                points.setdefault(label, []).extend(pts)
        throughput_vs_rate(points, args.out, args.title)


if __name__ == "__main__":
    main()
