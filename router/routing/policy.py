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
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat

import numpy as np

from records.serving import PolicyConfig

REASONS = ("prefix_hit", "tier_hit", "adapter_hit", "no_hit_least_cost", "imbalance", "round_robin", "least_load")


class ReplicaLoad:
    """One replica's load as its router counts it (a row of its pool's `Loads`)."""

    __slots__ = ("_table", "_row", "_in_flight", "_kv_usage", "prefill_tokens")

    def __init__(self, table: Loads | None, row: int) -> None:
        self._table, self._row = table, row
        self._in_flight = 0         # requests routed there and not finished
        self._kv_usage = 0.0        # the fraction of its KV blocks in use (from its stats)
        self.prefill_tokens = 0     # uncached prompt tokens routed there whose first token has not come back

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @in_flight.setter
    def in_flight(self, value: int) -> None:
        self._in_flight = value
        self._changed()

    @property
    def kv_usage(self) -> float:
        return self._kv_usage

    @kv_usage.setter
    def kv_usage(self, value: float) -> None:
        self._kv_usage = value
        self._changed()

    def _changed(self) -> None:
        if self._table is not None:
            self._table._value[self._row] = self._in_flight + self._kv_usage * self._table.max_num_seqs

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


class Loads(Mapping[str, ReplicaLoad]):
    """The router's `ReplicaLoad` of each replica of a pool, and each one's load in requests (in
    flight, plus its KV usage scaled to `max_num_seqs`) kept in a numpy column as it changes: the
    policy reads hundreds of replicas' loads as one array per request, where a Python pass over
    them cost ~70 us at 256 (benchmarks/router_decision.py). A replica removed (`pop`) keeps its
    load object, detached, for the streams still counting on it."""

    def __init__(self, replica_ids: Iterable[str] = (), max_num_seqs: int = 64) -> None:
        self.max_num_seqs = max_num_seqs
        self._value = np.zeros(8)
        self._loads: dict[str, ReplicaLoad] = {}
        self._free: list[int] = []
        self._used = 0
        # The last candidates asked for: their rows (a slice when they are the first rows in
        # order, as a pool's available replicas are until one leaves) and positions.
        self._index: tuple[list[str], slice | np.ndarray, dict[str, int]] | None = None
        for r in replica_ids:
            self.add(r)

    def add(self, replica_id: str) -> ReplicaLoad:
        """A new replica's load (idle), or the one it has."""
        if replica_id in self._loads:
            return self._loads[replica_id]
        if self._free:
            row = min(self._free)
            self._free.remove(row)
        else:
            row, self._used = self._used, self._used + 1
            if row == len(self._value):
                self._value = np.concatenate([self._value, np.zeros(row)])
        self._value[row] = 0.0
        load = self._loads[replica_id] = ReplicaLoad(self, row)
        self._index = None
        return load

    def pop(self, replica_id: str) -> ReplicaLoad:  # type: ignore[override]
        """Forget a replica; its row is reused, its load object counts on alone."""
        load = self._loads.pop(replica_id)
        self._free.append(load._row)
        load._table = None
        self._index = None
        return load

    def __getitem__(self, replica_id: str) -> ReplicaLoad:
        return self._loads[replica_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._loads)

    def __len__(self) -> int:
        return len(self._loads)

    def values_of(self, candidates: Sequence[str]) -> tuple[np.ndarray, dict[str, int]]:
        """Each candidate's load in requests, and each candidate's position. The rows of the last
        candidates asked for are kept: a router asks for the same list (its available replicas)
        every time."""
        if self._index is None or self._index[0] != candidates:
            rows = np.fromiter((self._loads[r]._row for r in candidates), np.intp, len(candidates))
            first = bool((rows == np.arange(len(rows))).all())
            self._index = (list(candidates), slice(0, len(rows)) if first else rows,
                           {r: i for i, r in enumerate(candidates)})
        _, rows, positions = self._index
        return self._value[rows], positions


@dataclass(slots=True)
class Decision:
    replica_id: str
    reason: str                 # one of REASONS
    matched_blocks: int = 0
    tier_blocks: int = 0        # after the matched ones, in the replica's offload tier
    # A peer replica of the pool whose cache holds more of the prompt: (its id, the hashes of the
    # leading blocks it holds), for the chosen replica to pull (RequestRouter.generate).
    peer: tuple[str, list[bytes]] | None = None
    # The prompt's block hash chain it was routed on (RequestRouter.route): passed to the replica
    # with the request, whose engine takes it instead of hashing the prompt again.
    block_hashes: list[bytes] | None = None


