"""The prefix index and the routing policies (unit; the router's request paths on a model's config
are in tests/cluster/test_router_paths.py)."""
from __future__ import annotations

import pytest

from records.hashing import hash_block_tokens
from records.kv_events import AllCleared, BlockRemoved, BlockStored
from records.serving import PolicyConfig
from router.routing.policy import Loads, RoutingPolicy
from router.routing.prefix_index import PrefixIndex


def test_prefix_index_follows_events_exactly():
    h = hash_block_tokens(list(range(64)), 16)
    index = PrefixIndex()
    index.apply("a", [BlockStored(h[:3])])
    index.apply("b", [BlockStored(h), BlockRemoved([h[3], h[2]])])    # evicted tail first, as engines do
    assert index.match(h) == {"a": 3, "b": 2}
    index.apply("a", [AllCleared(), BlockStored(h[:1])])
    assert index.match(h) == {"a": 1, "b": 2}
    index.remove_replica("b")
    assert index.match(h) == {"a": 1}


def test_prefix_index_runs_at_every_length_match_a_walk():
    """Runs found by galloping equal a block-by-block walk's, for replicas holding runs of every
    length of a long prompt (and the sparse form names only those off the common length)."""
    import random

    rng = random.Random(0)
    h = hash_block_tokens(list(range(16 * 300)), 16)
    index, want = PrefixIndex(), {}
    for i in range(40):
        n = rng.choice([0, 1, 2, 299, 300, rng.randrange(300)])
        index.apply(f"r{i}", [BlockStored(h[:n]), BlockStored(hash_block_tokens([i] * 32, 16))])
        want[f"r{i}"] = n
    assert index.match(h) == want
    sparse, default = index.match_sparse(h)
    assert {r: sparse.get(r, default) for r in want} == want
    assert index.num_blocks_of(["r0", "gone"]).tolist() == [want["r0"] + 2, 0]


def test_policy_prefers_prefix_until_load_is_imbalanced():
    policy = RoutingPolicy(PolicyConfig(seed=0, imbalance_threshold=4), max_num_seqs=8)
    idle = Loads(["a", "b"], max_num_seqs=8)
    d = policy.choose({"a": 0, "b": 5}, 6, idle)
    assert (d.replica_id, d.reason, d.matched_blocks) == ("b", "prefix_hit", 5)
    busy = Loads(["a", "b"], max_num_seqs=8)
    busy["b"].in_flight = 6
    assert policy.choose({"a": 0, "b": 5}, 6, busy).reason == "imbalance"
    assert policy.choose({"a": 0, "b": 5}, 6, busy).replica_id == "a"
    seen = {RoutingPolicy(PolicyConfig(seed=s)).choose({"a": 0, "b": 0}, 2, idle).replica_id for s in range(20)}
    assert seen == {"a", "b"}                                   # ties break at random
    rr = RoutingPolicy(PolicyConfig("round_robin"))
    assert [rr.choose({"a": 9, "b": 0}, 9, idle).replica_id for _ in range(4)] == ["a", "b", "a", "b"]
    with pytest.raises(ValueError, match="routing policy must be one of"):
        PolicyConfig("random")


def test_policy_picks_as_one_formula_over_every_replica():
    """The policy scores the few replicas a sparse match names one by one and the rest by their
    load; its picks equal the docstring's formula evaluated over every candidate (the tie-break
    too), on random pools: loads with ties, sparse and dense matches, tiers, adapters, down
    replicas, a zero load weight, and replicas that left and came back (rows reused)."""
    import random

    rng = random.Random(1)
    for case in range(400):
        n = rng.choice([1, 2, 5, 40])
        ids = [f"r{i}" for i in range(n)]
        config = PolicyConfig(seed=case, load_weight=rng.choice([0.0, 0.5, 1.0]), imbalance_threshold=8)
        loads = Loads(["gone"], max_num_seqs=8)
        loads["gone"].started(0)
        left = loads.pop("gone")                     # its row is reused by r0, which starts idle
        for r in ids:
            if rng.random() < 0.5:
                loads.add(r).in_flight = rng.choice([0, 1, 3])
                loads[r].kv_usage = rng.choice([0.0, 0.0, 0.25, 0.5])
            else:
                loads.add(r)
        left.ended()                                 # a stream that outlived its replica's row
        assert left.in_flight == 0
        candidates = [r for r in ids if rng.random() > 0.2] or ids[:1]
        default = rng.choice([0, 2])
        named = rng.sample(ids, min(n, rng.choice([0, 1, 2, n])))
        matched = {r: rng.choice([0, 2, 5, 6]) for r in named}
        tiers = {r: rng.choice([0, 3]) for r in rng.sample(ids, rng.choice([0, 1]))}
        held = set(rng.sample(ids, rng.choice([0, 0, 1]))) or None
        counts = {r: rng.choice([10, 11]) for r in ids}
        got = RoutingPolicy(config, 8).choose(matched, 6, loads, counts, held, tiers, candidates, default)

        # The reference: the formula over every candidate, in candidate order, then the same rng.
        vals = [loads[r].in_flight + loads[r].kv_usage * 8 for r in candidates]
        high, low = max(vals), min(vals)
        ref = random.Random(case)
        if high - low > config.imbalance_threshold:
            continue
        w = config.load_weight / max(high, 1.0)
        scores = [(matched.get(r, default) + config.tier_weight * tiers.get(r, 0)) / 6 - w * v
                  + config.adapter_weight * (r in (held or ())) for r, v in zip(candidates, vals)]
        tied = [r for r, sc in zip(candidates, scores) if sc == max(scores)]
        fewest = min(counts[r] for r in tied)
        tied = [r for r in tied if counts[r] == fewest]
        want = tied[0] if len(tied) == 1 else ref.choice(tied)
        assert got.replica_id == want, (case, got, want)


def test_policy_prefers_replicas_holding_the_adapter():
    policy = RoutingPolicy(PolicyConfig(seed=0), max_num_seqs=8)
    idle = Loads(["a", "b"], max_num_seqs=8)
    d = policy.choose({"a": 0, "b": 0}, 4, idle, holds_adapter={"b"})
    assert (d.replica_id, d.reason) == ("b", "adapter_hit")
    # A real prefix hit elsewhere outweighs it (half the prompt against the adapter's 0.25) ...
    assert policy.choose({"a": 2, "b": 0}, 4, idle, holds_adapter={"b"}).replica_id == "a"
    # ... and so does load: b busy with half of max_num_seqs more than a.
    busy = Loads(["a", "b"], max_num_seqs=8)
    busy["b"].in_flight = 4
    assert policy.choose({"a": 0, "b": 0}, 4, busy, holds_adapter={"b"}).replica_id == "a"
    with pytest.raises(ValueError, match="adapter_weight"):
        PolicyConfig(adapter_weight=-1)
