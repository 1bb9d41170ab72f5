"""The engine's output side (vLLM's OutputProcessor): each user request's n choices, their
incremental detokenization and stop strings, logprob conversion, and the RequestOutputs, cumulative
or as deltas (`SamplingParams.output_kind`). The engine hands it the requests a step advanced; it
tells the scheduler (through `finish_requests`) when a stop string ends a choice or a request
fails, so that its blocks are freed.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import records.clock as clock
from engine.text.tokenizer import IncrementalDetokenizer
from records.histogram import LatencyHistogram
from records.outputs import CompletionOutput, Logprob, RequestOutput
from records.request import FINISH_REASONS, Continuation, Request, RequestStatus
from records.sampling_params import SamplingParams


@dataclass(slots=True)
class ChoiceState:
    """One choice (child request) of a user request as the output side sees it."""
    request: Request
    detokenizer: IncrementalDetokenizer | None
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_seen: int = 0            # output tokens detokenized and checked for stop strings so far
    # What earlier outputs carried (output_kind "delta"): tokens (and their logprobs), text chars,
    # and whether the finish went out.
    sent_tokens: int = 0
    sent_chars: int = 0
    finish_sent: bool = False
    # Logprobs converted so far (the request's lists only grow: convert each entry once).
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cumulative_logprob: float = 0.0

    def visible_len(self) -> int:
        """How much of the text to show now. While running with stop strings, the tail that could
        be the start of a stop string is held back: the stop check may cut it, and streamed text
        cannot be taken back."""
        params = self.request.sampling_params
        if self.finish_reason is not None or not params.stop or params.include_stop_str_in_output:
            return len(self.text)
        return max(0, len(self.text) - (max(len(s) for s in params.stop) - 1))

    def completion(self, index: int, logprobs: bool, delta: bool) -> CompletionOutput | None:
        """This choice's output: all of it, or (`delta`) what is new since the last delta, None
        when nothing is (O(new tokens): nothing is copied that went out before)."""
        r = self.request
        tokens, end = r.output_token_ids, self.visible_len()
        first, first_char = (self.sent_tokens, self.sent_chars) if delta else (0, 0)
        if delta:
            if len(tokens) == first and end == first_char and (self.finish_reason is None or self.finish_sent):
                return None
            self.sent_tokens, self.sent_chars = len(tokens), end
            self.finish_sent = self.finish_reason is not None
        return CompletionOutput(
            index=index, text=self.text[first_char:end], token_ids=tokens[first:],
            cumulative_logprob=self.cumulative_logprob if logprobs else None,
            logprobs=self.logprobs[first:] if logprobs else None,
            finish_reason=self.finish_reason, stop_reason=self.stop_reason,
            error=self.request.error if self.finish_reason == "error" else None,
            weight_versions=r.weight_versions)       # (replaced on an update, never changed in place)


@dataclass(slots=True)
class RequestState:
    """The user's request as the output side sees it: n children, their text, timing."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[ChoiceState]
    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    prompt_logprobs: list[dict[int, Logprob] | None] = field(default_factory=list)
    kv_transfer_params: dict[str, Any] | None = None    # set when its blocks are leased
    trace_context: dict[str, str] | None = None          # W3C carrier: its spans' parent (engine/tracing.py)
    detokenize_s: float | None = None                    # time spent detokenizing (traced requests only)
    outputs_sent: int = 0

    @property
    def finished(self) -> bool:
        for c in self.children:          # a loop, not all(<generator>): asked several times per step
            if c.finish_reason is None:
                return False
        return True


