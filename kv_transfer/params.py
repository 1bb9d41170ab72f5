"""The records of a transfer: `RemotePrefill` (what a prefill engine returns as kv_transfer_params
and a decode engine receives; protobuf on the wire), `LoadSpec` (one pull) and `TransferReport`
(what a worker saw finish)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from kv_transfer.layout import KVLayout

# Version of the connectors' own protocol (lease words, notifications, staging layout): both ends
# of a transfer must run the same one. Checked with the layout in the handshake.
CONNECTOR_VERSION = 2     # 2: the decode engine releases the lease once all its ranks pulled


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
    layout: KVLayout                # P's layout (tp_rank 0 of P's TP group)
    addresses: list[dict[str, Any]]  # per P TP rank, transport-specific: how D's workers reach P's
    connector: str = ""             # P's connector ("" when built by hand without one)
    connector_version: int = CONNECTOR_VERSION
    adapter: str = ""               # the LoRA adapter's name the prompt ran under ("": the base model)

    def to_dict(self) -> dict[str, Any]:
        """The kv_transfer_params dict (engine API): the protobuf `RemotePrefill` (versioned, what D
        parses) under "pdserve_kv", beside a readable view of the same fields for logs and tests."""
        return {"do_remote_prefill": True, "pdserve_kv": self.to_proto_bytes(),
                "remote_engine_id": self.engine_id,
                "remote_request_id": self.request_id, "remote_block_ids": list(self.block_ids),
                "remote_block_hashes": [h.hex() for h in self.block_hashes],
                "remote_num_tokens": self.num_tokens, "lease_slot": self.lease_slot,
                "lease_token": self.lease_token, "lease_expires_at": self.lease_expires_at,
                "layout": asdict(self.layout), "addresses": self.addresses, "remote_adapter": self.adapter}

    def handshake(self) -> Any:
        from pdserve_proto import CONTROL_SCHEMA_VERSION, pb2  # noqa: PLC0415

        return pb2.KVHandshake(schema_version=CONTROL_SCHEMA_VERSION, connector=self.connector,
                               connector_version=self.connector_version, layout=self.layout.to_proto())

    def to_proto_bytes(self) -> bytes:
        from pdserve_proto import CONTROL_SCHEMA_VERSION, pb2  # noqa: PLC0415

        msg = pb2.RemotePrefill(
            schema_version=CONTROL_SCHEMA_VERSION, handshake=self.handshake(), engine_id=self.engine_id,
            request_id=self.request_id, block_ids=self.block_ids, block_hashes=self.block_hashes,
            num_tokens=self.num_tokens, lease_slot=self.lease_slot, lease_token=self.lease_token,
            lease_expires_at=self.lease_expires_at, adapter=self.adapter)
        for a in self.addresses:
            rank = msg.ranks.add()
            if "agent_metadata" in a:
                rank.nixl.CopyFrom(pb2.NixlAddress(
                    agent_metadata=a["agent_metadata"], kv_addrs=a["kv_addrs"], num_blocks=a["num_blocks"],
                    lease_addr=a["lease_addr"], num_lease_slots=a["num_lease_slots"], mem=a["mem"],
                    device_id=a["device_id"]))
            elif "host" in a:
                rank.torch_dist.CopyFrom(pb2.TorchDistAddress(host=a["host"], port=a["port"]))
            elif a:
                raise ValueError(f"RemotePrefill.addresses has no wire form: {sorted(a)}")
        return msg.SerializeToString()

    @classmethod
    def from_proto_bytes(cls, data: bytes) -> RemotePrefill:
        """Decode `to_proto_bytes()`; SchemaVersionMismatch (a ValueError) for another schema
        version, ValueError for bytes that are not a RemotePrefill."""
        from google.protobuf.message import DecodeError  # noqa: PLC0415

        from pdserve_proto import check_version, pb2  # noqa: PLC0415

        msg = pb2.RemotePrefill()
        try:
            msg.ParseFromString(bytes(data))
        except DecodeError as e:
            raise ValueError(f"kv_transfer_params.pdserve_kv is not a RemotePrefill message: {e}") from None
        check_version("kv_transfer_params.pdserve_kv (RemotePrefill)", msg.schema_version)
        check_version("kv_transfer_params.pdserve_kv (KVHandshake)", msg.handshake.schema_version)
        addresses: list[dict[str, Any]] = []
        for rank in msg.ranks:
            which = rank.WhichOneof("kind")
            if which == "nixl":
                n = rank.nixl
                addresses.append({
                    "agent_metadata": n.agent_metadata, "kv_addrs": list(n.kv_addrs), "num_blocks": n.num_blocks,
                    "lease_addr": n.lease_addr, "num_lease_slots": n.num_lease_slots, "mem": n.mem,
                    "device_id": n.device_id})
            elif which == "torch_dist":
                addresses.append({"host": rank.torch_dist.host, "port": rank.torch_dist.port})
            else:
                addresses.append({})
        hs = msg.handshake
        if addresses and len(addresses) != hs.layout.tp_size:
            raise ValueError(f"kv_transfer_params.pdserve_kv carries {len(addresses)} rank addresses for a "
                             f"prefill engine of tensor_parallel_size {hs.layout.tp_size}")
        return cls(engine_id=msg.engine_id, request_id=msg.request_id, block_ids=list(msg.block_ids),
                   block_hashes=list(msg.block_hashes), num_tokens=msg.num_tokens, lease_slot=msg.lease_slot,
                   lease_token=msg.lease_token, lease_expires_at=msg.lease_expires_at,
                   layout=KVLayout.from_proto(hs.layout), addresses=addresses, connector=hs.connector,
                   connector_version=hs.connector_version, adapter=msg.adapter)

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> RemotePrefill:
        """Parse kv_transfer_params; ValueError naming the missing or malformed field. The protobuf
        form ("pdserve_kv", what a prefill engine returns) is authoritative when present; a
        hand-built dict without it is read from its readable keys."""
        if "pdserve_kv" in params:
            return cls.from_proto_bytes(params["pdserve_kv"])
        try:
            return cls(engine_id=str(params["remote_engine_id"]),
                       request_id=str(params["remote_request_id"]),
                       block_ids=[int(b) for b in params["remote_block_ids"]],
                       block_hashes=[bytes.fromhex(h) for h in params["remote_block_hashes"]],
                       num_tokens=int(params["remote_num_tokens"]),
                       lease_slot=int(params["lease_slot"]), lease_token=int(params["lease_token"]),
                       lease_expires_at=float(params["lease_expires_at"]),
                       layout=KVLayout(**params["layout"]),
                       addresses=[dict(a) for a in params["addresses"]],
                       adapter=str(params.get("remote_adapter", "")))
        except KeyError as e:
            raise ValueError(f"kv_transfer_params is missing {e.args[0]!r} (pass the parameters the "
                             f"prefill engine returned)") from None
        except (TypeError, ValueError) as e:
            raise ValueError(f"kv_transfer_params is malformed: {e}") from None


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
