"""Where a command's CPU goes, by process kind: every process on the machine sampled while the
command runs (a test lane starts ~180 Ray processes, most of them short-lived), grouped by the name
Ray gives it (`ray::EngineReplica`, `ray::Worker`, ...) or its program, and the machine's busy and
idle CPU over the run (docs/perf/journal.md §47).

    .venv/bin/python benchmarks/process_cpu.py -- .venv/bin/python -m pytest -q \\
        -m "(ray or cluster) and not slow" tests

A process is seen only at samples (`--interval`, default 1 s): one that lives shorter than that is
missed, and one's CPU after its last sample is lost, so the total is a little under the machine's
busy CPU, which is printed beside it. Processes running before the command count only what they
spent during it.
"""
from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import time

import psutil

# Programs named by their command line rather than by a Ray name.
PROGRAMS = ("raylet", "gcs_server", "log_monitor", "dashboard", "runtime_env", "monitor.py", "pytest", "pdserve")


def kind(cmdline: str) -> str:
    """A process's group: its Ray name without the method it ran last (`ray::Worker.serve_steps` is
    a `ray::Worker`), else the first of PROGRAMS its command line names, else its start."""
    ray_name = re.match(r"ray::([A-Za-z_]+)", cmdline)
    if ray_name:
        return "ray::" + ray_name.group(1)
    return next((p for p in PROGRAMS if p in cmdline), cmdline[:50])


def sample(command: list[str], interval: float) -> tuple[dict[int, tuple[str, float]], int]:
    """Run `command`, sampling every process each `interval` s: pid -> (kind, CPU seconds spent
    since the run began), and the command's exit status."""
    seen: dict[int, tuple[str, float]] = {}
    before: dict[int, float] = {}
    me = psutil.Process().pid
    for p in psutil.process_iter(["cpu_times"]):
        if p.info["cpu_times"] is not None:
            before[p.pid] = p.info["cpu_times"].user + p.info["cpu_times"].system
    proc = subprocess.Popen(command)
    while True:
        done = proc.poll() is not None
        for p in psutil.process_iter(["cmdline", "name", "cpu_times"]):
            times = p.info["cpu_times"]
            if times is None or p.pid == me:
                continue
            name = kind(" ".join(p.info["cmdline"] or [p.info["name"] or "?"]))
            old = seen.get(p.pid)
            if old is not None and name.startswith("ray::IDLE"):
                name = old[0]                  # (a worker between actors keeps the kind it had)
            seen[p.pid] = (name, times.user + times.system - before.get(p.pid, 0.0))
        if done:
            return seen, proc.returncode
        time.sleep(interval)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between samples")
    parser.add_argument("--top", type=int, default=25, help="how many kinds to print")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    cpu0, wall0 = psutil.cpu_times(), time.monotonic()
    seen, status = sample(command, args.interval)
    cpu1, wall = psutil.cpu_times(), time.monotonic() - wall0
    idle = (cpu1.idle + getattr(cpu1, "iowait", 0.0)) - (cpu0.idle + getattr(cpu0, "iowait", 0.0))
    busy = sum(cpu1) - sum(cpu0) - idle
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for name, spent in seen.values():
        if spent > 0.05:
            totals[name][0] += spent
            totals[name][1] += 1
    print(f"{'cpu-s':>8} {'processes':>9}  kind")
    for name, (spent, count) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"{spent:8.1f} {count:9d}  {name}")
    print(f"{sum(t[0] for t in totals.values()):8.1f} sampled; the machine: wall {wall:.1f} s, busy {busy:.1f} "
          f"cpu-s, idle {idle:.1f} cpu-s; the command exited {status}")
    sys.exit(status)


if __name__ == "__main__":
    main()
