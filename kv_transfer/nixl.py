"""NIXL connector: the decode worker READs the prefill worker's blocks one-sidedly (UCX: RDMA between
GPUs or hosts, shared memory or TCP between processes of one host; DRAM on CPU, VRAM on GPU).

Every worker registers its per-layer KV tensors and its lease words with its NIXL agent and prepares
a descriptor list with one entry per (layer, K/V, block), so a pull is a list of indices. The agent's
metadata (a few hundred bytes) travels inside the transfer parameters, one per prefill TP rank: the
decode side adds a remote agent the first time it meets it, with no side channel. A pull is two
READs per prefill rank it reads from: the blocks, then the lease word. If the word still holds the
lease's token, the prefill side had not released the blocks while they were read (it clears the word
before a released block can be rewritten), so the data is valid. Once all its ranks are done, the
decode engine's rank 0 notifies the prefill engine's rank 0, which frees them.

With pipeline stages, each decode rank reads only its own layers, from the prefill rank(s) of the
stage(s) that hold them (`kv_sources`), all ranks of all stages at once; the two sides' layer
ranges may split differently. With equal TP sizes a rank reads whole blocks of its peer rank. When
the sizes differ, a rank's heads are a strided part of the other side's blocks: it reads them with
one descriptor per (layer, K/V, block, token), built per pull (many more, smaller reads: the price
of the NHD block layout).

Install (no CUDA torch is pulled in): `pip install --no-deps nixl==1.5.1 nixl-cu13==1.5.1 numpy`
(`make setup` does it).
"""
from __future__ import annotations

import base64
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kv_transfer.base import KVConnectorWorker, advertised_host
from records.config import KVTransferConfig
from records.kv_layout import KVLayout, KVSource
from records.transfer import LoadSpec, RemotePrefill, TransferReport

logger = logging.getLogger(__name__)

NUM_SCRATCH_WORDS = 4096      # lease words read back by concurrent pulls


def _import_nixl() -> tuple[Any, Any]:
    try:
        from nixl._api import nixl_agent, nixl_agent_config  # noqa: PLC0415
    except ImportError as e:
        raise RuntimeError(
            "kv_connector='nixl' needs the nixl package: pip install --no-deps nixl==1.5.1 "
            "nixl-cu13==1.5.1 numpy (make setup installs it)") from e
    return nixl_agent, nixl_agent_config


@dataclass(slots=True)
class _Remote:
    agent: str
    address: dict[str, Any]
    blocks: Any            # prepared dlist of its (layer, K/V, block) descriptors
    leases: Any            # prepared dlist of its lease words
    num_blocks: int


@dataclass(slots=True)
class _Load:
    spec: LoadSpec
    sources: list[_Remote]            # the prefill ranks it reads from
    handles: list[Any]                # this stage's transfers, one per source
    stage: str                        # "blocks" -> "lease"
    scratch: list[int] = field(default_factory=list)   # scratch words the lease tokens are read into
    aborting: bool = False
    error: str = ""                   # a failed read, reported once every read of the stage ended


