"""Placement of the pools on the Ray cluster: what each replica takes (`replica_bundles`), and
whether the cluster can hold every pool (`check_placement`, failing with a message naming what is
missing). One engine's own stages are placed by engine/executor/ray_cluster.py (`create_engine_placement`).
"""
from __future__ import annotations

import time
from collections.abc import Iterator
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
        at = f"models[{deployment.serving.served_model_names[0]}]." if config.models is not None else ""
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


def fmt_resources(resources: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(resources.items())) + "}"
