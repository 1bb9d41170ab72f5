"""Routing policies: pick one replica of a pool for a prompt.

`prefix_aware` (default) scores each replica by how much of the prompt it already holds against how
loaded it is:

    score = (matched_blocks + tier_weight * tier_blocks) / prompt_blocks - load_weight * load / max_load

where load is the requests the router has in flight there (waiting + running, as the router sees
them: fresher than polled stats) plus `kv_usage` scaled to requests. When the most and least loaded
replicas differ by more than `imbalance_threshold` requests, the least loaded wins regardless of
prefix (a hot prefix must not pile every request onto one replica). Ties go to the replica caching
the fewest blocks (a new prefix lands where it evicts least, as SGLang's cache-aware router balances
by tree size), then at random. `tier_blocks` are the blocks after the pool's run that the replica's
offload tier holds: it loads them (worth `tier_weight` of a pool hit: more than a miss, which is
computed, less than a hit, which costs nothing). A request under a LoRA adapter scores `adapter_weight` more on the
replicas that ran that adapter lately (they hold it in a slot or in host memory: no load from disk,
and its prefixes, whose block hashes are keyed by the adapter, are matched above anyway).
`round_robin` and `least_load` are the baselines to compare against.
"""
from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat

from records.serving import PolicyConfig

REASONS = ("prefix_hit", "tier_hit", "adapter_hit", "no_hit_least_cost", "imbalance", "round_robin", "least_load")


@dataclass(slots=True)
class ReplicaLoad:
    in_flight: int = 0          # requests routed there and not finished
    kv_usage: float = 0.0       # fraction of its KV blocks in use (from its stats)
    prefill_tokens: int = 0     # uncached prompt tokens routed there whose first token has not come back

    def value(self, max_num_seqs: int) -> float:
        return self.in_flight + self.kv_usage * max_num_seqs

    # A request's life as the router counts it (RequestRouter._stream; pdserve simulate too).
    def started(self, prefill_tokens: int) -> None:
        """A request sent here, with the uncached prompt tokens it computes before its first token."""
        self.in_flight += 1
        self.prefill_tokens += prefill_tokens

    def prefilled(self, prefill_tokens: int) -> None:
        """Its first token (or its end) came back: its prompt no longer waits here."""
        self.prefill_tokens -= prefill_tokens

    def ended(self) -> None:
        self.in_flight -= 1


@dataclass(slots=True)
class Decision:
    replica_id: str
    reason: str                 # one of REASONS
    matched_blocks: int = 0
    tier_blocks: int = 0        # after the matched ones, in the replica's offload tier
    # A peer replica of the pool whose cache holds more of the prompt: (its id, the hashes of the
    # leading blocks it holds), for the chosen replica to pull (RequestRouter.generate).
    peer: tuple[str, list[bytes]] | None = None


_IDLE = ReplicaLoad()         # a candidate the caller has no load for


class RoutingPolicy:
    def __init__(self, config: PolicyConfig | None = None, max_num_seqs: int = 64) -> None:
        self.config = config or PolicyConfig()
        self.max_num_seqs = max_num_seqs
        self._rng = random.Random(self.config.seed)
        self._rr = itertools.count()

    def choose(self, matched: dict[str, int], num_prompt_blocks: int, loads: dict[str, ReplicaLoad],
               cached_blocks: Mapping[str, int] | Callable[[Sequence[str]], list[int]] | None = None,
               holds_adapter: set[str] | None = None, tier_matched: dict[str, int] | None = None,
               candidates: Sequence[str] | None = None, matched_default: int = 0) -> Decision:
        """matched: replica id -> leading prompt blocks it holds (a key for every candidate);
        cached_blocks: replica id -> blocks in its prefix cache, a mapping or a function of a list of
        replica ids giving theirs (tie-breaker); holds_adapter: the replicas that ran the request's
        LoRA adapter lately (None: a request of the base model); tier_matched: replica id -> blocks
        after those its offload tier holds; candidates: the replicas to choose among, in a stable
        order (default: matched's keys, sorted); matched_default: the blocks of a candidate
        `matched` leaves out (PrefixIndex.match_sparse). One pass over the candidates (a router of hundreds of replicas
        does this per request: benchmarks/router_decision.py)."""
        candidates = sorted(matched) if candidates is None else candidates
        if not candidates:
            raise RuntimeError("no replica to route to")
        name = self.config.name
        if name == "round_robin":
            return Decision(candidates[next(self._rr) % len(candidates)], "round_robin")
        m = self.max_num_seqs
        vals = [l.in_flight + l.kv_usage * m for l in map(loads.get, candidates, repeat(_IDLE))]
        if name == "least_load":
            return Decision(self._pick_min(candidates, vals), "least_load")
        tiers = tier_matched or {}
        high, low = max(vals), min(vals)
        if high - low > self.config.imbalance_threshold:
            r = self._pick_min(candidates, vals)
            return Decision(r, "imbalance", matched.get(r, matched_default), tiers.get(r, 0))
        blocks_of = list(map(matched.get, candidates, repeat(matched_default)))
        blocks = max(num_prompt_blocks, 1)
        w = self.config.load_weight / max(high, 1.0)
        if tiers or holds_adapter:
            held, tw, aw = holds_adapter or set(), self.config.tier_weight, self.config.adapter_weight
            scores = [(mv + tw * tiers.get(r, 0)) / blocks - w * v + aw * (r in held)
                      for r, mv, v in zip(candidates, blocks_of, vals)]
        else:
            scores = [mv / blocks - w * v for mv, v in zip(blocks_of, vals)]
        best = max(scores)
        tied = [c for c, s in zip(candidates, scores) if s == best]
        if cached_blocks is not None and len(tied) > 1:
            counts = (cached_blocks(tied) if callable(cached_blocks)
                      else list(map(cached_blocks.get, tied, repeat(0))))
            fewest = min(counts)
            tied = [c for c, n in zip(tied, counts) if n == fewest]
        r = tied[0] if len(tied) == 1 else self._rng.choice(tied)
        held = holds_adapter or ()
        num = matched.get(r, matched_default)
        reason = ("prefix_hit" if num else "tier_hit" if tiers.get(r) else "adapter_hit" if r in held
                  else "no_hit_least_cost")
        return Decision(r, reason, num, tiers.get(r, 0))

    def _pick_min(self, candidates: Sequence[str], vals: list[float]) -> str:
        low = min(vals)
        lowest = [c for c, v in zip(candidates, vals) if v == low]
        return lowest[0] if len(lowest) == 1 else self._rng.choice(lowest)
