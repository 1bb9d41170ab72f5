"""Placement of one engine's rank actors (DESIGN: Ray topology).

One placement-group bundle per pipeline stage holds that stage's TP ranks, so they always share a
node (a bundle never spans nodes: STRICT_PACK per stage). The stages are spread over distinct nodes
(STRICT_SPREAD) when the cluster has at least as many nodes able to hold a stage; otherwise they are
packed where they fit (PACK, e.g. everything on one node).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group

if TYPE_CHECKING:
    from cluster.config import ClusterConfig, PoolSpec

REPLICA_ACTOR_CPUS = 0.1      # a multi-rank replica's own actor only schedules


class PlacementError(ValueError):
    """The Ray cluster cannot hold what the cluster spec asks for (names the pool and resource)."""


def stage_bundle(tp_size: int, num_cpus: float, num_gpus: float,
                 resources: dict[str, float] | None = None) -> dict[str, float]:
    bundle = {"CPU": tp_size * num_cpus}
    if num_gpus:
        bundle["GPU"] = tp_size * num_gpus
    for name, amount in (resources or {}).items():
        bundle[name] = tp_size * amount
    return bundle


def replica_bundles(spec: PoolSpec) -> list[dict[str, float]]:
    """What one replica of a pool takes: its actor alone (one rank), or its scheduling actor plus one
    bundle per pipeline stage."""
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
    for name, spec in config.pools.items():
        for bundle in replica_bundles(spec):
            if not any(all(node.get(k, 0.0) >= v for k, v in bundle.items()) for node in nodes):
                problems.append(f"pools.{name}: no node can hold {fmt_resources(bundle)} (one replica's "
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
    pools = sum(b.get("CPU", 0.0) * spec.replicas for spec in config.pools.values() for b in replica_bundles(spec))
    return pools + required_ingress_cpus(config)


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


def create_engine_placement(tp_size: int, pp_size: int, num_cpus: float = 1.0, num_gpus: float = 0.0,
                            resources: dict[str, float] | None = None, timeout_s: float = 120.0) -> Any:
    """A ready placement group with bundle s = stage s. Raises RuntimeError (naming the resources)
    if it cannot be placed within `timeout_s`."""
    bundle = stage_bundle(tp_size, num_cpus, num_gpus, resources)
    fitting = [n for n in ray.nodes() if n["Alive"]
               and all(n["Resources"].get(k, 0) >= v for k, v in bundle.items())]
    strategy = "STRICT_SPREAD" if pp_size > 1 and len(fitting) >= pp_size else "PACK"
    group = placement_group([dict(bundle) for _ in range(pp_size)], strategy=strategy)
    if not group.wait(timeout_s):
        remove_placement_group(group)
        raise RuntimeError(f"could not place {pp_size} stage(s) of {bundle} ({strategy}) within "
                           f"{timeout_s:.0f} s; cluster resources: {ray.cluster_resources()}")
    return group
