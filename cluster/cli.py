"""The `pdserve` command line.

    pdserve serve [--config spec.yaml] [--model PATH] [--port 8000] [--replicas N]   # OpenAI API on Ray
    pdserve generate "prompt" [--model PATH] [--max-tokens N] [--temperature T]      # offline, in-process
    pdserve scale [MODEL/]POOL N [--drain-timeout S] [--address ADDR] [--name NAME] # resize a running pool
    pdserve status [--json] [--address ADDR] [--name NAME]                          # models, pools, replicas
    pdserve apply SPEC.yaml [--address ADDR]                                        # update a deployment's spec
    pdserve simulate --trace FILE --profile P [--config SPEC] [--replicas N] [--json]  # replay in virtual time
    pdserve plan --trace FILE --profile P --ttft-slo MS --itl-slo MS [--output SPEC]  # the cheapest spec for an SLO
    pdserve profile --output FILE [--model PATH] [--threads N]                     # calibrate a profile here
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    parser = argparse.ArgumentParser(prog="pdserve", description="pdserve: LLM serving on Ray")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text offline with one engine in this process")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=None,
                     help="HF directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--dtype", default="auto")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    srv = sub.add_parser("serve", help="serve the model behind an OpenAI-compatible API on Ray Serve")
    from cluster.launch import run_serve  # noqa: PLC0415
    from cluster.serve_args import add_serve_args  # noqa: PLC0415

    add_serve_args(srv)
    scale = sub.add_parser("scale", help="resize a pool of a running deployment (replicas removed are drained)")
    scale.add_argument("pool", help="prefill or decode; MODEL/POOL in a spec of several models (e.g. qwen/decode)")
    scale.add_argument("replicas", type=int)
    scale.add_argument("--drain-timeout", type=float, default=60.0,
                       help="seconds a removed replica may finish its requests before its streams migrate")
    status = sub.add_parser("status", help="the pools of a running deployment")
    status.add_argument("--json", action="store_true")
    apply = sub.add_parser("apply", help="update a running deployment to this spec in place (pools resized "
                                         "or replaced rolling, no stream cut)")
    apply.add_argument("spec", help="the spec (YAML) of the deployment; its `name` says which")
    apply.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for the update")
    apply.add_argument("--route-prefix", default="/", help="the app's route prefix (default: /)")
    for p in (scale, status, apply):
        p.add_argument("--address", default="auto", help="the Ray cluster (default: the local one)")
    for p in (scale, status):
        p.add_argument("--name", default="pdserve", help="the deployment's spec name (default: pdserve)")
    sim = sub.add_parser("simulate", help="replay a trace against a spec of simulated replicas in virtual time")
    from cluster.sim import commands  # noqa: PLC0415

    commands.add_simulate_args(sim)
    commands.add_plan_args(sub.add_parser("plan", help="the cheapest spec that serves a trace within an SLO (replays "
                                                       "candidate specs in virtual time)"))
    commands.add_profile_args(sub.add_parser("profile", help="calibrate a simulation profile of the real engine "
                                                              "on this machine"))
    args = parser.parse_args(argv)
    if args.command == "serve":
        return run_serve(args)
    if args.command in ("simulate", "plan", "profile"):
        return {"simulate": commands.run_simulate, "plan": commands.run_plan, "profile": commands.run_profile}[
            args.command](args)
    if args.command in ("scale", "status", "apply"):
        return control(args)

    from engine.llm import LLM  # noqa: PLC0415 (slow import after argument errors)
    from records.sampling_params import SamplingParams  # noqa: PLC0415

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
        llm = LLM(args.model, dtype=args.dtype)
        if args.chat:
            out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
        else:
            out = llm.generate(args.prompt, params, use_tqdm=False)
    except ValueError as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    print(out[0].outputs[0].text)
    return 0


def control(args: argparse.Namespace) -> int:
    """`pdserve scale`, `status` and `apply`: ask the deployment's manager actor (each model's, in a
    spec of several models)."""
    import ray  # noqa: PLC0415

    from engine.executor.ray_cluster import connect_ray  # noqa: PLC0415

    config = None
    if args.command == "apply":
        from cluster.config import ClusterConfig  # noqa: PLC0415

        try:
            config = ClusterConfig.from_yaml(args.spec)
        except (OSError, ValueError) as e:
            print(f"pdserve: error: {args.spec}: {e}", file=sys.stderr)
            return 2
        args.name = config.name
    try:
        connect_ray(args.address)
    except ConnectionError as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    managers = deployment_managers(args.name)
    if not managers and args.command != "apply":
        print(f"pdserve: error: no deployment named {args.name!r} on this Ray cluster (--name)", file=sys.stderr)
        return 2
    try:
        if args.command == "scale":
            out = _scale(managers, args)
        elif args.command == "apply":
            out = apply_spec(config, managers, args.timeout, args.route_prefix)
        else:
            out = _status(managers, args.name)
    except (ValueError, TimeoutError, ray.exceptions.RayTaskError, ray.exceptions.GetTimeoutError) as e:
        cause = getattr(e, "cause", None) or e
        print(f"pdserve: error: {cause}", file=sys.stderr)
        return 2
    if args.command == "status" and not args.json:
        print(format_status(out))
    else:
        print(json.dumps(out, indent=2))
    return 0


def deployment_managers(name: str) -> dict[str, Any]:
    """The managers of the deployment `name`: its own (a one-model spec: {"": handle}), or each of
    its models' (model -> handle), found by the namespace and the spec each manager serves."""
    import ray  # noqa: PLC0415

    from cluster.manager import MANAGER_NAME  # noqa: PLC0415

    try:
        return {"": ray.get_actor(MANAGER_NAME, namespace=name)}
    except ValueError:
        pass
    found = {}
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["name"] != MANAGER_NAME or not actor["namespace"].startswith(name + "-"):
            continue
        handle = ray.get_actor(MANAGER_NAME, namespace=actor["namespace"])
        described = ray.get(handle.describe.remote(), timeout=60)
        if described.get("app") == name:
            found[described["models"][0]] = handle
    return found


