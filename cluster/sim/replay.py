"""Trace replay in virtual time (`pdserve simulate`): a spec's pools of simulated replicas serve a
trace in one process, with no Ray and no sleeping, at 8 to 512 replicas.

What runs is what the server runs: each replica is a real `LLMEngine` (scheduler, KV cache manager,
block pool and prefix cache, KV events, leases and pulls) on a simulated executor
(engine/executor/simulated.py) whose steps take the profile's time; requests are routed by the
server's `RequestRouter` and `PDRouter` (the routing policy over a `PrefixIndex` fed by the
engines' KV events, the P/D decision with its backlog check, peer prefix pulls) and autoscaled
pools by the manager's `Planner` on `sample_pool`s of the engines' stats. What this module adds is
the clock and the plumbing the server does with Ray: a heap of events (arrivals, the steps of each
replica, the routers' stats polls, the planner's checks, replicas that finish starting), the
router's load bookkeeping (`ReplicaLoad`) as the streams would do it, and the clients' view of
each request (its first token, the gaps between its tokens, its end).

Virtual time (records/clock.py): the clock reads each event's time; a replica's step is scheduled
at its start and applied at its end (the executor moves the clock there), and the replica's next
step comes no sooner. A replica that only waits on transfers sleeps until its next pull ends, a
release reaches it, or a lease expires.

Not simulated: failures (node loss, migration), the ingress and its fair queue (every request is
dispatched on arrival), and the time a scale-down drains for (a draining replica finishes what it
runs).
"""
from __future__ import annotations

import dataclasses
import heapq
import itertools
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import records.clock as clock
from cluster.config import ClusterConfig
from cluster.planner import Planner, PoolSample, sample_pool
from cluster.sim.trace import TraceRequest, TraceTokens
from engine.llm_engine import LLMEngine
from records.config import EngineConfig
from records.sampling_params import SamplingParams
from router.routing.metrics import ServingMetrics
from router.routing.pd import PDRouter
from router.routing.policy import Decision, ReplicaLoad, RoutingPolicy
from router.routing.pool_router import RequestRouter

# How often the manager checks its pools and runs the planners (cluster/manager.py's default).
HEALTH_CHECK_PERIOD_S = 2.0
# A replica that only waits on transfers, with no time to wake for, looks again this much later.
IDLE_POLL_S = 0.01


@dataclass(slots=True)
class Flight:
    """One trace request as its client sees it."""
    index: int
    arrival: float
    prompt: list[int]                     # dropped once it reached the replica that streams it
    prompt_len: int
    params: SamplingParams
    decode: Decision | None = None        # P/D: the decode replica chosen on arrival
    remote_prefill: bool = False
    first: float | None = None
    last: float | None = None
    done: float | None = None
    tokens: int = 0
    cached: int = 0                       # prompt tokens its prefilling engine had cached
    error: str | None = None


@dataclass(slots=True)
class Hop:
    """A flight's request on one replica: its prefill there (P/D), or the stream itself."""
    flight: Flight
    role: str                             # prefill | decode
    load: ReplicaLoad                     # the router's count of the replica it runs on
    backlog: int                          # prompt tokens it counts in that replica's backlog until its first token


@dataclass
class SimReplica:
    replica_id: str
    pool: str
    engine: LLMEngine
    state: str                            # starting | serving | draining | gone
    created: float
    gone: float | None = None
    wake_token: int = -1                  # the STEP event that counts (later ones replace earlier ones)
    wake_at: float | None = None
    requests: dict[str, Hop] = field(default_factory=dict)      # by engine request id


