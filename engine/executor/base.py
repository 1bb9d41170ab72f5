"""What every executor shares (engine/executor/executor.py, simulated.py): the KV connector's worker
sides of the engine's ranks, reached through the step messages."""
from __future__ import annotations

from typing import Any

from kv_transfer.worker_group import KVWorkerGroup
from records.step import ModelRunnerOutput, SchedulerOutput
from records.transfer import TransferReport


class Executor:
    """An engine's executor: how its steps run (`execute_model`, or `submit` and `collect` with
    several batches in flight), and the KV connector's worker sides of its ranks (`kv`, None without
    a connector), reached through the step messages. It sizes the KV cache (`num_blocks`,
    `num_cpu_blocks`, `tier_slots`) before the engine builds its block pool."""

    num_blocks: int = 0
    num_cpu_blocks: int = 0

    kv: KVWorkerGroup | None = None
    kv_scales: tuple[tuple[float, float], ...] = ()    # the fp8 cache's scales the ranks use (Worker.kv_scales)
    tier_slots: tuple[int, int] = (0, 0)     # the offload tier's (host, disk) slots (Worker.tier_slots)
    _kv_fresh = False                 # a step's reports arrived since the last kv_poll

    def _exchange(self, sched: SchedulerOutput | None, kv_ops: list[tuple[Any, ...]]
                  ) -> tuple[ModelRunnerOutput | None, list[TransferReport | None]]:
        """One step message to every rank: the driver's output and each rank's transfer report."""
        raise NotImplementedError

    def _step(self, sched: SchedulerOutput | None) -> ModelRunnerOutput | None:
        output, reports = self._exchange(sched, self.kv.take_ops() if self.kv is not None else [])
        if self.kv is not None:
            self.kv.collect(reports)
            self._kv_fresh = True
        return output

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        output = self._step(sched)
        assert output is not None
        return output

    def kv_poll(self) -> TransferReport:
        """Transfers finished since the last call: from the last step's replies, or from a step
        message without a model step when none ran since."""
        assert self.kv is not None
        if not self._kv_fresh:
            self._step(None)
        self._kv_fresh = False
        return self.kv.take_report()

    def kv_blocks(self, block_ids: list[int]) -> list[Any]:
        """Every rank's heads of these blocks (Worker.kv_blocks), in rank order (for checks)."""
        raise NotImplementedError

    def kv_pull_log(self) -> list[Any]:
        """Every rank's finished pulls since the last call (PullRecord), in rank order."""
        raise NotImplementedError

    def kv_flush(self) -> None:
        """Send the queued KV orders now (new leases must be live before their parameters leave)."""
        if self.kv is not None and self.kv.ops:
            self._step(None)

    def submit(self, sched: SchedulerOutput) -> None:
        """Send a step without waiting for it (pipeline stages keep several in flight); `collect`
        returns the outputs in the order sent. Only executors of pipelined engines have it."""
        raise NotImplementedError

    def collect(self) -> ModelRunnerOutput:
        raise NotImplementedError

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Call Worker.`method` on every rank at once (between steps); results in rank order."""
        raise NotImplementedError(f"{type(self).__name__} runs no workers to call {method} on")

    def tier_stats(self) -> dict[str, float]:
        raise NotImplementedError

    def expert_load(self) -> list[dict[int, int]]:
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError
