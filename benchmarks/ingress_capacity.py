"""How many requests one ingress replica serves, on simulated replicas (so the engines cost nothing
and the ingress path is what is measured): short streamed chats through Ray Serve's HTTP proxy,
sent by `wrk` (C, keep-alive connections, a Lua script posting the body) at a fixed number of
connections, against `pdserve serve --simulate` with `--ingress-replicas` 1, then 2 (and each
`--channel` and `--proxy-channel` asked for, alternating).

Reported per run: requests per second (wrk), the CPU seconds each process kind spent over the
window (the ingress replicas, Serve's proxy, the simulated replicas' hosts: psutil), and so the
requests per ingress CPU-second: what one ingress core sustains, whatever else shares this
machine's cores. With `--profile-ingress`, py-spy samples the ingress replica during the window and
the functions it spent the most time in are printed (own time and with callees; needs py-spy in the
venv: `.venv/bin/pip install py-spy`).

    .venv/bin/python benchmarks/ingress_capacity.py --connections 64 --seconds 20 --json ingress.json
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import httpx
import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import serve as bench  # benchmarks/serve.py: served()

LUA = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
counter = 0
request = function()
  counter = counter + 1
  local body = '{"model": "%s", "stream": true, "max_tokens": %d, "temperature": 0, "ignore_eos": true, ' ..
    '"messages": [{"role": "user", "content": "Question ' .. counter .. ': what is the capital of France?"}]}'
  return wrk.format(nil, "/v1/chat/completions", nil, body)
end
"""
KINDS = {"ingress": "openai-ingress", "proxy": "ProxyActor", "hosts": "ReplicaHost"}


def processes() -> dict[str, list[psutil.Process]]:
    found: dict[str, list[psutil.Process]] = {k: [] for k in KINDS}
    for p in psutil.process_iter(["cmdline", "name"]):
        text = " ".join(p.info["cmdline"] or []) + " " + (p.info["name"] or "")
        for kind, marker in KINDS.items():
            if marker in text:
                found[kind].append(p)
    return found


