"""The records of a transfer: `RemotePrefill` (what a prefill engine returns as kv_transfer_params
and a decode engine receives; its wire form and the kv_transfer_params dict are
pdserve_proto/transfer.py), `LoadSpec` (one pull) and `TransferReport` (what a worker saw finish)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from records.kv_layout import KVLayout

# Version of the connectors' own protocol (lease words, notifications, staging layout): both ends
# of a transfer must run the same one. Checked with the layout in the handshake.
# 2: the decode engine releases the lease once all its ranks pulled; 3: pipeline stages (addresses
# for every rank, stage-major; a torch_dist pull names its layers)
CONNECTOR_VERSION = 3


@dataclass(slots=True)
class RemotePrefill:
    """Where a prefilled prompt's KV waits: what P returns and D receives as kv_transfer_params."""
    engine_id: str
    request_id: str                 # the request's id on P
    block_ids: list[int]            # P's block table for the prompt
    block_hashes: list[bytes]       # hashes of the prompt's full blocks (as D computes them too)
    num_tokens: int                 # prompt tokens whose KV P holds
    lease_slot: int
    lease_token: int
    lease_expires_at: float         # time.time() on P (nodes' clocks agree within LEASE_MARGIN_S)
    layout: KVLayout                # P's layout (its rank 0's: TP rank 0 of stage 0)
    addresses: list[dict[str, Any]]  # per P rank (stage-major), transport-specific: how D's workers reach P's
    connector: str = ""             # P's connector ("" when built by hand without one)
    connector_version: int = CONNECTOR_VERSION
    adapter: str = ""               # the LoRA adapter's name the prompt ran under ("": the base model)


@dataclass(slots=True)
class LoadSpec:
    """One pull: remote blocks -> local blocks, both in prompt order."""
    request_id: str                 # the request's id on this (decode) engine
    remote: RemotePrefill
    local_block_ids: list[int]
    remote_block_ids: list[int]
    deadline: float                 # time.monotonic() by which it must be done


@dataclass(slots=True)
class TransferReport:
    """What a worker's `poll()` saw finish since the last poll."""
    released: list[tuple[int, int]] = field(default_factory=list)   # P: (lease slot, token) done with
    loaded: list[str] = field(default_factory=list)                  # D: request ids whose pull is done
    failed: list[tuple[str, str]] = field(default_factory=list)      # D: (request id, reason)
