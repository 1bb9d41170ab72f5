"""Executors drive an engine's ranks: in-process (one rank) or Ray worker actors (TP x PP), and
the Ray helpers that place them (`ray_cluster`)."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.executor.base import Executor
    from records.config import EngineConfig


def make_executor(config: EngineConfig) -> Executor:
    """The simulated executor for a simulated engine (EngineConfig.simulation); else the Ray
    executor for more than one rank or when asked for ("ray"), else in-process. Each imported
    only where chosen: a simulated engine's process never imports torch or the model code."""
    if config.simulation is not None:
        from engine.executor.simulated import SimulatedExecutor  # noqa: PLC0415

        return SimulatedExecutor(config)
    from engine.executor.executor import InProcessExecutor, RayExecutor  # noqa: PLC0415

    pc = config.parallel_config
    if pc.world_size == 1 and pc.distributed_executor_backend != "ray":
        return InProcessExecutor(config)
    return RayExecutor(config)
