"""EnginePool: the engine replica actors of one pool (prefill or decode), created and health-checked.

Ray is applied here: each replica is `ray.remote(EngineReplica)` with the pool's CPUs/GPUs, and torch
in it gets as many threads as CPUs it was given. With TP x PP > 1 the replica actor only schedules
(a tenth of a CPU); its engine starts one worker actor per rank with the pool's CPUs/GPUs each, in
a placement group (cluster/placement.py) that lives and dies with the replica.
"""
from __future__ import annotations

import asyncio
from typing import Any

import ray

from cluster.config import ClusterConfig, PoolSpec
from cluster.replica import EngineReplica
from engine.config import EngineConfig


class EnginePool:
    def __init__(self, name: str, spec: PoolSpec, engine_config: EngineConfig, namespace: str) -> None:
        self.name = name
        self.spec = spec
        self.engine_config = engine_config
        self.namespace = namespace
        self.replicas: dict[str, Any] = {}

    def start(self) -> None:
        actor_cls = ray.remote(EngineReplica)
        single = self.spec.world_size == 1
        threads = max(1, int(self.spec.num_cpus)) if single else 1
        for i in range(self.spec.replicas):
            replica_id = f"{self.name}-{i}"
            self.replicas[replica_id] = actor_cls.options(
                name=f"{self.namespace}-{replica_id}", num_cpus=self.spec.num_cpus if single else 0.1,
                num_gpus=self.spec.num_gpus if single else 0, max_concurrency=1000,
            ).remote(self.engine_config, replica_id, threads)

    async def wait_ready(self) -> list[dict]:
        """Block until every replica has loaded its model; returns their info."""
        return await asyncio.gather(*[h.info.remote() for h in self.replicas.values()])

    def shutdown(self) -> None:
        for handle in self.replicas.values():
            ray.kill(handle)
        self.replicas.clear()


def engine_config_for(config: ClusterConfig, pool: str = "decode") -> EngineConfig:
    """The engine config of one pool's replicas: the cluster's engine settings, the pool's
    parallelism, and in disaggregated mode the KV connector (every engine can play either role of
    a transfer)."""
    spec = config.pools[pool]
    kv_args = config.disaggregation.engine_args() if config.mode == "disaggregated" else {}
    parallel = {}
    if spec.world_size > 1:
        parallel = {"tensor_parallel_size": spec.tensor_parallel_size,
                    "pipeline_parallel_size": spec.pipeline_parallel_size,
                    "worker_num_cpus": spec.num_cpus, "worker_num_gpus": spec.num_gpus}
    return EngineConfig.create(config.model, **config.engine, **kv_args, **parallel)
