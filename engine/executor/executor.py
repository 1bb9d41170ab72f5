"""Executors drive the ranks of one engine: `InProcessExecutor` runs the single rank in this
process; `RayExecutor` runs one worker actor per TP x PP rank; a simulated engine's
`SimulatedExecutor` (engine/executor/simulated.py) runs no model at all. `make_executor`
(engine/llm_engine.py) picks."""
from __future__ import annotations

import pickle
from typing import Any

import torch

from engine.executor.base import Executor
from engine.worker.step_channel import StepChannel
from engine.worker.step_codec import StepEncoder
from engine.worker.worker import Worker
from kv_transfer.worker_group import KVWorkerGroup
from records.config import EngineConfig
from records.errors import ChannelClosed, EngineDeadError
from records.step import ModelRunnerOutput, SchedulerOutput
from records.transfer import TransferReport


class InProcessExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        pc = config.parallel_config
        assert pc.world_size == 1, "more than one rank needs the RayExecutor"
        self.worker = Worker(config, "cuda" if pc.worker_num_gpus else "cpu")
        self.worker.load_model()
        self.kv_scales = self.worker.kv_scales()
        self.num_blocks, self.num_cpu_blocks = self.worker.determine_num_blocks()
        self.tier_slots = self.worker.tier_slots()
        self.worker.init_cache(self.num_blocks, self.num_cpu_blocks, *self.tier_slots)
        if self.worker.kv_connector is not None:
            engine_id, address = self.worker.kv_address()
            self.kv = KVWorkerGroup(engine_id, [address])

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        return [getattr(self.worker, method)(*args)]

    def kv_blocks(self, block_ids: list[int]) -> list[Any]:
        return [self.worker.kv_blocks(block_ids)]

    def kv_pull_log(self) -> list[Any]:
        return self.worker.kv_pull_log()

    def tier_stats(self) -> dict[str, float]:
        return self.worker.tier_stats()

    def expert_load(self) -> list[dict[int, int]]:
        """Each rank's MoE expert load (Worker.expert_load), in rank order."""
        return [self.worker.expert_load()]

    def _exchange(self, sched: SchedulerOutput | None, kv_ops: list[tuple[Any, ...]]
                  ) -> tuple[ModelRunnerOutput | None, list[TransferReport | None]]:
        output, report = self.worker.step(sched, kv_ops, isolate_failures=True)
        return output, [report]

    def shutdown(self) -> None:
        self.worker.shutdown()


