"""What an engine reports of itself (`LLMEngine.stats`) and a replica around it
(`EngineReplica.stats`): typed records read by the ingress (routing loads, /metrics, /health),
the manager (health, the planners, scale to zero, `pdserve status`) and the simulator.

Counters are cumulative since the engine started, as Prometheus counters are; a reader takes
differences. Histograms are per-bucket counts (records/histogram.py says the buckets). A group that
an engine does not have is None (no drafter, no KV connector, no offload tier). Torch-free.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SpecDecodeStats:
    """Counters over verification steps (one per request per step that verified proposals)."""
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed."""
        return self.num_accepted_tokens / max(self.num_draft_tokens, 1)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification (accepted proposals + the target's own token), as vLLM
        reports it."""
        return 1 + self.num_accepted_tokens / max(self.num_drafts, 1)


@dataclass(slots=True, frozen=True)
class KVTransferStats:
    """An engine's KV connector: pulls it made (decode side) and leases it granted (prefill side)."""
    loads: int = 0                  # pulls completed
    load_failures: int = 0          # pulls that failed or timed out (recomputed or failed)
    blocks_pulled: int = 0
    leases: int = 0                 # prefilled requests' blocks leased to a puller
    leases_active: int = 0
    leases_expired: int = 0
    prefix_leases: int = 0          # cached prefixes leased to a peer replica
    requests_waiting: int = 0       # requests parked until their pull lands


@dataclass(slots=True, frozen=True)
class KVTierStats:
    """The offload tier (engine/core/kv_tier.py's bookkeeping, the workers' bytes summed over ranks)."""
    host_blocks: int = 0            # blocks held now
    disk_blocks: int = 0
    host_slots: int = 0             # capacity
    disk_slots: int = 0
    blocks_saved: int = 0           # evicted pool blocks copied to host
    blocks_demoted: int = 0         # host copies moved to disk
    blocks_dropped: int = 0         # copies that left the tier for good
    host_hit_blocks: int = 0        # blocks loaded back instead of recomputed
    disk_hit_blocks: int = 0
    load_failures: int = 0
    save_failures: int = 0
    bytes_saved: float = 0.0
    bytes_loaded: float = 0.0
    bytes_written_to_disk: float = 0.0
    seconds: float = 0.0            # engine steps' time copying blocks to and from the tier


@dataclass(slots=True, frozen=True)
class EngineStats:
    """One reading of an engine (`LLMEngine.stats()`): its load, counters and histograms."""
    num_requests_running: int = 0
    num_requests_waiting: int = 0
    num_prompt_tokens_queued: int = 0   # admitted but not yet run through the model (a prefill pool's queue)
    kv_cache_usage_perc: float = 0.0
    num_kv_blocks: int = 0
    num_free_kv_blocks: int = 0
    prefix_cache_queries: int = 0       # prompt tokens looked up
    prefix_cache_hits: int = 0          # prompt tokens served from the cache
    num_preemptions: int = 0
    prompt_tokens: int = 0              # received
    prompt_tokens_computed: int = 0     # run through the model (recomputed again after a preemption)
    generation_tokens: int = 0
    ttft: tuple[int, ...] = ()          # on records/histogram.py's LATENCY_BUCKETS_S
    itl: tuple[int, ...] = ()
    # the per-request histograms: name -> (counts, sum) (records/histogram.py: engine_histograms)
    histograms: dict[str, tuple[list[int], float]] = field(default_factory=dict)
    spec: SpecDecodeStats | None = None
    kv_transfer: KVTransferStats | None = None
    kv_tier: KVTierStats | None = None
    moe_expert_tokens: tuple[tuple[int, int, int], ...] = ()    # (rank, expert, rows run), a MoE model


@dataclass(slots=True, frozen=True)
class ReplicaStats:
    """A replica's reading: its engine's stats (zeros while asleep: nothing running, nothing cached)
    and the replica's own state."""
    replica_id: str
    healthy: bool
    asleep: int = 0                     # the sleep level, 0 awake
    engine: EngineStats = field(default_factory=EngineStats)

    @property
    def load(self) -> int:
        """Requests the replica holds (running and waiting)."""
        return self.engine.num_requests_running + self.engine.num_requests_waiting


def read(stats: EngineStats, path: str) -> float | None:
    """The number at a dotted path (`"kv_transfer.blocks_pulled"`), None when its group is absent."""
    value: object = stats
    for name in path.split("."):
        if value is None:
            return None
        value = getattr(value, name)
    return None if value is None else float(value)     # type: ignore[arg-type]

