"""A model's sleep mode across its pools (vLLM's `/sleep`, `/wake_up`, `/is_sleeping`, here per
model): the manager's `ModelSleep` puts every replica of the model's pools to sleep together and
wakes them together (cluster/replica.py: `EngineReplica.sleep` says what each level frees).

Sleep is all or nothing: a replica that refuses (a request, lease or transfer still under way)
wakes those already asleep again and the refusal reaches the caller, so a model is never half
asleep. Wake is idempotent and shared: every caller waiting on one wake (the ingress holds a
request for a sleeping model until its wake returns, then sends it).
"""
from __future__ import annotations

import asyncio
import time
from typing import Any

from records.single_flight import SingleFlight

LEVELS = (1, 2)


class ModelSleep:
    """The sleep level of one model's replicas (0: awake) and the wake under way, if any."""

    def __init__(self) -> None:
        self.level = 0
        self._waking: SingleFlight[dict[str, Any]] = SingleFlight()
        self.last_wake_s: float | None = None

    async def sleep(self, replicas: dict[str, Any], level: int) -> dict[str, Any]:
        """Put every replica (replica id -> EngineReplica actor handle) to sleep at `level`; each
        one's resident memory after (bytes). ValueError naming a replica that refused."""
        if level not in LEVELS:
            raise ValueError(f"level must be 1 or 2; got {level!r}")
        await self._waking.join()
        ids = list(replicas)
        results = await asyncio.gather(*[replicas[r].sleep.remote(level) for r in ids], return_exceptions=True)
        refused = [(r, res) for r, res in zip(ids, results) if isinstance(res, BaseException)]
        if refused:
            await asyncio.gather(*[replicas[r].wake.remote() for r in ids], return_exceptions=True)
            replica, error = refused[0]
            cause = getattr(error, "cause", None) or error
            raise ValueError(f"cannot sleep: {cause}" if replica in str(cause) else f"cannot sleep: {replica}: {cause}")
        self.level = level
        return {"level": level, "rss_bytes": {r: res["rss_bytes"] for r, res in zip(ids, results)}}

    async def wake(self, replicas: dict[str, Any]) -> dict[str, Any]:
        """Wake every replica (concurrent calls share one wake); the seconds it took."""
        return await self._waking.run(lambda: self._wake(replicas))

    async def _wake(self, replicas: dict[str, Any]) -> dict[str, Any]:
        began = time.monotonic()
        results = await asyncio.gather(*[h.wake.remote() for h in replicas.values()])
        self.level = 0
        self.last_wake_s = time.monotonic() - began
        return {"level": 0, "wake_s": self.last_wake_s,
                "rss_bytes": {r: res["rss_bytes"] for r, res in zip(replicas, results)}}
