"""LLMEngine: one replica's step loop. step() = schedule -> execute -> update -> outputs.

Validates requests on the way in (ValueError naming the field) and fans `n > 1` out into forked
children; the output side (detokenization, stop strings, vLLM-shaped RequestOutputs) is
engine/output_processor.py.
With a KV connector, its transfers (P/D pulls and leases, a peer's prefix) are engine/kv_transfers.py's,
which the step asks before scheduling (finished transfers) and after (new ones to the workers).
"""
from __future__ import annotations

from collections import deque
from dataclasses import replace
from typing import Any

import engine.tracing as tracing
import records.clock as clock
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.scheduler import Scheduler
from engine.core.step_budget import StepBudget, StepPacer
from engine.executor.base import Executor
from engine.kv_transfers import KVTransfers
from engine.output_processor import OutputProcessor
from engine.sample.structured_output import compiler_for
from engine.spec_decode import make_proposer, max_proposals
from engine.telemetry import RequestTelemetry
from engine.text.backend_tokenizer import engine_tokenizer, hf_tokenizer
from engine.text.images import ImageProcessor
from engine.text.tokenizer import eos_token_ids, tokenize_bad_words
from engine.weight_updates import WeightUpdates
from kv_transfer.base import KVConnectorScheduler
from records.config import EngineConfig
from records.engine_stats import EngineStats, SpecDecodeStats
from records.errors import EngineDeadError
from records.kv_events import KVEvent
from records.kv_layout import KVLayout
from records.lora import LoRARequest, read_adapter
from records.model_source import MOE_ARCHITECTURES, images_attend_both_ways, is_vision_language
from records.outputs import RequestOutput
from records.request import Continuation, NewRequest, Request, RequestStatus
from records.sampling_params import SamplingParams, StructuredOutputsParams, check_limits, validate_request
from records.step import ModelRunnerOutput, SchedulerOutput

# Steps in a row that may fail (each failing only its own requests) before the engine is declared
# dead: one failure is a request's or a transient fault; a run of them is the engine's own.
MAX_FAILED_STEPS = 3


