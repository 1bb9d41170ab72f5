"""torch.distributed connector: blocks move point-to-point over a two-rank process group per
(prefill engine, decode engine) pair: gloo on CPU, NCCL on GPU.

Each worker hosts a TCPStore (its `address()`); the store's queue is its control inbox. A decode
worker D reaching prefill worker P for the first time pushes `connect` into P's inbox and both build a
pair group over that store (P rank 0, D rank 1). To pull, D pushes `pull` (lease slot, token, block
ids) and waits for a header and the data; P, on its engine thread between steps, checks the lease is
still live, gathers the blocks into one contiguous buffer, releases the lease (the copy is taken), and
hands the buffer to the pair's sender thread. D scatters the received buffer into its blocks on its
own engine thread. A dead or slow peer costs a timed-out pull (then the failure policy), never a step:
the network waits happen on one thread per pair.
"""
from __future__ import annotations

import json
import logging
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from engine.config import KVTransferConfig
from kv_transfer.base import KVConnectorWorker, KVLayout, LoadSpec, RemotePrefill, TransferReport

logger = logging.getLogger(__name__)

INBOX = "pdserve/inbox"
OK, LEASE_GONE = 0, 1


class LeaseGoneError(RuntimeError):
    """The prefill side no longer holds the blocks (released, aborted or expired)."""


@dataclass(slots=True)
class _Pair:
    """One peer engine: its pair group, built and used on the pair's own thread."""
    key: str                                  # unique per pair incarnation: PrefixStore namespace
    rank: int
    thread: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1))
    group: Any = None
    client: Any = None                        # D side: the TCPStore client of P's inbox
    broken: bool = False


