"""Scheduler: iteration-level continuous batching under a token budget.

There are no prefill and decode phases: every step, each request catches its computed tokens up to
its token count, within `max_num_batched_tokens` (chunked prefill lets a long prompt take several
steps while decodes ride along). RUNNING requests go first, in order; then WAITING ones (FCFS, or by
priority), unless something was preempted this step. When blocks run out the newest (or lowest
priority) running request is preempted: by recompute (its blocks are freed and it starts over) or by
swap (its blocks are copied to the CPU pool and copied back when it resumes).

Phases of a step (`schedule`): running requests (`_schedule_running`: a decode with proposed
tokens is scheduled for 1 + k within the budget, the proposals dropped rather than preempt
anything), then waiting ones (`_schedule_waiting`): what each has already (`_cached_prefix`: its
swapped-out blocks back, its prefix-cache hits, or a KV pull from a prefill engine that parks it in
WAITING_FOR_REMOTE_KVS: engine/core/kv_loads.py) and what fits of the rest (`_start`: blocks the
offload tier holds are loaded, not recomputed). After the step (`update_from_output`) the emitted
tokens are appended one by one (each checked for stop, min/max tokens) and num_computed_tokens is
set back past rejected proposals. Static batching (the baseline): engine/core/static_batch.py.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import records.clock as clock
from engine.core.encoder_budget import EncoderBudget
from engine.core.forks import Forks
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.kv_loads import KVLoads
from engine.core.pooling import add_rows
from engine.core.static_batch import form_static_batch
from engine.core.step_budget import StepBudget, StepPacer
from records.config import SchedulerConfig
from records.request import Request, RequestStatus
from records.step import ModelRunnerOutput, ScheduledRequest, SchedulerOutput

if TYPE_CHECKING:
    from kv_transfer.base import KVConnectorScheduler


# `Scheduler._cached_prefix`'s answer for a request that starts a KV pull instead of computing.
PULLING = object()


@dataclass(slots=True)
class _Step:
    """What one `schedule()` has chosen so far (and the tokens it has left)."""
    budget: StepBudget
    num_new: dict[str, int] = field(default_factory=dict)
    drafts: dict[str, list[int]] = field(default_factory=dict)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 connector: KVConnectorScheduler | None = None, load_failure_policy: str = "recompute",
                 max_concurrent_batches: int = 1, whole_images: bool = False, pacer: StepPacer | None = None) -> None:
        """`whole_images`: the model's image tokens attend both ways (no chunk ends inside an image:
        engine/core/encoder_budget.py). `pacer`: caps the prompt tokens of steps that carry decodes."""
        self.config = config
        self.pacer = pacer
        self.budget = StepBudget(config.max_num_batched_tokens)     # the last step's
        # Pipeline stages: up to this many batches run at once (stage s on one while stage s + 1 runs
        # another). A request is in at most one of them (`in_flight` until its output is back), and each
        # batch takes at most 1/max_concurrent_batches of the running requests: decodes alternate.
        self.max_concurrent_batches = max_concurrent_batches
        self.in_flight: set[str] = set()
        self.kv = kv_cache_manager
        self.loads = KVLoads(connector, kv_cache_manager, load_failure_policy) if connector is not None else None
        self.encoder = EncoderBudget(config.max_num_encoder_input_tokens, whole_images)
        self.admitting = True           # False: waiting requests stay waiting (a pause, engine/weight_updates.py)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.forks = Forks(kv_cache_manager)            # n > 1 children waiting for their leader's prompt
        self.finished_ids: list[str] = []               # freed since the last step sent
        self.num_preemptions = 0
        self.num_prompt_tokens_computed = 0             # prompt positions run through the model here
        self.batch_ids: set[str] = set()                # static batching: the current batch
        self.tier_loading: dict[str, list[int]] = {}    # request id -> blocks its step loads from the tier
        self.preempted_ids: list[str] = []              # preempted, or a tier load failed, since the last step sent

    # --- intake -----------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request. A request with `fork_children` is an n > 1 leader (engine/core/forks.py)."""
        self.requests[request.request_id] = request
        self.requests.update((child.request_id, child) for child in request.fork_children)
        if self.forks.add(request):         # no prompt to share
            self._fork(request)
        self._enqueue(request)

    def _enqueue(self, request: Request, front: bool = False) -> None:
        if self.config.policy == "priority":
            key = (request.priority, request.arrival_time)
            i = next((i for i, r in enumerate(self.waiting) if (r.priority, r.arrival_time) > key),
                     len(self.waiting))
            self.waiting.insert(i, request)
        elif front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        """End requests (abort, stop string) wherever they are and free their blocks."""
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.status == RequestStatus.WAITING_FOR_FORK:
                self.forks.drop(rid)
            elif request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                assert self.loads is not None
                self.loads.abort(request, status)    # the pull may still write into its blocks
                self.finished_ids.append(rid)
                del self.requests[rid]
                continue
            else:
                self.waiting.remove(request)
                if request.remote_prefill is not None and self.loads is not None:
                    self.loads.drop_unstarted(request)
            self._free(request, status)

    def _free(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        if self.loads is None or not self.loads.keep_for_lease(request):
            self.kv.free(request)
        self.finished_ids.append(request.request_id)
        del self.requests[request.request_id]
        # A leader that ends before forking takes its waiting children with it (only an abort can
        # do that: the leader samples nothing before the fork).
        for child in self.forks.waiting(request):
            self.forks.drop(child.request_id)
            self._free(child, status)

    def has_unfinished_requests(self) -> bool:
        """True while any request runs, waits, pulls KV, or holds blocks under a lease."""
        return bool(self.requests or (self.loads is not None
                                      and (self.loads.aborted or self.loads.connector.leases)))

    # --- one step ---------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts, allocating their blocks (may preempt)."""
        decoding = self.pacer is not None and any(r.num_tokens_to_compute == 1 for r in self.running)
        step = _Step(StepBudget(self.config.max_num_batched_tokens, self.pacer.cap if decoding else None))
        self.budget = step.budget
        self.encoder.new_step()
        self._schedule_running(step)
        if self.admitting:
            self._schedule_waiting(step)
        assert not (step.swap_in and step.swap_out), "swap-in and swap-out never share a step"
        self.in_flight.update(step.num_new)
        tier_saves, tier_loads = self.kv.tier.take_orders() if self.kv.tier is not None else ([], [])
        out = SchedulerOutput(
            scheduled=[self._describe(self.requests[rid], n, step.drafts.get(rid, []))
                       for rid, n in step.num_new.items()],
            num_batched_tokens=sum(step.num_new.values()),
            swap_out=step.swap_out, swap_in=step.swap_in, copy_blocks=self.kv.take_pending_copies(),
            preempted_ids=self.preempted_ids + step.preempted, finished_ids=self.finished_ids,
            tier_saves=tier_saves, tier_loads=tier_loads)
        # An empty step is not sent (LLMEngine.step): its ids wait for the next one that is, or the
        # ranks would keep a finished request's generator, matcher and step state for good (and give
        # them to a later request of the same id).
        self.preempted_ids, self.finished_ids = ([], []) if not out.is_empty else (out.preempted_ids, out.finished_ids)
        return out

    def _schedule_running(self, step: _Step) -> None:
        """Running requests, in order; one that finds no blocks preempts (`_pick_victim`), itself too."""
        chunked = self.config.enable_chunked_prefill
        share = -(-len(self.running) // self.max_concurrent_batches)     # running requests per batch
        i = 0
        while i < len(self.running) and step.budget.left > 0 and len(step.num_new) < share:
            request = self.running[i]
            if request.request_id in self.in_flight:
                i += 1
                continue
            proposed, request.spec_token_ids = request.spec_token_ids, []    # consumed (or dropped)
            prompt = request.num_tokens_to_compute > 1
            n = self._fit(request, request.num_computed_tokens, min(
                request.num_tokens_to_compute + len(proposed),
                self.config.max_model_len - request.num_computed_tokens), step, prompt)
            if n <= 0 or (not chunked and n < request.num_tokens_to_compute):
                i += 1
                continue
            num_drafts = n - min(n, request.num_tokens_to_compute)
            if num_drafts and self.kv.allocate_slots(request, n) is None:
                n, num_drafts = n - num_drafts, 0    # no room for the proposals: never preempt for them
            while not num_drafts and self.kv.allocate_slots(request, n) is None:
                victim = self._pick_victim(i)
                self._preempt(victim, step.swap_out)
                step.preempted.append(victim.request_id)
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING:
                continue          # it preempted itself; the list shrank under i
            step.num_new[request.request_id] = n
            self.encoder.charge(request, request.num_computed_tokens, n)
            if num_drafts:
                step.drafts[request.request_id] = proposed[:num_drafts]
            step.budget.take(n, prompt)
            i += 1

    def _schedule_waiting(self, step: _Step) -> None:
        """Waiting requests in queue order until one does not fit, none in a step that preempted (a
        request whose adapter would be one more than max_loras is passed over, as vLLM's)."""
        static = self.config.batching == "static"
        if static:
            self.waiting, self.batch_ids = form_static_batch(self.waiting, self.requests, self.batch_ids,
                                                             self.config.max_num_seqs)
        adapters = self._running_adapters() if self.config.max_loras is not None else None
        skipped: list[Request] = []
        while self.waiting and step.budget.left > 0 and not step.preempted:
            request = self.waiting[0]
            if static and request.request_id not in self.batch_ids:
                break                       # the barrier: not before this batch has drained
            if len(self.running) + len(request.fork_children) >= self.config.max_num_seqs and self.running:
                break
            lora = request.sampling_params.lora_request
            if adapters is not None and lora is not None and lora.cache_key not in adapters:
                if len(adapters) >= self.config.max_loras:     # type: ignore[operator]
                    skipped.append(self.waiting.popleft())
                    continue
            prefix = self._cached_prefix(request, step)
            if prefix is PULLING:
                self.waiting.popleft()
                continue                    # its KV is being pulled: costs no token budget
            if prefix is None or not self._start(request, *prefix, step):
                break
            if adapters is not None and lora is not None:
                adapters.add(lora.cache_key)
        self.waiting.extendleft(reversed(skipped))        # back at the front, in their order

    def _cached_prefix(self, request: Request, step: _Step) -> tuple[list[int], int] | object | None:
        """What the request at the queue's front has already: a swapped-out request its blocks back
        (their copies go in the step), a new one its prefix-cache hits (blocks, tokens); PULLING when
        it starts a KV pull from a prefill engine instead, None when there is no room for it yet."""
        if request.status == RequestStatus.SWAPPED:
            mapping = self.kv.swap_in(request)
            if mapping is None:
                return None
            step.swap_in.extend(mapping)
            return [], 0
        if request.num_computed_tokens:
            return [], 0
        hits, num_hit = self.kv.get_computed_blocks(request)
        if request.remote_prefill is not None and self.loads is not None:
            pulling = self.loads.start(request, hits, num_hit)
            if pulling is None:
                return None                 # no room for its blocks yet
            if pulling:
                return PULLING
        return hits, num_hit

    def _start(self, request: Request, hits: list[int], num_hit: int, step: _Step) -> bool:
        """Admit the request at the queue's front for what fits of its tokens past `num_hit`
        (blocks after the pool's hits that the offload tier holds are loaded, not recomputed, when
        they fit; else computed); False, admitting nothing, when none fit (a swapped-in request
        runs next step then)."""
        chunked = self.config.enable_chunked_prefill
        tier_hashes, tier_found = [], []
        if request.num_computed_tokens == 0 and request.status != RequestStatus.SWAPPED:
            tier_hashes, tier_found = self.kv.tier_hits(request, num_hit // self.kv.block_size, self.kv.num_free_blocks)
        for tier in ((tier_hashes, tier_found), ([], [])) if tier_found else (([], []),):
            num_tier = len(tier[1]) // self.kv.num_groups * self.kv.block_size
            start = request.num_computed_tokens + num_hit + num_tier
            n = self._fit(request, start, request.num_tokens_to_compute - num_hit - num_tier, step, True)
            fits = n > 0 and (chunked or n == request.num_tokens_to_compute - num_hit - num_tier)
            # Blocks loaded from the tier are cached once their step is back (the load may fail).
            if fits and self.kv.allocate_slots(request, num_tier + n, hits, cache=not tier[1]) is not None:
                tier_hashes, tier_found = tier
                break
        else:
            if request.status == RequestStatus.SWAPPED:
                self._admit(request)        # swapped in but no room to compute yet: run it next step
            return False
        if tier_found:
            targets = self.kv.block_ids(request.request_id)[len(hits):len(hits) + len(tier_found)]
            self.kv.tier.load(tier_hashes, tier_found, targets)
            self.tier_loading[request.request_id] = targets
            num_hit += num_tier
        if request.num_computed_tokens == 0:
            self.kv.record_prefix_lookup(request.num_tokens, num_hit)
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_hit
        request.num_computed_tokens += num_hit
        self._admit(request)
        step.num_new[request.request_id] = n
        self.encoder.charge(request, request.num_computed_tokens, n)
        step.budget.take(n, True)
        return True

    def _fit(self, request: Request, start: int, want: int, step: _Step, prompt: bool) -> int:
        """What of `want` tokens from `start` the request takes in this step (StepBudget.room)."""
        n = self.encoder.fit(request, start, min(want, step.budget.room(prompt)))
        if n <= 0 and step.budget.may_pass_cap(prompt):
            n = self.encoder.fit(request, start, min(want, step.budget.left))
        return n

    def finish_loads(self, loaded: list[str], failed: list[tuple[str, str]]) -> list[Request]:
        """Apply finished pulls (KVLoads.finish): loaded requests, and failed ones that start over,
        rejoin the queue's front; returns the requests that ended with an error."""
        assert self.loads is not None
        requeue, errored = self.loads.finish(loaded, failed)
        for request in requeue:
            self._enqueue(request, front=True)
        for request in errored:
            self._free(request, RequestStatus.FINISHED_ERROR)
        return errored

    def take_new_leased(self) -> list[Request]:
        return self.loads.take_new_leased() if self.loads is not None else []

    def _running_adapters(self) -> set[tuple]:
        """The adapters of the running requests: at most max_loras run at once, so that every
        step's adapters have a slot on the model (engine/worker/lora_slots.py)."""
        return {r.sampling_params.lora_request.cache_key for r in self.running
                if r.sampling_params.lora_request is not None}

    def _admit(self, request: Request) -> None:
        self.waiting.popleft()
        request.status = RequestStatus.RUNNING
        if request.scheduled_time is None:
            request.scheduled_time = clock.monotonic()
        self.running.append(request)

    def _pick_victim(self, current: int) -> Request:
        """Newest running request (FCFS) or the lowest priority one, among those not yet scheduled
        this step (index >= current) and not in a batch still running (its blocks are being
        written). The request at `current` is always a candidate."""
        candidates = [r for r in self.running[current:] if r.request_id not in self.in_flight]
        if self.config.policy == "priority":
            return max(candidates, key=lambda r: (r.priority, r.arrival_time))
        return candidates[-1]

    def _preempt(self, request: Request, swap_out: list[tuple[int, int]]) -> None:
        self.running.remove(request)
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        mapping = self.kv.swap_out(request) if self.config.preemption_mode == "swap" else None
        if mapping is None:
            self._start_over(request)
            return
        swap_out.extend(mapping)
        request.status = RequestStatus.SWAPPED
        self._enqueue(request, front=True)

    def _start_over(self, request: Request) -> None:
        """Free a request's blocks and queue it first, to compute everything again."""
        self.kv.free(request)
        request.compute_again()
        request.status = RequestStatus.PREEMPTED
        self._enqueue(request, front=True)

    def _describe(self, request: Request, n: int, spec_token_ids: list[int]) -> ScheduledRequest:
        scheduled = request.describe(n, spec_token_ids, self.kv.block_ids(request.request_id))
        end = scheduled.start + len(scheduled.token_ids) - len(spec_token_ids)
        self.num_prompt_tokens_computed += max(0, min(end, request.num_prompt_tokens) - scheduled.start)
        return scheduled

    # --- after the step ---------------------------------------------------------------------------
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[Request]:
        """Advance computed tokens, append sampled tokens, stop finished requests (freeing their
        blocks) and fork n > 1 leaders whose prompt is done. Returns the requests with news."""
        updated: list[Request] = []
        self.in_flight.difference_update(s.request_id for s in scheduler_output.scheduled)
        failed_loads: set[int] = set()
        if runner_output.tier_failed and self.kv.tier is not None:
            failed_loads = self.kv.tier.forget_failed(runner_output.tier_failed)
        for sched in scheduler_output.scheduled:
            loaded = self.tier_loading.pop(sched.request_id, None)
            request = self.requests.get(sched.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue        # aborted during the step
            reason = runner_output.failed.get(request.request_id)
            if reason is not None:
                updated.extend(self._fail(request, reason))
                continue
            if loaded is not None and failed_loads.intersection(loaded):
                self.restart(request)
                continue
            request.num_computed_tokens += len(sched.token_ids)
            if loaded is not None:       # its tier blocks hold their KV: cache them and the step's
                self.kv.cache_full_blocks(request, request.num_computed_tokens)
            request.add_prompt_logprobs(runner_output.prompt_logprobs.get(request.request_id))
            if request.sampling_params.pooling is not None:     # an embedding: its rows, no token
                if add_rows(request, runner_output.pooled.get(request.request_id)):
                    self.running.remove(request)
                    self._free(request, RequestStatus.FINISHED_STOPPED)
                    updated.append(request)
                continue
            sampled = runner_output.sampled.get(request.request_id)
            emitted = [sampled] if sampled is not None else runner_output.spec_sampled.get(request.request_id, [])
            if sched.spec_token_ids:
                # Roll back past the rejected proposals: their KV slots lie beyond the computed
                # length (never read) and are rewritten when those positions are computed again.
                request.num_computed_tokens -= len(sched.spec_token_ids) + 1 - len(emitted)
            for token in emitted:
                request.append_sampled(token)
                self._check_stop(request, token.token_id)
                if request.is_finished:
                    break            # the rest of an accepted run comes after the stop
            if emitted:
                updated.append(request)
            if self.forks.due(request):
                self._fork(request)
        return updated

    def _fail(self, request: Request, reason: str) -> list[Request]:
        """End a running request that its step could not serve, with the n > 1 children still
        waiting for its prompt; returns them all. Its blocks past the computed tokens may have been
        registered in the prefix cache before their KV was written (blocks are cached as they are
        allocated): they leave the cache before they are freed, so no later request hits KV that
        was never computed."""
        ended = [request, *self.forks.waiting(request)]
        for r in ended:
            r.stop_reason = reason
        self.kv.uncache_from(request, request.num_computed_tokens)
        self.running.remove(request)
        self._free(request, RequestStatus.FINISHED_ERROR)
        return ended

    def restart(self, request: Request) -> None:
        """A running request whose computed KV cannot stand (blocks from the offload tier that did not
        load: its step's output is void; a weight update before its first token): free its blocks
        and compute its prompt again (failed tier copies are forgotten: its next lookup misses them)."""
        self.running.remove(request)
        request.num_cached_tokens = 0
        request.spec_token_ids = []
        self.preempted_ids.append(request.request_id)
        self._start_over(request)

    def _check_stop(self, request: Request, token_id: int) -> None:
        status = request.stop_status(token_id, self.config.max_model_len)
        if status is not None:
            self.running.remove(request)
            self._free(request, status)

    def _fork(self, leader: Request) -> None:
        """The leader's waiting children take its prompt blocks and run beside it, or queue."""
        for child in self.forks.fork(leader):
            if child.status == RequestStatus.RUNNING:
                self.running.append(child)
            else:
                self._enqueue(child)
