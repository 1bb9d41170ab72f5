"""SimulatedExecutor: the executor of a simulated engine (EngineConfig.simulation). The whole engine
runs (scheduler, KV cache manager and block pool, prefix cache and its events, leases and pulls,
the offload tier's bookkeeping, preemption, outputs) but the forward pass: a step takes the time
the profile's cost model gives its batch on the replica's TP x PP shape (records/sim_profile.py),
and every row that samples emits a deterministic token.

The tokens are a hash of the sequence's last token, its length and the request's seed, never one
of the model's EOS ids: a request runs to max_tokens (or max_model_len) as with ignore_eos, and a
sequence gives the same tokens on any replica (a migrated stream goes on as it would have; a P/D
request's first token on the decode replica is the prefill's). Structured-output constraints are
not applied: the tokens are not text.

Time: in real time (the replicas of `pdserve serve --simulate`) the step's thread sleeps until its
batch is done, `time_scale` real seconds per simulated second; under a virtual clock (`pdserve
simulate`: records/clock.py) nothing sleeps: `ready_at` says when the last step's outputs exist,
counting the engine's own work around the step (the profile's `engine_overhead`, which a real-time
replica spends for real). Pipeline stages overlap as real ones do: a batch holds each stage for its
share of the step and moves on after the hop between stages; a stage takes the next batch when free.
Block copies over the host link (swap, the offload tier) come before the forward pass.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Any

import records.clock as clock
from engine.executor.base import Executor
from kv_transfer.simulated import SimulatedKVWorker
from kv_transfer.worker_group import KVWorkerGroup
from records.config import DEFAULT_KV_CACHE_BYTES, EngineConfig
from records.dtypes import KV_DTYPE_SIZES
from records.kv_layout import KVLayout
from records.sim_profile import StepShape
from records.step import ModelRunnerOutput, SampledToken, ScheduledRequest, SchedulerOutput
from records.transfer import TransferReport

_MASK = (1 << 64) - 1


def simulated_token(last_token: int, length: int, seed: int, vocab_size: int, eos_token_ids: frozenset[int]) -> int:
    """The token a simulated model emits after a sequence of `length` tokens ending in `last_token`
    (splitmix64 of the three), in [0, vocab_size) and never an EOS id."""
    x = (last_token * 0x9E3779B97F4A7C15 + length * 0xBF58476D1CE4E5B9 + seed * 0x94D049BB133111EB
         + 0x632BE59BD9B4E019) & _MASK
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _MASK
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _MASK
    x ^= x >> 31
    token = x % vocab_size
    while token in eos_token_ids:
        token = (token + 1) % vocab_size
    return token


def step_shape(sched: SchedulerOutput) -> StepShape:
    """What the step's cost depends on: its prompt segments and decode rows."""
    prefill_tokens = decode_rows = decode_context = sampled = 0
    pairs = 0.0
    for req in sched.scheduled:
        n = len(req.token_ids)
        if n == 1:
            decode_rows += 1
            decode_context += req.start + 1
        else:
            prefill_tokens += n
            pairs += n * (req.start + (n + 1) / 2)
        sampled += req.do_sample
    return StepShape(prefill_tokens, pairs, decode_rows, decode_context, sampled)


class SimulatedExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        sim = config.simulation
        assert sim is not None
        self.profile, self.time_scale = sim.profile, sim.time_scale
        pc, cc = config.parallel_config, config.cache_config
        self.tp, self.pp = pc.tensor_parallel_size, pc.pipeline_parallel_size
        self.kv_dtype_bytes = KV_DTYPE_SIZES[config.kv_dtype] if cc.is_fp8 else None
        self.block_bytes = config.kv_block_bytes()          # over every rank
        ranks = self.tp * self.pp
        capacity = self.profile.kv_capacity_bytes(self.tp, self.pp)
        budget = DEFAULT_KV_CACHE_BYTES if capacity is None else capacity / ranks
        self.num_blocks, self.num_cpu_blocks = config.kv_cache_blocks(max(1, self.block_bytes // ranks), budget)
        self.tier_slots = config.tier_slots(self.block_bytes)
        self.kv_scales = cc.kv_scales
        self.vocab_size = config.model_config.vocab_size
        self.hidden_size = getattr(config.model_config.hf_config, "hidden_size", 1)
        self.kv_worker: SimulatedKVWorker | None = None
        if config.kv_transfer_config is not None:
            self.kv_worker = SimulatedKVWorker(config.kv_transfer_config, KVLayout.from_config(config),
                                               self.block_bytes, self.profile.transfer_time)
            self.kv = KVWorkerGroup(self.kv_worker.engine_id, [self.kv_worker.address()])
        self.stage_free = [0.0] * self.pp             # when each pipeline stage is free (clock.monotonic)
        self.in_flight: deque[tuple[float, ModelRunnerOutput]] = deque()
        self.ready_at = 0.0                           # when the last collected step's outputs exist
        self.num_steps = 0
        self.busy_s = 0.0                             # simulated seconds of forward passes

    # --- steps ------------------------------------------------------------------------------------
    def _exchange(self, sched: SchedulerOutput | None, kv_ops: list[tuple[Any, ...]]
                  ) -> tuple[ModelRunnerOutput | None, list[TransferReport | None]]:
        if self.kv_worker is not None:
            self.kv_worker.apply(kv_ops)
        output = None
        if sched is not None:
            self.submit(sched)
            output = self.collect()
        return output, [self.kv_worker.poll() if self.kv_worker is not None else None]

    def submit(self, sched: SchedulerOutput) -> None:
        """Start a batch through the stages now (its outputs are made at once, kept until `collect`)."""
        shape = step_shape(sched)
        stage_s = self.profile.stage_time(shape, self.tp, self.pp, self.kv_dtype_bytes)
        hop_s = self.profile.hop_time(shape) if self.pp > 1 else 0.0
        copies = len(sched.swap_out) + len(sched.swap_in) + len(sched.tier_saves) + len(sched.tier_loads)
        before_s = self.profile.transfer_time(copies * self.block_bytes, self.profile.host_bandwidth) if copies else 0.0
        if clock.is_virtual():
            before_s += self.profile.overhead_time(len(sched.scheduled))
        scale = self.time_scale
        t = clock.monotonic() + before_s * scale
        for stage in range(self.pp):
            t = max(t, self.stage_free[stage]) + stage_s * scale
            self.stage_free[stage] = t
            if stage < self.pp - 1:
                t += hop_s * scale
        self.num_steps += 1
        self.busy_s += self.pp * stage_s
        self.in_flight.append((t, self._outputs(sched)))

    def collect(self) -> ModelRunnerOutput:
        """The oldest batch's outputs, once it is done (in real time, sleeping until then)."""
        ready, output = self.in_flight.popleft()
        if clock.is_virtual():
            clock.advance(ready)
        else:
            delay = ready - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        self.ready_at = ready
        return output

    def _outputs(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        output = ModelRunnerOutput(sampled={})
        for req in sched.scheduled:
            if req.prompt_logprobs_from is not None:
                last = min(req.start + len(req.token_ids), len(req.prompt_token_ids) - 1)
                output.prompt_logprobs[req.request_id] = [{req.prompt_token_ids[p + 1]: 0.0}
                                                          for p in range(req.start, last)]
            params = req.sampling_params
            if params is not None and params.pooling is not None:
                rows = self._pooled_rows(req)
                if rows:
                    output.pooled[req.request_id] = (self._vector(req, rows), rows)
                continue
            if not req.do_sample:
                continue
            length = len(req.prompt_token_ids) + len(req.output_token_ids)
            last_token = req.output_token_ids[-1] if req.output_token_ids else req.prompt_token_ids[-1]
            token = simulated_token(last_token, length, req.seed or 0, self.vocab_size, req.eos_token_ids)
            if params is not None and params.logprobs is not None:
                output.sampled[req.request_id] = SampledToken(token, 0.0, 1, {token: 0.0})
            else:
                output.sampled[req.request_id] = SampledToken(token)
        return output

    @staticmethod
    def _pooled_rows(req: ScheduledRequest) -> int:
        """The rows of this chunk an embedding pools (as engine/worker/model_runner.py picks them)."""
        n, num_prompt = len(req.token_ids), len(req.prompt_token_ids)
        mode = req.sampling_params.pooling if req.sampling_params is not None else None
        if mode == "mean":
            return n
        if mode == "last":
            return int(req.start + n == num_prompt)
        return int(mode == "cls" and req.start == 0)

    def _vector(self, req: ScheduledRequest, rows: int) -> Any:
        import torch  # noqa: PLC0415 - embeddings only: pooled rows are tensors, as the runner's

        g = torch.Generator().manual_seed(hash(tuple(req.prompt_token_ids[:64])) & 0x7FFFFFFF)
        return torch.rand(self.hidden_size, generator=g) * rows

    # --- the rest of the executor's surface -------------------------------------------------------
    def kv_blocks(self, block_ids: list[int]) -> list[Any]:
        raise NotImplementedError("a simulated engine holds no KV values")

    def kv_pull_log(self) -> list[Any]:
        return self.kv_worker.take_pull_log() if self.kv_worker is not None else []

    def tier_stats(self) -> dict[str, float]:
        return {}

    def expert_load(self) -> list[dict[int, int]]:
        return [{}]

    def shutdown(self) -> None:
        if self.kv_worker is not None:
            self.kv_worker.shutdown()