class OutputProcessor:
    """Request states by user request id (and by child request id), and what a step's updated
    requests turn into."""

    def __init__(self, tokenizer: Any, finish_requests: Callable[[list[str], RequestStatus], None],
                 stream_interval: int = 1) -> None:
        """`stream_interval` (vLLM's): a delta request's outputs wait until a choice has that many new
        tokens (its first output and its finish go out at once)."""
        self.tokenizer = tokenizer
        self.stream_interval = stream_interval
        self.finish_requests = finish_requests      # the scheduler's: ends choices, frees their blocks
        self.states: dict[str, RequestState] = {}
        self.child_to_state: dict[str, tuple[RequestState, int]] = {}
        self.num_generation_tokens = 0
        # Since the engine started: arrival to first token, and between a request's steps that gave it
        # tokens (per request, not per token: a speculative step's tokens come together), read by the
        # manager's planner through the engine's stats (records/histogram.py).
        self.ttft = LatencyHistogram()
        self.itl = LatencyHistogram()
        # engine/telemetry.py's RequestTelemetry, told of every request that ends (set by the engine)
        self.telemetry: Any = None

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
            children: list[Request], arrival: float, continuation: Continuation | None = None,
            trace_context: dict[str, str] | None = None) -> None:
        state = RequestState(request_id, prompt, prompt_token_ids, params,
                             [ChoiceState(r, self._detokenizer(r)) for r in children], arrival,
                             trace_context=trace_context, detokenize_s=None if trace_context is None else 0.0)
        if continuation is not None:
            self._resume(state.children[0], continuation)
        self.states[request_id] = state
        for i, r in enumerate(children):
            self.child_to_state[r.request_id] = (state, i)

    def remove(self, request_id: str) -> list[str]:
        """Forget a user request (aborted); its children's request ids (empty if unknown)."""
        state = self.states.get(request_id)
        if state is None:
            return []
        self.forget(state)
        return [c.request.request_id for c in state.children]

    def set_transfer_params(self, child_id: str, params: dict[str, Any]) -> None:
        entry = self.child_to_state.get(child_id)
        if entry is not None:
            entry[0].kv_transfer_params = params

    def advance(self, updated: list[Request]) -> list[RequestOutput]:
        """The outputs of a step's updated requests (final_only requests only once finished)."""
        now = clock.monotonic()
        touched: dict[str, RequestState] = {}
        for request in updated:
            entry = self.child_to_state.get(request.request_id)
            if entry is None:
                continue
            state, i = entry
            if state.first_token_time is None:
                state.first_token_time = now
                self.ttft.observe(now - state.arrival_time)
            elif state.request_id not in touched:
                self.itl.observe(now - state.last_token_time)
            state.last_token_time = now
            try:
                if state.detokenize_s is None:
                    self.num_generation_tokens += self.process_tokens(state.children[i])
                else:
                    began = time.perf_counter()
                    self.num_generation_tokens += self.process_tokens(state.children[i])
                    state.detokenize_s += time.perf_counter() - began
            except Exception as e:  # noqa: BLE001 - e.g. its detokenization: this request only
                self.fail(state, f"processing its output failed: {e!r}")
            touched[state.request_id] = state
        outputs: list[RequestOutput] = []
        for state in touched.values():
            if not state.finished and (state.params.output_kind == "final_only" or self._held(state)):
                continue
            state.outputs_sent += 1
            try:
                outputs.append(self.make_output(state))
            except Exception as e:  # noqa: BLE001
                self.fail(state, f"building its output failed: {e!r}")
                outputs.append(self.make_output(state, plain=True))
            if state.finished:
                state.metrics["finished_time"] = now
                self.forget(state)
        return outputs

    def _held(self, state: RequestState) -> bool:
        """Whether a running delta request's output waits for more tokens (stream_interval)."""
        if self.stream_interval == 1 or state.params.output_kind != "delta" or not state.outputs_sent:
            return False
        for c in state.children:
            if (c.finish_reason is not None and not c.finish_sent) \
                    or len(c.request.output_token_ids) - c.sent_tokens >= self.stream_interval:
                return False
        return True

    def finish_loaded(self, request: Request) -> RequestOutput | None:
        """The final output of a request that ended while its KV was being pulled (failed pull)."""
        entry = self.child_to_state.get(request.request_id)
        if entry is None:
            return None
        state, i = entry
        state.children[i].finish_reason = FINISH_REASONS[request.status]
        state.children[i].stop_reason = request.stop_reason
        output = self.make_output(state)
        self.forget(state)
        return output

    @staticmethod
    def _resume(child: ChoiceState, continuation: Continuation) -> None:
        """A continued request (its Request resumed already): its detokenizer replays the tokens
        the client has, one at a time as they were first produced (so the text is the same), and
        nothing before `num_chars` of that text or before those tokens goes out again."""
        if child.detokenizer is not None:
            child.text = "".join(child.detokenizer.update([t]) for t in continuation.token_ids)
        k = len(continuation.token_ids)
        child.num_seen = child.sent_tokens = k
        child.sent_chars = min(continuation.num_chars, len(child.text))
        if child.request.sampling_params.logprobs is not None:
            child.logprobs = [{} for _ in range(k)]     # sent by the replica that produced them

    def _detokenizer(self, request: Request) -> IncrementalDetokenizer | None:
        if self.tokenizer is None or not request.sampling_params.detokenize:
            return None
        params = request.sampling_params
        return IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params.skip_special_tokens,
                                      params.spaces_between_special_tokens)

    def process_tokens(self, child: ChoiceState) -> int:
        """Detokenize the child's new output tokens one at a time (a speculative step adds several),
        checking stop strings after each; a stop drops the tokens after it. Returns how many new
        tokens the output keeps."""
        request = child.request
        params = request.sampling_params
        num_before = child.num_seen
        for token_id in request.output_token_ids[num_before:]:
            child.num_seen += 1
            if child.detokenizer is None:
                continue
            delta = child.detokenizer.update([token_id])
            if delta:
                child.text += delta
                if (params.stop and child.num_seen >= params.min_tokens
                        and self._check_stop_strings(child, len(delta))):
                    request.truncate_output(child.num_seen)
                    break
        if request.is_finished and child.finish_reason is None:
            child.finish_reason = FINISH_REASONS[request.status]
            child.stop_reason = request.stop_reason
        return child.num_seen - num_before

    def _check_stop_strings(self, child: ChoiceState, delta_len: int) -> bool:
        """True (and the child finished, its text cut) if its text now contains a stop string."""
        params = child.request.sampling_params
        longest = max(len(s) for s in params.stop)
        search_from = max(0, len(child.text) - delta_len - longest + 1)
        for stop in params.stop:
            at = child.text.find(stop, search_from)
            if at == -1:
                continue
            end = at + len(stop) if params.include_stop_str_in_output else at
            child.text = child.text[:end]
            child.finish_reason, child.stop_reason = "stop", stop
            if not child.request.is_finished:
                self.finish_requests([child.request.request_id], RequestStatus.FINISHED_STOPPED)
            return True
        return False

    def fail(self, state: RequestState, reason: str) -> None:
        """End every unfinished choice of a request with an error (its blocks are freed)."""
        running = [c.request.request_id for c in state.children if not c.request.is_finished]
        self.finish_requests(running, RequestStatus.FINISHED_ERROR)
        for child in state.children:
            if child.finish_reason is None or child.request.request_id in running:
                child.finish_reason, child.stop_reason = "error", reason

    def abort_all(self) -> list[RequestOutput]:
        """End every request with finish reason "abort", keeping what it generated (pause "abort":
        engine/weight_updates.py): their final outputs; their blocks are freed."""
        outputs = []
        for state in list(self.states.values()):
            running = [c.request.request_id for c in state.children if not c.request.is_finished]
            self.finish_requests(running, RequestStatus.FINISHED_ABORTED)
            for child in state.children:
                if child.finish_reason is None:
                    child.finish_reason = "abort"
            outputs.append(self.make_output(state))
            self.forget(state)
        return outputs

    def make_output(self, state: RequestState, plain: bool = False) -> RequestOutput:
        """The request's output: cumulative, or only what is new for output_kind "delta" (prompt
        logprobs too: those computed since the last output, as vLLM's DELTA outputs send them);
        `plain` leaves out what needs the tokenizer (logprobs, prompt logprobs): the output of a
        request whose conversion failed."""
        completions = []
        delta = state.params.output_kind == "delta"
        for i, child in enumerate(state.children):
            wants_logprobs = child.request.sampling_params.logprobs is not None and not plain
            if wants_logprobs:
                self._extend_logprobs(child)
            completion = child.completion(i, wants_logprobs, delta)
            if completion is not None:
                completions.append(completion)
        leader = state.children[0].request
        prompt_lps = None
        if state.params.prompt_logprobs is not None and not plain:
            sent = len(state.prompt_logprobs)
            for d in leader.prompt_logprobs[sent:]:
                state.prompt_logprobs.append(None if d is None else self._to_logprobs(d, None))
            prompt_lps = state.prompt_logprobs[sent:] if delta else list(state.prompt_logprobs)
        return RequestOutput(
            request_id=state.request_id, prompt=state.prompt, prompt_token_ids=state.prompt_token_ids,
            outputs=completions, finished=state.finished, prompt_logprobs=prompt_lps,
            num_cached_tokens=leader.num_cached_tokens, kv_transfer_params=state.kv_transfer_params,
            embedding=leader.embedding,
            weight_version=leader.weight_versions[-1][1] if leader.weight_versions else None,
            metrics={"arrival_time": state.arrival_time, "first_token_time": state.first_token_time or 0.0,
                     **state.metrics})

    def _extend_logprobs(self, child: ChoiceState) -> None:
        """Convert the logprob entries added since the last output (each is decoded once)."""
        r = child.request
        num = min(len(r.logprobs), len(r.output_token_ids), len(r.logprob_ranks))
        for j in range(len(child.logprobs), num):
            token_id = r.output_token_ids[j]
            entry = self._to_logprobs(r.logprobs[j], (token_id, r.logprob_ranks[j]))
            child.logprobs.append(entry)
            child.cumulative_logprob += entry[token_id].logprob

    def _to_logprobs(self, entry: dict[int, float], chosen: tuple[int, int] | None) -> dict[int, Logprob]:
        ranked = sorted(entry.items(), key=lambda kv: -kv[1])
        out = {}
        for rank, (tid, lp) in enumerate(ranked, start=1):
            if chosen is not None and tid == chosen[0]:
                rank = chosen[1]
            text = self.tokenizer.decode([tid]) if self.tokenizer is not None else None
            out[tid] = Logprob(lp, rank, text)
        return out

    def forget(self, state: RequestState) -> None:
        if self.telemetry is not None and self.states.get(state.request_id) is state:
            self.telemetry.finished(state, clock.monotonic())
        self.states.pop(state.request_id, None)
        for child in state.children:
            self.child_to_state.pop(child.request.request_id, None)
