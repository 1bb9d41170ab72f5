"""Wire form of a KV transfer's records (records/transfer.py, records/kv_layout.py): the
`RemotePrefill` a prefill engine returns and a decode engine parses, its `KVHandshake` and `KVLayout`,
and the kv_transfer_params dict of the engine API that carries them. Versioned like every
control-plane message: a reader refuses another schema version with SchemaVersionMismatch.
"""
from __future__ import annotations

from dataclasses import asdict
from typing import Any

from google.protobuf.message import DecodeError

from pdserve_proto import CONTROL_SCHEMA_VERSION, check_version, pb2
from records.kv_layout import KVLayout
from records.transfer import RemotePrefill


def layout_to_proto(layout: KVLayout) -> Any:
    return pb2.KVLayout(model=layout.model, num_layers=layout.num_layers, block_size=layout.block_size,
                        num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim, dtype=layout.dtype,
                        tp_rank=layout.tp_rank, tp_size=layout.tp_size, pp_rank=layout.pp_rank,
                        pp_size=layout.pp_size, layer_partition=list(layout.layer_partition),
                        num_groups=layout.num_groups)


def layout_from_proto(msg: Any) -> KVLayout:
    return KVLayout(model=msg.model, num_layers=msg.num_layers, block_size=msg.block_size,
                    num_kv_heads=msg.num_kv_heads, head_dim=msg.head_dim, dtype=msg.dtype,
                    tp_rank=msg.tp_rank, tp_size=msg.tp_size, pp_rank=msg.pp_rank, pp_size=msg.pp_size or 1,
                    layer_partition=tuple(msg.layer_partition), num_groups=msg.num_groups or 1)


def handshake(remote: RemotePrefill) -> Any:
    """The `KVHandshake` of a transfer: the prefill side's connector, its version and its layout."""
    return pb2.KVHandshake(schema_version=CONTROL_SCHEMA_VERSION, connector=remote.connector,
                           connector_version=remote.connector_version, layout=layout_to_proto(remote.layout))


def to_params(remote: RemotePrefill) -> dict[str, Any]:
    """The kv_transfer_params dict (engine API): the protobuf `RemotePrefill` (versioned, what D
    parses) under "pdserve_kv", beside a readable view of the same fields for logs and tests."""
    return {"do_remote_prefill": True, "pdserve_kv": encode_remote_prefill(remote),
            "remote_engine_id": remote.engine_id,
            "remote_request_id": remote.request_id, "remote_block_ids": list(remote.block_ids),
            "remote_block_hashes": [h.hex() for h in remote.block_hashes],
            "remote_num_tokens": remote.num_tokens, "lease_slot": remote.lease_slot,
            "lease_token": remote.lease_token, "lease_expires_at": remote.lease_expires_at,
            "layout": asdict(remote.layout), "addresses": remote.addresses, "remote_adapter": remote.adapter}


def from_params(params: dict[str, Any]) -> RemotePrefill:
    """Parse kv_transfer_params; ValueError naming the missing or malformed field. The protobuf
    form ("pdserve_kv", what a prefill engine returns) is authoritative when present; a
    hand-built dict without it is read from its readable keys."""
    if "pdserve_kv" in params:
        return decode_remote_prefill(params["pdserve_kv"])
    try:
        return RemotePrefill(engine_id=str(params["remote_engine_id"]),
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


def encode_remote_prefill(remote: RemotePrefill) -> bytes:
    """`remote` as RemotePrefill message bytes; ValueError for an address with no wire form."""
    msg = pb2.RemotePrefill(
        schema_version=CONTROL_SCHEMA_VERSION, handshake=handshake(remote), engine_id=remote.engine_id,
        request_id=remote.request_id, block_ids=remote.block_ids, block_hashes=remote.block_hashes,
        num_tokens=remote.num_tokens, lease_slot=remote.lease_slot, lease_token=remote.lease_token,
        lease_expires_at=remote.lease_expires_at, adapter=remote.adapter)
    for a in remote.addresses:
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


def decode_remote_prefill(data: bytes) -> RemotePrefill:
    """Decode `encode_remote_prefill()`; SchemaVersionMismatch (a ValueError) for another schema
    version, ValueError for bytes that are not a RemotePrefill."""
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
    world = hs.layout.tp_size * (hs.layout.pp_size or 1)
    if addresses and len(addresses) != world:
        raise ValueError(f"kv_transfer_params.pdserve_kv carries {len(addresses)} rank addresses for a "
                         f"prefill engine of tensor_parallel_size {hs.layout.tp_size} x pipeline_parallel_size "
                         f"{hs.layout.pp_size or 1}")
    return RemotePrefill(engine_id=msg.engine_id, request_id=msg.request_id, block_ids=list(msg.block_ids),
                         block_hashes=list(msg.block_hashes), num_tokens=msg.num_tokens,
                         lease_slot=msg.lease_slot, lease_token=msg.lease_token,
                         lease_expires_at=msg.lease_expires_at, layout=layout_from_proto(hs.layout),
                         addresses=addresses, connector=hs.connector, connector_version=hs.connector_version,
                         adapter=msg.adapter)