class RayExecutor(Executor):
    """One `Worker` actor per rank in a placement group (cluster/placement.py: a stage's TP ranks on
    one node, stages spread over nodes). Setup goes through Ray calls; then every worker runs
    `serve_steps`, connected to this executor's StepChannel, and each step's SchedulerOutput goes
    out as a delta (engine/worker/step_codec.py: O(batch) bytes on a decode step), serialized once and the
    same bytes written to every worker's connection; the driver rank (TP 0 of the last stage)
    answers with the sampled tokens. A dead worker fails the step with
    EngineDeadError as soon as its connection closes or Ray reports it."""

    def __init__(self, config: EngineConfig) -> None:
        import ray  # noqa: PLC0415
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # noqa: PLC0415

        from engine.executor.ray_cluster import create_engine_placement, init_ray  # noqa: PLC0415 (imports Ray)

        if not ray.is_initialized():
            init_ray()
        pc = config.parallel_config
        tp, pp = pc.tensor_parallel_size, pc.pipeline_parallel_size
        self.placement_group = create_engine_placement(tp, pp, pc.worker_num_cpus, pc.worker_num_gpus,
                                                       dict(pc.worker_resources))
        device = "cuda" if pc.worker_num_gpus else "cpu"
        threads = max(1, int(pc.worker_num_cpus))
        # Everything but `placement` runs on the actor's one default thread: torch work split over
        # two threads slows every later step (OpenMP; see engine/async_engine.py). `placement`, in
        # its own group, answers while serve_steps holds the default thread.
        actor = ray.remote(concurrency_groups={"control": 1})(Worker)
        self.workers = [
            actor.options(num_cpus=pc.worker_num_cpus, num_gpus=pc.worker_num_gpus,
                          resources=dict(pc.worker_resources),
                          scheduling_strategy=PlacementGroupSchedulingStrategy(
                              self.placement_group, placement_group_bundle_index=rank // tp),
                          ).remote(config, device, rank, threads)
            for rank in range(tp * pp)]
        self.driver = (pp - 1) * tp
        self.kv_dtype = config.kv_dtype
        try:
            host, port = ray.get(self.workers[0].rendezvous_address.remote())
            self._run("init_distributed", f"tcp://{host}:{port}")
            self._run("load_model")
            self.kv_scales = self._run("kv_scales")[0]        # (TP ranks agree: kv_scales.py)
            sizes = self._run("determine_num_blocks")
            self.num_blocks = min(n for n, _ in sizes)
            self.num_cpu_blocks = min(c for _, c in sizes)
            slots = self._run("tier_slots")
            self.tier_slots = (min(h for h, _ in slots), min(d for _, d in slots))
            self._run("init_cache", self.num_blocks, self.num_cpu_blocks, *self.tier_slots)
            if config.kv_transfer_config is not None:       # every rank of every stage, stage-major
                ids, addresses = zip(*self._run("kv_address"))
                self.kv = KVWorkerGroup(ids[0], list(addresses))
            self.encoder = StepEncoder()
            self.channel = StepChannel(ray.util.get_node_ip_address())
            self._loops = [w.serve_steps.remote(*self.channel.address) for w in self.workers]
            self.channel.accept(len(self.workers), 120.0, self._dead_worker)
        except ChannelClosed as e:
            self.shutdown()
            raise EngineDeadError(f"a worker of this engine failed to connect: {e}") from e
        except BaseException:
            self.shutdown()
            raise

    def _dead_worker(self) -> str | None:
        """Why the engine cannot go on, if a worker's step loop has ended (its actor died, or the loop
        raised); None while they all run."""
        import ray  # noqa: PLC0415

        done, _ = ray.wait(self._loops, num_returns=len(self._loops), timeout=0)
        for ref in done:
            rank = self._loops.index(ref)
            try:
                ray.get(ref)
            except Exception as e:  # noqa: BLE001 - reported as the reason
                return f"worker rank {rank} died: {e}"
            return f"worker rank {rank} stopped serving steps"
        return None

    def _run(self, method: str, *args: Any) -> list[Any]:
        """Call `method` on every worker at once; results in rank order."""
        return self._wait([getattr(w, method).remote(*args) for w in self.workers])

    @staticmethod
    def _wait(refs: list[Any]) -> list[Any]:
        """Results of `refs`; raise EngineDeadError once any worker is reported dead (the others may
        be blocked in a collective with it and never answer). Waits for all at once, looking at the
        finished ones every second, so the usual step costs one wait and one get."""
        import ray  # noqa: PLC0415

        try:
            pending = list(refs)
            while pending:
                ready, pending = ray.wait(pending, num_returns=len(pending), timeout=1.0)
                if pending and ready:
                    ray.get(ready)              # raises if one of them failed
            return ray.get(refs)
        except ray.exceptions.RayActorError as e:
            raise EngineDeadError(f"a worker of this engine died: {e}") from e

    def _exchange(self, sched: SchedulerOutput | None, kv_ops: list[tuple[Any, ...]]
                  ) -> tuple[ModelRunnerOutput | None, list[TransferReport | None]]:
        self._send(sched, kv_ops)
        return self._receive()

    def submit(self, sched: SchedulerOutput) -> None:
        """Send a step without waiting for it (pipeline stages: the workers run the steps in the
        order sent; `collect` returns their outputs in that order). Engines with a KV connector,
        which keep one batch in the stages (records/engine_args.py), step through execute_model."""
        self._send(sched, [])

    def collect(self) -> ModelRunnerOutput:
        """The output of the oldest step sent with `submit` (blocks until it is done)."""
        output, _ = self._receive()
        assert output is not None
        return output

    def _send(self, sched: SchedulerOutput | None, kv_ops: list[tuple[Any, ...]]) -> None:
        try:
            delta = None if sched is None else self.encoder.encode(sched)   # Worker.execute_serialized
            self.channel.broadcast(pickle.dumps((delta, kv_ops), protocol=pickle.HIGHEST_PROTOCOL))
        except ChannelClosed as e:
            raise EngineDeadError(f"a worker of this engine died: {e}") from e

    def _receive(self) -> tuple[ModelRunnerOutput | None, list[TransferReport | None]]:
        try:
            replies = self.channel.gather(self._dead_worker)
        except ChannelClosed as e:
            raise EngineDeadError(f"a worker of this engine died: {e}") from e
        results = [pickle.loads(reply) for reply in replies]
        for rank, (ok, value) in enumerate(results):
            if not ok:       # the ranks may now be out of step with each other: the engine stops
                raise EngineDeadError(f"worker rank {rank} failed a step:\n{value}")
        output = results[self.driver][1][0]
        for rank, (_, (other, _)) in enumerate(results):   # offload-tier orders failed on any rank
            if rank != self.driver and other is not None and other.tier_failed and output is not None:
                output.tier_failed.extend(o for o in other.tier_failed if o not in output.tier_failed)
        return output, [report for _, (_, report) in results]

    def kv_blocks(self, block_ids: list[int]) -> list[Any]:
        dtype = getattr(torch, self.kv_dtype)
        return [raw.view(dtype) for raw in self._wait([
            w.kv_block_bytes.options(concurrency_group="control").remote(block_ids) for w in self.workers])]

    def kv_pull_log(self) -> list[Any]:
        return [r for log in self._wait([w.kv_pull_log.options(concurrency_group="control").remote()
                                         for w in self.workers]) for r in log]

    def tier_stats(self) -> dict[str, float]:
        """The offload tier's counters, summed over the ranks."""
        total: dict[str, float] = {}
        for stats in self._wait([w.tier_stats.options(concurrency_group="control").remote() for w in self.workers]):
            for k, v in stats.items():
                total[k] = total.get(k, 0) + v
        return total

    def expert_load(self) -> list[dict[int, int]]:
        return self._wait([w.expert_load.options(concurrency_group="control").remote() for w in self.workers])

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        # (the control group: the step loop's thread waits on the step channel meanwhile). The
        # arguments go to the object store once, not once per rank (a weight update's tensors).
        import ray  # noqa: PLC0415

        refs = [ray.put(a) for a in args]
        return self._wait([getattr(w, method).options(concurrency_group="control").remote(*refs)
                           for w in self.workers])

    def placements(self) -> list[dict[str, Any]]:
        return self._wait([w.placement.options(concurrency_group="control").remote() for w in self.workers])

    def shutdown(self) -> None:
        import ray  # noqa: PLC0415
        from ray.util.placement_group import remove_placement_group  # noqa: PLC0415

        if getattr(self, "channel", None) is not None:
            self.channel.close()           # the workers' step loops end
            self.channel = None

        for worker in getattr(self, "workers", []):
            ray.kill(worker)
        self.workers = []
        if getattr(self, "placement_group", None) is not None:
            remove_placement_group(self.placement_group)
            self.placement_group = None
