"""Placement of one engine's rank actors (DESIGN: Ray topology).

One placement-group bundle per pipeline stage holds that stage's TP ranks, so they always share a
node (a bundle never spans nodes: STRICT_PACK per stage). The stages are spread over distinct nodes
(STRICT_SPREAD) when the cluster has at least as many nodes able to hold a stage; otherwise they are
packed where they fit (PACK, e.g. everything on one node).
"""
from __future__ import annotations

from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group


def stage_bundle(tp_size: int, num_cpus: float, num_gpus: float) -> dict[str, float]:
    bundle = {"CPU": tp_size * num_cpus}
    if num_gpus:
        bundle["GPU"] = tp_size * num_gpus
    return bundle


def create_engine_placement(tp_size: int, pp_size: int, num_cpus: float = 1.0, num_gpus: float = 0.0,
                            timeout_s: float = 120.0) -> Any:
    """A ready placement group with bundle s = stage s. Raises RuntimeError (naming the resources)
    if it cannot be placed within `timeout_s`."""
    bundle = stage_bundle(tp_size, num_cpus, num_gpus)
    fitting = [n for n in ray.nodes() if n["Alive"]
               and all(n["Resources"].get(k, 0) >= v for k, v in bundle.items())]
    strategy = "STRICT_SPREAD" if pp_size > 1 and len(fitting) >= pp_size else "PACK"
    group = placement_group([dict(bundle) for _ in range(pp_size)], strategy=strategy)
    if not group.wait(timeout_s):
        remove_placement_group(group)
        raise RuntimeError(f"could not place {pp_size} stage(s) of {bundle} ({strategy}) within "
                           f"{timeout_s:.0f} s; cluster resources: {ray.cluster_resources()}")
    return group