def cpu_seconds(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def run(args: argparse.Namespace, ingress_replicas: int, channel: str, proxy_channel: str) -> dict:
    direct = ", direct_ingress: true" if args.direct_ingress else ""
    spec = (f"engine: {{simulate: {args.profile}, max_model_len: 4096, stream_interval: {args.stream_interval}}}\n"
            f"pools:\n  decode: {{replicas: {args.replicas}, replicas_per_process: 8}}\n"
            f"routing: {{channel: {channel}}}\n"
            f"serving: {{port: PORT, ingress_replicas: {ingress_replicas}, ingress_num_cpus: 1, "
            f"max_in_flight: 100000, proxy_channel: {proxy_channel}{direct}}}\n")
    with bench.served(spec) as base:
        return {"server": "pdserve", "ingress_replicas": ingress_replicas, "channel": channel,
                "proxy_channel": proxy_channel,
                "stream_interval": args.stream_interval, **measure(args, base, ingress_replicas)}


def run_floor(args: argparse.Namespace) -> dict:
    """The same load against Serve's floor (benchmarks/serve_floor.py: a bare streaming deployment)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.join(root, "tests"))
    from helpers import free_port  # the tests' helper (tests/ is on the path now), as serve.py's

    port = free_port()
    cmd = [sys.executable, os.path.join(root, "benchmarks", "serve_floor.py"), "--port", str(port)]
    with bench.serving(cmd + (["--direct-ingress"] if args.direct_ingress else []), port, timeout_s=300) as base:
        return {"server": "serve_floor", "ingress_replicas": 1, **measure(args, base, 1)}


def measure(args: argparse.Namespace, base: str, ingress_replicas: int) -> dict:
    """wrk's load on a server that answers: requests per second, CPU per process kind, py-spy."""
    model = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(LUA % (model, args.max_tokens))
    wrk = ["wrk", "-t", "1", "-c", str(args.connections), "--latency", "-s", f.name, base]
    subprocess.run([*wrk[:-1], "-d", "5s", base], capture_output=True, check=True)     # warm up
    procs = processes()
    before = {k: cpu_seconds(v) for k, v in procs.items()}
    spy = None
    if args.profile_ingress and procs["ingress"]:
        raw = os.path.join(tempfile.gettempdir(), f"ingress-{ingress_replicas}.txt")
        py_spy = os.path.join(os.path.dirname(sys.executable), "py-spy")
        spy = (subprocess.Popen([py_spy, "record", "--pid", str(procs["ingress"][0].pid), "--duration",
                                 str(args.seconds), "--format", "raw", "--output", raw, "--nonblocking"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), raw)
    began = time.monotonic()
    out = subprocess.run([*wrk[:-1], "-d", f"{args.seconds}s", base], capture_output=True, text=True,
                         check=True).stdout
    wall = time.monotonic() - began
    used = {k: round(cpu_seconds(v) - before[k], 2) for k, v in procs.items()}
    profile = None
    if spy is not None:
        spy[0].wait(timeout=60)
        profile = top_functions(spy[1])
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    p50 = re.search(r"50%\s+([\d.]+)(\w+)", out)
    return {"direct_ingress": args.direct_ingress, "requests_per_s": rps, "wall_s": round(wall, 1),
            "non_2xx": int(errors.group(1)) if errors else 0,
            "latency_p50": f"{p50.group(1)}{p50.group(2)}" if p50 else None,
            "cpu_s": used, "ingress_cpu_share": round(used["ingress"] / wall, 3),
            "requests_per_ingress_cpu_s": round(rps * wall / used["ingress"], 1) if used["ingress"] else None,
            "ingress_cpu_us_per_token": (round(used["ingress"] / (rps * wall * args.max_tokens) * 1e6, 1)
                                         if rps else None),
            "profile": profile}


def top_functions(path: str, n: int = 15) -> dict:
    """py-spy's raw stacks -> the functions with the most samples, own and with callees."""
    own: collections.Counter = collections.Counter()
    inclusive: collections.Counter = collections.Counter()
    total = 0
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip().rpartition(" ")
            if not count.isdigit():
                continue
            frames = [fr.split(" (")[0] + " (" + fr.split(" (")[1].split(":")[0].split("/")[-1] + ")"
                      if " (" in fr else fr for fr in stack.split(";")]
            total += int(count)
            own[frames[-1]] += int(count)
            for fr in set(frames):
                inclusive[fr] += int(count)
    return {"samples": total,
            "own": [(f, round(c / total, 3)) for f, c in own.most_common(n)],
            "inclusive": [(f, round(c / total, 3)) for f, c in inclusive.most_common(3 * n)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="h200-llama3-8b", help="the simulated replicas' profile")
    ap.add_argument("--replicas", type=int, default=16)
    ap.add_argument("--connections", type=int, default=64)
    ap.add_argument("--seconds", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--stream-interval", type=int, default=1,
                    help="the engines' stream_interval (a chunk's fewest new tokens; vLLM's --stream-interval)")
    ap.add_argument("--ingress", default="1,2", help="ingress replica counts to run")
    ap.add_argument("--profile-ingress", action="store_true", help="sample the ingress with py-spy")
    ap.add_argument("--floor", action="store_true",
                    help="also run the same load against Serve's floor (benchmarks/serve_floor.py), first")
    ap.add_argument("--direct-ingress", action="store_true",
                    help="the ingress serves the port itself (serving.direct_ingress), not through Serve's proxy")
    ap.add_argument("--channel", default="tcp",
                    help="the output channels' transports to run, alternating (routing.channel: tcp, ray)")
    ap.add_argument("--proxy-channel", default="grpc",
                    help="Serve's proxy-to-ingress channels to run, alternating (serving.proxy_channel: grpc, ray)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    results = ([run_floor(args)] if args.floor else []) + [
        run(args, int(n), channel, proxy_channel) for _ in range(args.rounds) for n in args.ingress.split(",")
        for channel in args.channel.split(",") for proxy_channel in args.proxy_channel.split(",")]
    for r in results:
        print(json.dumps({k: v for k, v in r.items() if k != "profile"}))
        if r["profile"]:
            print("  ingress own time:", r["profile"]["own"][:10])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