class TorchDistConnectorWorker(KVConnectorWorker):
    name = "torch_dist"

    def __init__(self, config: KVTransferConfig, layout: KVLayout) -> None:
        super().__init__(config, layout)
        self.timeout = timedelta(seconds=config.load_timeout_s)
        self.store = dist.TCPStore(config.kv_host, 0, is_master=True, wait_for_workers=False,
                                   timeout=self.timeout)
        self.peers: dict[str, _Pair] = {}                    # P side: decode peers by pair key
        self.sources: dict[str, _Pair] = {}                  # D side: prefill engines by engine id
        self.loads: dict[str, tuple[LoadSpec, Future]] = {}  # D side: in-flight pulls
        self.released: list[tuple[int, int]] = []

    def address(self) -> dict[str, Any]:
        return {"host": self.config.kv_host, "port": self.store.port}

    # --- pair groups -----------------------------------------------------------------------------
    def _new_group(self, store: Any, key: str, rank: int) -> Any:
        prefixed = dist.PrefixStore(f"pdserve/pair/{key}", store)
        if self.kv_caches and self.kv_caches[0].is_cuda:
            return dist.ProcessGroupNCCL(prefixed, rank, 2)
        return dist.ProcessGroupGloo(prefixed, rank, 2, self.timeout)

    def _source(self, remote: RemotePrefill) -> _Pair:
        """D side: the pair to the prefill engine, (re)connecting on its thread if needed."""
        pair = self.sources.get(remote.engine_id)
        if pair is None or pair.broken:
            pair = _Pair(uuid.uuid4().hex, rank=1)
            self.sources[remote.engine_id] = pair
            host, port = remote.address["host"], int(remote.address["port"])
            pair.thread.submit(self._connect, pair, host, port)
        return pair

    def _connect(self, pair: _Pair, host: str, port: int) -> None:
        try:
            pair.client = dist.TCPStore(host, port, is_master=False, timeout=self.timeout)
            pair.client.queue_push(INBOX, json.dumps({"op": "connect", "key": pair.key}))
            pair.group = self._new_group(pair.client, pair.key, 1)
        except Exception:
            pair.broken = True
            raise

    # --- D side ----------------------------------------------------------------------------------
    def _start_load(self, spec: LoadSpec) -> None:
        pair = self._source(spec.remote)
        self.loads[spec.request_id] = (spec, pair.thread.submit(self._pull, pair, spec))

    def _pull(self, pair: _Pair, spec: LoadSpec) -> torch.Tensor:
        """On the pair's thread: ask for the blocks, receive them into a fresh buffer."""
        if pair.group is None:
            raise ConnectionError("no connection to the prefill engine")
        try:
            remote = spec.remote
            pair.client.queue_push(INBOX, json.dumps({
                "op": "pull", "key": pair.key, "slot": remote.lease_slot, "token": remote.lease_token,
                "block_ids": spec.remote_block_ids}))
            header = torch.zeros(2, dtype=torch.int64)
            pair.group.recv([header], 0, 0).wait()
            if int(header[0]) != OK:
                raise LeaseGoneError("the prefill engine no longer holds the blocks")
            shape = self.gathered_shape(len(spec.local_block_ids))
            dtype = self.kv_caches[0].dtype
            buf = torch.empty(int(header[1]), dtype=torch.uint8, device=self.kv_caches[0].device)
            pair.group.recv([buf], 0, 0).wait()
            return buf.view(dtype).view(shape)
        except LeaseGoneError:
            raise
        except Exception:
            pair.broken = True
            raise

    def release_remote(self, remote: RemotePrefill) -> None:
        pair = self._source(remote)
        message = json.dumps({"op": "release", "slot": remote.lease_slot, "token": remote.lease_token})
        pair.thread.submit(self._push, pair, message)

    @staticmethod
    def _push(pair: _Pair, message: str) -> None:
        if pair.client is not None:
            pair.client.queue_push(INBOX, message)

    # --- both sides, on the engine thread -----------------------------------------------------------
    def _poll(self) -> TransferReport:
        self._serve_inbox()
        report = TransferReport(released=self.released)
        self.released = []
        now = time.monotonic()
        for rid, (spec, future) in list(self.loads.items()):
            if future.done():
                del self.loads[rid]
                error = future.exception()
                if error is None:
                    self.scatter_blocks(spec.local_block_ids, future.result())
                    report.loaded.append(rid)
                else:
                    report.failed.append((rid, f"{type(error).__name__}: {error}"))
            elif now > spec.deadline:
                # Abandon it: the pair's thread only ever writes its own buffer, never our blocks.
                del self.loads[rid]
                self.sources.get(spec.remote.engine_id, _Pair("", 1)).broken = True
                report.failed.append((rid, f"timed out after {self.config.load_timeout_s} s"))
        return report

    def _serve_inbox(self) -> None:
        """P side: answer connects, pulls and releases queued by decode workers."""
        for key in [k for k, p in self.peers.items() if p.broken]:
            self.peers.pop(key).thread.shutdown(wait=False)
        while self.store.queue_len(INBOX) > 0:
            message = json.loads(self.store.queue_pop(INBOX, block=False))
            op = message["op"]
            if op == "connect":
                pair = _Pair(message["key"], rank=0)
                self.peers[pair.key] = pair
                pair.thread.submit(self._accept, pair)
            elif op == "release":
                if self.leases.is_live(message["slot"], message["token"]):
                    self.released.append((message["slot"], message["token"]))
            elif op == "pull":
                pair = self.peers.get(message["key"])
                if pair is not None:
                    self._serve_pull(pair, message)

    def _accept(self, pair: _Pair) -> None:
        try:
            pair.group = self._new_group(self.store, pair.key, 0)
        except Exception:
            pair.broken = True
            raise

    def _serve_pull(self, pair: _Pair, message: dict[str, Any]) -> None:
        slot, token, block_ids = message["slot"], message["token"], message["block_ids"]
        live = self.leases.is_live(slot, token) and set(block_ids) <= set(self.leases.block_ids[slot])
        data = None
        if live:
            data = self.gather_blocks(block_ids)         # taken now: the lease can end
            self.released.append((slot, token))
        pair.thread.submit(self._send, pair, data)

    @staticmethod
    def _send(pair: _Pair, data: torch.Tensor | None) -> None:
        try:
            if pair.group is None:
                raise ConnectionError("pair group was not established")
            raw = None if data is None else data.reshape(-1).view(torch.uint8)
            header = torch.tensor([OK if raw is not None else LEASE_GONE, 0 if raw is None else raw.numel()],
                                  dtype=torch.int64)
            pair.group.send([header], 1, 0).wait()
            if raw is not None:
                pair.group.send([raw], 1, 0).wait()
        except Exception as e:  # noqa: BLE001 - the decode side times out and recomputes
            logger.warning("KV send to a decode engine failed: %r", e)
            pair.broken = True

    def shutdown(self) -> None:
        for pair in [*self.peers.values(), *self.sources.values()]:
            pair.thread.shutdown(wait=False, cancel_futures=True)
        self.peers.clear()
        self.sources.clear()
