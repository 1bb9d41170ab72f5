"""A running model's pools brought to a changed spec in place (`ClusterManager.apply`): a pool whose
replicas are made the same (`PoolSpec.identity`, the engine config) is only resized; the others are
replaced rolling (`EnginePool.bring_up_new`: the new replicas of every replaced pool load beside
the old, then serve, and the old drain), the pools of a disaggregated spec together, so that a
prefill replica never hands KV to a decode replica of another model; pools the spec drops drain
and stop, pools it adds start.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable

from cluster.config import ClusterConfig
from cluster.pool import EnginePool, pool_tag


async def reconcile_pools(pools: dict[str, EnginePool], old: ClusterConfig, new: ClusterConfig,
                          place_timeout_s: float, on_change: Callable[[], None]) -> dict[str, str]:
    """Change `pools` (pool name -> its EnginePool, updated in place) from `old`'s spec to `new`'s;
    what was done to each pool, in words. If a replaced pool's new replicas cannot start, nothing
    changes and this raises."""
    drain_s = new.drain_timeout_s
    done: dict[str, str] = {}
    engine_configs = {name: await asyncio.to_thread(new.engine_config, name) for name in new.pools}
    replace = {name: spec for name, spec in new.pools.items() if name in pools
               and pool_tag(name, spec, engine_configs[name]) != pools[name].tag}
    await asyncio.gather(*[pools[name].bring_up_new(spec, engine_configs[name], place_timeout_s)
                           for name, spec in replace.items()])
    for name, spec in replace.items():
        done[name] = f"replaced {', '.join(pools[name].swap_in(spec, engine_configs[name], drain_s))}"
    for name in [n for n in pools if n not in new.pools]:          # pools the spec dropped
        pool = pools.pop(name)
        await asyncio.gather(*[pool.drain_replica(r, drain_s) for r in list(pool.replicas)])
        pool.shutdown()
        done[name] = "removed"
    for name, spec in new.pools.items():
        pool = pools.get(name)
        if pool is None:                                                 # pools the spec added
            pool = pools[name] = EnginePool(name, spec, engine_configs[name], new.name, on_change=on_change)
            pool.target = 0
        lo, hi = spec.bounds()
        same_size = name in old.pools and old.pools[name].replicas == spec.replicas
        target = min(max(pool.target, lo), hi) if same_size and pool.target else spec.replicas
        pool.spec = spec
        if target != pool.target:
            await pool.scale(target, drain_s)
            done.setdefault(name, f"resized to {target}")
    return done
