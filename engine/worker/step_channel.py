"""StepChannel: the per-step messages between an engine and its worker actors, over TCP.

Ray places and supervises the worker actors; a Ray call per worker per step, though, costs about
1.5 ms here (task submission, the reply object, the get), which is most of a small model's decode
step. So after setup each worker runs one long call, `Worker.serve_steps`, which connects back to
the engine's channel and then loops: read a frame (the pickled SchedulerOutput, the same bytes for
every rank), run the step, write a frame back (`(True, output)` from the driver rank, `(True, None)`
from the others, `(False, traceback)` when the step raised). A frame is an 8-byte big-endian length
and the bytes.

A worker whose process dies closes its socket, so the engine sees it at once (EngineDeadError)
rather than waiting on a collective that will never finish; every second without replies it also
asks `is_dead()` (the executor checks the workers' Ray tasks).
"""
from __future__ import annotations

import select
import socket
import struct
from collections.abc import Callable

from records.errors import ChannelClosed

_HEADER = struct.Struct("!Q")



def send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(_HEADER.pack(len(payload)) + payload)


def recv_frame(sock: socket.socket) -> bytes:
    """One whole frame; ChannelClosed at end of stream."""
    (size,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    return _recv_exact(sock, size)


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        try:
            n = sock.recv_into(view[got:], size - got)
        except ConnectionResetError as e:
            raise ChannelClosed(str(e)) from None
        if n == 0:
            raise ChannelClosed("connection closed")
        got += n
    return bytes(buf)


def connect(host: str, port: int, rank: int) -> socket.socket:
    """The worker's end: connect to the engine's channel and say which rank this is."""
    sock = socket.create_connection((host, port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    send_frame(sock, rank.to_bytes(4, "big"))
    return sock


class StepChannel:
    """The engine's end: one connection per worker rank."""

    def __init__(self, host: str) -> None:
        self._server = socket.create_server((host, 0))
        self.address = (host, self._server.getsockname()[1])
        self.socks: list[socket.socket] = []

    def accept(self, num_ranks: int, timeout_s: float, is_dead: Callable[[], str | None]) -> None:
        """Wait for every rank to connect (raises ChannelClosed if `is_dead` reports a failure or
        `timeout_s` passes first)."""
        socks: dict[int, socket.socket] = {}
        self._server.settimeout(1.0)
        waited = 0.0
        while len(socks) < num_ranks:
            try:
                sock, _ = self._server.accept()
            except TimeoutError:
                waited += 1.0
                reason = is_dead() or (f"only {len(socks)} of {num_ranks} workers connected within "
                                       f"{timeout_s:.0f} s" if waited >= timeout_s else None)
                if reason:
                    raise ChannelClosed(reason) from None
                continue
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            socks[int.from_bytes(recv_frame(sock), "big")] = sock
        self.socks = [socks[r] for r in range(num_ranks)]
        self._server.close()

    def broadcast(self, payload: bytes) -> None:
        frame = _HEADER.pack(len(payload)) + payload
        for rank, sock in enumerate(self.socks):
            try:
                sock.sendall(frame)
            except OSError as e:
                raise ChannelClosed(f"worker rank {rank}: {e}") from None

    def gather(self, is_dead: Callable[[], str | None]) -> list[bytes]:
        """One reply frame from every rank, in rank order. ChannelClosed names the rank whose
        connection closed, or what `is_dead` reported."""
        replies: list[bytes | None] = [None] * len(self.socks)
        pending = {sock: rank for rank, sock in enumerate(self.socks)}
        while pending:
            ready, _, _ = select.select(list(pending), [], [], 1.0)
            if not ready:
                reason = is_dead()
                if reason:
                    raise ChannelClosed(reason)
                continue
            for sock in ready:
                rank = pending.pop(sock)
                try:
                    replies[rank] = recv_frame(sock)
                except ChannelClosed as e:
                    raise ChannelClosed(f"worker rank {rank} closed its connection ({e}): its process "
                                        f"died") from None
        return replies  # type: ignore[return-value]

    def close(self) -> None:
        for sock in self.socks:
            sock.close()
        self.socks = []
        self._server.close()
