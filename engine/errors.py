"""The engine's exception types (a record layer: no torch, no engine internals).

Two failures must never be confused (DESIGN, style 7): the engine is dead (every request on it fails,
the replica is replaced) or one request failed (its stream ends with an error, every other request
and the engine go on). Bad user input is a plain ValueError naming the field, raised before anything
is queued.
"""
from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine can no longer run steps (a worker died, or steps keep failing); every in-flight
    request fails with it."""


class RequestFailedError(RuntimeError):
    """One request failed while it ran (a step could not serve it); its blocks are freed and the
    engine keeps serving every other request."""
