"""ClusterManager: the named actor that owns the pools, so every ingress replica and the launcher
find the same engines (`get_or_create_manager`).
"""
from __future__ import annotations

from typing import Any

import ray

from cluster.config import ClusterConfig
from cluster.pool import EnginePool, engine_config_for

MANAGER_NAME = "pdserve-manager"


class ClusterManager:
    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.pools = {name: EnginePool(name, spec, engine_config_for(config, name), config.name)
                      for name, spec in config.pools.items()}
        for pool in self.pools.values():
            pool.start()

    async def ready(self) -> dict[str, list[dict]]:
        return {name: await pool.wait_ready() for name, pool in self.pools.items()}

    def replicas(self, pool: str) -> dict[str, Any]:
        """Replica id -> actor handle of one pool."""
        if pool not in self.pools:
            raise ValueError(f"pool must be one of {sorted(self.pools)}; got {pool!r}")
        return dict(self.pools[pool].replicas)

    def shutdown(self) -> None:
        for pool in self.pools.values():
            pool.shutdown()


def get_or_create_manager(config: ClusterConfig) -> Any:
    """The cluster's manager actor, created on first call (namespace = config.name)."""
    return ray.remote(ClusterManager).options(
        name=MANAGER_NAME, namespace=config.name, get_if_exists=True, lifetime="detached",
        num_cpus=0).remote(config)
