"""TierStore: one rank's bytes of the offload tier (engine/core/kv_tier.py decides what goes where).

Host slots are tensors beside the KV cache, one per layer of this rank, [2, slots, block_size,
kv_heads, head_dim] (pinned on a GPU machine); a block moves between the pool and a host slot with
one indexed copy per layer. The disk store is one file per rank in the configured directory, a slot
being an 8-byte tag (engine/core/kv_tier.py: block_tag) and this rank's layers of one block,
contiguous ([layers, 2, block_size, kv_heads, head_dim]); a load whose slot does not start with its
block's tag fails. The file is unlinked as soon as it is open: it needs no cleanup, even after a
crash.

Writes to disk leave the step: a demotion copies the host slot into a buffer (its slot is reused at
once) and a writer thread writes it; until written, a load of that disk slot reads the buffer. Loads
from disk read the file in the step (the page cache usually has it). An order that cannot be
carried out (a short read, an OSError) is reported back and the scheduler recomputes instead.
"""
from __future__ import annotations

import logging
import os
import queue
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence

import torch

logger = logging.getLogger(__name__)

TAG_BYTES = 8


class TierStore:
    def __init__(self, kv_caches: list[torch.Tensor], num_host_slots: int, num_disk_slots: int = 0,
                 disk_path: str | None = None, rank: int = 0) -> None:
        first = kv_caches[0]
        self.kv_caches = kv_caches
        self.block_shape = tuple(first.shape[2:])               # (block_size, kv_heads, head_dim)
        pin = first.device.type == "cuda"
        self.host = [torch.zeros((2, num_host_slots, *self.block_shape), dtype=first.dtype, pin_memory=pin)
                     for _ in kv_caches]
        self.slot_shape = (len(kv_caches), 2, *self.block_shape)
        self.slot_bytes = first.element_size() * 2 * len(kv_caches) * first[0, 0].numel()
        self.disk_slot_bytes = TAG_BYTES + self.slot_bytes
        self.num_disk_slots = num_disk_slots
        self.fd: int | None = None
        self.fail_loads = 0              # tests: fail this many coming loads (as a failed read would)
        # Counters (this rank): bytes each way and seconds in the step's copies.
        self.bytes_saved = self.bytes_loaded = self.bytes_written = 0
        self.seconds = 0.0
        self._pending: dict[int, tuple[int, torch.Tensor]] = {}   # disk slot -> (tag, bytes) not yet written
        self._lock = threading.Lock()
        # (disk slot, tag, bytes) to write; an Event to set once those before it are written; None: stop.
        self._queue: queue.SimpleQueue[tuple[int, int, torch.Tensor] | threading.Event | None] = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        if num_disk_slots:
            directory = disk_path or tempfile.gettempdir()
            os.makedirs(directory, exist_ok=True)
            path = os.path.join(directory, f"pdserve-kv-{os.getpid()}-{rank}-{uuid.uuid4().hex[:8]}.bin")
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.unlink(path)
            os.ftruncate(self.fd, num_disk_slots * self.disk_slot_bytes)
            self._writer = threading.Thread(target=self._write_loop, name="pdserve-kv-disk", daemon=True)
            self._writer.start()

    # --- orders ---------------------------------------------------------------------------------
    def run(self, orders: Sequence[tuple]) -> list[tuple]:
        """Carry out orders in order (runs of one kind batched into one copy per layer); returns
        those that failed."""
        start = time.perf_counter()
        failed: list[tuple] = []
        i = 0
        while i < len(orders):
            kind = orders[i][0]
            j = i
            while j < len(orders) and orders[j][0] == kind and (kind != "load" or orders[j][1] == orders[i][1]):
                j += 1
            run = orders[i:j]
            try:
                if kind == "save":
                    self._copy(self.kv_caches, self.host, [(o[1], o[2]) for o in run])
                    self.bytes_saved += len(run) * self.slot_bytes
                elif kind == "demote":
                    for _, host_slot, disk_slot, tag in run:
                        self._demote(host_slot, disk_slot, tag)
                elif run[0][1] == "host":
                    failed += self._take_injected(run)
                    ok = [o for o in run if o not in failed]
                    self._copy(self.host, self.kv_caches, [(o[2], o[3]) for o in ok])
                    self.bytes_loaded += len(ok) * self.slot_bytes
                else:
                    failed += self._take_injected(run)
                    for order in run:
                        if order not in failed and not self._load_disk(*order[2:]):
                            failed.append(order)
            except Exception:
                logger.exception("KV offload tier: %d %s order(s) failed", len(run), kind)
                failed += [o for o in run if o not in failed]
            i = j
        self.seconds += time.perf_counter() - start
        return failed

    def _take_injected(self, run: Sequence[tuple]) -> list[tuple]:
        n = min(self.fail_loads, len(run))
        self.fail_loads -= n
        return list(run[:n])

    @staticmethod
    def _copy(src: list[torch.Tensor], dst: list[torch.Tensor], pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        s = torch.tensor([p[0] for p in pairs], device=src[0].device)
        d = torch.tensor([p[1] for p in pairs], device=dst[0].device)
        for a, b in zip(src, dst, strict=True):
            b.index_copy_(1, d, a.index_select(1, s).to(b.device))

    def _demote(self, host_slot: int, disk_slot: int, tag: int) -> None:
        buf = torch.stack([h[:, host_slot] for h in self.host])     # a copy: the slot is reused now
        with self._lock:
            self._pending[disk_slot] = (tag, buf)
        self._queue.put((disk_slot, tag, buf))

    def _load_disk(self, disk_slot: int, block_id: int, tag: int) -> bool:
        with self._lock:
            pending = self._pending.get(disk_slot)
        if pending is not None and pending[0] == tag:
            buf = pending[1]
        else:
            assert self.fd is not None
            data = os.pread(self.fd, self.disk_slot_bytes, disk_slot * self.disk_slot_bytes)
            found = int.from_bytes(data[:TAG_BYTES], "little") if len(data) == self.disk_slot_bytes else None
            if found != tag:
                logger.error("KV offload tier: disk slot %d does not hold its block (%s)", disk_slot,
                             f"read {len(data)} of {self.disk_slot_bytes} bytes" if found is None else "tag differs")
                return False
            raw = torch.frombuffer(bytearray(data[TAG_BYTES:]), dtype=torch.uint8)
            buf = raw.view(self.kv_caches[0].dtype).view(self.slot_shape)
        for layer, cache in enumerate(self.kv_caches):
            cache[:, block_id].copy_(buf[layer])
        self.bytes_loaded += self.slot_bytes
        return True

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            if isinstance(item, threading.Event):
                item.set()
                continue
            disk_slot, tag, buf = item
            try:
                assert self.fd is not None
                offset = disk_slot * self.disk_slot_bytes
                os.pwritev(self.fd, [tag.to_bytes(TAG_BYTES, "little"), buf.view(torch.uint8).numpy()], offset)
                self.bytes_written += self.slot_bytes
            except OSError:
                logger.exception("KV offload tier: writing disk slot %d failed", disk_slot)
                continue        # the buffer stays pending: loads of the slot still find it
            with self._lock:
                if self._pending.get(disk_slot, (0, None))[1] is buf:
                    del self._pending[disk_slot]

    def flush(self) -> None:
        """Wait until every demotion queued so far has been written (or failed to be)."""
        if self._writer is not None:
            done = threading.Event()
            self._queue.put(done)
            done.wait()

    def stats(self) -> dict[str, float]:
        return {"bytes_saved": self.bytes_saved, "bytes_loaded": self.bytes_loaded,
                "bytes_written_to_disk": self.bytes_written, "seconds": self.seconds}

    def shutdown(self) -> None:
        if self._writer is not None:
            self._queue.put(None)
            self._writer.join(timeout=10)
            self._writer = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
