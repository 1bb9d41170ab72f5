"""RequestTrace: one request as the ingress observes it across its hops, when tracing is on
(`serving.otlp_traces_endpoint`) or requests are logged (`serving.log_requests`); otherwise there
is none, and nothing is recorded.

- Its span `pdserve.request` (kind SERVER) under the client's `traceparent` when one came (else a
  new trace), with children: `pdserve.prepare` (body, validation, chat template, tokenization),
  `pdserve.admission`, and a `pdserve.route` per routing decision (pool, replica, reason, prefix
  hit). Its carrier goes to the engine replicas with the request (`carrier`), whose spans
  (engine/telemetry.py: the engine hop, queue, KV pull, prefill, decode, detokenization) join
  the same trace.
- Its log line at the end (logger `pdserve.requests`, one JSON object): id, route, model and
  adapter, prompt / output / cached tokens, time to first token, end-to-end time, the replicas
  it ran on, P/D or colocated, finish reasons, the error; the prompt's text only when asked.

It ends when both the endpoint has returned and the admission ticket of its prompts is released
(a streamed response goes on after its endpoint returned).
"""
from __future__ import annotations

import contextvars
import json
import logging
import sys
import time
from collections.abc import Callable
from typing import Any

import engine.tracing as tracing
from records.deltas import StepDelta

request_log = logging.getLogger("pdserve.requests")
# The request the current task serves (set by the ingress's endpoint, read where it is admitted).
CURRENT: contextvars.ContextVar[RequestTrace | None] = contextvars.ContextVar("pdserve_request_trace",
                                                                             default=None)
# When the current task's request reached the endpoint (time.monotonic()), traced or not.
ARRIVAL: contextvars.ContextVar[float | None] = contextvars.ContextVar("pdserve_request_arrival", default=None)


