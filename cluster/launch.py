"""Start serving: connect to (or start) Ray, create the manager and its pools, run the Serve app.

Entry point of `pdserve serve` and of `ray job submit -- python -m cluster.launch --config spec.yaml`;
their command line and how it overrides a spec: cluster/serve_args.py.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import sys
import time
from typing import Any

import yaml

from cluster.config import ClusterConfig
from cluster.serve_args import add_serve_args, config_from_args
from engine.executor.ray_cluster import init_ray
from records.errors import PlacementError, StartupError


class Stopped(BaseException):
    """SIGINT or SIGTERM: stop serving (raised in the main thread wherever it is, startup included)."""


class RayStopped(Exception):
    """The Ray this launcher started lost its GCS or raylet: nothing deployed on it can answer."""


def check_local_ray() -> None:
    """RayStopped when the GCS or the raylet of the Ray this process started has exited (`ray stop`,
    the OOM killer). A look at this process's own children, no call to Ray: a call to a dead GCS
    blocks while Ray's driver retries it for a minute (spinning a core) before ending the process
    with a line of its own. A Ray started elsewhere (an address, `ray job submit`) is not checked."""
    import ray  # noqa: PLC0415
    from ray._private import ray_constants  # noqa: PLC0415

    node = getattr(ray._private.worker, "_global_node", None)
    for kind, process in node.dead_processes() if node is not None else ():
        if kind in (ray_constants.PROCESS_TYPE_GCS_SERVER, ray_constants.PROCESS_TYPE_RAYLET):
            raise RayStopped(f"the local Ray's {kind} exited (code {process.returncode})")


def whole_lines() -> None:
    """Each line this process writes to stdout or stderr goes out in one write. Ray's driver prints
    its workers' log lines from a thread of its own, and with unbuffered streams
    (PYTHONUNBUFFERED=1, as container images often set) print() writes a line's text and its
    newline apart: in a shared pipe a launcher line then lands inside one of Ray's, and a script
    waiting for a line that starts with `pdserve: serving on` waits forever. Line buffering keeps
    each line whole and still writes it as soon as it ends."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError):     # a caller's own stream, or closed
            stream.reconfigure(line_buffering=True, write_through=False)


def catch_stop_signals() -> None:
    """Turn SIGINT and SIGTERM into `Stopped` in the main thread. Call again after Ray and Serve
    start: they install handlers of their own in the driver."""
    def stop(signum: int, _frame: object) -> None:
        raise Stopped(signal.Signals(signum).name)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)


