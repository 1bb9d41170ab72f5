"""The routers of one model's pools, as an ingress holds them: a RequestRouter per pool (each with
a policy of its own: a shared one would share round-robin's counter, and with the decode pool routed
first on every request the prefill pick would see every other count only), the router a request
goes through (the decode pool's, or in disaggregated mode the PDRouter over prefill and decode),
and the encode pool's EncodeStage where the model has one (router/routing/encode.py)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from records.config import ModelInfo
from records.serving import IngressSpec
from router.routing.encode import EncodeStage
from router.routing.metrics import ServingMetrics
from router.routing.pd import PDRouter
from router.routing.policy import RoutingPolicy
from router.routing.pool_router import RequestRouter


@dataclass
class ModelRouters:
    pools: dict[str, RequestRouter]             # pool name -> its router
    router: RequestRouter | PDRouter            # where a request goes
    encode: EncodeStage | None = None           # where its images go first

    @classmethod
    def of(cls, config: IngressSpec, info: ModelInfo, metrics: ServingMetrics, replicas: dict[str, Any] | None,
           prefill_replicas: dict[str, Any] | None, on_failure: Callable[[str], None] | None) -> ModelRouters:
        """replicas / prefill_replicas: the decode and prefill pools' actor handles (None: attached
        later); on_failure: called with the id of a replica a call found gone."""
        routing = config.routing

        def router(pool: str, handles: dict[str, Any] | None) -> RequestRouter:
            return RequestRouter(pool, handles or {}, info.block_size,
                                 RoutingPolicy(routing.policy(), info.max_num_seqs), metrics,
                                 routing.stats_interval_s, on_failure, routing.max_migrations,
                                 routing.min_peer_pull_tokens if routing.peer_prefix_pulls else None, routing.channel)

        decode = router("decode", replicas)
        out = cls({"decode": decode}, decode)
        if config.mode == "disaggregated":
            prefill = out.pools["prefill"] = router("prefill", prefill_replicas)
            out.router = PDRouter(prefill, decode, metrics, config.disaggregation.min_remote_prefill_tokens,
                                  config.disaggregation.prefill_backlog_factor)
        if config.encode:
            out.encode = EncodeStage(out.pools.setdefault("encode", router("encode", None)))
        return out

    def start(self) -> None:
        """Start each pool's background view (stats, KV events)."""
        self.router.start()
        if self.encode is not None:
            self.encode.pool.start()
