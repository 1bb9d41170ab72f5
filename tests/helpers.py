"""What the tests that start servers share: a free loopback port, and waiting for /health."""
from __future__ import annotations

import socket
import time
from collections.abc import Callable

import httpx


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base: str, timeout_s: float = 180.0, check: Callable[[], None] | None = None,
                 poll_s: float = 0.5) -> None:
    """Wait until GET {base}/health answers 200. `check` runs between polls and raises when waiting
    is pointless (the server process exited, its job failed); AssertionError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        if check is not None:
            check()
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{base} never became healthy within {timeout_s:g} s"
        time.sleep(poll_s)