def log_requests_to_stderr() -> None:
    """Write the request log's lines (INFO) to this process's stderr, one JSON object a line (under
    Ray, the worker's log, which Ray also streams to the driver); once per process."""
    if not any(getattr(h, "pdserve_requests", False) for h in request_log.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler.pdserve_requests = True  # type: ignore[attr-defined]
        request_log.addHandler(handler)
    request_log.setLevel(logging.INFO)
    request_log.propagate = False


class RequestTrace:
    def __init__(self, route: str, carrier: tracing.Carrier | None, log: bool = False,
                 describe_prompt: Callable[[list[int]], str] | None = None) -> None:
        """route: what was called (e.g. "/v1/chat/completions"); carrier: the client's trace
        headers; log: write the log line at the end; describe_prompt: the prompt's text for it
        (None: never logged)."""
        self.start = ARRIVAL.get() or time.monotonic()
        self.route = route
        self.log = log
        self.describe_prompt = describe_prompt
        self.span = (tracing.start_span("pdserve.request", carrier, self.start, {"http.route": route}, kind="SERVER")
                     if tracing.enabled() else None)
        self._holds = 1                 # the endpoint's; a ticket takes another (`hold`)
        self.fields: dict[str, Any] = {"route": route}
        self.replicas: list[str] = []
        self.mode: str | None = None        # "colocated" once routed; "pd" once a prefill replica runs it
        self.prompts: list[list[int]] = []
        self.first_token: float | None = None
        self.output_tokens = 0
        self.cached_tokens = 0
        self.finish_reasons: list[str] = []
        self.error: str | None = None

    # --- what happened ----------------------------------------------------------------------------
    def child(self, name: str, start: float, end: float | None = None, attributes: dict[str, Any] | None = None
              ) -> None:
        """A finished child span of the request (when tracing)."""
        if self.span is not None:
            tracing.record_span(name, self.span, start, end if end is not None else time.monotonic(), attributes)

    def carrier(self) -> tracing.Carrier | None:
        """What the engine replicas parent their spans on (None when not tracing)."""
        return tracing.carrier_of(self.span) if self.span is not None else None

    def started(self, request_id: str, prompts: list[list[int]], model: str, adapter: str | None) -> None:
        self.fields.update(id=request_id, model=model, adapter=adapter)
        self.prompts = prompts
        if self.span is not None:
            self.span.set_attributes({"gen_ai.request.id": request_id, "gen_ai.request.model": model,
                                      "gen_ai.usage.input_tokens": sum(map(len, prompts))})

    def routed(self, pool: str, decision: Any, start: float, block_size: int) -> None:
        """A routing decision (router/routing/policy.py: Decision), made from `start` to now."""
        self.mode = self.mode or "colocated"
        self.child("pdserve.route", start, attributes={
            "pdserve.pool": pool, "pdserve.replica": decision.replica_id, "pdserve.route.reason": decision.reason,
            "pdserve.route.prefix_hit_tokens": decision.matched_blocks * block_size,
            "pdserve.route.tier_hit_tokens": decision.tier_blocks * block_size,
            "pdserve.route.peer": decision.peer[0] if decision.peer is not None else ""})

    def encoded(self, replica_id: str | None, outcome: str, start: float) -> None:
        """Its images' encoding (router/routing/encode.py): where, and how it went, from `start` to now."""
        self.fields["encode"] = outcome
        if replica_id is not None:
            self.replicas.append(replica_id)
        self.child("pdserve.encode", start, attributes={"pdserve.pool": "encode", "pdserve.replica": replica_id or "",
                                                        "pdserve.encode.outcome": outcome})

    def ran_on(self, replica_id: str) -> None:
        """The request was submitted to this replica (a prefill, a decode, a migrated stream's next)."""
        self.replicas.append(replica_id)

    def disaggregated(self, reason: str) -> None:
        """The P/D decision (remote_prefill, local_prefill, ...)."""
        if reason == "remote_prefill":
            self.mode = "pd"
        self.fields["pd_decision"] = reason
        if self.span is not None:
            self.span.set_attribute("pdserve.pd_decision", reason)

    def delta(self, delta: StepDelta) -> None:
        for c in delta.choices:
            if c.token_ids and self.first_token is None:
                self.first_token = time.monotonic()
            self.output_tokens += len(c.token_ids)
            if c.finish_reason is not None:
                self.finish_reasons.append(c.finish_reason)
        if delta.num_cached_tokens:
            self.cached_tokens = max(self.cached_tokens, delta.num_cached_tokens)

    def failed(self, error: BaseException) -> None:
        self.error = f"{type(error).__name__}: {error}"

    # --- its end ----------------------------------------------------------------------------------
    def hold(self) -> None:
        self._holds += 1

    def release(self) -> None:
        """One holder is done; the last one ends the span and writes the log line. Never awaits."""
        self._holds -= 1
        if self._holds == 0:
            self._finish(time.monotonic())

    def _finish(self, now: float) -> None:
        ttft = None if self.first_token is None else round(self.first_token - self.start, 6)
        if self.span is not None:
            self.span.set_attributes({
                "gen_ai.usage.output_tokens": self.output_tokens, "pdserve.cached_tokens": self.cached_tokens,
                "pdserve.replicas": ",".join(self.replicas), "pdserve.mode": self.mode or "",
                "gen_ai.response.finish_reasons": ",".join(self.finish_reasons),
                **({"pdserve.ttft_s": ttft} if ttft is not None else {})})
            tracing.end_span(self.span, now, self.error)
        if self.log:
            line = {**self.fields, "prompt_tokens": sum(map(len, self.prompts)), "output_tokens": self.output_tokens,
                    "cached_tokens": self.cached_tokens, "ttft_s": ttft, "e2e_s": round(now - self.start, 6),
                    "replicas": self.replicas, "mode": self.mode, "finish_reasons": self.finish_reasons,
                    "error": self.error}
            if self.span is not None:
                line["trace_id"] = format(self.span.get_span_context().trace_id, "032x")
            if self.describe_prompt is not None:
                line["prompts"] = [self.describe_prompt(p) for p in self.prompts]
            request_log.info(json.dumps(line))
