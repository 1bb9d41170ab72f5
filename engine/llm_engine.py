"""LLMEngine: one replica's step loop. step() = schedule -> execute -> update -> outputs.

Validates requests on the way in (ValueError naming the field) and fans `n > 1` out into forked
children; the output side (detokenization, stop strings, vLLM-shaped RequestOutputs) is
engine/output_processor.py.
With a KV connector it also moves the transfer queues between the scheduler side and the worker side
of the connector (kv_transfer/base.py) at the start of each step.
"""
from __future__ import annotations

import uuid
from collections import deque
from dataclasses import replace
from typing import Any

import engine.tracing as tracing
import records.clock as clock
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.scheduler import Scheduler
from engine.executor.executor import make_executor
from engine.output_processor import OutputProcessor
from engine.sample.structured_output import compiler_for
from engine.spec_decode import SpecDecodeStats, make_proposer, max_proposals
from engine.telemetry import RequestTelemetry
from engine.text.tokenizer import eos_token_ids, shared_tokenizer
from kv_transfer.base import KVConnectorScheduler
from records.config import EngineConfig
from records.errors import EngineDeadError
from records.kv_layout import KVLayout
from records.lora import LoRARequest, read_adapter
from records.model_source import MOE_ARCHITECTURES
from records.outputs import KVEvent, ModelRunnerOutput, RequestOutput, SchedulerOutput
from records.request import PEER_PREFIX, Continuation, NewRequest, Request, RequestStatus
from records.sampling_params import SamplingParams, StructuredOutputsParams, check_limits, validate_request