def serve_cluster(config: ClusterConfig, blocking: bool = True, poll_s: float = 0.5) -> None:
    """Deploy the ingress and the manager, wait until the pools serve, then (`blocking`) serve until
    a signal raises Stopped (the caller tears down with `shutdown`).

    Fails fast with PlacementError when the cluster cannot hold the pools (after waiting up to the
    spec's placement_timeout_s for it to grow), and with StartupError when a replica is not placed
    in time or its model fails to load; never waits forever."""
    import faulthandler  # noqa: PLC0415

    import ray  # noqa: PLC0415
    from ray import serve  # noqa: PLC0415

    from cluster.app import build_app  # noqa: PLC0415
    from cluster.placement import check_placement  # noqa: PLC0415

    # (run_serve resolved every pool's engine config before Ray started.) Each model alone must fit
    # the cluster; several may together need more than it has: one short of room waits for it, in
    # the spec's order (below), so that models that are scaled to zero or scaled down can share nodes.
    for deployment in config.deployments():
        check_placement(deployment)
    warning = config.serving.check_ray_env(os.environ)   # Serve reads these from Ray's processes
    if warning:
        print(f"pdserve: warning: {warning}", file=sys.stderr, flush=True)
    faulthandler.register(signal.SIGUSR1)      # `kill -USR1 <pid>` prints every thread's stack
    deployments = config.deployments()
    managers = start_models(config, poll_s)
    print(f"pdserve: loading the pools ({_describe(config)})", flush=True)
    # With direct ingress the ingress replica takes the port; Serve's proxy, which still starts,
    # gets any free one.
    proxy_port = 0 if config.serving.direct_ingress else config.serving.port
    serve.start(http_options={"host": config.serving.host, "port": proxy_port},
                **grpc_start_options(config))
    catch_stop_signals()
    serve.run(build_app(config), name=config.name, route_prefix="/", blocking=False)
    catch_stop_signals()            # again, in case starting Serve replaced the handlers
    url = f"http://{config.serving.host}:{config.serving.port}"
    print(f"pdserve: starting on {url}/v1 (/health answers 503 until the pools serve)", flush=True)
    waiting: set[str] = set()
    while True:
        check_local_ray()
        statuses = ray.get([m.status.remote() for m in managers], timeout=60)
        for deployment, status in zip(deployments, statuses):
            at = f"model {deployment.serving.served_model_names[0]}: " if config.models is not None else ""
            if status["phase"] == "failed":
                raise StartupError(at + status["reason"])
            if status["phase"] == "waiting" and deployment.name not in waiting:
                waiting.add(deployment.name)
                print(f"pdserve: {at}{status['reason']} (it starts once its pools fit; the others serve)",
                      flush=True)
        if all(status["phase"] in ("ready", "waiting") for status in statuses):
            break
        time.sleep(poll_s)
    grpc_note = f", gRPC on port {config.serving.grpc_port}" if config.serving.grpc_port else ""
    print(f"pdserve: serving on {url}/v1{grpc_note} ({_describe(config)})", flush=True)
    while blocking:
        check_local_ray()
        time.sleep(1.0)


def start_models(config: ClusterConfig, poll_s: float = 0.5) -> list[Any]:
    """Start each model's pools, in the spec's order (the managers, one per model): with several
    models, each once the one before it has its nodes (or waits for room), so that the spec's order
    decides who gets room when it is short."""
    managers = []
    for d in config.deployments():
        managers.append(start_pools(d)[0])
        if config.models is not None:
            _wait_placed(managers[-1], poll_s)
    return managers


def _wait_placed(manager: Any, poll_s: float) -> None:
    """Until a model's replicas have nodes (or it waits for room, or failed): the next model's
    room check then sees what this one holds."""
    import ray  # noqa: PLC0415

    while not (status := ray.get(manager.status.remote(), timeout=60))["placed"] and status["phase"] == "starting":
        time.sleep(poll_s)


def _describe(config: ClusterConfig) -> str:
    """The mode and pool sizes, per model when there are several."""
    def pools(d: ClusterConfig) -> str:
        return f"{d.mode}, pools {', '.join(f'{k}={v.replicas}' for k, v in d.pools.items())}"
    if config.models is None:
        return pools(config)
    return "; ".join(f"{d.serving.served_model_names[0]}: {pools(d)}" for d in config.deployments())


def start_pools(config: ClusterConfig, timeout_s: float = 600.0) -> tuple[Any, dict]:
    """The manager of `config` (one model's spec; created on first call) with the spec applied and
    its pools starting: their replicas load while Serve and the ingress come up (2.2 s sooner to
    /health for `pdserve serve` on two cores than when the ingress starts them:
    docs/perf/journal.md §23). Returns it and what applying the spec did."""
    import ray  # noqa: PLC0415

    from cluster.manager import get_or_create_manager  # noqa: PLC0415

    # Resolved here (the launcher has transformers loaded already, to check the spec), not in the
    # manager, whose start the replicas wait for.
    manager = get_or_create_manager(config, {name: config.engine_config(name) for name in config.pools})
    # A manager of this name may serve another spec (an earlier deployment): this one replaces it.
    applied = ray.get(manager.apply.remote(config.model_dump_json()), timeout=timeout_s)
    ray.get(manager.start.remote(), timeout=60)
    return manager, applied


GRPC_SERVICER = "pdserve_proto.serve_proxy.add_GenerationServicer_to_server"


