"""A model's sleep as one ingress replica sees it (vLLM's `/sleep`, `/wake_up`, `/is_sleeping`,
per model; the manager's cluster/sleep.py puts the replicas to sleep and wakes them).

A request for a sleeping model is held, not failed: `Frontend.admit` waits for `wake()` when this
ingress put the model to sleep, and a request that reaches a replica put to sleep through another
ingress replica comes back with ModelAsleepError, wakes the model and is sent again. Every request
waiting shares one wake.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from records.errors import InvalidRequestError, ModelAsleepError, ServiceUnavailableError

# How many times one prompt is sent again after waking its model (a second sleep may come between).
WAKE_RETRIES = 2


def replica_asleep(error: BaseException) -> bool:
    """Whether a replica refused a request because it sleeps (through Ray's wrapper too)."""
    return isinstance(error, ModelAsleepError) or isinstance(getattr(error, "cause", None), ModelAsleepError)


class ModelSleepLink:
    """`manager()`: the model's manager handle (ServiceUnavailableError while it is not attached);
    `in_flight()`: this ingress's requests of the model in flight."""

    def __init__(self, manager: Callable[[], Any], in_flight: Callable[[], int]) -> None:
        self.manager, self.in_flight = manager, in_flight
        self.asleep = False         # put to sleep through this ingress, or a replica said so
        self._waking: asyncio.Task | None = None

    async def sleep(self, level: int, drain_s: float = 30.0) -> dict[str, Any]:
        """Put the model to sleep: new requests are held at once; those in flight here finish (up to
        `drain_s`); then every replica sleeps. InvalidRequestError naming why when one is still busy
        or the level is not 1 or 2 (the model stays awake)."""
        manager = self.manager()
        self.asleep = True
        deadline = time.monotonic() + drain_s
        while self.in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        try:
            return await manager.sleep.remote(level)
        except Exception as e:
            self.asleep = False
            cause = getattr(e, "cause", None) or e
            if isinstance(cause, ValueError):
                raise InvalidRequestError(str(cause), param="level" if "level must" in str(cause) else None) from None
            raise

    async def wake(self) -> dict[str, Any]:
        """Wake the model (every caller shares one wake); ServiceUnavailableError if it cannot."""
        if self._waking is None:
            self._waking = asyncio.get_running_loop().create_task(self._wake())
        waking = self._waking
        try:
            return await asyncio.shield(waking)
        finally:
            if waking.done() and self._waking is waking:
                self._waking = None

    async def _wake(self) -> dict[str, Any]:
        try:
            out = await self.manager().wake.remote()
        except Exception as e:  # noqa: BLE001 - what the client of a held request is told
            cause = getattr(e, "cause", None) or e
            raise ServiceUnavailableError(f"the model did not wake: {cause}") from None
        self.asleep = False
        return out

    async def is_sleeping(self) -> dict[str, Any]:
        """vLLM's /is_sleeping, from the manager (what every ingress replica shares)."""
        return await self.manager().is_sleeping.remote()
