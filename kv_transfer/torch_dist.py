"""torch.distributed connector: blocks move point-to-point over a two-rank process group per
(prefill worker, decode worker) pair: gloo on CPU, NCCL on GPU. Each rank (TP rank of a pipeline
stage) is a worker of its own: a decode rank pulls its own layers from the prefill ranks of the
stages that hold them, and within those its heads (one pair per source rank, all at once; with
equal TP sizes whole blocks of the peer rank, otherwise the pull names the heads, and the prefill
side sends just those).

Each worker hosts a TCPStore (its `address()`); the store's queue is its control inbox. A decode
worker D reaching prefill worker P for the first time pushes `connect` into P's inbox and both build a
pair group over that store (P rank 0, D rank 1). To pull, D pushes `pull` (lease slot, token, block
ids); P's engine thread checks the lease between steps and hands the pull to the pair's thread,
which streams the blocks layer by layer: it gathers layer l + 1 into one staging buffer while layer l
goes out of the other, and D scatters layer l into its blocks while layer l + 1 arrives, so the
gather, the wire and the scatter overlap. A trailer says whether the lease stayed live throughout.
The lease ends when the decode engine, all its ranks done, pushes `release` (rank 0 to rank 0).

Safety without stopping the engine: P gathers a layer only under the worker's lock after checking
the lease word, and `end_leases` takes the same lock, so once the engine has ended a lease (and is
about to free its blocks) no more of them is read; D writes its blocks only under its pair's lock
while the pull is not cancelled, and a timed-out pull is cancelled under that lock before it is
reported, so the engine never frees blocks a thread is still writing. A dead or slow peer costs a
timed-out pull (then the failure policy), never a step. Staging buffers are kept per pair (first-touch
page faults on fresh buffers cost more than the copies).
"""
from __future__ import annotations

import json
import logging
import queue
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from kv_transfer.base import KVConnectorWorker, advertised_host
from records.config import KVTransferConfig
from records.errors import LeaseGoneError
from records.kv_layout import KVLayout, KVSource
from records.transfer import LoadSpec, RemotePrefill, TransferReport

logger = logging.getLogger(__name__)

INBOX = "pdserve/inbox"
OK, LEASE_GONE = 0, 1


def scatter_blocks(cache: torch.Tensor, index: torch.Tensor, heads: slice | None,
                   received: torch.Tensor) -> None:
    """Write `received` ([2, n, block_size, heads, d]) into blocks `index` of one layer's cache
    ([2, num_blocks, block_size, kv_heads, d]), all heads or the `heads` slice of them.

    On CPU through NumPy on the cache's bytes seen as 8-byte words (or the widest word the head's
    bytes divide into): torch's index_copy_ / index_put_ move bf16 elements two bytes at a time and
    scatter at about half the speed of the gather (index_select), more slowly again with two
    threads; NumPy's fancy assignment of whole rows runs near the gather's speed."""
    if cache.device.type != "cpu":
        if cache.dtype == torch.float8_e4m3fn:        # (no index_copy_ for fp8: move its bytes)
            cache, received = cache.view(torch.uint8), received.view(torch.uint8)
        if heads is None:
            cache.index_copy_(1, index, received)
        else:
            cache[:, index, :, heads] = received
        return
    row = cache.shape[-1] * cache.element_size()
    word = next(w for w in (torch.int64, torch.int32, torch.int16, torch.uint8) if row % w.itemsize == 0)
    dst, src, rows = cache.view(word).numpy(), received.contiguous().view(word).numpy(), index.numpy()
    if heads is None:
        dst[:, rows] = src
    else:
        dst[:, rows, :, heads] = src



