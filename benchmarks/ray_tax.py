"""What an idle server's processes cost a CPU engine beside them: time a prefill-sized bf16 GEMM (the
engine's largest share of a prefill step) with every process of a running server stopped
(SIGSTOP), with one group of them running, and with all of them running, alternating; and count
each group's context switches a second while it idles.

    .venv/bin/pdserve serve --config my.yaml &                      # any server, left idle
    .venv/bin/python benchmarks/ray_tax.py --server-pid $(pgrep -f "pdserve serve" | head -1)

The groups are Ray's own services (GCS, raylet), the Ray workers (Serve's controller and proxy, the
ingress, the engine replicas, the cluster manager) and the rest (dashboard, agents, monitors, the
launcher). Each group runs alone for one timing, a few seconds at most, well inside Ray's health
check timeouts. docs/perf/journal.md §41 has what it found and what was tried against it.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving_cpu import role

GROUPS = ("ray services", "ray workers", "rest")


def group_of(name: str) -> str:
    if name in ("gcs_server", "raylet"):
        return "ray services"
    if name.startswith("ray::") and "Agent" not in name:
        return "ray workers"
    return "rest"


def server_groups(root: int) -> dict[str, list[psutil.Process]]:
    """The server's processes (the root and its descendants) by group, this benchmark excluded."""
    parent = psutil.Process(root)
    groups: dict[str, list[psutil.Process]] = {g: [] for g in GROUPS}
    for p in [parent, *parent.children(recursive=True)]:
        if p.pid != os.getpid():
            groups[group_of(role(p))].append(p)
    return groups


def switches(procs: list[psutil.Process]) -> int:
    """Context switches so far over every thread of `procs` (voluntary and not)."""
    total = 0
    for p in procs:
        try:
            tids = os.listdir(f"/proc/{p.pid}/task")
        except OSError:                     # the process is gone
            continue
        for tid in tids:
            try:
                text = Path(f"/proc/{p.pid}/task/{tid}/status").read_text()
            except OSError:
                continue
            total += sum(int(line.split()[1]) for line in text.splitlines() if "ctxt_switches" in line)
    return total


def signal_all(procs: list[psutil.Process], sig: int) -> None:
    for p in procs:
        try:
            os.kill(p.pid, sig)
        except ProcessLookupError:
            pass


class Gemm:
    """The embedded model's merged gate/up projection over a 2,048-token step, prepacked as a
    served engine runs it."""

    def __init__(self, rows: int, in_features: int, out_features: int, calls: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(rows, in_features, generator=g).bfloat16()
        weight = torch.randn(out_features, in_features, generator=g).bfloat16()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        self.calls = calls
        self.flops = 2 * rows * in_features * out_features

    def __call__(self) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(self.x, self.packed, None, "none", [], None)

    def mean_ms(self) -> float:
        start = time.perf_counter()
        for _ in range(self.calls):
            self()
        return (time.perf_counter() - start) / self.calls * 1e3


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--server-pid", type=int, required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--shape", default="576,3072", help="in_features,out_features of the GEMM")
    ap.add_argument("--calls", type=int, default=250, help="GEMMs per timing (~2 s at the default shape)")
    ap.add_argument("--idle-seconds", type=float, default=5.0, help="how long each group's switches are counted")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    k, n = (int(v) for v in args.shape.split(","))
    gemm = Gemm(args.rows, k, n, args.calls)
    for _ in range(10):
        gemm()
    groups = server_groups(args.server_pid)
    everyone = [p for procs in groups.values() for p in procs]
    print({g: sorted({role(p) for p in procs}) for g, procs in groups.items()})

    rates = {}
    for g, procs in groups.items():
        before = switches(procs)
        time.sleep(args.idle_seconds)
        rates[g] = (switches(procs) - before) / args.idle_seconds
    print("idle context switches a second: " + ", ".join(f"{g} {r:.0f}" for g, r in rates.items()))

    settings = ("all stopped", *(f"{g} running" for g in GROUPS), "all running")
    times: dict[str, list[float]] = {s: [] for s in settings}
    try:
        for _ in range(args.rounds):
            for s in settings:
                signal_all(everyone, signal.SIGSTOP)
                if s == "all running":
                    signal_all(everyone, signal.SIGCONT)
                elif s != "all stopped":
                    signal_all(groups[s.removesuffix(" running")], signal.SIGCONT)
                time.sleep(0.3)
                times[s].append(gemm.mean_ms())
                signal_all(everyone, signal.SIGCONT)
                time.sleep(0.5)
    finally:
        signal_all(everyone, signal.SIGCONT)
    base = min(times["all stopped"])
    print(f"{args.rows} x {k} -> {n} bf16 GEMM, ms a call (mean of {args.calls}) per round; best / all stopped's best")
    for s in settings:
        best = min(times[s])
        print(f"  {s:22s} {' '.join(f'{t:.3f}' for t in times[s])}   "
              f"{best / base:.3f}  ({gemm.flops / best / 1e6:.0f} GFLOP/s)")
    result = {"idle_switches_per_s": rates, "gemm_ms": times}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