# Steps in a row that may fail (each failing only its own requests) before the engine is declared
# dead: one failure is a request's or a transient fault; a run of them is the engine's own.
MAX_FAILED_STEPS = 3


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mc = config.model_config
        tracing.configure(config.otlp_traces_endpoint)
        self.tokenizer = shared_tokenizer(mc.model, mc.gguf_file)
        self._adapters: set[tuple] = set()        # adapters read_adapter accepted (their cache keys)
        self.eos_token_ids = eos_token_ids(self.tokenizer, mc.hf_config, mc.model)
        self.executor = make_executor(config)
        if self.executor.kv_scales != config.cache_config.kv_scales:    # fp8 scales calibrated at load
            config = self.config = replace(config, cache_config=replace(config.cache_config,
                                                                        kv_scales=self.executor.kv_scales))
        self.kv_cache_manager = KVCacheManager(
            self.executor.num_blocks, config.cache_config.block_size,
            config.cache_config.enable_prefix_caching, self.executor.num_cpu_blocks, self.executor.tier_slots,
            mc.kv_sliding_window)
        kvt = config.kv_transfer_config
        self.kv_connector: KVConnectorScheduler | None = None
        self.kv_worker = self.executor.kv           # every rank's worker side (None without a connector)
        if kvt is not None:
            self.kv_connector = KVConnectorScheduler(kvt, KVLayout.from_config(config))
        self.scheduler = Scheduler(config.scheduler_config, self.kv_cache_manager, self.kv_connector,
                                   kvt.load_failure_policy if kvt else "recompute",
                                   config.parallel_config.max_concurrent_batches)
        self.in_flight: deque[SchedulerOutput] = deque()   # batches submitted, oldest first
        self.proposer = make_proposer(config, self.executor.num_blocks)
        self.spec_stats = SpecDecodeStats()
        self._aborted_leases: list[str] = []
        self.last_step_idle = False         # the last step scheduled nothing (only transfers pending)
        self.num_failed_steps = 0           # steps in a row that raised (ModelRunnerOutput.step_error)
        self.output = OutputProcessor(self.tokenizer, self.scheduler.finish_requests)
        self.telemetry = self.output.telemetry = RequestTelemetry(mc.max_model_len, config.kv_block_bytes())
        self.num_prompt_tokens = 0
        self.num_prefix_leases = 0          # prefixes leased to peer replicas (lease_prefix)

    # --- intake -----------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
                    params: SamplingParams, arrival_time: float | None = None,
                    kv_transfer_params: dict[str, Any] | None = None,
                    continuation: Continuation | None = None, trace_context: dict[str, str] | None = None,
                    block_hashes: list[bytes] | None = None) -> None:
        """Validate and queue a request. Raises ValueError for bad input; nothing is queued then.

        `kv_transfer_params`: `{"do_remote_decode": True}` prefills here (max_tokens forced to 1)
        and leases the blocks for a decode engine (the output carries the parameters to pass it);
        the parameters a prefill engine returned pull the prompt's KV from it instead of computing.
        `continuation`: the request resumes after tokens another replica generated (records/request.py);
        its outputs carry only what comes after them. `trace_context`: a W3C trace-context carrier
        (`traceparent`); when this process traces, the request's spans go under it (engine/telemetry.py),
        or start a trace of their own without one. `block_hashes`: the prompt came prepared by an
        ingress, which checked its ids against the model and hashed it (records/request.py:
        NewRequest); only this engine's own limits are checked."""
        if prompt_token_ids is None:
            if prompt is None:
                raise ValueError("prompt must be a string or prompt_token_ids a list of ints")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompt_token_ids")
            prompt_token_ids = self.tokenizer.encode(prompt)
        prompt_token_ids = list(prompt_token_ids)
        self.validate(prompt_token_ids, params, prepared=block_hashes is not None)
        self.enqueue(NewRequest(request_id, prompt, prompt_token_ids, params,
                                arrival_time if arrival_time is not None else clock.monotonic(),
                                kv_transfer_params, continuation, trace_context, block_hashes))

    def enqueue(self, new: NewRequest) -> None:
        """Queue a request that `validate` passed (AsyncLLMEngine.submit validates off the engine's
        loop, and compiles its constraint on a thread of its own). Raises ValueError for what only
        the engine's state can refuse (an id in use, a continuation or transfer it cannot take)."""
        request_id, params, prompt_token_ids = new.request_id, new.params, new.prompt_token_ids
        if params.use_beam_search:
            raise ValueError("use_beam_search: beam search runs over the engine (LLM.generate, the server's "
                             "completions and chat: engine/beam_search.py), not as one engine request")
        if request_id in self.output.states or (self.kv_connector is not None
                                         and request_id in self.kv_connector.leases):
            raise ValueError(f"request_id {request_id!r} is already in use")
        mc = self.config.model_config
        max_tokens = params.max_tokens or (mc.max_model_len - len(prompt_token_ids))
        ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        bs = self.config.cache_config.block_size
        leader = Request(ids[0], prompt_token_ids, params, self.eos_token_ids, bs, max_tokens, new.arrival,
                         parent_id=request_id, index=0, block_hashes=new.block_hashes)
        leader.fork_children = [leader.fork(rid, i) for i, rid in enumerate(ids[1:], start=1)]
        if new.continuation is not None:
            self._check_continuation(params, max_tokens, new.continuation, bool(new.kv_transfer_params))
            leader.resume(new.continuation.token_ids)
        if new.kv_transfer_params:
            self._attach_transfer(leader, new.kv_transfer_params)
        children = [leader, *leader.fork_children]
        trace_context = new.trace_context
        if trace_context is None and tracing.enabled():
            trace_context = {}          # traced all the same, as a trace of its own (vLLM's offline tracing)
        self.output.add(request_id, new.prompt, prompt_token_ids, params, children, new.arrival, new.continuation,
                        trace_context)
        self.scheduler.add_request(leader)
        self.num_prompt_tokens += len(prompt_token_ids)

    def _check_continuation(self, params: SamplingParams, max_tokens: int, continuation: Continuation,
                            transfer: bool) -> None:
        if params.n != 1 or params.prompt_logprobs is not None or transfer:
            raise ValueError("continuation needs n == 1, prompt_logprobs None and no kv_transfer_params")
        tokens = continuation.token_ids
        vocab = self.config.model_config.vocab_size
        if not tokens or any(not isinstance(t, int) or not 0 <= t < vocab for t in tokens):
            raise ValueError(f"continuation.token_ids must be a non-empty list of token ids in [0, {vocab})")
        if len(tokens) >= max_tokens:
            raise ValueError(f"continuation.token_ids has {len(tokens)} tokens; the request's max_tokens "
                             f"({max_tokens}) leaves none to generate")
        if continuation.num_chars < 0:
            raise ValueError(f"continuation.num_chars must be >= 0; got {continuation.num_chars}")

    def _attach_transfer(self, request: Request, kv_transfer_params: dict[str, Any]) -> None:
        if self.kv_connector is None:
            raise ValueError("kv_transfer_params need a KV connector: create this engine with "
                             "kv_connector='nixl' or 'torch_dist'")
        if not isinstance(kv_transfer_params, dict):
            raise ValueError("kv_transfer_params must be a dict")
        params = request.sampling_params
        if params.n != 1:
            raise ValueError(f"kv_transfer_params need n == 1; got n={params.n}")
        remote = self.kv_connector.parse(kv_transfer_params, request.block_hashes, request.num_prompt_tokens,
                                         params.adapter_name)
        if remote is None:
            request.remote_decode = True
            request.max_tokens = 1
            peer = kv_transfer_params.get("peer_prefix")
            if peer is not None:       # its prefix pulled from a peer (a peer's lease_prefix)
                if not isinstance(peer, dict) or not peer.get("do_remote_prefill"):
                    raise ValueError("kv_transfer_params.peer_prefix must be the kv_transfer_params a peer's "
                                     "lease_prefix returned")
                request.remote_prefill = self.kv_connector.parse(peer, request.block_hashes, request.num_prompt_tokens,
                                                                 params.adapter_name)
        elif params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs must be None with do_remote_prefill (the prompt's KV "
                             "is pulled, not computed here)")
        else:
            request.remote_prefill = remote

    def validate(self, prompt_token_ids: list[int], params: SamplingParams, compile_constraint: bool = True,
                 prepared: bool = False) -> None:
        """Raise ValueError naming the field if this request cannot run on this engine (its output
        constraint compiled too, unless `compile_constraint` is False: the caller does that).
        `prepared`: an ingress checked it against the model already (records/request.py:
        NewRequest.block_hashes); only this engine's limits are checked."""
        mc = self.config.model_config
        max_num_seqs = None if params.use_beam_search else self.config.scheduler_config.max_num_seqs
        if prepared:
            check_limits(len(prompt_token_ids), params, mc.max_model_len, max_num_seqs)
        else:
            validate_request(prompt_token_ids, params, mc.vocab_size, mc.max_model_len, max_num_seqs)
        if params.structured_outputs is not None and compile_constraint:
            self.compile_constraint(params.structured_outputs)
        if params.lora_request is not None:
            self.check_adapter(params.lora_request)

    def check_adapter(self, lora: LoRARequest) -> None:
        """Refuse (ValueError naming the field) an adapter this engine cannot run: LoRA not enabled,
        or the PEFT directory not matching the model or max_lora_rank (read from the files' headers
        once per adapter; the workers read the tensors when it is first scheduled)."""
        if self.config.lora_config is None:
            raise ValueError("lora_request: this engine serves no adapters; start it with enable_lora=True "
                             "(--enable-lora)")
        if lora.cache_key not in self._adapters:
            read_adapter(lora.lora_path, self.config.model_config.hf_config, self.config.lora_config.max_lora_rank)
            self._adapters.add(lora.cache_key)

    def compile_constraint(self, spec: StructuredOutputsParams) -> None:
        """Compile an output constraint (cached per schema), so that one that cannot compile is
        refused (ValueError) before its request is queued; the runner of this process then finds it
        compiled. Safe on any thread (xgrammar's compiler is; it releases the GIL)."""
        mc = self.config.model_config
        compiler_for(mc.model, mc.gguf_file, mc.vocab_size, self.tokenizer).compile(spec)

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Abort user requests (all their children); their blocks are freed at once."""
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            if self.kv_connector is not None and rid in self.kv_connector.leases:
                self._aborted_leases.append(rid)     # freed at the next step
            child_ids = self.output.remove(rid)
            if child_ids:
                self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)
        if self.proposer is not None:
            self.proposer.retain(self.scheduler.requests)

    # --- the loop ---------------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        """True while a request is in flight or KV transfers (pulls, leases) are pending."""
        return (bool(self.output.states) or self.scheduler.has_unfinished_requests() or bool(self.in_flight)
                or (self.kv_worker is not None and self.kv_worker.has_pending()))

    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns an output for every request that advanced or finished."""
        if self.scheduler.max_concurrent_batches > 1:
            return self._step_pipelined()
        outputs = self._poll_transfers() if self.kv_worker is not None else []
        sched = self.scheduler.schedule()
        if self.kv_connector is not None:
            for spec in self.kv_connector.take_new_loads():
                self.kv_worker.start_load(spec)
            for remote in self.kv_connector.take_new_releases():
                self.kv_worker.release_remote(remote)
        self.last_step_idle = sched.is_empty
        if sched.is_empty:
            return outputs
        return outputs + self._apply(sched, self.executor.execute_model(sched))

    def _step_pipelined(self) -> list[RequestOutput]:
        """Pipeline stages: keep up to max_concurrent_batches batches of disjoint requests in the
        stages (the first stage runs the next batch while the last one finishes this one), then
        take the oldest batch's output. The stages run each batch in the order sent, so a block
        freed by one batch and reused by a later one is written in that order on every stage."""
        while len(self.in_flight) < self.scheduler.max_concurrent_batches:
            sched = self.scheduler.schedule()
            if sched.is_empty:
                break
            self.executor.submit(sched)
            self.in_flight.append(sched)
        self.last_step_idle = not self.in_flight
        if not self.in_flight:
            return []
        sched = self.in_flight.popleft()
        return self._apply(sched, self.executor.collect())

    def _apply(self, sched: SchedulerOutput, runner_out: ModelRunnerOutput) -> list[RequestOutput]:
        """The step's sampled tokens into the requests: outputs for those that advanced."""
        self.telemetry.step(sched.num_batched_tokens)
        if runner_out.spec_sampled:          # only speculative steps pay for the count
            for scheduled in sched.scheduled:
                emitted = runner_out.spec_sampled.get(scheduled.request_id)
                if emitted is not None:
                    self.spec_stats.observe(len(scheduled.spec_token_ids), len(emitted) - 1)
        if runner_out.step_error is not None:
            # The step's requests fail (the scheduler frees them); the engine serves the rest.
            # Steps that keep failing mean the engine itself is broken.
            self.num_failed_steps += 1
            if self.num_failed_steps >= MAX_FAILED_STEPS:
                raise EngineDeadError(f"{self.num_failed_steps} engine steps in a row failed; the last: "
                                      f"{runner_out.step_error}")
        else:
            self.num_failed_steps = 0
        updated = self.scheduler.update_from_output(sched, runner_out)
        if self.kv_connector is not None:
            self._start_leases()
        outputs = self.output.advance(updated)
        if self.proposer is not None:
            self._propose()
        return outputs

    def _propose(self) -> None:
        """Ask the proposer for the next step's tokens of running decodes that have none."""
        assert self.proposer is not None and self.config.speculative_config is not None
        k = self.config.speculative_config.num_speculative_tokens
        max_len = self.config.scheduler_config.max_model_len
        self.proposer.retain(self.scheduler.requests)
        busy = self.scheduler.in_flight           # their next tokens are not back yet
        wanted = [(r, num) for r in self.scheduler.running
                  if not r.spec_token_ids and r.request_id not in busy
                  and (num := max_proposals(r, k, max_len)) > 0]
        if wanted:
            requests, nums = zip(*wanted)
            for request, proposal in zip(requests, self.proposer.propose(list(requests), list(nums))):
                request.spec_token_ids = proposal

    def _poll_transfers(self) -> list[RequestOutput]:
        """Collect finished transfers: end released, aborted and expired leases (the worker refuses
        their pulls before their blocks are freed), and re-queue or fail finished pulls."""
        assert self.kv_connector is not None and self.kv_worker is not None
        report = self.executor.kv_poll()
        aborted, self._aborted_leases = self._aborted_leases, []
        ending = self.kv_connector.leases_to_end(report.released, aborted)
        if ending:
            self.kv_worker.end_leases([lease.slot for lease in ending])
            for lease in ending:
                self.kv_cache_manager.free(lease.request)
        outputs = []
        for request in self.scheduler.finish_loads(report.loaded, report.failed):
            output = self.output.finish_loaded(request)
            if output is not None:
                outputs.append(output)
        return outputs

    def _start_leases(self) -> None:
        """Lease the blocks of requests that finished their prefill for a remote decode."""
        assert self.kv_connector is not None and self.kv_worker is not None
        for request in self.scheduler.take_new_leased():
            block_ids = self.kv_cache_manager.block_ids(request.request_id)
            taken = self.kv_connector.lease_slots.take()
            if taken is None:        # lease table full: the decode side will compute the prompt
                self.kv_cache_manager.free(request)
                continue
            self.kv_worker.hold_lease(*taken, block_ids)
            params = self.kv_connector.add_lease(request, block_ids, *taken, self.kv_worker.addresses,
                                                 self.kv_worker.engine_id)
            self.output.set_transfer_params(request.request_id, params)
        self.executor.kv_flush()     # every rank holds the new leases before their parameters leave

    def lease_prefix(self, block_hashes: list[bytes], adapter: str = "") -> dict[str, Any] | None:
        """Lease the leading run of `block_hashes` this engine holds, in its pool or (loaded back
        into the pool first, now) its offload tier, for a peer replica to pull instead of computing
        them (the router decides: router/routing/pool_router.py). Returns the kv_transfer_params to
        give the peer's request (as a prefill engine's, for `num_tokens` = the run's tokens), or
        None when there is nothing to lease (no connector, no such blocks, the lease table full).
        The blocks stay referenced until the peer releases the lease, or it expires. Runs between
        steps (an engine with a connector keeps one batch in flight)."""
        if self.kv_connector is None or self.kv_worker is None or not self.kv_connector.lease_slots.num_free:
            return None
        kv, hashes = self.kv_cache_manager, list(block_hashes)
        holder, num_pool = kv.hold_prefix(f"{PEER_PREFIX}{uuid.uuid4().hex[:16]}", hashes)
        failed: set[int] = set()
        if kv.tier is not None and (kv.tier.saves or kv.tier.loads):    # the tier's blocks: load them now
            saves, loads = kv.tier.take_orders()
            out = self.executor.execute_model(SchedulerOutput([], 0, tier_saves=saves, tier_loads=loads))
            kv.tier.forget_failed(out.tier_failed)
            failed = {order[3] for order in out.tier_failed if order[0] == "load"}
        if kv.confirm_prefix(holder, hashes, failed) == 0:
            kv.free(holder)
            return None
        taken = self.kv_connector.lease_slots.take()
        assert taken is not None
        blocks = kv.req_to_blocks[holder.request_id]
        block_ids = [b.block_id for b in blocks]
        self.kv_worker.hold_lease(*taken, block_ids)
        params = self.kv_connector.add_prefix_lease(
            holder, block_ids, list(block_hashes[:len(blocks)]), len(blocks) * kv.block_size, adapter, *taken,
            self.kv_worker.addresses, self.kv_worker.engine_id)
        self.executor.kv_flush()     # every rank holds the lease before its parameters leave
        self.num_prefix_leases += 1
        return params

    def renew_lease(self, request_id: str, seconds: float) -> bool:
        """Keep a leased request's blocks at least `seconds` longer; False if it holds no lease."""
        return self.kv_connector is not None and self.kv_connector.renew_lease(request_id, seconds)

    # --- introspection ----------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        kv = self.kv_cache_manager
        return {
            "num_requests_running": len(self.scheduler.running),
            "num_requests_waiting": len(self.scheduler.waiting),
            # Prompt tokens admitted but not yet run through the model (a prefill pool's queue).
            "num_prompt_tokens_queued": sum(max(0, r.num_prompt_tokens - r.num_computed_tokens)
                                            for q in (self.scheduler.waiting, self.scheduler.running) for r in q),
            "kv_cache_usage_perc": kv.usage,
            "ttft_histogram": list(self.output.ttft.counts),     # records/histogram.py's buckets
            "itl_histogram": list(self.output.itl.counts),
            "histograms": self.telemetry.reading(),             # records/histogram.py: engine_histograms
            "num_kv_blocks": kv.block_pool.num_blocks,
            "num_free_kv_blocks": kv.num_free_blocks,
            "prefix_cache_queries": kv.prefix_cache_queries,
            "prefix_cache_hits": kv.prefix_cache_hits,
            "num_preemptions": self.scheduler.num_preemptions,
            "prompt_tokens": self.num_prompt_tokens,
            "prompt_tokens_computed": self.scheduler.num_prompt_tokens_computed,
            "generation_tokens": self.output.num_generation_tokens,
            **(self.spec_stats.as_dict() if self.proposer is not None else {}),
            **(self._transfer_stats() if self.kv_connector is not None else {}),
            **(self._tier_stats() if kv.tier is not None else {}),
            **self._moe_stats(),
        }

    def _moe_stats(self) -> dict[str, Any]:
        """A MoE model's expert load: [rank, expert, rows run] per expert each rank holds."""
        if self.config.model_config.architecture not in MOE_ARCHITECTURES:
            return {}
        return {"moe_expert_tokens": [[rank, expert, n] for rank, experts in enumerate(self.executor.expert_load())
                                      for expert, n in sorted(experts.items())]}

    def _tier_stats(self) -> dict[str, Any]:
        """The offload tier: blocks held per medium, its counters, and the workers' bytes and
        seconds (summed over the ranks)."""
        tier = self.kv_cache_manager.tier
        assert tier is not None
        worker = self.executor.tier_stats()
        return {"kv_tier_host_blocks": len(tier.entries["host"]), "kv_tier_disk_blocks": len(tier.entries["disk"]),
                "kv_tier_host_slots": tier.num_slots["host"], "kv_tier_disk_slots": tier.num_slots["disk"],
                **{f"kv_tier_{k}": v for k, v in tier.stats.as_dict().items()},
                **{f"kv_tier_{k}": v for k, v in worker.items()}}

    def _transfer_stats(self) -> dict[str, Any]:
        c, loads = self.kv_connector, self.scheduler.loads
        assert c is not None and loads is not None
        return {"kv_loads": c.num_loads, "kv_load_failures": c.num_load_failures,
                "kv_blocks_pulled": c.num_blocks_pulled, "kv_leases": c.num_leases,
                "kv_leases_active": len(c.leases), "kv_leases_expired": c.num_leases_expired,
                "kv_prefix_leases": self.num_prefix_leases,
                "num_requests_waiting_for_kv": len(loads.loading)}

    def take_kv_events(self) -> list[KVEvent]:
        return self.kv_cache_manager.take_events()

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def check_no_leaks(self) -> None:
        """AssertionError unless no request is left and every KV block is free."""
        assert not self.scheduler.requests, f"unfinished requests: {list(self.scheduler.requests)}"
        loads = self.scheduler.loads
        assert loads is None or not loads.aborted, f"pulls outstanding: {list(loads.aborted)}"
        assert not self.scheduler.tier_loading, f"tier loads outstanding: {list(self.scheduler.tier_loading)}"
        if self.kv_connector is not None:
            assert not self.kv_connector.leases, f"leases held: {list(self.kv_connector.leases)}"
        self.kv_cache_manager.check_no_leaks()
        if self.proposer is not None:
            self.proposer.check_no_leaks()