class _PairThread:
    """One daemon thread running a pair's work in order (a single-worker executor). Daemon, unlike
    ThreadPoolExecutor's: a pair group that never forms (a peer gone mid-handshake) may block its
    thread past every timeout, and interpreter exit joins every executor thread, so one stuck
    pair would keep a finished process from exiting."""

    def __init__(self) -> None:
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = self._cancel = False
        threading.Thread(target=self._run, daemon=True, name="pdserve-kv-pair").start()

    def submit(self, fn: Any, *args: Any) -> Future:
        future: Future = Future()
        if self._closed:
            future.set_exception(RuntimeError("the pair's thread was shut down"))
        else:
            self._work.put((future, fn, args))
        return future

    def shutdown(self, wait: bool = False, cancel_futures: bool = False) -> None:
        """End the thread after the work already queued, or (`cancel_futures`) after the work
        running now, cancelling the rest. Never waits (`wait` is ThreadPoolExecutor's argument)."""
        self._closed, self._cancel = True, cancel_futures
        self._work.put(None)

    def _run(self) -> None:
        while (item := self._work.get()) is not None:
            future, fn, args = item
            if self._cancel:
                future.cancel()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(e)


@dataclass(slots=True)
class _Pair:
    """One peer engine: its pair group, built and used on the pair's own thread."""
    key: str                                  # unique per pair incarnation: PrefixStore namespace
    rank: int
    thread: _PairThread = field(default_factory=_PairThread)
    group: Any = None
    client: Any = None                        # a TCPStore client of P's store (D: P's inbox too)
    broken: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)   # D: guards writes into blocks
    buffers: list[torch.Tensor] = field(default_factory=list)      # two staging buffers, reused

    def staging(self, i: int, num_bytes: int, device: torch.device) -> torch.Tensor:
        while len(self.buffers) < 2:
            self.buffers.append(torch.empty(0, dtype=torch.uint8, device=device))
        if self.buffers[i].numel() < num_bytes:
            self.buffers[i] = torch.empty(num_bytes, dtype=torch.uint8, device=device)
        return self.buffers[i][:num_bytes]


@dataclass(slots=True)
class _Pull:
    spec: LoadSpec
    parts: list[tuple[_Pair, Future]] = field(default_factory=list)   # one per prefill rank read from
    cancelled: bool = False


