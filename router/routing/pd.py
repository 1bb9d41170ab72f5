"""PDRouter: the prefill/decode split over two pools (DESIGN: data flow, step 3), each routed by a
`RequestRouter` (router/routing/pool_router.py).

It picks the decode replica first (where the tokens will stream from, and whose prefix cache
counts); if the prompt's uncached part there is shorter than `min_remote_prefill_tokens` (or the
request wants n > 1 or prompt logprobs), D prefills it itself: conditional disaggregation. It also
does when the chosen prefill replica's backlog of prompt tokens is longer than D's own
(`prefill_is_backlogged`, as Dynamo's disaggregated router weighs its prefill queue). Otherwise the
chosen prefill replica runs it with max_tokens=1 and leases its blocks; D gets the returned transfer
parameters, pulls what it lacks, and decodes. D's output is what streams (its first token is
recomputed from the pulled KV, so it is identical to a single engine's under greedy or seeded
sampling). A client that goes away while P prefills aborts it there; after that the lease is D's to
release once D has the request, and P is told to end it when the request ends any other way than
D's stream finishing (D may never have got it: the client left between the two hops).
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

from records.deltas import StepDelta
from records.engine_stats import ReplicaStats
from records.errors import NoReplicaError
from records.sampling_params import SamplingParams
from router.routing.metrics import ServingMetrics
from router.routing.policy import Decision
from router.routing.pool_router import RequestRouter
from router.routing.request_trace import RequestTrace


@dataclasses.dataclass(slots=True)
class PDPlan:
    """Where one request runs (`PDRouter.plan`)."""
    decode: Decision
    prefill: Decision | None        # None: the decode replica computes the prompt itself
    reason: str                     # local_prefill | local_prefill_backlog | remote_prefill
    prefill_params: SamplingParams | None = None    # what the prefill replica runs (`prefill_params`)


def prefill_params(params: SamplingParams) -> SamplingParams:
    """What a prefill replica runs of a request: its prompt, to its first token (one choice, no
    logprobs: the decode replica samples what the client sees)."""
    return dataclasses.replace(params, max_tokens=1, min_tokens=0, n=1, logprobs=None)


class PDRouter:
    """Prefill/decode orchestration over two pools (see the module docstring)."""

    def __init__(self, prefill: RequestRouter, decode: RequestRouter, metrics: ServingMetrics,
                 min_remote_prefill_tokens: int = 256, prefill_backlog_factor: float | None = 1.0) -> None:
        self.prefill = prefill
        self.decode = decode
        self.metrics = metrics
        self.min_remote_prefill_tokens = min_remote_prefill_tokens
        self.prefill_backlog_factor = prefill_backlog_factor

    @property
    def replicas(self) -> dict[str, Any]:
        """Every replica of both pools (ids are unique: they carry the pool name)."""
        return {**self.prefill.replicas, **self.decode.replicas}

    def start(self) -> None:
        self.prefill.start()
        self.decode.start()

    def stop(self) -> None:
        self.prefill.stop()
        self.decode.stop()

    async def refresh_stats(self) -> dict[str, ReplicaStats]:
        prefill, decode = await asyncio.gather(self.prefill.refresh_stats(), self.decode.refresh_stats())
        return {**prefill, **decode}

    def wants_remote_prefill(self, num_prompt_tokens: int, params: SamplingParams,
                             decode_decision: Decision) -> bool:
        """Whether the prompt is worth a remote prefill at all: enough of it is uncached on the
        chosen decode replica (and the request is one the prefill pool can run)."""
        if params.n != 1 or params.prompt_logprobs is not None or params.pooling or not self.prefill.available:
            return False
        return self.decode.uncached_tokens(num_prompt_tokens, decode_decision) >= self.min_remote_prefill_tokens

    def prefill_is_backlogged(self, num_prompt_tokens: int, p_decision: Decision, d_decision: Decision) -> bool:
        """Load-aware conditional disaggregation: True when the decode replica would get through
        the prompt sooner itself. Each side's backlog is the uncached prompt tokens this router has
        sent it that have not produced their first token yet, plus this prompt's uncached part there;
        the prompt stays on the decode replica when the prefill replica's backlog exceeds
        `prefill_backlog_factor` times the decode replica's (a saturated prefill pool never stalls
        prompts the decode replica could prefill itself sooner; an idle one takes every long
        prompt). None turns the check off (always remote past min_remote_prefill_tokens)."""
        if self.prefill_backlog_factor is None:
            return False
        p_backlog = (self.prefill.loads[p_decision.replica_id].prefill_tokens
                     + self.prefill.uncached_tokens(num_prompt_tokens, p_decision))
        d_backlog = (self.decode.loads[d_decision.replica_id].prefill_tokens
                     + self.decode.uncached_tokens(num_prompt_tokens, d_decision))
        return p_backlog > self.prefill_backlog_factor * d_backlog

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       trace: RequestTrace | None = None, arrival: float | None = None, images: tuple = ()
                       ) -> AsyncIterator[StepDelta]:
        """Stream the decode replica's StepDeltas, after a remote prefill when it pays. `trace`:
        the request's, told of every decision (router/routing/request_trace.py); `arrival`: when
        it arrived (time.monotonic(); default now), where the decode pool's time to first token
        starts (so that it covers the prefill hop and the pull, as a client sees it); `images`: the
        prompt's (both replicas get them: the decode one keys its blocks on them, and computes the
        prompt itself when its pull fails)."""
        arrival = time.monotonic() if arrival is None else arrival
        if params.pooling is not None and self.prefill.available:
            # An embedding is all prefill: it runs whole on the prefill pool, no KV moves.
            self.metrics.routing.decisions.inc(reason="embedding_on_prefill", pool="pd")
            async for delta in self.prefill.generate(request_id, prompt_token_ids, params,
                                                     self.prefill.route(prompt_token_ids, params, trace, images=images),
                                                     trace=trace, arrival=arrival, images=images):
                yield delta
            return
        plan = self.plan(prompt_token_ids, params, trace, images)
        kv_params = None
        try:
            if plan.prefill is not None:
                assert plan.prefill_params is not None
                kv_params = await self._prefill(request_id, prompt_token_ids, plan.prefill_params, plan.prefill,
                                                trace, images)
            # After a remote prefill the decode replica computes one token (and pulls the rest).
            async for delta in self.decode.generate(request_id, prompt_token_ids, params, plan.decode, kv_params,
                                                    prefill_tokens=1 if kv_params is not None else None,
                                                    trace=trace, arrival=arrival, images=images):
                yield delta
        except BaseException:
            # The client went away (or the decode failed) after P leased its blocks: D may never
            # have taken the request, and then nothing would release them before the lease expired.
            if kv_params is not None and plan.prefill is not None:
                self.prefill.end_lease(plan.prefill.replica_id, kv_params)
            raise

    def plan(self, prompt_token_ids: list[int], params: SamplingParams, trace: RequestTrace | None = None,
             images: tuple = ()) -> PDPlan:
        """Where a request runs: its decode replica, and the prefill replica that runs its prompt
        first when it pays (`prefill` None: the decode replica prefills it); the reason is counted
        (`pdserve:router_decisions_total{pool="pd"}`) and told to `trace`. What `generate` follows,
        and what `pdserve simulate` drives."""
        hashes = self.decode.block_hashes(prompt_token_ids, params, images)      # both pools' engines hash alike
        d_decision = self.decode.route(prompt_token_ids, params, trace, hashes)
        p_decision = p_params = None
        if self.wants_remote_prefill(len(prompt_token_ids), params, d_decision):
            p_params = prefill_params(params)
            p_decision = self.prefill.route(prompt_token_ids, p_params, trace, hashes)
            reason = ("local_prefill_backlog" if self.prefill_is_backlogged(len(prompt_token_ids), p_decision,
                                                                             d_decision) else "remote_prefill")
        else:
            reason = "local_prefill"
        self.metrics.routing.decisions.inc(reason=reason, pool="pd")
        if trace is not None:
            trace.disaggregated(reason)
        if reason != "remote_prefill":
            return PDPlan(d_decision, None, reason)
        return PDPlan(d_decision, p_decision, reason, p_params)

    async def _prefill(self, request_id: str, prompt_token_ids: list[int], p_params: SamplingParams,
                       decision: Decision, trace: RequestTrace | None = None, images: tuple = ()) -> dict | None:
        """Run the prompt (`p_params`: `prefill_params`) on the chosen prefill replica; its transfer
        parameters, or None when it leased nothing (its first token ended the request, or its lease
        table was full) or no prefill replica could run it: then D computes the prompt itself."""
        last = None
        try:
            async for delta in self.prefill.generate(request_id, prompt_token_ids, p_params, decision,
                                                     kv_transfer_params={"do_remote_decode": True}, trace=trace,
                                                     images=images):
                last = delta
        except NoReplicaError:          # every prefill replica failed it or is being replaced
            self.metrics.routing.decisions.inc(reason="prefill_unavailable", pool="pd")
            return None
        if last is None or last.kv_transfer_params is None:
            self.metrics.routing.decisions.inc(reason="prefill_not_leased", pool="pd")
            return None
        return last.kv_transfer_params
