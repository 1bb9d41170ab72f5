"""Placement of the pools on the Ray cluster: what each replica takes (`replica_bundles`), and
whether the cluster can hold every pool (`check_placement`, failing with a message naming what is
missing). One engine's own stages are placed by engine/executor/ray_cluster.py (`create_engine_placement`).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import ray

from engine.executor.ray_cluster import stage_bundle
from records.errors import PlacementError

if TYPE_CHECKING:
    from cluster.config import ClusterConfig, PoolSpec

REPLICA_ACTOR_CPUS = 0.1      # a multi-rank replica's own actor only schedules
# A simulated replica's share of its host actor (cluster/replica_host.py): it runs no model.
SIMULATED_REPLICA_CPUS = 0.05


def replica_bundles(spec: PoolSpec, simulated: bool = False) -> list[dict[str, float]]:
    """What one replica of a pool takes: its actor alone (one rank), or its scheduling actor plus one
    bundle per pipeline stage; a simulated replica (engine.simulate), its share of a host."""
    if simulated:
        return [{"CPU": SIMULATED_REPLICA_CPUS, **spec.resources}]
    if spec.world_size == 1:
        return [stage_bundle(1, spec.num_cpus, spec.num_gpus, spec.resources)]
    stage = stage_bundle(spec.tensor_parallel_size, spec.num_cpus, spec.num_gpus, spec.resources)
    return [{"CPU": REPLICA_ACTOR_CPUS}] + [dict(stage) for _ in range(spec.pipeline_parallel_size)]


def placement_problems(config: ClusterConfig, nodes: list[dict[str, float]]) -> list[str]:
    """Why the pools can never fit on nodes with these total resources (empty when they might).

    Two necessary conditions, so that nothing that could be placed is refused: every bundle fits on
    some node, and the sum of each resource is within the cluster's total. The sum counts the
    ingress replicas' CPUs too: they come first, and pools that fit only without them would leave a
    replica pending forever."""
    problems = []
    needed: dict[str, float] = {"CPU": required_ingress_cpus(config)}
    ingress = {"CPU": config.serving.ingress_num_cpus, **config.serving.ingress_resources}
    if not any(all(node.get(k, 0.0) >= v for k, v in ingress.items()) for node in nodes):
        problems.append(f"serving: no node can hold an ingress replica's {fmt_resources(ingress)} "
                        f"(ingress_num_cpus, ingress_resources)")
    for where, spec, simulated in _every_pool(config):
        for bundle in replica_bundles(spec, simulated):
            if not any(all(node.get(k, 0.0) >= v for k, v in bundle.items()) for node in nodes):
                problems.append(f"{where}: no node can hold {fmt_resources(bundle)} (one replica's "
                                f"{'rank' if spec.world_size == 1 else 'bundle'})")
            for k, v in bundle.items():
                needed[k] = needed.get(k, 0.0) + v * spec.replicas
    for k, v in sorted(needed.items()):
        have = sum(node.get(k, 0.0) for node in nodes)
        if v > have + 1e-9:
            problems.append(f"the pools{' and the ingress' if k == 'CPU' else ''} need {v:g} {k} in all; "
                            f"the cluster has {have:g}")
    return sorted(set(problems), key=problems.index)


def required_ingress_cpus(config: ClusterConfig) -> float:
    return config.serving.ingress_replicas * config.serving.ingress_num_cpus


def required_cpus(config: ClusterConfig) -> float:
    """Logical CPUs the whole app takes: every pool's replicas and the ingress replicas (what a
    local Ray started for it must have at least)."""
    pools = sum(b.get("CPU", 0.0) * spec.replicas for _, spec, simulated in _every_pool(config)
                for b in replica_bundles(spec, simulated))
    return pools + required_ingress_cpus(config)


def _every_pool(config: ClusterConfig) -> Iterator[tuple[str, PoolSpec, bool]]:
    """(where the spec sets it, the pool, whether its replicas are simulated) for every model's pools."""
    for deployment in config.deployments():
        several = config.models is not None or config.app is not None     # (or one model's of several)
        at = f"models[{deployment.serving.served_model_names[0]}]." if several else ""
        for name, spec in deployment.pools.items():
            yield f"{at}pools.{name}", spec, deployment.engine.simulate is not None


def check_placement(config: ClusterConfig, timeout_s: float | None = None) -> None:
    """Wait up to `timeout_s` (default: the spec's placement_timeout_s) for the cluster's alive nodes
    to be able to hold every pool; raise PlacementError naming what is missing instead of leaving
    actors pending forever."""
    timeout_s = config.placement_timeout_s if timeout_s is None else timeout_s
    deadline = time.monotonic() + timeout_s
    while True:
        nodes = [dict(n["Resources"]) for n in ray.nodes() if n["Alive"]]
        problems = placement_problems(config, nodes)
        if not problems:
            return
        if time.monotonic() >= deadline:
            have = ", ".join(fmt_resources({k: v for k, v in n.items() if not k.startswith(("node:", "memory",
                              "object_store_memory"))}) for n in nodes)
            raise PlacementError(f"the Ray cluster cannot hold the pools (waited {timeout_s:g} s): "
                                 f"{'; '.join(problems)}. Nodes: {have or 'none'}")
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))


def room_problems(config: ClusterConfig, free: list[dict[str, float]]) -> list[str]:
    """Why this spec's pools do not fit what the nodes have free now (empty when they do): every
    replica's bundles placed first-fit, largest first, onto a copy of each node's free resources.
    With several models, a model starts only once all its pools fit (`wait_for_room`), so the
    models placed first (the spec's order at deploy) keep what they hold."""
    nodes = [dict(n) for n in free]
    bundles = sorted(((where, b) for where, spec, simulated in _every_pool(config) for _ in range(spec.replicas)
                      for b in replica_bundles(spec, simulated)), key=lambda wb: -sum(wb[1].values()))
    short: dict[str, list[dict[str, float]]] = {}
    for where, bundle in bundles:
        node = next((n for n in nodes if all(n.get(k, 0.0) >= v - 1e-9 for k, v in bundle.items())), None)
        if node is None:
            short.setdefault(where, []).append(bundle)
            continue
        for k, v in bundle.items():
            node[k] -= v
    return [f"{where}: {len(b)} of its bundles ({fmt_resources(b[0])} each) do not fit what the nodes have free"
            for where, b in short.items()]


def free_nodes() -> list[dict[str, float]]:
    """What each alive node has free now (Ray's per-node view; the cluster's sum where that is
    unavailable)."""
    try:
        from ray._private.state import available_resources_per_node  # noqa: PLC0415 - no public per-node view

        return [dict(r) for r in available_resources_per_node().values()]
    except (ImportError, AttributeError):
        return [dict(ray.available_resources())]


async def wait_for_room(config: ClusterConfig, waiting: Callable[[str], None], poll_s: float = 1.0) -> None:
    """Return once the nodes' free resources hold every pool of `config`; meanwhile `waiting(why)`
    after each look that found them short (a node joining, or another model shrinking, ends it)."""
    while problems := await asyncio.to_thread(lambda: room_problems(config, free_nodes())):
        waiting("waiting for room: " + "; ".join(problems))
        await asyncio.sleep(poll_s)


def fmt_resources(resources: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(resources.items())) + "}"
