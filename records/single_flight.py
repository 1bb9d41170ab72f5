"""One run of an async job at a time, shared by every caller that asks while it runs: a model's
wake, its start from zero (router/ingress/cold_model.py, cluster/sleep.py, cluster/scale_to_zero.py,
cluster/replica.py)."""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class SingleFlight(Generic[T]):
    """`run(start)` starts `start()` unless a run is under way, and returns that run's result (or
    raises its error) to every caller; a caller cancelled while waiting does not cancel the run."""

    def __init__(self) -> None:
        self._task: asyncio.Task | None = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def join(self) -> None:
        """Wait for the run under way, if any (raising its error), without starting one."""
        task = self._task
        if task is not None and not task.done():
            await asyncio.shield(task)

    async def run(self, start: Callable[[], Awaitable[T]]) -> T:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(start())
        task = self._task
        try:
            return await asyncio.shield(task)
        finally:
            if task.done() and self._task is task:
                self._task = None