class RoutingPolicy:
    def __init__(self, config: PolicyConfig | None = None, max_num_seqs: int = 64) -> None:
        self.config = config or PolicyConfig()
        self.max_num_seqs = max_num_seqs     # a full KV cache weighs this many requests (its router's Loads)
        self._rng = random.Random(self.config.seed)
        self._rr = itertools.count()

    def choose(self, matched: dict[str, int], num_prompt_blocks: int, loads: Loads,
               cached_blocks: Mapping[str, int] | Callable[[Sequence[str]], Sequence[int]] | None = None,
               holds_adapter: set[str] | None = None, tier_matched: dict[str, int] | None = None,
               candidates: Sequence[str] | None = None, matched_default: int = 0) -> Decision:
        """matched: replica id -> leading prompt blocks it holds (a key for every candidate);
        loads: the pool's (a row for every candidate);
        cached_blocks: replica id -> blocks in its prefix cache, a mapping or a function of a list of
        replica ids giving theirs (tie-breaker); holds_adapter: the replicas that ran the request's
        LoRA adapter lately (None: a request of the base model); tier_matched: replica id -> blocks
        after those its offload tier holds; candidates: the replicas to choose among, in a stable
        order (default: matched's keys, sorted); matched_default: the blocks of a candidate
        `matched` leaves out (PrefixIndex.match_sparse). One pass over the candidates (a router of hundreds of replicas
        does this per request, scored as numpy columns: benchmarks/router_decision.py)."""
        candidates = sorted(matched) if candidates is None else candidates
        if not candidates:
            raise RuntimeError("no replica to route to")
        name = self.config.name
        if name == "round_robin":
            return Decision(candidates[next(self._rr) % len(candidates)], "round_robin")
        vals, positions = loads.values_of(candidates)
        if name == "least_load":
            return Decision(self._pick_min(candidates, vals), "least_load")
        tiers = tier_matched or {}
        held = holds_adapter or ()
        high, low = float(vals.max()), float(vals.min())
        if high - low > self.config.imbalance_threshold:
            r = self._pick_min(candidates, vals)
            return Decision(r, "imbalance", matched.get(r, matched_default), tiers.get(r, 0))
        blocks = max(num_prompt_blocks, 1)
        w = self.config.load_weight / max(high, 1.0)
        tw, aw = self.config.tier_weight, self.config.adapter_weight

        def score(r: str, load: float) -> float:
            return ((matched.get(r, matched_default) + tw * tiers.get(r, 0)) / blocks - w * load
                    + aw * (r in held))

        # The candidates `matched`, `tiers` and `held` name (a few, from a sparse match) are scored
        # one by one; every other one scores `matched_default` less its load, so the least loaded
        # of them are the best of them. Both give the floats one formula over all would.
        named = {i: r for r in itertools.chain(matched, tiers, held) if (i := positions.get(r)) is not None}
        if not named and (w == 0 or high == low):
            tied = candidates                       # all alike (an idle pool, a prompt no one holds)
        elif len(named) * 4 < len(candidates):
            scores = {i: score(r, vals[i]) for i, r in named.items()}
            rest = matched_default / blocks - w * low
            best = max(rest, *scores.values()) if scores else rest
            tied_at = [i for i, s in scores.items() if s == best]
            if rest == best:
                at_low = vals == low if w > 0 else np.ones(len(candidates), bool)
                at_low[list(named)] = False
                tied_at += np.flatnonzero(at_low).tolist()
            tied = _at(candidates, sorted(tied_at))
        else:
            dense = np.fromiter(map(score, candidates, vals.tolist()), float, len(candidates))
            tied = _at(candidates, np.flatnonzero(dense == dense.max()))
        if cached_blocks is not None and len(tied) > 1:
            counts = np.asarray(cached_blocks(tied) if callable(cached_blocks)
                                else list(map(cached_blocks.get, tied, repeat(0))))
            tied = _at(tied, np.flatnonzero(counts == counts.min()))
        r = tied[0] if len(tied) == 1 else self._rng.choice(tied)
        num = matched.get(r, matched_default)
        reason = ("prefix_hit" if num else "tier_hit" if tiers.get(r) else "adapter_hit" if r in held
                  else "no_hit_least_cost")
        return Decision(r, reason, num, tiers.get(r, 0))

    def _pick_min(self, candidates: Sequence[str], vals: np.ndarray) -> str:
        lowest = _at(candidates, np.flatnonzero(vals == vals.min()))
        return lowest[0] if len(lowest) == 1 else self._rng.choice(lowest)


def _at(candidates: Sequence[str], indices: np.ndarray | list[int]) -> Sequence[str]:
    """The candidates at `indices` (in order)."""
    if len(indices) == len(candidates):
        return candidates
    return [candidates[i] for i in (indices.tolist() if isinstance(indices, np.ndarray) else indices)]
