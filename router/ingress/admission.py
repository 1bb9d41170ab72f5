"""Admission: the ingress's count of requests in flight, held by tickets that cannot leak.

Every admitted request holds a `Ticket` until it ends. `Ticket.release()` is idempotent and is called
on every exit path: the end of a stream or of a response, an error, a client that disconnects before
or after the first byte, a cancellation by Serve's proxy. It never awaits anything: under anyio (which
runs Starlette's responses) a cancelled task is cancelled again at every later `await`, so a release
placed after an `await` in a `finally` block is skipped, and the count leaks (a client that drops
hundreds of streams used to lock the server out with 429s). A ticket that is dropped unreleased (a
streaming body that never started) releases itself when it is garbage collected.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from router.routing.request_trace import RequestTrace


class Ticket:
    """`count` admitted requests; `release()` gives them back once, however often it is called."""

    __slots__ = ("_admission", "arrival", "count", "trace")

    def __init__(self, admission: Admission, count: int) -> None:
        self._admission: Admission | None = admission
        self.count = count
        self.trace: RequestTrace | None = None     # held until released (router/routing/request_trace.py)
        self.arrival: float | None = None          # when its request reached the endpoint (time.monotonic())

    def release(self) -> None:
        admission, self._admission = self._admission, None
        if admission is not None:
            admission._release(self.count)
            if self.trace is not None:
                self.trace.release()

    @property
    def released(self) -> bool:
        return self._admission is None

    def __del__(self) -> None:
        self.release()


class Admission:
    """At most `limit` requests in flight; `on_change(in_flight)` is told every change (a gauge)."""

    def __init__(self, limit: int, on_change: Callable[[int], None] = lambda _: None) -> None:
        self.limit = limit
        self.in_flight = 0
        self.on_change = on_change

    def admit(self, count: int) -> Ticket | None:
        """A ticket for `count` more requests, or None when they do not fit under the limit now."""
        if self.in_flight + count > self.limit:
            return None
        self.in_flight += count
        self.on_change(self.in_flight)
        return Ticket(self, count)

    def _release(self, count: int) -> None:
        self.in_flight -= count
        assert self.in_flight >= 0, "released more requests than admitted"
        self.on_change(self.in_flight)