def grpc_start_options(config: ClusterConfig) -> dict:
    """serve.start() keywords enabling the gRPC Generation service when `serving.grpc_port` is set."""
    # Not the generated function: this one also repairs cancellation in Serve's proxy (its docstring).
    if config.serving.grpc_port is None:
        return {}
    from pdserve_proto.serve_proxy import grpc_options_on  # noqa: PLC0415

    # Listening where HTTP does (serving.host), not on every interface as Serve's proxy would.
    return {"grpc_options": grpc_options_on(config.serving.host, port=config.serving.grpc_port,
                                            grpc_servicer_functions=[GRPC_SERVICER])}


def shutdown(config: ClusterConfig, drain_s: float = 10.0) -> None:
    """Tear down the Serve app and the engine pools (whatever of them exists)."""
    import ray  # noqa: PLC0415
    from ray import serve  # noqa: PLC0415

    from cluster.manager import MANAGER_NAME  # noqa: PLC0415

    try:
        serve.delete(config.name)
    except Exception as e:  # noqa: BLE001 - Serve never started, or is gone
        print(f"pdserve: deleting the Serve app: {e}", file=sys.stderr)
    for deployment in config.deployments():
        try:
            manager = ray.get_actor(MANAGER_NAME, namespace=deployment.name)
        except ValueError:
            continue
        try:
            ray.get(manager.shutdown.remote(drain_s=drain_s), timeout=drain_s + 30)
        finally:
            ray.kill(manager)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdserve serve", description="serve a model behind the OpenAI API")
    add_serve_args(ap)
    args = ap.parse_args(argv)
    return run_serve(args)


def run_serve(args: argparse.Namespace) -> int:
    whole_lines()
    try:
        config = config_from_args(args)
        for deployment in config.deployments():   # each model allows its engine section: checked
            for pool in deployment.pools:           # before Ray starts
                deployment.engine_config(pool)
    except (OSError, ValueError, yaml.YAMLError) as e:    # pydantic's ValidationError is a ValueError
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    from cluster.placement import required_cpus  # noqa: PLC0415

    catch_stop_signals()        # from here on, Ctrl-C or SIGTERM stop cleanly, whatever is starting
    local = deployed = False
    code = 0
    try:
        # A local Ray gets the logical CPUs the spec needs even on a smaller machine (logical CPUs
        # only share the cores out), and never grows: its placement check does not wait.
        num_cpus = args.num_cpus or max(os.cpu_count() or 1, math.ceil(required_cpus(config)))
        if not (args.address or os.environ.get("RAY_ADDRESS")):
            os.environ.update(config.serving.ray_env())  # inherited by the Ray it starts
            # Serve holds a direct ingress replica that stops for 30 s, requests or none, so that a
            # load balancer in front sees it go; a local Ray's clients reach it directly, and
            # Ctrl-C waits only for the streams still running (up to serving.ingress_drain_timeout_s).
            os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "0")
        local = init_ray(args.address, num_cpus)
        # The launcher watches the start itself, so the ingress answers (503) while the pools load.
        update: dict = {"serving": config.serving.model_copy(update={"wait_for_pools": False})}
        if local:
            update["placement_timeout_s"] = 0.0
        config = config.model_copy(update=update)
        catch_stop_signals()
        deployed = True
        serve_cluster(config)
    except Stopped as e:
        print(f"pdserve: shutting down ({e})", flush=True)
    except (PlacementError, StartupError) as e:
        print(f"pdserve: error: {e}", file=sys.stderr, flush=True)
        code = 2
    except RayStopped as e:
        print(f"pdserve: error: {e}: stopping", file=sys.stderr, flush=True)
        code, deployed = 1, False       # nothing to tear down through a dead GCS (that would block)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)     # tear down without a second interruption
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if deployed:
            shutdown(config)
        if local:
            import ray  # noqa: PLC0415

            ray.shutdown()
    return code


if __name__ == "__main__":
    sys.exit(main())