def _scale(managers: dict[str, Any], args: argparse.Namespace) -> dict:
    """`pdserve scale [MODEL/]POOL N`."""
    import ray  # noqa: PLC0415

    model, _, pool = args.pool.rpartition("/")
    if model not in managers:
        if "" in managers:
            raise ValueError(f"{args.name!r} serves one model: name the pool alone (prefill or decode); "
                             f"got {args.pool!r}")
        raise ValueError(f"{args.name!r} serves several models: name MODEL/POOL, MODEL one of {sorted(managers)}; "
                         f"got {args.pool!r}")
    return ray.get(managers[model].scale.remote(pool, args.replicas, args.drain_timeout), timeout=120)


def _status(managers: dict[str, Any], name: str) -> dict:
    """`pdserve status`: the deployment's (or each model's) state, and what its ingress saw."""
    import ray  # noqa: PLC0415

    described = dict(zip(managers, ray.get([m.describe.remote() for m in managers.values()], timeout=60)))
    if "" in described:
        return {**described[""], "ingress": _ingress_replicas(name), "ingress_observed": _ingress_observed(name)}
    observed = _ingress_observed(name) or {}
    return {"name": name, "ingress": _ingress_replicas(name),
            "models": {model: {**out, "ingress_observed": observed.get("models", {}).get(model)}
                       for model, out in described.items()}}


def apply_spec(config: Any, managers: dict[str, Any], timeout_s: float, route_prefix: str = "/") -> dict:
    """Hand each model's spec to its manager (created for a model the deployment did not serve: its
    pools load before any request can reach it), then redeploy the Serve app with the whole spec
    (Serve rolls the ingress replicas, which read the serving and routing sections and the models;
    streams on the old replicas finish), wait until every manager serves its spec, and only then
    shut down the managers of models the spec no longer has (their streams drain first)."""
    import ray  # noqa: PLC0415
    from ray import serve  # noqa: PLC0415

    from cluster.app import build_app  # noqa: PLC0415
    from cluster.launch import start_pools  # noqa: PLC0415
    from cluster.manager import fingerprint  # noqa: PLC0415

    deployments = config.deployments()
    keep = {d.name for d in deployments}
    out: dict[str, Any] = {}
    handles = []
    for d in deployments:
        # The pools first (what this prints), then the ingress replicas, whose own `apply` finds it done.
        manager, applied = start_pools(d, timeout_s)
        handles.append((d, manager))
        out[d.serving.served_model_names[0] if config.models is not None else "spec"] = applied
    serve.run(build_app(config), name=config.name, route_prefix=route_prefix, blocking=False)
    deadline = time.monotonic() + timeout_s
    for d, manager in handles:
        want = fingerprint(d)
        # (a model waiting for room has taken its spec: it starts once its pools fit)
        while (st := ray.get(manager.describe.remote(), timeout=60))["fingerprint"] != want or st["updating"] \
                or st["phase"] not in ("ready", "waiting"):
            if st["phase"] == "failed":
                raise TimeoutError(f"{d.name}: the pools failed: {st['reason']}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{d.name} did not take spec {want} within {timeout_s:g} s: {st['updating']}")
            time.sleep(1.0)
    _wait_app_running(config.name, deadline)
    for model, manager in managers.items():
        namespace = ray.get(manager.describe.remote(), timeout=60)["name"]
        if namespace not in keep:                   # a model the spec no longer serves
            try:
                ray.get(manager.shutdown.remote(drain_s=config.drain_timeout_s), timeout=config.drain_timeout_s + 30)
            finally:
                ray.kill(manager)
            out[model or namespace] = {"removed": True}
    if config.models is None:
        return out["spec"]
    return out


