"""A model that is not serving right now, as one ingress replica sees it: put to sleep (vLLM's
`/sleep`, `/wake_up`, `/is_sleeping`, per model; cluster/sleep.py on the manager) or scaled to zero
(autoscaling's `min_replicas: 0`; cluster/scale_to_zero.py). Either way a request for it is held,
not failed, until the model is back.

Asleep: `Frontend.admit` waits for `wake()` when this ingress put the model to sleep, and a request
that reaches a replica put to sleep through another ingress replica comes back with
ModelAsleepError, wakes the model and is sent again. Scaled to zero: a request that finds no
replica waits for `activate()` (the manager starts one replica per pool), up to the pools'
`cold_start_timeout_s`, then is answered 503 with Retry-After. Every request waiting shares one
wake or start.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from records.errors import InvalidRequestError, ModelAsleepError, ServiceUnavailableError
from records.single_flight import SingleFlight

# How many times one prompt is sent again after waking its model (a second sleep may come between).
WAKE_RETRIES = 2


def replica_asleep(error: BaseException) -> bool:
    """Whether a replica refused a request because it sleeps (through Ray's wrapper too)."""
    return isinstance(error, ModelAsleepError) or isinstance(getattr(error, "cause", None), ModelAsleepError)


class ColdModel:
    """`manager()`: the model's manager handle (ServiceUnavailableError while it is not attached);
    `in_flight()`: this ingress's requests of the model in flight; `cold_start_timeout_s`: how long
    a request waits for a model scaled to zero (None: it does not scale to zero)."""

    def __init__(self, manager: Callable[[], Any], in_flight: Callable[[], int],
                 cold_start_timeout_s: float | None = None) -> None:
        self.manager, self.in_flight = manager, in_flight
        self.cold_start_timeout_s = cold_start_timeout_s
        self.asleep = False         # put to sleep through this ingress, or a replica said so
        self._waking: SingleFlight[dict[str, Any]] = SingleFlight()
        self._activating: SingleFlight[dict[str, dict[str, Any]]] = SingleFlight()

    @property
    def scales_to_zero(self) -> bool:
        return self.cold_start_timeout_s is not None

    async def activate(self) -> dict[str, dict[str, Any]]:
        """Bring the model back from zero (every caller shares one start): the pools' replicas
        (pool -> replica id -> handle) once each pool serves; ServiceUnavailableError with
        Retry-After when it does not come up within `cold_start_timeout_s`."""
        return await self._activating.run(self._activate)

    async def _activate(self) -> dict[str, dict[str, Any]]:
        timeout = self.cold_start_timeout_s or 0.0
        try:
            return await asyncio.wait_for(self.manager().activate.remote(), timeout)
        except Exception as e:  # noqa: BLE001 - what the client of a held request is told
            cause = getattr(e, "cause", None) or e
            why = f"did not start within {timeout:g} s" if isinstance(e, asyncio.TimeoutError) else f"failed: {cause}"
            error = ServiceUnavailableError(f"the model is scaled to zero and its start {why}; retry later")
            error.retry_after = min(60.0, timeout)          # type: ignore[attr-defined]
            raise error from None

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
        return await self._waking.run(self._wake)

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