def make_executor(config: EngineConfig) -> Executor:
    """The simulated executor for a simulated engine (EngineConfig.simulation); else the Ray
    executor for more than one rank or when asked for ("ray"), else in-process. Each is imported
    only where chosen: a simulated engine's process never imports torch or the model's code."""
    if config.simulation is not None:
        from engine.executor.simulated import SimulatedExecutor  # noqa: PLC0415

        return SimulatedExecutor(config)
    from engine.executor.executor import InProcessExecutor, RayExecutor  # noqa: PLC0415

    pc = config.parallel_config
    if pc.world_size == 1 and pc.distributed_executor_backend != "ray":
        return InProcessExecutor(config)
    return RayExecutor(config)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mc = config.model_config
        tracing.configure(config.otlp_traces_endpoint)
        self.tokenizer = engine_tokenizer(mc.model, mc.gguf_file, mc.hf_config)
        self._adapters: set[tuple] = set()        # adapters read_adapter accepted (their cache keys)
        self._image_processor: ImageProcessor | None = None
        self.eos_token_ids = eos_token_ids(self.tokenizer, mc.hf_config, mc.model)
        self.executor = make_executor(config)
        if self.executor.kv_scales != config.cache_config.kv_scales:    # fp8 scales calibrated at load
            config = self.config = replace(config, cache_config=replace(config.cache_config,
                                                                        kv_scales=self.executor.kv_scales))
        self.kv_cache_manager = KVCacheManager(
            self.executor.num_blocks, config.cache_config.block_size,
            config.cache_config.enable_prefix_caching, self.executor.num_cpu_blocks, self.executor.tier_slots,
            config.kv_groups.windows)
        kvt = config.kv_transfer_config
        self.kv_connector = KVConnectorScheduler(kvt, KVLayout.from_config(config)) if kvt is not None else None
        self.kv_worker = self.executor.kv           # every rank's worker side (None without a connector)
        sc = config.scheduler_config
        self.pacer = StepPacer(sc.itl_target_s, sc.max_num_batched_tokens) if sc.itl_target_s else None
        # Pipelined, a stream's next token comes when its batch is back: a batch's time in the stages.
        self.paced: deque[tuple[StepBudget, float]] = deque()    # the batches in flight: budget, submitted at
        self.scheduler = Scheduler(sc, self.kv_cache_manager, self.kv_connector,
                                   kvt.load_failure_policy if kvt else "recompute",
                                   config.parallel_config.max_concurrent_batches,
                                   images_attend_both_ways(config.model_config.hf_config), self.pacer)
        self.in_flight: deque[SchedulerOutput] = deque()   # batches submitted, oldest first
        self.proposer = make_proposer(config, self.executor.num_blocks)
        self.spec_stats = SpecDecodeStats()
        self.last_step_idle = False         # the last step scheduled nothing (only transfers pending)
        self.num_failed_steps = 0           # steps in a row that raised (ModelRunnerOutput.step_error)
        self.output = OutputProcessor(self.tokenizer, self.scheduler.finish_requests, config.stream_interval)
        self.telemetry = self.output.telemetry = RequestTelemetry(mc.max_model_len, config.kv_block_bytes())
        self.num_prompt_tokens = 0
        # Its KV transfers (P/D, peer prefixes), from a request's parameters to its blocks' release.
        self.transfers = (KVTransfers(self.kv_connector, self.executor, self.kv_cache_manager, self.scheduler,
                                      self.output) if self.kv_connector is not None else None)
        # A trainer's weight updates, their versions, pause and resume (engine/weight_updates.py).
        self.weights = WeightUpdates(self)

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
        NewRequest); only this engine's own limits are checked. (A prompt with images comes as a
        NewRequest to `enqueue`: LLM.generate and AsyncLLMEngine.submit prepare them.)"""
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

    def encode_images(self, images: list[Any]) -> list[Any]:
        """The embeddings [placeholder tokens, hidden] of each image (records/multimodal.py), on the
        CPU: an encode replica's work, read by the replica that prefills the prompt."""
        if not is_vision_language(self.config.model_config.hf_config):
            raise ValueError("images: this model takes no images (a vision-language model does)")
        return next(r for r in self.executor.collective_rpc("encode_images", list(images)) if r is not None)

    def image_processor(self) -> ImageProcessor:
        """The model's image processor (loaded when the first image comes); ValueError for a model
        that takes no images."""
        if self._image_processor is None:
            mc = self.config.model_config
            if not is_vision_language(mc.hf_config):
                raise ValueError("multi_modal_data: this model takes no images (a vision-language model does: "
                                 "LlavaForConditionalGeneration)")
            self._image_processor = ImageProcessor(mc.model, mc.hf_config.vision_language, mc.media)
        return self._image_processor

    def enqueue(self, new: NewRequest) -> None:
        """Queue a request that `validate` passed (AsyncLLMEngine.submit validates off the engine's
        loop, and compiles its constraint on a thread of its own). Raises ValueError for what only
        the engine's state can refuse (an id in use, a continuation or transfer it cannot take)."""
        request_id, params, prompt_token_ids = new.request_id, new.params, new.prompt_token_ids
        if params.use_beam_search:
            raise ValueError("use_beam_search: beam search runs over the engine (LLM.generate, the server's "
                             "completions and chat: engine/beam_search.py), not as one engine request")
        if new.images and not is_vision_language(self.config.model_config.hf_config):
            raise ValueError("images: this model takes no images (a vision-language model does)")
        budget = self.config.scheduler_config.max_num_batched_tokens
        if self.scheduler.encoder.whole_images and any(image.length > budget for image in new.images):
            longest = max(image.length for image in new.images)
            raise ValueError(f"max_num_batched_tokens ({budget}) must hold an image's {longest} tokens: this "
                             f"model's images are computed in one step (they attend both ways)")
        if request_id in self.output.states or (self.transfers is not None and self.transfers.holds(request_id)):
            raise ValueError(f"request_id {request_id!r} is already in use")
        mc = self.config.model_config
        max_tokens = params.max_tokens or (mc.max_model_len - len(prompt_token_ids))
        ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        bs = self.config.cache_config.block_size
        leader = Request(ids[0], prompt_token_ids, params, self.eos_token_ids, bs, max_tokens, new.arrival,
                         parent_id=request_id, index=0, block_hashes=new.block_hashes, images=new.images)
        leader.fork_children = [leader.fork(rid, i) for i, rid in enumerate(ids[1:], start=1)]
        if new.continuation is not None:
            self._check_continuation(params, max_tokens, new.continuation, bool(new.kv_transfer_params))
            leader.resume(new.continuation.token_ids)
        if new.kv_transfer_params:
            if self.transfers is None:
                raise ValueError("kv_transfer_params need a KV connector: create this engine with "
                                 "kv_connector='nixl' or 'torch_dist'")
            self.transfers.attach(leader, new.kv_transfer_params)
        children = [leader, *leader.fork_children]
        for child in children:
            self.weights.start(child)
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

    def validate(self, prompt_token_ids: list[int], params: SamplingParams, compile_constraint: bool = True,
                 prepared: bool = False) -> None:
        """Raise ValueError naming the field if this request cannot run on this engine (its output
        constraint compiled too, unless `compile_constraint` is False: the caller does that; its
        bad_words tokenized).
        `prepared`: an ingress checked it against the model already (records/request.py:
        NewRequest.block_hashes); only this engine's limits are checked."""
        mc = self.config.model_config
        max_num_seqs = None if params.use_beam_search else self.config.scheduler_config.max_num_seqs
        if prepared:
            check_limits(len(prompt_token_ids), params, mc.max_model_len, max_num_seqs)
        else:
            tokenize_bad_words(params, self.tokenizer)         # (a prepared request's came tokenized)
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
        compiler_for(mc.model, mc.gguf_file, mc.vocab_size, hf_tokenizer(self.tokenizer)).compile(spec)

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Abort user requests (all their children); their blocks are freed at once."""
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            if self.transfers is not None:
                self.transfers.abort(rid)            # a lease of that id: freed at the next step
            child_ids = self.output.remove(rid)
            if child_ids:
                self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)
        if self.proposer is not None:
            self.proposer.retain(self.scheduler.requests)

    # --- the loop ---------------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        """True while a request is in flight or KV transfers (pulls, leases) are pending."""
        return (bool(self.output.states) or self.scheduler.has_unfinished_requests() or bool(self.in_flight)
                or bool(self.weights.held)
                or (self.kv_worker is not None and self.kv_worker.has_pending()))

    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns an output for every request that advanced or finished."""
        outputs = self.weights.take_held()       # pipelined batches a pause or an update finished
        if not self.weights.stepping:            # paused at this step boundary
            self.last_step_idle = True
            return outputs
        if self.scheduler.max_concurrent_batches > 1:
            return outputs + self._step_pipelined()
        outputs += self.transfers.poll() if self.transfers is not None else []
        start = clock.monotonic()
        sched = self.scheduler.schedule()
        if self.transfers is not None:
            self.transfers.dispatch()
        self.last_step_idle = sched.is_empty
        if sched.is_empty:
            return outputs
        outputs += self._apply(sched, self.executor.execute_model(sched))
        self._pace(self.scheduler.budget, clock.monotonic() - start)
        return outputs

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
            self.paced.append((self.scheduler.budget, clock.monotonic()))
        self.last_step_idle = not self.in_flight
        if not self.in_flight:
            return []
        return self._collect()

    def drain(self) -> list[RequestOutput]:
        """Finish the batches still in the pipeline stages (a pipelined engine), oldest first."""
        outputs: list[RequestOutput] = []
        while self.in_flight:
            outputs += self._collect()
        return outputs

    def _collect(self) -> list[RequestOutput]:
        """The oldest pipelined batch's outputs; its time in the stages paces the next batches."""
        sched, (budget, submitted) = self.in_flight.popleft(), self.paced.popleft()
        outputs = self._apply(sched, self.executor.collect())
        self._pace(budget, clock.monotonic() - submitted)
        return outputs

    def _pace(self, budget: StepBudget, seconds: float) -> None:
        """A step's time, for the pacer (a step that carried decodes: its prompt tokens' cap)."""
        if self.pacer is not None and budget.prompt_cap is not None:
            self.pacer.observe(seconds, budget.prompt_taken, budget.prompt_taken >= budget.prompt_cap)

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
        if self.transfers is not None:
            self.transfers.start_leases()
        outputs = self.output.advance(updated)
        if self.proposer is not None:
            self._propose()
        return outputs

    def _propose(self) -> None:
        """Ask the proposer for the next step's tokens of running decodes that have none."""
        spec = self.config.speculative_config
        assert self.proposer is not None and spec is not None
        k, max_len = spec.num_speculative_tokens, self.config.scheduler_config.max_model_len
        self.proposer.retain(self.scheduler.requests)
        # A batch this large is compute-bound: verifying k tokens a request costs more than the
        # accepted ones return (vLLM's disable_by_batch_size).
        if spec.disable_by_batch_size is not None and len(self.scheduler.running) >= spec.disable_by_batch_size:
            return
        busy = self.scheduler.in_flight           # their next tokens are not back yet
        wanted = [(r, num) for r in self.scheduler.running
                  if not r.spec_token_ids and r.request_id not in busy
                  and (num := max_proposals(r, k, max_len)) > 0]
        if wanted:
            requests, nums = zip(*wanted)
            for request, proposal in zip(requests, self.proposer.propose(list(requests), list(nums))):
                request.spec_token_ids = proposal

    def lease_prefix(self, block_hashes: list[bytes], adapter: str = "") -> dict[str, Any] | None:
        """A peer's prefix pull (KVTransfers.lease_prefix); None without a connector."""
        return self.transfers.lease_prefix(block_hashes, adapter) if self.transfers is not None else None

    def renew_lease(self, request_id: str, seconds: float) -> bool:
        """Keep a leased request's blocks at least `seconds` longer; False if it holds no lease."""
        return self.transfers is not None and self.transfers.renew(request_id, seconds)

    def stats(self) -> EngineStats:
        kv = self.kv_cache_manager
        tier = kv.tier
        return EngineStats(
            num_requests_running=len(self.scheduler.running),
            num_requests_waiting=len(self.scheduler.waiting),
            num_prompt_tokens_queued=sum(max(0, r.num_prompt_tokens - r.num_computed_tokens)
                                         for q in (self.scheduler.waiting, self.scheduler.running) for r in q),
            kv_cache_usage_perc=kv.usage,
            num_kv_blocks=kv.block_pool.num_blocks,
            num_free_kv_blocks=kv.num_free_blocks,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self.num_prompt_tokens,
            prompt_tokens_computed=self.scheduler.num_prompt_tokens_computed,
            generation_tokens=self.output.num_generation_tokens,
            ttft=tuple(self.output.ttft.counts),
            itl=tuple(self.output.itl.counts),
            histograms=self.telemetry.reading(),
            spec=replace(self.spec_stats) if self.proposer is not None else None,
            kv_transfer=self.transfers.stats() if self.transfers is not None else None,
            kv_tier=tier.reading(self.executor.tier_stats()) if tier is not None else None,
            moe_expert_tokens=self._moe_expert_tokens())

    def _moe_expert_tokens(self) -> tuple[tuple[int, int, int], ...]:
        """A MoE model's expert load: (rank, expert, rows run) per expert each rank holds."""
        if self.config.model_config.architecture not in MOE_ARCHITECTURES:
            return ()
        return tuple((rank, expert, n) for rank, experts in enumerate(self.executor.expert_load())
                     for expert, n in sorted(experts.items()))

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
        if self.transfers is not None:
            self.transfers.check_no_leaks()
        self.kv_cache_manager.check_no_leaks()
        if self.proposer is not None:
            self.proposer.check_no_leaks()
