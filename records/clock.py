"""The clock an engine, its KV connector and the router read: this process's own (`time.monotonic`,
`time.time`), or a virtual one that a simulation advances.

`pdserve simulate` (cluster/sim/replay.py) runs hundreds of real engines and routers in one process
in virtual time: nothing sleeps, and the clock jumps from one event to the next. Everything that
decides by time (lease expiry, pull deadlines) or measures it (arrival, first token, the latency
histograms the planner reads) reads this module, so that the same code runs in both.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

# What a virtual clock's wall time starts from (any fixed value: leases compare wall times of one
# process only under a simulation).
VIRTUAL_EPOCH = 1_700_000_000.0


class VirtualClock:
    """Time that passes only when told to. A replay (cluster/sim/replay.py) sets `now` to each
    event's time, in time order across its engines; within one engine's step the clock reads the
    step's start while it is scheduled and its end once the executor has run it (`advance`), so
    what the engine stamps on its outputs (first token, the latency histograms) is when they exist."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start


_virtual: VirtualClock | None = None


def monotonic() -> float:
    """Seconds on a monotonic clock (`time.monotonic`, or the virtual clock's)."""
    return time.monotonic() if _virtual is None else _virtual.now


def wall() -> float:
    """Seconds since the epoch (`time.time`, or the virtual clock's, from VIRTUAL_EPOCH)."""
    return time.time() if _virtual is None else VIRTUAL_EPOCH + _virtual.now


def is_virtual() -> bool:
    return _virtual is not None


def advance(t: float) -> None:
    """Move the virtual clock forward to `t` (a simulated step's end); nothing in real time."""
    if _virtual is not None and t > _virtual.now:
        _virtual.now = t


@contextlib.contextmanager
def virtual(clock: VirtualClock) -> Iterator[VirtualClock]:
    """Run the block on `clock` (this process only; not re-entrant)."""
    global _virtual
    assert _virtual is None, "a virtual clock is already in use"
    _virtual = clock
    try:
        yield clock
    finally:
        _virtual = None
