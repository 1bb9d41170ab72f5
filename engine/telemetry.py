"""RequestTelemetry: what an engine records about each request when it ends.

- The per-request histograms at vLLM's names and buckets (records/histogram.py: `engine_histograms`):
  queue time (arrival to first scheduled), prefill time (first scheduled to first token, a KV pull
  included), decode time (first to last token), inference time (first scheduled to last token),
  time per output token, prompt and generation tokens, `n`, `max_tokens`; and pdserve's own: the
  KV pull's seconds and bytes. Each step's scheduled tokens go to `iteration_tokens_total`. The
  engine's stats carry the readings (`histograms`); the ingress exports them per replica.
- When the request came with a trace context and this process traces (engine/tracing.py), its
  spans, recorded at the times they happened: `pdserve.engine` (this replica's hop: arrival to
  end) and under it `pdserve.queue`, `pdserve.kv_pull` (blocks, bytes, its error),
  `pdserve.prefill`, `pdserve.decode` and `pdserve.detokenize` (first to last token processed;
  the time spent detokenizing in its `pdserve.busy_s`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import engine.tracing as tracing
from records.histogram import Histogram, engine_histograms

if TYPE_CHECKING:
    from engine.output_processor import RequestState


class RequestTelemetry:
    def __init__(self, max_model_len: int, block_bytes: int) -> None:
        """block_bytes: one KV block's bytes over every layer and rank (a pull's bytes)."""
        self.histograms = {name: Histogram(b) for name, b in engine_histograms(max_model_len).items()}
        self.block_bytes = block_bytes
        # Set by whoever runs the engine (the replica: its id, pool and node), on every span.
        self.attributes: dict[str, Any] = {}

    def step(self, num_tokens: int) -> None:
        self.histograms["iteration_tokens_total"].observe(num_tokens)

    def reading(self) -> dict[str, tuple[list[int], float]]:
        """Every histogram's counts per bucket and sum, for the engine's stats."""
        return {name: h.reading() for name, h in self.histograms.items()}

    def finished(self, state: RequestState, now: float) -> None:
        """A request ended (finished, failed or aborted): observe it, and record its spans."""
        leader = state.children[0].request
        h = self.histograms
        sched, first, last = leader.scheduled_time, state.first_token_time, state.last_token_time
        generated = sum(len(c.request.output_token_ids) for c in state.children)
        if sched is not None:
            h["request_queue_time_seconds"].observe(sched - state.arrival_time)
        if sched is not None and first is not None:
            h["request_prefill_time_seconds"].observe(first - sched)
            h["request_inference_time_seconds"].observe(last - sched)
        if first is not None:
            h["request_decode_time_seconds"].observe(last - first)
            if generated > 1:
                h["request_time_per_output_token_seconds"].observe((last - first) / (generated - 1))
        h["request_prompt_tokens"].observe(len(state.prompt_token_ids))
        h["request_generation_tokens"].observe(generated)
        h["request_params_n"].observe(state.params.n)
        h["request_params_max_tokens"].observe(leader.max_tokens)
        if leader.pull_start is not None and leader.pull_end is not None and leader.pull_error is None:
            h["kv_pull_seconds"].observe(leader.pull_end - leader.pull_start)
            h["kv_pull_bytes"].observe(leader.pull_blocks * self.block_bytes)
        if state.trace_context is not None and tracing.enabled():
            self._spans(state, now, generated)

    def _spans(self, state: RequestState, now: float, generated: int) -> None:
        leader = state.children[0].request
        reasons = [c.finish_reason for c in state.children]
        reason = ",".join(str(r) for r in reasons) if all(reasons) else "abort"
        attrs = {**self.attributes, "gen_ai.request.id": state.request_id,
                 "gen_ai.usage.input_tokens": len(state.prompt_token_ids),
                 "gen_ai.usage.output_tokens": generated, "gen_ai.response.finish_reasons": reason,
                 "gen_ai.request.max_tokens": leader.max_tokens, "gen_ai.request.n": state.params.n,
                 "pdserve.cached_tokens": leader.num_cached_tokens,
                 "pdserve.preemptions": leader.num_preemptions,
                 "pdserve.kv_role": "prefill_for_remote_decode" if leader.remote_decode else
                                    "decode_after_pull" if leader.pull_start is not None else "local"}
        if state.params.lora_request is not None:
            attrs["pdserve.adapter"] = state.params.adapter_name
        error = leader.error and f"{type(leader.error).__name__}: {leader.error}"
        hop = tracing.start_span("pdserve.engine", state.trace_context, state.arrival_time, attrs, kind="SERVER")
        sched, first, last = leader.scheduled_time, state.first_token_time, state.last_token_time
        queue_end = sched if sched is not None else now
        tracing.record_span("pdserve.queue", hop, state.arrival_time, queue_end)
        compute_start = sched
        if leader.pull_start is not None:
            pull_end = leader.pull_end if leader.pull_end is not None else now
            tracing.record_span("pdserve.kv_pull", hop, leader.pull_start, pull_end, {
                "pdserve.kv.blocks": leader.pull_blocks, "pdserve.kv.bytes": leader.pull_blocks * self.block_bytes},
                error=leader.pull_error)
            compute_start = pull_end
        if compute_start is not None:
            pulled = leader.pull_tokens if leader.pull_start is not None and leader.pull_error is None else 0
            computed = max(0, len(state.prompt_token_ids) - leader.num_cached_tokens - pulled)
            tracing.record_span("pdserve.prefill", hop, compute_start, first if first is not None else now,
                                {"pdserve.computed_prompt_tokens": computed})
        if first is not None and generated > len(state.children):
            tracing.record_span("pdserve.decode", hop, first, last, {"gen_ai.usage.output_tokens": generated})
        if state.detokenize_s is not None and first is not None:
            tracing.record_span("pdserve.detokenize", hop, first, last, {"pdserve.busy_s": state.detokenize_s})
        tracing.end_span(hop, now, error)
