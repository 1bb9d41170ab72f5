"""Start serving: connect to (or start) Ray, create the manager and its pools, run the Serve app.

Entry point of `pdserve serve` and of `ray job submit -- python -m cluster.launch --config spec.yaml`.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

import yaml

from cluster.config import ClusterConfig


def init_ray(address: str | None = None, num_cpus: int | None = None) -> bool:
    """Join the Ray cluster at `address` (or RAY_ADDRESS), else start a local one on 127.0.0.1.
    True when this call started a local Ray (one that no node will join)."""
    import ray  # noqa: PLC0415

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, namespace="pdserve")
        return False
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, namespace="pdserve",
             _node_ip_address="127.0.0.1")
    return True


def serve_cluster(config: ClusterConfig, blocking: bool = True, placement_timeout_s: float | None = None
                  ) -> None:
    """Deploy the ingress (which creates the manager and the engine pools) and wait for it.

    First checks that the cluster can hold the pools (waiting up to `placement_timeout_s`, by default
    the spec's), raising PlacementError instead of leaving the app pending forever."""
    import faulthandler  # noqa: PLC0415

    from ray import serve  # noqa: PLC0415

    from cluster.placement import check_placement  # noqa: PLC0415

    check_placement(config, placement_timeout_s)
    faulthandler.register(signal.SIGUSR1)      # `kill -USR1 <pid>` prints every thread's stack
    stop = threading.Event()
    if blocking:
        _catch_stop_signals(stop)        # a signal during startup must not be lost

    from router.app import build_app  # noqa: PLC0415

    serve.start(http_options={"host": config.serving.host, "port": config.serving.port},
                **grpc_start_options(config))
    serve.run(build_app(config), name=config.name, route_prefix="/", blocking=False)
    grpc_note = f", gRPC on port {config.serving.grpc_port}" if config.serving.grpc_port else ""
    print(f"pdserve: serving on http://{config.serving.host}:{config.serving.port}/v1{grpc_note} "
          f"({config.mode}, pools {', '.join(f'{k}={v.replicas}' for k, v in config.pools.items())})",
          flush=True)
    if blocking:
        _catch_stop_signals(stop)        # again, in case starting Serve replaced the handlers
        while not stop.wait(1.0):
            pass
        print("pdserve: shutting down", flush=True)
        shutdown(config)


def grpc_start_options(config: ClusterConfig) -> dict:
    """serve.start() keywords enabling the gRPC Generation service when `serving.grpc_port` is set."""
    if config.serving.grpc_port is None:
        return {}
    from ray.serve.config import gRPCOptions  # noqa: PLC0415

    return {"grpc_options": gRPCOptions(port=config.serving.grpc_port,
                                        grpc_servicer_functions=["pdserve_proto.add_GenerationServicer_to_server"])}


def _catch_stop_signals(stop: threading.Event) -> None:
    # Ray replaces Python's SIGINT handler in the driver, so Ctrl-C is caught here explicitly.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())


def shutdown(config: ClusterConfig) -> None:
    """Tear down the Serve app and the engine pools."""
    import ray  # noqa: PLC0415
    from ray import serve  # noqa: PLC0415

    from cluster.manager import MANAGER_NAME  # noqa: PLC0415

    serve.delete(config.name)
    try:
        manager = ray.get_actor(MANAGER_NAME, namespace=config.name)
        ray.get(manager.shutdown.remote(drain_s=10.0))
        ray.kill(manager)
    except ValueError:
        pass


def config_from_args(args: argparse.Namespace) -> ClusterConfig:
    """The spec file (or DEFAULT_SPEC) with the command line's overrides; ValueError names the field."""
    data = ClusterConfig.from_yaml(args.config).model_dump() if args.config else dict(DEFAULT_SPEC)
    if args.model is not None:
        data["model"] = args.model
    serving = dict(data.get("serving", {}))
    if args.host is not None:
        serving["host"] = args.host
    if args.port is not None:
        serving["port"] = args.port
    data["serving"] = serving
    pools = dict(data.get("pools", {}))
    if args.replicas is not None:
        pools["decode"] = {**dict(pools.get("decode", {})), "replicas": args.replicas}
    if args.prefill_replicas == 0:
        pools.pop("prefill", None)
        data["mode"] = "colocated"
    elif args.prefill_replicas is not None:
        pools["prefill"] = {**dict(pools.get("prefill", {})), "replicas": args.prefill_replicas}
        data["mode"] = "disaggregated"
    if pools:
        data["pools"] = pools
    if args.connector is not None:
        data["disaggregation"] = {**dict(data.get("disaggregation", {})), "connector": args.connector}
    return ClusterConfig.model_validate(data)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdserve serve", description="serve a model behind the OpenAI API")
    add_serve_args(ap)
    args = ap.parse_args(argv)
    return run_serve(args)


def add_serve_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--config", default=None, help="cluster spec YAML (see cluster/config.py)")
    ap.add_argument("--model", default=None, help="overrides the spec's model")
    ap.add_argument("--host", default=None)
    ap.add_argument("--port", type=int, default=None)
    ap.add_argument("--replicas", type=int, default=None, help="replicas of the decode pool")
    ap.add_argument("--prefill-replicas", type=int, default=None,
                    help="replicas of the prefill pool (> 0 serves disaggregated: prefill and decode "
                         "pools with KV transfer; 0 serves colocated)")
    ap.add_argument("--connector", choices=["nixl", "torch_dist"], default=None,
                    help="KV connector between the pools (disaggregated mode)")
    ap.add_argument("--address", default=None, help="Ray address (default: RAY_ADDRESS or a local Ray)")
    ap.add_argument("--num-cpus", type=int, default=None, help="logical CPUs of a local Ray")


# What `pdserve serve` runs without --config: the embedded model, 1 prefill + 1 decode replica, KV
# moved over NIXL.
DEFAULT_SPEC: dict = {"mode": "disaggregated", "pools": {"prefill": {"replicas": 1}, "decode": {"replicas": 1}}}


def run_serve(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except (OSError, ValueError, yaml.YAMLError) as e:    # pydantic's ValidationError is a ValueError
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    from cluster.placement import PlacementError  # noqa: PLC0415

    local = init_ray(args.address, args.num_cpus)
    try:
        serve_cluster(config, placement_timeout_s=0.0 if local else None)   # a local Ray never grows
    except PlacementError as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