class TorchDistConnectorWorker(KVConnectorWorker):
    name = "torch_dist"

    def __init__(self, config: KVTransferConfig, layout: KVLayout) -> None:
        super().__init__(config, layout)
        self.timeout = timedelta(seconds=config.load_timeout_s)
        self.host = advertised_host(config.kv_host)
        self.store = dist.TCPStore(self.host, 0, is_master=True, wait_for_workers=False,
                                   timeout=self.timeout)
        self.peers: dict[str, _Pair] = {}                    # P side: decode peers by pair key
        self.sources: dict[str, _Pair] = {}                  # D side: prefill engines by engine id
        self.pulls: dict[str, _Pull] = {}                    # D side: in flight, by request id
        self.lease_lock = threading.Lock()                   # P: lease checks vs. ends
        self.released: list[tuple[int, int]] = []            # P: appended by pair threads
        self.released_lock = threading.Lock()

    def address(self) -> dict[str, Any]:
        return {"host": self.host, "port": self.store.port}

    def _layer_view(self, raw: torch.Tensor, num_blocks: int, heads: int) -> torch.Tensor:
        """A staging byte buffer seen as `heads` heads of one layer's blocks: [2, n, block_size, heads, d]."""
        lay = self.layout
        return raw.view(self.kv_caches[0].dtype).view(2, num_blocks, lay.block_size, heads, lay.head_dim)

    def _layer_bytes(self, num_blocks: int, heads: int) -> int:
        return 2 * num_blocks * self.layout.block_size * heads * self.layout.head_bytes

    # --- pair groups -----------------------------------------------------------------------------
    def _new_group(self, store: Any, key: str, rank: int) -> Any:
        prefixed = dist.PrefixStore(f"pdserve/pair/{key}", store)
        if self.kv_caches and self.kv_caches[0].is_cuda:
            return dist.ProcessGroupNCCL(prefixed, rank, 2)
        return dist.ProcessGroupGloo(prefixed, rank, 2, self.timeout)

    def _source(self, remote: RemotePrefill, rank: int) -> _Pair:
        """D side: the pair to the prefill engine's rank `rank`, (re)connecting on its thread if needed."""
        host, port = remote.addresses[rank]["host"], int(remote.addresses[rank]["port"])
        pair = self.sources.get(f"{host}:{port}")
        if pair is None or pair.broken:
            pair = _Pair(uuid.uuid4().hex, rank=1)
            self.sources[f"{host}:{port}"] = pair
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
        pull = _Pull(spec)
        try:
            parts = self.pull_sources(spec.remote)
        except Exception as e:  # noqa: BLE001 - reported as a failed pull
            self._injected_failures.append((spec.request_id, f"{type(e).__name__}: {e}"))
            return
        for part in parts:
            pair = self._source(spec.remote, part.src_rank)
            pull.parts.append((pair, pair.thread.submit(self._pull, pair, pull, part)))
        self.pulls[spec.request_id] = pull

    def _pull(self, pair: _Pair, pull: _Pull, source: KVSource) -> None:
        """On the pair's thread: ask for the blocks (the source's layers that are this rank's, this
        part's heads of them), receive and scatter them layer by layer."""
        if pair.group is None:
            raise ConnectionError("no connection to the prefill engine")
        spec, remote, part = pull.spec, pull.spec.remote, source.heads
        whole = part.covers(remote.layout, self.layout)
        try:
            pair.client.queue_push(INBOX, json.dumps({
                "op": "pull", "key": pair.key, "slot": remote.lease_slot, "token": remote.lease_token,
                "block_ids": spec.remote_block_ids, "heads": None if whole else [part.src_start, part.count],
                "layers": [source.src_layers.start, source.src_layers.stop]}))
            status = torch.zeros(1, dtype=torch.int64)
            pair.group.recv([status], 0, 0).wait()
            if int(status[0]) != OK:
                raise LeaseGoneError("the prefill engine no longer holds the blocks")
            n = len(spec.local_block_ids)
            device = self.kv_caches[0].device
            index = torch.tensor(spec.local_block_ids, dtype=torch.long, device=device)
            size = self._layer_bytes(n, part.count)
            bufs = [pair.staging(0, size, device), pair.staging(1, size, device)]
            heads = slice(part.dst_start, part.dst_start + part.count)
            caches = [self.kv_caches[i] for i in source.dst_layers]
            work = pair.group.recv([bufs[0]], 0, 0)
            for layer, cache in enumerate(caches):
                work.wait()
                if layer + 1 < len(caches):
                    work = pair.group.recv([bufs[(layer + 1) % 2]], 0, 0)
                with pair.lock:
                    if pull.cancelled:
                        raise TimeoutError("cancelled")
                    received = self._layer_view(bufs[layer % 2], n, part.count)
                    scatter_blocks(cache, index, None if whole else heads, received)
            pair.group.recv([status], 0, 0).wait()
            if int(status[0]) != OK:
                raise LeaseGoneError("the prefill engine released the blocks during the pull")
        except LeaseGoneError:
            raise
        except Exception:
            pair.broken = True
            raise

    def release_remote(self, remote: RemotePrefill) -> None:
        pair = self._source(remote, 0)
        message = json.dumps({"op": "release", "slot": remote.lease_slot, "token": remote.lease_token})
        pair.thread.submit(self._push, pair, message)

    @staticmethod
    def _push(pair: _Pair, message: str) -> None:
        if pair.client is not None:
            pair.client.queue_push(INBOX, message)

    # --- both sides, on the engine thread -----------------------------------------------------------
    def _poll(self) -> TransferReport:
        self._serve_inbox()
        with self.released_lock:
            report = TransferReport(released=self.released)
            self.released = []
        now = time.monotonic()
        for rid, pull in list(self.pulls.items()):
            errors = [e for _, future in pull.parts if future.done() and (e := future.exception()) is not None]
            if all(future.done() for _, future in pull.parts):
                del self.pulls[rid]
                if not errors:
                    report.loaded.append(rid)
                else:
                    report.failed.append((rid, "; ".join(f"{type(e).__name__}: {e}" for e in errors)))
            elif errors or now > pull.spec.deadline:
                # One part failed (e.g. one prefill stage is gone) or time is up: the pull fails as
                # a whole now, the parts still running are cancelled.
                self._cancel(pull)
                del self.pulls[rid]
                why = "; ".join(f"{type(e).__name__}: {e}" for e in errors)
                report.failed.append((rid, why or f"timed out after {self.config.load_timeout_s} s"))
        return report

    @staticmethod
    def _cancel(pull: _Pull) -> None:
        """Stop a pull's parts from writing into its blocks (then the engine may free them). Their
        pairs are dropped: a thread may still be waiting on the wire for the cancelled data."""
        for pair, future in pull.parts:
            with pair.lock:          # from here on its thread writes none of our blocks
                pull.cancelled = True
            if not future.done():
                pair.broken = True

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
                    with self.released_lock:
                        self.released.append((message["slot"], message["token"]))
            elif op == "pull" and message["key"] in self.peers:
                # Pulls of one pair run in order on its thread (one pair group, one stream).
                pair = self.peers[message["key"]]
                pair.thread.submit(self._send, pair, message)

    def _accept(self, pair: _Pair) -> None:
        """On the pair's thread: P's side of the pair group, over a connection of its own to this
        worker's store. Not over `self.store`, which is one socket that the engine thread polls
        the inbox through meanwhile: used from two threads at once, a TCPStore object's requests
        and replies can cross (two ranks rendezvousing through one object, measured, waited out
        the whole timeout; a make test run saw a first pull's connect hang past 300 s)."""
        try:
            pair.client = dist.TCPStore(self.host, self.store.port, is_master=False, timeout=self.timeout)
            pair.group = self._new_group(pair.client, pair.key, 0)
        except Exception:
            pair.broken = True
            raise

    def end_leases(self, slots: list[int]) -> None:
        with self.lease_lock:         # waits out a layer being gathered from these blocks
            super().end_leases(slots)

    def _gather_layer(self, layer: int, index: torch.Tensor, heads: slice | None, out: torch.Tensor,
                      slot: int, token: int) -> bool:
        """Copy one layer of the leased blocks (these heads of them) into `out` if the lease is
        still live."""
        with self.lease_lock:
            if not self.leases.is_live(slot, token):
                return False
            if heads is None:
                torch.index_select(self.kv_caches[layer], 1, index, out=out)
            else:
                out.copy_(self.kv_caches[layer][:, index, :, heads])
            return True

    def _send(self, pair: _Pair, message: dict[str, Any]) -> None:
        """On the pair's thread: status, the layers (double-buffered), then a trailer. The lease
        stays: the decode engine releases it once all its ranks have their blocks."""
        slot, token, block_ids = message["slot"], message["token"], message["block_ids"]
        try:
            if pair.group is None:
                raise ConnectionError("pair group was not established")
            with self.lease_lock:
                live = self.leases.is_live(slot, token) and set(block_ids) <= set(self.leases.block_ids[slot])
            pair.group.send([torch.tensor([OK if live else LEASE_GONE], dtype=torch.int64)], 1, 0).wait()
            if not live:
                return
            n = len(block_ids)
            first, count = message.get("heads") or (0, self.layout.local_kv_heads)
            heads = None if message.get("heads") is None else slice(first, first + count)
            device = self.kv_caches[0].device
            index = torch.tensor(block_ids, dtype=torch.long, device=device)
            size = self._layer_bytes(n, count)
            bufs = [pair.staging(0, size, device), pair.staging(1, size, device)]
            work = None
            layers = range(*message.get("layers") or (0, len(self.kv_caches)))
            for i, layer in enumerate(layers):
                buf = bufs[i % 2]
                live = live and self._gather_layer(layer, index, heads, self._layer_view(buf, n, count),
                                                   slot, token)
                if work is not None:
                    work.wait()
                work = pair.group.send([buf], 1, 0)
            work.wait()
            pair.group.send([torch.tensor([OK if live else LEASE_GONE], dtype=torch.int64)], 1, 0).wait()
        except Exception as e:  # noqa: BLE001 - the decode side times out and recomputes
            logger.warning("KV send to a decode engine failed: %r", e)
            pair.broken = True

    def shutdown(self) -> None:
        for pair in [*self.peers.values(), *self.sources.values()]:
            pair.thread.shutdown(wait=False, cancel_futures=True)
        self.peers.clear()
        self.sources.clear()