def _wait_app_running(name: str, deadline: float) -> None:
    """Until Serve runs the app's new ingress replicas (the old ones still finishing their streams)."""
    from ray import serve  # noqa: PLC0415

    while True:
        app = serve.status().applications.get(name)
        if app is not None and str(app.status) in ("RUNNING", "ApplicationStatus.RUNNING"):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the Serve app {name!r} is not running: {app.status if app else 'absent'}")
        time.sleep(0.5)


def _ingress_replicas(app_name: str) -> dict[str, int] | None:
    """Serve's count of the app's ingress replicas by state (None when Serve does not run it)."""
    from ray import serve  # noqa: PLC0415

    try:
        app = serve.status().applications.get(app_name)
    except Exception:  # noqa: BLE001 - Serve is not running here
        return None
    if app is None:
        return None
    return {str(state): n for d in app.deployments.values() for state, n in d.replica_states.items()}


def _ingress_observed(app_name: str) -> dict | None:
    """What one of the app's ingress replicas saw (routing decisions, peer pulls, its tracing);
    None when Serve does not run the app here or it does not answer."""
    from ray import serve  # noqa: PLC0415

    try:
        return serve.get_app_handle(app_name).observability.remote().result(timeout_s=30)
    except Exception:  # noqa: BLE001 - no Serve app of that name (a bare manager), or it is starting
        return None


def format_status(out: dict) -> str:
    """`pdserve status` as text: the deployment, or each of its models, with pools and replicas."""
    if "models" in out and isinstance(out["models"], dict):
        lines = [f"deployment {out['name']}: {len(out['models'])} models"]
        if out.get("ingress") is not None:
            lines.append("ingress: " + ", ".join(f"{n} {state.lower()}" for state, n in out["ingress"].items()))
        for model, st in out["models"].items():
            lines.append("")
            lines.extend(_format_deployment(st, f"model {model} ({st['mode']}, manager {st['name']})").splitlines())
        return "\n".join(lines)
    return _format_deployment(out, f"deployment {out['name']}")


def _format_deployment(out: dict, title: str) -> str:
    lines = [f"{title} (spec {out['fingerprint']}): {out['phase']}"
             + (f" ({out['reason']})" if out.get("reason") else "")
             + (f"; {out['updating']}" if out.get("updating") else "")]
    if out.get("ingress") is not None:
        lines.append("ingress: " + ", ".join(f"{n} {state.lower()}" for state, n in out["ingress"].items()))
    if out.get("weight_version") is not None:
        lines.append(f"weights: version {out['weight_version']}"
                     + (f"; paused ({out['paused']})" if out.get("paused") else ""))
    tracing = out.get("tracing") or {}
    lines.append(f"tracing: {tracing.get('otlp_traces_endpoint') or 'off'}; request log: "
                 f"{'on' if tracing.get('log_requests') else 'off'}")
    seen = out.get("ingress_observed")
    if seen:
        for pool, reasons in sorted(seen["routing_decisions"].items()):
            lines.append(f"routing ({pool}): " + ", ".join(f"{r} {n}" for r, n in sorted(reasons.items())))
        pulls = seen["peer_prefix_pulls"]
        if pulls:
            lines.append("peer prefix pulls: " + ", ".join(f"{o} {n}" for o, n in sorted(pulls.items())))
    for pool, st in out["pools"].items():
        lo, hi = st["bounds"]
        lines.append(f"{pool}: {len(st['replicas'])}/{st['target']} serving (bounds {lo}..{hi}; "
                     f"replaced {st['replaced']})")
        for r in st["detail"]:
            usage = f"KV {r['kv_usage']:.0%}" if r["kv_usage"] is not None else "KV -"
            lines.append(f"  {r['id']:<12} {r['state']:<9} {r['layout']:<9} node {(r['node'] or '-')[:12]:<12} "
                         f"{usage:<8} running {_dash(r['running'])} waiting {_dash(r['waiting'])}")
            latency = r.get("latency") or {}
            if latency.get("ttft_s", {}).get("count"):
                lines.append("    " + "; ".join(
                    f"{name[:-2].upper()} p50/p90/p99 " + "/".join(_ms(v[p]) for p in ("p50", "p90", "p99"))
                    for name, v in latency.items() if v["count"]))
            for medium, (held, slots) in (r.get("kv_tier") or {}).items():
                lines.append(f"    KV tier {medium}: {held}/{slots} blocks")
        last = (st.get("planner") or {}).get("last")
        if last is not None:
            lines.append(f"  planner: {last['action']} ({last['reason']}); "
                         f"changes {st['planner']['decisions']}")
    return "\n".join(lines)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}ms"


def _dash(value: Any) -> str:
    return "-" if value is None else str(value)


if __name__ == "__main__":
    sys.exit(main())
