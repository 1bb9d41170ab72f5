"""Executors drive the ranks of one engine. `InProcessExecutor` runs the single rank in this process;
the Ray executor (one worker actor per TP x PP rank) comes with the parallelism issue."""
from __future__ import annotations

from engine.config import EngineConfig
from engine.outputs import ModelRunnerOutput, SchedulerOutput
from engine.worker import Worker


class EngineDeadError(RuntimeError):
    """The engine can no longer run steps (a worker died); every in-flight request fails with it."""


class InProcessExecutor:
    def __init__(self, config: EngineConfig) -> None:
        if config.parallel_config.world_size != 1:
            raise ValueError("tensor_parallel_size and pipeline_parallel_size > 1 need the Ray executor, "
                             "which is not built yet; use 1")
        self.worker = Worker(config)
        self.worker.load_model()
        self.num_blocks, self.num_cpu_blocks = self.worker.determine_num_blocks()
        self.worker.init_cache(self.num_blocks, self.num_cpu_blocks)
        # The worker side of the KV connector (None without one); the engine drives it directly.
        self.kv_connector_worker = self.worker.kv_connector

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(sched)

    def shutdown(self) -> None:
        self.worker.shutdown()
