"""Where a served token's CPU time goes: run a serving workload (benchmarks/serve.py's options) and
report the CPU time each process of the server's tree spent per output token.

    .venv/bin/python benchmarks/serving_cpu.py --server-pid $(pgrep -f "pdserve serve" | head -1) \\
        --base-url http://127.0.0.1:8000 --dataset random --input-len 16:32 --output-len 128 \\
        --num-prompts 32 --concurrency 16

The processes are those under `--server-pid` (a `pdserve serve` launcher with its local Ray, or a
vLLM server), grouped by what they run (Ray sets actor process titles: `ray::EngineReplica`,
`ray::ServeReplica:<app>:openai-ingress`, `ray::ProxyActor`, ...). CPU time is user + system from
the kernel's accounting over the timed part of the run, so it counts every thread of a process
(the engine's step thread and the actor's event loop alike) and nothing of the client.
"""
from __future__ import annotations

import argparse
import asyncio
import re
import sys
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

import serve
import workloads


def role(proc: psutil.Process) -> str:
    """A stable name for what a process does (its Ray title without per-call suffixes)."""
    try:
        cmd = proc.cmdline()
        name = cmd[0] if cmd else proc.name()
    except psutil.Error:
        return "?"
    if name.startswith("ray::"):
        name = re.sub(r"\.\w+$", "", name.split()[0])          # ray::EngineReplica.generate -> ray::EngineReplica
        return re.sub(r"^ray::ServeReplica:[^:]+:", "ray::ServeReplica:", name)
    base = Path(name).name
    if base.startswith("python"):
        script = next((a for a in cmd[1:] if not a.startswith("-")), "")
        return f"python {Path(script).name}" if script else base
    return base


def cpu_by_process(root: int) -> dict[int, tuple[str, float]]:
    """pid -> (role, CPU seconds so far) for the root and its descendants."""
    try:
        parent = psutil.Process(root)
        procs = [parent, *parent.children(recursive=True)]
    except psutil.NoSuchProcess:
        raise SystemExit(f"no process {root}") from None
    out = {}
    for p in procs:
        try:
            t = p.cpu_times()
            out[p.pid] = (role(p), t.user + t.system)
        except psutil.Error:
            continue
    return out


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--server-pid", type=int, required=True)
    serve.add_args(ap)
    args = ap.parse_args(argv)
    requests = workloads.make_dataset(args)
    snapshots: list[dict[int, tuple[str, float]]] = []
    results, wall, _ = asyncio.run(serve.run(args, requests,
                                             on_timed=lambda: snapshots.append(cpu_by_process(args.server_pid))))
    before, after = snapshots
    summary = serve.summarize(results, wall)
    tokens = max(1, summary["output_tokens"])
    by_role: dict[str, float] = {}
    for pid, (name, cpu) in after.items():
        by_role[name] = by_role.get(name, 0.0) + cpu - before.get(pid, (name, 0.0))[1]
    total = sum(by_role.values())
    print(f"{summary['completed']} requests, {summary['output_tokens']} output tokens in {wall:.1f} s "
          f"({summary['output_token_throughput']:.1f} tok/s); server CPU {total:.1f} s "
          f"({total / wall:.2f} cores)")
    print(f"{'process':48} {'CPU s':>8} {'ms/token':>9} {'share':>6}")
    for name, cpu in sorted(by_role.items(), key=lambda kv: -kv[1]):
        if cpu >= 0.005 * total:
            print(f"{name[:48]:48} {cpu:8.2f} {1000 * cpu / tokens:9.2f} {cpu / total:6.1%}")
    return {name: 1000 * cpu / tokens for name, cpu in by_role.items()}


if __name__ == "__main__":
    main()