class NixlConnectorWorker(KVConnectorWorker):
    name = "nixl"

    def __init__(self, config: KVTransferConfig, layout: KVLayout) -> None:
        super().__init__(config, layout)
        nixl_agent, nixl_agent_config = _import_nixl()
        self.agent_name = f"pdserve-{self.engine_id}"
        # NIXL's progress thread polls without sleeping (a whole core per agent). Without it the
        # agent progresses when this worker polls (every engine step; every IDLE_POLL_S when only
        # transfers are pending), which is enough where reads are one-sided (shared memory and CMA
        # on one host, RDMA between hosts). Over plain TCP the prefill side must progress to serve
        # a read: there, {"nixl_progress_thread": True} in kv_connector_extra trades the core for it.
        progress = bool(config.extra_value("nixl_progress_thread", False))
        if advertised_host(config.kv_host).startswith("127.") and "UCX_NET_DEVICES" not in os.environ:
            # An engine reached over loopback (a single-machine cluster) listens on loopback only:
            # UCX's TCP transport would otherwise open a listener on every network interface.
            os.environ["UCX_NET_DEVICES"] = "lo"
        self.agent = nixl_agent(self.agent_name,
                                nixl_agent_config(enable_prog_thread=progress, backends=["UCX"]))
        self.scratch = torch.zeros(NUM_SCRATCH_WORDS, dtype=torch.int64)
        self.free_scratch = list(range(NUM_SCRATCH_WORDS - 1, -1, -1))
        self.remotes: dict[str, _Remote] = {}
        self.loads: dict[str, _Load] = {}
        self.registrations: list[Any] = []

    def _mem(self, tensor: torch.Tensor) -> tuple[str, int]:
        return ("VRAM", tensor.device.index or 0) if tensor.is_cuda else ("DRAM", 0)

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        for tensor in [*kv_caches, self.leases.words, self.scratch]:
            self.registrations.append(self.agent.register_memory(tensor))
        mem, dev = self._mem(kv_caches[0])
        self.local_blocks = self.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", self._block_descs([t.data_ptr() for t in kv_caches], self.num_blocks,
                                                 self.layout.block_bytes, dev), mem)
        self.local_scratch = self.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", self._word_descs(self.scratch.data_ptr(), NUM_SCRATCH_WORDS), "DRAM")
        self.metadata = base64.b64encode(self.agent.get_agent_metadata()).decode()

    @staticmethod
    def _block_descs(bases: list[int], num_blocks: int, size: int, device_id: int) -> np.ndarray:
        """One (addr, len, dev) row per (layer, K/V, block), in that order."""
        offsets = np.arange(2 * num_blocks, dtype=np.int64) * size     # K blocks, then V blocks
        rows = [np.stack([base + offsets, np.full_like(offsets, size), np.full_like(offsets, device_id)], 1)
                for base in bases]
        return np.concatenate(rows)

    @staticmethod
    def _word_descs(base: int, count: int) -> np.ndarray:
        addrs = base + np.arange(count, dtype=np.int64) * 8
        return np.stack([addrs, np.full_like(addrs, 8), np.zeros_like(addrs)], 1)

    @staticmethod
    def _indices(block_ids: list[int], num_blocks: int, layers: range) -> np.ndarray:
        """Descriptor indices of these blocks' K and V in these layers (indices into the rank's
        own KV tensors)."""
        ids = np.asarray(block_ids, dtype=np.int64)
        per_layer = np.concatenate([ids, num_blocks + ids])
        first = np.arange(layers.start, layers.stop, dtype=np.int64)[:, None] * (2 * num_blocks)
        return (first + per_layer[None, :]).reshape(-1)

    def _sliced_descs(self, bases: list[int], num_blocks: int, block_ids: list[int], heads_per_token: int,
                      first_head: int, count: int, device_id: int) -> np.ndarray:
        """One row per (layer, K/V, block, token): `count` heads from `first_head` of each token, in
        a cache whose blocks hold `heads_per_token` heads (when the two engines' TP sizes differ,
        a rank's heads are a strided part of the other side's blocks)."""
        hb, bs = self.layout.head_bytes, self.layout.block_size
        ids = np.asarray(block_ids, dtype=np.int64)
        block_bytes = bs * heads_per_token * hb
        blocks = np.concatenate([ids, num_blocks + ids]) * block_bytes                # K, then V
        tokens = (np.arange(bs, dtype=np.int64) * heads_per_token + first_head) * hb
        per_layer = (blocks[:, None] + tokens[None, :]).reshape(-1)
        addrs = (np.asarray(bases, dtype=np.int64)[:, None] + per_layer[None, :]).reshape(-1)
        return np.stack([addrs, np.full_like(addrs, count * hb), np.full_like(addrs, device_id)], 1)

    def address(self) -> dict[str, Any]:
        mem, dev = self._mem(self.kv_caches[0])
        return {"agent_metadata": self.metadata, "kv_addrs": [t.data_ptr() for t in self.kv_caches],
                "num_blocks": self.num_blocks, "lease_addr": self.leases.words.data_ptr(),
                "num_lease_slots": len(self.leases.words), "mem": mem, "device_id": dev}

    def _remote(self, remote: RemotePrefill, rank: int) -> _Remote:
        """Add the agent of the prefill engine's rank `rank` and prepare its descriptor lists (once
        per agent)."""
        address = remote.addresses[rank]
        known = self.remotes.get(address["agent_metadata"])
        if known is not None:
            return known
        agent = self.agent.add_remote_agent(base64.b64decode(address["agent_metadata"]))
        agent = agent.decode() if isinstance(agent, bytes) else agent
        num_blocks = int(address["num_blocks"])
        block_bytes = self.layout.block_size * remote.layout.local_kv_heads * self.layout.head_bytes
        blocks = self.agent.prep_xfer_dlist(
            agent, self._block_descs([int(a) for a in address["kv_addrs"]], num_blocks, block_bytes,
                                     int(address["device_id"])), address["mem"])
        leases = self.agent.prep_xfer_dlist(
            agent, self._word_descs(int(address["lease_addr"]), int(address["num_lease_slots"])), "DRAM")
        known = _Remote(agent, address, blocks, leases, num_blocks)
        self.remotes[address["agent_metadata"]] = known
        return known

    # --- D side ----------------------------------------------------------------------------------
    def _read(self, spec: LoadSpec, source: _Remote, part: KVSource) -> Any:
        """Start READing this source rank's part of the blocks (its layers that are this rank's):
        whole blocks through the prepared lists, or (TP sizes differ) the part's heads of every
        token."""
        remote, heads = spec.remote, part.heads
        if heads.covers(remote.layout, self.layout):
            handle = self.agent.make_prepped_xfer(
                "READ", self.local_blocks, self._indices(spec.local_block_ids, self.num_blocks, part.dst_layers),
                source.blocks, self._indices(spec.remote_block_ids, source.num_blocks, part.src_layers))
        else:
            mem, dev = self._mem(self.kv_caches[0])
            mine = [self.kv_caches[i].data_ptr() for i in part.dst_layers]
            local = self._sliced_descs(mine, self.num_blocks, spec.local_block_ids, self.layout.local_kv_heads,
                                       heads.dst_start, heads.count, dev)
            address = source.address
            theirs = [int(address["kv_addrs"][i]) for i in part.src_layers]
            theirs = self._sliced_descs(theirs, source.num_blocks, spec.remote_block_ids,
                                        remote.layout.local_kv_heads, heads.src_start, heads.count,
                                        int(address["device_id"]))
            handle = self.agent.initialize_xfer("READ", self.agent.get_xfer_descs(local, mem),
                                                self.agent.get_xfer_descs(theirs, address["mem"]), source.agent)
        if self.agent.transfer(handle) == "ERR":
            self.agent.release_xfer_handle(handle)
            raise RuntimeError("NIXL refused to start the transfer")
        return handle

    def _start_load(self, spec: LoadSpec) -> None:
        load = _Load(spec, [], [], "blocks")
        try:
            for part in self.pull_sources(spec.remote):
                source = self._remote(spec.remote, part.src_rank)
                load.handles.append(self._read(spec, source, part))
                load.sources.append(source)
        except Exception as e:  # noqa: BLE001 - reported as a failed pull
            self._release_handles(load)
            self._injected_failures.append((spec.request_id, f"{type(e).__name__}: {e}"))
            return
        self.loads[spec.request_id] = load

    def _release_handles(self, load: _Load) -> bool:
        """Release (cancelling) the stage's transfers; False if one could not be."""
        kept = []
        for handle in load.handles:
            try:
                self.agent.release_xfer_handle(handle)
            except Exception:  # noqa: BLE001 - could not cancel: keep it, wait for it to end
                kept.append(handle)
        load.handles = kept
        return not kept

    def release_remote(self, remote: RemotePrefill) -> None:
        try:
            agent = self._remote(remote, 0).agent
            self.agent.send_notif(agent, f"done:{remote.lease_slot}:{remote.lease_token}".encode())
        except Exception as e:  # noqa: BLE001 - the lease expires instead
            logger.warning("could not notify prefill engine %s: %r", remote.engine_id, e)

    def _advance(self, load: _Load, now: float) -> str | None:
        """Move one pull along; returns "" when loaded, a reason when failed, None while running."""
        states = [self.agent.check_xfer_state(handle) for handle in load.handles]
        if "PROC" in states and "ERR" not in states:
            if now > load.spec.deadline and not load.aborting:
                load.aborting = True
                if not self._release_handles(load):
                    return None
                return f"timed out after {self.config.load_timeout_s} s"
            return None
        if any(state != "DONE" for state in states) and not load.error:
            load.error = f"transfer failed ({'/'.join(states)})"
        if not self._release_handles(load):
            return None            # a read could not be cancelled: report once it has ended
        if load.error or load.aborting:
            return "timed out" if load.aborting else load.error
        remote = load.spec.remote
        if load.stage == "blocks":
            # Then each source's lease word: unchanged means its blocks were not released meanwhile.
            load.stage = "lease"
            for source in load.sources:
                word = self.free_scratch.pop()
                load.scratch.append(word)
                self.scratch[word] = 0
                handle = self.agent.make_prepped_xfer("READ", self.local_scratch, [word], source.leases,
                                                      [remote.lease_slot])
                if self.agent.transfer(handle) == "ERR":
                    self.agent.release_xfer_handle(handle)
                    self._release_handles(load)
                    return "transfer failed (lease word)"
                load.handles.append(handle)
            return None
        if any(int(self.scratch[word]) != remote.lease_token for word in load.scratch):
            return "the prefill engine released the blocks during the pull"
        return ""

    # --- both sides ------------------------------------------------------------------------------
    def _poll(self) -> TransferReport:
        report = TransferReport()
        for messages in self.agent.get_new_notifs().values():
            for message in messages:
                parts = message.split(b":")
                if len(parts) != 3 or parts[0] != b"done" or not (parts[1].isdigit() and parts[2].isdigit()):
                    logger.warning("ignoring unexpected NIXL notification %r", message[:64])
                    continue
                slot, token = int(parts[1]), int(parts[2])
                if self.leases.is_live(slot, token):
                    report.released.append((slot, token))
        now = time.monotonic()
        for rid, load in list(self.loads.items()):
            try:
                outcome = self._advance(load, now)
            except Exception as e:  # noqa: BLE001 - e.g. the remote agent went away
                outcome = f"{type(e).__name__}: {e}"
            if outcome is None:
                continue
            del self.loads[rid]
            self.free_scratch.extend(load.scratch)
            if outcome == "":
                report.loaded.append(rid)
            else:
                report.failed.append((rid, outcome))
        return report

    def shutdown(self) -> None:
        """Cancel pulls, deregister memory and drop the agent (its UCX workers and threads)."""
        if self.agent is None:
            return
        for load in self.loads.values():
            self._release_handles(load)              # best effort at shutdown
        self.loads.clear()
        for registration in self.registrations:
            try:
                self.agent.deregister_memory(registration)
            except Exception:  # noqa: BLE001
                pass
        self.registrations.clear()
        self.agent = None