class Replay:
    """Replay `requests` against `spec` (whose engine section names the simulation profile)."""

    def __init__(self, spec: ClusterConfig, requests: list[TraceRequest], seed: int = 0,
                 block_tokens: int = 512) -> None:
        if spec.engine.simulate is None:
            raise ValueError("engine.simulate: a replay needs a simulation profile (--profile, or the spec's "
                             "engine.simulate)")
        # Virtual seconds are simulated seconds: a spec's time scale is for real-time replicas.
        self.spec = spec.model_copy(update={"engine": dataclasses.replace(spec.engine, simulate_time_scale=1.0)})
        self.requests = requests
        self.configs: dict[str, EngineConfig] = {pool: self.spec.engine_config(pool) for pool in self.spec.pools}
        decode_config = self.configs["decode"]
        self.profile = decode_config.simulation.profile            # type: ignore[union-attr]
        info = decode_config.model_info()
        self.max_model_len = info.max_model_len
        self.tokens = TraceTokens(info.vocab_size, block_tokens, seed)
        self.metrics = ServingMetrics(info.max_model_len)
        routing = self.spec.routing
        peers = routing.min_peer_pull_tokens if routing.peer_prefix_pulls else None
        # The policies' random tie-breaks seeded too: a replay is the same every time it runs.
        policy = dataclasses.replace(routing.policy(), seed=seed)
        self.routers: dict[str, RequestRouter] = {
            pool: RequestRouter(pool, {}, info.block_size, RoutingPolicy(policy, info.max_num_seqs),
                                self.metrics, routing.stats_interval_s, None, routing.max_migrations, peers)
            for pool in self.spec.pools}
        self.pd = None
        if self.spec.mode == "disaggregated":
            d = self.spec.disaggregation
            self.pd = PDRouter(self.routers["prefill"], self.routers["decode"], self.metrics,
                               d.min_remote_prefill_tokens, d.prefill_backlog_factor)
        self.planners = {pool: Planner(p.autoscaling) for pool, p in self.spec.pools.items()
                         if p.autoscaling is not None}
        self.targets = {pool: p.replicas for pool, p in self.spec.pools.items()}
        self.replicas: dict[str, SimReplica] = {}
        self._next_index = {pool: 0 for pool in self.spec.pools}
        self._heap: list[tuple[float, int, str, Any]] = []
        self._seq = itertools.count()
        self._queued_steps = 0                # step events in the heap (superseded ones too)
        self._hist_seen: dict[tuple[str, str], list[int]] = {}
        self.flights: list[Flight] = []
        self.itl = array("d")                 # every gap between two of a request's steps with tokens
        self.decisions: dict[str, int] = {}
        self.scaling: list[tuple[float, str, int, int]] = []     # (t, pool, target, serving)
        self.planner_log: list[dict[str, Any]] = []
        self.num_done = 0
        self.clock = clock.VirtualClock()

    # --- replicas ---------------------------------------------------------------------------------
    def _add_replica(self, pool: str, state: str) -> SimReplica:
        replica_id = f"{pool}-{self._next_index[pool]}"
        self._next_index[pool] += 1
        engine = LLMEngine(self.configs[pool])
        replica = SimReplica(replica_id, pool, engine, state, self.clock.now)
        worker = getattr(engine.executor, "kv_worker", None)
        if worker is not None:      # a release from a decode replica wakes this prefill replica
            worker.on_release = lambda: self._wake(replica, self.clock.now)
        self.replicas[replica_id] = replica
        if state == "serving":
            self._publish(pool)
        return replica

    def _publish(self, pool: str) -> None:
        """The routers follow the pool's serving replicas (the manager's membership)."""
        self.routers[pool].set_replicas({r.replica_id: r for r in self.replicas.values()
                                         if r.pool == pool and r.state == "serving"})

    def _retire(self, replica: SimReplica) -> None:
        replica.state, replica.gone = "gone", self.clock.now
        replica.engine.check_no_leaks()
        replica.engine.executor.shutdown()

    # --- events -----------------------------------------------------------------------------------
    def _push(self, t: float, kind: str, payload: Any = None) -> int:
        seq = next(self._seq)
        heapq.heappush(self._heap, (t, seq, kind, payload))
        return seq

    def _wake(self, replica: SimReplica, t: float) -> None:
        """Step `replica` at `t`, or at its queued step if that comes sooner."""
        if replica.state == "gone" or (replica.wake_at is not None and replica.wake_at <= t):
            return
        replica.wake_at = t
        replica.wake_token = self._push(t, "step", replica)
        self._queued_steps += 1

    def run(self) -> Replay:
        with clock.virtual(self.clock):
            for pool, spec in self.spec.pools.items():
                for _ in range(spec.replicas):
                    self._add_replica(pool, "serving")
            self._push(self.spec.routing.stats_interval_s, "stats")
            if self.planners:
                self._push(HEALTH_CHECK_PERIOD_S, "plan")
            self._record_sizes()
            arrivals = iter(enumerate(self.requests))
            upcoming = next(arrivals, None)
            # On until every request is done and no replica has anything left to step (a lease to
            # end once its release arrives).
            while upcoming is not None or self.num_done < len(self.flights) or self._queued_steps:
                if upcoming is not None and (not self._heap or upcoming[1].arrival_s <= self._heap[0][0]):
                    self.clock.now = upcoming[1].arrival_s
                    self._arrive(*upcoming)
                    upcoming = next(arrivals, None)
                    continue
                t, seq, kind, payload = heapq.heappop(self._heap)
                self.clock.now = t
                if kind == "step":
                    self._queued_steps -= 1
                    if payload.wake_token == seq:
                        payload.wake_at = None
                        self._step(payload)
                elif kind == "stats":
                    self._poll_stats()
                    self._push(t + self.spec.routing.stats_interval_s, "stats")
                elif kind == "plan":
                    self._plan()
                    self._push(t + HEALTH_CHECK_PERIOD_S, "plan")
                elif kind == "ready":
                    self._ready(payload)
            self.end = max((f.done for f in self.flights if f.done is not None), default=0.0)
            for replica in self.replicas.values():
                if replica.state != "gone":
                    replica.engine.check_no_leaks()
                    replica.engine.executor.shutdown()
        return self

    def _arrive(self, index: int, request: TraceRequest) -> None:
        prompt = self.tokens.prompt(request, index)
        if len(prompt) >= self.max_model_len:     # as the server would refuse it (HTTP 400)
            prompt = prompt[:self.max_model_len - 1]
        output_length = min(request.output_length, self.max_model_len - len(prompt))
        params = SamplingParams(max_tokens=output_length, temperature=0.0, ignore_eos=True, detokenize=False,
                                output_kind="delta")
        flight = Flight(index, self.clock.now, prompt, len(prompt), params)
        self.flights.append(flight)
        if self.pd is not None:
            plan = self.pd.plan(prompt, params)
            self.decisions[plan.reason] = self.decisions.get(plan.reason, 0) + 1
            if plan.prefill is not None:
                flight.decode, flight.remote_prefill = plan.decode, True
                self._submit(flight, self.routers["prefill"], plan.prefill, "prefill",
                             plan.prefill_params, {"do_remote_decode": True})
                return
            decision = plan.decode
        else:
            decision = self.routers["decode"].route(prompt, params)
        self._submit(flight, self.routers["decode"], decision, "decode", params, None)

    def _submit(self, flight: Flight, router: RequestRouter, decision: Decision, role: str,
                params: SamplingParams, kv_params: dict | None) -> None:
        """Start `flight` on the decision's replica (a peer's prefix leased first, as the router does)."""
        replica = self.replicas[decision.replica_id]
        if decision.peer is not None and not (kv_params or {}).get("do_remote_prefill"):
            peer = self.replicas.get(decision.peer[0])
            leased = None if peer is None else peer.engine.lease_prefix(decision.peer[1], params.adapter_name)
            if leased is not None:
                kv_params = leased if kv_params is None else {**kv_params, "peer_prefix": leased}
        backlog = 1 if (kv_params or {}).get("do_remote_prefill") else router.uncached_tokens(len(flight.prompt),
                                                                                              decision)
        load = router.loads[replica.replica_id]
        load.started(backlog)
        request_id = f"{flight.index}-{role}"
        replica.engine.add_request(request_id, None, flight.prompt, params, kv_transfer_params=kv_params)
        replica.requests[request_id] = Hop(flight, role, load, backlog)
        if role == "decode":
            flight.prompt = []          # the engine holds it now (a trace of hours would not fit twice)
        self._wake(replica, self.clock.now)

    def _step(self, replica: SimReplica) -> None:
        engine = replica.engine
        if not engine.has_unfinished_requests():
            if replica.state == "draining":
                self._retire(replica)
            return
        outputs = engine.step()                 # in virtual time: the clock is at the step's end now
        now = self.clock.now
        events = engine.take_kv_events()
        if events and replica.state == "serving":
            self.routers[replica.pool].index.apply(replica.replica_id, events)
        for out in outputs:
            self._deliver(replica, out, now)
        if not engine.has_unfinished_requests():
            if replica.state == "draining":
                self._retire(replica)
            return
        self._wake(replica, now if not engine.last_step_idle else self._idle_wake(replica, now))

    def _idle_wake(self, replica: SimReplica, now: float) -> float:
        """When a replica with nothing to step (only transfers pending) should look again: its next
        pull's end or lease's expiry (a release wakes it sooner: `_add_replica`), or shortly when
        requests wait or orders are unsent."""
        times = []
        worker = getattr(replica.engine.executor, "kv_worker", None)
        if worker is not None and worker.next_event_at() is not None:
            times.append(worker.next_event_at())
        connector = replica.engine.kv_connector
        if connector is not None and connector.leases:
            times.append(min(lease.expires_at for lease in connector.leases.values()) - clock.VIRTUAL_EPOCH)
        if not times or replica.engine.scheduler.waiting or (replica.engine.kv_worker is not None
                                                             and replica.engine.kv_worker.ops):
            times.append(now + IDLE_POLL_S)
        return max(now, min(times))

    def _deliver(self, replica: SimReplica, out: Any, now: float) -> None:
        hop = replica.requests[out.request_id]
        flight = hop.flight
        n = sum(len(c.token_ids) for c in out.outputs)
        if (n or out.finished) and hop.backlog:
            hop.load.prefilled(hop.backlog)          # its prompt is done there
            hop.backlog = 0
        if out.finished:
            del replica.requests[out.request_id]
            hop.load.ended()
        if hop.role == "prefill":
            if out.finished:
                flight.cached = out.num_cached_tokens
                self._decode_after_prefill(flight, out.kv_transfer_params)
            return
        if n:
            if flight.first is None:
                flight.first = now
                if not flight.remote_prefill:
                    flight.cached = out.num_cached_tokens
            else:
                self.itl.append(now - flight.last)
            flight.last = now
            flight.tokens += n
        if out.finished:
            flight.done = now
            error = next((c for c in out.outputs if c.finish_reason == "error"), None)
            flight.error = None if error is None else str(error.stop_reason)
            self.num_done += 1

    def _decode_after_prefill(self, flight: Flight, kv_params: dict | None) -> None:
        router = self.routers["decode"]
        decision = flight.decode
        if decision is None or decision.replica_id not in router.replicas:       # it left meanwhile
            decision = router.route(flight.prompt, flight.params)
        if kv_params is None:
            flight.remote_prefill = False       # nothing leased: the decode replica computes the prompt
        self._submit(flight, router, decision, "decode", flight.params, kv_params)

    # --- the routers' view, and the planner -------------------------------------------------------
    def _poll_stats(self) -> None:
        for router in self.routers.values():
            for replica_id, load in router.loads.items():
                load.kv_usage = self.replicas[replica_id].engine.kv_cache_manager.usage

    def _plan(self) -> None:
        now = self.clock.now
        for pool, planner in self.planners.items():
            serving = [r for r in self.replicas.values() if r.pool == pool and r.state == "serving"]
            starting = sum(1 for r in self.replicas.values() if r.pool == pool and r.state == "starting")
            sample: PoolSample = sample_pool(now, {r.replica_id: r.engine.stats() for r in serving}, starting,
                                             self._hist_seen)
            planner.observe(sample)
            decision = planner.plan(self.targets[pool], now)
            if decision.action == "hold":
                continue
            self.planner_log.append({"t": now, "pool": pool, "action": decision.action, "from": self.targets[pool],
                                     "to": decision.replicas, "reason": decision.reason})
            self._scale(pool, decision.replicas)

    def _scale(self, pool: str, target: int) -> None:
        """As EnginePool.scale: new replicas start (serving once started up); surplus ones still
        starting are cancelled first, then the serving ones running the fewest requests drain."""
        self.targets[pool] = target
        mine = [r for r in self.replicas.values() if r.pool == pool and r.state in ("serving", "starting")]
        for _ in range(target - len(mine)):
            replica = self._add_replica(pool, "starting")
            self._push(self.clock.now + self.profile.startup_s, "ready", replica)
        excess = len(mine) - target
        for replica in [r for r in reversed(mine) if r.state == "starting"][:max(0, excess)]:
            self._retire(replica)
            excess -= 1
        if excess > 0:
            serving = sorted((r for r in mine if r.state == "serving"),
                             key=lambda r: len(r.engine.scheduler.running) + len(r.engine.scheduler.waiting))
            for replica in serving[:excess]:
                replica.state = "draining"
                if not replica.engine.has_unfinished_requests():
                    self._retire(replica)
        self._publish(pool)
        self._record_sizes()

    def _ready(self, replica: SimReplica) -> None:
        if replica.state != "starting":
            return
        replica.state = "serving"
        self._publish(replica.pool)
        self._record_sizes()

    def _record_sizes(self) -> None:
        for pool in self.spec.pools:
            serving = sum(1 for r in self.replicas.values() if r.pool == pool and r.state == "serving")
            self.scaling.append((self.clock.now, pool, self.targets[pool], serving))

    # --- what it measured -------------------------------------------------------------------------
    def replica_seconds(self) -> dict[str, float]:
        """Per pool: replica lifetimes (starting, serving or draining) summed over the replay."""
        out = {pool: 0.0 for pool in self.spec.pools}
        for r in self.replicas.values():
            out[r.pool] += (self.end if r.gone is None else r.gone) - r.created
        return out

    def engine_totals(self) -> dict[str, int]:
        totals = {"prompt_tokens_computed": 0, "num_preemptions": 0, "kv_blocks_pulled": 0, "kv_load_failures": 0}
        for r in self.replicas.values():
            s = r.engine.scheduler
            totals["prompt_tokens_computed"] += s.num_prompt_tokens_computed
            totals["num_preemptions"] += s.num_preemptions
            if r.engine.kv_connector is not None:
                totals["kv_blocks_pulled"] += r.engine.kv_connector.num_blocks_pulled
                totals["kv_load_failures"] += r.engine.kv_connector.num_load_failures
        return totals

    def finished(self) -> Iterator[Flight]:
        return (f for f in self.flights if f.done is not None)


def percentiles(values: list[float] | array, qs: tuple[float, ...] = (0.5, 0.9, 0.99)) -> dict[str, float | None]:
    """p50 / p90 / p99, interpolated between the closest ranks (numpy's default, as
    benchmarks/serve.py reads a real server's); None without values."""
    data = sorted(values)
    out: dict[str, float | None] = {}
    for q in qs:
        if not data:
            out[f"p{round(q * 100)}"] = None
            continue
        k = (len(data) - 1) * q
        lo = int(k)
        hi = min(lo + 1, len(data) - 1)
        out[f"p{round(q * 100)}"] = data[lo] + (data[hi] - data[lo]) * (k - lo)
    return out
