"""The worker side of a simulated engine's KV connector (engine/executor/simulated.py): the whole
protocol runs (leases, pulls, releases, timeouts, the failure policy) but no bytes move.

A pull takes the time the simulation profile gives its bytes over the KV link, then counts as done
if the prefill engine still holds its lease (checked where that engine lives in this process; a
remote one is taken at its word). The release goes to the prefill engine's worker directly when it
lives in this process (`pdserve simulate` runs every engine in one; a simulated replica host runs
several), else as one UDP datagram to the address its transfer parameters carry (simulated
replicas in other processes); a lost datagram costs only the lease's expiry.
"""
from __future__ import annotations

import socket
import struct
import weakref
from collections.abc import Callable
from typing import Any

import records.clock as clock
from kv_transfer.base import KVConnectorWorker, advertised_host
from records.config import KVTransferConfig
from records.kv_layout import KVLayout
from records.transfer import LoadSpec, RemotePrefill, TransferReport

_RELEASE = struct.Struct("<qq")         # (lease slot, lease token)
# The simulated workers of this process, by engine id: a release to one of them is a call.
_LOCAL: weakref.WeakValueDictionary[str, SimulatedKVWorker] = weakref.WeakValueDictionary()


class SimulatedKVWorker(KVConnectorWorker):
    name = "simulated"

    def __init__(self, config: KVTransferConfig, layout: KVLayout, block_bytes: int,
                 transfer_time: Callable[[float], float]) -> None:
        """block_bytes: one KV block of the simulated model over every rank; transfer_time: seconds
        a pull of that many bytes takes (the profile's KV link)."""
        super().__init__(config, layout)
        self.block_bytes = block_bytes
        self.transfer_time = transfer_time
        self.pulls: list[tuple[float, LoadSpec]] = []    # (when it is done, clock.monotonic), in order
        self._inbox: list[tuple[int, int]] = []          # releases delivered in this process
        # Called when a release reaches this worker in-process (a virtual-time replay wakes the engine).
        self.on_release: Callable[[], None] | None = None
        self.host = advertised_host(config.kv_host)
        # Under a virtual clock every engine is in this process (a replay of hundreds): no socket.
        self._sock: socket.socket | None = None
        if not clock.is_virtual():
            self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            self._sock.bind((self.host, 0))
            self._sock.setblocking(False)
        _LOCAL[self.engine_id] = self

    def address(self) -> dict[str, Any]:
        port = self._sock.getsockname()[1] if self._sock is not None else 0
        return {"engine": self.engine_id, "host": self.host, "port": port}

    def _start_load(self, spec: LoadSpec) -> None:
        done = clock.monotonic() + self.transfer_time(len(spec.local_block_ids) * self.block_bytes)
        self.pulls.append((done, spec))

    def next_event_at(self) -> float | None:
        """When the next pull is done (clock.monotonic()), None without pulls."""
        return min((done for done, _ in self.pulls), default=None)

    def release_remote(self, remote: RemotePrefill) -> None:
        peer_address = remote.addresses[0]
        peer = _LOCAL.get(peer_address.get("engine", ""))
        if peer is not None:
            peer.deliver(remote.lease_slot, remote.lease_token)
            return
        if self._sock is None or not peer_address.get("port"):
            return                  # nowhere to send it: the lease expires on its own
        try:
            self._sock.sendto(_RELEASE.pack(remote.lease_slot, remote.lease_token),
                              (peer_address["host"], int(peer_address["port"])))
        except OSError:
            pass            # the prefill engine is gone, or its lease expires on its own

    def deliver(self, slot: int, token: int) -> None:
        """A release from a decode engine of this process."""
        self._inbox.append((slot, token))
        if self.on_release is not None:
            self.on_release()

    def _poll(self) -> TransferReport:
        report = TransferReport()
        now = clock.monotonic()
        if self.pulls:
            waiting = []
            for done, spec in self.pulls:
                if done > now:
                    waiting.append((done, spec))
                elif done > spec.deadline:
                    report.failed.append((spec.request_id, f"timed out after {self.config.load_timeout_s:g} s"))
                elif not self._lease_live(spec.remote):
                    report.failed.append((spec.request_id, "the prefill engine let its lease go before the pull"))
                else:
                    report.loaded.append(spec.request_id)
            self.pulls = waiting
        report.released, self._inbox = self._inbox, []
        while self._sock is not None:
            try:
                data = self._sock.recv(64)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                break
            if len(data) == _RELEASE.size:
                report.released.append(_RELEASE.unpack(data))
        return report

    @staticmethod
    def _lease_live(remote: RemotePrefill) -> bool:
        peer = _LOCAL.get(remote.addresses[0].get("engine", ""))
        return peer is None or peer.leases.is_live(remote.lease_slot, remote.lease_token)

    def shutdown(self) -> None:
        _LOCAL.pop(self.engine_id, None)
        if self._sock is not None:
            self._sock.close()
