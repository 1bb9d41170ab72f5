"""NIXL connector: the decode worker READs the prefill worker's blocks one-sidedly (UCX: RDMA between
GPUs or hosts, shared memory or TCP between processes of one host; DRAM on CPU, VRAM on GPU).

Every worker registers its per-layer KV tensors and its lease words with its NIXL agent and prepares
a descriptor list with one entry per (layer, K/V, block), so a pull is a list of indices. The agent's
metadata (a few hundred bytes) travels inside the transfer parameters: the decode side adds the
remote agent the first time it meets it, with no side channel. A pull is two READs: the blocks, then
the lease word. If the word still holds the lease's token, the prefill side had not released the
blocks while they were read (it clears the word before a released block can be rewritten), so the
data is valid; the decode side then notifies the prefill side, which frees them.

Install (no CUDA torch is pulled in): `pip install --no-deps nixl==1.5.1 nixl-cu13==1.5.1 numpy`
(`make setup` does it).
"""
from __future__ import annotations

import base64
import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from engine.config import KVTransferConfig
from kv_transfer.base import KVConnectorWorker, KVLayout, LoadSpec, RemotePrefill, TransferReport

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
    blocks: Any            # prepared dlist of its (layer, K/V, block) descriptors
    leases: Any            # prepared dlist of its lease words
    num_blocks: int


@dataclass(slots=True)
class _Load:
    spec: LoadSpec
    remote: _Remote
    handle: Any
    stage: str             # "blocks" -> "lease"
    scratch: int = -1      # scratch word the lease token is read into
    aborting: bool = False


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
            "NIXL_INIT_AGENT", self._block_descs([t.data_ptr() for t in kv_caches], self.num_blocks, dev), mem)
        self.local_scratch = self.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", self._word_descs(self.scratch.data_ptr(), NUM_SCRATCH_WORDS), "DRAM")
        self.metadata = base64.b64encode(self.agent.get_agent_metadata()).decode()

    def _block_descs(self, bases: list[int], num_blocks: int, device_id: int) -> np.ndarray:
        """One (addr, len, dev) row per (layer, K/V, block), in that order."""
        size = self.layout.block_bytes
        offsets = np.arange(2 * num_blocks, dtype=np.int64) * size     # K blocks, then V blocks
        rows = [np.stack([base + offsets, np.full_like(offsets, size), np.full_like(offsets, device_id)], 1)
                for base in bases]
        return np.concatenate(rows)

    @staticmethod
    def _word_descs(base: int, count: int) -> np.ndarray:
        addrs = base + np.arange(count, dtype=np.int64) * 8
        return np.stack([addrs, np.full_like(addrs, 8), np.zeros_like(addrs)], 1)

    def _indices(self, block_ids: list[int], num_blocks: int) -> np.ndarray:
        """Descriptor indices of these blocks' K and V in every layer."""
        ids = np.asarray(block_ids, dtype=np.int64)
        per_layer = np.concatenate([ids, num_blocks + ids])
        layers = np.arange(self.layout.num_layers, dtype=np.int64)[:, None] * (2 * num_blocks)
        return (layers + per_layer[None, :]).reshape(-1)

    def address(self) -> dict[str, Any]:
        mem, dev = self._mem(self.kv_caches[0])
        return {"agent_metadata": self.metadata, "kv_addrs": [t.data_ptr() for t in self.kv_caches],
                "num_blocks": self.num_blocks, "lease_addr": self.leases.words.data_ptr(),
                "num_lease_slots": len(self.leases.words), "mem": mem, "device_id": dev}

    def _remote(self, remote: RemotePrefill) -> _Remote:
        """Add the prefill engine's agent and prepare its descriptor lists (once per agent)."""
        address = remote.address
        known = self.remotes.get(address["agent_metadata"])
        if known is not None:
            return known
        agent = self.agent.add_remote_agent(base64.b64decode(address["agent_metadata"]))
        agent = agent.decode() if isinstance(agent, bytes) else agent
        num_blocks = int(address["num_blocks"])
        blocks = self.agent.prep_xfer_dlist(
            agent, self._block_descs([int(a) for a in address["kv_addrs"]], num_blocks,
                                     int(address["device_id"])), address["mem"])
        leases = self.agent.prep_xfer_dlist(
            agent, self._word_descs(int(address["lease_addr"]), int(address["num_lease_slots"])), "DRAM")
        known = _Remote(agent, blocks, leases, num_blocks)
        self.remotes[address["agent_metadata"]] = known
        return known

    # --- D side ----------------------------------------------------------------------------------
    def _start_load(self, spec: LoadSpec) -> None:
        try:
            remote = self._remote(spec.remote)
            handle = self.agent.make_prepped_xfer(
                "READ", self.local_blocks, self._indices(spec.local_block_ids, self.num_blocks),
                remote.blocks, self._indices(spec.remote_block_ids, remote.num_blocks))
            if self.agent.transfer(handle) == "ERR":
                self.agent.release_xfer_handle(handle)
                raise RuntimeError("NIXL refused to start the transfer")
        except Exception as e:  # noqa: BLE001 - reported as a failed pull
            self._injected_failures.append((spec.request_id, f"{type(e).__name__}: {e}"))
            return
        self.loads[spec.request_id] = _Load(spec, remote, handle, "blocks")

    def release_remote(self, remote: RemotePrefill) -> None:
        try:
            agent = self._remote(remote).agent
            self.agent.send_notif(agent, f"done:{remote.lease_slot}:{remote.lease_token}".encode())
        except Exception as e:  # noqa: BLE001 - the lease expires instead
            logger.warning("could not notify prefill engine %s: %r", remote.engine_id, e)

    def _advance(self, load: _Load, now: float) -> str | None:
        """Move one pull along; returns "" when loaded, a reason when failed, None while running."""
        state = self.agent.check_xfer_state(load.handle)
        if state == "PROC":
            if now > load.spec.deadline and not load.aborting:
                load.aborting = True
                try:
                    self.agent.release_xfer_handle(load.handle)    # cancels it
                except Exception:  # noqa: BLE001 - could not cancel: wait for it to end
                    return None
                return f"timed out after {self.config.load_timeout_s} s"
            return None
        self.agent.release_xfer_handle(load.handle)
        if state != "DONE" or load.aborting:
            return "timed out" if load.aborting else f"transfer failed ({state})"
        if load.stage == "blocks":
            load.stage = "lease"
            load.scratch = self.free_scratch.pop()
            self.scratch[load.scratch] = 0
            load.handle = self.agent.make_prepped_xfer(
                "READ", self.local_scratch, [load.scratch], load.remote.leases, [load.spec.remote.lease_slot])
            if self.agent.transfer(load.handle) == "ERR":
                self.agent.release_xfer_handle(load.handle)
                load.handle = None
                return "transfer failed (lease word)"
            return None
        token = int(self.scratch[load.scratch])
        if token != load.spec.remote.lease_token:
            return "the prefill engine released the blocks during the pull"
        remote = load.spec.remote
        self.agent.send_notif(load.remote.agent, f"done:{remote.lease_slot}:{remote.lease_token}".encode())
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
            if load.scratch >= 0:
                self.free_scratch.append(load.scratch)
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
            try:
                if load.handle is not None:
                    self.agent.release_xfer_handle(load.handle)
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass
        self.loads.clear()
        for registration in self.registrations:
            try:
                self.agent.deregister_memory(registration)
            except Exception:  # noqa: BLE001
                pass
        self.registrations.clear()
        self.agent = None
